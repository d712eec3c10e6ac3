"""Native CPU kernels of our own, built on first use with the compiler torch's extensions use.

``group_linear.cpp``: fused dequantize + matmul for weights in groups of 32 (4-bit and
8-bit), float32 activations. ``decode_attention.cpp``: decode attention reading the paged cache
in place, shared prefixes once. ``fused_ops.cpp``: RMSNorm, SiLU- and GELU-and-multiply, rotary.
``decode_forward.cpp``: every layer of a decode-only step in one call, one thread team. It is compiled once per environment into
``$PREFIXCACHE_KERNELS_DIR`` or ``<venv>/share/prefixcache-kernels/torch-<version>`` (the
user cache directory when the environment is read-only), and rebuilt when the source or flags
change (torch's extension loader hashes them); ``make install`` builds it so that no start
pays the ~30 s compile.

``available()`` is False (and the engine falls back to dense float32 layers, slower but the same
numbers) when the CPU lacks AVX2/FMA, the platform is not x86-64, no compiler works, or
``PREFIXCACHE_NO_KERNELS=1`` is set. The reason is logged once.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = [_HERE / n for n in (
    "group_linear.cpp", "decode_attention.cpp", "fused_ops.cpp", "decode_forward.cpp",
    "prefill_attention.cpp", "kv_store.cpp", "int_linear.cpp", "exact_decode.cpp",
)]
_HEADERS = [
    _HERE / n
    for n in ("vec.h", "group_gemv.h", "attention.h", "rowwise.h", "kv_codec.h", "parallel.h",
              "int_gemm.h", "exact_attention.h", "int_attention.h", "team.h")
]
# -fopenmp: at::parallel_for is a header template that compiles to `#pragma omp parallel` in
# our library; without the flag it runs on one thread. The library then needs libgomp.so.1,
# which resolves to the copy torch has already loaded (one OpenMP runtime, one thread pool).
# -ffp-contract=off: the compiler never fuses a multiply and an add that the source wrote apart,
# so every path's float arithmetic is the sequence written (the exact integer path's epilogue
# relies on it, and it makes the AVX2 and AVX-512 builds of a formula agree).
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]


def build_dir() -> Path:
    env = os.environ.get("PREFIXCACHE_KERNELS_DIR")
    if env:
        return Path(env).expanduser()
    leaf = f"torch-{torch.__version__}"
    venv = Path(sys.prefix) / "share" / "prefixcache-kernels" / leaf
    if os.access(sys.prefix, os.W_OK):
        return venv
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "prefixcache-kernels" / leaf


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def unavailable_reason() -> str | None:
    if os.environ.get("PREFIXCACHE_NO_KERNELS") == "1":
        return "PREFIXCACHE_NO_KERNELS=1"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"no kernels for {platform.machine()}"
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        return f"CPU lacks {', '.join(sorted(missing))}"
    return None


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.prefixcache.q4_linear`` / ``q8_linear`` can be called (builds them on
    the first call in a process; later processes load the built library)."""
    reason = unavailable_reason()
    if reason is None:
        try:
            _build()
            return True
        except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as e:
            # a missing compiler or ninja, a compile error
            reason = f"build failed: {e}".splitlines()[0]
    log.warning("prefixcache CPU kernels unavailable (%s): quantized layers run dense", reason)
    return False


# A build takes ~1 min; torch's loader holds a ``lock`` file in the build directory meanwhile
# and waits, without end, while another process's lock exists. A build killed mid-compile
# (a timeout, Ctrl-C) leaves its lock behind, and every later start would hang on it.
STALE_LOCK_S = 600.0


