"""A segment as a record of the persistent tiers (disk, Redis): its bytes and what names them.

    key input = u32(m) || u32(s[0]) ... u32(s[m-1]) || u32(n) || u32(t[0]) ... u32(t[n-1])
    payload   = K then V, float32 little-endian, each [layers, kv_heads, n, head_dim]

(s: the sink ids, t: the segment's ids; ``u32`` as in plan.py.) The tier frame (tiers/codec.py)
serves a record only when its store id, segment key, namespace, this key input and the payload
length are all what the reader expects, so ``entry_of`` only ever sees a verified payload of
exactly the tokens asked for. K is stored as the entry holds it: rotated for the positions it
was computed at (``SegmentEntry.position``, = m), re-rotated when placed (``model.llama.rerotate``).

Why float32 and not the pool's KV format: an entry holds the values attention reads back (for
int8/fp8, dequantized with per-token scales), and placing it quantizes them again onto the
same grid; float32 keeps that exact for every format. Redundant bytes of a bf16 pool's values
(the low halves are zero) go away when the tier compresses (``--tier-compression``).
"""

from __future__ import annotations

import numpy as np
import torch

from prefixcache.cache.hashing import _u32, _u32_array
from prefixcache.segments.store import SegmentEntry

_F32 = 4


def key_input(sink, token_ids) -> bytes:
    return (
        _u32(len(sink)) + _u32_array(list(sink)).tobytes()
        + _u32(len(token_ids)) + _u32_array(list(token_ids)).tobytes()
    )  # fmt: skip


def payload_bytes(n: int, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """The exact payload length of a segment of ``n`` tokens (K and V, float32)."""
    return 2 * num_layers * num_kv_heads * n * head_dim * _F32


def payload_of(entry: SegmentEntry) -> bytes:
    """K then V as float32 bytes (copied to the CPU when the entry lives on a GPU)."""
    kv = torch.stack([entry.k, entry.v]).to(device="cpu", dtype=torch.float32).contiguous()
    return kv.numpy().tobytes()


def entry_of(
    payload,
    namespace: str | None,
    token_ids,
    sink,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> SegmentEntry:
    """The entry a verified payload holds (``payload`` of ``payload_bytes`` length)."""
    n = len(token_ids)
    if len(payload) != payload_bytes(n, num_layers, num_kv_heads, head_dim):
        raise ValueError(f"segment payload of {len(payload)} bytes for {n} tokens")
    flat = torch.from_numpy(np.frombuffer(payload, dtype="<f4").copy())
    kv = flat.view(2, num_layers, num_kv_heads, n, head_dim).to(device)
    return SegmentEntry(namespace, tuple(token_ids), kv[0], kv[1], tuple(sink), len(sink))
