"""A vLLM proposer of perfect drafts, for bench vllm's cost of a vLLM pass of k + 1 tokens: each row's
next k tokens of a known output ($STARSD_ORACLE: a JSON list of whole sequences, prompt and output, as
vLLM decodes them alone), so that every draft is accepted and each step scores k + 1 tokens."""

from __future__ import annotations

import json
import os

import numpy as np


class Oracle:
    def __init__(self, vllm_config):
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        with open(os.environ["STARSD_ORACLE"]) as f:
            self.sequences = [list(s) for s in json.load(f)]

    def load_model(self, *args, **kwargs) -> None:
        pass

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None, **_) -> list[list[int]]:
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            row = token_ids_cpu[i, :n].tolist() if len(sampled) else None
            known = next((s for s in self.sequences if row is not None and s[:n] == row), None)
            drafts.append(known[n:n + self.k] if known else [])
        return drafts
