"""Shared prefixes on a draft server: a stream whose prompt begins with tokens another stream's
draft KV holds (live, or retired after its session left) starts from a copy of them, drafts as it
would have from nothing, and the retired state gives way first when the budget is short."""

import time

import pytest

from starsd.config import DraftConfig, SamplingConfig, ServerConfig
from starsd.star.client import DraftClient
from starsd.star.prefixes import BLOCK, PrefixIndex, block_hashes
from starsd.star.processes import free_port
from starsd.star.server import DraftServer

FP = "f" * 64
CHAIN = (DraftConfig(depth=3, min_path_prob=0.0, adaptive=False), SamplingConfig())
KIB = 1 / (1 << 20)  # in GiB
SHARED = [1 + (7 * i) % 120 for i in range(3 * BLOCK)]  # three blocks


def test_the_index_names_each_whole_block_prefix_by_its_last_owner():
    index = PrefixIndex()
    index.register(1, SHARED + [5, 6])
    index.register(2, SHARED[:BLOCK] + [9] * BLOCK)
    assert index.candidates(SHARED + [7]) == [(3 * BLOCK, 1), (2 * BLOCK, 1), (BLOCK, 2)]
    index.move(1, -1)  # a session's state retired under a key of its own
    assert index.candidates(SHARED) == [(3 * BLOCK, -1), (2 * BLOCK, -1), (BLOCK, 2)]
    index.drop(2)
    assert index.candidates(SHARED[:BLOCK]) == [] and len(index) == 2
    assert block_hashes(SHARED, upto=2 * BLOCK + 3) == block_hashes(SHARED)[:2]


@pytest.fixture
def servers(tiny_drafters):
    """"small": a 180 KiB draft KV budget (the tiny draft holds 512 B a token, and a new stream of n
    tokens (n + 64): a 50-token one 57 KiB); "roomy": 8 GiB."""
    made = {}
    for name, budget in (("small", 180 * KIB), ("roomy", 8.0)):
        address = f"tcp://127.0.0.1:{free_port()}"
        server = DraftServer(tiny_drafters["good"], FP, 128, ServerConfig(bind=address, kv_budget_gib=budget,
                                                                          predraft=False))
        made[name] = (server, address, server.start())
    yield {name: (server, address) for name, (server, address, _) in made.items()}
    for server, _, thread in made.values():
        server.stop()
        thread.join(timeout=5)


def client(address: str, name: str) -> DraftClient:
    c = DraftClient(address, FP, name, timeout_s=10, heartbeat_s=0)
    c.hello()
    return c


def first_draft(server: DraftServer, address: str, name: str, prompt: list[int]) -> list[int]:
    """A new stream's first draft, its session then left (its state retired)."""
    c = client(address, name)
    tokens = c.draft(prompt, 5, *CHAIN)[1][0].tolist()
    c.close()
    deadline = time.monotonic() + 5
    while len(server.sessions) and time.monotonic() < deadline:  # the Bye is handled by the compute loop
        time.sleep(0.01)
    return tokens


def test_a_stream_starts_from_the_prefix_another_holds_and_drafts_as_from_nothing(servers):
    server, address = servers["roomy"]
    a = client(address, "a")
    a.draft(SHARED + [3, 4], 5, *CHAIN)
    prompt = SHARED + [8, 9, 10]
    assert first_draft(server, address, "b", prompt) == first_draft(*servers["small"], "b", prompt)  # from nothing
    assert server.stats.prefix_hits == 1 and server.stats.prefix_tokens == 3 * BLOCK
    a.draft([5], 5)  # the one it was taken from goes on
    a.close()


def test_a_retired_stream_is_a_prefix_until_the_budget_needs_its_room(servers):
    server, address = servers["small"]
    first_draft(server, address, "a", SHARED + [3, 4])
    assert server.sessions.retired_bytes() > 0
    prompt = SHARED + [8, 9]
    assert first_draft(server, address, "b", prompt) == first_draft(*servers["roomy"], "b", prompt)
    assert server.stats.prefix_hits == 1 and server.stats.prefix_tokens == 3 * BLOCK
    held = server.sessions.retired_bytes()  # a's and b's states, retired
    c = client(address, "long")  # 130 tokens, 97 KiB: room for one of them only
    c.draft([2 + i % 100 for i in range(130)], 5, *CHAIN)
    assert 0 < server.sessions.retired_bytes() < held
    assert server.stats.sessions_evicted == 0 and not server.stats.errors
    c.close()
