"""`starsd bench sessions` end to end on the tiny pair: many sessions through a small draft KV budget
(none refused, every output the target's own, the budget kept), streams sharing a prefix, and many
sessions held at once."""

import json

import tiny
from starsd import cli


def test_bench_sessions_churns_shares_and_holds(tmp_path):
    target, draft = tiny.save_pair(tmp_path)
    out = tmp_path / "sessions.json"
    code = cli.main(["bench", "sessions", "--churn-total", "40", "--churn-live", "10", "--churn-room", "20",
                     "--churn-duration-s", "0", "--churn-step-s", "0.01", "--prefix-sessions", "3", "--prefix-tokens", "200", "--held", "12",
                     "--target", target, "--draft", draft, "--dtype", "float32", "--draft-quantize", "none",
                     "--threads", "1", "--json-out", str(out)])
    result = json.loads(out.read_text())
    churn = result["churn"]
    assert code == 0 and churn["opened"] == 40 and churn["refused_hellos"] == 0 and churn["outputs_differ"] == 0
    server = churn["server"]
    assert server["sessions_evicted"] > 0 and server["sessions_restored"] > 0 and not server["errors"]
    assert 0 < churn["kv_bytes_max"] <= churn["budget_bytes"] and churn["drafted_steps"] > 0
    prefix = result["prefix"]
    assert prefix["server"]["prefix"]["hits"] == 3  # the two later streams, and the first one back
    assert prefix["server"]["prefix"]["tokens"] >= 2 * 192 + 192  # whole 16-token blocks of the prefix
    held = result["held"]
    assert held["sessions_open"] == 12 and held["sessions_evicted"] == 0 and not held["errors"]
    assert (tmp_path / "sessions.png").stat().st_size > 0
