"""Target servers that serve several streams at once (--target-streams).

On llama.cpp the streams are slots of one context, their passes gathered into one llama_decode
(models/llamacpp.py): each stream must get what it gets alone (its trees and rollbacks in its own
sequences, never touching another's), and the passes must really be shared. Through `starsd serve`
(real processes: a draft server, a llama.cpp target server of 2 streams, the gateway), two requests
run on the one target at once, each with its own draft session, and a third is refused while both
slots are taken. On transformers the streams' scoring passes are gathered too, into one forward
pass over rows of different lengths (models/target.py, score_batch).
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import signal
import threading
import time
import weakref

import httpx2 as httpx
import pytest
import torch

import tiny
from gguf_tiny import VOCAB, write_tiny_model_dir
from starsd.config import SamplingConfig
from starsd.models.batcher import Job
from starsd.models.target import TargetModel
from starsd.spec_decode.decode import target_only
from starsd.spec_decode.tree import DraftTree
from starsd.spec_decode.verify import Verdict
from starsd.star.processes import free_port, read_json_line, spawn

if not os.environ.get("STARSD_REQUIRE_REAL"):  # make test builds it: missing is a failure there
    pytest.importorskip("llama_cpp")
from starsd.models.llamacpp import LlamaCppTarget  # noqa: E402

GREEDY = SamplingConfig(temperature=0.0)
MODEL = "tiny-gguf"
#         root -> 0 -> 1 -> 2;  0 -> 3;  root -> 4 -> 5;  4 -> 6 -> 7, then a chain, nothing, alone, wider
STEPS = [([-1, 0, 1, 0, -1, 4, 4, 6], [4, 6, 7]), ([-1, 0, 1, 2], [0, 1]), ([-1, -1, -1, 2, 2], []), ([], []),
         ([-1, 0, 0, 1, 1, 2, 2], [0, 2, 5])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny GGUF with its tokenizer and a transformers copy beside it (the draft, and the reference)."""
    return write_tiny_model_dir(tmp_path_factory.mktemp("streams"))


def run_steps(target, prompt: list[int], seed: int, vocab: int = len(VOCAB)) -> list[torch.Tensor]:
    """Score STEPS' trees on `target` (a slot, or a reference), committing each step's path: each pass's logits."""
    seq = target.start(prompt)
    out = []
    for i, (parents, path) in enumerate(STEPS):
        g = torch.Generator().manual_seed(seed * 100 + i)
        tree = DraftTree(torch.randint(0, vocab, (len(parents),), generator=g), torch.tensor(parents))
        out.append(target.score(seq, tree))
        bonus = int(torch.randint(0, vocab, (1,), generator=g))
        target.commit(seq, Verdict(path, [int(tree.tokens[j]) for j in path] + [bonus]))
    out.append(target.score(seq, DraftTree.empty()))
    return out


def steps_together(slots, prompts: list[list[int]], vocab: int = len(VOCAB)) -> dict[int, list[torch.Tensor]]:
    """run_steps on each slot at once, a thread each (released together), each slot ended after."""
    got: dict[int, list[torch.Tensor]] = {}
    barrier = threading.Barrier(len(prompts))

    def stream(i: int) -> None:
        barrier.wait()
        got[i] = run_steps(slots[i], prompts[i], seed=i, vocab=vocab)
        slots[i].end()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


def test_slots_score_trees_together_each_as_if_alone(model_dir):
    """Three streams on three slots of one context, each driven by its own thread through trees
    whose paths leave other branches behind: every pass's logits are those the same engine computes
    for that stream alone (up to the rounding of a batch of other rows), and the streams' passes
    were gathered (fewer llama_decodes than passes asked). tests/test_llamacpp.py checks the
    engine alone against transformers."""
    llama = LlamaCppTarget(model_dir / "model.gguf", threads=1, streams=3)
    prompts = [torch.randint(0, len(VOCAB), (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (17, 40, 5)]
    got = steps_together(llama.slots, prompts)
    assert llama.batcher.passes < llama.batcher.asked
    again = run_steps(llama.slots[1], prompts[1], seed=1)  # an ended slot takes a new stream
    llama.close()
    alone = LlamaCppTarget(model_dir / "model.gguf", threads=1)
    for i, prompt in enumerate(prompts):
        want = run_steps(alone, prompt, seed=i)
        assert len(got[i]) == len(want)
        for a, b in zip(got[i] + (again if i == 1 else []), want + (want if i == 1 else [])):
            assert (a - b).abs().max().item() < 1e-2 * max(1.0, b.abs().max().item())  # attending to another
            # stream's cells would move them by about their own size; a batch of other rows rounds at 1e-3
    alone.close()


def test_greedy_streams_decoded_together_equal_each_decoded_alone(model_dir):
    alone = LlamaCppTarget(model_dir / "model.gguf", threads=1)
    prompts = [list(range(10 + i, 30 + 3 * i)) for i in range(4)]
    want = [target_only(alone, p, 40, GREEDY).token_ids for p in prompts]
    alone.close()
    shared = LlamaCppTarget(model_dir / "model.gguf", threads=1, streams=4)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: target_only(shared.slots[i], prompts[i], 40, GREEDY).token_ids, range(4)))
    assert got == want
    assert shared.batcher.passes < shared.batcher.asked
    shared.close()


