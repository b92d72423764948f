"""A fleet of vLLM instances on GPUs drafting from shared draft servers, on paper: the draft servers
M instances need, and the tokens/s each instance gets, from published GPU costs (a costs file:
docs/results/inputs/fleet-a100.json, each figure with its source or marked as an assumption).

Terms
- instance: one vLLM engine serving `rows` requests at once. At every step it asks its draft server
  for a draft of each row, waits for them, and verifies every row in one pass of rows x (d + 1)
  tokens (d: the depth). In the simulator (theory/simulate.py) it is one target whose draft request
  holds its rows: S(j) is d levels over j x rows rows (a level: one pass of the draft) plus the rows'
  share of their prompts' ingest; R the instance's verify pass plus the network; tau rows x (1 + the
  tokens accepted a step at depth d).
- verify pass: the decode step of `rows` rows, plus what the linear layers cost more for rows x
  (d + 1) tokens than for `rows` (Vidur's per-layer profiles). Attention reads each row's KV once,
  whatever its tokens: it is counted once, in the step.
- ingest: each request's prompt is ingested by the draft server once, over output / tau_row steps.
  With shared prefixes the shared part is ingested once per server and counted as free
  (star/prefixes.py copies the prefix's KV: it saves compute, not memory).
- draft KV: every session holds its prompt and output in the draft server's KV, at most.
Pure arithmetic and simulation: no processes, no models.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from starsd.errors import SettingError
from starsd.results import write_json
from starsd.theory import simulate as sim
from starsd.theory.sysmodel import Profile, interpolate

GIB = 2 ** 30


def _by_int(table: dict) -> dict[int, float]:
    """A JSON table keyed by numbers as strings, keyed by int."""
    return {int(k): float(v) for k, v in table.items()}


@dataclass(frozen=True)
class Costs:
    """One target's and the draft's costs on a GPU (times in ms), and the acceptance by depth."""

    target: str  # the target's name, as the costs file says it
    gpus: int  # the GPUs one instance of the target takes
    layers: int  # the target's transformer layers
    step_ms: dict[int, float]  # the target's decode step (one token a row) by rows
    linear_ms_per_layer: dict[int, float]  # one layer's linear layers by tokens in the pass
    level_ms: float  # one draft level for one row
    batch_growth: dict[int, float]  # a draft level's cost for b rows, as a multiple of level_ms
    prefill_ms_per_token: float  # the draft ingesting a prompt, per token
    kv_bytes_per_token: int  # the draft's KV for one token of a session
    accepted: dict[int, float]  # draft tokens accepted a step, by fixed depth

    def step(self, rows: int) -> float:
        return interpolate(self.step_ms, rows)

    def verify(self, rows: int, tokens: int) -> float:
        """The target's pass over `tokens` tokens in each of `rows` rows."""
        linear = self.layers * (interpolate(self.linear_ms_per_layer, rows * tokens)
                                - interpolate(self.linear_ms_per_layer, rows))
        return self.step(rows) + max(0.0, linear)

    def level(self, rows: int) -> float:
        return self.level_ms * interpolate(self.batch_growth, rows)

    @classmethod
    def load(cls, path: str | Path, target: str) -> Costs:
        try:
            d = json.loads(Path(path).read_text())
            t, draft = d["targets"][target], d["draft"]
            return cls(target=t["name"], gpus=int(t["gpus"]), layers=int(t["layers"]), step_ms=_by_int(t["step_ms"]),
                       linear_ms_per_layer=_by_int(t["linear_ms_per_layer"]), level_ms=float(draft["level_ms"]["1"]),
                       batch_growth=_by_int(draft["batch_growth"]),
                       prefill_ms_per_token=float(draft["prefill_ms_per_token"]),
                       kv_bytes_per_token=int(draft["kv_bytes_per_token"]),
                       accepted=_by_int(d["acceptance"]["accepted_per_step"]))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise SettingError(f"cannot read target {target!r}'s costs from {path}: {e!r}") from None


