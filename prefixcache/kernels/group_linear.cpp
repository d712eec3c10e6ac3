// Fused dequantize + matmul for weights stored in groups of 32 along the input dimension, with
// float32 activations and float32 sums (prefixcache/kernels/__init__.py builds and loads this).
//
//   q4: w[n, k] = q * d + m   (q in 0..15, two per byte, in the order Q4::load reads)
//   q8: w[n, k] = q * d       (q int8; GGUF Q8_0)
//
// Each weight is rebuilt in float32 with one fused multiply-add (q * d is exact in float32, so
// the result is the same float the dense path holds: the file's own value), then multiplied
// into every row of x. Only the order of the float32 sums differs from a dense GEMM, so the
// result is the dense layer's up to float32 rounding. Each output is one accumulator summed in
// a fixed order, whatever the tile, so a token's result does not depend on which other rows
// share its call.
//
// Why: a decode step reads every weight once; 4 bits per weight instead of 32 is the step.
// aten's int4/int8 CPU kernels take bf16 activations only, and rounding activations to bf16
// turns float32 noise into whole bf16 steps (measured: cold != warm on greedy outputs).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "vec.h"

namespace {

using prefixcache::hsum;

constexpr int64_t kGroup = 32;

struct Q4 {
  static constexpr int64_t kBytesPerGroup = 16;
  static constexpr int kRowTile = 4;  // weight rows a lone x row walks at once (measured)
  static constexpr bool kPrefetch = false;
  // 16 bytes = 4 dwords; weight 8c + j (chunk c, lane j) is nibble 2c + j / 4 of dword j % 4
  // (GroupLinear packs them so). Broadcast to both halves of a register, lane j holds dword
  // j % 4, and one variable shift per chunk brings every lane's nibble down: no byte
  // widening shuffles (measured 8.9 vs 14.5 cycles per group and row at M = 1).
  static inline void load(const uint8_t* p, float d, float m, __m256 w[4]) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    for (int c = 0; c < 4; ++c) {
      const __m256i sh = _mm256_setr_epi32(8 * c, 8 * c, 8 * c, 8 * c, 8 * c + 4, 8 * c + 4, 8 * c + 4, 8 * c + 4);
      const __m256i v = _mm256_and_si256(_mm256_srlv_epi32(b, sh), mask);
      w[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), vd, vm);
    }
  }
};

struct Q8 {
  static constexpr int64_t kBytesPerGroup = 32;
  // Twice the bytes per weight: more than 2 rows at once made the streams slower, not faster,
  // and a software prefetch a few groups ahead helps (measured on the 49k x 576 head).
  static constexpr int kRowTile = 2;
  static constexpr bool kPrefetch = true;
  static inline void load(const uint8_t* p, float d, float /*unused*/, __m256 w[4]) {
    const __m256 vd = _mm256_set1_ps(d);
    for (int j = 0; j < 4; ++j) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j));
      w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vd);
    }
  }
};

// One accumulator per output (i, j), summed over groups in order (within a group: weights
// 0-7, 8-15, 16-23, 24-31): the same float32 result whatever tile computed it. MT x NT tiles
// keep <= 8 accumulators: 8 x 1 (a weight rebuilt once serves 8 rows), 4 x 2, 2 x 4, and for a
// lone row 1 x 4 or 1 x 2 (independent chains to hide FMA latency).
template <typename Fmt, int MT, int NT>
inline void tile(const float* x, int64_t k, const uint8_t* q, const float* scale,
                 const float* offset, int64_t n, float* y, int64_t ldy) {
  const int64_t groups = k / kGroup;
  const int64_t row_bytes = groups * Fmt::kBytesPerGroup;
  __m256 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int j = 0; j < NT; ++j) {
      const int64_t r = n + j;
      if (Fmt::kPrefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(q + r * row_bytes + (g + 4) * Fmt::kBytesPerGroup),
                     _MM_HINT_T0);
      }
      __m256 w[4];
      Fmt::load(q + r * row_bytes + g * Fmt::kBytesPerGroup, scale[r * groups + g],
                offset ? offset[r * groups + g] : 0.f, w);
      for (int i = 0; i < MT; ++i) {
        const float* xr = x + i * k + g * kGroup;
        __m256 a = acc[i][j];
        a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a);
        a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a);
        a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a);
        acc[i][j] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) y[i * ldy + n + j] = hsum(acc[i][j]);
}

template <typename Fmt, int MT, int NT>
void sweep(const float* x, int64_t k, const uint8_t* q, const float* scale, const float* offset,
           int64_t n0, int64_t n1, float* y, int64_t ldy) {
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) tile<Fmt, MT, NT>(x, k, q, scale, offset, n, y, ldy);
  for (; n < n1; ++n) tile<Fmt, MT, 1>(x, k, q, scale, offset, n, y, ldy);
}

// y[:, n0:n1] for all m rows of x.
template <typename Fmt>
void rows_block(const float* x, int64_t m, int64_t k, const uint8_t* q, const float* scale,
                const float* offset, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) sweep<Fmt, 8, 1>(x + i * k, k, q, scale, offset, n0, n1, y + i * ldy, ldy);
  for (; i + 4 <= m; i += 4) sweep<Fmt, 4, 2>(x + i * k, k, q, scale, offset, n0, n1, y + i * ldy, ldy);
  for (; i + 2 <= m; i += 2) sweep<Fmt, 2, 4>(x + i * k, k, q, scale, offset, n0, n1, y + i * ldy, ldy);
  for (; i < m; ++i) sweep<Fmt, 1, Fmt::kRowTile>(x + i * k, k, q, scale, offset, n0, n1, y + i * ldy, ldy);
}

template <typename Fmt>
at::Tensor group_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& offset) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu(), "x: [M, K] float32 on CPU");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "q: [N, bytes] contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(q.size(1) == k / kGroup * Fmt::kBytesPerGroup, "q has the wrong row size for K");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == n * (k / kGroup), "scale: [N, K/32] float32 contiguous");
  const float* off = nullptr;
  if (offset.has_value()) {
    TORCH_CHECK(offset->scalar_type() == at::kFloat && offset->is_contiguous() &&
                    offset->numel() == n * (k / kGroup), "offset: [N, K/32] float32 contiguous");
    off = offset->data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Threads split the weight rows; a block of 64 rows (<= 18 KB of 4-bit weights) stays in
  // cache while every tile of x rows passes over it.
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += 64) {
      rows_block<Fmt>(xp, m, k, qp, sp, off, b0, std::min(end, b0 + 64), yp, n);
    }
  });
  return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                     const at::Tensor& offset) {
  return group_linear<Q4>(x, q, scale, offset);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  return group_linear<Q8>(x, q, scale, c10::nullopt);
}

}  // namespace

TORCH_LIBRARY(prefixcache, lib) {
  lib.def("q4_linear(Tensor x, Tensor q, Tensor scale, Tensor offset) -> Tensor");
  lib.def("q8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("q4_linear", &q4_linear);
  lib.impl("q8_linear", &q8_linear);
}
