"""The statistical check of losslessness shared by the tests that decode many times and count
(test_verify on a Markov target, test_remote_lossless through a live draft server): an empirical law
against the exact target law, vLLM-style."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


def expected_tv(target: np.ndarray, trials: int) -> float:
    """The TV distance an exact sampler's empirical law of `trials` draws keeps from `target` on
    average (normal approximation of each cell: E|emp - p| = sqrt(2 p (1 - p) / (pi n)))."""
    p = np.asarray(target, dtype=float).reshape(-1)
    p = p / p.sum()
    return 0.5 * float(np.sqrt(2 * p * (1 - p) / (math.pi * trials)).sum())


def gof_pvalue(counts: np.ndarray, expect: np.ndarray) -> float:
    """Chi-square goodness of fit over the cells of positive probability (zero-probability cells are
    checked separately); cells with expected count < 5 are pooled into one."""
    pos = expect > 0
    counts, e = counts[pos], expect[pos] * counts[pos].sum()
    big = e >= 5
    obs, exp = list(counts[big]), list(e[big])
    if (~big).any():
        obs.append(counts[~big].sum())
        exp.append(e[~big].sum())
    obs, exp = np.array(obs, dtype=float), np.array(exp, dtype=float)
    exp *= obs.sum() / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)


def assert_matches(name, counts, target, refs, max_tv, ratio=5.0, min_p=1e-4):
    """vLLM-style check: the empirical law is close to the target and several times closer to it
    than to any reference; it never hits a zero-probability outcome; and a chi-square test passes."""
    counts = counts.reshape(-1).astype(float)
    target = np.asarray(target, dtype=float).reshape(-1)
    target = target / target.sum()
    emp = counts / counts.sum()
    d = tv(emp, target)
    assert counts[target == 0].sum() == 0, f"{name}: emitted a token of target probability 0"
    assert d < max_tv, f"{name}: TV to target {d:.4f} >= {max_tv}"
    for rname, ref in refs.items():
        ref = np.asarray(ref, dtype=float).reshape(-1)
        ref = ref / ref.sum()
        assert tv(target, ref) > 0.1, f"setup: reference {rname} too close to the target"
        dr = tv(emp, ref)
        assert d * ratio < dr, f"{name}: TV to target {d:.4f} not {ratio}x below TV to {rname} {dr:.4f}"
    pv = gof_pvalue(counts, target)
    assert pv > min_p, f"{name}: chi-square p-value {pv:.2e}"
    return d
