"""Mooncake traces (FAST'25): one request a line, prefix blocks named by hash id.

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [int, ...]}``; equal hash ids are equal 512-token prefix blocks (the format of the
Mooncake repository's FAST25-release traces, also replayed by NVIDIA aiperf as
``mooncake_trace``). Block ``i`` of a request is worth 512 tokens, its last block what is left:
``input_length - 512 * (len(hash_ids) - 1)``.

Hash ids name prefixes, not contents: the same id always follows the same parent (checked on
both published traces), so the ids of all requests form a forest, the shape the eviction
policies (``cache/eviction/``) work on. The rule, checked as the trace is read
(``PrefixForest``): **within one request no id repeats, and an id always follows the same
parent (the id before it, or none: the request's first block) in every request**. An id that
repeats names a block that would be its own ancestor; one under two parents names two prefixes.

A bad line is a :class:`TraceFormatError` naming the file and line (and, for the rule above,
the id and the line where it was first seen): a trace is an input we replay, not a log to
salvage, so nothing is skipped silently.

The reader lives in bench/, the lower of its two users: ``bench serve --dataset-name
mooncake-trace`` replays a trace (``datasets.py``), ``analyze --trace-format mooncake``
simulates one (``analyze/trace_sim.py``, ``analyze/engine_sim.py``), and analyze may import
bench, never the reverse.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512


class TraceFormatError(ValueError):
    """A trace line that is not a Mooncake request; the message has ``FILE:LINE``."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, i: int) -> int:
        """Tokens of block ``i`` (the last one may be partial)."""
        n = len(self.hash_ids)
        return TRACE_BLOCK_TOKENS if i < n - 1 else self.input_length - TRACE_BLOCK_TOKENS * (n - 1)

    def hit_tokens(self, k: int) -> int:
        """Input tokens covered by the first ``k`` blocks."""
        return min(k * TRACE_BLOCK_TOKENS, self.input_length)

    def scaled_block_lengths(self, block_tokens: int) -> list[int]:
        """Tokens of each block when a 512-token block becomes ``block_tokens`` (a replay's
        scale): a full block exactly ``block_tokens``, a partial one its share rounded up (at
        least one token)."""
        scale = block_tokens / TRACE_BLOCK_TOKENS
        return [max(1, math.ceil(self.block_tokens(j) * scale)) for j in range(len(self.hash_ids))]


def _int(obj: dict, key: str, where: str) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise TraceFormatError(f"{where}: {key!r} must be a non-negative integer, got {v!r}")
    return v


def parse_request(line: str, where: str = "<line>") -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}: invalid JSON ({e.msg})") from e
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: not a JSON object")
    ts = obj.get("timestamp")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
        raise TraceFormatError(f"{where}: 'timestamp' must be a non-negative number of ms")
    n_in = _int(obj, "input_length", where)
    n_out = _int(obj, "output_length", where)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers")
    need = -(-n_in // TRACE_BLOCK_TOKENS)
    if len(ids) != need:
        raise TraceFormatError(
            f"{where}: {len(ids)} hash ids for input_length {n_in} (expected {need} blocks "
            f"of {TRACE_BLOCK_TOKENS} tokens)")
    return TraceRequest(float(ts), n_in, n_out, tuple(ids))


class PrefixForest:
    """Each hash id's parent as first seen (and where), to check the rule of the module: ids
    form a forest of prefixes."""

    def __init__(self) -> None:
        self._parent: dict[int, tuple[int | None, str]] = {}

    def add(self, r: TraceRequest, where: str) -> None:
        seen: dict[int, int] = {}
        parent = None
        for i, h in enumerate(r.hash_ids):
            if h in seen:
                raise TraceFormatError(
                    f"{where}: hash id {h} repeats within the request (blocks {seen[h]} and "
                    f"{i}); a Mooncake hash id names a block with its whole prefix, so it "
                    "occurs at most once in a request")
            seen[h] = i
            first = self._parent.setdefault(h, (parent, where))
            if first[0] != parent:
                def name(x):
                    return "no parent (a first block)" if x is None else f"parent {x}"

                raise TraceFormatError(
                    f"{where}: hash id {h} follows {name(parent)} here but {name(first[0])} "
                    f"at {first[1]}; a Mooncake hash id names a block with its whole prefix, "
                    "so it always follows the same parent")
            parent = h


def read_trace(path: str | Path, max_requests: int | None = None,
               start_ms: float | None = None, end_ms: float | None = None) -> list[TraceRequest]:
    """The requests of a trace, in file order, optionally cut to a time window / a count; the
    requests kept obey the rule of the module (``TraceFormatError`` naming the line, the id,
    and the line where it was first seen)."""
    out: list[TraceRequest] = []
    forest = PrefixForest()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            r = parse_request(line, where)
            if start_ms is not None and r.timestamp_ms < start_ms:
                continue
            if end_ms is not None and r.timestamp_ms >= end_ms:
                continue
            forest.add(r, where)
            out.append(r)
            if max_requests is not None and len(out) >= max_requests:
                break
    return out


def infinite_hit_rate(requests: list[TraceRequest]) -> float:
    """Share of input tokens an unbounded cache serves: each request's leading run of blocks
    seen before (all of a request's blocks are cached after it)."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        hit += r.hit_tokens(k)
        total += r.input_length
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def working_set_blocks(requests: list[TraceRequest]) -> int:
    """Distinct hash ids: the blocks an unbounded cache would hold."""
    return len({h for r in requests for h in r.hash_ids})
