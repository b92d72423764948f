"""One vLLM engine's run, in the vLLM environment (`make vllm`'s .venv-vllm): bench vllm and the
vLLM tests start it as a process of its own, `python -m starsd.bench.vllm_engine RUN.json`, since
vLLM and StarSD's own engines need different transformers releases (README, vLLM).

RUN.json: {"model", "dtype", "speculative" (vLLM's --speculative-config, or null), "prompts"
(token ids each), "max_tokens", "temperature", "seed" (each request's; null: none, so that copies of a
prompt sample apart, from the engine's generator seeded 0), "ignore_eos", "max_num_seqs", "logprobs",
"warm_up" (true, by default: a 2-token request before the timed run)}.
Prints one JSON line: each prompt's token ids (and with "logprobs" > 0 each step's top logprobs),
the seconds and tokens/s of the timed run, vLLM's own speculative counters.
"""

from __future__ import annotations

import json
import sys
import time


def counters(llm) -> dict[str, float]:
    """vLLM's speculative decoding counters (Prometheus names without the vllm: prefix)."""
    found = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num") and hasattr(metric, "value"):
            found[metric.name.removeprefix("vllm:")] = found.get(metric.name.removeprefix("vllm:"), 0) + metric.value
    return found


def main(path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    run = json.loads(open(path).read())
    seed = run.get("seed", 0)
    llm = LLM(model=run["model"], dtype=run["dtype"], max_model_len=run.get("max_model_len", 2048),
              speculative_config=run.get("speculative"), max_num_seqs=run.get("max_num_seqs", 4),
              seed=0 if seed is None else seed, disable_log_stats=False, enable_prefix_caching=False,
              enforce_eager=run.get("enforce_eager", False))
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in run["prompts"]]
    sampling = SamplingParams(temperature=run.get("temperature", 0.0), seed=seed,
                              max_tokens=run["max_tokens"], ignore_eos=run.get("ignore_eos", True),
                              logprobs=run.get("logprobs") or None)
    if run.get("warm_up", True):
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    before = counters(llm)
    started = time.perf_counter()
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    seconds = time.perf_counter() - started
    after = counters(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {"token_ids": tokens, "seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds,
              "spec": {k: v - before.get(k, 0) for k, v in after.items()}}
    if run.get("logprobs"):  # per step: [[token, logprob], ...] best first
        result["logprobs"] = [[sorted(([t, lp.logprob] for t, lp in step.items()), key=lambda x: -x[1])
                               for step in o.outputs[0].logprobs] for o in outs]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
