// Causal attention of a prefill chunk: q [T, H, D] over k, v [KVH, C, D], where the last T keys
// are the queries' own (query i sits at position C - T + i and sees keys 0 .. C - T + i).
//
// Flash-style: each work item is one KV head and a block of query rows; it walks the visible
// keys in blocks of 32, transposes the block of K once (so a query's 32 scores come out of
// vector FMAs, no horizontal sums), and keeps a running max, sum and output per query (online
// softmax), so no [T, C] score matrix is ever written. Float32 throughout.
//
// Why: the torch path (chunked bmm, masked_fill, softmax, bmm) spent ~25% of a 1,000-token
// prefill on attention, mostly in small GEMMs with K = 64 and passes over score matrices.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

using prefixcache::exp256;
using prefixcache::hmax;
using prefixcache::hsum;

constexpr int64_t kKeys = 32;   // keys per block: 4 vectors of scores per query
constexpr int64_t kRows = 16;   // query rows per work item
constexpr int64_t kMaxD = 256;

// One item: query rows [i0, i1) of KV head kh (all G query heads of it).
void attend_rows(const float* q, const float* k, const float* v, float* out, int64_t t, int64_t c,
                 int64_t h, int64_t kvh_count, int64_t d, int64_t kh, int64_t i0, int64_t i1,
                 float scale, std::vector<float>& kt) {
  const int64_t g = h / kvh_count, first = c - t, nv = d / 8;
  const float* kh_base = k + kh * c * d;
  const float* vh_base = v + kh * c * d;
  kt.resize(static_cast<size_t>(d * kKeys));
  const int64_t nq = (i1 - i0) * g;
  std::vector<float> m(nq, -std::numeric_limits<float>::infinity()), l(nq, 0.f);
  std::vector<float> acc(static_cast<size_t>(nq * d), 0.f);
  const int64_t last_key = first + i1 - 1;  // the highest position any row here sees
  alignas(32) float s[kKeys];
  for (int64_t k0 = 0; k0 <= last_key; k0 += kKeys) {
    const int64_t nk = std::min(kKeys, last_key + 1 - k0);
    // K block transposed: kt[dd * kKeys + j] = K[k0 + j][dd] (zeros past nk)
    for (int64_t j = 0; j < kKeys; ++j) {
      const float* kr = kh_base + (k0 + j) * d;
      for (int64_t dd = 0; dd < d; ++dd) kt[dd * kKeys + j] = j < nk ? kr[dd] : 0.f;
    }
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t pos = first + i;
      if (pos < k0) continue;  // this whole key block is in the row's future
      const int64_t visible = std::min(nk, pos - k0 + 1);
      for (int64_t gi = 0; gi < g; ++gi) {
        const int64_t qi = (i - i0) * g + gi;
        const float* qv = q + (i * h + kh * g + gi) * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t dd = 0; dd < d; ++dd) {
          const __m256 qb = _mm256_set1_ps(qv[dd]);
          const float* row = kt.data() + dd * kKeys;
          a0 = _mm256_fmadd_ps(qb, _mm256_loadu_ps(row), a0);
          a1 = _mm256_fmadd_ps(qb, _mm256_loadu_ps(row + 8), a1);
          a2 = _mm256_fmadd_ps(qb, _mm256_loadu_ps(row + 16), a2);
          a3 = _mm256_fmadd_ps(qb, _mm256_loadu_ps(row + 24), a3);
        }
        const __m256 vs = _mm256_set1_ps(scale);
        _mm256_store_ps(s, _mm256_mul_ps(a0, vs));
        _mm256_store_ps(s + 8, _mm256_mul_ps(a1, vs));
        _mm256_store_ps(s + 16, _mm256_mul_ps(a2, vs));
        _mm256_store_ps(s + 24, _mm256_mul_ps(a3, vs));
        for (int64_t j = visible; j < kKeys; ++j) s[j] = -std::numeric_limits<float>::infinity();
        // online softmax: rescale what was accumulated to the new max
        const __m256 bmax = _mm256_max_ps(_mm256_max_ps(_mm256_load_ps(s), _mm256_load_ps(s + 8)),
                                          _mm256_max_ps(_mm256_load_ps(s + 16), _mm256_load_ps(s + 24)));
        const float m_new = std::max(m[qi], hmax(bmax));
        const float w_old = std::exp(m[qi] - m_new);
        const __m256 vm = _mm256_set1_ps(m_new);
        for (int64_t j = 0; j < kKeys; j += 8) {
          _mm256_store_ps(s + j, exp256(_mm256_sub_ps(_mm256_load_ps(s + j), vm)));
        }
        // exp256 clamps, so a masked key weighs 1.6e-38, not 0: drop it exactly
        for (int64_t j = visible; j < kKeys; ++j) s[j] = 0.f;
        float block_sum = 0.f;
        for (int64_t j = 0; j < visible; ++j) block_sum += s[j];
        l[qi] = l[qi] * w_old + block_sum;
        m[qi] = m_new;
        float* o = acc.data() + qi * d;
        __m256 ov[kMaxD / 8];
        const __m256 wo = _mm256_set1_ps(w_old);
        for (int64_t cc = 0; cc < nv; ++cc) ov[cc] = _mm256_mul_ps(_mm256_loadu_ps(o + 8 * cc), wo);
        for (int64_t j = 0; j < visible; ++j) {
          const __m256 p = _mm256_set1_ps(s[j]);
          const float* vr = vh_base + (k0 + j) * d;
          for (int64_t cc = 0; cc < nv; ++cc) ov[cc] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * cc), ov[cc]);
        }
        for (int64_t cc = 0; cc < nv; ++cc) _mm256_storeu_ps(o + 8 * cc, ov[cc]);
      }
    }
  }
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t qi = (i - i0) * g + gi;
      const float inv = 1.f / l[qi];
      const float* o = acc.data() + qi * d;
      float* dst = out + (i * h + kh * g + gi) * d;
      for (int64_t cc = 0; cc < d; ++cc) dst[cc] = o[cc] * inv;
    }
  }
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [T, H, D] float32 contiguous");
  TORCH_CHECK(k.dim() == 3 && k.scalar_type() == at::kFloat && k.is_contiguous() && v.sizes() == k.sizes() &&
                  v.is_contiguous() && v.scalar_type() == at::kFloat, "k, v: [KVH, C, D] float32 contiguous");
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), kvh = k.size(0), c = k.size(1);
  TORCH_CHECK(k.size(2) == d && d % 8 == 0 && d <= kMaxD, "head_dim a multiple of 8, <= 256");
  TORCH_CHECK(h % kvh == 0 && t <= c && t > 0, "query heads a multiple of KV heads; 0 < T <= C");
  at::Tensor out = at::empty_like(q);
  const int64_t blocks = (t + kRows - 1) / kRows, items = blocks * kvh;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Later row blocks see more keys: threads take items round-robin, so each gets early and
  // late blocks (a contiguous split would give one thread most of the work).
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> kt;
    for (int64_t th = t0; th < t1; ++th) {
      for (int64_t it = th; it < items; it += nt) {
        const int64_t kh = it % kvh, blk = it / kvh;
        const int64_t i0 = blk * kRows, i1 = std::min(t, i0 + kRows);
        attend_rows(qp, kp, vp, op, t, c, h, kvh, d, kh, i0, i1, static_cast<float>(scale), kt);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, lib) {
  lib.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("prefill_attention", &prefill_attention);
}
