"""The vLLM proposer's own parts (starsd/vllm): rows told apart, the chain vLLM gets, its settings, a
refusal met; no vLLM (its calls are made as vLLM's runner makes them, to a real draft server in this
process)."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from starsd.config import ProposerSettings, ServerConfig
from starsd.spec_decode.tree import DraftTree
from starsd.star.processes import free_port
from starsd.star.server import DraftServer
from starsd.vllm.kernels import expand
from starsd.vllm.proposer import Proposer, chain_of
from starsd.vllm.rows import claim, extends

FP = "f" * 64


def test_a_row_that_goes_on_keeps_its_stream():
    held = {0: [1, 2, 3], 1: [7, 8]}
    claims = claim({0: [1, 2, 3, 4, 5], 1: [7, 8, 9]}, held, {0: 0, 1: 1})
    assert [(c.row, c.stream) for c in claims] == [(0, 0), (1, 1)]


def test_a_row_moved_by_compaction_follows_its_request():
    """Request 0 finished; vLLM moved the batch's last row (request 2) into row 0."""
    held = {0: [1, 2], 1: [4, 5], 2: [7, 8]}
    claims = claim({0: [7, 8, 9], 1: [4, 5, 6]}, held, {0: 0, 1: 1, 2: 2})
    assert [(c.row, c.stream) for c in claims] == [(0, 2), (1, 1)]


def test_a_new_request_never_takes_another_requests_tokens():
    """A new prompt in a row whose old request ended opens a new stream, even where it shares a head
    with that request (a reset with its whole prefix, not a continuation of the other's)."""
    held = {0: [1, 2, 3, 4]}
    claims = claim({0: [1, 2, 9]}, held, {0: 0})
    assert [(c.row, c.stream) for c in claims] == [(0, None)]
    assert not extends([1, 2, 9], [1, 2, 3, 4]) and extends([1, 2, 3, 4], [1, 2, 3, 4])


def test_two_rows_that_extend_one_stream_share_nothing():
    """Two requests with the same prompt and the same first token: one keeps the stream, the other opens one."""
    held = {0: [1, 2, 3]}
    claims = claim({0: [1, 2, 3, 4], 1: [1, 2, 3, 4]}, held, {0: 0})
    assert [(c.row, c.stream) for c in claims] == [(0, 0), (1, None)]


def test_a_row_that_holds_no_more_than_a_streams_tokens_takes_none():
    """A copy of a prompt that sampled what another copy did, at the point where that copy's stream
    stands (its own row skipped this step): a new stream, not one with nothing new for its server
    (a request of no tokens, which the server refuses)."""
    held = {0: [1, 2, 3]}
    claims = claim({4: [1, 2, 3]}, held, {0: 0})
    assert [(c.row, c.stream) for c in claims] == [(4, None)]


def test_a_row_takes_the_longest_stream_it_extends():
    held = {0: [1, 2], 1: [1, 2, 3, 4]}
    claims = claim({3: [1, 2, 3, 4, 5]}, held, {0: 5, 1: 6})
    assert [(c.row, c.stream) for c in claims] == [(3, 1)]


def test_a_drafts_first_chain_is_what_vllm_gets():
    assert chain_of(DraftTree.chain([5, 6, 7])) == [5, 6, 7]
    tree = DraftTree(torch.tensor([5, 9, 6, 8]), torch.tensor([-1, -1, 0, 1]))  # two branches
    assert chain_of(tree) == [5, 6] and chain_of(DraftTree.empty()) == []


def test_the_repaired_expand_spreads_each_requests_value_over_its_tokens():
    """vLLM's expand kernel's contract (vllm/kernels.py): request r's value on each of its tokens, floats
    kept as floats, replace_from replaced (vLLM marks a greedy request's temperature so)."""
    out = torch.full((6,), -9.0)
    expand(out, torch.tensor([0.5, -1.0, 0.75]), torch.tensor([2, 3, 6], dtype=torch.int32), -1.0, 1.0)
    assert out.tolist() == [0.5, 0.5, 1.0, 0.75, 0.75, 0.75]
    ints = torch.zeros(3, dtype=torch.int64)
    expand(ints, torch.tensor([4, 9]), torch.tensor([0, 3]), 0, 0)
    assert ints.tolist() == [9, 9, 9]  # a request with no drafted token takes none


