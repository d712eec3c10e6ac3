// Exact, batch-invariant linear layer: 4-bit weight groups times integer activations, summed in
// int32, then one float32 epilogue in a fixed order (prefixcache/model/int_linear.py wraps it).
//
//   w[n, k] = q[n, k] * d[n, g] + m[n, g]        q in 0..15, g = k / 32 (GGUF Q4_1 / Q4_0)
//   x[r, k] ~ a[r, k] * s[r, g]                   a integer, |a| <= A (A = 32639 or 127)
//
// Per output (r, n) and group g the kernel computes the exact integers
//   dot = sum_k a[r, k] q[n, k]     sum_a = sum_k a[r, k]
// and then, for g = 0, 1, ... in order, in float32 with separate roundings (no FMA):
//   acc = acc + float(dot) * (s[r, g] * d[n, g])
//   acc = acc + m[n, g] * (s[r, g] * float(sum_a))
// Integer sums are exact whatever the blocking, tiling, threading or batch size, and the float
// epilogue of an output reads only that output's row and column, so a row's result depends on
// that row alone: bit-for-bit the same alone or in any batch, on any thread count, and on every
// ISA path here (vpdpbusd on AVX512-VNNI, vpmaddubsw + vpmaddwd on AVX2: the same integers,
// then the same scalar sequence of IEEE multiplies and adds per lane). The float values fit:
// |dot| <= 32 * 15 * 32639 < 2^24, so float(dot) is exact.
//
// 16-bit activations run as two int8 passes: a = 256 hi + lo with hi, lo in [-128, 127], and
// dot = 256 dot(hi) + dot(lo), still exact. They cost two passes and keep float32-like
// quality (KL 4e-8 vs float32 on the default model); 8-bit activations are one pass (faster,
// KL 1.7e-3: over the quality floor, opt-in). docs/design.md section 2 has the measurements.
//
// Weight layout (IntLinear.pack in int_linear.py), per block of 16 output columns and group:
//   256 bytes of nibbles: [j = 0..3][column c = 0..15][byte b = 0..3], low nibble = weight
//   k = 4 j + b of column c, high nibble = weight k = 16 + 4 j + b (k within the group)
//   then d and m: [blocks, groups, 16] float32 each.
// A 64-byte row j is one VNNI operand (16 columns x 4 consecutive k) after masking a nibble.
//
// Mixed activations (``mixed``, with 16 bits): per row, a group whose magnitude stands out of
// its row is quantized to 16 bits and every other group to 8, as the 16-bit value 256 a8:
//   wide(r, g) = G amax(r, g)^2 > 2 sum_g' amax(r, g')^2   (in double, g' in order)
//   wide:    s = amax / 32639, a = round(x / s)                   (the 16-bit rule)
//   narrow:  s8 = amax / 127, a = 256 round(x / s8), s = s8 / 256  (hi = a8, lo = 0)
// The integers and the epilogue are the 16-bit path's, so every path, skip or not, gives the
// same bits; a narrow group's low pass is all zeros and is skipped (per row and group), so the
// kernel costs about one pass plus the wide groups' share (~11% on the default model). Quality
// between the two (docs/design.md section 2): the decision reads only its own row.
//
// int8_linear is the same for 8-bit weight groups (GGUF Q8_0, or a bf16/float checkpoint
// quantized at load): w[n, k] = q[n, k] * d[n, g], q in -128..127, no offset, so
//   acc = acc + float(dot) * (s[r, g] * d[n, g])
// with dot = sum_k a[r, k] q[n, k] over the full 16-bit (or 8-bit) integers a. |dot| may pass
// 2^24, so float(dot) rounds: to nearest, the same on every path and in the reference. Two
// layouts of the same integers, chosen by the scheme (int_gemm.h w8_quads):
// - pairs (16-bit activations, and every scheme on AVX2): 512 bytes per block of 16 columns and
//   group, [p = 0..15][column 0..15][2], the weights k = 2 p, 2 p + 1 of the column; one pass of
//   16 x 16 -> 32 bit pair products on the integers whole (vpdpwssd / vpmaddwd: no saturation,
//   |pair| <= 2 * 32639 * 128).
// - quads (8-bit and mixed activations on AVX512-VNNI): 512 bytes [j = 0..7][column 0..15][4],
//   u8 = q + 128 of the weights k = 4 j .. 4 j + 3: vpdpbusd's unsigned operand against the
//   activations' int8 parts (hi, lo as above), and dot = 256 D(hi) + D(lo) - 128 sum(a) exactly.
//   One pass of 64 multiply-adds an instruction for 8-bit groups of activations, so mixed rows
//   cost about one pass (their wide groups add the low pass), as with 4-bit weights.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <thread>
#include <vector>

