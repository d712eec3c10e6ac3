"""Anthropic's error dialect: ``{"type": "error", "error": {"type", "message"}}`` on the Messages
routes (``/v1/messages`` and those under it), whoever raises the error (the routes, the body
checks, the edge's refusals, an unknown route under the path). The app answers in it by the
:class:`~prefixcache.server.edge.errors.ErrorDialect` this package passes (``DIALECT``); the
cluster's ingress passes it too.
"""

from __future__ import annotations

from prefixcache.server.edge.errors import ErrorDialect

# HTTP status -> Anthropic error type (its documented errors); the Messages routes answer
# a wrong type or a missing field with a 400, as Anthropic does, where the OpenAI routes say 422.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = "/v1/messages"  # this route and those under it speak Anthropic's dialect


def status(status: int) -> int:
    return 400 if status == 422 else status


def error_body(status: int, message: str) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


DIALECT = ErrorDialect(ANTHROPIC_PATHS, status, error_body)
