"""StarSD as the drafter of an unmodified vLLM: `"model": "starsd.vllm.Proposer"` (proposer.py)."""

from starsd.vllm.proposer import Proposer

__all__ = ["Proposer"]