#include "int_gemm.h"
#include "parallel.h"

namespace {

using namespace prefixcache;

void check_scheme(const at::Tensor& x, int64_t bits, int64_t isa, bool mixed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu(), "x: [M, K] float32 on CPU");
  TORCH_CHECK(bits == 8 || bits == 16, "activation bits: 8 or 16");
  TORCH_CHECK(!mixed || bits == 16, "mixed activations are 8 or 16 bits per group: bits 16");
  check_isa(isa);
  TORCH_CHECK(x.size(1) % kGroup == 0, "K must be a multiple of 32");
}

// y = x W^T in work items (a chunk of rows, a run of column blocks), each taken by whichever
// thread is free (parallel.h). Any split and any schedule give the same bits: each output is
// computed whole by one item, and each row is quantized on its own.
//
// The rows are quantized inside the same parallel region, a row chunk by the first item that
// needs it, not in a region of their own before it: one region (and one join) a layer instead of
// two, and no static split for a busy sibling core to stall. An item whose chunk another thread
// is quantizing quantizes a later chunk meanwhile, or waits. Measured on a 2-core Xeon
// (docs/benchmarks-journal.md "8-bit weight pairs on AMX, and the Xeon side by side again"):
// served random-256 at c8 +5-11% (default model) and +2-4% (Gemma 3), builds alternated.
at::Tensor run(const at::Tensor& x, const IntWeights& w, const IntScheme& sc) {
  const at::Tensor xc = x.contiguous();
  const int64_t m = x.size(0), k = w.k, blocks = w.blocks();
  at::Tensor y = at::empty({m, w.n}, x.options());
  if (m == 0) return y;
  const float* xp = xc.data_ptr<float>();
  Quantized qa;
  size_quantized(qa, m, k, sc, w.w8, w.s16);
  float* yp = y.data_ptr<float>();
  const int64_t row_chunks = (m + kRowChunk - 1) / kRowChunk;
  const int64_t per_item = blocks_per_item(row_chunks, blocks);
  const int64_t col_items = (blocks + per_item - 1) / per_item;
  const bool whole = whole_activations(w.w8, sc, w.s16);
  // per row chunk: 0 not quantized, 1 being quantized, 2 quantized (release: its rows written)
  std::vector<std::atomic<int>> state(static_cast<size_t>(row_chunks));
  for (auto& st : state) st.store(0, std::memory_order_relaxed);
  const auto claim_and_quantize = [&](int64_t rc) {
    int expected = 0;
    if (!state[rc].compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) return false;
    quantize_rows(xp, k, rc * kRowChunk, std::min(m, (rc + 1) * kRowChunk), sc.bits, whole, sc.mixed, qa);
    state[rc].store(2, std::memory_order_release);
    return true;
  };
  const auto need = [&](int64_t rc) {
    int spins = 0;
    while (state[rc].load(std::memory_order_acquire) != 2) {
      if (claim_and_quantize(rc)) return;
      bool helped = false;  // another thread has rc: quantize a later chunk meanwhile
      for (int64_t j = rc + 1; j < row_chunks && !helped; ++j)
        helped = state[j].load(std::memory_order_relaxed) == 0 && claim_and_quantize(j);
      if (!helped) {
        _mm_pause();
        if (++spins > (1 << 14)) std::this_thread::yield(), spins = 0;  // a descheduled sibling
      }
    }
  };
  parallel_items(row_chunks * col_items, [&](int64_t it) {
    const int64_t rc = it / col_items, ci = it % col_items;
    const int64_t r0 = rc * kRowChunk, r1 = std::min(m, r0 + kRowChunk);
    const int64_t b0 = ci * per_item, b1 = std::min(blocks, b0 + per_item);
    need(rc);
    gemm_item(qa, w, sc, r0, r1, b0, b1, yp);
  });
  return y;
}

