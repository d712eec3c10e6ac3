"""Linear kernels (prefixcache/model/linear.py, prefixcache/kernels) against the plain
computation they replace.

- dense (oneDNN-packed where the CPU allows): F.linear within float32 rounding;
- group layers (4-bit and 8-bit groups of 32): the fused kernel (small M) and the float32 GEMM
  over the dequantized weights (large M) equal ``x @ W.T`` with W the file's own float32
  weights, within float32 rounding, at every M; the kernel's result for a row does not depend
  on the other rows of the call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixcache import kernels
from prefixcache.model.linear import (
    DenseLinear,
    GroupLinear,
    make_linear,
    onednn_packs,
    quantize_int4,
    quantize_int8,
)
from prefixcache.model.loader import Int4Groups, Int8Groups

SHAPES = [(96, 64), (160, 96), (64, 224)]  # (out, in): in divisible by 32
ROWS = list(range(1, 18)) + [31, 33, 64]

needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"group kernels unavailable: {kernels.unavailable_reason()}"
)


def _close(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Equal up to float32 summation order: the error bound scales with sum |x| |w|."""
    bound = (x.abs() @ w.abs().T) * 4e-6 + 1e-6
    assert bool(((a - b).abs() <= bound).all()), float(((a - b).abs() / bound).max())


@pytest.mark.parametrize("out_f,in_f", SHAPES)
def test_dense_float32_equals_f_linear(out_f, in_f):
    g = torch.Generator().manual_seed(out_f)
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g)
    lin = DenseLinear(w, b)
    for m in ROWS:
        x = torch.randn(m, in_f, generator=g)
        _close(lin(x) - b, F.linear(x, w), x, w)


def test_dense_bfloat16_equals_f_linear():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).bfloat16()
    lin = DenseLinear(w)
    for m in ROWS:
        x = torch.randn(m, 64, generator=g).bfloat16()
        # bf16 outputs: one rounding of a float32 sum, so a few bf16 steps apart at most
        torch.testing.assert_close(lin(x).float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)


def test_onednn_probe_is_cached_and_boolean():
    assert onednn_packs(torch.float32) in (True, False)
    assert onednn_packs(torch.float32) is onednn_packs(torch.float32)


def _q4(out_f: int, in_f: int, seed: int) -> Int4Groups:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8)
    scale = torch.rand(out_f, in_f // 32, generator=g) * 0.02 + 1e-3
    offset = -8 * scale + torch.randn(out_f, in_f // 32, generator=g) * 1e-3
    return Int4Groups(q, scale, offset, 32)


def _q8(out_f: int, in_f: int, seed: int) -> Int8Groups:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out_f, in_f), generator=g, dtype=torch.int8)
    return Int8Groups(q, torch.rand(out_f, in_f // 32, generator=g) * 0.01 + 1e-4)


@needs_kernels
@pytest.mark.parametrize("make", [_q4, _q8], ids=["q4", "q8"])
@pytest.mark.parametrize("out_f,in_f", SHAPES)
def test_group_kernel_equals_dense_on_the_files_weights(make, out_f, in_f):
    groups = make(out_f, in_f, out_f + in_f)
    w = groups.dequantize()
    kernel = GroupLinear(groups, large_m=1 << 30)  # always the fused kernel
    gemm = GroupLinear(groups, large_m=0)  # always the float32 GEMM
    g = torch.Generator().manual_seed(7)
    for m in ROWS:
        x = torch.randn(m, in_f, generator=g)
        ref = x @ w.T
        _close(kernel(x), ref, x, w)
        _close(gemm(x), ref, x, w)


@needs_kernels
def test_group_kernel_row_does_not_depend_on_its_companions():
    groups = _q4(160, 96, 3)
    lin = GroupLinear(groups, large_m=1 << 30)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(17, 96, generator=g)
    full = lin(x)
    for i in range(17):
        assert torch.equal(lin(x[i : i + 1]), full[i : i + 1])  # bit for bit


@needs_kernels
def test_group_layer_around_the_switch_point_and_with_bias():
    groups = _q8(96, 64, 9)
    bias = torch.randn(96)
    lin = GroupLinear(groups, bias)
    w = groups.dequantize()
    g = torch.Generator().manual_seed(11)
    for m in (lin.large_m - 1, lin.large_m, lin.large_m + 1):
        x = torch.randn(m, 64, generator=g)
        _close(lin(x) - bias, x @ w.T, x, w)


@needs_kernels
def test_group_kernel_keeps_bfloat16_callers_in_bfloat16():
    groups = _q4(64, 64, 2)
    x = torch.randn(3, 64).bfloat16()
    y = GroupLinear(groups)(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), x.float() @ groups.dequantize().T, rtol=2e-2, atol=2e-2)


def test_quantize_int4_and_int8_error_within_half_a_step():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 128, generator=g)
    for groups in (quantize_int4(w), quantize_int8(w)):
        step = groups.scale.repeat_interleave(32, dim=1)
        assert float(((groups.dequantize() - w).abs() / step).max()) <= 0.5 + 1e-4
    assert int(quantize_int4(w).q.max()) <= 15
    assert int(quantize_int8(w).q.abs().max()) <= 127


