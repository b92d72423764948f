"""The fleet on paper (theory/fleet.py): the simulator's inputs from GPU costs, and the plan's search."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from starsd.errors import SettingError
from starsd.theory import fleet, simulate

ROOT = Path(__file__).resolve().parents[1]
COSTS = ROOT / "docs" / "results" / "inputs" / "fleet-a100.json"


def costs(**kw) -> fleet.Costs:
    base = dict(target="t", gpus=1, layers=10, step_ms={1: 10.0, 64: 20.0}, linear_ms_per_layer={1: 0.1, 64: 0.1, 128: 0.3},
                level_ms=2.0, batch_growth={1: 1.0, 64: 2.0}, prefill_ms_per_token=0.01, kv_bytes_per_token=1024,
                accepted={1: 0.8, 2: 1.5})
    return fleet.Costs(**{**base, **kw})


def test_a_verify_pass_costs_the_step_while_its_tokens_stay_where_the_linear_layers_are_flat():
    c = costs()
    assert c.verify(16, 1) == c.step(16)
    assert c.verify(16, 4) == c.step(16)  # 64 tokens: as flat as 16
    assert c.verify(32, 4) == pytest.approx(c.step(32) + 10 * (0.3 - 0.1))  # 128 tokens: 0.2 ms more a layer


def test_an_instance_is_a_target_whose_draft_request_holds_its_rows():
    c, s = costs(), fleet.Scenario(rows=8, prompt=100, shared=0, output=50, network_ms=1.0, max_rows=32)
    p = fleet.profile(c, s, depth=2)
    ingest = 100 * 2.5 / 50 * 0.01  # a row's share of its prompt's ingest, a step
    assert p.max_batch == 4
    assert p.service(1) == pytest.approx(2 * c.level(8) + 8 * ingest)
    assert p.service(4) == pytest.approx(2 * c.level(32) + 32 * ingest)
    assert p.return_ms == pytest.approx(c.verify(8, 3) + 1.0)
    assert p.tokens_per_iteration == pytest.approx(8 * 2.5)
    assert p.target_only_ms_per_token == pytest.approx(c.step(8) / 8)


def test_a_shared_prefix_takes_its_ingest_off_every_draft():
    c = costs()
    alone = fleet.profile(c, fleet.Scenario(rows=8, prompt=100, shared=0, output=50), 2)
    shared = fleet.profile(c, fleet.Scenario(rows=8, prompt=100, shared=100, output=50), 2)
    assert shared.service(1) == pytest.approx(2 * c.level(8))
    assert alone.service(4) - shared.service(4) == pytest.approx(32 * 100 * 2.5 / 50 * 0.01)


def test_the_plan_takes_the_fewest_servers_that_keep_each_instance_at_its_share():
    c = costs(level_ms=8.0)  # a slow draft: one server keeps few instances
    s = fleet.Scenario(rows=8, prompt=100, shared=0, output=50, max_rows=64)
    row = fleet.plan(c, s, 16, depth=2, quality=0.9)
    p = fleet.profile(c, s, 2)
    mine = simulate.simulate(p, 1, 1).per_target_tokens_per_s
    assert row["servers"] > 1
    assert simulate.simulate(p, 16, row["servers"]).min_per_target_tokens_per_s >= 0.9 * mine
    assert simulate.simulate(p, 16, row["servers"] - 1).min_per_target_tokens_per_s < 0.9 * mine
    assert row["vs_alone"] == pytest.approx(row["per_instance_tokens_per_s"] / fleet.alone_tokens_per_s(c, s))
    assert row["per_gpu_vs_alone"] == pytest.approx(row["vs_alone"] * 16 / (16 + row["servers"]))
    assert fleet.plan(c, s, 2, depth=2)["servers"] <= row["servers"]


def test_bad_scenarios_and_unknown_targets_are_refused():
    with pytest.raises(SettingError):
        fleet.Scenario(prompt=10, shared=11)
    with pytest.raises(SettingError):
        fleet.Scenario(rows=300, max_rows=256)
    with pytest.raises(SettingError, match="no acceptance at depth 5"):
        fleet.profile(costs(), fleet.Scenario(), 5)
    with pytest.raises(SettingError, match="13b"):
        fleet.Costs.load(COSTS, "13b")


def test_every_figure_of_the_committed_costs_names_its_source():
    d = json.loads(COSTS.read_text())
    for target in d["targets"].values():
        assert target["step_source"] and target["linear_source"]
    draft = d["draft"]
    for key in ("level", "batch_growth", "prefill", "kv"):
        assert draft[f"{key}_source"]
    assert "assumption" in draft["batch_growth_source"] and "derived" in draft["prefill_source"]
    assert d["acceptance"]["source"]
    for name in d["targets"]:
        fleet.Costs.load(COSTS, name)


def test_the_fleet_command_writes_its_table(tmp_path):
    out = tmp_path / "fleet.json"
    subprocess.run([sys.executable, "-m", "starsd.cli", "fleet", "--targets", "7b", "--instances", "8", "--json-out",
                    str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["target"], r["shared"], r["instances"]) for r in rows] == [("7b", 0, 8), ("7b", 768, 8)]
    assert all(r["servers"] >= 1 and r["per_instance_tokens_per_s"] > 0 for r in rows)
