"""The KV tensors of the paged cache, sized from a byte budget.

Layout: one tensor per K and V, ``[num_layers, num_kv_heads, num_blocks * block_size, head_dim]``
(KV head before slot: a gather of a context's slots gives each head's keys contiguously), in
the KV dtype's storage type, plus per-(token, head) scales for int8/fp8 (kv/formats.py).
A token's KV lives at slot ``block_id * block_size + offset``; the block ids come from the
torch-free block pool, so this module never decides which block holds what.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch

from prefixcache import kernels
from prefixcache.config import parse_bytes
from prefixcache.kv.formats import KVFormat
from prefixcache.model.loader import ModelConfig

log = logging.getLogger(__name__)

# Without an explicit budget: this share of available memory, capped, so a laptop stays usable.
_DEFAULT_SHARE = 0.25
_DEFAULT_CAP = 4 << 30


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    kv_format: KVFormat

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token


def plan_kv_layout(
    config: ModelConfig,
    fmt: KVFormat,
    block_size: int,
    kv_cache_memory: str | int | None,
    device: torch.device,
) -> KVLayout:
    per_token = fmt.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim)
    if kv_cache_memory is None:
        budget = min(int(_available_bytes(device) * _DEFAULT_SHARE), _DEFAULT_CAP)
    else:
        budget = parse_bytes(kv_cache_memory)
    num_blocks = budget // (per_token * block_size)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory of {budget} bytes holds no block: one block of {block_size} tokens "
            f"needs {per_token * block_size} bytes"
        )
    return KVLayout(num_blocks, block_size, per_token, fmt)


class KVCache:
    """The pool's tensors: K and V ``[layers, kv_heads, slots, head_dim]`` in the storage dtype,
    and for scaled formats one float32 scale per (layer, kv head, slot)."""

    def __init__(self, config: ModelConfig, layout: KVLayout, device: torch.device):
        self.layout = layout
        self.fmt = fmt = layout.kv_format
        if fmt.unit and layout.block_size % fmt.unit:
            raise ValueError(f"{fmt.name} K/V need blocks of a multiple of {fmt.unit} tokens")
        shape = (config.num_layers, config.num_kv_heads, layout.capacity_tokens, config.head_dim)
        # Never read before written (attention reads only slots of computed tokens). empty, not
        # zeros: zeroing 4 GiB took 2-3 s of every start, and on CPU an allocation this size is
        # fresh pages the OS maps on first touch (they read as zero anyway).
        self.k = torch.empty(shape, dtype=fmt.storage, device=device)
        self.v = torch.empty(shape, dtype=fmt.storage, device=device)
        self.k_scale = self.v_scale = None
        if fmt.scaled:
            self.k_scale = torch.empty(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.empty(shape[:3], dtype=torch.float32, device=device)

    # ---- whole blocks, as bytes (the persistent tiers; tiers/codec.py) ---------------------------
    def _block_parts(self, block_id: int) -> list[torch.Tensor]:
        """Views of one block: K, V ``[layers, kv_heads, block_size, head_dim]``, then the K, V
        scales ``[layers, kv_heads, block_size]`` of scaled formats. The order is the stored
        payload's; changing it needs a new ``tiers.keys.CODEC_VERSION``."""
        bs = self.layout.block_size
        s = slice(block_id * bs, (block_id + 1) * bs)
        parts = [self.k[:, :, s], self.v[:, :, s]]
        if self.k_scale is not None:
            parts += [self.k_scale[:, :, s], self.v_scale[:, :, s]]
        return parts

    def read_block(self, block_id: int) -> bytes:
        """The block's K/V (and scales) as stored, ``layout.block_size * bytes_per_token`` bytes."""
        flat = [_bytes_of(p.contiguous()).reshape(-1) for p in self._block_parts(block_id)]
        return torch.cat(flat).cpu().numpy().tobytes()

    def write_block(self, block_id: int, data: bytes | memoryview) -> None:
        """Put ``read_block``'s bytes back into a block (a restore from a tier)."""
        with warnings.catch_warnings():  # only read from: a read-only buffer is fine, no copy
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8)
        off = 0
        for dst in self._block_parts(block_id):
            n = dst.numel() * dst.element_size()
            if off + n > src.numel():
                raise ValueError(f"block payload of {len(data)} bytes is too short")
            raw = _bytes_of(dst)  # [..., head_dim * element size] view of the same memory
            raw.copy_(src[off : off + n].view(raw.shape).to(dst.device))
            off += n
        if off != src.numel():
            raise ValueError(f"block payload of {len(data)} bytes, {off} expected")

    def copy_tokens(self, copies) -> None:
        """For each ``(src, dst, n)``: slots 0..n-1 of block ``src`` into block ``dst``, in
        every layer, K, V and their scales, byte for byte; one gather and scatter per tensor.
        ``dst`` must not be a source of the same call (the engine's never is: a fresh block)."""
        bs = self.layout.block_size
        src: list[int] = []
        dst: list[int] = []
        for s, d, n in copies:
            if not 0 <= n <= bs:
                raise ValueError(f"cannot copy {n} tokens of a block of {bs}")
            src.extend(range(s * bs, s * bs + n))
            dst.extend(range(d * bs, d * bs + n))
        if not src:
            return
        dev = self.k.device
        si = torch.tensor(src, dtype=torch.long, device=dev)
        di = torch.tensor(dst, dtype=torch.long, device=dev)
        for t in (self.k_scale, self.v_scale):
            if t is not None:  # scales [L, H, slots]
                t.index_copy_(2, di, t.index_select(2, si))
        d = self.k.shape[-1]
        for t, value in ((self.k, False), (self.v, True)):
            # each dimension of each slot where the layout puts it: [L, H, slots * D] flat
            raw = _raw(t).flatten(2)
            src_e = self.fmt.element_index(si, d, value).flatten()
            raw.index_copy_(2, self.fmt.element_index(di, d, value).flatten(), raw.index_select(2, src_e))

    def stored(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``slots`` as stored (storage dtype, not dequantized), ``[layers, kv_heads, n,
        head_dim]`` in row order whatever the layout: what a token's cache entry holds."""
        d = self.k.shape[-1]
        out = []
        for t, value in ((self.k, False), (self.v, True)):
            if not self.fmt.unit:
                out.append(t.index_select(2, slots))
                continue
            idx = self.fmt.element_index(slots, d, value).flatten()
            out.append(_raw(t).flatten(2).index_select(2, idx).view(*t.shape[:2], -1, d).view(t.dtype))
        return out[0], out[1]

    def layer(self, i: int, native: bool = False) -> LayerKV:
        ks = None if self.k_scale is None else self.k_scale[i]
        vs = None if self.v_scale is None else self.v_scale[i]
        return LayerKV(self.k[i], self.v[i], ks, vs, self.fmt, native)


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache: K, V ``[kv_heads, slots, head_dim]`` and their scales ``[kv_heads,
    slots]`` (None unscaled). ``native``: quantize with the C++ kernels (same numbers)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    fmt: KVFormat
    native: bool = False

    def store(self, slots: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor):
        """Write the new tokens' K, V ``[T, kv_heads, head_dim]`` at ``slots``; returns what was
        stored, as the float32 (or compute-dtype) values every attention read will see."""
        if self.native:
            return kernels.kv_store(self, slots, k_new, v_new)
        seen = []
        d = self.k.shape[-1]
        for cache, scales, x, value in ((self.k, self.k_scale, k_new, False), (self.v, self.v_scale, v_new, True)):
            q, s = self.fmt.quantize(x)
            if self.fmt.unit:  # each dimension where the layout puts it, in the head's plane
                idx = self.fmt.element_index(slots, d, value).flatten()
                _raw(cache).flatten(1).index_copy_(1, idx, _raw(q).transpose(0, 1).flatten(1))
            else:
                _raw(cache).index_copy_(1, slots, _raw(q).transpose(0, 1))
            if s is not None:
                scales.index_copy_(1, slots, s.transpose(0, 1))
            seen.append(x if q.dtype == x.dtype else self.fmt.dequantize(q, s).to(x.dtype))
        return seen[0], seen[1]

    def gather(self, slots: torch.Tensor, dtype: torch.dtype):
        """K, V of ``slots`` as ``[kv_heads, n, head_dim]`` in ``dtype`` (dequantized)."""
        out = []
        d = self.k.shape[-1]
        for cache, scales, value in ((self.k, self.k_scale, False), (self.v, self.v_scale, True)):
            if self.fmt.unit:
                idx = self.fmt.element_index(slots, d, value).flatten()
                q = _raw(cache).flatten(1).index_select(1, idx).view(cache.shape[0], -1, d).view(cache.dtype)
            else:
                q = _raw(cache).index_select(1, slots).view(cache.dtype)
            if q.dtype == dtype and scales is None:
                out.append(q)
                continue
            s = None if scales is None else scales.index_select(1, slots)
            out.append(self.fmt.dequantize(q, s).to(dtype))
        return out[0], out[1]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's memory as uint8, the last dimension widened by the element size."""
    return t.view(torch.uint8)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their bytes: torch's CPU index_copy_/index_select do not take fp8."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.int8 else t
