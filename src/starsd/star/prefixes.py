"""Shared prefixes: the draft KV a draft server holds, indexed by blocks of tokens, so that a new
stream whose prompt begins with tokens held for another starts from a copy of their KV instead of
computing it again (as vLLM's automatic prefix caching indexes its KV blocks).

A prefix of n = k * BLOCK tokens is known by the hash of its k blocks, chained block after block.
The index maps each such hash to the last *owner* registered for it: a session's tag, or the key of
a retired sequence (a freed session's draft state, kept while the budget has room: sessions.py).
An entry is a hint: before a prefix is used, its owner's tokens are compared with the prompt's, and
its KV must hold them (`DraftSequence.cached`), so a stale or colliding entry costs a lookup only.
"""

from __future__ import annotations

BLOCK = 16  # tokens a block of the index holds


def block_hashes(tokens: list[int], upto: int | None = None) -> list[int]:
    """The chained hash of each whole block of tokens[:upto]: entry k - 1 names tokens[:k * BLOCK].

    >>> len(block_hashes(list(range(40)))), block_hashes([1] * 16) == block_hashes([1] * 17)
    (2, True)
    """
    end = len(tokens) if upto is None else min(upto, len(tokens))
    hashes, h = [], 0
    for start in range(0, end - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[start:start + BLOCK])))
        hashes.append(h)
    return hashes


class PrefixIndex:
    """Prefix hashes -> the owner last registered for each, and each owner's hashes (to take them out)."""

    def __init__(self):
        self._owner: dict[int, int] = {}
        self._hashes: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def register(self, owner: int, tokens: list[int], upto: int | None = None) -> None:
        """`owner` holds tokens[:upto] (all of them by default): it replaces what it held before."""
        self.drop(owner)
        hashes = block_hashes(tokens, upto)
        for h in hashes:
            self._owner[h] = owner
        self._hashes[owner] = hashes

    def move(self, old: int, new: int) -> None:
        """What `old` held is now `new`'s (a freed session's state retired under a key of its own)."""
        hashes = self._hashes.pop(old, [])
        for h in hashes:
            if self._owner.get(h) == old:
                self._owner[h] = new
        self._hashes[new] = hashes

    def drop(self, owner: int) -> None:
        for h in self._hashes.pop(owner, []):
            if self._owner.get(h) == owner:
                del self._owner[h]

    def candidates(self, tokens: list[int]) -> list[tuple[int, int]]:
        """(prefix length, owner) for the prefixes of `tokens` the index names, longest first."""
        hashes = block_hashes(tokens)
        return [((k + 1) * BLOCK, self._owner[h]) for k, h in reversed(list(enumerate(hashes)))
                if h in self._owner]
