"""What a segments request asks for (docs/segments.md): its documents' token spans and how much
of each reused one is recomputed. Plain data of the engine boundary, no torch: the server builds
it, ``EngineRequest.segments`` carries it, and the segments feature plans from it
(``segments/plan.py``: the spans' keys)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixcache.api.errors import InvalidRequestError

CACHE_MODES = ("prefix", "segments")
DEFAULT_RECOMPUTE_TOKENS = 16
# Which tokens of a reused segment are recomputed (the budget is the same in every mode):
# "first" its first tokens (EPIC), "deviation" those whose KV deviates most from what the context
# gives (CacheBlend; segments/blend.py), "both" half of each.
SELECTIONS = ("first", "deviation", "both")
MAX_RECOMPUTE_TOKENS = 1 << 20


@dataclass(frozen=True)
class SegmentOptions:
    """How much of each reused segment is recomputed in its new context, and which tokens.

    The budget: a segment of n tokens recomputes
    ``B = min(n, max(recompute_tokens, ceil(recompute_ratio * n)))`` tokens whatever the
    selection: ``recompute_tokens >= n`` (or ratio 1) recomputes it all, which is exactly a cold
    prefill of the same ids; B = 0 reuses it as stored. ``selection`` says which B tokens:

    - "first": its first B tokens (EPIC: where the missing context matters most);
    - "deviation": the B tokens whose layer-1 V computed in context deviates most from the
      placed one (CacheBlend; segments/blend.py), found by one extra layer over the segment;
    - "both": its first ceil(B/2) tokens, then the B - ceil(B/2) most deviating of the rest."""

    recompute_tokens: int = DEFAULT_RECOMPUTE_TOKENS
    recompute_ratio: float = 0.0
    selection: str = "first"

    def __post_init__(self):
        k = self.recompute_tokens
        if type(k) is not int or not 0 <= k <= MAX_RECOMPUTE_TOKENS:
            raise InvalidRequestError(
                f"segment_recompute_tokens must be an integer in [0, {MAX_RECOMPUTE_TOKENS}], "
                f"got {k!r}", param="segment_recompute_tokens")  # fmt: skip
        r = self.recompute_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0.0 <= r <= 1.0):
            raise InvalidRequestError(
                f"segment_recompute_ratio must be a number in [0, 1], got {r!r}",
                param="segment_recompute_ratio",
            )
        if not isinstance(self.selection, str) or self.selection not in SELECTIONS:
            raise InvalidRequestError(
                f"segment_selection must be one of {', '.join(SELECTIONS)}, "
                f"got {self.selection!r}", param="segment_selection")  # fmt: skip

    def recompute_for(self, n: int) -> int:
        """B, the tokens of an n-token segment recomputed."""
        return min(n, max(self.recompute_tokens, math.ceil(self.recompute_ratio * n)))

    def split(self, n: int) -> tuple[int, int]:
        """(f, d): of an n-token segment's B recomputed tokens, its first f and the d most
        deviating of the rest (f + d == B)."""
        b = self.recompute_for(n)
        f = {"first": b, "deviation": 0, "both": (b + 1) // 2}[self.selection]
        return f, b - f

    @property
    def probes(self) -> bool:
        """Whether reused segments need the deviation probe (segments/blend.py)."""
        return self.selection != "first"


@dataclass(frozen=True)
class SegmentRequest:
    """What a caller asks for: the document spans of its prompt ids (from
    ``tokenizer.segments.encode_chat_segments``) and the recompute options."""

    spans: tuple[tuple[int, int], ...]
    options: SegmentOptions = SegmentOptions()
    store_only: bool = False  # /v1/cache/warm: see segments/plan.py's SegmentPlan
