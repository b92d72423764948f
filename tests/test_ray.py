"""`starsd serve --ray`: a real two-node Ray cluster on this machine, the head in one network
namespace and a worker node in another (joined by a veth cable), with token authentication on
both. The draft server must land on the head (its resource) and the targets on the worker; the
gateway then serves greedy answers equal to target-only decoding, with Ray off the data path. A
target server killed (kill -9) is started again by its actor at its address, and answers again.
The worker node then dies (every process of it killed) and a new one joins: Ray starts the target
actors again there, at new addresses, and the gateway serves through them. Last, the draft server's
actor dies (its Ray worker process killed): Ray starts it again, at a new address, and the targets,
told by the gateway, draft there."""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys

import psutil
import pytest

import tiny
from starsd.config import ModelConfig, SamplingConfig
from starsd.emulate import netns
from starsd.models.pair import Pair
from starsd.spec_decode.decode import target_only
from starsd.star.processes import free_port, read_json_line, spawn

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'starsd[ray]')")
RAY = shutil.which("ray", path=os.path.dirname(sys.executable))
PROMPT = "def mul(a, b):"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if (why := netns.available()) is not None:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    root = tmp_path_factory.mktemp("ray")
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    link = netns.Link()
    head = f"{link.draft_ip}:6379"
    nodes = [(link.draft_ns, ["--head", "--port", "6379", "--resources", '{"draft_host": 1}',
                              "--include-dashboard=false"], link.draft_ip),
             (link.target_ns, ["--address", head, "--resources", '{"target_host": 2}'], link.target_ip)]

    def start(ns, args, ip):
        run = subprocess.run([*link.exec_argv(ns), RAY, "start", *args, "--node-ip-address", ip, "--num-cpus", "1",
                              "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-2000:]

    try:
        for node in nodes:
            start(*node)
        yield {"link": link, "env": env, "head": head, "root": root, "new_worker": lambda: start(*nodes[1])}
    finally:  # both nodes stopped at once: each `ray stop` waits seconds for its node's processes
        stops = [subprocess.Popen([*link.exec_argv(ns), RAY, "stop", "--force"], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for ns, _, _ in nodes]
        for stop in stops:
            try:
                stop.wait(timeout=180)
            except subprocess.TimeoutExpired:
                stop.kill()
        link.close()


def test_serve_places_the_star_by_resources_and_answers(cluster):
    link = cluster["link"]
    tok = tiny.char_tokenizer()
    target = tiny.tiny_model(1)
    target_dir = tiny.save(target, tok, cluster["root"] / "target")
    draft_dir = tiny.save(tiny.perturbed(target, seed=7, scale=0.1), tok, cluster["root"] / "draft")
    port = free_port()
    gateway = spawn(["serve", "--ray", cluster["head"], "--targets", "2", "--host", link.draft_ip, "--port", str(port),
                     "--ray-draft-resources", '{"draft_host": 1}', "--ray-target-resources", '{"target_host": 1}',
                     "--target", target_dir, "--draft", draft_dir, "--dtype", "float32", "--draft-quantize", "none",
                     "--served-model-name", "tiny", "--no-draft-adaptive", "--api-key", "x"],  # a tiny target decodes a token in
                    # milliseconds: its depth policy may rightly find a draft across the link not worth its wait, and
                    # this test is about where the star runs, so every step waits for its draft
                    prefix=link.exec_argv(link.draft_ns), env=cluster["env"])
    try:
        ready = read_json_line(gateway, "ready", 300)
        assert ready["draft_server"].startswith(f"tcp://{link.draft_ip}:")  # on the head: draft_host
        assert all(t.startswith(f"tcp://{link.target_ip}:") for t in ready["targets"])  # on the worker
        ask = ("import json, openai; c = openai.OpenAI(base_url=%r, api_key='x', max_retries=0); "
               "r = c.completions.create(model='tiny', prompt=%r, max_tokens=30, temperature=0); "
               "print(json.dumps({'text': r.choices[0].text, 'spec': r.model_extra['spec_decode']}))"
               % (f"http://{link.draft_ip}:{port}/v1", PROMPT))
        run = subprocess.run([*link.exec_argv(link.draft_ns), sys.executable, "-c", ask], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        got = json.loads(run.stdout)
        probe = ("import json, urllib.request; from starsd.star.client import query_stats; "
                 "m = urllib.request.urlopen(%r, timeout=30).read().decode(); "
                 "print(json.dumps({'keyless': query_stats(%r, timeout_s=2.0), 'metrics': m}))"
                 % (f"http://{link.draft_ip}:{port}/metrics", ready["draft_server"]))
        run = subprocess.run([*link.exec_argv(link.draft_ns), sys.executable, "-c", probe], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        probed = json.loads(run.stdout)
        assert probed["keyless"] is None  # the star's links take keys: a peer without one gets no answer
        assert "starsd:draft_server_up 1.0" in probed["metrics"]  # the gateway has one: it reads the draft server
        victim = next(p for p in psutil.process_iter(["cmdline"])
                      if {"target-server", "target-0"} <= set(p.info["cmdline"] or ()))
        victim.kill()
        base = f"http://{link.draft_ip}:{port}"
        after = served(link, base, "'process_restarts_total{process=\"target-server\"} 1.0' in metrics() and up() == 2", 120)
        lose_node(link.target_ip)  # the worker node dies with its actors and their target servers
        cluster["new_worker"]()  # another joins
        relocated = served(link, base, "up() == 2", 240)
        serving = [a for p in psutil.process_iter(["cmdline"]) if "target-server" in (p.info["cmdline"] or ())
                   for a in p.info["cmdline"] if a.startswith("tcp://") and a in ready["targets"]]
        draft = next(p for p in psutil.process_iter(["cmdline"])
                     if {"draft-server", ready["draft_server"]} <= set(p.info["cmdline"] or ()))
        draft.parent().kill()  # the actor's process: its draft server dies with it, and Ray starts both again
        moved = served(link, base, "'process_restarts_total{process=\"draft-server\"} 1.0' in metrics()", 180)
        drafting = [a for p in psutil.process_iter(["cmdline"]) if "draft-server" in (p.info["cmdline"] or ())
                    for a in p.info["cmdline"] if a.startswith(f"tcp://{link.draft_ip}:")]
    finally:
        gateway.send_signal(signal.SIGTERM)
        code = gateway.wait(timeout=90)
    local = Pair.load(ModelConfig(target_dir, dtype="float32"), None)
    ref = target_only(local.target, local.tokenizer.encode(PROMPT, add_special_tokens=False), 30, SamplingConfig(),
                      local.eos_ids)
    assert got["text"] == local.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    assert got["spec"]["drafts"] > 0  # drafted on the head, verified on the worker
    assert 'starsd:process_restarts_total{process="target-server"} 1.0' in after["metrics"]
    assert after["health"]["targets_up"] == 2 and after["texts"] == [got["text"]] * 3
    assert relocated["health"]["targets_up"] == 2 and relocated["texts"] == [got["text"]] * 3
    assert not serving  # none of the target servers now serving is at an address of the lost node's
    assert drafting and ready["draft_server"] not in drafting  # the draft server runs at a new address
    assert moved["texts"] == [got["text"]] * 3 and all(moved["drafts"]), moved["drafts"]  # and its targets draft there
    assert code == 0


def served(link, base: str, until: str, wait_s: float) -> dict:
    """From the head's namespace: wait up to wait_s until `until` holds (metrics(): the gateway's
    /metrics text, up(): its targets in service), then ask the gateway 3 times; the health, the
    answers' texts and steps drafted, and the metrics after."""
    script = ("import json, time, httpx2 as httpx, openai; base = %r; deadline = time.monotonic() + %r\n"
              "metrics = lambda: httpx.get(base + '/metrics').text\n"
              "up = lambda: httpx.get(base + '/health').json()['targets_up']\n"
              "while time.monotonic() < deadline and not (%s):\n"
              "    time.sleep(0.5)\n"
              "c = openai.OpenAI(base_url=base + '/v1', api_key='x', max_retries=0)\n"
              "rs = [c.completions.create(model='tiny', prompt=%r, max_tokens=30, temperature=0) for _ in range(3)]\n"
              "print(json.dumps({'health': httpx.get(base + '/health').json(), 'texts': [r.choices[0].text for r in rs],\n"
              "                  'drafts': [r.model_extra['spec_decode']['drafts'] for r in rs], 'metrics': metrics()}))"
              % (base, wait_s, until, PROMPT))
    run = subprocess.run([*link.exec_argv(link.draft_ns), sys.executable, "-c", script], capture_output=True,
                         text=True, timeout=wait_s + 60)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def lose_node(ip: str) -> None:
    """Kill -9 every process of the Ray node at `ip` (its raylet, its workers, the actors' processes):
    `ray stop` would take every node of this machine, the head's too."""
    mine = [p for p in psutil.process_iter(["cmdline"]) if any(ip in a for a in p.info["cmdline"] or ())]
    for p in mine:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(mine, timeout=30)

