"""Linear layers as kernels chosen once at load time.

A model's matmuls are ``y = x W^T (+ b)`` with ``x: [M, in]``; M is the number of rows in the
step (1 for a single decode, thousands for a prefill). Two kinds of layer:

- ``DenseLinear``: W in the compute dtype. On CPU through oneDNN with the weight reordered
  once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` /
  ``_linear_pointwise``, what inductor's freezing emits): measured faster than MKL's
  ``F.linear`` at small M on this machine (the 49k x 576 output projection at M = 8: 9.6 ms vs
  27 ms), the same at large M. Falls back to ``F.linear`` where oneDNN is missing (CUDA, or
  bf16 on a CPU without AVX-512).
- ``GroupLinear``: W stored in groups of 32 along the input dimension, 4-bit (``w = q d + m``)
  or 8-bit (``w = q d``), as GGUF's Q4_0/Q4_1/Q8_0 store them. Up to ``LARGE_M`` rows it runs
  our fused dequantize-matmul kernel (``prefixcache/kernels``), which reads 4 or 8 bits per
  weight instead of 32 and keeps float32 activations and sums; above, the float32 GEMM over
  the dequantized weights (the kernel is compute-bound at large M, the GEMM is not). Both
  paths hold the same float32 weights, so they differ by float32 summation order only: a
  token's K/V are the same, to float32 rounding, whether it was computed in a decode or in a
  prefill, which is what cold == warm rests on.

Why not aten's ``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm`` (measured, see
docs/benchmarks-journal.md): they take bf16 activations only and return bf16. Rounding activations to
bf16 at every layer turns float32 summation noise (different batch shapes in a cold and a warm
run) into whole bf16 steps on some elements, and greedy outputs of the same prompt then differed
cold vs warm in the engine tests.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from prefixcache import kernels
from prefixcache.model.loader import Int4Groups, Int8Groups, Int8Groups16

GROUP = 32
# Rows above which a group layer runs the float32 GEMM over its dequantized weights instead of
# the fused kernel, whose cost grows with M (it rebuilds each weight once per tile of up to 8
# rows) while the GEMM's stays flat until it is compute-bound. Measured on the default model's
# 30 layers, 2 threads (docs/benchmarks-journal.md, "Linear kernels"): kernel / dense 10 / 37 ms at
# M = 1, 27 / 85 at 8, 88 / 106 at 32, 131 / 174 at 48, 218 / 193 at 64.
LARGE_M = 48


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU can run oneDNN's packed linear in ``dtype`` (bf16 needs AVX-512)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), w, None, "none", [None], "")
        return True
    except (RuntimeError, AttributeError):
        return False


class DenseLinear:
    """y = x W^T + b in W's dtype."""

    kind = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight=True):
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()  # what one call reads
        self.bias = bias
        self.packed = None
        if weight.device.type == "cpu" and onednn_packs(weight.dtype):
            # The batch-size hint only tunes the layout; any M is accepted.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        # The plain layout is kept for the F.linear fallback and where others share it (a tied
        # embedding); keep_weight=False frees it once packed (a second copy of the layer).
        self.weight = weight if keep_weight or self.packed is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)


class GroupLinear:
    """Weights in groups of 32 (``Int4Groups`` or ``Int8Groups``), float32 activations."""

    def __init__(
        self,
        groups: Int4Groups | Int8Groups,
        bias: torch.Tensor | None = None,
        large_m: int = LARGE_M,
        dequantized: torch.Tensor | None = None,
    ):
        """``dequantized``: ``groups.dequantize()`` when the caller has it already (the loader's
        float32 copy); computed otherwise."""
        if isinstance(groups, Int4Groups):
            if groups.group_size != GROUP:
                raise ValueError(f"4-bit groups of {groups.group_size}; the kernel takes {GROUP}")
            self.kind = "q4"
        else:
            self.kind = "q8"
        self.records = pack_records(groups)
        self.out_features, self.in_features = groups.q.shape
        # The large-M path; the kernel rebuilds these same float32 values (q * d + m, one
        # rounding, like the loader's dequantization).
        if dequantized is None:
            dequantized = groups.dequantize()
        self.dense = DenseLinear(dequantized.float().contiguous(), keep_weight=False)
        self.bias = None if bias is None else bias.float()
        # Without the kernels (no compiler, no AVX2) every call takes the dense path: the same
        # numbers, at dense speed.
        self.large_m = large_m if kernels.available() else -1

    @property
    def nbytes(self) -> int:  # what a small-M call reads
        return self.records.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if x.shape[0] > self.large_m:
            y = self.dense(xf)
        elif self.kind == "q4":
            y = kernels.q4_linear(xf, self.records)
        else:
            y = kernels.q8_linear(xf, self.records)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


