"""A target worker: holds the target model, drafts through a draft server, verifies locally.

One generation stream at a time (as in the paper): for each prompt, the draft -> verify -> accept
loop of generate.speculative with a RemoteDrafter. Prints one JSON object per prompt with --json.
"""

from __future__ import annotations

import json
import sys
import time

from starsd.colocated import Pair
from starsd.config import DraftConfig, ModelConfig, SamplingConfig
from starsd.draft_client import DraftClient, RemoteDrafter
from starsd.generate import speculative, target_only
from starsd.models.loading import logits_width, vocab_fingerprint
from starsd.prompts import Prompt


def run(connect: str, target_cfg: ModelConfig, prompts: list[Prompt], max_new_tokens: int,
        sampling: SamplingConfig, draft: DraftConfig, name: str, as_json: bool, no_spec: bool = False,
        cache: str | None = None, threads: int = 0, wait_go: bool = False, timeout_s: float = 60.0) -> int:
    pair = Pair.load(target_cfg, None, cache, threads)
    fingerprint = vocab_fingerprint(pair.tokenizer, logits_width(pair.target.model))
    client = DraftClient(connect, fingerprint, name, timeout_s)
    try:
        if not no_spec:
            client.hello()
        if wait_go:  # a launcher starts every target's decoding at the same moment
            print(json.dumps({"ready": name}), flush=True)
            sys.stdin.readline()
        drafter = RemoteDrafter(client)
        for prompt in prompts:
            ids = prompt.encode(pair.tokenizer)
            drafter.timing = type(drafter.timing)()
            started = time.time()
            if no_spec:
                gen = target_only(pair.target, ids, max_new_tokens, sampling, pair.eos_ids)
            else:
                gen = speculative(pair.target, drafter, ids, max_new_tokens, draft, sampling, pair.eos_ids)
            text = pair.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            if as_json:
                print(json.dumps({
                    "target": name, "prompt_id": prompt.id, "prompt": prompt.text, "token_ids": gen.token_ids,
                    "text": text, "num_steps": gen.num_steps, "mean_accepted": gen.mean_accepted,
                    "seconds": gen.seconds, "tokens_per_s": gen.tokens_per_s, "started": started,
                    "finished": time.time(), "draft": drafter.timing.summary(),
                }), flush=True)
            else:
                print(f"[{name}] {prompt.id}: {len(gen.token_ids)} tokens, {gen.tokens_per_s:.2f} tok/s, "
                      f"{gen.mean_accepted:.2f} accepted/step\n{text}\n", flush=True)
    finally:
        client.close()
    return 0
