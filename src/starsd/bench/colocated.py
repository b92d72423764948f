"""Co-located benchmark: target-only vs our speculative decoding vs HF transformers' assisted generation,
and with --eagle, drafting with an EAGLE head from the target's features (16- and 8-bit features).

All run side by side in one process on the same prompts, the order rotated per prompt so that
drift in machine speed hits every mode alike. Throughput is total new tokens / total seconds.
The EAGLE modes also count the bytes a target would send its draft server per iteration: each
committed token's id and feature, as protocol.features_to_wire encodes it (the 8-bit mode drafts
from features that went through that encoding and back).
"""

from __future__ import annotations

import argparse
import time

import torch

from starsd import config as C
from starsd.results import Steps, bar_plot, summary, write_json
from starsd.models.drafter import Drafter
from starsd.spec_decode.drafting import LocalDrafting
from starsd.models.loading import load_eagle
from starsd.models.pair import Pair
from starsd.star import protocol as P
from starsd.prompts import load as load_prompts

MODES = ("target_only", "speculative", "eagle", "eagle8", "hf_assisted")
EAGLE_MODES = {"eagle": 16, "eagle8": 8}  # mode -> feature bits


class WireFeatures(LocalDrafting):
    """A drafter fed the target's features as they would arrive over the wire at `bits` bits; counts
    the request bytes (token ids and feature frames) per draft."""

    def __init__(self, drafter: Drafter, bits: int):
        self.drafter = drafter
        self.bits = bits
        self.device = drafter.device
        self.taps = drafter.taps
        self.bytes: list[int] = []

    def start(self, *args):
        return self.drafter.start(*args)

    def propose(self, seq, new_tokens, cfg, sampling, generator=None, max_depth=1 << 30, deadline_ms=None,
                features=None):
        frames = P.features_to_wire(features, self.bits)
        self.bytes.append(4 * max(len(new_tokens), len(features)) + sum(f.numel() * f.element_size() for f in frames))
        return self.drafter.propose(seq, new_tokens, cfg, sampling, generator, max_depth, deadline_ms,
                                    P.features_from_wire(frames))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval or chat")
    p.add_argument("--limit", type=int, default=16, help="number of prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt at most")
    p.add_argument("--json-out", default="results/colocated.json", help="results as JSON here")
    p.add_argument("--plot-out", default=None, help="PNG path (default: the JSON path with .png)")
    p.add_argument("--no-hf", action="store_true", help="skip HF assisted generation")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")
    p.set_defaults(threads=2, target_engine="transformers")  # the figures in docs/ were measured so


