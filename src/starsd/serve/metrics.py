"""Prometheus metrics of the gateway and of the draft server, named in vLLM's style where vLLM has
the figure (`vllm:` -> `starsd:`).

Speculation, as vLLM counts it: a draft is one target step that verified a draft; its draft tokens
are the draft's depth; its accepted tokens the drafted tokens the target kept. Per position,
accepted_tokens_per_pos{position=i} counts drafts whose token i was accepted. The draft server's
figures are read from its StatsRequest answer at scrape time (DraftServerCollector).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
OUTCOMES = ("stop", "length", "aborted", "rejected", "invalid", "error")
disable_created_metrics()  # no *_created series beside each counter (as vLLM)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, max_position: int):
        self.registry = registry
        self.max_position = max_position
        self.requests = Counter("starsd:requests", "requests by outcome: stop, length (finished), aborted "
                                "(client gone), rejected (queue full), invalid (bad request), error", ["outcome"],
                                registry=registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.running = Gauge("starsd:num_requests_running", "requests on a target now", registry=registry)
        self.waiting = Gauge("starsd:num_requests_waiting", "requests waiting for a free target", registry=registry)
        self.prompt_tokens = Counter("starsd:prompt_tokens", "prompt tokens of served requests", registry=registry)
        self.generation_tokens = Counter("starsd:generation_tokens", "tokens generated", registry=registry)
        self.ttft = Histogram("starsd:time_to_first_token_seconds", "request arrival to its first text",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("starsd:inter_token_latency_seconds", "time between a stream's outputs, per token "
                             "(a target step's wait shared by the tokens it emitted)", buckets=LATENCY_BUCKETS,
                             registry=registry)
        self.e2e = Histogram("starsd:e2e_request_latency_seconds", "request arrival to its last output",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_time = Histogram("starsd:request_queue_time_seconds", "time a request waited for a free target",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.drafts = Counter("starsd:spec_decode_num_drafts", "target steps that verified a draft", registry=registry)
        self.draft_tokens = Counter("starsd:spec_decode_num_draft_tokens", "drafted tokens verified",
                                    registry=registry)
        self.accepted_tokens = Counter("starsd:spec_decode_num_accepted_tokens", "drafted tokens accepted",
                                       registry=registry)
        self.accepted_per_pos = Counter("starsd:spec_decode_num_accepted_tokens_per_pos",
                                        "drafts whose token at this position was accepted", ["position"],
                                        registry=registry)
        self._drafted_steps = 0
        self._accepted = 0
        mean = Gauge("starsd:spec_decode_mean_acceptance_length", "tokens per drafted target step "
                     "(1 + accepted / drafts), since start", registry=registry)
        mean.set_function(self._mean_acceptance_length)

    def step(self, tokens: int, drafted: int, accepted: int, seconds: float) -> None:
        """One target step of a stream: `seconds` since the stream's previous output."""
        self.generation_tokens.inc(tokens)
        for _ in range(tokens):
            self.itl.observe(seconds / tokens)
        if drafted:
            self._drafted_steps += 1
            self._accepted += accepted
            self.drafts.inc()
            self.draft_tokens.inc(drafted)
            self.accepted_tokens.inc(accepted)
            for i in range(min(accepted, self.max_position)):
                self.accepted_per_pos.labels(str(i)).inc()

    def _mean_acceptance_length(self) -> float:
        return 1 + self._accepted / self._drafted_steps if self._drafted_steps else 0.0


class DraftServerCollector:
    """The draft servers' counters as metrics, from `snapshots()` (each server's StatsRequest JSON, or
    None where it does not answer): starsd:draft_server_up counts those that answered, and the other
    series are over them, summed (the busy fraction: their mean). Each server's own are on its
    --metrics-port."""

    def __init__(self, snapshots: Callable[[], list[dict | None]]):
        self.snapshots = snapshots

    def collect(self):
        answered = [s for s in self.snapshots() if s]
        yield GaugeMetricFamily("starsd:draft_server_up", "draft servers that answered", value=float(len(answered)))
        if not answered:
            return
        stats = combined(answered)
        yield CounterMetricFamily("starsd:draft_server_busy_seconds", "seconds spent drafting (rate() of it is "
                                  "the busy fraction)", value=stats["busy_s"])
        yield GaugeMetricFamily("starsd:draft_server_busy_fraction", "share of the uptime spent drafting",
                                value=stats["utilization"])
        yield GaugeMetricFamily("starsd:draft_server_queue_depth", "draft requests waiting in Q_in",
                                value=stats.get("queue_depth", 0))
        yield GaugeMetricFamily("starsd:draft_server_sessions_open", "target sessions held",
                                value=stats["sessions_open"])
        yield GaugeMetricFamily("starsd:draft_server_connections", "connections holding sessions (an engine's "
                                "requests share one)", value=stats.get("connections", 0))
        yield CounterMetricFamily("starsd:draft_server_sessions_evicted", "sessions whose draft KV was freed for "
                                  "another's (their next request ingests their tokens again)",
                                  value=stats.get("sessions_evicted", 0))
        yield CounterMetricFamily("starsd:draft_server_prefix_tokens", "prompt tokens not ingested: new streams "
                                  "started from a prefix another's draft KV held",
                                  value=stats.get("prefix", {}).get("tokens", 0))
        yield GaugeMetricFamily("starsd:draft_server_kv_bytes", "draft KV held by the sessions and their pre-drafts",
                                value=stats.get("kv_bytes", 0))
        yield CounterMetricFamily("starsd:draft_server_requests", "draft requests taken", value=stats["requests"])
        errors = CounterMetricFamily("starsd:draft_server_errors", "refusals and errors by code", labels=["code"])
        for code, n in sorted(stats["errors"].items()):
            errors.add_metric([code], n)
        yield errors
        yield CounterMetricFamily("starsd:draft_server_predraft_hits", "draft requests answered from a pre-draft",
                                  value=stats["predraft"]["hits"])
        yield batch_histogram({int(k): v for k, v in stats["batch_sizes"].items()})


