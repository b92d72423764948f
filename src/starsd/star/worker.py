"""A target worker: holds the target model, drafts through a draft server, verifies locally.

One generation stream at a time (as in the paper): for each prompt, the draft -> verify -> accept
loop of spec.decode.speculative with a RemoteDrafter. Prints one JSON object per prompt with --json.
"""

from __future__ import annotations

import json
import sys
import time

from starsd.config import ClientKeys, DraftConfig, PairConfig, SamplingConfig
from starsd.models.loading import vocab_fingerprint
from starsd.models.pair import Pair
from starsd.prompts import Prompt
from starsd.spec_decode.decode import measure_verify, speculative, target_only
from starsd.spec_decode.depth import DepthPolicy
from starsd.star.client import DraftClient
from starsd.star.remote_drafter import RemoteDrafter, Timing


def run(connect: str, pair_cfg: PairConfig, prompts: list[Prompt], max_new_tokens: int, sampling: SamplingConfig,
        draft: DraftConfig, *, name: str = "target", as_json: bool = False, no_spec: bool = False,
        ignore_eos: bool = False, wait_go: bool = False, timeout_s: float = 60.0,
        keys: ClientKeys = ClientKeys()) -> int:
    """Decode `prompts` one after another. ignore_eos: always decode max_new_tokens (load tests).
    wait_go: after the handshake, print a ready line and wait for a line on stdin (a launcher
    starts every target's decoding at the same moment)."""
    pair = Pair.load(pair_cfg.target_model(), None, pair_cfg.cache, pair_cfg.threads)
    eos = frozenset() if ignore_eos else pair.eos_ids
    client = DraftClient(connect, vocab_fingerprint(pair.tokenizer, pair.target.width), name, timeout_s,
                         keys=keys)
    try:
        policy = DepthPolicy(draft.depth)  # one for the whole run: what it learns carries over the prompts
        if not no_spec:
            client.try_hello(timeout_s if wait_go else 5.0)  # a launcher's synchronised start (a benchmark)
            # waits for the session: its targets start drafting at the same moment
            if draft.adaptive:
                measure_verify(pair.target, policy)
        if wait_go:
            print(json.dumps({"ready": name}), flush=True)
            sys.stdin.readline()
        drafter = RemoteDrafter(client)
        for prompt in prompts:
            ids = prompt.encode(pair.tokenizer)
            drafter.timing = Timing()
            started = time.time()
            if no_spec:
                gen = target_only(pair.target, ids, max_new_tokens, sampling, eos)
            else:
                gen = speculative(pair.target, drafter, ids, max_new_tokens, draft, sampling, eos, policy=policy)
            text = pair.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            if as_json:
                print(json.dumps({
                    "target": name, "prompt_id": prompt.id, "prompt": prompt.text, "token_ids": gen.token_ids,
                    "text": text, "num_steps": gen.num_steps, "drafted_steps": sum(d > 0 for d in gen.depths), "asked": gen.asked,
                    "depths": gen.depths, "vocab": pair.target.width,
                    "mean_accepted": gen.mean_accepted,
                    "seconds": gen.seconds, "tokens_per_s": gen.tokens_per_s, "started": started,
                    "finished": time.time(), "draft": drafter.timing.summary(),
                }), flush=True)
            else:
                print(f"[{name}] {prompt.id}: {len(gen.token_ids)} tokens, {gen.tokens_per_s:.2f} tok/s, "
                      f"{gen.mean_accepted:.2f} accepted/step\n{text}\n", flush=True)
    finally:
        client.close()
    return 0