@dataclass(frozen=True)
class Scenario:
    """What each instance serves."""

    rows: int = 16  # requests an instance runs at once
    prompt: int = 1024  # tokens of each request's prompt
    shared: int = 0  # of them, a prefix common to every request (its ingest counted as free)
    output: int = 256  # tokens each request generates
    network_ms: float = 1.0  # an instance's round trip to its draft server, with (de)serialisation
    max_rows: int = 256  # rows a draft server drafts in one batch

    def __post_init__(self):
        if min(self.rows, self.prompt, self.output, self.max_rows) < 1 or not 0 <= self.shared <= self.prompt:
            raise SettingError(f"a scenario needs rows, prompt, output and max_rows >= 1 and 0 <= shared <= prompt: "
                               f"{self}")
        if self.rows > self.max_rows:
            raise SettingError(f"an instance's {self.rows} rows do not fit a draft batch of {self.max_rows}")


def profile(c: Costs, s: Scenario, depth: int) -> Profile:
    """The simulator's inputs for instances of `s` drafting `depth` tokens a step (module docstring)."""
    if depth not in c.accepted:
        raise SettingError(f"no acceptance at depth {depth} (known: {sorted(c.accepted)})")
    tau_row = 1 + c.accepted[depth]
    ingest_ms = (s.prompt - s.shared) * tau_row / s.output * c.prefill_ms_per_token  # a row's share, a step
    most = s.max_rows // s.rows
    return Profile(
        service_ms={j: depth * c.level(j * s.rows) + j * s.rows * ingest_ms for j in range(1, most + 1)},
        return_ms=c.verify(s.rows, depth + 1) + s.network_ms,
        tokens_per_iteration=s.rows * tau_row,
        target_only_ms_per_token=c.step(s.rows) / s.rows,
        max_batch=most)


def alone_tokens_per_s(c: Costs, s: Scenario) -> float:
    """An instance's tokens/s decoding without speculation."""
    return 1e3 * s.rows / c.step(s.rows)


def best_depth(c: Costs, s: Scenario, seed: int = 0) -> int:
    """The depth at which one instance with a draft server of its own makes the most tokens/s."""
    def alone_with_its_server(depth: int) -> float:
        return sim.simulate(profile(c, s, depth), 1, 1, seed=seed).per_target_tokens_per_s

    return max(sorted(c.accepted), key=alone_with_its_server)


def kv_gib(c: Costs, s: Scenario, instances: int) -> float:
    """The draft KV a server holds for `instances` instances' sessions, each at its longest."""
    return instances * s.rows * (s.prompt + s.output) * c.kv_bytes_per_token / GIB


def plan(c: Costs, s: Scenario, instances: int, depth: int, quality: float = 0.9, seed: int = 0) -> dict:
    """The draft servers `instances` instances need to keep `quality` of one instance's tokens/s with a
    server of its own, and what each instance gets with them and with a single server."""
    p = profile(c, s, depth)
    servers = sim.servers_needed(p, instances, quality, seed=seed)
    mine = sim.simulate(p, 1, 1, seed=seed).per_target_tokens_per_s
    run = sim.simulate(p, instances, servers, seed=seed)
    one = run if servers == 1 else sim.simulate(p, instances, 1, seed=seed)
    alone = alone_tokens_per_s(c, s)
    gpus = instances * c.gpus  # a draft server is one GPU
    return {"instances": instances, "depth": depth, "servers": servers,
            "per_instance_tokens_per_s": run.per_target_tokens_per_s,
            "least_per_instance_tokens_per_s": run.min_per_target_tokens_per_s,
            "vs_alone": run.per_target_tokens_per_s / alone, "vs_own_server": run.per_target_tokens_per_s / mine,
            "per_gpu_vs_alone": run.per_target_tokens_per_s * gpus / (gpus + servers) / alone,
            "server_utilization": run.utilization, "rows_per_draft_batch": run.mean_batch * s.rows,
            "kv_gib_per_server": kv_gib(c, s, math.ceil(instances / servers)),
            "one_server": {"per_instance_tokens_per_s": one.per_target_tokens_per_s,
                           "vs_alone": one.per_target_tokens_per_s / alone, "utilization": one.utilization,
                           "kv_gib": kv_gib(c, s, instances)},
            "alone_tokens_per_s": alone, "own_server_tokens_per_s": mine}


