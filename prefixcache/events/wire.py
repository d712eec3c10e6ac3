"""The KV event wire format, compatible with vLLM's ``vllm.distributed.kv_events``.

A message on the PUB socket has three frames: ``topic``, an 8-byte big-endian sequence number
(one per batch, from 0, consecutive), and a msgpack payload: the batch as an array
``[ts, [event, ...], data_parallel_rank]``; each event is an array whose first item is its type
name (msgspec's tagged, array-like structs):

    ["BlockStored", [hash, ...], parent_hash | nil, [token_id, ...], block_size, lora_id, medium]
    ["BlockRemoved", [hash, ...], medium]
    ["AllBlocksCleared"]

Hashes are our 16-byte block keys (msgpack bin; vLLM's ``ExternalBlockHash`` is bytes | int).
A ``BlockStored`` lists consecutive blocks of one chain: ``parent_hash`` is the parent of the
first (nil when it is the namespace's root), and ``token_ids`` are all their tokens in order.
``medium`` is "cpu" (our RAM pool). Decoding accepts vLLM's shorter forms (fields left out at
the end take their defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

MEDIUM = "cpu"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str | None = MEDIUM


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...] = field(default_factory=tuple)
    data_parallel_rank: int | None = None


class WireFormatError(ValueError):
    """A payload that is not a KV event batch."""


def _event_to_wire(e: Event) -> list:
    if isinstance(e, BlockStored):
        return ["BlockStored", list(e.block_hashes), e.parent_block_hash, list(e.token_ids),
                e.block_size, e.lora_id, e.medium]  # fmt: skip
    if isinstance(e, BlockRemoved):
        return ["BlockRemoved", list(e.block_hashes), e.medium]
    if isinstance(e, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {e!r}")


def encode_batch(batch: EventBatch) -> bytes:
    body = [batch.ts, [_event_to_wire(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:  # omit_defaults: a trailing default is left out
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


def _event_from_wire(x) -> Event:
    if not isinstance(x, list) or not x or not isinstance(x[0], str):
        raise WireFormatError(f"an event must be [type, ...], got {x!r:.80}")
    kind, rest = x[0], x[1:]
    if kind == "BlockStored" and len(rest) >= 4:
        hashes, parent, tokens, size = rest[:4]
        lora = rest[4] if len(rest) > 4 else None
        medium = rest[5] if len(rest) > 5 else None
        return BlockStored(tuple(hashes), parent, tuple(tokens), size, lora, medium)
    if kind == "BlockRemoved" and len(rest) >= 1:
        return BlockRemoved(tuple(rest[0]), rest[1] if len(rest) > 1 else None)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise WireFormatError(f"unknown or short event {kind!r}")


def decode_batch(payload: bytes) -> EventBatch:
    try:
        body = msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise WireFormatError(f"not msgpack: {e}") from None
    if not isinstance(body, list) or len(body) < 2 or not isinstance(body[1], list):
        raise WireFormatError("a batch must be [ts, [events], rank?]")
    rank = body[2] if len(body) > 2 else None
    return EventBatch(float(body[0]), tuple(_event_from_wire(e) for e in body[1]), rank)
