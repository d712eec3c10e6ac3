// Element-wise steps of a decoder layer fused into one pass each (float32, AVX2): each replaces
// 3-8 tensor ops whose fixed cost dominates at the small M of a decode step. Every row is
// computed on its own, in the same order whatever M is.
//
//   rms_norm(x, w, eps)        x * rsqrt(mean(x^2) + eps) * w
//   silu_mul(gate_up)          silu(gate) * up, gate_up = [gate | up] along the last dim
//   rope_(qkv, heads, cos, sin) rotate the first `heads` heads of each row in place:
//                              x cos + rotate_half(x) sin (rotate-half convention)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "vec.h"

namespace {

using prefixcache::exp256;
using prefixcache::hsum;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.is_cpu(),
              name, ": [M, N] float32 contiguous on CPU");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t m = x.size(0), n = x.size(1);
  TORCH_CHECK(w.numel() == n && w.scalar_type() == at::kFloat && w.is_contiguous(), "w: [N] float32");
  TORCH_CHECK(n % 8 == 0, "N a multiple of 8");
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * n;
      float* yr = yp + r * n;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < n; i += 8) {
        const __m256 v = _mm256_loadu_ps(xr + i);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      const float inv = 1.f / std::sqrt(hsum(acc) / static_cast<float>(n) + static_cast<float>(eps));
      const __m256 vi = _mm256_set1_ps(inv);
      for (int64_t i = 0; i < n; i += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + i), vi);
        _mm256_storeu_ps(yr + i, _mm256_mul_ps(v, _mm256_loadu_ps(wp + i)));
      }
    }
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t m = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(n % 8 == 0, "half the width a multiple of 8");
  at::Tensor y = at::empty({m, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    const __m256 one = _mm256_set1_ps(1.f);
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gp + r * 2 * n;
      const float* u = g + n;
      float* yr = yp + r * n;
      for (int64_t i = 0; i < n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
      }
    }
  });
  return y;
}

// qkv: [T, W] float32 contiguous, heads of width d from column 0; cos, sin_signed: [T, d] with
// sin_signed = [-sin | sin] (prefixcache/model/llama.py Rotary).
void rope_(const at::Tensor& qkv, int64_t heads, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t t = qkv.size(0), w = qkv.size(1), d = cos.size(1), half = d / 2;
  TORCH_CHECK(cos.size(0) == t && sin.sizes() == cos.sizes(), "cos, sin: [T, D]");
  TORCH_CHECK(half % 8 == 0 && heads * d <= w, "head_dim a multiple of 16; heads fit the row");
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, t, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cp + r * d;
      const float* s = sp + r * d;
      for (int64_t hh = 0; hh < heads; ++hh) {
        float* x = xp + r * w + hh * d;
        for (int64_t i = 0; i < half; i += 8) {
          const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
          // x[i] cos[i] + x[i + d/2] (-sin[i]);  x[i + d/2] cos[i + d/2] + x[i] sin[i + d/2]
          const __m256 lo = _mm256_fmadd_ps(b, _mm256_loadu_ps(s + i), _mm256_mul_ps(a, _mm256_loadu_ps(c + i)));
          const __m256 hi = _mm256_fmadd_ps(a, _mm256_loadu_ps(s + half + i),
                                            _mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)));
          _mm256_storeu_ps(x + i, lo);
          _mm256_storeu_ps(x + half + i, hi);
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, lib) {
  lib.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  lib.def("silu_mul(Tensor gate_up) -> Tensor");
  lib.def("rope_(Tensor(a!) qkv, int heads, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("rms_norm", &rms_norm);
  lib.impl("silu_mul", &silu_mul);
  lib.impl("rope_", &rope_);
}
