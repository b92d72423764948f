"""StarSD's proposer driven as vLLM 0.33.0's GPU model runner (the V1 runner: custom_class runs on no
other) drives a custom_class proposer, call for call, against a real draft server in this process; no
vLLM is imported. Where each call is made, in vLLM 0.33.0's source (the sdist on PyPI):

- built: `create_custom_proposer` (vllm/v1/spec_decode/custom_class_proposer.py:12-73) imports
  speculative_config.model and calls `user_class(vllm_config)` (line 50), from GPUModelRunner.__init__
  (vllm/v1/worker/gpu_model_runner.py:610-613); it checks only that `propose` is callable (57-65).
- loaded: GPUModelRunner.load_model (gpu_model_runner.py:5011-5012) calls `drafter.load_model(self.model)`,
  the target nn.Module, positional, where the proposer has one. vLLM wraps a drafter's `.model` in a
  CUDA-graph wrapper (5142-5147) and reads it for EPLB (5013-5030): the proposer has none.
- asked: GPUModelRunner.propose_draft_token_ids (gpu_model_runner.py:4744-4751) calls
  `propose(sampled_token_ids, self.input_batch.num_tokens_no_spec, self.input_batch.token_ids_cpu,
  slot_mappings=slot_mappings)`, after bookkeeping (sample_tokens, 4418, 4451-4455):
  sampled_token_ids: list[list[int]], one list a row (num_reqs rows), the row's tokens committed this
  step; [] for a row whose tokens are discarded (a prefill chunk: _bookkeeping_sync, 3480-3491);
  num_tokens_no_spec: np.ndarray int32 [max_num_reqs], the whole buffer (gpu_input_batch.py:149-155);
  token_ids_cpu: np.ndarray int32 [max_num_reqs, max_model_len], the whole buffer (gpu_input_batch.py:
  131-137), this step's tokens already written at the rows' ends (gpu_model_runner.py:3546-3548), and
  past them stale tokens (the rejected drafts: update_req_spec_token_ids, gpu_input_batch.py:496-521);
  slot_mappings: dict[str, torch.Tensor] (layer name -> int64 [num_tokens_padded]), or a list of such
  dicts with micro-batching, or None (_get_slot_mappings, gpu_model_runner.py:3822-3894).
- its answer: a list (held as _draft_token_ids) handed to the scheduler as
  DraftTokenIds(input_batch.req_ids, drafts) (take_draft_token_ids and _get_draft_token_ids_cpu,
  gpu_model_runner.py:4593-4596, 4637-4638): drafts[i] is req_ids[i]'s; the scheduler zips the two
  (vllm/v1/core/sched/scheduler.py:2862-2881) and schedules at most num_speculative_tokens of it (1019-1020).
- rows between steps: GPUModelRunner._update_states (gpu_model_runner.py:1176-1500): finished and
  unscheduled (preempted) requests' rows emptied (remove_request, gpu_input_batch.py:523), new and
  resumed requests added into the smallest emptied rows first (add_request, 345; a resumed request
  with its prompt and output tokens), then `condense` (698: the last rows move into the holes) and the
  attention backend's reordering (swap_states, 580). The proposer is told none of it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import tiny
from starsd.config import ServerConfig
from starsd.models.loading import vocab_fingerprint
from starsd.star.processes import free_port
from starsd.star.server import DraftServer
from starsd.vllm.proposer import Proposer

K = 3  # num_speculative_tokens
MAX_REQS = 4  # scheduler_config.max_num_seqs: the input batch's rows
MAX_LEN = 128  # model_config.max_model_len: a row's width


@pytest.fixture
def tokenizer_dir(tmp_path):
    path = tmp_path / "tokenizer"
    tiny.char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def server(tiny_drafters, tokenizer_dir):
    """A draft server with the tiny `good` drafter, whose fingerprint is the one the proposer derives
    from vLLM's tokenizer and vocabulary size (as a server for the target's pair has)."""
    from transformers import AutoTokenizer

    fingerprint = vocab_fingerprint(AutoTokenizer.from_pretrained(tokenizer_dir), tiny.VOCAB)
    address = f"tcp://127.0.0.1:{free_port()}"
    s = DraftServer(tiny_drafters["good"], fingerprint, tiny.VOCAB, ServerConfig(bind=address))
    thread = s.start()
    yield address
    s.stop()
    thread.join(timeout=5)


def vllm_config(tokenizer_dir) -> SimpleNamespace:
    """The fields of vLLM's VllmConfig that the runner's custom_class path and the Proposer read."""
    spec = SimpleNamespace(method="custom_class", model="starsd.vllm.Proposer", num_speculative_tokens=K)
    model = SimpleNamespace(max_model_len=MAX_LEN, tokenizer=str(tokenizer_dir), trust_remote_code=False,
                            get_vocab_size=lambda: tiny.VOCAB)
    return SimpleNamespace(speculative_config=spec, model_config=model)


def built_as_vllm_does(config) -> Proposer:
    """create_custom_proposer (custom_class_proposer.py:25-50): the class named by speculative_config.model,
    imported and called with the config alone."""
    import importlib

    module, name = config.speculative_config.model.rsplit(".", 1)
    proposer = getattr(importlib.import_module(module), name)(config)
    assert callable(proposer.propose)
    return proposer


class Batch:
    """vLLM's persistent input batch as the proposer sees it (gpu_input_batch.py, InputBatch): int32
    buffers that vLLM keeps for good and writes in place, a request's row moving as others come and go."""

    def __init__(self):
        self.token_ids_cpu = np.zeros((MAX_REQS, MAX_LEN), dtype=np.int32)  # [max_num_reqs, max_model_len]
        self.num_tokens_no_spec = np.zeros(MAX_REQS, dtype=np.int32)  # [max_num_reqs]
        self.req_ids: list[str | None] = []  # row -> request (None: emptied, until condense)
        self.emptied: list[int] = []

    def add(self, req_id: str, tokens: list[int]) -> None:
        """add_request: the smallest emptied row, else one more at the end."""
        if self.emptied:
            row = min(self.emptied)
            self.emptied.remove(row)
            self.req_ids[row] = req_id
        else:
            row = len(self.req_ids)
            self.req_ids.append(req_id)
        self.token_ids_cpu[row, :len(tokens)] = tokens
        self.num_tokens_no_spec[row] = len(tokens)

    def remove(self, req_id: str) -> None:
        """remove_request: the row stays, empty, its tokens left in the buffer."""
        row = self.req_ids.index(req_id)
        self.req_ids[row] = None
        self.emptied.append(row)

    def condense(self) -> None:
        """The last live row moves into the smallest hole until no hole lies below a live row; the
        moved row's old tokens are left where they were."""
        while self.emptied:
            hole = min(self.emptied)
            last = max((i for i, r in enumerate(self.req_ids) if r is not None), default=-1)
            if hole > last:
                break
            n = int(self.num_tokens_no_spec[last])
            self.token_ids_cpu[hole, :n] = self.token_ids_cpu[last, :n]
            self.num_tokens_no_spec[hole] = n
            self.req_ids[hole] = self.req_ids[last]
            self.req_ids[last] = None
            self.emptied.remove(hole)
            self.emptied.append(last)
        while self.req_ids and self.req_ids[-1] is None:
            self.req_ids.pop()
        self.emptied = []

    def swap(self, i: int, j: int) -> None:
        """swap_states: two rows trade places (the attention backend's decode-first reordering)."""
        width = int(max(self.num_tokens_no_spec[i], self.num_tokens_no_spec[j]))
        self.token_ids_cpu[[i, j], :width] = self.token_ids_cpu[[j, i], :width]
        self.num_tokens_no_spec[[i, j]] = self.num_tokens_no_spec[[j, i]]
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]

    def tokens(self, row: int) -> list[int]:
        return self.token_ids_cpu[row, :int(self.num_tokens_no_spec[row])].tolist()


