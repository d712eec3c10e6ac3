"""Call an ASGI app in-process for one HTTP request and stream its response back as messages.

A replica answers a forwarded request with the messages of ``forward``: first
``{"status", "headers", "body", "more"}`` (the response start *and* its first body chunk, so a caller that
got nothing yet knows nothing was produced and may retry elsewhere), then ``bytes`` chunks.
When the consumer stops early (the client went away, Ray cancelled the call) the app sees
``http.disconnect``, exactly as behind uvicorn, and aborts its engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


def http_scope(method: str, path: str, query: str, headers: list[tuple[str, str]], client: str) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": (client, 0),
        "server": ("prefixcache-replica", 0),
    }


async def stream_asgi(app, scope: dict, body: bytes) -> AsyncIterator[dict | bytes]:
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)  # the app returned (or raised): no more messages

    task = asyncio.create_task(run())
    start: dict | None = None
    try:
        while True:
            message = await sent.get()
            if message is None:
                if task.done() and task.exception() is not None and start is None:
                    raise task.exception()
                if start is not None:  # started but returned without a final body chunk
                    yield {"status": start["status"], "headers": start["headers"], "body": b"",
                           "more": False}  # fmt: skip
                return
            kind = message["type"]
            if kind == "http.response.start":
                start = {"status": message["status"],
                         "headers": [(k.decode("latin-1"), v.decode("latin-1"))
                                     for k, v in message.get("headers", [])]}  # fmt: skip
            elif kind == "http.response.body":
                chunk = message.get("body", b"")
                more = bool(message.get("more_body", False))
                if start is not None:
                    yield {"status": start["status"], "headers": start["headers"], "body": chunk,
                           "more": more}  # fmt: skip
                    start = None
                elif chunk:
                    yield chunk
                if not more:
                    return
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            task.cancel()
