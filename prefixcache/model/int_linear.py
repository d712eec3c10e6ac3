"""The exact linear layer: 4- or 8-bit weight groups times integer activations, summed in int32.

``IntLinear`` runs ``kernels/int_linear.cpp`` (its header comment has the arithmetic). Its
result for a row depends on that row alone (integer sums are exact whatever the tiling, the
batch, the thread count or the ISA, and the float epilogue is one fixed sequence per output),
so a token's K/V and logits are bit-for-bit the same alone or batched, chunked or whole,
decoded or prefilled. ``reference`` is the same arithmetic in plain PyTorch (int64 sums, the
same float32 epilogue), which the kernel is tested equal to with ``torch.equal``.

8-bit groups (GGUF Q8_0 and Q5_0; Q5_1 and Q5_K with their minimums as offsets, the epilogue of
4-bit groups; or a float checkpoint quantized at load: ``linear.quantize_int8``) run
``kernels.int8_linear``: with 16-bit activations the integers whole in one pass of 16 x 16-bit
pair products; with 8-bit or mixed activations on AVX512-VNNI as ``q + 128`` quads against the
activations' int8 parts (one vpdpbusd pass, the offset taken back exactly: ``pack8``); then the
same epilogue without the offset term.

On AVX2 (no VNNI) with 16-bit activations, 4-bit groups are also held as int8 (``q`` in 0..15,
with their offsets) and a call of ``WIDE_ROWS`` rows or more (prefill, wide decode) runs
``int8_linear`` on them: on Zen 2 it is 1.2x the nibble kernel's two passes (150 vs 122 GOP/s;
8-bit activations stay with the nibbles' single pass, 190), and its integers and epilogue are
the nibble kernel's (``256 dot(hi) + dot(lo) == dot(a)``), so the bits do not depend on which
of the two ran (tested). Narrower calls (decode) keep the nibbles, half the bytes to read.

Activations are quantized per row and group of 32: ``s = max|x| / A``, ``a = round(x / s)``
(half to even) with ``A = 32639`` for 16-bit (run as two int8 passes) or ``127`` for 8-bit.
``mixed`` (16 bits, ``kind`` w4a8x16): per row, the groups whose maximum stands out of the row
(``G amax^2 > 2 sum amax^2``, in float64 in group order) keep 16 bits, the others have 8 bits
carried as the 16-bit value ``256 a8`` (scale ``s8 / 256``): the same integers and epilogue as
16-bit, and the kernel skips the low pass where it is zero (int_linear.cpp).
"""

from __future__ import annotations

import torch

from prefixcache import kernels
from prefixcache.model.loader import Int4Groups, Int8Groups, Int8Groups16

GROUP = 32
COLS = 16  # output columns per packed block
ACTIVATION_MAX = {16: 32639.0, 8: 127.0}
# Rows from which 4-bit groups run as int8 on AVX2 (above). At 16 rows the int8 layout is
# already ahead (143 vs 113 GOP/s on Zen 2); below, reading twice the bytes costs more.
WIDE_ROWS = 8


