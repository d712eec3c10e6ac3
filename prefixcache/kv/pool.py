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
from prefixcache.model.config import ModelConfig

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
    """How the budget is spent. ``bytes_per_token``: every layer's K/V of a token (what a tier's
    block holds). With window parts (``window_parts`` > 0, a model with sliding-window and
    global layers: cache/window.py), a block holds the global layers' K/V only
    (``block_bytes_per_token``) and the local layers' live in ``window_parts`` parts of
    ``block_size`` tokens each (part 0 the null part)."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    kv_format: KVFormat
    window_parts: int = 0
    window_bytes_per_token: int = 0  # the local layers' share of bytes_per_token

    @property
    def block_bytes_per_token(self) -> int:
        return self.bytes_per_token - self.window_bytes_per_token

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def capacity_bytes(self) -> int:
        parts = self.window_parts * self.block_size * self.window_bytes_per_token
        return self.capacity_tokens * self.block_bytes_per_token + parts


def window_layers(config: ModelConfig) -> list[int]:
    """The layers whose K/V go to window parts: the sliding-window layers of a model that has
    global layers too (Gemma 3). A model of window layers only (Mistral's) or none: []."""
    local = [i for i in range(config.num_layers) if config.window_of(i)]
    return local if 0 < len(local) < config.num_layers else []


def plan_kv_layout(
    config: ModelConfig,
    fmt: KVFormat,
    block_size: int,
    kv_cache_memory: str | int | None,
    device: torch.device,
    max_num_seqs: int = 1,
    max_num_batched_tokens: int = 0,
) -> KVLayout:
    """Blocks (and window parts) for the budget. Window parts: enough for ``max_num_seqs``
    windows and a step of ``max_num_batched_tokens`` new tokens, at most half the budget, and
    never fewer than one sequence needs to run a step alone (its window, the step's blocks, a
    partial block's copy and the null part). A budget whose half cannot hold that many keeps
    every layer on blocks (as before window parts; the other half on blocks holds 3x the
    tokens at Gemma 3's one global layer in six, so parts pay off wherever they fit)."""
    per_token = fmt.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim)
    if kv_cache_memory is None:
        budget = min(int(_available_bytes(device) * _DEFAULT_SHARE), _DEFAULT_CAP)
    else:
        budget = parse_bytes(kv_cache_memory)
    local = window_layers(config)
    parts, part_bytes, window_per_token = 0, 0, 0
    if local:
        window_per_token = fmt.bytes_per_token(len(local), config.num_kv_heads, config.head_dim)
        part_bytes = window_per_token * block_size
        held = -(-(config.sliding_window - 1) // block_size) + 1  # a sequence's parts between steps
        step = -(-max_num_batched_tokens // block_size) + max_num_seqs
        floor = held + -(-max_num_batched_tokens // block_size) + 3
        parts = max(floor, min(max_num_seqs * held + step, budget // 2 // part_bytes))
        if parts * part_bytes > budget // 2:  # too small a budget for parts: every layer on blocks
            log.info("kv_cache_memory of %d bytes is too small for window parts (%d parts of %d bytes "
                     "pass half of it); sliding-window layers keep their K/V for every token",
                     budget, parts, part_bytes)  # fmt: skip
            local, parts, part_bytes, window_per_token = [], 0, 0, 0
    block_bytes = (per_token - window_per_token) * block_size
    num_blocks = (budget - parts * part_bytes) // block_bytes
    if num_blocks < 1:
        need = block_bytes + parts * part_bytes
        raise ValueError(
            f"kv_cache_memory of {budget} bytes holds no block: one block of {block_size} tokens "
            f"needs {need} bytes" + (f" beside {parts} window parts" if parts else "")
        )
    if not local:
        return KVLayout(num_blocks, block_size, per_token, fmt)
    parts = min(parts, num_blocks + 1)  # a part per block (and the null part) at most
    return KVLayout(num_blocks, block_size, per_token, fmt, parts, window_per_token)


class KVCache:
    """The pool's tensors: K and V ``[layers, kv_heads, slots, head_dim]`` in the storage dtype,
    and for scaled formats one float32 scale per (layer, kv head, slot). With window parts
    (``layout.window_parts``) the block tensors hold the global layers only and ``wk``, ``wv``
    (and their scales) the window layers, ``[window layers, kv_heads, parts * block_size,
    head_dim]``: a token of block b at offset o is at slot ``b * bs + o`` of the first, at
    ``part * bs + o`` of the second (its block's part, cache/window.py)."""

    def __init__(self, config: ModelConfig, layout: KVLayout, device: torch.device):
        self.layout = layout
        self.fmt = fmt = layout.kv_format
        if fmt.unit and layout.block_size % fmt.unit:
            raise ValueError(f"{fmt.name} K/V need blocks of a multiple of {fmt.unit} tokens")
        local = set(window_layers(config)) if layout.window_parts else set()
        # layer -> (in the window tensors?, its index there)
        self._where: list[tuple[bool, int]] = []
        counts = [0, 0]
        for i in range(config.num_layers):
            w = i in local
            self._where.append((w, counts[w]))
            counts[w] += 1
        self.num_layers = config.num_layers
        h, d = config.num_kv_heads, config.head_dim
        # Never read before written (attention reads only slots of computed tokens). empty, not
        # zeros: zeroing 4 GiB took 2-3 s of every start, and on CPU an allocation this size is
        # fresh pages the OS maps on first touch (they read as zero anyway).
        self.k, self.v, self.k_scale, self.v_scale = _tensors(fmt, (counts[0], h, layout.capacity_tokens, d), device)
        self.wk = self.wv = self.wk_scale = self.wv_scale = None
        if local:
            shape = (counts[1], h, layout.window_parts * layout.block_size, d)
            self.wk, self.wv, self.wk_scale, self.wv_scale = _tensors(fmt, shape, device)

    @property
    def windowed(self) -> bool:
        return self.wk is not None

    # ---- whole blocks, as bytes (the persistent tiers; tiers/codec.py) ---------------------------
    def _block_views(self, block_id: int, part: int | None) -> list[tuple[torch.Tensor | None, int]]:
        """One block's K/V as stored, each layer's ``[kv_heads, block_size, head_dim]`` in layer
        order, K then V, then the K, V scales ``[kv_heads, block_size]`` of scaled formats, with
        each view's size in bytes; a window layer's view is None without ``part``. The order is
        the stored payload's (every layer's K, as one ``[layers, ...]`` tensor would hold them):
        changing it needs a new ``tiers.keys.CODEC_VERSION``."""
        bs = self.layout.block_size
        s = slice(block_id * bs, (block_id + 1) * bs)
        ps = None if part is None else slice(part * bs, (part + 1) * bs)
        out = []
        pairs = [(self.k, self.wk), (self.v, self.wv)]
        if self.k_scale is not None:
            pairs += [(self.k_scale, self.wk_scale), (self.v_scale, self.wv_scale)]
        for whole, window in pairs:
            for local, j in self._where:
                t = window if local else whole
                view = t[j, :, s if not local else (ps or slice(0, bs))]
                out.append((None if local and ps is None else view, view.numel() * view.element_size()))
        return out

    def read_block(self, block_id: int, part: int | None = None) -> bytes:
        """The block's K/V (and scales) as stored, ``layout.block_size * bytes_per_token`` bytes;
        with window parts, its ``part`` holds the window layers' (required)."""
        if self.windowed and part is None:
            raise ValueError(f"block {block_id}: its window layers' K/V need its part")
        flat = [_bytes_of(v.contiguous()).reshape(-1) for v, _ in self._block_views(block_id, part)]
        return torch.cat(flat).cpu().numpy().tobytes()

    def write_block(self, block_id: int, data: bytes | memoryview, part: int | None = None) -> None:
        """Put ``read_block``'s bytes back into a block (a restore from a tier); with window
        parts, the window layers' into ``part`` (None: they are skipped)."""
        with warnings.catch_warnings():  # only read from: a read-only buffer is fine, no copy
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8)
        off = 0
        for dst, n in self._block_views(block_id, part):
            if off + n > src.numel():
                raise ValueError(f"block payload of {len(data)} bytes is too short")
            if dst is not None:
                raw = _bytes_of(dst)  # [..., head_dim * element size] view of the same memory
                raw.copy_(src[off : off + n].view(raw.shape).to(dst.device))
            off += n
        if off != src.numel():
            raise ValueError(f"block payload of {len(data)} bytes, {off} expected")

    def copy_tokens(self, copies, part_copies=None) -> None:
        """For each ``(src, dst, n)``: slots 0..n-1 of block ``src`` into block ``dst``, in
        every layer, K, V and their scales, byte for byte; with window parts, the window layers'
        by ``part_copies`` (the same copies between the blocks' parts). One gather and scatter
        per tensor. ``dst`` must not be a source of the same call (the engine's never is: a
        fresh block)."""
        bs = self.layout.block_size
        for _, _, n in copies:
            if not 0 <= n <= bs:
                raise ValueError(f"cannot copy {n} tokens of a block of {bs}")
        self._copy_slots((self.k, self.v, self.k_scale, self.v_scale), copies)
        if self.windowed:
            if part_copies is None or len(part_copies) != len(copies) or any(not s or not d for s, d, _ in part_copies):
                raise ValueError("a copy of a block with window parts needs both blocks' parts")
            self._copy_slots((self.wk, self.wv, self.wk_scale, self.wv_scale), part_copies)

    def _copy_slots(self, tensors, copies) -> None:
        bs = self.layout.block_size
        src: list[int] = []
        dst: list[int] = []
        for s, d, n in copies:
            src.extend(range(s * bs, s * bs + n))
            dst.extend(range(d * bs, d * bs + n))
        if not src:
            return
        k, v, k_scale, v_scale = tensors
        dev = k.device
        si = torch.tensor(src, dtype=torch.long, device=dev)
        di = torch.tensor(dst, dtype=torch.long, device=dev)
        for t in (k_scale, v_scale):
            if t is not None:  # scales [L, H, slots]
                t.index_copy_(2, di, t.index_select(2, si))
        d = k.shape[-1]
        for t, value in ((k, False), (v, True)):
            # each dimension of each slot where the layout puts it: [L, H, slots * D] flat
            raw = _raw(t).flatten(2)
            src_e = self.fmt.element_index(si, d, value).flatten()
            raw.index_copy_(2, self.fmt.element_index(di, d, value).flatten(), raw.index_select(2, src_e))

    def stored(self, slots: torch.Tensor, window_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``slots`` as stored (storage dtype, not dequantized), ``[layers, kv_heads, n,
        head_dim]`` in row order whatever the layout: what a token's cache entry holds. With
        window parts the window layers' come from ``window_slots`` (the same tokens' part slots)."""
        out = []
        for whole, window, value in ((self.k, self.wk, False), (self.v, self.wv, True)):
            a = _stored(whole, slots, self.fmt, value)
            if window is None:
                out.append(a)
                continue
            if window_slots is None:
                raise ValueError("window layers' K/V need the tokens' window slots")
            b = _stored(window, window_slots, self.fmt, value)
            out.append(torch.stack([b[j] if local else a[j] for local, j in self._where]))
        return out[0], out[1]

    def layer(self, i: int, native: bool = False) -> LayerKV:
        local, j = self._where[i]
        if local:
            k, v, ks, vs = self.wk, self.wv, self.wk_scale, self.wv_scale
        else:
            k, v, ks, vs = self.k, self.v, self.k_scale, self.v_scale
        return LayerKV(k[j], v[j], None if ks is None else ks[j], None if vs is None else vs[j], self.fmt, native)

    def is_window_layer(self, i: int) -> bool:
        return self._where[i][0]


def _tensors(fmt: KVFormat, shape: tuple, device: torch.device):
    """K, V of ``shape`` in the storage dtype, and their scales (None unscaled)."""
    k = torch.empty(shape, dtype=fmt.storage, device=device)
    v = torch.empty(shape, dtype=fmt.storage, device=device)
    if not fmt.scaled:
        return k, v, None, None
    return k, v, torch.empty(shape[:3], dtype=torch.float32, device=device), torch.empty(shape[:3], dtype=torch.float32, device=device)


def _stored(t: torch.Tensor, slots: torch.Tensor, fmt: KVFormat, value: bool) -> torch.Tensor:
    d = t.shape[-1]
    if not fmt.unit:
        return t.index_select(2, slots)
    idx = fmt.element_index(slots, d, value).flatten()
    return _raw(t).flatten(2).index_select(2, idx).view(*t.shape[:2], -1, d).view(t.dtype)


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

    def store(self, slots: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, seen: bool = True):
        """Write the new tokens' K, V ``[T, kv_heads, head_dim]`` at ``slots``; returns what was
        stored, as the float32 (or compute-dtype) values every attention read will see (None
        with ``seen=False``: the native store then skips computing them)."""
        if self.native:
            return kernels.kv_store(self, slots, k_new, v_new, seen)
        out = []
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
            if seen:
                out.append(x if q.dtype == x.dtype else self.fmt.dequantize(q, s).to(x.dtype))
        return (out[0], out[1]) if seen else None

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
