"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server returns goes through :class:`APIError` or one of the handlers installed
by :func:`install_error_handlers`, so clients (the ``openai`` package included) always get a body
they can parse, whatever went wrong: malformed JSON, a wrong type, an unknown route, a full queue.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("prefixcache.server")

# HTTP status -> OpenAI error type. OpenAI itself answers most client errors with
# "invalid_request_error"; the others name the class of failure.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


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


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None):
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404) and wrong methods (405) from the router itself.
        code = "not_found" if exc.status_code == 404 else None
        return APIError(
            exc.status_code, str(exc.detail), code=code, headers=getattr(exc, "headers", None)
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
