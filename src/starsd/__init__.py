"""StarSD: one-for-many speculative decoding."""

__version__ = "0.1.0"