def test_transformers_streams_scored_together_each_as_if_alone():
    """The transformers engine's slots: three streams of different lengths through trees whose paths
    leave other branches behind, their passes gathered into shared forward passes (fewer passes
    than asked, some of them batches); every pass's logits are the stream's alone ones up to float32
    rounding (attending to another stream's or a padding column would move them by their own size),
    and greedy streams decoded together equal each decoded alone."""
    model = tiny.tiny_model(1)
    vocab = model.config.vocab_size
    shared, alone = TargetModel(model, streams=3), TargetModel(model)
    prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (17, 40, 5)]
    batched = []
    real = shared.score_batch

    def score_batch(seqs, trees):
        batched.append(len(seqs))
        return real(seqs, trees)

    shared.score_batch = score_batch
    got = steps_together(shared.slots, prompts, vocab)
    assert shared.batcher.passes < shared.batcher.asked and batched and max(batched) > 1
    for i, prompt in enumerate(prompts):
        want = run_steps(alone, prompt, seed=i, vocab=vocab)
        assert len(got[i]) == len(want)
        for a, b in zip(got[i], want):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    prompts = [list(range(3 + i, 20 + 2 * i)) for i in range(3)]
    want = [target_only(alone, p, 24, GREEDY).token_ids for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda i: target_only(shared.slots[i], prompts[i], 24, GREEDY).token_ids, range(3)))
    assert got == want


