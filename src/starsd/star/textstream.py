"""Token ids -> text deltas for a stream, with stop strings (OpenAI's `stop`).

A delta is held back while it could still be the start of a stop string, or while it ends in an
incomplete UTF-8 character (byte-level BPE splits characters over tokens), so that no text a client
has seen is ever taken back.
"""

from __future__ import annotations

_INCOMPLETE = "\ufffd"  # what the tokenizer decodes a partial UTF-8 sequence to


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of `text` already handed out

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """Take a step's tokens; return the new text that is safe to show, and whether a stop
        string was reached (the text then ends just before it, and the stream is over)."""
        self.ids += ids
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._first_stop()
        if cut is not None:
            return self._emit(cut), True
        end = len(self.text.rstrip(_INCOMPLETE)) if self.text.endswith(_INCOMPLETE) else len(self.text)
        return self._emit(end - self._stop_prefix(end)), False

    def flush(self) -> str:
        """The held-back rest, at the end of a stream that met no stop string."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        end = max(end, self.sent)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta

    def _first_stop(self) -> int | None:
        """Where the earliest stop string starts in the text not yet handed out."""
        found = [i for s in self.stop if (i := self.text.find(s, self.sent)) >= 0]
        return min(found) if found else None

    def _stop_prefix(self, end: int) -> int:
        """Length of the longest tail of text[sent:end] that begins some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, end - self.sent), longest, -1):
                if self.text.endswith(s[:k], 0, end):
                    longest = k
                    break
        return longest
