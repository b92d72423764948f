"""The emulated draft host (emulate/draft_host.py): a recording of the real drafter answers every
request below a recorded prefix as the real drafter would, after the recorded cost, and a real draft
server around it serves a target the same steps as the real drafter."""

import dataclasses
import time
import types

import pytest

from starsd.config import DraftConfig, SamplingConfig, ServerConfig
from starsd.emulate.draft_host import Cost, RecordedDrafter, Recording, batch_scale, record
from starsd.models.drafter import DraftJob
from starsd.spec_decode.decode import speculative, target_only
from starsd.star.client import DraftClient
from starsd.star.processes import free_port
from starsd.star.remote_drafter import RemoteDrafter
from starsd.star.server import DraftServer

FP = "f" * 64
GREEDY = SamplingConfig()
PROMPT = [5, 9, 2, 7, 1, 3]
UNSURE = DraftConfig(min_path_prob=0.3)  # the tiny draft's chains stop at several depths below 0.3 (at 1-2 below 0.5)


def draft(drafter, context, cfg, max_depth=1 << 30, given=0):
    """(chain, runner-ups) of one draft below `context`, from a fresh sequence."""
    job = DraftJob(drafter.start(context), [], cfg, GREEDY, max_depth=max_depth, given=given)
    return drafter.propose_batch([job])[0].tokens.tolist(), job.second


def recorded(tiny_target, drafter, tmp_path, n=24, cfg=DraftConfig()) -> tuple[Recording, list[int]]:
    out = target_only(tiny_target, PROMPT, n, GREEDY).token_ids
    record(drafter, [(PROMPT, out)], cfg, "test").save(tmp_path / "drafts.json")
    return Recording.load(tmp_path / "drafts.json"), out


def test_a_recording_answers_as_the_real_drafter_below_every_recorded_prefix(tiny_target, tiny_drafters, tmp_path):
    real = tiny_drafters["good"]
    rec, out = recorded(tiny_target, real, tmp_path, cfg=UNSURE)
    emulated = RecordedDrafter(real.model, dataclasses.replace(rec, cost=Cost(0, 0, 0)))
    lengths, hits = set(), []
    for i in range(len(out) + 1):
        context = PROMPT + out[:i]
        for depth in (1, 3, 10):
            cfg = dataclasses.replace(UNSURE, depth=depth)
            want = draft(real, context, cfg)
            assert draft(emulated, context, cfg) == want
            assert draft(emulated, context, UNSURE, max_depth=depth) == want  # the target's budget
            higher = dataclasses.replace(cfg, min_path_prob=0.5)  # a request that stops higher: the chain cut
            assert draft(emulated, context, higher) == draft(real, context, higher)  # where the real one stops
            lengths.add(len(want[0]))
        # a pre-draft of a whole chain's bonus guess (its first level given, a level deeper): as the real
        # one where the guess is the target's token, else an outcome that cannot happen, not recorded
        deeper = dataclasses.replace(UNSURE, depth=11)
        want = draft(real, context, deeper, given=1)
        hit = i < len(out) and want[0][0] == out[i]
        assert draft(emulated, context, deeper, given=1) == (want if hit else ([], []))
        hits.append(hit)
    assert len(lengths) > 2  # the chain rule stopped at several depths: min_path_prob was met
    assert any(hits) and emulated.misses == hits.count(False)
    emulated.misses = 0
    off = PROMPT + [out[0] ^ 1]  # no request of a lossless greedy star comes here
    assert draft(emulated, off, UNSURE) == ([], []) and emulated.misses == 1


def test_a_recorded_draft_takes_its_cost_and_yields_between_levels(tiny_target, tiny_drafters, tmp_path,
                                                                   monkeypatch):
    """What a draft sleeps is counted, not timed: a loaded host lengthens a sleep by any amount, so
    the wall clock bounds the cost from below only."""
    import starsd.emulate.draft_host as draft_host

    slept = []  # ms
    monkeypatch.setattr(draft_host, "time", types.SimpleNamespace(
        perf_counter=time.perf_counter, sleep=lambda s: slept.append(s * 1e3) or time.sleep(s)))
    cfg = DraftConfig(depth=4, min_path_prob=0.0)
    rec, out = recorded(tiny_target, tiny_drafters["perfect"], tmp_path, n=8, cfg=cfg)
    emulated = RecordedDrafter(tiny_drafters["perfect"].model, dataclasses.replace(rec, cost=Cost(10, 5, 40)))
    seq = emulated.start(PROMPT)
    slept.clear()
    start = time.perf_counter()
    tree = emulated.propose(seq, [], cfg, GREEDY)
    took = (time.perf_counter() - start) * 1e3
    assert tree.tokens.tolist() == out[:4]  # the perfect draft: the target's own tokens
    whole = 10 + 5 * (len(PROMPT) - 1) + 4 * 40  # the prompt's ingest and four levels
    assert sum(slept) == pytest.approx(whole) and took >= whole
    seq = emulated.start(PROMPT)
    slept.clear()
    cut = emulated.propose_batch([DraftJob(seq, [], cfg, GREEDY)], stop=lambda: True)[0]
    assert cut.tokens.tolist() == out[:1]  # a request came: no level after the first, nor its time
    assert sum(slept) == pytest.approx(whole - 3 * 40)
    # recorded whole, a chain is cut where a request's own threshold stops the real drafter
    unsure = DraftConfig(depth=4, min_path_prob=0.6)
    want, _ = draft(tiny_drafters["perfect"], PROMPT, unsure)
    assert emulated.propose(emulated.start(PROMPT), [], unsure, GREEDY).tokens.tolist() == want
    assert emulated.misses == 0
    recorded_higher = dataclasses.replace(rec, min_path_prob=0.3)  # below its recorded threshold: not known
    assert RecordedDrafter(emulated.model, recorded_higher).propose(
        emulated.start(PROMPT), [], cfg, GREEDY).tokens.tolist() == []
    # a batch of three streams: each level at the batch's cost, as measured, not three streams' own
    batched = RecordedDrafter(emulated.model, dataclasses.replace(rec, cost=Cost(10, 5, 40, batch=(1.0, 1.2, 1.5))))
    seqs = [batched.start(PROMPT) for _ in range(3)]
    slept.clear()
    batched.propose_batch([DraftJob(s, [], cfg, GREEDY) for s in seqs])
    assert sum(slept) == pytest.approx(10 + 5 * (3 * len(PROMPT) - 1) + 4 * 40 * 1.5)