def table(rows: list[dict]) -> str:
    lines = [f"{'target':>6} {'shared':>6} {'M':>4} {'d':>2} {'K':>3} {'tok/s/inst':>10} {'vs alone':>8} "
             f"{'vs own':>7} {'a GPU':>6} {'util':>5} {'batch rows':>10} {'KV GiB/K':>8} {'K=1 vs alone':>12}"]
    for r in rows:
        lines.append(f"{r['target']:>6} {r['shared']:>6} {r['instances']:>4} {r['depth']:>2} {r['servers']:>3} "
                     f"{r['per_instance_tokens_per_s']:>10.1f} {r['vs_alone']:>7.2f}x {r['vs_own_server']:>6.2f}x "
                     f"{r['per_gpu_vs_alone']:>5.2f}x "
                     f"{r['server_utilization']:>5.0%} {r['rows_per_draft_batch']:>10.1f} "
                     f"{r['kv_gib_per_server']:>8.2f} {r['one_server']['vs_alone']:>11.2f}x")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", default="docs/results/inputs/fleet-a100.json", help="the GPU costs file, each figure "
                   "with its source")
    p.add_argument("--targets", default="7b,70b", help="the costs file's targets, comma-separated")
    p.add_argument("--instances", default="8,16,64", help="vLLM instances M, comma-separated")
    p.add_argument("--rows", type=int, default=Scenario.rows, help="requests each instance runs at once")
    p.add_argument("--prompt", type=int, default=Scenario.prompt, help="tokens of each request's prompt")
    p.add_argument("--shared", type=int, default=768, help="with shared prefixes: the prompt's tokens every request "
                   "shares (each row of the table is also given without)")
    p.add_argument("--output", type=int, default=Scenario.output, help="tokens each request generates")
    p.add_argument("--network-ms", type=float, default=Scenario.network_ms, help="an instance's round trip to its "
                   "draft server, ms")
    p.add_argument("--max-rows", type=int, default=Scenario.max_rows, help="rows a draft server drafts in one batch")
    p.add_argument("--quality", type=float, default=0.9, help="the share of an instance's tokens/s with a draft "
                   "server of its own that each instance keeps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="write the table as JSON here")


def main(args: argparse.Namespace) -> int:
    instances = sim.int_list(args.instances, "--instances")
    shared = Scenario(rows=args.rows, prompt=args.prompt, shared=args.shared, output=args.output,
                      network_ms=args.network_ms, max_rows=args.max_rows)
    out = []
    for target in args.targets.split(","):
        c = Costs.load(args.costs, target)
        for s in (replace(shared, shared=0), shared):
            depth = best_depth(c, s, args.seed)
            out += [{"target": target, "shared": s.shared, **plan(c, s, m, depth, args.quality, args.seed)}
                    for m in instances]
    print(f"draft servers (K) for M vLLM instances of {args.rows} requests each ({args.prompt}-token prompts, "
          f"{args.output} tokens out), each instance kept at {args.quality:.0%} of its tokens/s with a server of "
          f"its own; d: the depth that serves one instance best; 'vs alone': against the instance decoding alone; "
          f"'a GPU': tokens/s per GPU (the instances' and the draft servers', one each) against the instances alone")
    print(table(out))
    if args.json_out:
        write_json(args.json_out, {"benchmark": "fleet", "what_is_real": "nothing run: the simulator on published "
                                   "GPU costs (the costs file names each source) and acceptance from CPU runs",
                                   "costs_file": args.costs, "costs": json.loads(Path(args.costs).read_text()),
                                   "scenario": asdict(shared), "quality": args.quality, "rows": out})
    return 0