def clear_stale_lock(directory: Path, now: float | None = None) -> bool:
    """Remove ``directory/lock`` when it is older than any build runs (``STALE_LOCK_S``): the
    mark of a killed build. A younger lock is a build under way and is left to finish."""
    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    log.warning("kernels: removing a stale build lock %s (%.0f s old: a build was killed)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _build() -> None:
    """Load the library built for this exact source and flags, building it first if needed.
    The directory name is a digest of both, so a changed source never loads an old build, and
    a loaded build never re-runs the compiler (torch's loader would re-check with ninja, and
    rebuild whenever the checkout's path changed)."""
    import xxhash
    from torch.utils import cpp_extension

    h = xxhash.xxh3_64(" ".join(_FLAGS).encode())
    for f in _SOURCES + _HEADERS:
        h.update(f.read_bytes())
    key = h.hexdigest()
    directory = build_dir() / key
    library = directory / "prefixcache_kernels.so"
    if library.is_file():
        torch.ops.load_library(str(library))
        return
    directory.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(directory)
    cpp_extension.load(
        name="prefixcache_kernels",
        sources=[str(f) for f in _SOURCES],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )


def decode_attention(q, kv, parts, scale: float):
    """Decode attention of q [B, H, D] over one layer's cache ``kv`` (kv.pool.LayerKV), read in
    place in its storage format, for the step's NativeParts."""
    return torch.ops.prefixcache.decode_attention(
        q, kv.k, kv.v, kv.k_scale, kv.v_scale, kv.fmt.code, parts.rows_off, parts.rows,
        parts.slots_off, parts.slots, scale,
    )  # fmt: skip


def kv_store(kv, slots, k_new, v_new, seen: bool = True):
    """Quantize and write new K, V [T, KVH, D] into ``kv`` (a LayerKV) at ``slots``; returns
    the stored values as float32 (kv_store.cpp; the same bytes as KVFormat.quantize), or None
    with ``seen=False`` (for callers that read the pool itself)."""
    k, v = torch.ops.prefixcache.kv_store(
        kv.k, kv.v, kv.k_scale, kv.v_scale, kv.fmt.code, slots, k_new, v_new, seen
    )
    return (k, v) if seen else None


def prefill_attention(q, k, v, scale: float):
    """Causal attention of q [T, H, D] over k, v [KVH, C, D] (the last T keys are q's own)."""
    return torch.ops.prefixcache.prefill_attention(q, k, v, scale)


def paged_attention(q, kv, paged, scale: float, isa_name: str = "avx2", window: int = 0):
    """Causal attention of every sequence of a step (q [T, H, D]) over one layer's pool ``kv``
    (a LayerKV) read in place, for a model.attention.PagedBatch: the per-query arithmetic of
    prefill_attention for prefill chunks and decodes alike. Over an int16 pool the products run
    on the integer units of ``isa_name`` (int_attention.h; every path gives the same bits).
    ``window`` > 0: a sliding window, a query at p sees keys (p - window, p]."""
    return torch.ops.prefixcache.paged_attention(
        q, kv.k, kv.v, kv.k_scale, kv.v_scale, kv.fmt.code, paged.q_start, paged.q_len, paged.ctx,
        paged.slots_off, paged.slots, scale, _ISA_CODE[isa_name], window,
    )  # fmt: skip


def rms_norm(x, w, eps: float):
    return torch.ops.prefixcache.rms_norm(x, w, eps)


def silu_mul(gate_up):
    return torch.ops.prefixcache.silu_mul(gate_up)


def gelu_mul(gate_up):
    """gelu_tanh(gate) * up for gate_up = [gate | up] (Gemma's GeGLU), row by row."""
    return torch.ops.prefixcache.gelu_mul(gate_up)


def rope_(qkv, heads: int, cos, sin) -> None:
    torch.ops.prefixcache.rope_(qkv, heads, cos, sin)


def decode_forward(x, cos, sin, layers, kv, slot_mapping, parts, num_heads: int,
                   num_kv_heads: int, eps: float, scale: float):
    """Every decoder layer of a decode-only step in one call (decode_forward.cpp). ``layers`` is
    (input_norms, post_norms, qkv, o, gate_up, down, kinds, qkv_bias) as lists over layers;
    ``kv`` the pool (kv.pool.KVCache); ``parts`` the step's NativeParts. Returns the final
    hidden states [B, hidden]."""
    return torch.ops.prefixcache.decode_forward(
        x, cos, sin, *layers, kv.k, kv.v, kv.k_scale, kv.v_scale, kv.fmt.code, slot_mapping,
        parts.rows_off, parts.rows, parts.slots_off, parts.slots, num_heads, num_kv_heads, eps,
        scale,
    )  # fmt: skip


def decode_groups(ctx, slots_off, slots, min_shared: int = 256, min_groups: int = 1):
    """How exact_decode groups a step's decode rows by the cached prefix their contexts share
    (int_attention.h shared_prefix_groups): [B, 2] int64, each row's group and the keys the
    group shares (0: a row alone). ``min_shared``: the least a group shares (exact_decode: 256);
    ``min_groups``: groups are halved until there are this many (exact_decode: two work items
    a thread)."""
    return torch.ops.prefixcache.decode_groups(ctx, slots_off, slots, min_shared, min_groups)


def exact_decode(x, cos, sin, layers, kv, meta, isa_name: str, num_heads: int, num_kv_heads: int,
                 ffn: int, eps: float, scale: float, local=None):
    """Every decoder layer of an exact decode-only step in one call (exact_decode.cpp): the bits
    of the op-by-op path. ``layers`` is (input_norms, post_norms, wq, wd, wm, codes, qkv_bias,
    qk_norms, out_norms, windows, gelu) from model/llama.py; ``meta`` the step's
    AttentionMetadata (one query per sequence; ``meta.window`` the window parts' tables where
    the pool has parts); ``local`` the sliding-window layers' (cos, sin), None without them."""
    parts, tables, pks, pvs = [], [], None, None
    in_parts = [0] * kv.num_layers  # which layers' K/V live in the pool's window parts
    if kv.windowed:
        w = meta.window
        parts, pks, pvs = [kv.wk, kv.wv], kv.wk_scale, kv.wv_scale
        tables = [w.slot_mapping, w.paged.ctx, w.paged.slots_off, w.paged.slots]
        in_parts = [int(kv.is_window_layer(i)) for i in range(kv.num_layers)]
    lc, ls = local if local is not None else (None, None)
    p = meta.paged
    return torch.ops.prefixcache.exact_decode(
        x, cos, sin, *layers, _ISA_CODE[isa_name], kv.k, kv.v, kv.k_scale, kv.v_scale,
        kv.fmt.code, meta.slot_mapping, p.ctx, p.slots_off, p.slots, lc, ls, parts, in_parts, pks, pvs, tables,
        num_heads, num_kv_heads, ffn, eps, scale,
    )  # fmt: skip


def q4_linear(x, records):
    """x [M, K] float32 times 4-bit group records [N, K / 32 * 24] (see group_linear.cpp)."""
    return torch.ops.prefixcache.q4_linear(x, records)


def q8_linear(x, records):
    """x [M, K] float32 times 8-bit group records [N, K / 32 * 36]."""
    return torch.ops.prefixcache.q8_linear(x, records)


# The integer paths of the exact linear kernel (int_linear.cpp), best first. Every path gives the
# same bits; PREFIXCACHE_ISA names a lower one to force it on a higher host (tests, comparisons).
ISAS = ("amx", "avx512-vnni", "avx2")
_ISA_CODE = {"amx": 3, "avx512-vnni": 2, "avx2": 1}
_VNNI512 = {"avx512f", "avx512bw", "avx512_vnni"}
# amx: wide calls through AMX-INT8 tiles, the rest (decode, remainder rows, mixed activations,
# weights with a scale per 16) through the AVX512-VNNI tiles; the same bits (int_gemm.h rows_amx,
# rows_amx_w8).
_ISA_FLAGS = {"amx": {"amx_tile", "amx_int8"} | _VNNI512, "avx512-vnni": _VNNI512, "avx2": {"avx2", "fma"}}


def supported_isas() -> list[str]:
    """The integer paths this CPU can run, best first (amx only where the OS also grants this
    process the tile state: asked of the built kernels)."""
    flags = _cpu_flags()
    have = [name for name in ISAS if _ISA_FLAGS[name] <= flags]
    if "amx" in have and not (available() and torch.ops.prefixcache.has_amx()):
        have.remove("amx")
    return have


def isa() -> str:
    """The path the exact integer kernels run on: the best this CPU has, or the one
    ``PREFIXCACHE_ISA`` names (an error if the CPU lacks it or the name is unknown)."""
    want = os.environ.get("PREFIXCACHE_ISA", "").strip().lower()
    have = supported_isas()
    if not want or want == "auto":
        if not have:
            raise RuntimeError("no integer kernel path for this CPU (needs AVX2)")
        return have[0]
    if want not in ISAS:
        raise ValueError(f"PREFIXCACHE_ISA={want!r}: one of auto, {', '.join(ISAS)}")
    if want not in have:
        raise ValueError(f"PREFIXCACHE_ISA={want}: this CPU lacks it (it has {', '.join(have)})")
    return want


def int4_linear(x, wq, wd, wm, n: int, bits: int, isa_name: str, mixed: bool = False):
    """x [M, K] float32 times packed 4-bit groups (model/int_linear.py) with ``bits``-bit
    activations (``mixed``: 8 or 16 bits per group, int_linear.cpp), exact integer sums:
    [M, n] float32."""
    return torch.ops.prefixcache.int4_linear(x, wq, wd, wm, n, bits, _ISA_CODE[isa_name], mixed)


def int8_linear(x, wq, wd, n: int, bits: int, isa_name: str, wm=None, mixed: bool = False):
    """x [M, K] float32 times packed 8-bit groups (model/int_linear.py) with ``bits``-bit
    activations, exact integer sums: [M, n] float32. ``wm``: int4_linear's offsets, for 4-bit
    weights held as int8 (the same bits as int4_linear)."""
    return torch.ops.prefixcache.int8_linear(x, wq, wd, wm, n, bits, _ISA_CODE[isa_name], mixed)
