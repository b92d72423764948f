"""The vLLM proposer's own parts (starsd/vllm): rows told apart, the chain vLLM gets, its settings; no vLLM."""

import torch

from starsd.spec.tree import DraftTree
from starsd.vllm.proposer import chain_of
from starsd.vllm.rows import claim, extends


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


def test_a_row_takes_the_longest_stream_it_extends():
    held = {0: [1, 2], 1: [1, 2, 3, 4]}
    claims = claim({3: [1, 2, 3, 4, 5]}, held, {0: 5, 1: 6})
    assert [(c.row, c.stream) for c in claims] == [(3, 1)]


def test_a_drafts_first_chain_is_what_vllm_gets():
    assert chain_of(DraftTree.chain([5, 6, 7])) == [5, 6, 7]
    tree = DraftTree(torch.tensor([5, 9, 6, 8]), torch.tensor([-1, -1, 0, 1]))  # two branches
    assert chain_of(tree) == [5, 6] and chain_of(DraftTree.empty()) == []


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
