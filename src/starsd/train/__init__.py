"""Training drafters offline: EAGLE heads on the target's own features, from local text."""