def bonus(tokens: list[int]) -> int:
    """The token the target takes after the accepted drafts: any token but the end (0) will do."""
    return (31 * sum(tokens) + len(tokens)) % (tiny.VOCAB - 1) + 1


def is_greedy_chain(model, tokens: list[int], draft: list[int], tol: float = 1e-3) -> bool:
    """Whether each token of `draft` is the draft model's argmax after `tokens` and the draft before it
    (within `tol` of the best logit: the server drafts with a KV cache, this recomputes)."""
    if not draft:
        return True
    with torch.no_grad():
        logits = model(torch.tensor([tokens + draft])).logits[0, len(tokens) - 1:-1]  # [len(draft), vocab]
    taken = logits[torch.arange(len(draft)), torch.tensor(draft)]
    return bool((taken >= logits.max(-1).values - tol).all())


class Runner:
    """vLLM 0.33's V1 runner's side of the proposer, step by step (sync scheduling: custom_class turns
    async scheduling off, vllm/config/vllm.py:1651-1662, 1711-1717)."""

    def __init__(self, proposer: Proposer, draft_model):
        self.proposer = proposer
        self.draft_model = draft_model
        self.batch = Batch()
        self.scheduled: dict[str, list[int]] = {}  # request -> the draft the scheduler holds for it
        self.paused: dict[str, list[int]] = {}  # preempted request -> its tokens
        self.steps = 0

    def step(self, finished=(), preempted=(), arriving: dict[str, list[int]] | None = None, resumed=(),
             chunked=(), swap: tuple[int, int] | None = None, slot_mappings="dict") -> list[list[int]]:
        """One step: _update_states' changes to the rows, the forward pass (each row commits its accepted
        drafts and one more token, or none in a prefill chunk that is not its last), bookkeeping, then
        propose() as propose_draft_token_ids calls it. Returns its drafts, checked."""
        self.steps += 1
        batch = self.batch
        for req_id in finished:
            batch.remove(req_id)
            self.scheduled.pop(req_id, None)
        for req_id in preempted:
            self.paused[req_id] = batch.tokens(batch.req_ids.index(req_id))
            batch.remove(req_id)
            self.scheduled.pop(req_id, None)
        fresh = dict(arriving or {}) | {req_id: self.paused.pop(req_id) for req_id in resumed}
        for req_id, tokens in fresh.items():
            batch.add(req_id, tokens)
        batch.condense()
        if swap:
            batch.swap(*swap)
        sampled = [self._forward(i, req_id, req_id in fresh, req_id in chunked)
                   for i, req_id in enumerate(batch.req_ids)]
        drafts = self.proposer.propose(sampled, batch.num_tokens_no_spec, batch.token_ids_cpu,
                                       slot_mappings=self._slot_mappings(sampled, slot_mappings))
        self._check(sampled, drafts)
        self.scheduled = {req_id: draft for req_id, draft in zip(batch.req_ids, drafts)}
        return drafts

    def _forward(self, row: int, req_id: str, fresh: bool, chunk: bool) -> list[int]:
        """The row's committed tokens this step, written at its end (the scheduled draft's tokens first,
        so that the rejected ones stay past it, as in vLLM's buffer)."""
        batch = self.batch
        n = int(batch.num_tokens_no_spec[row])
        if chunk:
            return []  # a prefill chunk: its sampled token is discarded
        draft = [] if fresh else self.scheduled.get(req_id, [])
        batch.token_ids_cpu[row, n:n + len(draft)] = draft
        accepted = draft[:self.steps % (K + 1)]  # 0..K of them, by the step
        committed = accepted + [bonus(batch.tokens(row) + accepted)]
        batch.token_ids_cpu[row, n:n + len(committed)] = committed
        batch.num_tokens_no_spec[row] = n + len(committed)
        return committed

    @staticmethod
    def _slot_mappings(sampled: list[list[int]], form: str):
        """As _get_slot_mappings gives them: per attention layer, the step's tokens' KV slots."""
        tokens = max(1, sum(map(len, sampled)))
        layers = {f"model.layers.{i}.self_attn.attn": torch.arange(tokens, dtype=torch.int64) for i in range(2)}
        return {"dict": layers, "list": [layers, layers], "none": None}[form]

    def _check(self, sampled: list[list[int]], drafts) -> None:
        """What the runner consumes: a list, a row's draft at the row's index, each a list of ints, at
        most K; none for a row that committed nothing; each row's draft is its own request's (the draft
        model's greedy chain after that row's tokens)."""
        assert type(drafts) is list and len(drafts) == len(self.batch.req_ids)
        for i, draft in enumerate(drafts):
            assert type(draft) is list and all(type(t) is int for t in draft) and len(draft) <= K
            if not sampled[i]:
                assert draft == []
            else:
                assert draft, f"row {i} ({self.batch.req_ids[i]}) got no draft at step {self.steps}"
                own = is_greedy_chain(self.draft_model, self.batch.tokens(i), draft)
                assert own, f"row {i} ({self.batch.req_ids[i]}) got a draft that is not its own at step {self.steps}"


