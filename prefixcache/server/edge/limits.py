"""Size and time limits of the HTTP edge, one frozen config (``prefixcache serve`` flags).

Everything a client controls is bounded before it costs us anything proportional to it: the
body before it is read (``Content-Length``) and while it is read, a text prompt before it is
tokenized (a text longer than ``max_model_len`` times the longest token in characters cannot
fit), token ids before they are hashed, lists the engine scans per generated token (stop strings,
stop token ids) before the request starts. Defaults are generous for honest clients; see the
"Limits" table in docs/server.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 4 << 20  # 413 above; the whole context as JSON ids is ~60 KiB
    max_json_depth: int = 32  # our bodies nest 4 levels; a deeper document is an attack
    # Objects and arrays in a body, counted before it is parsed (server/edge/body.py): parsing costs
    # per value (~3 us a content part), not per byte. A chat of max_messages messages with
    # list contents has ~3,000.
    max_json_containers: int = 8192
    max_n: int = 16  # choices per prompt
    max_prompts_per_request: int = 32  # prompts in one /v1/completions request
    max_logprobs: int = 20  # top logprobs per token (the engine's own ceiling is 20 too)
    max_stop_sequences: int = 16  # stop strings per request (OpenAI allows 4)
    max_stop_chars: int = 256  # characters per stop string
    max_stop_token_ids: int = 64
    max_messages: int = 1024  # chat messages per request
    max_tools: int = 128  # tool definitions per Messages request
    # Time: a body must arrive within body_timeout; a connection must send a request's headers
    # within header_timeout; a response chunk the client does not take within send_timeout
    # cancels its request (a client that stopped reading).
    body_timeout: float = 30.0
    header_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    send_timeout: float = 30.0
    max_connections: int = 512  # open connections; more are closed at once
    # Cache control calls (lookup, invalidate, stats: server/base/cache_gate.py) run on their own
    # threads, at most this many admitted per tenant at once (429 above).
    cache_route_threads: int = 4
    max_cache_calls_per_tenant: int = 2
    # ... and at most this many a second per non-admin tenant (a token bucket; 429 above).
    max_cache_calls_per_second: float = 20.0
    # A non-admin tenant with more refused requests (400, 404, 413, 422, 429) than this in a second gets
    # 429s for refusal_penalty seconds before its bodies are read (server/edge/refusals.py).
    max_refusals_per_second: int = 8
    refusal_penalty: float = 2.0
    # A client address answered more 401s than this in a second has its connections closed
    # and refused for refusal_penalty seconds (server/edge/refusals.py PeerGuard).
    max_unauthenticated_per_second: int = 64
    # /metrics is rendered by one reader at a time; keyless readers (--public-metrics) get a
    # read at most this old (server/observability/snapshot.py): their scrape storm costs one
    # read a second.
    metrics_max_age: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{f.name} must be a number, got {v!r}")
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{f.name} must be a positive number, got {v!r}")
        if self.max_logprobs > 20:
            raise ValueError(f"max_logprobs is at most 20 (the engine's), got {self.max_logprobs}")
