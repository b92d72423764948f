"""vLLM engines run from StarSD's own environment: each in a process of the vLLM environment
(`make vllm`: .venv-vllm, vLLM's own transformers release), as bench vllm and the vLLM tests start them.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from starsd.config import ProposerSettings
from starsd.errors import SettingError
from starsd.star.processes import stop_group

VLLM_PYTHON = ".venv-vllm/bin/python"  # make vllm's, relative to the repository


def vllm_python(given: str = "") -> str:
    """The vLLM environment's interpreter: `given`, else $STARSD_VLLM_PYTHON, else make vllm's."""
    path = given or os.environ.get("STARSD_VLLM_PYTHON") or VLLM_PYTHON
    if not Path(path).is_file():
        raise SettingError(f"no vLLM environment at {path}: `make vllm` builds one (or set STARSD_VLLM_PYTHON)")
    return path


def engine_env(python: str, proposer: ProposerSettings | None = None, kv_cache_gib: int = 2,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a vLLM engine runs in: its venv's Intel OpenMP preloaded (vLLM's CPU build asks for
    it, or its speculation slows), a KV cache of `kv_cache_gib`, and the proposer's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STARSD_") or k == "STARSD_CACHE"}
    iomp = Path(os.path.abspath(python)).parent.parent / "lib" / "libiomp5.so"  # (the venv's: a venv's python
    # is a link to the base interpreter, which resolved it did not find, and vLLM fell back on torch's libgomp)
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if proposer is not None:
        for name, value in vars(proposer).items():
            env[f"STARSD_{name.upper()}"] = str(value)
    return {**env, **(extra or {})}


def taskset(cores: str) -> list[str]:
    """The command prefix that runs a process on `cores`, as taskset takes them (empty: all, no prefix)."""
    return ["taskset", "-c", cores] if cores else []


def bound_to(cores: str) -> dict[str, str]:
    """The environment in which vLLM's CPU build binds its OpenMP threads to `cores` (empty: its own choice)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": cores} if cores else {}


def run_engine(run: dict, python: str, proposer: ProposerSettings | None = None, timeout_s: float = 900,
               log: str | None = None, env: dict[str, str] | None = None, cores: str = "") -> dict:
    """One vLLM engine's run (bench/vllm_engine.py: `run`'s fields), its result. `proposer`: where a
    `starsd.vllm.Proposer` drafts. Its stderr goes to `log` (else is kept for the error). `cores`: the
    cores (as taskset takes them) its processes run on and vLLM binds its threads to; empty: all."""
    prefix = taskset(cores)
    env = {**(env or {}), **bound_to(cores)}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(run, f)
    err = open(log, "a") if log else subprocess.PIPE
    try:  # a group of its own: vLLM's engine core and worker outlive their parent if killed alone
        proc = subprocess.Popen([*prefix, python, "-m", "starsd.bench.vllm_engine", f.name], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=engine_env(python, proposer, extra=env),
                                start_new_session=True)
        try:
            out, errors = proc.communicate(timeout=timeout_s)
        finally:  # its end, a timeout or this process interrupted: nothing of the group stays behind
            stop_group(proc)
    finally:
        os.unlink(f.name)
        if log:
            err.close()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = errors[-3000:] if errors else f"(see {log})"
        raise RuntimeError(f"the vLLM engine failed (exit {proc.returncode}): {tail}")
    return json.loads(lines[-1])