def complete(url: str, prompt: str, max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_an_engine_dropped_ends_its_batcher_thread_and_is_freed(model_dir):
    """A target with several streams passes through its Batcher's thread; once nothing else holds the
    engine, the thread ends and the engine (its model, its llama.cpp context) is freed, rather than
    kept for the life of the process by a thread that loops forever."""
    for make in (lambda: TargetModel(tiny.tiny_model(1), streams=2),
                 lambda: LlamaCppTarget(model_dir / "model.gguf", threads=1, streams=2)):
        engine = make()
        steps_together(engine.slots, [[5, 6, 7], [8, 9]], engine.width)  # it served
        gone = weakref.ref(engine)
        thread = engine.batcher.thread
        del engine
        gc.collect()
        thread.join(timeout=5)
        assert gone() is None and not thread.is_alive()


def test_an_engine_closed_ends_its_batcher_thread_at_once(model_dir):
    """close() ends the Batcher's thread at once, while the caller still holds the engine; a stream
    that asks for a pass after that hears that the engine was closed instead of waiting forever."""
    for make in (lambda: TargetModel(tiny.tiny_model(1), streams=2),
                 lambda: LlamaCppTarget(model_dir / "model.gguf", threads=1, streams=2)):
        engine = make()
        steps_together(engine.slots, [[5, 6, 7], [8, 9]], engine.width)
        engine.close()
        assert not engine.batcher.thread.is_alive()
        with pytest.raises(RuntimeError, match="closed"):
            engine.batcher.submit(Job())


def test_serve_routes_two_streams_to_one_target_and_refuses_a_third(model_dir):
    """`starsd serve` with one llama.cpp target server of 2 streams and no queue: two requests at
    once both run on it (each its own draft session on the draft server) and equal llama.cpp's
    own greedy output; a third, while both slots are taken, gets 503 at once."""
    port = free_port()
    proc = spawn(["serve", "--targets", "1", "--target-streams", "2", "--port", str(port), "--target", str(model_dir),
                  "--draft", str(model_dir), "--target-engine", "llamacpp", "--dtype", "float32",
                  "--draft-quantize", "none", "--draft-depth", "3", "--no-draft-adaptive", "--max-queue", "0",
                  "--served-model-name", MODEL])
    try:
        read_json_line(proc, "ready", 300)
        url = f"http://127.0.0.1:{port}"
        prompts = ["def add(a, b):", "import os\nfor x in"]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda p: complete(url, p, 64), prompts))
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        from starsd.models.loading import load_tokenizer

        tok = load_tokenizer(str(model_dir))
        alone = LlamaCppTarget(model_dir / "model.gguf", threads=1)
        for prompt, answer in zip(prompts, answers):
            ids = tok.encode(prompt, add_special_tokens=False)
            want = tok.decode(target_only(alone, ids, 64, GREEDY).token_ids, skip_special_tokens=True)
            assert answer.json()["choices"][0]["text"] == want
        alone.close()
        metrics = httpx.get(url + "/metrics").text
        assert "starsd:draft_server_sessions_open 2.0" in metrics
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(complete, url, prompts[0], 400) for _ in range(2)]
            deadline = time.monotonic() + 60
            while httpx.get(url + "/health").json()["running"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            third = complete(url, prompts[1], 8)
            assert third.status_code == 503 and "busy" in third.json()["error"]["message"]
            assert [f.result().status_code for f in futures] == [200, 200]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_the_gateway_hands_out_free_slots_least_loaded_target_first():
    """IdleTargets: a target of S streams takes up to S requests, each to the target with the most
    free slots; a slot given back twice is still one slot."""
    import asyncio

    import zmq.asyncio

    from starsd.serve.pool import IdleTargets, TargetLink
    from starsd.star import protocol as P

    async def scenario():
        ctx = zmq.asyncio.Context()
        a, b = (TargetLink(ctx, f"tcp://127.0.0.1:{free_port()}") for _ in range(2))
        a.info = P.TargetInfo("a", "m", 4096, False, False, streams=3)
        b.info = P.TargetInfo("b", "m", 4096, False, False, streams=1)
        idle = IdleTargets()
        idle.fill(a)
        idle.fill(b)
        assert len(idle) == 4
        got = [await idle.get() for _ in range(4)]
        assert [link.info.name for link in got] == ["a", "a", "a", "b"]  # 3:1, 2:1, then a tie: the first
        idle.put(b)
        idle.put(b)  # b serves one stream: never two free slots
        assert len(idle) == 1 and await idle.get() is b
        waiter = asyncio.ensure_future(idle.get())  # nothing free: it waits
        await asyncio.sleep(0)
        idle.put(a)
        assert await waiter is a and len(idle) == 0
        for link in (a, b):
            link.close()
        ctx.term()

    asyncio.run(scenario())


def test_a_stream_in_a_shared_pass_is_charged_its_share_of_it(model_dir):
    """The depth policy weighs a draft against decoding alone by what each costs the stream: in a
    pass shared with other streams, its rows' part of the pass. Charged the whole pass, a stream
    beside others found one-token passes dear (80 ms for two streams' rows) against the two-token
    pass it had measured alone (79 ms), and had its co-hosted draft server ingest prompts for drafts
    that could not pay."""
    llama = LlamaCppTarget(model_dir / "model.gguf", threads=1, streams=2)
    seqs = [llama.slots[i].start(list(range(5 + i, 40))) for i in range(2)]
    barrier = threading.Barrier(2)

    def one(i: int, width: int) -> None:
        barrier.wait()
        llama.slots[i].score(seqs[i], DraftTree.chain([7] * (width - 1)))

    for _ in range(5):  # both asks within the batcher's gathering window: on a loaded machine, maybe not at once
        before = llama.batcher.passes
        threads = [threading.Thread(target=one, args=(i, w)) for i, w in ((0, 1), (1, 3))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if llama.batcher.passes == before + 1:  # one llama_decode of both streams' rows
            break
        for i in range(2):
            llama.slots[i].commit(seqs[i], Verdict([], [9]))
    assert llama.batcher.passes == before + 1
    assert seqs[0].pass_ms > 0 and abs(seqs[1].pass_ms - 3 * seqs[0].pass_ms) < 1e-6 * seqs[1].pass_ms
    llama.close()
    alone = LlamaCppTarget(model_dir / "model.gguf", threads=1)
    seq = alone.start(list(range(5, 40)))
    alone.score(seq, DraftTree.empty())
    assert seq.pass_ms is None  # its own pass: the loop's clock is its cost
    alone.close()


@pytest.fixture
def two_stream_server():
    """A target server of 2 streams on the tiny transformers target (decoding alone), in this
    process, and a function that opens a DEALER to it."""
    import zmq

    from starsd.config import DraftConfig
    from starsd.models.pair import Pair
    from starsd.star.target_server import TargetServer

    address = f"tcp://127.0.0.1:{free_port()}"
    pair = Pair(TargetModel(tiny.tiny_model(1), streams=2), None, tiny.char_tokenizer(), frozenset({0}))
    server = TargetServer(pair, address, None, DraftConfig(), "t0", "tiny")
    ready = threading.Event()
    thread = threading.Thread(target=server.serve, kwargs={"on_ready": ready.set}, daemon=True)
    thread.start()
    assert ready.wait(30)
    ctx = zmq.Context()
    socks = []

    def peer():
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
        return sock

    yield server, peer
    server.stop()
    thread.join(30)
    for sock in socks:
        sock.close(0)
    ctx.term()


def generate(sock, stream_id: int, prompt: str, max_tokens: int) -> None:
    from starsd.star import protocol as P

    sock.send_multipart(P.encode(P.Generate(stream_id, prompt, None, max_tokens, P.SamplingConfig(), (), True)))


def last_message(sock, timeout_s: float = 60):
    """Read a stream's messages to its last: its final Output or an Error."""
    from starsd.star import protocol as P

    while True:
        assert sock.poll(timeout_s * 1000), "no answer"
        msg, _ = P.decode(sock.recv_multipart())
        if isinstance(msg, P.Error) or msg.finish:
            return msg


def test_a_cancel_ends_the_stream_of_its_sender_only(two_stream_server):
    """Stream ids are each sender's own: two gateways may both run a stream 5 on one target. A
    Cancel of one ended both, and the first to end cleared the other's cancel."""
    from starsd.star import protocol as P

    server, peer = two_stream_server
    a, b = peer(), peer()
    generate(a, 5, "def f(x):", 1000)
    generate(b, 5, "def g(y):", 300)
    for sock in (a, b):  # both streams run
        assert sock.poll(60_000)
        sock.recv_multipart()
    a.send_multipart(P.encode(P.Cancel(5)))
    assert last_message(a).finish == "cancelled"
    assert last_message(b).finish == "length"


def test_a_stream_that_fails_outside_its_steps_frees_its_slot(two_stream_server, monkeypatch):
    """An exception before a stream's steps (here: encoding its prompt) killed the slot's worker:
    the slot stayed taken, or took requests nobody served. Now the stream gets an `internal` error
    and the slot serves the next one."""
    from starsd.star import protocol as P

    server, peer = two_stream_server
    encode = server._encode

    def fails_on_boom(req):
        if req.prompt == "boom":
            raise RuntimeError("a tokenizer bug")
        return encode(req)

    monkeypatch.setattr(server, "_encode", fails_on_boom)
    sock = peer()
    for i in range(3):  # more failures than slots: every one must come back
        generate(sock, 10 + i, "boom", 8)
        error = last_message(sock)
        assert isinstance(error, P.Error) and error.code == "internal" and error.tag == 10 + i
    for i in range(2):
        generate(sock, 20 + i, "def f(x):", 8)
    assert [last_message(sock).finish for _ in range(2)] == ["length", "length"]
    assert not server.info().busy


def test_a_pass_that_fails_for_one_stream_fails_that_stream_only(model_dir):
    """Two streams' rows in one llama_decode, one of them with a token outside the vocabulary:
    llama.cpp refuses the whole batch. The stream whose rows were fine gets its logits."""
    from starsd.errors import StarsdError

    llama = LlamaCppTarget(model_dir / "model.gguf", threads=1, streams=2)
    seqs = [llama.slots[i].start(list(range(5 + i, 30))) for i in range(2)]
    barrier = threading.Barrier(2)
    out: dict[int, object] = {}

    def one(i: int, token: int) -> None:
        barrier.wait()
        try:
            out[i] = llama.slots[i].score(seqs[i], DraftTree.chain([token]))
        except StarsdError as e:
            out[i] = e

    threads = [threading.Thread(target=one, args=(i, t)) for i, t in ((0, 7), (1, len(VOCAB) + 50))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(out[0], torch.Tensor) and out[0].shape == (2, len(VOCAB))
    assert isinstance(out[1], StarsdError)
    llama.close()
