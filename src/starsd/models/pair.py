"""A target and its draft loaded side by side in one process (the co-located baseline)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from starsd.config import DraftConfig, ModelConfig, PairConfig, SamplingConfig
from starsd.models.drafter import Drafter
from starsd.errors import StarsdError
from starsd.models.llamacpp import LlamaCppTarget
from starsd.models.loading import (check_pair, eos_ids, generation_config, load_eagle, load_model, load_tokenizer,
                                   logits_width)
from starsd.models.target import TargetModel
from starsd.prompts import Prompt
from starsd.spec_decode.decode import Generation, speculative, target_only, warm_up
from starsd.spec_decode.depth import DepthPolicy


@dataclass
class Pair:
    target: TargetModel | LlamaCppTarget
    drafter: Drafter | None
    tokenizer: object
    eos_ids: frozenset[int]
    policies: dict = field(default_factory=dict, repr=False)  # (id of a drafter, DraftConfig) -> (drafter, its policy)

    @classmethod
    def load(cls, target_cfg: ModelConfig, draft_cfg: ModelConfig | None, cache: str | None = None,
             threads: int = 0, eagle: ModelConfig | None = None) -> "Pair":
        """Load the target (and the draft, unless None, or the EAGLE head `eagle` instead); refuse a
        draft with another vocabulary."""
        if threads:
            torch.set_num_threads(threads)
        tokenizer = load_tokenizer(target_cfg.path, cache)
        if target_cfg.engine == "llamacpp":
            if eagle is not None:
                raise StarsdError("EAGLE heads draft from the target's hidden states: use --target-engine transformers")
            target = LlamaCppTarget.load(target_cfg, cache, threads)
            generation = generation_config(target_cfg.path, cache)
        else:
            model = load_model(target_cfg, cache)
            target, generation = TargetModel(model, streams=target_cfg.streams), model.generation_config
        drafter = None
        if eagle is not None:
            drafter = Drafter(load_eagle(eagle, target_cfg, cache, target.model))
        elif draft_cfg is not None:
            draft_tok = load_tokenizer(draft_cfg.path, cache)
            draft = load_model(draft_cfg, cache)
            check_pair(tokenizer, target.width, draft_tok, logits_width(draft))
            drafter = Drafter(draft)
        return cls(target, drafter, tokenizer, eos_ids(generation, tokenizer))

    def generate(self, prompt: Prompt, max_new_tokens: int, sampling: SamplingConfig,
                 draft: DraftConfig | None, drafter=None) -> Generation:
        """Target-only decoding (draft None), or speculative with the pair's drafter or `drafter`."""
        ids = prompt.encode(self.tokenizer)
        if draft is None:
            return target_only(self.target, ids, max_new_tokens, sampling, self.eos_ids)
        drafter = drafter or self.drafter
        if drafter is None:
            raise ValueError("speculative decoding needs a draft model")
        return speculative(self.target, drafter, ids, max_new_tokens, draft, sampling, self.eos_ids,
                           policy=self.policy(drafter, draft))

    def policy(self, drafter, draft: DraftConfig) -> DepthPolicy | None:
        """The depth policy of every generation with `drafter` at `draft` (None: a fixed depth): one for
        the pair, as a target process keeps one for all its prompts (star/worker.py), so that what it
        has learnt of the target's and the drafter's costs and of how often drafts are accepted carries
        over. A fresh policy per prompt starts every answer from its priors, and answers are short:
        `bench colocated` (6 HumanEval prompts, an AMX Xeon) went from 0.98x to 1.02x HF assisted
        generation with one policy carried over them (docs/benchmarks.md)."""
        if not draft.adaptive:
            return None
        key = (id(drafter), draft)
        if not self.policies:  # the first policy's first measured pass must not be the engine's first touch
            warm_up(self.target)
        if key not in self.policies:  # the drafter is kept with it: its id is not reused while the key lives
            self.policies[key] = (drafter, DepthPolicy(draft.depth))
        return self.policies[key][1]


def load_drafter(cfg: PairConfig) -> tuple[Drafter, object]:
    """A draft server's drafter and the tokenizer whose ids it drafts: the EAGLE head, when the
    config names one (with the target's tokenizer), else the draft model."""
    if cfg.eagle:
        head = load_eagle(cfg.eagle_model(), cfg.target_model(), cfg.cache)
        return Drafter(head), load_tokenizer(cfg.target, cfg.cache)
    draft = cfg.draft_model()
    return Drafter(load_model(draft, cfg.cache)), load_tokenizer(draft.path, cfg.cache)
