"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, unless the
route's API speaks another dialect (an :class:`ErrorDialect` its package passes to the app:
Anthropic's, anthropic/errors.py, on ``/v1/messages...``).

Every failure the server returns goes through :class:`APIError` or one of the handlers installed
by :func:`install_error_handlers`, so clients (the ``openai`` package included) always get a body
they can parse, whatever went wrong: malformed JSON, a wrong type, an unknown route, a full queue.

The engine's typed errors (prefixcache/errors.py) map to statuses by class in
:func:`from_engine_error`; nothing matches message text. A 5xx means a fault of ours: its body
says only "internal error" and the request id (``X-Request-Id``), and the log has the traceback
under that id. Internal exception text never reaches a client.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixcache.api.errors import (
    EngineShutDownError,
    InvalidRequestError,
    QueueFullError,
    SequenceFailedError,
    SlowConsumerError,
    TierUnavailableError,
)

log = logging.getLogger("prefixcache.server")

# HTTP status -> OpenAI error type. OpenAI itself answers most client errors with
# "invalid_request_error"; the others name the class of failure.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


@dataclass(frozen=True)
class ErrorDialect:
    """How an API that is not OpenAI-shaped answers errors on its routes: those at ``path`` and
    under it. ``status``: the status it answers for ours (a 422 may be its 400); ``body``: its
    error body for a status and a message."""

    path: str
    status: Callable[[int], int]
    body: Callable[[int, str], dict]

    def covers(self, path: str) -> bool:
        return path == self.path or path.startswith(self.path + "/")

    def body_of(self, err: APIError) -> dict:
        return self.body(self.status(err.status), err.message)

    def response(self, err: APIError) -> JSONResponse:
        return JSONResponse(
            self.body_of(err), status_code=self.status(err.status), headers=err.headers
        )


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")


class APIError(Exception):
    """An error answered as ``status`` with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def response_for(self, path: str, dialects: Iterable[ErrorDialect] = ()) -> JSONResponse:
        """The answer in the dialect of the route at ``path``: the first of ``dialects`` that
        covers it, else OpenAI's."""
        for d in dialects:
            if d.covers(path):
                return d.response(self)
        return self.response()


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None):
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def from_engine_error(e: BaseException, request_id: str | None = None) -> APIError | None:
    """The API error for one of the engine's typed errors; None for anything else (a bug,
    which the caller logs and answers with :func:`internal_error`)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineShutDownError):
        return APIError(503, "the server is shutting down", code="shutting_down")
    if isinstance(e, TierUnavailableError):
        return APIError(503, str(e), code=e.code)
    if isinstance(e, QueueFullError):  # TenantQuotaError included
        return APIError(
            429, f"server is busy: {e.message}", code=e.code,
            headers={"Retry-After": str(max(1, round(e.retry_after)))},
        )  # fmt: skip
    if isinstance(e, InvalidRequestError):
        return APIError(400, e.message, param=e.param, code=e.code)
    if isinstance(e, SlowConsumerError):
        return APIError(408, "the client did not read the response in time", code="slow_client")
    if isinstance(e, SequenceFailedError):
        return internal_error(request_id, e)
    return None


def new_request_id() -> str:
    return uuid.uuid4().hex


def internal_error(request_id: str | None, exc: BaseException | None = None) -> APIError:
    """Our fault: logged with the traceback under the request id; the client gets the id only."""
    log.error("request %s: internal error", request_id, exc_info=exc)
    return APIError(
        500, f"internal error (request id {request_id}); the server log has the details",
        code="internal_error",
    )  # fmt: skip


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A pydantic failure (wrong type, missing field) as a 422 naming the first bad field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    # Drop "body" and the union-member tags pydantic puts in a location ("prompt.list[int]").
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    same_field = all(e.get("loc", ())[:2] == first.get("loc", ())[:2] for e in errors)
    more = "" if same_field or len(errors) < 2 else f" (and {len(errors) - 1} more errors)"
    where = f"{param}: " if param else ""
    return APIError(422, f"{where}{msg}{more}", param=param, code="invalid_type")


def _count_refusal(request: Request, status: int) -> None:
    """A refusal of a tenant's request counts toward its refusal limit (server/edge/refusals.py);
    ``accept`` names the tenant on the request when it is counted. A 401 has no tenant: it
    counts toward its client address's (``PeerGuard``)."""
    tenant = getattr(request.state, "refusal_tenant", None)
    if tenant is not None:
        request.app.state.serving.refusals.record(tenant, status)
    elif status == 401:
        guard = getattr(request.app.state, "peer_guard", None)
        if guard is not None and request.client is not None:
            guard.refused(request.client.host)


def install_error_handlers(app: FastAPI, dialects: Iterable[ErrorDialect] = ()) -> None:
    """Every failure answered as an :class:`APIError`, in the dialect of its route's API."""
    dialects = tuple(dialects)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        _count_refusal(request, exc.status)
        return exc.response_for(request.url.path, dialects)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        _count_refusal(request, 422)
        return validation_error(exc).response_for(request.url.path, dialects)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404) and wrong methods (405) from the router itself.
        code = "not_found" if exc.status_code == 404 else None
        return APIError(
            exc.status_code, str(exc.detail), code=code, headers=getattr(exc, "headers", None)
        ).response_for(request.url.path, dialects)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = request_id_of(request.scope)
        err = from_engine_error(exc, rid) or internal_error(rid, exc)
        _count_refusal(request, err.status)
        resp = err.response_for(request.url.path, dialects)
        if rid:
            resp.headers["X-Request-Id"] = rid
        return resp


def request_id_of(scope) -> str | None:
    return scope.get("state", {}).get("request_id")


class RequestIdMiddleware:
    """Gives every HTTP request an id (``X-Request-Id`` on the answer; in the log of a 5xx)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)