class IntLinear:
    """y = x W^T (+ b) for W in 4-bit (``Int4Groups``) or 8-bit (``Int8Groups``) groups of 32,
    or small integers in groups of 16 (``Int8Groups16``: 8-bit pairs with a scale, and an offset
    where the file has minimums, per 16), ``bits``-bit activations."""

    def __init__(self, groups: Int4Groups | Int8Groups16 | Int8Groups, bias: torch.Tensor | None, bits: int,
                 isa: str, mixed: bool = False):  # fmt: skip
        if isinstance(groups, Int4Groups) and groups.group_size != GROUP:  # Int8Groups are always 32
            raise ValueError(f"weight groups of {groups.group_size}; the kernel takes {GROUP}")
        if bits not in ACTIVATION_MAX:
            raise ValueError(f"activation bits must be 8 or 16, got {bits}")
        if not kernels.available():  # loads the built library (or says why there is none)
            raise RuntimeError(f"the exact integer kernels are unavailable: {kernels.unavailable_reason()}")
        if mixed and bits != 16:
            raise ValueError("mixed activations are 8 or 16 bits per group: bits must be 16")
        self.out_features, self.in_features = groups.q.shape
        # Groups of 16 (Q6_K, Q3_K, Q2_K): 8-bit pairs, two epilogues a group of 32 (one per scale), the
        # activations whole 16-bit integers in every scheme (mixed and 8-bit ones are such
        # integers: the same numbers, without the quads' low-pass skip)
        self.sixteens = isinstance(groups, Int8Groups16)
        width = groups.bits if self.sixteens else 8 if isinstance(groups, Int8Groups) else 4
        self.wide = isinstance(groups, (Int8Groups, Int8Groups16))
        self.kind = f"w{width}a{'8x16' if mixed else bits}"
        self.bits, self.isa, self.mixed = bits, isa, mixed
        self.wq8 = None  # 4-bit groups as int8, for wide calls on AVX2
        if self.wide:
            self.wq, self.wd = pack8(groups, quads=w8_quads(isa, bits, mixed) and not self.sixteens)
            # groups with a minimum (GGUF Q5_1/Q5_K; per 16: Q2_K): int4_linear's offset epilogue
            offset = getattr(groups, "offset", None)
            self.wm = None if offset is None else _block_scales(offset, *_blocks(groups.q.shape[0]))
        else:
            self.wq, self.wd, self.wm = pack(groups)
            if isa == "avx2" and bits == 16 and not mixed:
                # 8-bit (and mixed) activations: one vpmaddubsw pass (plus the wide groups' low
                # pass) is faster
                self.wq8, _ = pack8(Int8Groups(groups.q.to(torch.int8), groups.scale))
        # The unpacked groups are not kept: one byte a weight, twice the nibbles (1 GB on a 1B
        # model). Tests build the reference from their own copy.
        self.bias = None if bias is None else bias.float()

    @property
    def nbytes(self) -> int:  # what one call reads
        return self.wq.numel() + 4 * (self.wd.numel() + (0 if self.wm is None else self.wm.numel()))

    @property
    def resident_bytes(self) -> int:  # what it holds: nbytes and the int8 copy on AVX2
        return self.nbytes + (0 if self.wq8 is None else self.wq8.numel())

    @property
    def rows_readable(self) -> bool:
        """Whether ``rows`` can read W back: 8-bit groups of 32 (pack8's pairs or quads)."""
        return self.wide and self.wm is None and not self.sixteens

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W as stored, dequantized ([n, in] float32, ``q * d`` per group: the
        same numbers as ``Int8Groups.dequantize``), read from the packed weights in place: a
        tied embedding needs no copy of its own."""
        if not self.rows_readable:
            raise ValueError("rows() reads 8-bit groups of 32 only")
        g = self.in_features // GROUP
        blocks = self.wq.numel() // (COLS * self.in_features)
        b, c = ids // COLS, ids % COLS
        if self.wq.dtype == torch.uint8:  # quads: q + 128, [j][column][4]
            q = self.wq.view(blocks, g, GROUP // 4, COLS, 4)[b, :, :, c, :].to(torch.int16) - 128
        else:  # pairs: [p][column][2]
            q = self.wq.view(blocks, g, GROUP // 2, COLS, 2)[b, :, :, c, :]
        d = self.wd.view(blocks, g, COLS)[b, :, c]  # [n, g]
        return (q.reshape(-1, g, GROUP).float() * d.unsqueeze(-1)).view(-1, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, bits, isa, mixed = self.out_features, self.bits, self.isa, self.mixed
        if self.wide:
            y = kernels.int8_linear(x.float(), self.wq, self.wd, n, bits, isa, self.wm, mixed)
        elif self.wq8 is not None and x.shape[0] >= WIDE_ROWS:
            y = kernels.int8_linear(x.float(), self.wq8, self.wd, n, bits, isa, self.wm, mixed)
        else:
            y = kernels.int4_linear(x.float(), self.wq, self.wd, self.wm, n, bits, isa, mixed)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def _blocks(out: int) -> tuple[int, int]:
    """Blocks of 16 columns for ``out`` outputs, and the padding columns of the last."""
    blocks = -(-out // COLS)
    return blocks, blocks * COLS - out


def _block_scales(t: torch.Tensor, blocks: int, pad: int) -> torch.Tensor:
    """[N, groups] -> [blocks, groups, 16] float32, zero scales for the padding columns."""
    g = t.shape[1]
    t = torch.nn.functional.pad(t.float(), (0, 0, 0, pad))  # [blocks * 16, groups]
    return t.view(blocks, COLS, g).transpose(1, 2).contiguous()


def pack(groups: Int4Groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout: per block of 16 output columns and group of 32 inputs, 256 bytes of
    nibbles ordered [j 0..3][column 0..15][b 0..3], the low nibble weight 4 j + b of the group
    and the high one 16 + 4 j + b; then d and m as [blocks, groups, 16] float32. Columns past
    the layer's end are zero weights with zero scales."""
    out, n = groups.q.shape
    g = n // GROUP
    blocks = -(-out // COLS)
    pad = blocks * COLS - out
    q = torch.nn.functional.pad(groups.q, (0, 0, 0, pad)).view(blocks, COLS, g, 2, 4, 4)
    # q[block, col, group, half, j, b] -> [block, group, j, col, b], low half | high half << 4
    q = q.permute(0, 2, 3, 4, 1, 5)  # [block, group, half, j, col, b]
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous().view(-1)

    return nibbles, _block_scales(groups.scale, blocks, pad), _block_scales(groups.offset, blocks, pad)


def w8_quads(isa: str, bits: int, mixed: bool) -> bool:
    """Whether 8-bit weights are packed as quads (int_gemm.h ``w8_quads``, the same rule): on
    AVX512-VNNI (and AMX, whose B tiles they are) with 8-bit or mixed activations, where vpdpbusd
    runs them in one pass; with
    16 bits everywhere the pairs' vpdpwssd was faster (docs/benchmarks-journal.md)."""
    return isa in ("amx", "avx512-vnni") and (bits == 8 or mixed)


def pack8(groups: Int8Groups | Int8Groups16, quads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``int8_linear``'s layout: per block of 16 output columns and group of 32 inputs, 512
    bytes; then d as [blocks, groups, 16] float32 (``Int8Groups16``: [blocks, 2 groups, 16], a
    scale per 16 weights, in pairs only). Columns past the layer's end are zero
    weights, zero scales. ``quads`` (``w8_quads``): uint8 ``q + 128`` ordered
    [j 0..7][column 0..15][4], weights 4 j .. 4 j + 3 of the group (a vpdpbusd operand per j);
    else int8 pairs ordered [p 0..15][column 0..15][2], weights 2 p and 2 p + 1."""
    out, n = groups.q.shape
    g = n // GROUP
    blocks = -(-out // COLS)
    pad = blocks * COLS - out
    q = torch.nn.functional.pad(groups.q, (0, 0, 0, pad))
    if quads:
        q = (q.to(torch.int16) + 128).to(torch.uint8).view(blocks, COLS, g, GROUP // 4, 4)
        q = q.permute(0, 2, 3, 1, 4).contiguous().view(-1)  # [block, group, j, col, 4]
    else:
        q = q.view(blocks, COLS, g, GROUP // 2, 2).permute(0, 2, 3, 1, 4).contiguous().view(-1)
    return q, _block_scales(groups.scale, blocks, pad)


def _quantize_groups(xg: torch.Tensor, amax: torch.Tensor, amax_q: float):
    """a (float, integer values), s: ``round(xg / s)`` clamped, ``s = amax / amax_q``."""
    s = amax / amax_q  # one IEEE division, as the kernel
    safe = torch.where(s > 0, s, torch.ones_like(s))
    a = torch.round(xg / safe.unsqueeze(-1)).clamp(-amax_q, amax_q)
    return torch.where((s > 0).unsqueeze(-1), a, torch.zeros_like(a)), s


def wide_groups(amax: torch.Tensor) -> torch.Tensor:
    """[M, G] bool: the groups that keep 16 bits under mixed activations, ``G amax^2 > 2 sum
    amax^2`` with the sum in float64 in group order (the kernel's sequence, so the same
    decisions)."""
    sq = amax.double() * amax.double()
    energy = torch.zeros(amax.shape[0], dtype=torch.float64)
    for g in range(amax.shape[1]):
        energy = energy + sq[:, g]
    return amax.shape[1] * sq > 2.0 * energy.unsqueeze(1)


def quantize_activations(x: torch.Tensor, bits: int, mixed: bool = False):
    """a [M, K] int64, s [M, K / 32] float32: the kernel's activation quantization."""
    m, k = x.shape
    xg = x.float().view(m, k // GROUP, GROUP)
    amax = xg.abs().amax(-1)
    a, s = _quantize_groups(xg, amax, ACTIVATION_MAX[bits])
    if mixed:  # narrow groups: 8 bits carried as 256 a8, scale s8 / 256 (exact)
        a8, s8 = _quantize_groups(xg, amax, ACTIVATION_MAX[8])
        wide = wide_groups(amax)
        a = torch.where(wide.unsqueeze(-1), a, a8 * 256)
        s = torch.where(wide, s, s8 / 256)
    return a.to(torch.int64).view(m, k), s


def reference(x: torch.Tensor, groups: Int4Groups | Int8Groups16 | Int8Groups, bits: int,
              mixed: bool = False) -> torch.Tensor:  # fmt: skip
    """The kernel's arithmetic in plain PyTorch: exact integer sums per group (int64), then the
    float32 epilogue in group order, each multiply and add rounded on its own. [M, N] float32.
    Groups of 16: the integer sum and the epilogue per group of 16, in order, each with the
    activations' scale of its group of 32."""
    m, k = x.shape
    if isinstance(groups, Int8Groups16):  # (with offsets: s sum(a) over each 16 activations)
        a, s = quantize_activations(x, bits, mixed)
        a16 = a.view(m, k // 16, 16)
        dots = torch.einsum("mjk,njk->mnj", a16, groups.q.to(torch.int64).view(-1, k // 16, 16))
        ssum16 = s.repeat_interleave(2, dim=1) * a16.sum(-1).to(torch.float32)  # [M, K / 16]
        acc = torch.zeros(m, groups.q.shape[0], dtype=torch.float32)
        for j in range(k // 16):
            p = s[:, j // 2 : j // 2 + 1] * groups.scale[:, j].float().unsqueeze(0)
            acc = acc + dots[:, :, j].to(torch.int32).to(torch.float32) * p
            if groups.offset is not None:
                acc = acc + groups.offset[:, j].float().unsqueeze(0) * ssum16[:, j : j + 1]
        return acc
    ng = k // GROUP
    a, s = quantize_activations(x, bits, mixed)
    ag = a.view(m, ng, GROUP)
    qg = groups.q.to(torch.int64).view(-1, ng, GROUP)
    dots = torch.einsum("mgk,ngk->mng", ag, qg)  # exact: int64
    if isinstance(groups, Int8Groups) and groups.offset is None:
        d = groups.scale.float()
        acc = torch.zeros(m, groups.q.shape[0], dtype=torch.float32)
        for g in range(ng):  # |dot| < 2^31: int32 first, then float32 rounds to nearest
            p = s[:, g : g + 1] * d[:, g].unsqueeze(0)
            acc = acc + dots[:, :, g].to(torch.int32).to(torch.float32) * p
        return acc
    sums = ag.sum(-1)  # [M, groups]
    ssum = s * sums.to(torch.float32)  # [M, groups]
    d, off = groups.scale.float(), groups.offset.float()  # [N, groups]
    acc = torch.zeros(m, groups.q.shape[0], dtype=torch.float32)
    for g in range(ng):
        p = s[:, g : g + 1] * d[:, g].unsqueeze(0)  # [M, N]
        acc = acc + dots[:, :, g].to(torch.float32) * p
        acc = acc + off[:, g].unsqueeze(0) * ssum[:, g : g + 1]
    return acc
