"""One stored block as bytes: a header naming exactly what it holds, the payload, a checksum.

    offset  size  field
    0       4     magic b"PCKV"
    4       2     codec version (keys.CODEC_VERSION), u16 little-endian
    6       1     compression: 0 none, 1 lz4 (block), 2 zstd
    7       1     reserved, 0
    8       16    store id (keys.StoreLayout.store_id: codec, model, KV dtype, layout)
    24      16    the block's chain key
    40      16    namespace id (keys.namespace_id, as 16 raw bytes)
    56      4     n_in: length of the key input (a block: 16 + 4 * block_size), u32
    60      4     payload length before compression, u32
    64      4     stored payload length, u32
    68      n_in  key input: parent key || the block's token ids (cache/hashing.py)
    ...           stored payload
    end-16  16    XXH3-128 of every byte before it

``decode`` serves a block only if the checksum matches *and* every field equals what the reader
expects (the store id, the key, the namespace, the key input, the payload length): a truncated
or corrupt file, a block of another model, namespace or layout under this name, or a renamed
file is a ``BlockRejected`` with the reason, never KV. The checksum covers the header too, so a
flipped bit in a length or a key cannot move the check elsewhere.

The payload is the KV of the block in the KV dtype as the pool stores it (kv/pool.py
``KVCache.read_block``): K then V ``[layers, kv_heads, block_size, head_dim]``, then for scaled
formats (int8, fp8) the float32 scales of K then V ``[layers, kv_heads, block_size]``.
A *segment record* (cache_mode "segments") uses the same frame with the segment store id, its
segment key, the segment key input (segments/record.py: sink and token ids, any length) and a
payload of the document's float32 K then V ``[layers, kv_heads, n, head_dim]``; the reader
expects the length its token count gives. Compression is used only where it pays: a block that does not shrink by an eighth is stored raw
(float32 K/V barely compress; the codec is chosen per tier, keys and checksums do not change).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from xxhash import xxh3_128_digest

from prefixcache.tiers.keys import CODEC_VERSION

MAGIC = b"PCKV"
_HEAD = struct.Struct("<4sHBB16s16s16sIII")
HEADER_BYTES = _HEAD.size  # 68
CHECKSUM_BYTES = 16
COMPRESSIONS = ("none", "lz4", "zstd")
_MIN_SAVING = 1 / 8


class BlockRejected(Exception):
    """A stored block that must not be served; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason  # "truncated" | "checksum" | "foreign" | "format"


@dataclass(frozen=True)
class BlockName:
    """What a reader expects a stored block to be."""

    store_id: bytes
    key: bytes
    namespace_id: bytes  # 16 raw bytes
    key_input: bytes


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


def encode(name: BlockName, payload: bytes, compression: str = "none") -> bytes:
    method = COMPRESSIONS.index(compression)
    stored = payload
    if method:
        packed = _compress(method, payload)
        if len(packed) <= len(payload) * (1 - _MIN_SAVING):
            stored = packed
        else:
            method = 0
    head = _HEAD.pack(
        MAGIC, CODEC_VERSION, method, 0, name.store_id, name.key, name.namespace_id,
        len(name.key_input), len(payload), len(stored),
    )  # fmt: skip
    body = head + name.key_input + stored
    return body + xxh3_128_digest(body)


def decode(data: bytes, expected: BlockName, payload_bytes: int) -> bytes | memoryview:
    """The payload of ``data`` if it is exactly the block ``expected`` names, else raises. An
    uncompressed payload is a view into ``data`` (no copy: a restore moves ~0.7 MB per block)."""
    if len(data) < HEADER_BYTES + CHECKSUM_BYTES:
        raise BlockRejected("truncated", f"{len(data)} bytes")
    magic, version, method, _, store_id, key, ns, n_in, n_raw, n_stored = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise BlockRejected("format", "bad magic")
    if len(data) != HEADER_BYTES + n_in + n_stored + CHECKSUM_BYTES:
        raise BlockRejected("truncated", f"{len(data)} bytes, header says otherwise")
    body = memoryview(data)[:-CHECKSUM_BYTES]
    if xxh3_128_digest(body) != data[-CHECKSUM_BYTES:]:
        raise BlockRejected("checksum")
    if version != CODEC_VERSION or method >= len(COMPRESSIONS):
        raise BlockRejected("format", f"codec version {version}, compression {method}")
    key_input = data[HEADER_BYTES : HEADER_BYTES + n_in]
    if (
        store_id != expected.store_id
        or key != expected.key
        or ns != expected.namespace_id
        or key_input != expected.key_input
        or n_raw != payload_bytes
    ):
        raise BlockRejected("foreign", "another block, model, namespace or layout")
    stored = memoryview(data)[HEADER_BYTES + n_in : -CHECKSUM_BYTES]
    if method == 0:
        payload = stored
    else:
        try:
            payload = _decompress(method, stored, n_raw)
        except Exception as e:  # noqa: BLE001 - checksummed yet undecodable: reject, never serve
            raise BlockRejected("format", f"decompression failed: {e}") from None
    if len(payload) != payload_bytes:
        raise BlockRejected("format", f"payload of {len(payload)} bytes")
    return payload
