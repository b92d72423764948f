"""The wire format alone: round trips and validation, no sockets."""

import dataclasses

import msgspec
import pytest
import torch

from starsd.config import MAX_DRAFT_NODES, DraftConfig, SamplingConfig
from starsd.star import protocol as P

DRAFT = DraftConfig(depth=4, min_path_prob=0.3)
SAMPLING = SamplingConfig()


def roundtrip(msg, tensors=()):
    return P.decode([bytes(f) for f in P.encode(msg, tensors)])


def test_request_and_reply_round_trip_with_raw_tensors():
    tokens = torch.tensor([1, 2, 3], dtype=torch.int32)
    hidden = torch.randn(3, 8, dtype=torch.bfloat16)
    msg, (t, h) = roundtrip(P.DraftRequest(5, 0, True, DRAFT, SAMPLING, 9, P.specs(tokens, hidden)), (tokens, hidden))
    assert msg.draft == DRAFT and msg.sampling == SAMPLING and torch.equal(t, tokens) and torch.equal(h, hidden)
    ids = torch.tensor([[7, 3, 9], [1, 8, 2]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.25, 0.25], [0.125, 0.875, 0.0]], dtype=torch.float16)
    tree = (torch.tensor([7, 8], dtype=torch.int32), torch.tensor([-1, 0], dtype=torch.int32), ids, weights)
    reply, (tok, par, ids2, w2) = roundtrip(P.DraftReply(5, 0, 0.1, 2.0, 3, P.specs(*tree)), tree)
    assert reply.batch_size == 3 and torch.equal(par, tree[1]) and torch.equal(ids2, ids) and torch.equal(w2, weights)


def test_every_message_type_round_trips():
    for msg in (P.Hello(1, "ab", "t"), P.Welcome(3, "s", 64), P.Welcome(3, "s", 64, None, 12.5), P.Bye(3), P.Error("x", "y", 1, 2), P.Ping(1, 2.0),
                P.Pong(1, 2.0), P.Pong(1, 2.0, False, 7.5), P.StatsRequest(), P.Stats("{}")):
        assert roundtrip(msg)[0] == msg


def bad(frames, code):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frames)
    assert e.value.code == code, e.value


def test_malformed_frames_are_rejected_with_a_code():
    tokens = torch.tensor([1, 2], dtype=torch.int32)
    req = P.encode(P.DraftRequest(1, 0, False, None, None, 5, P.specs(tokens)), (tokens,))
    bad([], "empty")
    bad([b""], "empty")
    bad([b"\x63" + req[0][1:]], "unknown_type")
    bad([req[0][:5]], "bad_header")
    bad([bytes([P.MsgType.HELLO]) + msgspec.msgpack.encode([1, 2, 3])], "bad_header")  # wrong field types
    bad([req[0]], "bad_frames")
    bad([req[0], b"123"], "bad_tensor")
    bad([req[0], bytes(req[1]), b"extra"], "bad_frames")


def with_settings(draft: dict, sampling: dict) -> list[bytes]:
    """A reset request whose settings are given as raw maps (no DraftConfig could hold bad values)."""
    tokens = torch.zeros(2, dtype=torch.int32)
    header = [1, 0, True, draft, sampling, 5, [["int32", [2]]]]
    return [bytes([P.MsgType.DRAFT_REQUEST]) + msgspec.msgpack.encode(header), bytes(memoryview(tokens.numpy()))]


def test_settings_travel_by_name():
    draft = dataclasses.asdict(DRAFT)
    msg, _ = P.decode(with_settings({k: draft[k] for k in reversed(draft)}, {"seed": 7}))  # any order
    assert msg.draft == DRAFT and msg.sampling == SamplingConfig(seed=7)  # missing names take defaults


def test_payload_rules_are_enforced():
    def request(tokens, **kw):
        fields = dict(tag=1, step=0, reset=False, draft=None, sampling=None, budget=5) | kw
        return [bytes(f) for f in P.encode(P.DraftRequest(**fields, tensors=P.specs(tokens)), (tokens,))]

    bad(request(torch.zeros(0, dtype=torch.int32)), "bad_request")
    bad(request(torch.zeros(2, dtype=torch.float32)), "bad_request")
    bad(request(torch.zeros(2, dtype=torch.int32), reset=True), "bad_request")  # reset without settings
    bad(request(torch.zeros(2, dtype=torch.int32), reset=True, draft=DRAFT), "bad_request")  # ... or half of them
    bad(request(torch.zeros(2, dtype=torch.int32), budget=0), "bad_request")
    for stop in (1.0, -0.5, 2.0, float("nan"), float("inf")):  # a draft's own chain threshold: [0, 1), or -1
        bad(request(torch.zeros(2, dtype=torch.int32), stop=stop), "bad_request")
    for stop in (-1.0, 0.0, 0.62):
        assert P.decode(request(torch.zeros(2, dtype=torch.int32), stop=stop))[0].stop == stop
    too_big = torch.zeros(P.MAX_TOKENS_PER_REQUEST + 1, dtype=torch.int32)
    bad(request(too_big), "bad_request")
    draft, sampling = dataclasses.asdict(DRAFT), dataclasses.asdict(SAMPLING)
    for wrong in (dict(depth=0), dict(depth=65), dict(top_k=0), dict(sample=True, top_k=2), dict(min_path_prob=1.0),
                  dict(depth="4"), dict(sample_top_k=0), dict(sample_top_k=257), dict(sample_top_p=0.0),
                  dict(sample_top_p=float("nan"))):
        bad(with_settings(draft | wrong, sampling), "bad_settings")
    for wrong in (dict(top_p=0.0), dict(temperature=-1.0)):
        bad(with_settings(draft, sampling | wrong), "bad_settings")