// isa: 3 = AMX-INT8, 2 = AVX512-VNNI, 1 = AVX2 (int_gemm.h check_isa).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wd, const at::Tensor& wm,
                       int64_t n, int64_t bits, int64_t isa, bool mixed) {
  check_scheme(x, bits, isa, mixed);
  const int64_t k = x.size(1), groups = k / kGroup, blocks = (n + kCols - 1) / kCols;
  TORCH_CHECK(wq.is_contiguous() && wq.scalar_type() == at::kByte && wq.numel() == blocks * groups * kBlockBytes,
              "wq: packed nibbles [blocks * groups * 256] uint8");
  TORCH_CHECK(wd.is_contiguous() && wm.is_contiguous() && wd.scalar_type() == at::kFloat &&
                  wm.scalar_type() == at::kFloat && wd.numel() == blocks * groups * kCols &&
                  wm.numel() == wd.numel(),
              "wd, wm: [blocks, groups, 16] float32");
  const IntWeights w{false, wq.data_ptr<uint8_t>(), wd.data_ptr<float>(), wm.data_ptr<float>(), n, k};
  return run(x, w, IntScheme{static_cast<int>(bits), mixed, isa});
}

// wm (optional): per-group offsets as int4_linear's, for 4-bit weights held as int8 (q in
// 0..15): then the epilogue is int4_linear's too, acc + float(dot) (s d) + m (s sum(a)), with
// the same integer dot (256 dot(hi) + dot(lo) == dot(a)), so the bits equal int4_linear's.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wd,
                       const std::optional<at::Tensor>& wm, int64_t n, int64_t bits, int64_t isa, bool mixed) {
  check_scheme(x, bits, isa, mixed);
  const int64_t k = x.size(1), groups = k / kGroup, blocks = (n + kCols - 1) / kCols;
  const IntScheme sc{static_cast<int>(bits), mixed, isa};
  // a scale (and an offset, if any) per 16 weights, twice the groups' count: GGUF Q6_K, Q3_K, Q2_K;
  // always int8 pairs
  const bool s16 = wd.numel() == 2 * blocks * groups * kCols;
  TORCH_CHECK(wq.is_contiguous() && wq.scalar_type() == (w8_quads(sc) && !s16 ? at::kByte : at::kChar) &&
                  wq.numel() == blocks * groups * kBlockBytes8,
              "wq: packed 8-bit weights [blocks * groups * 512]: uint8 quads (avx512-vnni with 8-bit or mixed "
              "activations, scales per 32) or int8 pairs");
  TORCH_CHECK(wd.is_contiguous() && wd.scalar_type() == at::kFloat &&
                  (wd.numel() == blocks * groups * kCols || s16),
              "wd: [blocks, groups, 16] float32 (or [blocks, 2 groups, 16]: a scale per 16 weights)");
  const bool off = wm.has_value();
  TORCH_CHECK(!off || (wm->is_contiguous() && wm->scalar_type() == at::kFloat && wm->numel() == wd.numel()),
              "wm: [blocks, groups, 16] float32 (per 16 weights: as wd)");
  const IntWeights w{true, wq.data_ptr(), wd.data_ptr<float>(), off ? wm->data_ptr<float>() : nullptr, n, k, s16};
  return run(x, w, sc);
}

// Whether AMX-INT8 runs here: the CPU has it and the OS granted this process the tile state.
bool has_amx() { return cpu_has_amx(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, lib) {
  lib.def("has_amx", &has_amx);
  lib.def("int4_linear(Tensor x, Tensor wq, Tensor wd, Tensor wm, int n, int bits, int isa, bool mixed=False) -> Tensor");
  lib.def("int8_linear(Tensor x, Tensor wq, Tensor wd, Tensor? wm, int n, int bits, int isa, bool mixed=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("int4_linear", &int4_linear);
  lib.impl("int8_linear", &int8_linear);
}
