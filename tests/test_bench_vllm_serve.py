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


def test_core_lists_read_as_taskset_writes_them():
    assert cores_of("1") == {1} and cores_of("0,2-3") == {0, 2, 3}