def test_a_sampled_reply_carries_a_q_whose_support_holds_each_token():
    """q comes as int32 ids and float16 weights [n, K]: each row a distribution (finite, >= 0, not all
    0) whose support holds its node's token, since that token was drawn from it."""
    tokens, parents = torch.tensor([7, 8], dtype=torch.int32), torch.tensor([-1, 0], dtype=torch.int32)

    def reply(ids, weights):
        tensors = (tokens, parents, ids, weights)
        return [bytes(f) for f in P.encode(P.DraftReply(5, 0, 0.1, 2.0, 1, P.specs(*tensors)), tensors)]

    ids = torch.tensor([[7, 3], [1, 8]], dtype=torch.int32)
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5]], dtype=torch.float16)
    assert len(P.decode(reply(ids, weights))[1]) == 4
    bad(reply(ids.flip(0), weights), "bad_reply")  # 7 is not in the second row, nor 8 in the first
    bad(reply(ids, torch.tensor([[0.0, 1.0], [0.5, 0.5]], dtype=torch.float16)), "bad_reply")  # q(7) = 0
    bad(reply(ids, weights.float()), "bad_reply")
    bad(reply(ids.float(), weights), "bad_reply")
    bad(reply(ids[:1], weights[:1]), "bad_reply")
    bad(reply(ids, torch.tensor([[1.0, float("nan")], [0.5, 0.5]], dtype=torch.float16)), "bad_reply")
    bad(reply(ids, torch.tensor([[1.0, -0.5], [0.5, 0.5]], dtype=torch.float16)), "bad_reply")
    bad(reply(ids - 8, weights), "bad_reply")
    wide = torch.full((2, 257), 8, dtype=torch.int32)
    wide[0] = 7
    bad(reply(wide, torch.ones(2, 257, dtype=torch.float16)), "bad_reply")  # past MAX_SAMPLE_TOP_K
    tensors = (tokens, parents, ids)
    bad([bytes(f) for f in P.encode(P.DraftReply(5, 0, 0.1, 2.0, 1, P.specs(*tensors)), tensors)], "bad_reply")


def test_the_advertised_tree_cap_holds():
    """total_tokens 0 keeps depth * top_k nodes: 64 x 16 = 1,024 passed validation while Welcome
    advertised 256. No draft beyond the cap can be built, locally or off the wire."""
    with pytest.raises(ValueError, match=f"at most {MAX_DRAFT_NODES} nodes"):
        DraftConfig(depth=64, top_k=16)
    assert DraftConfig(depth=64, top_k=16, total_tokens=MAX_DRAFT_NODES).max_nodes == MAX_DRAFT_NODES
    bad(with_settings(dataclasses.asdict(DRAFT) | dict(depth=64, top_k=16, total_tokens=0),
                      dataclasses.asdict(SAMPLING)), "bad_settings")
    bad(with_settings(dataclasses.asdict(DRAFT) | dict(total_tokens=MAX_DRAFT_NODES + 1),
                      dataclasses.asdict(SAMPLING)), "bad_settings")


def test_shape_must_match_frame_size():
    t = torch.zeros(4, dtype=torch.int32)
    head = P.encode(P.DraftRequest(1, 0, False, None, None, 5, (P.TensorSpec("int32", (5,)),)))[0]
    bad([head, bytes(memoryview(t.numpy()))], "bad_tensor")
    head = P.encode(P.DraftRequest(1, 0, False, None, None, 5, (P.TensorSpec("int64", (4,)),)))[0]
    bad([head, b"\x00" * 32], "bad_tensor")


def test_hostile_values_are_refused_not_crashed_on():
    """Shapes whose element count overflows int64, non-finite floats and out-of-range seeds."""
    head = P.encode(P.DraftRequest(1, 0, False, None, None, 5, (P.TensorSpec("int32", (1 << 62, 4)),)))[0]
    bad([head, b""], "bad_tensor")
    head = P.encode(P.DraftRequest(1, 0, False, None, None, 5, (P.TensorSpec("int32", (1 << 62, 0)),)))[0]
    bad([head, b""], "bad_tensor")
    sampling = dataclasses.asdict(SAMPLING)
    for wrong in (dict(temperature=float("nan")), dict(top_p=float("inf")), dict(seed=(1 << 64) - 1), dict(seed=-1)):
        bad(with_settings(dataclasses.asdict(DRAFT), sampling | wrong), "bad_settings")
    bad(with_settings(dataclasses.asdict(DRAFT) | dict(min_path_prob=float("nan")), sampling), "bad_settings")
