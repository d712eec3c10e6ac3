// Decode attention over the paged KV cache, reading K/V rows where they lie (no gathered copy).
//
// The step's decodes come as "parts" (planned in prefixcache/model/decode_attention.py): a part
// is a list of query rows that all attend the same list of cache slots, a shared prefix
// segment (many rows, read once for all of them) or one row's own tail. Each (part, KV head)
// is one work item computing, for its rows x G query heads, the softmax pieces over its slots:
// max m, sum l and the unnormalised output o. A row's pieces are merged exactly afterwards
// (log-sum-exp), so the result is one softmax over the row's whole context up to float32
// rounding. Items go to threads largest first (their sizes differ by 10x).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "vec.h"

namespace {

using prefixcache::exp256;
using prefixcache::hmax;
using prefixcache::hsum;

constexpr int kMaxD = 256;

inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i < d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  return hsum(_mm256_add_ps(acc0, acc1));
}

struct Item {
  int64_t part, kvh, cost;
};

// Softmax pieces of rows [r0, r1) of one part, heads [h0, h0 + g), over the part's slots.
void attend_item(const float* q, const float* k, const float* v, int64_t n_slots_total, int64_t h,
                 int64_t d, const int64_t* rows, int64_t nr, const int64_t* slots, int64_t ns,
                 int64_t kvh, int64_t g, float scale, float* pm, float* pl, float* po,
                 std::vector<float>& scores) {
  const float* kh = k + kvh * n_slots_total * d;
  const float* vh = v + kvh * n_slots_total * d;
  const int64_t nq = nr * g;
  scores.resize(static_cast<size_t>(nq * ns));
  // scores[qi, j] = q . K[slot_j] * scale, slots outer so a K row is read once for all queries
  for (int64_t j = 0; j < ns; ++j) {
    const float* kr = kh + slots[j] * d;
    for (int64_t r = 0; r < nr; ++r) {
      const float* qr = q + (rows[r] * h + kvh * g) * d;
      for (int64_t gi = 0; gi < g; ++gi) {
        scores[(r * g + gi) * ns + j] = dot(qr + gi * d, kr, d) * scale;
      }
    }
  }
  for (int64_t qi = 0; qi < nq; ++qi) {
    float* s = scores.data() + qi * ns;
    // max
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + 8 <= ns; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
    float m = hmax(vmax);
    for (; j < ns; ++j) m = std::max(m, s[j]);
    // exp and sum
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    j = 0;
    for (; j + 8 <= ns; j += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
      _mm256_storeu_ps(s + j, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float l = hsum(vsum);
    for (; j < ns; ++j) {
      s[j] = std::exp(s[j] - m);
      l += s[j];
    }
    // o = sum_j p_j V[slot_j], accumulated in registers (d <= kMaxD)
    __m256 acc[kMaxD / 8];
    const int64_t nv = d / 8;
    for (int64_t c = 0; c < nv; ++c) acc[c] = _mm256_setzero_ps();
    for (j = 0; j < ns; ++j) {
      const __m256 p = _mm256_set1_ps(s[j]);
      const float* vr = vh + slots[j] * d;
      for (int64_t c = 0; c < nv; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), acc[c]);
    }
    const int64_t r = qi / g, gi = qi % g;
    const int64_t head = kvh * g + gi;
    pm[r * h + head] = m;
    pl[r * h + head] = l;
    float* o = po + (r * h + head) * d;
    for (int64_t c = 0; c < nv; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& rows_off,
                            const at::Tensor& rows, const at::Tensor& slots_off,
                            const at::Tensor& slots, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [B, H, D] float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == at::kFloat && v_cache.sizes() == k_cache.sizes(),
              "k_cache, v_cache: [KVH, N, D] float32 contiguous");
  for (const at::Tensor* t : {&rows_off, &rows, &slots_off, &slots}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, "int64 vectors");
  }
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t kvh = k_cache.size(0), n = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == d && d % 8 == 0 && d <= kMaxD, "head_dim a multiple of 8, <= 256");
  TORCH_CHECK(h % kvh == 0, "query heads a multiple of KV heads");
  const int64_t g = h / kvh;
  const int64_t parts = rows_off.numel() - 1;
  TORCH_CHECK(parts >= 0 && slots_off.numel() == parts + 1, "offsets of parts");
  const int64_t* ro = rows_off.data_ptr<int64_t>();
  const int64_t* so = slots_off.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  TORCH_CHECK(ro[parts] == rows.numel() && so[parts] == slots.numel(), "offsets end at the data");
  for (int64_t i = 0; i < rows.numel(); ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < b, "row out of range");
  for (int64_t i = 0; i < slots.numel(); ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < n, "slot out of range");

  const int64_t total_rows = rows.numel();
  at::Tensor pm = at::empty({total_rows, h}, q.options());
  at::Tensor pl = at::empty({total_rows, h}, q.options());
  at::Tensor po = at::empty({total_rows, h, d}, q.options());

  std::vector<Item> items;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t nr = ro[p + 1] - ro[p], ns = so[p + 1] - so[p];
    TORCH_CHECK(ns > 0 || nr == 0, "a part with rows attends at least one slot");
    for (int64_t kh = 0; kh < kvh; ++kh) items.push_back({p, kh, nr * g * ns + ns * 2});
  }
  // Largest first onto the least loaded thread (the static split of parallel_for would give
  // one thread all the long segments).
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& c) { return a.cost > c.cost; });
  std::vector<std::vector<Item>> plan(threads);
  std::vector<int64_t> load(threads, 0);
  for (const Item& it : items) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    plan[t].push_back(it);
    load[t] += it.cost;
  }
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* pmp = pm.data_ptr<float>();
  float* plp = pl.data_ptr<float>();
  float* pop = po.data_ptr<float>();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      for (const Item& it : plan[t]) {
        const int64_t r0 = ro[it.part], nr = ro[it.part + 1] - r0;
        const int64_t s0 = so[it.part], ns = so[it.part + 1] - s0;
        attend_item(qp, kp, vp, n, h, d, rp + r0, nr, sp + s0, ns, it.kvh, g,
                    static_cast<float>(scale), pmp + r0 * h, plp + r0 * h, pop + r0 * h * d, scores);
      }
    }
  });

  // Exact merge of each row's pieces, in part order.
  at::Tensor out = at::zeros({b, h, d}, q.options());
  std::vector<float> mrow(b * h, -std::numeric_limits<float>::infinity()), lrow(b * h, 0.f);
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < total_rows; ++i) {
    const int64_t row = rp[i];
    for (int64_t hh = 0; hh < h; ++hh) {
      const int64_t a = row * h + hh;
      const float m_new = std::max(mrow[a], pmp[i * h + hh]);
      const float w_old = std::exp(mrow[a] - m_new), w_part = std::exp(pmp[i * h + hh] - m_new);
      lrow[a] = lrow[a] * w_old + plp[i * h + hh] * w_part;
      float* o = op + a * d;
      const float* oi = pop + (i * h + hh) * d;
      for (int64_t c = 0; c < d; ++c) o[c] = o[c] * w_old + oi[c] * w_part;
      mrow[a] = m_new;
    }
  }
  for (int64_t a = 0; a < b * h; ++a) {
    TORCH_CHECK(lrow[a] > 0.f, "a decode row attended no slot");
    const float inv = 1.f / lrow[a];
    float* o = op + a * d;
    for (int64_t c = 0; c < d; ++c) o[c] *= inv;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, lib) {
  lib.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor rows_off, Tensor rows, "
      "Tensor slots_off, Tensor slots, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("decode_attention", &decode_attention);
}
