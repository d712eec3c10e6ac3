// Element-wise steps of a decoder layer fused into one pass each (float32, AVX2): each replaces
// 3-8 tensor ops whose fixed cost dominates at the small M of a decode step. Every row is
// computed on its own, in the same order whatever M is.
//
//   rms_norm(x, w, eps)        x * rsqrt(mean(x^2) + eps) * w
//   silu_mul(gate_up)          silu(gate) * up, gate_up = [gate | up] along the last dim
//   gelu_mul(gate_up)          gelu_tanh(gate) * up (Gemma's GeGLU), the same layout
//   rope_(qkv, heads, cos, sin) rotate the first `heads` heads of each row in place:
//                              x cos + rotate_half(x) sin (rotate-half convention)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "parallel.h"
#include "rowwise.h"

namespace {

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
  prefixcache::parallel_chunks(m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) prefixcache::rms_norm_row(xp + r * n, wp, static_cast<float>(eps), n, yp + r * n);
  });
  return y;
}

at::Tensor glu(const at::Tensor& gate_up, bool gelu) {
  check_rows(gate_up, "gate_up");
  const int64_t m = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(n % 8 == 0, "half the width a multiple of 8");
  at::Tensor y = at::empty({m, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  prefixcache::parallel_chunks(m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (gelu) prefixcache::gelu_tanh_mul_row(gp + r * 2 * n, n, yp + r * n);
      else prefixcache::silu_mul_row(gp + r * 2 * n, n, yp + r * n);
    }
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return glu(gate_up, false); }
at::Tensor gelu_mul(const at::Tensor& gate_up) { return glu(gate_up, true); }

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
  prefixcache::parallel_chunks(t, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) prefixcache::rope_row(xp + r * w, heads, cp + r * d, sp + r * d, d);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, lib) {
  lib.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  lib.def("silu_mul(Tensor gate_up) -> Tensor");
  lib.def("gelu_mul(Tensor gate_up) -> Tensor");
  lib.def("rope_(Tensor(a!) qkv, int heads, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("rms_norm", &rms_norm);
  lib.impl("silu_mul", &silu_mul);
  lib.impl("gelu_mul", &gelu_mul);
  lib.impl("rope_", &rope_);
}