def test_the_proposers_settings_come_from_the_environment():
    import pytest

    from starsd.config import ProposerSettings
    from starsd.errors import SettingError

    s = ProposerSettings.from_env({"STARSD_CONNECT": "tcp://h:1,tcp://h:2", "STARSD_TIMEOUT_S": "5",
                                   "STARSD_ADAPTIVE": "0", "STARSD_COHOSTED": "no"})
    assert (s.connect, s.timeout_s, s.adaptive, s.cohosted) == ("tcp://h:1,tcp://h:2", 5.0, False, "no")
    with pytest.raises(SettingError, match="STARSD_CONNECT"):
        ProposerSettings.from_env({})
    with pytest.raises(SettingError, match="STARSD_COHOSTED"):
        ProposerSettings.from_env({"STARSD_CONNECT": "tcp://h:1", "STARSD_COHOSTED": "maybe"})


@pytest.fixture
def server(tiny_drafters):
    address = f"tcp://127.0.0.1:{free_port()}"
    s = DraftServer(tiny_drafters["good"], FP, 128, ServerConfig(bind=address))
    thread = s.start()
    yield address
    s.stop()
    thread.join(timeout=5)


def test_a_refused_row_decodes_alone_and_the_others_draft_on(server):
    """Row 1 holds a token the server's 128-token vocabulary has not: the server refuses its request
    (bad_tokens). vLLM's step still gets every row's draft but that one's, no exception reaches vLLM,
    and the next step drafts again."""
    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3),
                                  model_config=SimpleNamespace(max_model_len=256))
    proposer = Proposer(vllm_config, ProposerSettings(connect=server, timeout_s=10.0, adaptive=False, cohosted_drafts=True), fingerprint=FP)
    tokens = np.zeros((2, 64), dtype=np.int64)
    tokens[0, :6] = [1, 2, 3, 4, 5, 6]
    tokens[1, :6] = [1, 2, 3, 4, 5, 500]
    for step in range(2):
        n = 6 + step
        drafts = proposer.propose([[int(tokens[0, n - 1])], [500]], np.array([n, n]), tokens)
        assert drafts[0] and drafts[1] == []
        assert proposer.counters.errors == step + 1
        tokens[0, n] = drafts[0][0]  # vLLM accepted the first drafted token
        tokens[1, n] = 500
    proposer.close()


def test_a_requests_first_draft_which_ingests_its_prefix_is_no_drafts_cost(server):
    """A row's first request carries its whole prefix: waited for, its wait was the server's ingest of the
    prompt as well as a draft, and counted as a draft's cost it made every later draft look that much
    dearer. The row's first step asks it ahead (the drafter catches up, as after steps decoded alone), once
    its session is open, and gives no draft; the draft waited for at the next step ingests no prompt, and is counted, as each
    later draft waited for is."""
    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3),
                                  model_config=SimpleNamespace(max_model_len=256))
    proposer = Proposer(vllm_config, ProposerSettings(connect=server, timeout_s=10.0, cohosted_drafts=True),
                        fingerprint=FP)
    tokens = np.zeros((1, 128), dtype=np.int64)
    n = 60
    tokens[0, :n] = np.arange(n) % 100 + 1
    steps = []  # (a draft given, its wait as the stream will count it, draft costs counted so far)
    for step in range(8):
        time.sleep(0.05)  # vLLM's pass: what a draft saves is weighed against it
        drafts = proposer.propose([[int(tokens[0, n - 1])]], np.array([n]), tokens)
        stream = proposer.streams[0]
        steps.append((bool(drafts[0]), stream.draft_ms, sum(map(len, stream.policy.draft_ms.samples.values()))))
        tokens[0, n] = (tokens[0, n - 1] + 7) % 100 + 1  # vLLM took none of the draft: its own token
        n += 1
    proposer.close()
    first = next(i for i, (given, _, _) in enumerate(steps) if given)  # the step after the prefix went out:
    # its first step's, or the next's where the session's Welcome had not come (an ask ahead does not wait for it)
    assert 1 <= first <= 2 and all(wait is None for _, wait, _ in steps[:first]) and steps[first][2] == 0
    for (_, wait, before), (_, _, after) in zip(steps[first:], steps[first + 1:]):
        assert after == before + (wait is not None)  # a later draft waited for is counted at the next step


