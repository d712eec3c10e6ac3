"""Publish the prefix index's changes as KV event batches (wire.py) on a ZMQ PUB socket.

The KV events connector (connector.py) calls ``stored`` / ``removed`` from the engine thread
with the index's recorded changes after each step; those calls only append to a pending list
under a small lock, so the engine never waits on the network. A publisher thread takes the pending events every
``interval`` seconds, coalesces consecutive blocks of one chain into one ``BlockStored`` (as
vLLM does per step), numbers the batch and sends it. The last ``buffer_batches`` batches are kept
for the replay socket (a ZMQ ROUTER): a client that saw a gap in the sequence numbers sends the
first sequence number it missed (8 bytes, big-endian) and receives the kept batches from there,
at most ``replay_max_batches`` of them (one request must not make us send the whole buffer), as
``[seq, payload]`` messages, then ``[-1, b""]`` as the end marker; a client further behind asks
again from the next one it lacks.

Who may read (access.py): the bind is refused off loopback unless CURVE or ``allow_remote`` says
otherwise, and with a CURVE secret both sockets are CURVE servers. ``BlockStored.token_ids`` (the
tenants' prompt and generated tokens) is sent only with ``token_ids=True``; otherwise it is an
empty array, so vLLM's decoders still read the same shape.

Invariants: sequence numbers are consecutive from 0 for the life of the publisher; the first
batch holds ``AllBlocksCleared`` (a restarted engine starts empty, so a subscriber that knew the
previous incarnation forgets it); applying every batch in order to an empty set gives the index's
key set at the time of the last batch (tests/events/test_kv_events.py checks it against the index).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from itertools import islice
from urllib.parse import urlsplit, urlunsplit

import zmq

from prefixcache.events.access import (
    check_bind,
    check_endpoint,
    curve_server,
    is_local_endpoint,
)
from prefixcache.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
)

log = logging.getLogger("prefixcache.events")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# The most batches one replay request is answered with (the buffer keeps up to 10,000).
REPLAY_MAX_BATCHES = 1000


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``tcp://host:port`` with ``port + offset`` (one endpoint per replica on a machine, as
    vLLM offsets by data-parallel rank); other transports get ``-offset`` appended."""
    if offset == 0:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and parts.port is not None:
        host = parts.netloc.rsplit(":", 1)[0]
        return urlunsplit((parts.scheme, f"{host}:{parts.port + offset}", "", "", ""))
    return f"{endpoint}-{offset}"


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        block_size: int,
        rank: int | None = None,
        buffer_batches: int = 10_000,
        replay_max_batches: int = REPLAY_MAX_BATCHES,
        interval: float = 0.01,
        token_ids: bool = False,
        curve_secret: bytes | None = None,
        allow_remote: bool = False,
        context: zmq.Context | None = None,
    ) -> None:
        for ep in (endpoint, replay_endpoint):
            if ep is not None:
                check_endpoint(ep)
                check_bind(ep, curve=curve_secret is not None, allow_remote=allow_remote)
                if curve_secret is None and not is_local_endpoint(ep):
                    log.warning("KV events in plaintext on %s (allow_remote): whoever reaches it "
                                "reads every tenant's block events", ep)  # fmt: skip
        if replay_max_batches < 1:
            raise ValueError(f"replay_max_batches must be >= 1, got {replay_max_batches}")
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode()
        self.block_size, self.rank, self.interval = block_size, rank, interval
        self.token_ids, self.replay_max_batches = token_ids, replay_max_batches
        self._ctx = context or zmq.Context()
        self._own_ctx = context is None
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:  # bind here, so a taken port is an error at startup, not a dead thread
            if curve_secret is not None:  # before bind: the mechanism is fixed per listener
                curve_server(self._pub, curve_secret)
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                if curve_secret is not None:
                    curve_server(self._replay, curve_secret)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot bind KV events socket: {e}") from None
        self._lock = threading.Lock()
        # pending: events in order; a chain being stored is kept open as [hashes, parent, tokens]
        self._pending: list = [AllBlocksCleared()]
        self._last_stored_key: bytes | None = None
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self.next_seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # -- the connector's calls (engine thread) ----------------------------------------------------
    def stored(self, key: bytes, parent: bytes | None, token_ids) -> None:
        tokens = token_ids if self.token_ids else ()  # not even kept unless they are sent
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if isinstance(last, list) and parent is not None and parent == self._last_stored_key:
                last[0].append(key)
                last[2].extend(tokens)
            else:
                self._pending.append([[key], parent, list(tokens)])
            self._last_stored_key = key

    def removed(self, key: bytes) -> None:
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if isinstance(last, BlockRemoved):
                self._pending[-1] = BlockRemoved(last.block_hashes + (key,), last.medium)
            else:
                self._pending.append(BlockRemoved((key,)))
            self._last_stored_key = None

    def cleared(self) -> None:
        with self._lock:
            self._pending.append(AllBlocksCleared())
            self._last_stored_key = None

    # -- the publisher thread ------------------------------------------------------------------
    def _take(self) -> list:
        with self._lock:
            pending, self._pending = self._pending, []
            self._last_stored_key = None
        return [
            BlockStored(tuple(e[0]), e[1], tuple(e[2]), self.block_size) if isinstance(e, list) else e
            for e in pending
        ]

    def _send(self, events: list) -> None:
        payload = encode_batch(EventBatch(time.time(), tuple(events), self.rank))
        seq = self.next_seq
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big", signed=True), payload])
        self._kept.append((seq, payload))
        self.next_seq = seq + 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        identity, start = frames[0], frames[-1]
        head = [identity, b""] if len(frames) > 2 else [identity]  # REQ clients add an empty frame
        try:
            first = int.from_bytes(start, "big", signed=True) if len(start) == 8 else None
        except ValueError:
            first = None
        if first is not None and self._kept:
            # kept seqs are consecutive: the batch ``first`` is at index first - oldest
            start = max(0, first - self._kept[0][0])
            for seq, payload in islice(self._kept, start, start + self.replay_max_batches):
                self._replay.send_multipart(head + [seq.to_bytes(8, "big", signed=True), payload])
        self._replay.send_multipart(head + [END_OF_REPLAY, b""])

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                stopping = self._stop.is_set()
                if self._replay is not None:
                    if dict(poller.poll(timeout=self.interval * 1000)):
                        self._serve_replay()
                else:
                    time.sleep(self.interval)
                events = self._take()
                if events:
                    self._send(events)
                if stopping:
                    return
        except Exception:
            log.exception("KV events publisher stopped")

    def flush(self, timeout: float = 2.0) -> None:
        """Wait until everything stored so far is sent (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    break
            time.sleep(self.interval)
        time.sleep(2 * self.interval)  # the batch taken last is sent within one interval

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        if self._own_ctx:
            self._ctx.term()
