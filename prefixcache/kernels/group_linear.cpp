// Fused dequantize + matmul for weights stored in groups of 32 along the input dimension, with
// float32 activations and float32 sums (prefixcache/kernels/__init__.py builds and loads this).
//
//   q4: w[n, k] = q * d + m   (q in 0..15, two per byte; GGUF Q4_0/Q4_1 nibble order)
//   q8: w[n, k] = q * d       (q int8; GGUF Q8_0)
//
// Each weight is rebuilt in float32 with one fused multiply-add (q * d is exact in float32, so
// the result is the same float the dense path holds: the file's own value), then multiplied
// into every row of x. Only the order of the float32 sums differs from a dense GEMM, so the
// result is the dense layer's up to float32 rounding. A row's sum order does not depend on M
// (two accumulators per row, whatever the tile), so a token's result does not depend on which
// other rows share its call.
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
constexpr int kTile = 4;  // rows of x per pass over a weight row: 8 accumulators + 4 weights

struct Q4 {
  static constexpr int64_t kBytesPerGroup = 16;
  // 16 bytes: low nibbles are weights 0..15, high nibbles 16..31.
  static inline void load(const uint8_t* p, float d, float m, __m256 w[4]) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vd, vm);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vd, vm);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vd, vm);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vd, vm);
  }
};

struct Q8 {
  static constexpr int64_t kBytesPerGroup = 32;
  static inline void load(const uint8_t* p, float d, float /*unused*/, __m256 w[4]) {
    const __m256 vd = _mm256_set1_ps(d);
    for (int j = 0; j < 4; ++j) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j));
      w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vd);
    }
  }
};

// y[i, n] for rows i < MT of x and weight rows n in [n0, n1).
template <typename Fmt, int MT>
void rows(const float* x, int64_t ldx, int64_t k, const uint8_t* q, const float* scale,
          const float* offset, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t groups = k / kGroup;
  const int64_t row_bytes = groups * Fmt::kBytesPerGroup;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[MT][2];
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const uint8_t* qn = q + n * row_bytes;
    const float* dn = scale + n * groups;
    const float* mn = offset ? offset + n * groups : nullptr;
    for (int64_t g = 0; g < groups; ++g) {
      __m256 w[4];
      Fmt::load(qn + g * Fmt::kBytesPerGroup, dn[g], mn ? mn[g] : 0.f, w);
      const float* xg = x + g * kGroup;
      for (int i = 0; i < MT; ++i) {
        const float* xr = xg + i * ldx;
        acc[i][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[i][1]);
        acc[i][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[i][1]);
      }
    }
    for (int i = 0; i < MT; ++i) y[i * ldy + n] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
  }
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
  // Threads split the weight rows; each thread streams its rows once per tile of x rows, and a
  // block of 64 rows (<= 18 KB of q4) stays in cache across the tiles.
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += 64) {
      const int64_t b1 = std::min(end, b0 + 64);
      for (int64_t i = 0; i < m; i += kTile) {
        const float* xi = xp + i * k;
        float* yi = yp + i * n;
        switch (std::min<int64_t>(kTile, m - i)) {
          case 4: rows<Fmt, 4>(xi, k, k, qp, sp, off, yi, n, b0, b1); break;
          case 3: rows<Fmt, 3>(xi, k, k, qp, sp, off, yi, n, b0, b1); break;
          case 2: rows<Fmt, 2>(xi, k, k, qp, sp, off, yi, n, b0, b1); break;
          default: rows<Fmt, 1>(xi, k, k, qp, sp, off, yi, n, b0, b1); break;
        }
      }
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
