"""The star over real sockets: a draft-server process and target-worker processes on loopback."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

import tiny
from starsd.star import protocol as P
from starsd.models.pair import Pair
from starsd.config import DraftConfig, ModelConfig, PairConfig, SamplingConfig, ServerConfig
from starsd.star.client import DraftClient, DraftServerError
from starsd.spec_decode.decode import speculative, target_only
from starsd.star.launch import run_targets, start_server, summarize
from starsd.star.processes import spawn
from starsd.models.loading import logits_width, vocab_fingerprint
from starsd.prompts import humaneval

N = 4
MAX_NEW = 48


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("star")
    target, draft = tiny.save_pair(root)
    other = tiny.char_tokenizer(alphabet="".join(chr(i) for i in range(126, 31, -1)) + "\n")
    return {"target": target, "draft": draft, "alien": tiny.save(tiny.tiny_model(3), other, root / "alien")}


@pytest.fixture(scope="module")
def star(dirs):
    s = start_server(PairConfig(draft=dirs["draft"], dtype="float32", threads=1, draft_quantize="none"),
                     ServerConfig(session_timeout_s=5))  # the same draft as the in-process reference below
    yield s
    s.close()


@pytest.fixture(scope="module")
def local(dirs):
    """The same target and draft, co-located in this process: the reference outputs."""
    return Pair.load(ModelConfig(dirs["target"], dtype="float32"), ModelConfig(dirs["draft"], dtype="float32"))


def target_args(dirs, *extra):
    return ["--target", dirs["target"], "--dtype", "float32", "--threads", "1", "--no-draft-adaptive",
            "--max-new-tokens", str(MAX_NEW), "--draft-depth", "4", *extra]


def stats(star) -> dict:
    c = DraftClient(star.address, "", "test", timeout_s=10)
    try:
        return c.stats()
    finally:
        c.close()


def test_four_targets_batched_and_lossless(star, dirs, local):
    before = stats(star)["batch_sizes"]
    results = run_targets(star, N, target_args(dirs), num_prompts=2 * N)
    star.targets.clear()
    assert len(results) == 2 * N and len({r["target"] for r in results}) == N
    prompts = {p.id: p for p in humaneval()[: 2 * N]}
    for r in results:
        ids = prompts[r["prompt_id"]].encode(local.tokenizer)
        ref = target_only(local.target, ids, MAX_NEW, SamplingConfig(), local.eos_ids)
        assert r["token_ids"] == ref.token_ids, r["prompt_id"]
        assert r["draft"]["requests"] == r["drafted_steps"] >= r["num_steps"] - 1  # the last may be too short
    after = stats(star)["batch_sizes"]
    batched = {k: after[k] - before.get(k, 0) for k in after if int(k) > 1}
    assert sum(batched.values()) > 0, f"no batch of more than one session: {after}"


def test_network_sampling_is_seeded_and_matches_colocated(star, dirs, local):
    prompt = humaneval()[3]
    extra = ["--temperature", "0.8", "--top-p", "0.95", "--seed", "5", "--draft-sample", "--prompt", prompt.text]
    runs = []
    for _ in range(2):
        p = spawn(["target", "--connect", star.address, "--json", *target_args(dirs, *extra)])
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        runs.append(json.loads(out.splitlines()[-1]))
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    ids = prompt.encode(local.tokenizer)
    s = SamplingConfig(temperature=0.8, top_p=0.95, seed=5)
    ref = speculative(local.target, local.drafter, ids, MAX_NEW, DraftConfig(depth=4, sample=True, adaptive=False), s,
                      local.eos_ids)
    assert runs[0]["token_ids"] == ref.token_ids


def test_killed_target_is_reclaimed_and_others_finish(star, dirs, local):
    # it cannot have finished when the kill comes, however fast the host (400 tokens or an EOS could have)
    long = ["--max-new-tokens", "4000", "--ignore-eos", "--draft-depth", "2", "--prompt", "def victim():"]
    victim = spawn(["target", "--connect", star.address, "--json", *target_args(dirs)[:-4], *long])
    freed = stats(star)["sessions_freed"]
    deadline = time.monotonic() + 60
    while stats(star)["sessions_open"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # mid-generation
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    results = run_targets(star, 2, target_args(dirs), num_prompts=2)
    star.targets.clear()
    prompts = {p.id: p for p in humaneval()[:2]}
    for r in results:
        ref = target_only(local.target, prompts[r["prompt_id"]].encode(local.tokenizer), MAX_NEW, SamplingConfig(),
                          local.eos_ids)
        assert r["token_ids"] == ref.token_ids
    deadline = time.monotonic() + 10
    while stats(star)["sessions_freed"] < freed + 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    after = stats(star)
    assert after["sessions_freed"] >= freed + 3  # the victim's and the two finished targets'
    assert after["sessions_open"] == 0


def test_the_first_draft_is_made_while_the_target_prefills(star, local):
    from starsd.star.remote_drafter import RemoteDrafter

    client = DraftClient(star.address, vocab_fingerprint(local.tokenizer, logits_width(local.target.model)), "ahead")
    try:
        client.hello()
        drafter = RemoteDrafter(client)
        cfg = DraftConfig(depth=4, adaptive=False)
        prompt = [7, 3, 9, 12, 40]
        seq = drafter.start(prompt, cfg, SamplingConfig(), 4)
        reset = time.monotonic()
        # drafted before it is asked for: its reply is in the socket before the prefill's 0.5 s are out (seen
        # there, not read off a wait shorter than the server's queue + service ms, which a loaded host's
        # preemption of this thread can make longer than those few ms)
        assert client.link.sock.poll(10_000), "no first draft"
        time.sleep(max(0.0, reset + 0.5 - time.monotonic()))  # the target's prefill
        drafter.propose(seq, [], cfg, SamplingConfig(), max_depth=4)
        t = drafter.timing
        assert t.batch == [1] and t.early == [True] and t.wall[0] >= 500  # its round trip runs from the prompt's reset,
        assert not t.overheads()  # and it tells nothing of the protocol's overhead
        gen = speculative(local.target, drafter, prompt, 40, cfg, SamplingConfig())
        assert gen.token_ids == target_only(local.target, prompt, 40, SamplingConfig()).token_ids
        assert all(d > 0 for d in gen.depths[:-1])
    finally:
        client.close()


def test_vocabulary_mismatch_is_refused_on_both_sides(star, dirs):
    p = subprocess.run([*spawn_cmd(), "target", "--connect", star.address, "--target", dirs["alien"],
                        "--dtype", "float32", "--prompt", "x", "--max-new-tokens", "4"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "vocab_mismatch" in p.stderr and "shared tokenizer" in p.stderr
    assert stats(star)["errors"].get("vocab_mismatch", 0) >= 1


def spawn_cmd():
    return [sys.executable, "-m", "starsd.cli"]


def raw_socket(star):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(star.address)
    return sock


def ask(sock, frames):
    sock.send_multipart(frames)
    assert sock.poll(10000), "the draft server did not answer"
    return P.decode(sock.recv_multipart())[0]


def test_wrong_protocol_version_is_refused(star, local):
    fp = vocab_fingerprint(local.tokenizer, logits_width(local.target.model))
    sock = raw_socket(star)
    reply = ask(sock, P.encode(P.Hello(P.PROTOCOL_VERSION + 1, fp, "old")))
    assert isinstance(reply, P.Error) and reply.code == "version" and "not supported" in reply.message
    sock.close()


def test_malformed_messages_get_errors_and_harm_no_one(star, local):
    fp = vocab_fingerprint(local.tokenizer, logits_width(local.target.model))
    good = DraftClient(star.address, fp, "good", timeout_s=10)
    good.hello()
    settings = (DraftConfig(depth=3, min_path_prob=0.0), SamplingConfig())
    first, _ = good.draft([5, 6, 7], 10, *settings)
    sock = raw_socket(star)
    one = torch.tensor([1], dtype=torch.int32)
    bad_token = P.encode(P.DraftRequest(good.tag, 0, True, *settings, 10, P.specs(one)), (one,))
    cases = {
        "unknown_type": [b"\xff"],
        "bad_header": [bytes([P.MsgType.DRAFT_REQUEST]) + b"\x93garbage"],
        "bad_frames": [bad_token[0]],  # announces a tensor, sends none
        "unknown_session": bad_token,  # another connection's tag
        "bad_tensor": [bad_token[0], b"\x00\x01"],
    }
    for code, frames in cases.items():
        reply = ask(sock, frames)
        assert isinstance(reply, P.Error) and reply.code == code, (code, reply)
    second, tensors = good.draft([8], 9)  # the good session is untouched
    assert second.step == first.step + 1 and tensors[0].shape[0] >= 1
    with pytest.raises(DraftServerError, match="bad_step"):
        good.step = 7
        good.draft([1], 5)
    good.close()
    sock.close()
    time.sleep(0.3)  # the server answers stats from a copy up to 0.2 s old
    assert all(stats(star)["errors"].get(c, 0) >= 1 for c in cases)


def descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        c, p = map(int, line.split())
        children.setdefault(p, []).append(c)
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_launch_ctrl_c_leaves_no_orphans(dirs):
    """The signal comes at a known point: once the launcher says its targets are decoding, and they
    cannot be done (--ignore-eos, 4,000 tokens each). It used to come after a fixed sleep, and a fast
    machine had finished the whole launch by then (exit code 0, not 130)."""
    launcher = subprocess.Popen([*spawn_cmd(), "launch", "--targets", "2", "--target", dirs["target"], "--draft",
                                 dirs["draft"], "--dtype", "float32", "--limit", "8", "--max-new-tokens", "4000",
                                 "--", "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in launcher.stderr:
        if "targets released" in line:
            break
    else:
        pytest.fail(f"the launcher exited ({launcher.wait()}) before releasing its targets")
    children = descendants(launcher.pid)
    assert len(children) >= 3, "the launcher did not start a server and two targets"
    rest: list[str] = []  # the star's stderr from here on, read so that no writer blocks on a full pipe
    reader = threading.Thread(target=lambda: rest.extend(launcher.stderr), daemon=True)
    reader.start()
    launcher.send_signal(signal.SIGINT)
    try:
        launcher.wait(timeout=30)
    except subprocess.TimeoutExpired:
        launcher.kill()
        pytest.fail(f"the launcher did not stop within 30 s of SIGINT; its stderr since:\n{''.join(rest)[-3000:]}")
    assert launcher.returncode == 130, "".join(rest)[-3000:]
    deadline = time.monotonic() + 10
    while [c for c in children if alive(c)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [c for c in children if alive(c)], "processes left behind"


def test_launch_runs_a_local_star_and_reports_it(dirs, tmp_path):
    """A fixed depth (the flags after --, for every target): with the default policy, targets that
    measure no draft paying on a busy 2-core host decode alone, and the server would report nothing."""
    out = tmp_path / "launch.json"
    run = subprocess.run([*spawn_cmd(), "launch", "--targets", "2", "--target", dirs["target"], "--draft", dirs["draft"],
                          "--dtype", "float32", "--limit", "4", "--max-new-tokens", "24", "--json-out", str(out),
                          "--", "--no-draft-adaptive"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "system:" in run.stdout and "pre-drafting:" in run.stdout
    result = json.loads(out.read_text())
    server = result["draft_server"]
    assert server["requests"] >= server["replies"] > 0 and server["predraft"]["hits"] <= server["requests"]
    assert len(result["results"]) == 4 and {r["target"] for r in result["results"]} == {"target-0", "target-1"}
    assert out.with_suffix(".png").stat().st_size > 1000


def test_launch_summary_takes_prompts_without_an_answered_draft():
    """A target that decoded a whole prompt alone (its drafts asked ahead and never answered in
    time) reports a draft summary without means: the launch summary must take it as it is."""
    rows = [{"target": "target-0", "token_ids": [1, 2, 3], "seconds": 2.0, "mean_accepted": 0.0, "go": 10.0,
             "finished": 12.0, "draft": {"requests": 0, "refused": 0, "late": 0, "ahead": 3, "taken_late": 0}},
            {"target": "target-0", "token_ids": [4, 5], "seconds": 1.0, "mean_accepted": 1.0, "go": 10.0,
             "finished": 13.0, "draft": {}}]
    got = summarize(rows, 1)
    assert got["tokens"] == 5 and got["per_target"]["target-0"]["tokens_per_s"] == pytest.approx(5 / 3)