def test_an_engines_own_rows_are_not_each_others_neighbours(server):
    """A co-hosted server's compute slows the other targets on its host (a stream charges it to each),
    but not the other rows of the same vLLM engine: they wait for their drafts together, and each row's
    wait already holds the batch's compute. Another engine's rows are neighbours."""
    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3),
                                  model_config=SimpleNamespace(max_model_len=256))
    settings = ProposerSettings(connect=server, timeout_s=10.0, cohosted="yes", cohosted_drafts=True)
    mine, other = (Proposer(vllm_config, settings, fingerprint=FP) for _ in range(2))
    tokens = np.tile(np.arange(1, 65, dtype=np.int64), (4, 1))
    tokens[:, 5] = [7, 8, 9, 10]  # four requests: three in one engine, one in the other

    def step(n):
        mine.propose([[int(tokens[i, n - 1])] for i in range(3)], np.array([n] * 3), tokens[:3])
        other.propose([[int(tokens[3, n - 1])]], np.array([n]), tokens[3:])

    step(6)
    streams = mine.streams + other.streams
    until = time.monotonic() + 10
    while any(st.drafter.neighbours != 3 for st in streams) and time.monotonic() < until:
        time.sleep(0.05)  # heartbeats: each session hears that the server has 4 on its host
    step(7)
    assert [st.drafter.neighbours for st in streams] == [3, 3, 3, 3]
    assert [st.source.neighbours for st in mine.streams] == [1, 1, 1]  # the other engine's row
    assert [st.source.neighbours for st in other.streams] == [3]
    mine.close()
    other.close()


def test_an_engine_preloads_its_venvs_intel_openmp(tmp_path):
    """vLLM's CPU build wants its venv's libiomp5 preloaded. A venv's python is a link to the base
    interpreter: the library is found beside the venv's own bin, not the base's."""
    import sys

    from starsd.bench.vllm_runs import engine_env

    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    assert engine_env(str(tmp_path / "bin" / "python"))["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")


def test_beside_a_server_on_its_own_cores_vllm_decodes_alone_unless_told(server, caplog):
    """A draft server on this host computes on vLLM's cores: by default the plug-in opens no session
    and gives every row an empty draft, saying why once; STARSD_COHOSTED=no (the server has cores of
    its own) or STARSD_COHOSTED_DRAFTS drafts."""
    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3),
                                  model_config=SimpleNamespace(max_model_len=256))
    tokens = np.tile(np.arange(1, 65, dtype=np.int64), (2, 1))

    def drafts(settings: ProposerSettings) -> list[list[int]]:
        proposer = Proposer(vllm_config, settings, fingerprint=FP)
        try:
            return proposer.propose([[6], [6]], np.array([6, 6]), tokens), proposer.counters.sessions
        finally:
            proposer.close()

    with caplog.at_level("WARNING", logger="starsd.vllm"):
        assert drafts(ProposerSettings(connect=server, timeout_s=10.0, adaptive=False)) == ([[], []], 0)
    assert "decodes alone" in caplog.text and "STARSD_COHOSTED=no" in caplog.text
    for told in ({"cohosted": "no"}, {"cohosted_drafts": True}):
        got, sessions = drafts(ProposerSettings(connect=server, timeout_s=10.0, adaptive=False, **told))
        assert all(got) and sessions == 2, told


def test_a_server_of_another_vocabulary_is_said_once_and_vllm_decodes_alone(server, caplog):
    """Hellos refused for good (vocab_mismatch): an error line for each request of the step that met it,
    the rows decode alone from then on, and no line at a later step."""
    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3),
                                  model_config=SimpleNamespace(max_model_len=256))
    proposer = Proposer(vllm_config, ProposerSettings(connect=server, timeout_s=10.0, adaptive=False,
                                                      cohosted_drafts=True), fingerprint="e" * 64)
    tokens = np.tile(np.arange(1, 65, dtype=np.int64), (3, 1))
    tokens[:, 5] = [7, 8, 9]
    caplog.clear()  # (the plug-in's line about vLLM's kernel, absent here)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")
                and r.name != "starsd.server"]

    with caplog.at_level("INFO", logger="starsd"):
        for n in range(6, 12):
            assert proposer.propose([[int(tokens[i, n - 1])] for i in range(3)], np.array([n] * 3), tokens) == [[]] * 3
            if n == 6:
                first = said()
    assert 1 <= len(first) <= 3 and all("vocab_mismatch" in line for line in first)  # a line a request at most
    assert said() == first and proposer.alone  # and none at a later step
    assert proposer.streams == [] and len(proposer.connections) == 0
    proposer.close()
