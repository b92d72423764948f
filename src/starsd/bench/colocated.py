"""Co-located benchmark: target-only vs our speculative decoding vs HF transformers' assisted generation.

All three run side by side in one process on the same prompts, the order rotated per prompt so
that drift in machine speed hits every mode alike. Throughput is total new tokens / total seconds.
"""

from __future__ import annotations

import argparse
import time

import torch

from starsd import config as C
from starsd.results import Steps, bar_plot, summary, write_json
from starsd.models.pair import Pair
from starsd.prompts import load as load_prompts

MODES = ("target_only", "speculative", "hf_assisted")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval or chat")
    p.add_argument("--limit", type=int, default=16, help="number of prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt at most")
    p.add_argument("--json-out", default="results/colocated.json", help="results as JSON here")
    p.add_argument("--plot-out", default=None, help="PNG path (default: the JSON path with .png)")
    p.add_argument("--no-hf", action="store_true", help="skip HF assisted generation")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")
    p.set_defaults(threads=2)


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


def run(pair: Pair, prompts, max_new_tokens: int, draft: C.DraftConfig, with_hf: bool) -> dict:
    greedy = C.SamplingConfig()
    modes = [m for m in MODES if with_hf or m != "hf_assisted"]
    warm = prompts[0].encode(pair.tokenizer)  # first passes allocate and pick kernels: not measured
    rows = []
    with Steps("bench colocated", len(prompts) * len(modes)) as steps:
        steps.say("warm-up")
        pair.generate(prompts[0], 16, greedy, None)
        pair.generate(prompts[0], 16, greedy, draft)
        if with_hf:
            hf_assisted(pair, warm, 16, draft.depth)
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
                    gen = pair.generate(prompt, max_new_tokens, greedy, draft if mode == "speculative" else None)
                    row[mode] = {"tokens": len(gen.token_ids), "seconds": gen.seconds, "token_ids": gen.token_ids,
                                 "steps": gen.num_steps, "mean_accepted": gen.mean_accepted}
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
    return out


def main(args) -> int:
    cfg = C.from_args(C.PairConfig, args)
    draft = C.from_args(C.DraftConfig, args, prefix="draft-")
    pair = Pair.load(cfg.target_model(), cfg.draft_model(), cfg.cache, cfg.threads)
    prompts = load_prompts(args.prompts, args.limit)
    result = run(pair, prompts, args.max_new_tokens, draft, not args.no_hf)
    result = {
        "benchmark": "colocated", "target": args.target, "draft": args.draft, "dtype": cfg.target_model().dtype,
        "device": args.device, "threads": torch.get_num_threads(), "prompt_set": args.prompts,
        "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "draft_config": {"depth": draft.depth, "top_k": draft.top_k, "total_tokens": draft.max_nodes},
        **result,
    }
    write_json(args.json_out, result)
    labels = ["target-only", f"StarSD spec (d={draft.depth}, k={draft.top_k})"]
    values = [result["target_only_tokens_per_s"], result["spec_tokens_per_s"]]
    if "hf_assisted_tokens_per_s" in result:
        labels.append(f"HF assisted ({draft.depth} tokens)")
        values.append(result["hf_assisted_tokens_per_s"])
    png = args.plot_out or str(args.json_out).rsplit(".", 1)[0] + ".png"
    bar_plot(png, labels, values, ylabel="tokens / s",
             title=f"Co-located decoding, {len(prompts)} {args.prompts} prompts, {cfg.target_model().dtype}")
    speedups = [1.0, result["speedup"], result.get("hf_assisted_speedup")]
    summary(f"bench colocated: {len(prompts)} {args.prompts} prompts, {cfg.target_model().dtype}, "
            f"threads={result['threads']}", ["mode", "tokens/s", "speedup"],
            [[label, f"{v:.2f}", f"{x:.2f}x"] for label, v, x in zip(labels, values, speedups)],
            {"accepted per step": f"{result['mean_accepted']:.2f} (speculative)",
             "greedy outputs equal to target-only": f"{result['greedy_identical_prompts']} of {len(prompts)} prompts"},
            {"JSON": args.json_out, "plot": png})
    return 0
