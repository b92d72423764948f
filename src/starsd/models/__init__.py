"""Model backends on transformers: the target scorer and the drafters."""
