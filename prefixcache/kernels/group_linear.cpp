// Fused dequantize + matmul for weights stored in groups of 32 along the input dimension, with
// float32 activations and float32 sums (prefixcache/kernels/__init__.py builds and loads this).
//
//   q4: w[n, k] = q * d + m   (q in 0..15)
//   q8: w[n, k] = q * d       (q int8)
//
// A weight row is a sequence of group records, scale first, so one row is one memory stream
// (GroupLinear in prefixcache/model/linear.py packs them):
//
//   q4 record, 24 bytes: float32 d | float32 m | 16 bytes of nibbles (order: Q4::load)
//   q8 record, 36 bytes: float32 d | 32 int8
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
//
// Measured on a 2-core AVX2 EPYC (docs/benchmarks-journal.md, "Linear kernels"): the step at small M
// is bound by how fast two cores pull weight bytes while rebuilding them, so the layout keeps
// one stream per row, a lone x row walks two weight rows at once, and a software prefetch runs
// 16 records ahead (the scales in a separate array, and four rows at once, were 2x slower).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "group_gemv.h"

namespace {

using prefixcache::kGroup;
using prefixcache::Q4;
using prefixcache::Q8;
using prefixcache::rows_block;

template <typename Fmt>
at::Tensor group_linear(const at::Tensor& x, const at::Tensor& q) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu(), "x: [M, K] float32 on CPU");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kByte,
              "q: [N, bytes] uint8 contiguous (group records)");
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(q.size(1) == k / kGroup * Fmt::kRecord, "q has the wrong row size for K");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Threads split the weight rows; a block of 64 rows stays in cache while every tile of x
  // rows passes over it.
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += 64) {
      rows_block<Fmt>(xp, m, k, qp, b0, std::min(end, b0 + 64), yp, n);
    }
  });
  return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& q) { return group_linear<Q4>(x, q); }

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& q) { return group_linear<Q8>(x, q); }

}  // namespace

TORCH_LIBRARY(prefixcache, lib) {
  lib.def("q4_linear(Tensor x, Tensor q) -> Tensor");
  lib.def("q8_linear(Tensor x, Tensor q) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("q4_linear", &q4_linear);
  lib.impl("q8_linear", &q8_linear);
}
