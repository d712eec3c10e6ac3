"""How K and V are stored in the paged cache: the KV dtype (``--kv-cache-dtype``).

| name | storage | per (token, KV head) | bytes/token, default model |
|---|---|---|---|
| ``float32`` / ``bfloat16`` (``auto``: the model's dtype) | as computed, or rounded to bf16 | - | 46,080 / 23,040 |
| ``int8`` | round(x / s), s = absmax / 127 | float32 scale s | 12,240 |
| ``fp8_e4m3`` | e4m3 of x / s, s = absmax / 448 | float32 scale s | 12,240 |

Quantization is per token and KV head, so a token's stored K/V are a function of that token's
own K/V alone: written once when the token is computed, never touched again (a per-channel
scale over a block, as in KIVI, would change as the block fills, and a token would read back
differently depending on when its block was complete). Every attention read sees the stored
values, including tokens of the chunk being computed (``LayerKV.store`` returns them), so a
prefix served from the cache gives attention exactly what a cold run gives it.

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
    name: str  # float32 | bfloat16 | float16 | int8 | fp8_e4m3
    storage: torch.dtype
    scaled: bool  # a float32 scale per (token, KV head)
    qmax: float = 0.0  # the largest stored magnitude of a scaled format
    code: int = 0  # the native kernels' name for it: 0 f32, 1 bf16, 2 int8, 3 fp8_e4m3

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
        if self.storage == torch.int8:
            y = torch.round(y).clamp(-self.qmax, self.qmax)
        return y.to(self.storage), scale

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Stored values -> the float32 values attention computes with."""
        x = q.float()
        return x if scale is None else x * scale.unsqueeze(-1)


_FORMATS = {
    "float32": KVFormat("float32", torch.float32, False, code=0),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16, False, code=1),
    "float16": KVFormat("float16", torch.float16, False, code=4),
    "int8": KVFormat("int8", torch.int8, True, 127.0, code=2),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, True, 448.0, code=3),
}


def kv_format(name: str, model_dtype: torch.dtype) -> KVFormat:
    """The format of a ``kv_cache_dtype`` setting; ``auto`` stores K/V in the model's dtype."""
    if name == "auto":
        name = str(model_dtype).removeprefix("torch.")
    if name not in _FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return _FORMATS[name]
