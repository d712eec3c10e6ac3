// One row of each element-wise step of a decoder layer (float32, AVX2), shared by
// fused_ops.cpp (one op per call) and decode_forward.cpp (a whole decode step). Each row is
// computed on its own, in the same order whatever else is in the batch.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace prefixcache {

// y = x * rsqrt(mean(x^2) + eps) * w, n a multiple of 8.
inline void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const float inv = 1.f / std::sqrt(hsum(acc) / static_cast<float>(n) + eps);
  const __m256 vi = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vi);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(v, _mm256_loadu_ps(w + i)));
  }
}

// y[i] = silu(gate[i]) * up[i] for gate_up = [gate | up] (2n floats), n a multiple of 8.
inline void silu_mul_row(const float* gate_up, int64_t n, float* y) {
  const __m256 one = _mm256_set1_ps(1.f);
  const float* u = gate_up + n;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(gate_up + i);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
  }
}

// y[i] = gelu_tanh(gate[i]) * up[i] (Gemma's GeGLU), with gelu_tanh(g) = 0.5 g (1 + tanh(u)) =
// g sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3): silu_mul_row's form, one exponential each.
inline void gelu_tanh_mul_row(const float* gate_up, int64_t n, float* y) {
  const __m256 one = _mm256_set1_ps(1.f), c2 = _mm256_set1_ps(-2.f * 0.7978845608028654f);
  const __m256 cube = _mm256_set1_ps(0.044715f);
  const float* u = gate_up + n;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(gate_up + i);
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(cube, gv), _mm256_mul_ps(gv, gv), gv);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_mul_ps(c2, inner))));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
  }
}

// Rotate `heads` heads of width d starting at x, in place: x cos + rotate_half(x) sin, with
// c = [cos | cos] and s = [-sin | sin] for this row's position (rotate-half convention).
inline void rope_row(float* x, int64_t heads, const float* c, const float* s, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t hh = 0; hh < heads; ++hh, x += d) {
    for (int64_t i = 0; i < half; i += 8) {
      const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
      // x[i] cos[i] + x[i + d/2] (-sin[i]);  x[i + d/2] cos[i + d/2] + x[i] sin[i + d/2]
      const __m256 lo = _mm256_fmadd_ps(b, _mm256_loadu_ps(s + i), _mm256_mul_ps(a, _mm256_loadu_ps(c + i)));
      const __m256 hi = _mm256_fmadd_ps(a, _mm256_loadu_ps(s + half + i), _mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)));
      _mm256_storeu_ps(x + i, lo);
      _mm256_storeu_ps(x + half + i, hi);
    }
  }
}

}  // namespace prefixcache
