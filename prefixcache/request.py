"""Request, SamplingParams, RequestOutput: plain data, shaped like vLLM's so users know them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs of each generated token
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Accept lists (and a single string for stop) from callers; store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None:
            object.__setattr__(self, "top_k", -1)
        elif self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    # One dict per generated token: token id -> logprob (the chosen token and the top-k).
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics | None = None


@dataclass
class StreamDelta:
    """One increment of a streamed request (AsyncEngine.add_request yields these)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics
    new_logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    # Set on the first delta when the request asked for an explanation of its hit or miss.
    cache_info: CacheExplanation | None = None


@dataclass(frozen=True)
class CacheExplanation:
    """Why a prompt hit or missed the prefix cache, computed when it was admitted.

    reason is one of: "full_hit" (every full block cached), "no_prior_request" (nothing with this
    prefix was ever cached in the namespace), "evicted" (it was cached, then evicted),
    "diverged" (an earlier prompt shared the first ``first_uncached_position`` tokens, then
    differed), "other_namespace" (the blocks exist, but under another namespace),
    "partial_block" (only the tail, shorter than a block, is uncached: it is never cached),
    "caching_disabled".
    """

    cached_tokens: int
    first_uncached_position: int
    reason: str
    diverged_at: int | None = None
