"""bench vllm-serve's and bench vllm's arithmetic: ratios taken within one run, texts compared with alone's
run by run, the plug-in's counters per request set; taskset's core lists."""

from starsd.bench.vllm import cores_of
from starsd.bench.vllm_serve import figures


def request_set(tokens_per_s: float, ids: list[list[int]], plugin: dict | None = None) -> dict:
    return {"tokens_per_s": tokens_per_s, "token_ids": ids, **({"plugin": plugin} if plugin else {})}


def test_each_ratio_is_taken_against_alone_in_the_same_run():
    runs = [{"alone": {"sets": {"1": request_set(4.0, [[1, 2]])}},
             "star": {"sets": {"1": request_set(3.0, [[1, 2]], {"proposed": 8, "accepted": 5})}}},
            {"alone": {"sets": {"1": request_set(2.0, [[1, 2]])}},
             "star": {"sets": {"1": request_set(3.0, [[1, 3]], {"proposed": 4, "accepted": 1})}}}]
    got = figures(runs, ["alone", "star"], [1])
    assert got["star"]["1"]["vs_alone"] == [0.75, 1.5]  # not 6.0 / 6.0 pooled over the runs
    assert got["star"]["1"]["equal"] is False  # run 2's text parted from alone's
    assert got["star"]["1"]["drafted_tokens"] == [8, 4] and got["star"]["1"]["accepted_tokens"] == [5, 1]
    assert got["alone"]["1"]["equal"] is True and "drafted_tokens" not in got["alone"]["1"]
    without_alone = figures([{m: run[m] for m in ("star", "alone")} for run in runs], ["star"], [1])
    assert without_alone["star"]["1"]["vs_star"] == [1.0, 1.0]  # the first mode is the reference


def test_core_lists_read_as_taskset_writes_them():
    assert cores_of("1") == {1} and cores_of("0,2-3") == {0, 2, 3}


def test_a_levels_time_is_read_by_batch_size_between_two_readings_of_the_servers_counters():
    from starsd.bench.vllm import level_ms
    from starsd.star.stats import ServerStats

    stats = ServerStats()
    stats.level(50.0, 2, 1)  # the warm-up's, before the run
    before = stats.snapshot(0)
    stats.level(90.0, 2, 1)
    stats.level(120.0, 3, 2)
    stats.level(180.0, 3, 2)
    stats.level(0.0, 0, 3)  # a batch that drafted no level is not counted
    assert level_ms(before, stats.snapshot(0)) == {"1": {"batches": 1, "levels": 2, "ms_per_level": 45.0},
                                                   "2": {"batches": 2, "levels": 6, "ms_per_level": 50.0}}


def test_the_modes_passes_alternate_and_each_set_gives_its_median_pass():
    """Every mode is up at once and gets a pass of each set in turn, the order reversed each repeat (a drift
    of the host's speed weighs on both alike); a set's figure is its median pass, and whether every pass
    gave the same tokens is kept."""
    from types import SimpleNamespace

    from starsd.bench.vllm_serve import passes

    sent = []

    class Server:  # what VllmServe.at_once returns, pass after pass
        def __init__(self, name, speeds, ids):
            self.name = name
            self.left = [request_set(s, i) for s, i in zip(speeds, ids)]

        def at_once(self, prompts, max_tokens):
            sent.append((self.name, len(prompts)))
            return self.left.pop(0)

    up = [SimpleNamespace(name="alone", stats=None, server=Server("alone", [5.0, 3.0, 4.0], [[[1]]] * 3)),
          SimpleNamespace(name="star", stats=None, server=Server("star", [2.0, 6.0, 1.0], [[[1]], [[2]], [[1]]]))]
    got = passes(up, [[7], [8]], [1], 4, 3)
    assert sent == [("alone", 1), ("star", 1), ("star", 1), ("alone", 1), ("alone", 1), ("star", 1)]
    assert got["alone"]["sets"]["1"]["tokens_per_s"] == 4.0 and got["alone"]["sets"]["1"]["passes_equal"]
    assert got["alone"]["sets"]["1"]["passes_tokens_per_s"] == [5.0, 3.0, 4.0]
    assert got["star"]["sets"]["1"]["tokens_per_s"] == 2.0 and not got["star"]["sets"]["1"]["passes_equal"]
    runs = [{"alone": got["alone"], "star": got["star"]}]
    assert figures(runs, ["alone", "star"], [1])["star"]["1"]["equal"] is False


def test_an_engine_that_overruns_leaves_no_process_of_its_group_behind(tmp_path):
    """vLLM's engine core and worker outlive their parent if it alone is killed (a bench stopped left
    two holding 10 GB): run_engine kills the whole group, on a timeout as at the end."""
    import subprocess
    import time
    from pathlib import Path

    import pytest

    from starsd.bench.vllm_runs import run_engine

    pids = tmp_path / "pids"
    engine = tmp_path / "engine"  # stands where vLLM's python is: starts a child of its own, then hangs
    engine.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pids}\nsleep 300\n")
    engine.chmod(0o755)
    with pytest.raises(subprocess.TimeoutExpired):
        run_engine({}, str(engine), timeout_s=2)
    status = Path(f"/proc/{int(pids.read_text())}/status")
    time.sleep(0.2)
    assert not status.exists() or "State:\tZ" in status.read_text()  # gone, or dead and not yet reaped