# The kernel's nibble order within a group of 32 (prefixcache/kernels/group_linear.cpp, Q4):
# byte 4 d + b holds weight 8 b + d in its low nibble and weight 8 b + 4 + d in its high one.
_LOW = [8 * b + d for d in range(4) for b in range(4)]
_HIGH = [i + 4 for i in _LOW]


def pack_records(groups: Int4Groups | Int8Groups) -> torch.Tensor:
    """The kernel's layout: each weight row a run of group records, scale first (one memory
    stream per row). 4-bit: float32 d | float32 m | 16 bytes of nibbles (24 bytes); 8-bit:
    float32 d | 32 int8 (36 bytes). Returns [out, groups * record] uint8."""
    out, n = groups.q.shape
    g = groups.q.view(out, n // GROUP, GROUP)

    def f32_bytes(t: torch.Tensor) -> torch.Tensor:  # [out, groups] float32 -> [out, groups, 4]
        return t.float().contiguous().unsqueeze(-1).view(torch.uint8)

    if isinstance(groups, Int4Groups):
        nibbles = g[:, :, _LOW] | (g[:, :, _HIGH] << 4)
        parts = [f32_bytes(groups.scale), f32_bytes(groups.offset), nibbles]
    else:
        parts = [f32_bytes(groups.scale), g.view(torch.uint8)]
    return torch.cat(parts, dim=-1).reshape(out, -1).contiguous()


def quantize_int4(weight: torch.Tensor) -> Int4Groups:
    """Asymmetric 4-bit groups of 32 (min/max per group, like GGUF Q4_1) of a float weight."""
    out, n = _check_groups(weight)
    g = weight.float().view(out, n // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return Int4Groups(q.view(out, n), scale, lo, GROUP)


def quantize_int8(weight: torch.Tensor) -> Int8Groups:
    """Symmetric int8 groups of 32 (absmax / 127 per group, like GGUF Q8_0) of a float weight."""
    out, n = _check_groups(weight)
    g = weight.float().view(out, n // GROUP, GROUP)
    scale = (g.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(g / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return Int8Groups(q.view(out, n), scale)


def _check_groups(weight: torch.Tensor) -> tuple[int, int]:
    out, n = weight.shape
    if n % GROUP:
        raise ValueError(f"grouped weights need in_features divisible by {GROUP}, got {n}")
    return out, n


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    dtype: torch.dtype,
    device: torch.device,
    groups: Int4Groups | Int8Groups16 | Int8Groups | None = None,
):
    """The layer for one weight. ``fmt``: "dense"; "file" (the file's own groups when it has
    them, else dense); "int4" / "int8" (the file's groups of that width when it has them, else
    quantized here). ``weight`` is the float32 weight (equal to ``groups.dequantize()``)."""
    if (isinstance(groups, Int8Groups) and groups.offset is not None) or not isinstance(groups, (Int4Groups, Int8Groups)):
        # (the float kernels' 8-bit records hold no minimum, and take groups of 32 only, not
        # Q6_K/Q3_K/Q2_K's 16: dense, or requantized)
        groups = None
    if fmt == "file" and groups is not None:
        return GroupLinear(groups, bias, dequantized=weight)
    if fmt == "int4":
        if isinstance(groups, Int4Groups):
            return GroupLinear(groups, bias, dequantized=weight)
        return GroupLinear(quantize_int4(weight), bias)
    if fmt == "int8":
        if isinstance(groups, Int8Groups):
            return GroupLinear(groups, bias, dequantized=weight)
        return GroupLinear(quantize_int8(weight), bias)
    if fmt not in ("dense", "file"):
        raise ValueError(f"unknown weight format {fmt!r}")
    b = None if bias is None else bias.to(device=device, dtype=dtype)
    return DenseLinear(weight.to(device=device, dtype=dtype).contiguous(), b)