PROMPTS = {"A": [5, 17, 29, 41, 53, 65], "B": [70, 60, 50, 40, 30, 20, 10], "C": [3, 1, 4, 1, 5, 9, 2, 6],
           "D": [99, 98, 97, 96, 95], "E": [11, 22, 33, 44, 55, 66, 77, 88, 99]}


def test_the_proposer_takes_vllm_033s_gpu_runner_calls(server, tokenizer_dir, tiny_target, tiny_drafters,
                                                        monkeypatch):
    """Built, loaded and asked as vLLM 0.33.0's V1 GPU runner does (the module docstring cites each call),
    over requests that finish, are preempted and resume, and arrive, rows moving under the proposer: every
    step's answer is what the runner consumes, and every row's draft is its own request's."""
    monkeypatch.setenv("STARSD_CONNECT", server)  # the proposer's settings come from `vllm serve`'s environment
    monkeypatch.setenv("STARSD_TIMEOUT_S", "10")
    monkeypatch.setenv("STARSD_ADAPTIVE", "0")  # k tokens asked every step, and waited for
    monkeypatch.setenv("STARSD_COHOSTED_DRAFTS", "1")  # from a server in this process, on these cores
    proposer = built_as_vllm_does(vllm_config(tokenizer_dir))
    assert not hasattr(proposer, "model")  # vLLM would wrap it for CUDA graphs (gpu_model_runner.py:5142-5147)
    proposer.load_model(tiny_target.model)  # gpu_model_runner.py:5012: the target model, positional
    runner = Runner(proposer, tiny_drafters["good"].model)
    batch = runner.batch
    try:
        runner.step(arriving={r: PROMPTS[r] for r in "ABCD"})  # four prompts prefilled in one step
        runner.step()
        held = batch.req_ids.copy()
        drafts = runner.step(finished=["A"])  # condense: D, the last row, fills A's row 0
        assert held == ["A", "B", "C", "D"] and batch.req_ids == ["D", "B", "C"]
        moved = [drafts[2], drafts[1], drafts[0]]  # what a proposer that did not follow the move would give
        assert not all(is_greedy_chain(runner.draft_model, batch.tokens(i), d) for i, d in enumerate(moved))
        runner.step(preempted=["B"], arriving={"E": PROMPTS["E"]}, chunked=["E"], slot_mappings="list")
        assert batch.req_ids == ["D", "E", "C"]  # E took B's emptied row: no condense; E's prefill goes on
        runner.step()  # E's prefill done: its first draft
        runner.step(swap=(0, 2), slot_mappings="none")  # the backend's reordering
        assert batch.req_ids == ["C", "E", "D"]
        b = len(runner.paused["B"])
        runner.step(finished=["E"], resumed=["B"])  # B back with its prompt and outputs, into E's row
        assert batch.req_ids == ["C", "B", "D"] and len(batch.tokens(1)) == b + 1
        for _ in range(3):
            runner.step()
    finally:
        proposer.close()
    assert proposer.counters.errors == 0 and proposer.counters.missed == 0
    assert proposer.counters.verified > 0 and proposer.counters.accepted > 0


def test_a_row_given_another_requests_draft_is_caught(tiny_drafters):
    """The check the runner test relies on can fail: a draft moved to another request's row is not that
    row's greedy chain."""
    model = tiny_drafters["good"].model
    a, b = PROMPTS["A"], PROMPTS["B"]

    def chain(tokens):
        out = []
        with torch.no_grad():
            for _ in range(K):
                out.append(int(model(torch.tensor([tokens + out])).logits[0, -1].argmax()))
        return out

    assert is_greedy_chain(model, a, chain(a)) and is_greedy_chain(model, b, chain(b))
    assert not is_greedy_chain(model, a, chain(b)) and not is_greedy_chain(model, b, chain(a))
