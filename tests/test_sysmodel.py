"""The analytical model: regimes, N_full and throughput on hand-computable profiles."""

import json

import pytest

from starsd.theory import sysmodel as M


def serial_profile(**kw) -> M.Profile:
    return M.Profile(**{"service_ms": {1: 100.0}, "return_ms": 300.0, "tokens_per_iteration": 4.0,
                        "target_only_ms_per_token": 150.0, **kw})


def batched_profile(**kw) -> M.Profile:  # S(b) = 80 + 20 b: batching pays
    return M.Profile(**{"service_ms": {1: 100.0, 2: 120.0, 8: 240.0, 32: 720.0}, "return_ms": 300.0,
                        "tokens_per_iteration": 4.0, "target_only_ms_per_token": 150.0, **kw})


def test_service_interpolates_and_extends():
    p = batched_profile()
    assert p.service(1) == 100 and p.service(8) == 240
    assert p.service(5) == pytest.approx(180)
    assert p.service(64) == pytest.approx(80 + 20 * 64)
    assert serial_profile().service(4) == 400  # one point only: batching assumed to gain nothing


def test_serial_server_closed_form():
    p = serial_profile()  # S = 100, R = 300: N_full = (S + R) / S = 4
    assert M.n_full(p, serial=True) == pytest.approx(4.0)
    one = M.predict(p, 1, serial=True)
    assert one.regime == "under-loaded"
    assert one.t_gamma_ms == pytest.approx(400) and one.t_idle_ms == pytest.approx(300)
    assert one.utilization == pytest.approx(0.25)
    assert one.system_tokens_per_s == pytest.approx(10.0)  # 4 tokens per 0.4 s
    two = M.predict(p, 2, serial=True)
    assert two.system_tokens_per_s == pytest.approx(20.0) and two.t_idle_ms == pytest.approx(200)
    eight = M.predict(p, 8, serial=True)  # saturated: T_gamma = N * S, T_idle = 0
    assert eight.regime == "fully loaded"
    assert eight.t_gamma_ms == pytest.approx(800) and eight.t_idle_ms == pytest.approx(0)
    assert eight.utilization == pytest.approx(1.0)
    assert eight.system_tokens_per_s == pytest.approx(40.0) and eight.per_target_tokens_per_s == pytest.approx(5.0)


def test_t_gamma_is_n_times_service_plus_idle():
    p = batched_profile()
    for n in (1, 2, 3, 5, 9, 17, 40):
        for serial in (True, False):
            r = M.predict(p, n, serial)
            assert r.t_gamma_ms == pytest.approx(n * p.service(r.batch) / r.batch + r.t_idle_ms)


def test_batched_server_outgrows_serial():
    p = batched_profile()
    cap_serial, _ = M.capacity(p, serial=True)
    cap_batched, b = M.capacity(p, serial=False)
    assert (cap_serial, b) == (pytest.approx(10.0), 32)
    assert cap_batched == pytest.approx(1e3 * 32 / 720)
    assert M.n_full(p, serial=False) == pytest.approx(cap_batched * 0.4)
    assert M.n_full(p, serial=False) > 4 * M.n_full(p, serial=True)
    xs = [M.predict(p, n).system_tokens_per_s for n in range(1, 80)]
    assert all(b >= a - 1e-9 for a, b in zip(xs, xs[1:]))  # more targets never lose throughput
    assert xs[-1] <= cap_batched * 4 + 1e-9
    assert all(x <= 1e3 * n / 400 * 4 + 1e-9 for n, x in enumerate(xs, 1))  # linear bound


def test_batched_regimes_and_batch_size():
    p = batched_profile()
    assert M.predict(p, 2).regime == "under-loaded" and M.predict(p, 2).batch == 1
    loaded = M.predict(p, 40)
    assert loaded.regime == "fully loaded" and loaded.utilization == pytest.approx(1.0)
    b = loaded.batch
    assert 40 == pytest.approx(b * (1.5 + 300 / p.service(b)))  # Little's law, as documented
    assert M.predict(p, 10_000).batch == 32  # never beyond max_batch


def test_break_even_against_target_only():
    p = serial_profile(target_only_ms_per_token=140.0)  # alone 7.14 tok/s; per target 40/N past N_full
    assert M.break_even(p, serial=True) == 5  # 40/5 = 8 >= 7.14 > 40/6
    assert M.break_even(M.Profile({1: 100.0}, 300.0, 4.0), serial=True) is None
    slow = serial_profile(target_only_ms_per_token=10.0)
    assert M.break_even(slow, serial=True) == 0


def test_profile_json_round_trip_and_errors(tmp_path):
    p = batched_profile(return_samples_ms=(290.0, 310.0), tokens_samples=(3, 5))
    f = tmp_path / "bench.json"
    f.write_text(json.dumps({"points": [], "profile": p.to_json()}))
    assert M.Profile.load(f) == p
    f.write_text(json.dumps({"service_ms": {"1": 10}, "return_ms": 1, "tokens_per_iteration": 2, "bogus": 1}))
    with pytest.raises(ValueError, match="bogus"):
        M.Profile.load(f)
    with pytest.raises(ValueError, match="cannot read"):
        M.Profile.load(tmp_path / "missing.json")
    with pytest.raises(ValueError):
        M.Profile({}, 1.0, 2.0)
    with pytest.raises(ValueError):
        M.Profile({1: -5.0}, 1.0, 2.0)
    with pytest.raises(ValueError):
        M.Profile({1: 5.0}, 1.0, 0.5)


def test_report_lists_both_disciplines():
    text = M.report(batched_profile(), [1, 4, 16])
    assert "one-at-a-time server" in text and "batched server" in text
    assert text.count("fully loaded") >= 2