def hf_assisted(pair: Pair, ids: list[int], max_new_tokens: int, num_assistant_tokens: int) -> tuple[list[int], float]:
    """HF assisted generation, greedy. num_assistant_tokens goes on the draft's generation config:
    passed to generate() it is silently ignored (transformers 5.24)."""
    target, draft = pair.target.model, pair.drafter.model
    draft.generation_config.num_assistant_tokens = num_assistant_tokens
    x = torch.tensor([ids], device=pair.target.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=draft, do_sample=False,
                              max_new_tokens=max_new_tokens, eos_token_id=sorted(pair.eos_ids),
                              pad_token_id=pair.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def run(pair: Pair, prompts, max_new_tokens: int, draft: C.DraftConfig, with_hf: bool,
        head: Drafter | None = None) -> dict:
    greedy = C.SamplingConfig()
    modes = [m for m in MODES if (with_hf or m != "hf_assisted") and (head or m not in EAGLE_MODES)]
    wired = {m: WireFeatures(head, bits) for m, bits in EAGLE_MODES.items() if head}
    warm = prompts[0].encode(pair.tokenizer)  # first passes allocate and pick kernels: not measured
    rows = []
    with Steps("bench colocated", len(prompts) * len(modes)) as steps:
        steps.say("warm-up")
        pair.generate(prompts[0], 16, greedy, None)
        pair.generate(prompts[0], 16, greedy, draft)
        if with_hf:
            hf_assisted(pair, warm, 16, draft.depth)
        for w in wired.values():
            pair.generate(prompts[0], 16, greedy, draft, w)
            w.bytes.clear()
        for i, prompt in enumerate(prompts):
            ids = prompt.encode(pair.tokenizer)
            order = modes[i % len(modes):] + modes[: i % len(modes)]
            row = {"id": prompt.id, "prompt_tokens": len(ids), "order": order}
            for mode in order:
                steps.begin(f"{mode}, prompt {i + 1}/{len(prompts)} ({prompt.id})")
                if mode == "hf_assisted":
                    tokens, seconds = hf_assisted(pair, ids, max_new_tokens, draft.depth)
                    row[mode] = {"tokens": len(tokens), "seconds": seconds, "token_ids": tokens}
                else:
                    gen = pair.generate(prompt, max_new_tokens, greedy, None if mode == "target_only" else draft,
                                        wired.get(mode))
                    row[mode] = {"tokens": len(gen.token_ids), "seconds": gen.seconds, "token_ids": gen.token_ids,
                                 "steps": gen.num_steps, "mean_accepted": gen.mean_accepted}
                    if mode in wired:
                        row[mode]["request_bytes"] = list(wired[mode].bytes)
                        wired[mode].bytes.clear()
                steps.end()
            rows.append(row)
            rates = "  ".join(f"{m} {row[m]['tokens'] / row[m]['seconds']:.2f} tok/s" for m in modes)
            steps.line(f"[{i + 1}/{len(prompts)}] {prompt.id}: {rates}")
    return summarize(rows, modes)


def summarize(rows: list[dict], modes: list[str]) -> dict:
    rate = {m: sum(r[m]["tokens"] for r in rows) / sum(r[m]["seconds"] for r in rows) for m in modes}
    steps = sum(r["speculative"]["steps"] for r in rows)
    accepted = sum(r["speculative"]["mean_accepted"] * r["speculative"]["steps"] for r in rows)
    same = sum(r["speculative"]["token_ids"] == r["target_only"]["token_ids"] for r in rows)
    out = {
        "target_only_tokens_per_s": rate["target_only"],
        "spec_tokens_per_s": rate["speculative"],
        "speedup": rate["speculative"] / rate["target_only"],
        "mean_accepted": accepted / steps if steps else 0.0,
        "greedy_identical_prompts": same,
        "prompts": rows,
    }
    if "hf_assisted" in modes:
        out["hf_assisted_tokens_per_s"] = rate["hf_assisted"]
        out["hf_assisted_speedup"] = rate["hf_assisted"] / rate["target_only"]
    for m in EAGLE_MODES:
        if m in modes:
            sent = [b for r in rows for b in r[m]["request_bytes"][1:]]  # after each stream's first (the prompt)
            out[m] = {"tokens_per_s": rate[m], "speedup": rate[m] / rate["target_only"],
                      "mean_accepted": _mean_accepted(rows, m), "bytes_per_iteration": sum(sent) / max(1, len(sent)),
                      "greedy_identical_prompts": sum(r[m]["token_ids"] == r["target_only"]["token_ids"] for r in rows)}
    return out


def _mean_accepted(rows: list[dict], mode: str) -> float:
    steps = sum(r[mode]["steps"] for r in rows)
    return sum(r[mode]["mean_accepted"] * r[mode]["steps"] for r in rows) / steps if steps else 0.0


def main(args) -> int:
    cfg = C.from_args(C.PairConfig, args)
    draft = C.from_args(C.DraftConfig, args, prefix="draft-")
    pair = Pair.load(cfg.target_model(), cfg.draft_model(), cfg.cache, cfg.threads)
    head = Drafter(load_eagle(cfg.eagle_model(), cfg.target_model(), cfg.cache, pair.target.model)) if cfg.eagle else None
    prompts = load_prompts(args.prompts, args.limit)
    result = run(pair, prompts, args.max_new_tokens, draft, not args.no_hf, head)
    result = {
        "benchmark": "colocated", "target": args.target, "draft": args.draft, "dtype": cfg.target_model().dtype,
        "eagle_head": cfg.eagle or None, "device": args.device, "threads": torch.get_num_threads(), "prompt_set": args.prompts,
        "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "draft_config": {"depth": draft.depth, "top_k": draft.top_k, "total_tokens": draft.max_nodes},
        **result,
    }
    write_json(args.json_out, result)
    labels = ["target-only", f"StarSD spec (d={draft.depth}, k={draft.top_k})"]
    values = [result["target_only_tokens_per_s"], result["spec_tokens_per_s"]]
    extra = {}
    for m, bits in EAGLE_MODES.items():
        if m in result:
            labels.append(f"EAGLE head, {bits}-bit features")
            values.append(result[m]["tokens_per_s"])
            extra[f"EAGLE {bits}-bit"] = (f"{result[m]['mean_accepted']:.2f} accepted per step, "
                                          f"{result[m]['bytes_per_iteration']:.0f} B per request, "
                                          f"{result[m]['greedy_identical_prompts']} of {len(prompts)} equal to target-only")
    if "hf_assisted_tokens_per_s" in result:
        labels.append(f"HF assisted ({draft.depth} tokens)")
        values.append(result["hf_assisted_tokens_per_s"])
    png = args.plot_out or str(args.json_out).rsplit(".", 1)[0] + ".png"
    bar_plot(png, labels, values, ylabel="tokens / s",
             title=f"Co-located decoding, {len(prompts)} {args.prompts} prompts, {cfg.target_model().dtype}")
    speedups = [v / values[0] for v in values]
    summary(f"bench colocated: {len(prompts)} {args.prompts} prompts, {cfg.target_model().dtype}, "
            f"threads={result['threads']}", ["mode", "tokens/s", "speedup"],
            [[label, f"{v:.2f}", f"{x:.2f}x"] for label, v, x in zip(labels, values, speedups)],
            {"accepted per step": f"{result['mean_accepted']:.2f} (speculative)",
             "greedy outputs equal to target-only": f"{result['greedy_identical_prompts']} of {len(prompts)} prompts",
             **extra},
            {"JSON": args.json_out, "plot": png})
    return 0
