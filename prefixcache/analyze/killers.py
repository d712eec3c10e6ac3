"""Cache killers: requests whose content was mostly seen before, but which diverge early.

A timestamp or a user name at the top of a system prompt makes every prompt unique from that
token on; the prefix cache then saves nothing, although most of the content repeats. Finding
this needs a notion of "seen content" that survives a shift, which the block hash chain by
design does not have. So each prompt also gets a few *content features*: hashes of its 16-token
windows, kept when the hash falls in a 1/32 sample (so the same windows are kept in every prompt
that contains them, wherever they sit), with their positions. For a request whose cached prefix
is short, the features after that prefix tell how much of the rest was seen before:

    seen    ≈ (features after the cached prefix seen before / features after it) × tokens after it
    killer  if cached + seen ≥ half its tokens and seen ≥ a quarter of them (the "lost" tokens)

Candidates are grouped by the first seen feature after their cached prefix: the content that
follows the volatile spot, the same for every request with the same pattern (all prompts with a
timestamp in the same system prompt). The example pair of a group is the request and the last
earlier request holding that feature; for the largest groups it is compared token by token: the
first divergence, where the content realigns, how much is really shared after it, an excerpt.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import repeat
from typing import NamedTuple

import numpy as np

WINDOW = 16
_SAMPLE_MASK = np.uint64(31)
MIN_FEATURES = 4  # fewer say too little about how much content two prompts share
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def content_features(tokens: np.ndarray) -> tuple[list[int], list[int]]:
    """``(positions, hashes)`` of the sampled token windows of a prompt, in position order."""
    if len(tokens) < WINDOW:
        return [], []
    x = tokens.astype(np.uint64) + _GOLD
    x *= _M1
    x ^= x >> np.uint64(31)
    s = np.empty(len(x) + 1, dtype=np.uint64)
    s[0] = 0
    np.cumsum(x, out=s[1:])
    w = s[WINDOW:] - s[:-WINDOW]  # order-free window sums, wrapping mod 2**64
    w ^= w >> np.uint64(29)
    w *= _M2
    w ^= w >> np.uint64(32)
    pos = np.flatnonzero((w & _SAMPLE_MASK) == 0)
    return pos.tolist(), w[pos].tolist()


class KillerGroup:
    """Requests whose first seen content after their cached prefix is the same."""

    __slots__ = ("example", "lost_tokens", "requests")

    def __init__(self, example: tuple[int, int]) -> None:
        self.requests = 0
        self.lost_tokens = 0.0
        self.example = example  # (request, earlier request holding the same content)


class KillerDetector:
    """Streams over requests; memory is one entry per distinct sampled feature (and group)."""

    def __init__(self, min_shared: float = 0.5, min_lost: float = 0.25, min_blocks: int = 2):
        self.min_shared = min_shared
        self.min_lost = min_lost
        self.min_blocks = min_blocks
        self._last_with: dict[int, int] = {}  # feature -> last request that had it
        self.groups: dict[int, KillerGroup] = {}  # first seen feature -> group

    def observe(
        self,
        request: int,
        positions: Sequence[int],
        features: Sequence[int],
        n_tokens: int,
        cached_tokens: int,
        block_size: int,
    ) -> None:
        lost_floor = max(self.min_lost * n_tokens, self.min_blocks * block_size)
        if n_tokens - cached_tokens >= lost_floor:
            k = bisect_left(positions, cached_tokens)
            after = features[k:]
            if len(after) >= MIN_FEATURES:
                holders = list(map(self._last_with.get, after))
                n_seen = len(holders) - holders.count(None)
                seen = n_seen / len(after) * (n_tokens - cached_tokens)
                if seen >= lost_floor and cached_tokens + seen >= self.min_shared * n_tokens:
                    i = next(i for i, h in enumerate(holders) if h is not None)
                    g = self.groups.get(after[i])
                    if g is None:
                        g = self.groups[after[i]] = KillerGroup((request, holders[i]))
                    g.requests += 1
                    g.lost_tokens += seen
        self._last_with.update(zip(features, repeat(request)))

    def top(self, k: int) -> list[KillerGroup]:
        return sorted(self.groups.values(), key=lambda g: -g.lost_tokens)[:k]


class Divergence(NamedTuple):
    position: int  # first token where the two prompts differ
    resync: int | None  # where the request's content realigns with the other prompt
    other_resync: int | None  # the same place in the other prompt
    shared_after: int  # tokens of the request after the divergence also found in the other


def divergence(a: Sequence[int], b: Sequence[int], anchor: int = 8) -> Divergence:
    """First differing token of ``a`` vs ``b``, where ``a`` realigns with ``b`` after it, and
    how many tokens of ``a`` after the divergence are shared content.

    Realigning means: the next ``anchor`` tokens of ``a`` occur in ``b`` after its divergence.
    """
    n = min(len(a), len(b))
    d = 0
    while d < n and a[d] == b[d]:
        d += 1
    grams: dict[tuple[int, ...], int] = {}
    for j in range(d, len(b) - anchor + 1):
        grams.setdefault(tuple(b[j : j + anchor]), j)
    resync = other = None
    shared_until = d  # tokens of a covered by a matching window so far
    shared = 0
    for i in range(d, len(a) - anchor + 1):
        j = grams.get(tuple(a[i : i + anchor]))
        if j is None:
            continue
        if resync is None:
            resync, other = i, j
        lo = max(i, shared_until)
        shared += i + anchor - lo
        shared_until = i + anchor
    return Divergence(d, resync, other, shared)