def test_make_linear_formats_and_errors():
    w = torch.randn(64, 64)
    cpu = torch.device("cpu")
    assert make_linear(w, None, "dense", torch.float32, cpu).kind == "dense"
    assert make_linear(w, None, "file", torch.float32, cpu).kind == "dense"  # no stored groups
    assert make_linear(w, None, "file", torch.float32, cpu, _q8(64, 64, 1)).kind == "q8"
    assert make_linear(w, None, "int4", torch.float32, cpu).kind == "q4"
    assert make_linear(w, None, "int8", torch.float32, cpu).kind == "q8"
    # int8 over 4-bit groups the file holds: requantized from the float weight
    assert make_linear(w, None, "int8", torch.float32, cpu, _q4(64, 64, 1)).kind == "q8"
    with pytest.raises(ValueError, match="divisible"):
        make_linear(torch.randn(8, 40), None, "int4", torch.float32, cpu)
    with pytest.raises(ValueError, match="unknown weight format"):
        make_linear(w, None, "int3", torch.float32, cpu)


def test_without_kernels_group_layers_run_dense(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    groups = _q4(64, 64, 6)
    lin = GroupLinear(groups)
    x = torch.randn(2, 64)
    assert lin.large_m == -1
    _close(lin(x), x @ groups.dequantize().T, x, groups.dequantize())


@needs_kernels
def test_group_layer_takes_the_callers_dequantized_copy():
    groups = _q4(64, 96, 8)
    given = GroupLinear(groups, large_m=0, dequantized=groups.dequantize())
    computed = GroupLinear(groups, large_m=0)
    x = torch.randn(5, 96)
    assert torch.equal(given(x), computed(x))


def test_dense_can_drop_its_plain_copy_once_packed():
    w = torch.randn(32, 64)
    lin = DenseLinear(w, keep_weight=False)
    assert (lin.weight is None) == (lin.packed is not None)
    x = torch.randn(3, 64)
    _close(lin(x), x @ w.T, x, w)
    assert lin.nbytes == w.numel() * 4


def test_a_killed_builds_lock_is_cleared_a_running_builds_kept(tmp_path):
    """torch's loader waits without end on a build directory's ``lock``; one left by a killed
    build (older than any build runs) is removed, a fresh one (a build under way) is not."""
    import os

    lock = tmp_path / "lock"
    assert not kernels.clear_stale_lock(tmp_path)  # none
    lock.touch()
    assert not kernels.clear_stale_lock(tmp_path) and lock.exists()
    old = lock.stat().st_mtime - kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert kernels.clear_stale_lock(tmp_path) and not lock.exists()