def combined(snapshots: list[dict]) -> dict:
    """Several draft servers' counters as one server's: sums, and the mean busy fraction."""
    if len(snapshots) == 1:
        return snapshots[0]
    errors: collections.Counter = collections.Counter()
    sizes: collections.Counter = collections.Counter()
    for s in snapshots:
        errors.update(s["errors"])
        sizes.update({int(k): v for k, v in s["batch_sizes"].items()})
    total = {key: sum(s.get(key, 0) for s in snapshots)
             for key in ("busy_s", "queue_depth", "sessions_open", "requests", "sessions_evicted", "kv_bytes",
                          "connections")}
    return {**total, "utilization": sum(s["utilization"] for s in snapshots) / len(snapshots), "errors": dict(errors),
            "predraft": {"hits": sum(s["predraft"]["hits"] for s in snapshots)}, "batch_sizes": dict(sizes),
            "prefix": {"tokens": sum(s.get("prefix", {}).get("tokens", 0) for s in snapshots)}}


class TargetCollector:
    """A target server's counters (star.target_server.TargetServer.counters) as metrics."""

    def __init__(self, counters: Callable[[], dict]):
        self.counters = counters

    def collect(self):
        c = self.counters()
        labels = ["target"]
        for key, help_ in (("streams", "generation streams served"), ("tokens", "tokens generated"),
                           ("steps", "target forward passes after the prefill"),
                           ("drafts", "steps that verified a draft"), ("draft_tokens", "drafted tokens verified"),
                           ("accepted_tokens", "drafted tokens accepted"),
                           ("busy_seconds", "seconds spent serving streams, summed over the streams")):
            family = CounterMetricFamily(f"starsd:target_{key}", help_, labels=labels)
            family.add_metric([c["name"]], c[key])
            yield family
        running = GaugeMetricFamily("starsd:target_streams_running", "streams being served now", labels=labels)
        running.add_metric([c["name"]], float(c["running"]))
        yield running


class RestartsCollector:
    """How often a star (local, or on Ray) started each kind of its processes again (star.supervise.Supervisor)."""

    KINDS = ("draft-server", "target-server")

    def __init__(self, restarts: Callable[[], dict[str, int]]):
        self.restarts = restarts

    def collect(self):
        counts = self.restarts()
        family = CounterMetricFamily("starsd:process_restarts", "processes of the star started again after they "
                                     "exited", labels=["process"])
        for kind in self.KINDS:
            family.add_metric([kind], counts.get(kind, 0))
        yield family


class ElasticCollector:
    """The elastic controller's decisions and the draft servers it runs (star/elastic.py)."""

    ACTIONS = ("add", "retire", "add_failed")

    def __init__(self, controller: Callable):
        self.controller = controller  # gives the controller, or None before it starts

    def collect(self):
        controller = self.controller()
        if controller is None:
            return
        family = CounterMetricFamily("starsd:elastic_decisions", "draft servers added and retired by the elastic "
                                     "controller", labels=["action"])
        for action in self.ACTIONS:
            family.add_metric([action], controller.counts.decisions.get(action, 0))
        yield family
        yield GaugeMetricFamily("starsd:elastic_draft_servers", "draft servers the elastic controller runs",
                                value=controller.counts.servers)


def serve_metrics(port: int, collector) -> None:
    """Serve one collector's metrics at http://0.0.0.0:PORT/metrics (a daemon thread)."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    registry.register(collector)
    start_http_server(port, registry=registry)


def batch_histogram(sizes: dict[int, int]) -> HistogramMetricFamily:
    """Batch sizes (size -> batches) as a cumulative histogram."""
    buckets = [(str(b), sum(n for s, n in sizes.items() if s <= b)) for b in BATCH_BUCKETS]
    buckets.append(("+Inf", sum(sizes.values())))
    return HistogramMetricFamily("starsd:draft_server_batch_size", "sessions drafted together per batch",
                                 buckets=buckets, sum_value=sum(s * n for s, n in sizes.items()))
