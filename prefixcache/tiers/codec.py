"""One stored block as bytes: a header naming exactly what it holds, the payload, a keyed MAC.

    offset  size  field
    0       4     magic b"PCKV"
    4       2     codec version (keys.CODEC_VERSION), u16 little-endian
    6       1     compression: 0 none, 1 lz4 (block), 2 zstd
    7       1     reserved, 0
    8       32    record name (keys.block_name: keyed digest of the store id and chain key)
    40      32    namespace id (keys.namespace_id: keyed, 16 raw bytes)
    56      32    key-input digest (secret.key_input_digest of parent key || token ids)
    88      4     payload length before compression, u32
    92      4     stored payload length, u32
    96      ...   stored payload
    end-32  32    HMAC-SHA256 under the deployment's MAC key (secret.py) of every byte before it

``decode`` serves a block only if the MAC verifies *and* every field equals what the reader
expects (the name, the namespace, the key input's digest, the payload length): a truncated or
corrupt file, a record forged or planted by whoever can write to the Redis or the directory
without the deployment's secret, a block of another model, namespace or layout under this
name, or a renamed file is a ``BlockRejected`` with the reason, never KV. The MAC covers the
header too, so a flipped bit in a length or a name cannot move the check elsewhere; a record
of another deployment (another secret) fails it like a forgery.

No token id is stored: the reader has the key input (it asked for the block) and compares its
keyed digest, which is all the check needs. (The KV payload itself is not encrypted: see
docs/engine.md, "Cache tiers", for what a reader of the store can still learn from it.)

The payload is the KV of the block in the KV dtype as the pool stores it (kv/pool.py
``KVCache.read_block``): K then V ``[layers, kv_heads, block_size, head_dim]``, then for scaled
formats (int8, fp8) the float32 scales of K then V ``[layers, kv_heads, block_size]``.
A *segment record* (cache_mode "segments") uses the same frame with the segment store id in its
name, the digest of the segment key input (segments/record.py: sink and token ids, any length)
and a payload of the document's float32 K then V ``[layers, kv_heads, n, head_dim]``; the reader
expects the length its token count gives. Compression is used only where it pays: a block that
does not shrink by an eighth is stored raw (float32 K/V barely compress; the codec is chosen
per tier, names and MACs do not change).

Version 1 (an unkeyed XXH3 checksum, token ids in the clear) is not read: its names differ
(the codec version is in the store id), so its records are plain misses.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

from prefixcache.tiers.keys import CODEC_VERSION
from prefixcache.tiers.secret import TierKeys, key_input_digest

MAGIC = b"PCKV"
_HEAD = struct.Struct("<4sHBB32s16s32sII")
HEADER_BYTES = _HEAD.size  # 96
MAC_BYTES = 32
COMPRESSIONS = ("none", "lz4", "zstd")
_MIN_SAVING = 1 / 8


class BlockRejected(Exception):
    """A stored block that must not be served; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason  # "truncated" | "mac" | "foreign" | "format"


@dataclass(frozen=True)
class BlockName:
    """What a reader expects a stored block to be."""

    name: bytes  # 32 raw bytes (keys.block_name)
    namespace_id: bytes  # 16 raw bytes (keys.namespace_id)
    key_input: bytes  # in the clear here; only its keyed digest is stored


def _compress(method: int, data: bytes) -> bytes:
    if method == 1:
        import lz4.block

        return lz4.block.compress(data, store_size=False)
    import zstandard

    return zstandard.ZstdCompressor(level=1).compress(data)


def _decompress(method: int, data: bytes, size: int) -> bytes:
    if method == 1:
        import lz4.block

        return lz4.block.decompress(data, uncompressed_size=size)
    import zstandard

    return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)


def _mac(keys: TierKeys, body) -> bytes:
    return hmac.digest(keys.mac, body, "sha256")


def encode(name: BlockName, payload: bytes, keys: TierKeys, compression: str = "none") -> bytes:
    method = COMPRESSIONS.index(compression)
    stored = payload
    if method:
        packed = _compress(method, payload)
        if len(packed) <= len(payload) * (1 - _MIN_SAVING):
            stored = packed
        else:
            method = 0
    head = _HEAD.pack(
        MAGIC, CODEC_VERSION, method, 0, name.name, name.namespace_id,
        key_input_digest(keys, name.key_input), len(payload), len(stored),
    )  # fmt: skip
    body = head + stored
    return body + _mac(keys, body)


def decode(data: bytes, expected: BlockName, payload_bytes: int,
           keys: TierKeys) -> bytes | memoryview:  # fmt: skip
    """The payload of ``data`` if it is exactly the block ``expected`` names, written by this
    deployment, else raises. An uncompressed payload is a view into ``data`` (no copy: a
    restore moves ~0.7 MB per block)."""
    if len(data) < HEADER_BYTES + MAC_BYTES:
        raise BlockRejected("truncated", f"{len(data)} bytes")
    magic, version, method, _, name, ns, digest, n_raw, n_stored = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise BlockRejected("format", "bad magic")
    if len(data) != HEADER_BYTES + n_stored + MAC_BYTES:
        raise BlockRejected("truncated", f"{len(data)} bytes, header says otherwise")
    body = memoryview(data)[:-MAC_BYTES]
    if not hmac.compare_digest(_mac(keys, body), data[-MAC_BYTES:]):
        raise BlockRejected("mac", "corrupt, forged, or written under another secret")
    if version != CODEC_VERSION or method >= len(COMPRESSIONS):
        raise BlockRejected("format", f"codec version {version}, compression {method}")
    if (
        name != expected.name
        or ns != expected.namespace_id
        or not hmac.compare_digest(digest, key_input_digest(keys, expected.key_input))
        or n_raw != payload_bytes
    ):
        raise BlockRejected("foreign", "another block, model, namespace or layout")
    stored = memoryview(data)[HEADER_BYTES:-MAC_BYTES]
    if method == 0:
        payload = stored
    else:
        try:
            payload = _decompress(method, stored, n_raw)
        except Exception as e:  # noqa: BLE001 - authenticated yet undecodable: reject, never serve
            raise BlockRejected("format", f"decompression failed: {e}") from None
    if len(payload) != payload_bytes:
        raise BlockRejected("format", f"payload of {len(payload)} bytes")
    return payload
