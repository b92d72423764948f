"""EAGLE heads: the published checkpoint layouts load; drafting from the target's features is lossless
co-located and through a draft server with several targets (16- and 8-bit features); sampling keeps
the target's law."""

import collections
import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

import tiny
from starsd.config import DraftConfig, ModelConfig, PairConfig, SamplingConfig, ServerConfig
from starsd.models import eagle
from starsd.models.drafter import Drafter
from starsd.models.eagle import EagleHead, EagleLoadError
from starsd.models.pair import Pair
from starsd.prompts import humaneval
from starsd.spec_decode.decode import speculative, target_only
from starsd.spec_decode.verify import warp
from starsd.models.loading import logits_width, vocab_fingerprint
from starsd.star import protocol as P
from starsd.star.client import DraftClient
from starsd.star.remote_drafter import RemoteDrafter
from starsd.star.launch import run_targets, start_server

LAYERS = 8  # EAGLE-3 taps the inputs of layers 2, 4 and 5
GREEDY = SamplingConfig()
CHAIN = DraftConfig(depth=4, min_path_prob=0, adaptive=False)
TREE = DraftConfig(depth=3, top_k=3, total_tokens=10, min_path_prob=0, adaptive=False)


def published_layout(config, kind: str, draft_vocab: int = 0) -> dict[str, torch.Tensor]:
    """A head's weights under the names the EAGLE-1 and EAGLE-3 releases use, random, written out
    by hand (not by eagle.save) so that the names are checked against the releases."""
    g = torch.Generator().manual_seed(5)
    h, v = config.hidden_size, config.vocab_size
    q, kv = config.num_attention_heads * (h // config.num_attention_heads), config.num_key_value_heads * (h // config.num_attention_heads)
    width = 2 * h if kind == "eagle3" else h  # EAGLE-3's attention reads [embedding; feature]
    layer = "midlayer" if kind == "eagle3" else "layers.0"
    shapes = {
        f"{layer}.self_attn.q_proj.weight": (q, width), f"{layer}.self_attn.q_proj.bias": (q,),
        f"{layer}.self_attn.k_proj.weight": (kv, width), f"{layer}.self_attn.k_proj.bias": (kv,),
        f"{layer}.self_attn.v_proj.weight": (kv, width), f"{layer}.self_attn.v_proj.bias": (kv,),
        f"{layer}.self_attn.o_proj.weight": (h, q),
        f"{layer}.mlp.gate_proj.weight": (config.intermediate_size, h),
        f"{layer}.mlp.up_proj.weight": (config.intermediate_size, h),
        f"{layer}.mlp.down_proj.weight": (h, config.intermediate_size),
        f"{layer}.post_attention_layernorm.weight": (h,),
    }
    if kind == "eagle1":  # no input norm on the first layer; the release carries the target's embedding
        shapes |= {"fc.weight": (h, 2 * h), "fc.bias": (h,), "embed_tokens.weight": (v, h)}
    else:
        shapes |= {"fc.weight": (h, 3 * h), f"{layer}.input_layernorm.weight": (h,),
                   f"{layer}.hidden_norm.weight": (h,), "norm.weight": (h,), "lm_head.weight": (draft_vocab, h)}
    state = {k: torch.randn(s, generator=g) * 0.2 for k, s in shapes.items()}
    if kind == "eagle3":  # draft id i is target id i + d2t[i]: here every other target id
        state["d2t"] = torch.arange(draft_vocab)
        state["t2d"] = torch.zeros(v, dtype=torch.bool)
        state["t2d"][::2] = True
    return state


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    tok = tiny.char_tokenizer()
    target = tiny.tiny_model(1, layers=LAYERS)
    out = {"target": tiny.save(target, tok, root / "target")}
    head_config = json.loads(target.config.to_json_string()) | {"num_hidden_layers": 1}
    e1 = root / "eagle1"
    e1.mkdir()
    torch.save(published_layout(target.config, "eagle1"), e1 / "pytorch_model.bin")  # as the EAGLE-1 releases
    (e1 / "config.json").write_text(json.dumps(head_config))
    e3 = root / "eagle3"
    e3.mkdir()
    save_file(published_layout(target.config, "eagle3", draft_vocab=64), str(e3 / "model.safetensors"))
    (e3 / "config.json").write_text(json.dumps(head_config | {"draft_vocab_size": 64}))
    return out | {"eagle1": str(e1), "eagle3": str(e3)}


@pytest.fixture(scope="module")
def local(dirs):
    return Pair.load(ModelConfig(dirs["target"], dtype="float32"), None)


def head(dirs, local, kind) -> EagleHead:
    model = local.target.model
    return eagle.load(dirs[kind], model.config, model.get_input_embeddings(), model.get_output_embeddings(),
                      torch.float32)


def test_published_layouts_load_and_round_trip(dirs, local, tmp_path):
    h1, h3 = head(dirs, local, "eagle1"), head(dirs, local, "eagle3")
    assert (h1.kind, h1.taps) == ("eagle1", ())
    assert (h3.kind, h3.taps, h3.feature_width) == ("eagle3", (2, 4, 5), 3 * 64)
    assert "embed_tokens.weight" not in h1.state_dict()  # the target's: held, not owned
    saved = eagle.load(eagle.save(h3, tmp_path / "again"), local.target.model.config,
                       local.target.model.get_input_embeddings(), local.target.model.get_output_embeddings(), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(h3.state_dict().values(), saved.state_dict().values()))
    bigger = tiny.tiny_model(1, layers=LAYERS, hidden=32)
    with pytest.raises(EagleLoadError, match="hidden size"):
        eagle.load(dirs["eagle1"], bigger.config, bigger.get_input_embeddings(), bigger.get_output_embeddings(), torch.float32)
    with pytest.raises(EagleLoadError, match="neither"):
        save_file({"fc.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
        eagle.load(tmp_path, local.target.model.config, None, None, torch.float32)


def test_eagle3_drafts_only_its_vocabulary(dirs, local):
    drafter = Drafter(head(dirs, local, "eagle3"))
    prompt = list(range(3, 20))
    seq = local.target.start(prompt, drafter.taps)
    tree = drafter.propose(drafter.start(prompt), [], TREE, GREEDY, features=seq.features)
    assert len(tree) > 0 and all(t % 2 == 0 and t < 128 for t in tree.tokens.tolist())  # d2t = i: ids 2i


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("draft", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_output_equals_target_only(dirs, local, kind, draft):
    drafter = Drafter(head(dirs, local, kind))
    for prompt in ([7], [5, 6, 7, 8, 9, 10, 11], list(range(40, 90))):
        ref = target_only(local.target, prompt, 40, GREEDY)
        out = speculative(local.target, drafter, prompt, 40, draft, GREEDY)
        assert out.token_ids == ref.token_ids, (kind, prompt[:3])
        assert sum(out.depths) > 0  # it drafted


def test_features_survive_8_bits_within_a_step():
    x = torch.randn(5, 96) * 3
    codes, scales = P.features_to_wire(x, 8)
    assert codes.dtype == torch.uint8 and scales.shape == (5, 2)
    back = P.features_from_wire(P.decode([bytes(f) for f in P.encode(
        P.DraftRequest(1, 0, False, None, None, 1, P.specs(torch.zeros(5, dtype=torch.int32), codes, scales)),
        (torch.zeros(5, dtype=torch.int32), codes, scales))])[1][1:])
    assert (back - x).abs().max() <= (x.max(1).values - x.min(1).values).max() / 255 / 2 + 1e-5


def test_sampling_keeps_the_target_law(dirs, local):
    """The first sampled token of a sampled EAGLE chain follows the target's law, far closer to it
    than to the head's own."""
    s = SamplingConfig(temperature=1.0, top_k=6)
    drafter = Drafter(head(dirs, local, "eagle1"))
    prompt = [10, 11, 12]
    seq = local.target.start(prompt, drafter.taps)
    from starsd.spec_decode.tree import DraftTree

    exact = warp(local.target.score(seq, DraftTree.empty())[0], s)
    sampled = DraftConfig(depth=2, sample=True, adaptive=False, min_path_prob=0)
    seq = local.target.start(prompt, drafter.taps)
    own = drafter.propose(drafter.start(prompt), [], sampled, s, features=seq.features).q.dense(exact.shape[-1])[0]
    trials = 2000
    counts = collections.Counter(speculative(local.target, drafter, prompt, 1, sampled,
                                             SamplingConfig(temperature=1.0, top_k=6, seed=i)).token_ids[0]
                                 for i in range(trials))
    emp = torch.zeros_like(exact)
    for t, c in counts.items():
        emp[t] = c / trials
    to_target, to_head = 0.5 * (emp - exact).abs().sum().item(), 0.5 * (emp - own).abs().sum().item()
    assert to_target < 0.05 and to_head > 3 * to_target, (to_target, to_head)


def test_star_with_eagle_head_is_lossless_for_several_targets(dirs, local):
    """A draft-server process drafts with the EAGLE-3 head for three target processes at once,
    each sending its 16-bit features, then for a target here sending 8-bit ones; every output
    equals target-only decoding."""
    star = start_server(PairConfig(target=dirs["target"], eagle=dirs["eagle3"], dtype="float32", threads=1),
                        ServerConfig(session_timeout_s=10))
    try:
        args = ["--target", dirs["target"], "--dtype", "float32", "--threads", "1", "--no-draft-adaptive",
                "--max-new-tokens", "24", "--draft-depth", "3"]
        results = run_targets(star, 3, args, num_prompts=3)
        client = DraftClient(star.address, vocab_fingerprint(local.tokenizer, logits_width(local.target.model)))
        client.hello()
        remote = RemoteDrafter(client)
        assert remote.taps == (2, 4, 5)
        eight = [speculative(local.target, remote, p.encode(local.tokenizer), 24, dataclasses.replace(CHAIN, feature_bits=8),
                             GREEDY, local.eos_ids) for p in humaneval()[:2]]
        client.close()
    finally:
        star.close()
    prompts = humaneval()[:3]
    refs = {p.id: target_only(local.target, p.encode(local.tokenizer), 24, GREEDY, local.eos_ids).token_ids for p in prompts}
    for r in results:
        assert r["token_ids"] == refs[r["prompt_id"]]
        assert r["draft"]["requests"] >= r["num_steps"] - 1  # every step but perhaps the last was drafted
    for p, g in zip(prompts, eight):
        assert g.token_ids == refs[p.id] and sum(g.depths) > 0


def test_replay_targets_send_the_recorded_features(dirs, local, tmp_path):
    """A replay target's features are the real target's (recorded in one pass over prompt and
    continuation), and the service sweep drafts with a head from them."""
    from starsd.bench.harness import measure_service
    from starsd.emulate.replay import LatencyProfile, ReplayTarget, load_features, record, record_features, recording_path

    cfg = ModelConfig(dirs["target"], dtype="float32")
    prompts = humaneval()[:2]
    rec = record(cfg, prompts, 12, str(tmp_path), log=lambda *_: None)
    rec_file = recording_path(cfg, prompts, 12, str(tmp_path))
    drafter = Drafter(head(dirs, local, "eagle3"))
    record_features(cfg, rec, rec_file, drafter.taps, str(tmp_path), log=lambda *_: None)
    replay = ReplayTarget(rec, LatencyProfile({1: (1e-3,)}), features=load_features(rec_file, drafter.taps))
    ids = prompts[0].encode(local.tokenizer)
    seq, real = replay.start(ids, drafter.taps), local.target.start(ids, drafter.taps)
    torch.testing.assert_close(seq.features.float(), real.features, atol=2e-2, rtol=2e-2)  # stored in bf16
    cont = rec.prompts[prompts[0].id]["continuation"]
    from starsd.spec_decode.tree import DraftTree

    tree = DraftTree(torch.tensor([cont[0], cont[0] + 1, cont[1]]), torch.tensor([-1, -1, 0]))  # node 1 is off the path
    replay.score(seq, tree, drafter.taps)
    local.target.score(real, tree, drafter.taps)
    on_path = torch.tensor([0, 1, 3])
    torch.testing.assert_close(seq.features[on_path].float(), real.features[on_path], atol=2e-2, rtol=2e-2)
    assert not seq.features[2].any()
    sweep = measure_service(drafter, rec, [1, 2], TREE, reps=1, rows_per_size=2,
                            features=load_features(rec_file, drafter.taps))
    assert all(v["service_ms"] and min(v["service_ms"]) > 0 and min(v["bound_ms"]) > 0 for v in sweep.values())
