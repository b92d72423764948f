"""Unit tests for starsd.theory.simulate: the discrete-event star against closed forms and sysmodel."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time

import pytest

from starsd.theory import sysmodel
from starsd.theory.simulate import SimResult, _cut_batch, _Window, add_args, compare, main, servers_needed, simulate
from starsd.theory.sysmodel import Profile

# Serial: S(1) = 10 ms, R = 40 ms, so a lone target iterates every 50 ms and N_full = 5.
SERIAL = Profile(service_ms={1: 10.0}, return_ms=40.0, tokens_per_iteration=2.0)

# Batched: S(b) = 10 + b ms up to b = 32, R = 50 ms; capacity 32/42 iterations/ms, N_full ~ 46.5.
LINEAR_S = {b: 10.0 + b for b in (1, 2, 4, 8, 16, 32)}
RETURN_SPREAD = tuple(25.0 + 50.0 * i / 199 for i in range(200))  # uniform on [25, 75], mean 50
BATCHED = {
    "constant R": Profile(service_ms=LINEAR_S, return_ms=50.0, tokens_per_iteration=3.0, max_batch=32),
    "spread R": Profile(service_ms=LINEAR_S, return_ms=50.0, tokens_per_iteration=3.0, max_batch=32,
                        return_samples_ms=RETURN_SPREAD),
}
SPREAD = BATCHED["spread R"]


def rel(a: float, b: float) -> float:
    return abs(a - b) / b


# ---------------------------------------------------------------------------------------------
# Serial draft server: the closed form X = min(N / (S + R), 1 / S)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 10, 20])
def test_serial_matches_closed_form(n):
    s, r = SERIAL.service(1), SERIAL.return_ms
    result = simulate(SERIAL, n, serial=True)
    x = min(n / (s + r), 1 / s) * 1e3  # iterations/s
    assert rel(result.system_tokens_per_s, x * SERIAL.tokens_per_iteration) < 0.02
    assert rel(result.t_gamma_ms, 1e3 * n / x) < 0.02
    if n >= sysmodel.n_full(SERIAL, serial=True):
        assert result.utilization >= 0.99
    else:
        assert rel(result.utilization, n * s / (s + r)) < 0.02
    assert result.mean_batch == 1


# ---------------------------------------------------------------------------------------------
# Batched draft server, S(b) = a + c * b
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(BATCHED))
def test_batched_stays_within_the_bounds(name):
    p = BATCHED[name]
    capacity = sysmodel.capacity(p, serial=False)[0]
    slack = 1e-9 if name == "constant R" else 0.03  # sampled R: a window's mean R is not exactly 50
    for n in (1, 2, 4, 8, 16, 32, 47, 64, 93, 140, 300):
        x = simulate(p, n).system_tokens_per_s / p.tokens_per_iteration
        assert x <= capacity * (1 + slack), n
        assert x <= 1e3 * n / (p.return_ms + p.service(1)) * (1 + slack), n


def test_batched_throughput_grows_with_n():
    xs = [simulate(SPREAD, n).system_tokens_per_s for n in (1, 2, 4, 8, 16, 32, 47, 64, 93, 140, 300)]
    assert all(b >= a * 0.99 for a, b in zip(xs, xs[1:])), xs
    assert xs[6] > 10 * xs[0]  # ~linear growth up to N_full


def test_batched_is_fully_loaded_past_n_full():
    n_full = sysmodel.n_full(SPREAD, serial=False)
    for n in (math.ceil(n_full), round(2 * n_full), round(3 * n_full)):
        assert simulate(SPREAD, n).utilization >= 0.9, n


@pytest.mark.parametrize("name", list(BATCHED))
@pytest.mark.parametrize("load", [0.0, 1.0, 3.0])  # N = 1, N_full, 3 x N_full
def test_batched_agrees_with_sysmodel(name, load):
    p = BATCHED[name]
    n = max(1, round(load * sysmodel.n_full(p, serial=False)))
    simulated = simulate(p, n).system_tokens_per_s
    predicted = sysmodel.predict(p, n).system_tokens_per_s
    assert rel(simulated, predicted) < 0.15, (n, simulated, predicted)


def test_constant_return_time_keeps_targets_in_lock_step():
    # All targets start at t = 0; with a constant R nothing ever separates them, so N <= max_batch
    # targets are drafted as one batch and the draft server idles for R: X = N / (S(N) + R), below
    # the model's linear bound N / (S(1) + R). Any spread in R breaks the lock step.
    p, n = BATCHED["constant R"], 16
    result = simulate(p, n)
    assert result.mean_batch == n
    assert rel(result.system_tokens_per_s, 1e3 * n / (p.service(n) + p.return_ms) * p.tokens_per_iteration) < 1e-6
    assert simulate(SPREAD, n).mean_batch < n / 2


# ---------------------------------------------------------------------------------------------
# Several draft servers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("serial", [False, True])
@pytest.mark.parametrize("k", [2, 4])
def test_k_servers_carry_k_times_the_load(k, serial):
    n = 20
    one = simulate(SPREAD, n, 1, serial).system_tokens_per_s
    many = simulate(SPREAD, k * n, k, serial)
    assert rel(many.system_tokens_per_s, k * one) < 0.05
    assert len(many.server_utilizations) == k


def test_uneven_round_robin_judges_the_worst_off_server():
    result = simulate(SERIAL, 13, servers=2, serial=True)  # 7 targets on one server, 6 on the other
    assert result.min_per_target_tokens_per_s < result.per_target_tokens_per_s
    assert rel(result.min_per_target_tokens_per_s, 1e3 / (7 * 10.0) * SERIAL.tokens_per_iteration) < 0.02


def test_servers_needed_matches_the_closed_form_on_a_serial_server():
    # per-target X = min(1 / (S + R), 1 / (N S)) >= 0.9 / (S + R) holds up to N = 5 per server.
    for m in (1, 4, 5, 6, 11, 50):
        assert servers_needed(SERIAL, m, quality=0.9, serial=True) == math.ceil(m / 5), m


def test_servers_needed_is_monotone_and_minimal():
    alone = simulate(SPREAD, 1).per_target_tokens_per_s
    answers = []
    for m in (1, 10, 50, 100, 200):
        k = servers_needed(SPREAD, m, quality=0.9)
        answers.append(k)
        assert simulate(SPREAD, m, k).min_per_target_tokens_per_s >= 0.9 * alone
        if k > 1:
            assert simulate(SPREAD, m, k - 1).min_per_target_tokens_per_s < 0.9 * alone
    assert answers[0] == 1
    assert answers == sorted(answers)


def test_servers_needed_rejects_bad_input():
    with pytest.raises(ValueError):
        servers_needed(SPREAD, 0)
    with pytest.raises(ValueError):
        servers_needed(SPREAD, 10, quality=1.5)
    with pytest.raises(ValueError, match="max_servers"):
        servers_needed(SERIAL, 100, serial=True, max_servers=4)


# ---------------------------------------------------------------------------------------------
# Reproducibility, speed, horizon, latency
# ---------------------------------------------------------------------------------------------

def test_seeded_runs_are_reproducible():
    assert simulate(SPREAD, 30, 2, seed=3) == simulate(SPREAD, 30, 2, seed=3)
    assert simulate(SPREAD, 30, 2, seed=3) != simulate(SPREAD, 30, 2, seed=4)


def test_a_thousand_targets_run_fast():
    t0 = time.perf_counter()
    result = simulate(SPREAD, 1000, servers=4)
    assert time.perf_counter() - t0 < 5.0
    assert result.utilization > 0.99
    assert result.iterations > 1000 * 30  # ~40 iterations per target in the window


def test_explicit_horizon_is_used():
    result = simulate(SERIAL, 3, serial=True, duration_s=2.0, warmup_s=0.5)
    assert result.window_ms == 2000.0 and result.warmup_ms == 500.0
    assert rel(result.system_tokens_per_s, 3 / 50e-3 * SERIAL.tokens_per_iteration) < 0.02


@pytest.mark.parametrize("kwargs", [{"n": 0}, {"n": 2, "servers": 0}, {"n": 2, "duration_s": 0.0},
                                    {"n": 2, "warmup_s": -1.0}])
def test_simulate_rejects_bad_input(kwargs):
    with pytest.raises(ValueError):
        simulate(SERIAL, **kwargs)


def test_latency_is_constant_for_a_lone_target_with_constant_times():
    result = simulate(SERIAL, 1, serial=True)
    assert result.latency_cv == pytest.approx(0.0, abs=1e-12)
    assert result.latency_mean_ms == pytest.approx(50.0 / 2.0)
    assert result.latency_p50_ms == result.latency_p99_ms == pytest.approx(25.0)


def test_latency_spreads_with_sampled_return_and_tokens():
    assert simulate(SPREAD, 1).latency_cv > 0.05
    tokens = Profile(service_ms={1: 10.0}, return_ms=40.0, tokens_per_iteration=2.5, tokens_samples=(1, 2, 3, 4))
    result = simulate(tokens, 1, serial=True)
    assert result.latency_cv > 0.1
    assert result.latency_p99_ms > result.latency_p50_ms


# ---------------------------------------------------------------------------------------------
# Batches cut short, as the server cuts them (the profile's levels_samples)
# ---------------------------------------------------------------------------------------------

DEEP = Profile(service_ms={1: 100.0, 2: 110.0, 8: 150.0}, return_ms=40.0, tokens_per_iteration=11.0,
               tokens_samples=(11,), levels_samples=(10,))  # ten levels a draft, all accepted: 10 ms a level


def test_a_request_from_outside_cuts_a_batch_at_the_next_level():
    for came, levels in ((25.0, 3), (30.0, 3), (-5.0, 1), (500.0, 10)):  # the first level always runs
        q_in, window = [(came, 1)], _Window(0.0, 1e9)
        end = _cut_batch(DEEP, [(0.0, 0)], 0.0, q_in, window, random.Random(0), 10.0)
        assert end == pytest.approx(10.0 * levels)
        assert window.iteration_tokens == [min(11, levels + 1)]  # the accepted prefix of what it got
        assert [t for t, target in q_in if target == 0] == [pytest.approx(10.0 * levels + 40.0)]  # its next request


def test_a_rows_own_next_request_cuts_nothing():
    """A row replied early (its chain done at level 2) sends its next request 1 ms later, while its
    batch's other row drafts on to level 10: the server's batch does not end for it (star/server.py,
    `_cut`: only other sessions' requests cut), nor does the simulated one."""
    quick = dataclasses.replace(DEEP, return_ms=1.0, tokens_samples=(3, 11), levels_samples=(2, 10))
    mixed = 0
    for seed in range(20):
        q_in, window = [], _Window(0.0, 1e9)
        end = _cut_batch(quick, [(0.0, 0), (0.0, 1)], 0.0, q_in, window, random.Random(seed), 10.0)
        got = sorted(window.iteration_tokens)
        assert end == (100.0 if 11 in got else 20.0) and set(got) <= {3, 11}  # each draft whole
        mixed += got == [3, 11]
    assert mixed


def test_a_lone_target_is_never_cut():
    cut, whole = simulate(DEEP, 1), simulate(dataclasses.replace(DEEP, levels_samples=()), 1)
    assert cut.system_tokens_per_s == pytest.approx(whole.system_tokens_per_s, rel=1e-6)


def test_cuts_shorten_the_drafts_past_saturation():
    """Many targets on one server: requests keep coming, so batches end early, smaller and shallower;
    the simulator without levels drafts each batch whole."""
    spread = dataclasses.replace(DEEP, return_samples_ms=RETURN_SPREAD)  # else they come in lock step
    cut, whole = simulate(spread, 16), simulate(dataclasses.replace(spread, levels_samples=()), 16)
    assert cut.mean_batch < whole.mean_batch
    tokens = cut.system_tokens_per_s * cut.t_gamma_ms / 1e3 / 16  # tokens an iteration
    assert 1 < tokens < 11


def test_levels_samples_must_pair_with_tokens_samples():
    for tokens, levels in (((3, 4), (5,)), ((3,), (0,)), ((7,), (5,))):
        with pytest.raises(ValueError):
            Profile(service_ms={1: 10.0}, return_ms=1.0, tokens_per_iteration=2.0, tokens_samples=tokens,
                    levels_samples=levels)
    assert Profile.from_json(DEEP.to_json()) == DEEP


# ---------------------------------------------------------------------------------------------
# compare() and the CLI
# ---------------------------------------------------------------------------------------------

def test_compare_reports_simulated_throughput_and_error():
    sim = simulate(SERIAL, 4, serial=True).system_tokens_per_s
    points = [{"mode": "serial", "n": 4, "system_tokens_per_s": sim},
              {"mode": "batched", "n": 4, "system_tokens_per_s": 2 * sim},
              {"mode": "colocated", "n": 1, "system_tokens_per_s": 1.0}]
    out = compare(SERIAL, points)
    assert [o["mode"] for o in out] == ["serial", "batched"]
    assert out[0]["relative_error"] == pytest.approx(0.0)
    batched = simulate(SERIAL, 4).system_tokens_per_s
    assert out[1]["simulated_tokens_per_s"] == batched
    assert out[1]["relative_error"] == pytest.approx(batched / (2 * sim) - 1)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_args(parser)
    return parser.parse_args(argv)


def test_cli_prints_a_table_and_writes_json(tmp_path, capsys):
    profile = tmp_path / "bench.json"
    profile.write_text(json.dumps({"benchmark": "star", "profile": SPREAD.to_json()}))
    out = tmp_path / "sim.json"
    args = parse(["--from", str(profile), "--targets", "1,8,64", "--servers", "1,2",
                  "--for-targets", "100", "--json-out", str(out)])
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "system tok/s" in text and "model tok/s" in text and "T_gamma" in text
    assert "100 targets need" in text
    result = json.loads(out.read_text())
    assert len(result["results"]) == 6
    assert {(r["servers"], r["n"]) for r in result["results"]} == {(k, n) for k in (1, 2) for n in (1, 8, 64)}
    assert result["servers_needed"]["servers"] >= 1
    assert Profile.from_json(result) == SPREAD  # the JSON holds its profile, so it feeds the next run
    assert set(result["results"][0]) == set(SimResult.__dataclass_fields__)


def test_cli_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="cannot read a profile"):
        main(parse(["--from", str(tmp_path / "missing.json")]))
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(SERIAL.to_json()))
    with pytest.raises(ValueError, match="--targets"):
        main(parse(["--from", str(profile), "--targets", "1,x"]))
    with pytest.raises(ValueError, match="--servers"):
        main(parse(["--from", str(profile), "--servers", "0"]))
