"""A segments request's plan: each document's token span and key, in prompt order. No torch.

What the caller asks for (``SegmentRequest``, ``SegmentOptions``) is the request's data, in
``api/segments.py``; this module turns it into keyed spans (``SegmentPlan``).

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

from dataclasses import dataclass

from prefixcache.api.errors import InvalidRequestError
from prefixcache.api.segments import SegmentOptions
from prefixcache.cache.hashing import _str, _u32, _u32_array, key_hash

SEGMENT_KEY_VERSION = 2
_TAG = b"prefixcache/segment-key"
# Segments are computed after the prompt's first SINK_TOKENS tokens (the attention sink: v1
# computed them from position 0, where a document's own first token became the sink of all its
# other tokens; docs/benchmarks-journal.md has both).
SINK_TOKENS = 1
BOUNDARY = f"after-prompt-head-{SINK_TOKENS}"


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
