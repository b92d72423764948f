"""`starsd demo`'s summary as a person reads it where its output is not a terminal (a pipe, a CI
log): rich then lays it out at 80 columns, and its table once cut its own headers to "target…" and
"speed-…"."""

import io

from rich.console import Console

from starsd.serve.demo import _print_summary


def test_the_summary_table_reads_whole_at_80_columns():
    rows = [{"request": f"HumanEval/{i}", "tokens": 62, "tokens_per_s": 7.17, "target_only_tokens_per_s": 7.12,
             "drafts": 110, "target_steps": 124, "mean_acceptance_length": 2.5, "same_text_as_target_only": True,
             "text": "pass"} for i in (0, 163)]
    system = {"tokens": 124, "tokens_per_s": 10.53, "target_only_tokens_per_s": 10.45, "draft_server_utilization": 0.4}
    out = io.StringIO()
    _print_summary(Console(file=out, width=80), rows, system)
    text = out.getvalue()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for word in ("HumanEval/163", "StarSD", "alone", "speed-", "drafted", "110 of 124", "1.01x", "system"):
        assert word in text, word
