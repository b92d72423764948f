"""The memory benchmark's arithmetic: instances that fit a budget, /proc status lines, safetensors headers."""

import json
import struct

import pytest

from starsd.bench.memory import GIB, Fit, fit, safetensors_params
from starsd.bench.rss import parse_status


def test_colocated_pairs_and_remote_targets_that_fit():
    # 24 GiB: 24 // 7 = 3 pairs; one 3 GiB server leaves 21 GiB for 21 // 5 = 4 targets
    assert fit(24 * GIB, 7 * GIB, 5 * GIB, 3 * GIB) == Fit(colocated=3, remote=4)
    assert fit(10 * GIB, 5 * GIB, 5 * GIB, 1) == Fit(colocated=2, remote=1)  # the server's byte costs a target


def test_a_budget_below_the_draft_server_fits_no_remote_target():
    assert fit(2 * GIB, 1 * GIB, 1 * GIB, 3 * GIB) == Fit(colocated=2, remote=0)
    assert fit(0, 1, 1, 1) == Fit(0, 0)


def test_fit_refuses_sizes_that_make_no_sense():
    with pytest.raises(ValueError, match="> 0"):
        fit(GIB, 0, GIB, GIB)
    with pytest.raises(ValueError, match="budget"):
        fit(-1, GIB, GIB, GIB)


def test_parse_status_reads_rss_and_high_water_mark_in_bytes():
    text = "Name:\tpython\nVmPeak:\t 9000 kB\nVmHWM:\t 2048 kB\nVmRSS:\t 1024 kB\nThreads:\t3\n"
    assert parse_status(text) == {"VmHWM": 2048 * 1024, "VmRSS": 1024 * 1024}
    assert parse_status("Name:\tpython\nState:\tZ (zombie)\n") == {}


def test_safetensors_params_counts_from_the_header(tmp_path):
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]},
              "b": {"dtype": "F32", "shape": [5], "data_offsets": [24, 44]}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(44))
    assert safetensors_params(tmp_path) == {"params": 17, "checkpoint_bytes": 44}


def test_a_groups_peak_counts_every_process_in_it():
    """What bench vllm-serve reads before it starts another vLLM beside one that is up (vLLM's API server,
    engine core and worker share a process group): a child's memory counts with its parent's."""
    import subprocess
    import sys

    from starsd.bench.rss import available, group_peak, read_status
    from starsd.star.processes import stop_group

    hold = "import sys, time; x = bytearray(64 << 20); sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                               f"{hold!r}]).wait()"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout.readline() == "up\n"  # the child's 64 MiB are held
        assert read_status(parent.pid)["VmHWM"] < 64 << 20 <= group_peak(parent.pid)  # the child's counted
        assert available() > 64 << 20
    finally:
        stop_group(parent)
