"""What a segments request asks for: its options, each document's token span and key. No torch.

A segment key names the KV of a token run computed *alone*: after the ``sink`` tokens (the
first token of the prompt, the model's attention sink) and nothing else, at positions
len(sink)..len(sink)+n-1 (the boundary convention ``BOUNDARY``). It is a pure function of what
that KV depends on: the model fingerprint (weights, tokenizer, dtype, KV dtype), the KV dtype
once more (spelled out so a reader of the key input needs no fingerprint to tell formats apart),
the namespace, the convention, the sink ids and the token ids. Equal keys mean equal stored KV;
the store still compares token ids on a hit, so a collision can only cost a miss.

    key = H( b"prefixcache/segment-key" || u32(SEGMENT_KEY_VERSION) || str(fingerprint)
             || str(kv_dtype) || str(BOUNDARY) || ns || u32(m) || u32(s[0]) ... u32(s[m-1])
             || u32(n) || u32(t[0]) ... u32(t[n-1]) )          s: the sink ids, t: the segment's

with ``H``, ``u32``, ``str`` and ``ns`` as in docs/design.md §3 (the block-key format).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixcache.api.errors import InvalidRequestError
from prefixcache.cache.hashing import _str, _u32, _u32_array, key_hash

SEGMENT_KEY_VERSION = 2
_TAG = b"prefixcache/segment-key"
# Segments are computed after the prompt's first SINK_TOKENS tokens (the attention sink: v1
# computed them from position 0, where a document's own first token became the sink of all its
# other tokens; docs/benchmarks-journal.md has both).
SINK_TOKENS = 1
BOUNDARY = f"after-prompt-head-{SINK_TOKENS}"

CACHE_MODES = ("prefix", "segments")
DEFAULT_RECOMPUTE_TOKENS = 16
# Which tokens of a reused segment are recomputed (the budget is the same in every mode):
# "first" its first tokens (EPIC), "deviation" those whose KV deviates most from what the context
# gives (CacheBlend; segments/blend.py), "both" half of each.
SELECTIONS = ("first", "deviation", "both")
MAX_RECOMPUTE_TOKENS = 1 << 20


def segment_key(
    fingerprint: str,
    kv_dtype: str,
    namespace: str | None,
    token_ids: list[int],
    sink: list[int] | tuple[int, ...] = (),
) -> bytes:
    ns = b"\x00" if namespace is None else b"\x01" + _str(namespace)
    head = _TAG + _u32(SEGMENT_KEY_VERSION) + _str(fingerprint) + _str(kv_dtype) + _str(BOUNDARY)
    # little-endian u32 ids on every platform we run on
    sink_b = _u32(len(sink)) + _u32_array(list(sink)).tobytes()
    return key_hash(head + ns + sink_b + _u32(len(token_ids)) + _u32_array(token_ids).tobytes())


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
class SegmentSpan:
    """Prompt tokens ``[start, end)`` are one document; ``key`` names its KV computed alone."""

    start: int
    end: int
    key: bytes

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SegmentPlan:
    """A sequence's segments in prompt order (non-overlapping, before the last prompt token)
    and the recompute options. Everything outside the spans is computed exactly."""

    spans: tuple[SegmentSpan, ...]
    options: SegmentOptions
    sink: tuple[int, ...] = ()  # the tokens every segment of this plan is computed after
    # /v1/cache/warm in segments mode: compute and keep each span the store lacks; nothing is
    # placed, sampled or written into the pool, and the request ends when they are kept.
    store_only: bool = False

    @property
    def end(self) -> int:
        return self.spans[-1].end if self.spans else 0

    def first_start(self) -> int:
        return self.spans[0].start if self.spans else 0


def check_spans(spans: list[tuple[int, int]], num_prompt_tokens: int) -> None:
    """Spans must be non-empty, in order, non-overlapping, and end before the last prompt token
    (whose logits are needed, so it is always computed)."""
    prev = 0
    for a, b in spans:
        if type(a) is not int or type(b) is not int or not (prev <= a < b < num_prompt_tokens):
            raise InvalidRequestError(
                f"segment span ({a!r}, {b!r}) is out of order, empty or outside the prompt "
                f"of {num_prompt_tokens} tokens", param="messages")  # fmt: skip
        prev = b


@dataclass(frozen=True)
class SegmentRequest:
    """What a caller asks for: the document spans of its prompt ids (from
    ``model.tokenizer_segments.encode_chat_segments``) and the recompute options."""

    spans: tuple[tuple[int, int], ...]
    options: SegmentOptions = SegmentOptions()
    store_only: bool = False  # see SegmentPlan
