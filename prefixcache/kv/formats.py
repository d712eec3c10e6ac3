"""How K and V are stored in the paged cache: the KV dtype (``--kv-cache-dtype``).

| name | storage | per (token, KV head) | bytes/token, default model |
|---|---|---|---|
| ``float32`` / ``bfloat16`` (``auto``: the model's dtype) | as computed, or rounded to bf16 | - | 46,080 / 23,040 |
| ``int16`` (``auto`` on the exact path) | round(x / s), s = absmax / 4095 | float32 scale s | 23,760 |
| ``int8`` | round(x / s), s = absmax / 127 | float32 scale s | 12,240 |
| ``fp8_e4m3`` | e4m3 of x / s, s = absmax / 448 | float32 scale s | 12,240 |

Quantization is per token and KV head, so a token's stored K/V are a function of that token's
own K/V alone: written once when the token is computed, never touched again (a per-channel
scale over a block, as in KIVI, would change as the block fills, and a token would read back
differently depending on when its block was complete). Every attention read sees the stored
values, including tokens of the chunk being computed (``LayerKV.store`` returns them), so a
prefix served from the cache gives attention exactly what a cold run gives it.

int16 keeps 13 bits (|x| <= 4095) so that attention's integer products stay exact in int32
(kernels/int_attention.h: K/V times a 12-bit query and 14-bit softmax weights, head_dim <= 256);
on the exact path it is ``auto``'s choice: float32-like quality (KL vs float32 K/V at 2k-8k-token
contexts in docs/benchmarks-journal.md), half of float32's bytes, and attention on the integer units.
int8 measured KL ~1e-3 at 2k-token contexts (over the floor), so it stays opt-in.

Layout. Every format stores a token's row of a KV head whole at its slot, except int16, whose
rows live in units of 16 slots laid out as the integer attention reads them (kernels/kv_codec.h):
K as pairs of dimensions across the unit's 16 slots, V as pairs of slots across the dimensions.
A unit is the same 16 x D values, permuted inside, so a block of a multiple of 16 slots keeps its
bytes together (the tiers' payloads); ``element_index`` is the map, for the torch paths.

The quantizers here are the reference; the native kernels (prefixcache/kernels/kv_store.cpp)
compute the same floats, bit for bit (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.config import KV_CACHE_DTYPES

_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class KVFormat:
    name: str  # float32 | bfloat16 | float16 | int16 | int8 | fp8_e4m3
    storage: torch.dtype
    scaled: bool  # a float32 scale per (token, KV head)
    qmax: float = 0.0  # the largest stored magnitude of a scaled format
    code: int = 0  # the native kernels' name for it: 0 f32, 1 bf16, 2 int8, 3 fp8_e4m3, 5 int16
    unit: int = 0  # slots per layout unit (int16: 16), 0 where rows are stored whole

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        elem = torch.empty((), dtype=self.storage).element_size()
        per_head = head_dim * elem + (4 if self.scaled else 0)
        return 2 * num_layers * num_kv_heads * per_head

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [..., D] float32 -> (stored [..., D], scale [...] float32 or None)."""
        if not self.scaled:
            return x.to(self.storage), None
        amax = x.abs().amax(dim=-1)
        scale = (amax / self.qmax).clamp(min=_TINY)
        y = x / scale.unsqueeze(-1)
        if self.storage in (torch.int8, torch.int16):
            y = torch.round(y).clamp(-self.qmax, self.qmax)
        return y.to(self.storage), scale

    def element_index(self, slots: torch.Tensor, head_dim: int, value: bool) -> torch.Tensor:
        """[T, head_dim] offsets, in elements of a KV head's plane ([slots * head_dim] flat), of
        each dimension of each slot's K (``value`` False) or V row."""
        e = torch.arange(head_dim, device=slots.device)
        if not self.unit:
            return slots[:, None] * head_dim + e
        off = (slots % self.unit)[:, None]
        base = (slots[:, None] - off) * head_dim
        if value:
            return base + ((off // 2) * head_dim + e) * 2 + off % 2
        return base + ((e // 2) * self.unit + off) * 2 + e % 2

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Stored values -> the float32 values attention computes with."""
        x = q.float()
        return x if scale is None else x * scale.unsqueeze(-1)


_FORMATS = {
    "float32": KVFormat("float32", torch.float32, False, code=0),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16, False, code=1),
    "float16": KVFormat("float16", torch.float16, False, code=4),
    "int16": KVFormat("int16", torch.int16, True, 4095.0, code=5, unit=16),
    "int8": KVFormat("int8", torch.int8, True, 127.0, code=2),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, True, 448.0, code=3),
}


def kv_format(name: str, model_dtype: torch.dtype, exact: bool = False, block_size: int = 16) -> KVFormat:
    """The format of a ``kv_cache_dtype`` setting; ``auto`` stores K/V as int16 on the exact
    integer path (``exact``) with blocks of a multiple of 16 tokens, else in the model's dtype.
    int16 asked for elsewhere is an error: only the exact path's attention reads its layout."""
    int16_ok = exact and block_size % 16 == 0
    if name == "auto":
        name = "int16" if int16_ok else str(model_dtype).removeprefix("torch.")
    if name not in _FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    if name == "int16" and not int16_ok:
        raise ValueError(
            "kv_cache_dtype int16 runs on the exact integer path (CPU kernels, --activations other "
            f"than float32) with --block-size a multiple of 16 (got {block_size}{'' if exact else ', not exact'})"
        )
    return _FORMATS[name]