def test_a_batched_levels_cost_is_measured_and_extended():
    cost = Cost(0, 0, 10, batch=(1.0, 1.25, 1.5))
    assert [cost.level_ms(b) for b in (1, 3, 5)] == [10, 15, 20]  # beyond: the last two's line
    assert Cost(0, 0, 10).level_ms(3) == 30  # a recording from before: each stream's level apart


def test_the_real_drafters_batches_cost_less_a_stream_than_streams_alone(tiny_drafters):
    scale = batch_scale(tiny_drafters["good"], PROMPT, DraftConfig(), sizes=3, repeats=5)
    assert len(scale) == 3 and scale[0] == 1.0 and all(s > 0 for s in scale)
    assert scale[2] < 3.0  # three streams' level in one batch: less than three levels of one


def test_a_draft_server_answering_from_a_recording_serves_the_real_drafters_steps(tiny_target, tiny_drafters, tmp_path):
    """Over the real server and transport, a fixed depth: the same steps as the real drafter drafting
    in the target's process, and the target's own output."""
    real = tiny_drafters["good"]
    rec, out = recorded(tiny_target, real, tmp_path, n=30)
    cfg = DraftConfig(depth=4, adaptive=False)
    local = speculative(tiny_target, real, PROMPT, 30, cfg, GREEDY)
    address = f"tcp://127.0.0.1:{free_port()}"
    emulated = RecordedDrafter(real.model, dataclasses.replace(rec, cost=Cost(1, 0, 1)))
    server = DraftServer(emulated, FP, 128, ServerConfig(bind=address, predraft=False))
    thread = server.start()
    warm_up = emulated.misses  # the server's warm-up drafts below tokens nobody recorded
    client = DraftClient(address, FP, "t", timeout_s=10, heartbeat_s=0)
    try:
        client.hello()
        remote = speculative(tiny_target, RemoteDrafter(client), PROMPT, 30, cfg, GREEDY)
    finally:
        client.close()
        server.stop()
        thread.join(timeout=5)
    assert remote.token_ids == local.token_ids == out
    assert remote.num_steps == local.num_steps < len(out) and emulated.misses == warm_up


def test_an_emulated_server_pre_drafts_a_session_that_took_a_shared_prefix(tiny_target, tiny_drafters, tmp_path,
                                                                        caplog):
    """Two streams whose prompts share 96 tokens: the second's session starts from the first's draft
    KV columns (prefix sharing, on by default), and the server pre-drafts both idle sessions' next
    steps, as the real drafter's server does. The emulated sequences' KV is the real one's size: a
    64-column one took the shared columns past its end, and every pre-draft of that session failed."""
    real = tiny_drafters["good"]
    long = [(7 * i + 3) % real.model.config.vocab_size for i in range(100)]
    cfg = DraftConfig(depth=4, min_path_prob=0.0, adaptive=False)
    out = target_only(tiny_target, long, 6, GREEDY).token_ids
    record(real, [(long, out)], cfg, "test").save(tmp_path / "drafts.json")
    emulated = RecordedDrafter(real.model, dataclasses.replace(Recording.load(tmp_path / "drafts.json"),
                                                               cost=Cost(1, 0, 1)))
    address = f"tcp://127.0.0.1:{free_port()}"
    server = DraftServer(emulated, FP, 128, ServerConfig(bind=address, predraft_cohosted=True))
    thread = server.start()
    clients = [DraftClient(address, FP, f"t{i}", timeout_s=10, heartbeat_s=0) for i in range(2)]
    want = draft(real, long, cfg)[0]
    try:
        for c in clients:
            c.hello()
            assert c.draft(long, 5, cfg, GREEDY)[1][0].tolist() == want
        deadline = time.monotonic() + 5
        while server.stats.snapshot(2)["predraft"]["outcomes"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = server.stats.snapshot(2)
    finally:
        for c in clients:
            c.close()
        server.stop()
        thread.join(timeout=5)
    assert stats["prefix"]["hits"] == 1 and stats["prefix"]["tokens"] == 96
    assert stats["predraft"]["outcomes"] >= 2
    assert "pre-draft" not in caplog.text
