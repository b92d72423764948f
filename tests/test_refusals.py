"""Every refusal a person can act on is one line on stderr, with no traceback, and a non-zero exit:
the real `starsd` command in a child process, as a person runs it. Each refusal comes before any
model loads, so these run in seconds."""

import os
import socket
import subprocess
import sys

import pytest

from starsd.star.processes import free_port


def offline(cache) -> dict[str, str]:
    """An empty model cache and a package index that cannot be reached (a closed loopback port):
    nothing can load, so a refusal that came after a model load would show as a failed fetch."""
    return {"STARSD_CACHE": str(cache), "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
            "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_DEFAULT_TIMEOUT": "2", "PIP_NO_CACHE_DIR": "1"}


@pytest.fixture(autouse=True)
def nothing_to_load(tmp_path, monkeypatch):
    for key, value in offline(tmp_path / "cache").items():
        monkeypatch.setenv(key, value)


def starsd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "starsd.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def refused(run: subprocess.CompletedProcess, *words: str) -> str:
    """The run's one line of refusal; asserts it is the whole of stderr and names `words`."""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode != 0, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("starsd"), lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def taken_port():
    """A TCP port on loopback that another process (this one) is listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_bad_flags_and_values():
    refused(starsd("generate", "--prompt", "x", "--max-new-tokens", "many"), "--max-new-tokens", "invalid int")
    refused(starsd("generate", "--prompt", "x", "--no-such-flag"), "--no-such-flag", "starsd generate --help")
    refused(starsd("generate", "--prompt", "x", "--threads", "-1"), "threads must be >= 0")
    refused(starsd("draft-server", "--max-batch", "0"), "max_batch must be >= 1")
    refused(starsd("launch", "--prompts", "poems"), "unknown prompt set 'poems'")
    refused(starsd("serve", "--draft-servers", "0"), "--draft-servers must be 1 to 64, not 0")
    refused(starsd("model", "--from", "/nonexistent/profile.json"), "cannot read a profile")
    refused(starsd("serve", "--api-key-file", "/nonexistent/key"), "cannot read the API key file")
    refused(starsd("draft-server", "--recording", "/nonexistent/drafts.json"), "cannot read the recording")
    refused(starsd("target-server", "--bind", "tcp://127.0.0.1:9", "--connect", "tcp://127.0.0.1:9",
                   "--target-engine", "llamacpp", "--target-streams", "64", "--draft-top-k", "4", "--draft-depth", "3"),
            "64 streams leave each stream's draft tree 4 leaves", "--draft-total-tokens")


def test_addresses_that_may_not_be_opened_without_keys():
    port = str(free_port())
    refused(starsd("draft-server", "--bind", f"tcp://0.0.0.0:{port}"), "not a loopback address", "--insecure")
    refused(starsd("target-server", "--bind", f"tcp://0.0.0.0:{port}"), "not a loopback address", "--insecure")
    line = refused(starsd("serve", "--host", "0.0.0.0", "--port", port), "--api-key", "--insecure")
    assert "0.0.0.0" in line


def test_ports_in_use(taken_port):
    address = f"tcp://127.0.0.1:{taken_port}"
    refused(starsd("draft-server", "--bind", address), "cannot listen on", "address already in use")
    refused(starsd("target-server", "--bind", address), "cannot listen on", "address already in use")
    refused(starsd("serve", "--port", str(taken_port)), "cannot listen on", "--port")


def test_missing_or_unreadable_keys(tmp_path):
    port = str(free_port())
    refused(starsd("draft-server", "--bind", f"tcp://127.0.0.1:{port}", "--curve-key", str(tmp_path / "none"),
                   "--curve-clients", str(tmp_path)), "cannot read the key file")
    refused(starsd("stats", "--connect", f"tcp://127.0.0.1:{port}", "--curve-key", str(tmp_path / "none")),
            "needs both its own secret key and the server's public key")
    public = tmp_path / "me.key"
    public.write_text("not a key\n")
    refused(starsd("stats", "--connect", f"tcp://127.0.0.1:{port}", "--curve-key", str(public),
                   "--curve-server-key", str(public)), "me.key")


def test_a_peer_that_does_not_answer():
    refused(starsd("stats", "--connect", f"tcp://127.0.0.1:{free_port()}", "--timeout", "1"), "no answer from")


def test_a_model_that_is_not_cached_and_cannot_be_fetched(tmp_path):
    """The fetch says what it tries before it is refused; the refusal is its last line."""
    run = starsd("models", "fetch", "qwen2.5-coder-0.5b-instruct")
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("starsd: error: part 1 of qwen2.5-coder-0.5b-instruct") and "could not be downloaded" in last
    refused(starsd("models", "fetch", "qwen-9000b"), "unknown pinned model 'qwen-9000b'")
    refused(starsd("launch", "--target", str(tmp_path / "no-such-model"), "--draft", str(tmp_path / "no-such-draft")),
            "no-such-model", "is not a pinned name")


def test_an_open_gateway_needs_a_key_or_insecure():
    """The gateway's rule is the star sockets' rule: a non-loopback host without a key is refused (above);
    with a key, or --insecure, it listens, and here goes on to wait for its target server, which is
    not there: refused in one line once --start-timeout has passed."""
    target = f"tcp://127.0.0.1:{free_port()}"
    for opening in (["--api-key", "k"], ["--insecure"]):
        run = starsd("serve", "--host", "0.0.0.0", "--port", str(free_port()), *opening, "--target-server", target,
                     "--start-timeout", "1")
        refused(run, target, "did not answer within 1 s")
