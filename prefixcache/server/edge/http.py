"""Connection-level defences: header timeout, connection cap, send timeout.

uvicorn (h11) has a keep-alive timeout but no limit on how long a client may take to send a
request's headers, and ``limit_concurrency`` answers 503 only once a request has arrived, so 200
half-sent requests hold 200 sockets forever. :func:`protocol_class` returns uvicorn's protocol
with two additions:

- **connection cap, shared by peers**: at ``max_connections`` open connections, a new one from
  a peer (a client address) holding fewer connections than the peer holding the most takes the
  place of that peer's oldest connection still waiting for a request's headers (a new or idle
  keep-alive one); otherwise it is closed as soon as it is made. One client alone may use every
  connection, but one that fills the server with half-sent requests (a keyless slowloris)
  cannot lock the others out: each newcomer from another address pushes one of its connections
  out (issue #37). Connections serving a request are never pushed out;
- **blocked addresses**: a client address that keeps failing authentication (refusals.py
  ``PeerGuard``) has its connections closed after their current response and refused when made;
- **header timeout**: a connection that has not completed a request's headers within
  ``header_timeout`` seconds of being made (or of its previous response) is closed;
- **no lingering**: closing a transport waits until its buffered bytes are sent, forever if the
  client stopped reading, and uvicorn's graceful shutdown waits for every connection to close.
  A connection closed with bytes still buffered is aborted ``send_timeout`` seconds later.

:class:`TimedStreamingResponse` bounds each chunk's send: a client that stops reading a stream
blocks our send on flow control; after ``send_timeout`` seconds the stream is closed (which
aborts its engine requests and frees their blocks) and the connection dropped.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("prefixcache.server")


class _NoLingerTransport:
    """The connection's transport, whose ``close()`` turns into ``abort()`` after ``linger``
    seconds when bytes are still buffered (the client does not read them)."""

    def __init__(self, transport, loop: asyncio.AbstractEventLoop, linger: float) -> None:
        self._transport = transport
        self._loop = loop
        self._linger = linger

    def close(self) -> None:
        self._transport.close()
        if self._transport.get_write_buffer_size() > 0:
            self._loop.call_later(self._linger, self._transport.abort)  # no-op once closed

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def _peer(transport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


class PeerConnections:
    """The open connections of each peer, oldest first (one event loop: no lock)."""

    def __init__(self) -> None:
        self.by_peer: dict[str, dict[int, H11Protocol]] = {}

    def add(self, peer: str, conn: H11Protocol) -> int:
        mine = self.by_peer.setdefault(peer, {})
        mine[id(conn)] = conn
        return len(mine)

    def discard(self, peer: str, conn: H11Protocol) -> None:
        mine = self.by_peer.get(peer)
        if mine is not None and mine.pop(id(conn), None) is not None and not mine:
            del self.by_peer[peer]

    def displaceable(self, peer: str) -> H11Protocol | None:
        """At the cap, for a new connection of ``peer``: the oldest connection waiting for a
        request's headers of the peer holding the most, if that is more than ``peer`` holds
        (the new one counted)."""
        mine = len(self.by_peer.get(peer, ()))
        for _, conns in sorted(self.by_peer.items(), key=lambda kv: -len(kv[1])):
            if len(conns) <= mine:
                return None
            waiting = next((c for c in conns.values() if getattr(c, "_header_timer", None)), None)
            if waiting is not None:
                return waiting
        return None


def protocol_class(
    max_connections: int, header_timeout: float, send_timeout: float, guard=None
) -> type[H11Protocol]:
    """``guard``: a ``refusals.PeerGuard`` (the app's ``state.peer_guard``): connections of a
    blocked client address are refused when made and closed after their current response."""
    peers = PeerConnections()

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.transport = _NoLingerTransport(transport, self.loop, send_timeout)
            self._header_timer: asyncio.TimerHandle | None = None
            self._peer = _peer(transport)
            peers.add(self._peer, self)
            if guard is not None and guard.blocked(self._peer):
                transport.abort()  # its connection_lost takes it out of the counts
                return
            if len(self.connections) > max_connections:
                other = peers.displaceable(self._peer)
                if other is None:
                    log.warning("connection refused: %d open (limit %d)",
                                len(self.connections) - 1, max_connections)  # fmt: skip
                    transport.abort()
                    return
                log.warning("connection of %s closed for one of %s: %d open (limit %d)",
                            other._peer, self._peer, len(self.connections) - 1,
                            max_connections)  # fmt: skip
                other._disarm_header_timer()
                other.transport.abort()  # its connection_lost runs soon; out of the counts now
                self.connections.discard(other)
                peers.discard(other._peer, other)
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout, self._header_timed_out)

        def _disarm_header_timer(self) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.abort()

        def handle_events(self) -> None:
            super().handle_events()
            # A request's headers arrived (uvicorn made its cycle): the timer is done.
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if guard is not None and guard.blocked(self._peer):
                self.transport.close()  # a blocked address keeps no connection
                return
            self._arm_header_timer()  # the next request on this connection, if any

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            peers.discard(getattr(self, "_peer", ""), self)
            super().connection_lost(exc)

    return GuardedH11Protocol


class SlowClientError(Exception):
    """The client did not take a response chunk within the send timeout."""


class TimedStreamingResponse(StreamingResponse):
    """A streaming response whose every chunk must be taken within ``send_timeout`` seconds."""

    def __init__(self, content, *, send_timeout: float, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.send_timeout = send_timeout

    async def stream_response(self, send) -> None:
        async def timed(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout)
            except TimeoutError:
                raise SlowClientError(
                    f"a response chunk was not taken within {self.send_timeout:g} s"
                ) from None

        # On SlowClientError the response just ends unfinished: uvicorn then closes the
        # connection (aborted, as its buffer does not drain) and logs one line; nothing here is
        # an error of ours, so there is no traceback and no 500 in our log.
        try:
            await timed(
                {"type": "http.response.start", "status": self.status_code,
                 "headers": self.raw_headers}
            )  # fmt: skip
            async for chunk in self.body_iterator:
                if not isinstance(chunk, bytes | memoryview):
                    chunk = chunk.encode(self.charset)
                await timed({"type": "http.response.body", "body": chunk, "more_body": True})
            await timed({"type": "http.response.body", "body": b"", "more_body": False})
        except SlowClientError as e:
            log.warning("stream cancelled: %s", e)
        finally:
            # Close the generator now (its finally aborts the run and frees the blocks) rather
            # than whenever the garbage collector finalizes it.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
