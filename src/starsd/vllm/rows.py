"""vLLM's rows as the star's streams. vLLM's proposer interface (custom_class, 0.32-0.33) gives each
step a batch of rows and, for each, its committed tokens; it gives no request ids and no word when a
request ends, and it moves rows as requests come and go (a finished request's row is filled with the
batch's last one). A row is taken for the stream whose tokens it extends: the same request, one step
on, or another request whose prefix the stream already holds, which drafts from the same state.
Two requests' tokens are never mixed: a row that extends no stream opens a new one (a reset with its
whole prefix).
"""

from __future__ import annotations

from dataclasses import dataclass


def extends(tokens: list[int], known: list[int]) -> bool:
    """Whether `tokens` is `known` with zero or more tokens after it."""
    return len(tokens) >= len(known) and tokens[:len(known)] == known


@dataclass
class Claim:
    row: int
    stream: int | None  # the index of the stream the row extends; None: a new request


def claim(rows: dict[int, list[int]], held: dict[int, list[int]], last_row: dict[int, int]) -> list[Claim]:
    """Each row's stream. `rows`: row -> committed tokens, of the rows vLLM asks drafts for this step;
    `held`: stream -> the committed tokens it was last given; `last_row`: stream -> the row it had.
    A stream is taken by at most one row: first by the row it had, if that row goes on from it, then
    by any other row that goes on from it, longest stream first (the most specific prefix). A row goes
    on from a stream where it holds the stream's tokens and more (a request commits at least one a
    step): one that holds exactly those is another request at the same point (copies of a prompt that
    sampled alike), which would bring the stream's server no new token."""
    claims = {}
    free = dict(held)

    def goes_on(row: int, stream: int) -> bool:
        return len(rows[row]) > len(free[stream]) and extends(rows[row], free[stream])

    for stream, row in last_row.items():
        if row in rows and stream in free and goes_on(row, stream):
            claims[row] = Claim(row, stream)
            del free[stream]
    for row in sorted(rows):
        if row in claims:
            continue
        found = [s for s in free if goes_on(row, s)]
        stream = max(found, key=lambda s: len(free[s]), default=None)
        if stream is not None:
            del free[stream]
        claims[row] = Claim(row, stream)
    return [claims[row] for row in sorted(claims)]
