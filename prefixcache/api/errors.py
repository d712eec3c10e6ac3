"""Typed errors of the engine boundary: what a caller did wrong, what it may retry, what broke.

The server maps each class to one HTTP status by its type, never by matching message text:

    InvalidRequestError  (ValueError)  400  the request itself is wrong; ``param`` names the field
      ContextLengthError               400  prompt + max_tokens over the context (code
                                            ``context_length_exceeded``)
      PinQuotaError                    400  a pin over the pool's pin budget or the tenant's quota
      SegmentLimitError                400  a segments request over its document or record limit
    QueueFullError                     429  too many waiting requests (all tenants); retry later
      TenantQuotaError                 429  this tenant holds its share of the queue; retry later
    EngineShutDownError                503  the engine takes no new requests
    TierUnavailableError               503  a cache tier (Redis) could not be reached for a
                                            cache-control call (invalidate); retry later
    SequenceFailedError                500  our fault: one sequence failed in sampling or output
                                            processing; the others in its step went on
    SlowConsumerError                  -    the stream's reader fell too far behind; the request
                                            was cancelled and its blocks freed

``InvalidRequestError`` subclasses ``ValueError`` so the offline API keeps raising what vLLM's
raises. No prefixcache imports: every layer may raise these.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the errors the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt, sampling parameters, cache call) the engine refuses as given."""

    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt plus completion longer than the context (or than the KV pool can hold)."""

    code = "context_length_exceeded"


class PinQuotaError(InvalidRequestError):
    """A pin that would exceed the pool's pin budget or the tenant's pin quota."""

    code = "pin_quota_exceeded"


class SegmentLimitError(InvalidRequestError):
    """A segments request over a configured limit: more documents than
    ``max_segments_per_request``, or a document whose KV computed alone would make a record
    larger than ``max_segment_record``."""

    code = "segment_limit_exceeded"


class QueueFullError(EngineError, RuntimeError):
    """More requests are waiting than the engine accepts; retry after ``retry_after`` seconds."""

    code = "queue_full"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class TenantQuotaError(QueueFullError):
    """This tenant already holds its share of the waiting (or running) sequences."""

    code = "tenant_quota_exceeded"


class EngineShutDownError(EngineError, RuntimeError):
    """The engine is shutting down or shut down: it takes no new requests."""


class TierUnavailableError(EngineError, RuntimeError):
    """A persistent cache tier (Redis) could not be reached for a cache-control call; what
    could be done (the RAM pool, the other tiers) was done."""

    code = "cache_tier_unavailable"


class SequenceFailedError(EngineError, RuntimeError):
    """One sequence failed inside a step (sampling, output processing): a bug of ours, not of
    the request. The sequence was finished alone; the others in the step were not touched."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"request {request_id} failed: {type(cause).__name__}")
        self.request_id = request_id
        self.cause = cause


class SlowConsumerError(EngineError, RuntimeError):
    """The reader of a stream left more than the allowed number of deltas unread."""
