"""What a sampled draft's q costs on the wire and in acceptance: its support (spec_decode/sparse_q.py) against
the whole warped distribution that sampled drafts used to carry.

Along real text (the target's own answers to prompts, teacher-forced) every position has a target
distribution p and a draft distribution q, both warped by the sampling settings. A token drawn
from q is accepted with probability sum_x min(p(x), q(x)): the expected acceptance per drafted
token, computed exactly rather than sampled. It is computed for the full q and for its truncation
with the draft's settings (`--draft-sample-top-k`, `--draft-sample-top-p`), along with the bytes a
node of each takes on the wire (full: 4 V bytes; support: 6 bytes a kept token). Beside them, the
default draft, which proposes its argmax x (q one-hot, nothing on the wire): accepted with
probability p(x).
"""

from __future__ import annotations

import argparse

import torch

from starsd import config as C
from starsd.models.pair import Pair
from starsd.prompts import load as load_prompts
from starsd.results import Steps, bar_panels, summary, write_json
from starsd.spec_decode.decode import target_only
from starsd.spec_decode.sparse_q import SparseQ
from starsd.spec_decode.tree import DraftTree
from starsd.spec_decode.verify import warp


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="chat", help="prompt set: humaneval or chat")
    p.add_argument("--limit", type=int, default=6, help="number of prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens of each answer")
    p.add_argument("--temperatures", default="0.7,1.0", help="sampling temperatures, comma-separated")
    p.add_argument("--json-out", default="results/sampled-q.json", help="results as JSON here, the plot beside it")
    C.add_flags(p, C.PairConfig)
    C.add_flags(p, C.DraftConfig, prefix="draft-")


def main(args) -> int:
    cfg = C.from_args(C.PairConfig, args)
    draft = C.from_args(C.DraftConfig, args, prefix="draft-")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    pair = Pair.load(cfg.target_model(), cfg.draft_model(), cfg.cache, cfg.threads)
    prompts = load_prompts(args.prompts, args.limit)
    full = {t: [] for t in temperatures}
    kept = {t: [] for t in temperatures}
    argmax = {t: [] for t in temperatures}
    width = []
    with Steps("bench sampled-q", len(prompts)) as steps:
        for prompt in prompts:
            steps.begin(prompt.id)
            ids = prompt.encode(pair.tokenizer)
            answer = target_only(pair.target, ids, args.max_new_tokens, C.SamplingConfig(), pair.eos_ids).token_ids
            seq = pair.target.start(ids)
            p_logits = pair.target.score(seq, DraftTree.chain(answer[:-1]))  # after the prompt and each answer token
            with torch.inference_mode():
                q_logits = pair.drafter.model(torch.tensor([ids + answer[:-1]])).logits[0, len(ids) - 1:]
            for t in temperatures:
                s = C.SamplingConfig(temperature=t)
                p, q = warp(p_logits, s), warp(q_logits.float(), s)
                sparse = SparseQ.truncate(q, draft.sample_top_k, draft.sample_top_p)
                full[t] += torch.minimum(p, q).sum(-1).tolist()
                kept[t] += torch.minimum(p, sparse.dense(p.shape[-1])).sum(-1).tolist()
                argmax[t] += p.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1).tolist()
                width += (sparse.weights > 0).sum(-1).tolist()
            steps.end(f"{prompt.id}: {len(answer)} positions")
    vocab = pair.target.width
    points = [{"temperature": t, "positions": len(full[t]), "acceptance_full_q": sum(full[t]) / len(full[t]),
               "acceptance_support": sum(kept[t]) / len(kept[t]),
               "acceptance_argmax_draft": sum(argmax[t]) / len(argmax[t])} for t in temperatures]
    for point in points:
        point["relative"] = point["acceptance_support"] / point["acceptance_full_q"]
    bytes_support = 6 * sum(width) / len(width)
    result = {"benchmark": "sampled-q", "target": cfg.target, "draft": cfg.draft, "engine": cfg.target_engine,
              "sample_top_k": draft.sample_top_k, "sample_top_p": draft.sample_top_p, "vocab": vocab,
              "bytes_per_node_full_q": 4 * vocab, "bytes_per_node_support_mean": bytes_support,
              "bytes_per_node_support_max": 6 * draft.sample_top_k, "points": points}
    write_json(args.json_out, result)
    png = str(args.json_out).rsplit(".", 1)[0] + ".png"
    bar_panels(png, [{"labels": ["full q", "support", "argmax draft"],
                      "values": [round(p[k], 4) for k in ("acceptance_full_q", "acceptance_support",
                                                          "acceptance_argmax_draft")],
                      "ylabel": "expected acceptance per drafted token", "title": f"temperature {p['temperature']}"}
                     for p in points])
    summary(f"bench sampled-q: {len(prompts)} {args.prompts} prompts, {args.max_new_tokens}-token answers; q's "
            f"support: top {draft.sample_top_k}, top-p {draft.sample_top_p}",
            ["temperature", "positions", "acceptance, full q", "acceptance, support", "support / full",
             "acceptance, argmax draft"],
            [[p["temperature"], p["positions"], f"{p['acceptance_full_q']:.4f}", f"{p['acceptance_support']:.4f}",
              f"{p['relative']:.4f}", f"{p['acceptance_argmax_draft']:.4f}"] for p in points],
            facts={"bytes a node": f"{4 * vocab:,} (full q) -> {bytes_support:.0f} mean, {6 * draft.sample_top_k} at most"},
            files={"JSON": args.json_out, "plot": png})
    return 0
