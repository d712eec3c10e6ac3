"""A KV events client that rebuilds one engine's set of cached blocks from its event stream.

What an external KV-aware router does per worker, in its simplest form; the tests use it to
check the stream against the engine's own index, and ``prefixcache events`` users can start from
it. On a gap in the sequence numbers it asks the replay socket for what it missed (again from
where the answer stopped: one answer holds at most the publisher's ``replay_max_batches``).

Against a CURVE publisher (access.py) pass ``server_public_key`` (z85, the ``.pub`` file of the
publisher's key); ``client_keypair`` is optional (a fresh one by default: the publisher accepts
any client that knows its key).
"""

from __future__ import annotations

import time

import zmq

from prefixcache.events.access import curve_client
from prefixcache.events.publisher import END_OF_REPLAY
from prefixcache.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch


class BlockSetSubscriber:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        server_public_key: bytes | str | None = None,
        client_keypair: tuple[bytes, bytes] | None = None,
    ) -> None:
        if server_public_key is not None and client_keypair is None:
            client_keypair = zmq.curve_keypair()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        if server_public_key is not None:
            curve_client(self._sub, server_public_key, client_keypair)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            if server_public_key is not None:
                curve_client(self._replay, server_public_key, client_keypair)
            self._replay.connect(replay_endpoint)
        self.blocks: set[bytes] = set()
        self.last_seq = -1
        self.batches = 0
        self.replayed = 0
        self.rank: int | None = None

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = decode_batch(payload)
        self.rank = batch.data_parallel_rank
        for e in batch.events:
            if isinstance(e, BlockStored):
                self.blocks.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.blocks.difference_update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()
        self.last_seq = seq
        self.batches += 1

    def _fill_gap(self, upto: int, timeout: float) -> None:
        """Ask the replay socket for every batch after ``last_seq`` and before ``upto``, again
        after each bounded answer that brought something, until the gap is closed."""
        if self._replay is None:
            return
        deadline = time.monotonic() + timeout
        while self.last_seq + 1 < upto:
            before = self.last_seq
            try:  # no pipe (replay endpoint down, or our handshake refused): never wait for one
                self._replay.send_multipart([b"", (self.last_seq + 1).to_bytes(8, "big", signed=True)],
                                            flags=zmq.NOBLOCK)  # fmt: skip
            except zmq.Again:
                return
            while True:
                if not self._replay.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                    return
                frames = self._replay.recv_multipart()
                seq_bytes, payload = frames[-2], frames[-1]
                if seq_bytes == END_OF_REPLAY:
                    break
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if self.last_seq < seq < upto:
                    self._apply(seq, payload)
                    self.replayed += 1
            if self.last_seq == before:  # nothing kept from there any more
                return

    def poll(self, timeout: float = 0.1) -> int:
        """Apply every batch that arrives within ``timeout`` seconds; returns how many."""
        n = 0
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if not self._sub.poll(int(max(0.0, left) * 1000)):
                return n
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq > self.last_seq + 1:
                self._fill_gap(seq, timeout=2.0)
            if seq > self.last_seq:
                self._apply(seq, payload)
                n += 1

    def close(self) -> None:
        for s in (self._sub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()
