// Attention on the exact path, shared by prefill_attention.cpp (the per-layer ops) and
// exact_decode.cpp (a whole decode step per call): every query reduces over its keys in blocks of
// 32 from position 0 with one online softmax, whatever the chunk, the batch or the call. The
// method is in prefill_attention.cpp's header comment.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kv_codec.h"
#include "vec.h"

namespace prefixcache::exact {



constexpr int64_t kKeys = 32;   // keys per block: 4 vectors of scores per query
constexpr int64_t kRows = 32;   // query rows per work item (measured: 16 -> 32 is +8% on a 1,000-token prefill, 64 balances worse)
constexpr int64_t kMaxD = 256;

// Scores of up to two queries against one transposed key block: s = scale * q . K[j]. Two queries
// share each load of the block and give 8 independent FMA chains (one query alone is bound by
// the latency of 4 chains); a missing second query (qb == nullptr) costs nothing.
inline void block_scores(const float* kt, int64_t d, float scale, const float* qa, const float* qb,
                         float* sa, float* sb) {
  const __m256 vs = _mm256_set1_ps(scale);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  if (qb != nullptr) {
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t dd = 0; dd < d; ++dd) {
      const float* row = kt + dd * kKeys;
      const __m256 k0 = _mm256_loadu_ps(row), k1 = _mm256_loadu_ps(row + 8);
      const __m256 k2 = _mm256_loadu_ps(row + 16), k3 = _mm256_loadu_ps(row + 24);
      const __m256 x = _mm256_set1_ps(qa[dd]), y = _mm256_set1_ps(qb[dd]);
      a0 = _mm256_fmadd_ps(x, k0, a0); a1 = _mm256_fmadd_ps(x, k1, a1);
      a2 = _mm256_fmadd_ps(x, k2, a2); a3 = _mm256_fmadd_ps(x, k3, a3);
      b0 = _mm256_fmadd_ps(y, k0, b0); b1 = _mm256_fmadd_ps(y, k1, b1);
      b2 = _mm256_fmadd_ps(y, k2, b2); b3 = _mm256_fmadd_ps(y, k3, b3);
    }
    _mm256_store_ps(sb, _mm256_mul_ps(b0, vs)); _mm256_store_ps(sb + 8, _mm256_mul_ps(b1, vs));
    _mm256_store_ps(sb + 16, _mm256_mul_ps(b2, vs)); _mm256_store_ps(sb + 24, _mm256_mul_ps(b3, vs));
  } else {
    for (int64_t dd = 0; dd < d; ++dd) {
      const float* row = kt + dd * kKeys;
      const __m256 x = _mm256_set1_ps(qa[dd]);
      a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row), a0);
      a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 8), a1);
      a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 16), a2);
      a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 24), a3);
    }
  }
  _mm256_store_ps(sa, _mm256_mul_ps(a0, vs)); _mm256_store_ps(sa + 8, _mm256_mul_ps(a1, vs));
  _mm256_store_ps(sa + 16, _mm256_mul_ps(a2, vs)); _mm256_store_ps(sa + 24, _mm256_mul_ps(a3, vs));
}

// Scores of three queries against one transposed key block: 12 independent FMA chains (two
// queries' 8 chains are exactly the FMA latency x throughput of Zen 4, so any stall showed), the
// key vectors taken as memory operands so the chains and the broadcasts fit 16 registers. Each
// query's chain is block_scores' (the same FMAs in the same order: the same bits).
inline void block_scores3(const float* kt, int64_t d, float scale, const float* qa, const float* qb,
                          const float* qc, float* sa, float* sb, float* sc) {
  const __m256 vs = _mm256_set1_ps(scale);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
  for (int64_t dd = 0; dd < d; ++dd) {
    const float* row = kt + dd * kKeys;
    const __m256 x = _mm256_set1_ps(qa[dd]), y = _mm256_set1_ps(qb[dd]), z = _mm256_set1_ps(qc[dd]);
    const __m256 k0 = _mm256_loadu_ps(row), k1 = _mm256_loadu_ps(row + 8);
    a0 = _mm256_fmadd_ps(x, k0, a0); b0 = _mm256_fmadd_ps(y, k0, b0); c0 = _mm256_fmadd_ps(z, k0, c0);
    a1 = _mm256_fmadd_ps(x, k1, a1); b1 = _mm256_fmadd_ps(y, k1, b1); c1 = _mm256_fmadd_ps(z, k1, c1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 16), a2);
    b2 = _mm256_fmadd_ps(y, _mm256_loadu_ps(row + 16), b2);
    c2 = _mm256_fmadd_ps(z, _mm256_loadu_ps(row + 16), c2);
    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 24), a3);
    b3 = _mm256_fmadd_ps(y, _mm256_loadu_ps(row + 24), b3);
    c3 = _mm256_fmadd_ps(z, _mm256_loadu_ps(row + 24), c3);
  }
  _mm256_store_ps(sa, _mm256_mul_ps(a0, vs)); _mm256_store_ps(sa + 8, _mm256_mul_ps(a1, vs));
  _mm256_store_ps(sa + 16, _mm256_mul_ps(a2, vs)); _mm256_store_ps(sa + 24, _mm256_mul_ps(a3, vs));
  _mm256_store_ps(sb, _mm256_mul_ps(b0, vs)); _mm256_store_ps(sb + 8, _mm256_mul_ps(b1, vs));
  _mm256_store_ps(sb + 16, _mm256_mul_ps(b2, vs)); _mm256_store_ps(sb + 24, _mm256_mul_ps(b3, vs));
  _mm256_store_ps(sc, _mm256_mul_ps(c0, vs)); _mm256_store_ps(sc + 8, _mm256_mul_ps(c1, vs));
  _mm256_store_ps(sc + 16, _mm256_mul_ps(c2, vs)); _mm256_store_ps(sc + 24, _mm256_mul_ps(c3, vs));
}

// Online softmax step of one query over a block: s (scores, keys [from, visible) of them real)
// becomes the block's weights exp(s - m_new) (exactly 0 outside [from, visible)); m and l move to the new max;
// returns the factor the running output is rescaled by.
inline float block_softmax(float* s, int64_t from, int64_t visible, float& m, float& l) {
  for (int64_t j = 0; j < from; ++j) s[j] = -std::numeric_limits<float>::infinity();
  for (int64_t j = visible; j < kKeys; ++j) s[j] = -std::numeric_limits<float>::infinity();
  const __m256 bmax = _mm256_max_ps(_mm256_max_ps(_mm256_load_ps(s), _mm256_load_ps(s + 8)),
                                    _mm256_max_ps(_mm256_load_ps(s + 16), _mm256_load_ps(s + 24)));
  const float m_new = std::max(m, hmax(bmax));
  const float w_old = std::exp(m - m_new);
  const __m256 vm = _mm256_set1_ps(m_new);
  for (int64_t j = 0; j < kKeys; j += 8) _mm256_store_ps(s + j, exp256(_mm256_sub_ps(_mm256_load_ps(s + j), vm)));
  // exp256 clamps, so a masked key weighs 1.6e-38, not 0: drop it exactly
  for (int64_t j = 0; j < from; ++j) s[j] = 0.f;
  for (int64_t j = visible; j < kKeys; ++j) s[j] = 0.f;
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(s), _mm256_load_ps(s + 8)),
                                   _mm256_add_ps(_mm256_load_ps(s + 16), _mm256_load_ps(s + 24)));
  l = l * w_old + hsum(sum);
  m = m_new;
  return w_old;
}

// o = o * w + sum_j p[j] V[j] for up to two queries (ob == nullptr: one), over keys [0, nk) of
// the block at vr, for the NV vectors of the head at c0. Two queries' accumulators and the shared
// V loads fit the 16 registers; NV is a compile-time count so they stay in registers (with a
// runtime count GCC kept them on the stack: a load and a store around every FMA, ~half of the
// kernel's time, measured with perf). A weight of exactly 0 (a masked key) adds exactly 0.
template <int NV>
inline void values_part(const float* const* vr, int64_t c0, int64_t nk, const float* pa, float wa,
                        float* oa, const float* pb, float wb, float* ob) {
  __m256 x[NV], y[NV];
  const __m256 va = _mm256_set1_ps(wa), vb = _mm256_set1_ps(wb);
  for (int c = 0; c < NV; ++c) {
    x[c] = _mm256_mul_ps(_mm256_loadu_ps(oa + c0 + 8 * c), va);
    if (ob != nullptr) y[c] = _mm256_mul_ps(_mm256_loadu_ps(ob + c0 + 8 * c), vb);
  }
  if (ob != nullptr) {
    for (int64_t j = 0; j < nk; ++j) {
      const float* row = vr[j] + c0;
      const __m256 p = _mm256_set1_ps(pa[j]), r = _mm256_set1_ps(pb[j]);
      for (int c = 0; c < NV; ++c) {
        const __m256 vv = _mm256_loadu_ps(row + 8 * c);
        x[c] = _mm256_fmadd_ps(p, vv, x[c]);
        y[c] = _mm256_fmadd_ps(r, vv, y[c]);
      }
    }
  } else {
    for (int64_t j = 0; j < nk; ++j) {
      const float* row = vr[j] + c0;
      const __m256 p = _mm256_set1_ps(pa[j]);
      for (int c = 0; c < NV; ++c) x[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(row + 8 * c), x[c]);
    }
  }
  for (int c = 0; c < NV; ++c) {
    _mm256_storeu_ps(oa + c0 + 8 * c, x[c]);
    if (ob != nullptr) _mm256_storeu_ps(ob + c0 + 8 * c, y[c]);
  }
}

// block_values for three queries (12 chains for NV = 4, as block_scores3): each query's
// operations are values_part's, in the same order.
template <int NV>
inline void values_part3(const float* const* vr, int64_t c0, int64_t nk, const float* const* p,
                         const float* w, float* const* o) {
  __m256 x[3][NV];
  for (int i = 0; i < 3; ++i) {
    const __m256 vw = _mm256_set1_ps(w[i]);
    for (int c = 0; c < NV; ++c) x[i][c] = _mm256_mul_ps(_mm256_loadu_ps(o[i] + c0 + 8 * c), vw);
  }
  for (int64_t j = 0; j < nk; ++j) {
    const float* row = vr[j] + c0;
    const __m256 pa = _mm256_set1_ps(p[0][j]), pb = _mm256_set1_ps(p[1][j]), pc = _mm256_set1_ps(p[2][j]);
    for (int c = 0; c < NV; ++c) {
      x[0][c] = _mm256_fmadd_ps(pa, _mm256_loadu_ps(row + 8 * c), x[0][c]);
      x[1][c] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(row + 8 * c), x[1][c]);
      x[2][c] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(row + 8 * c), x[2][c]);
    }
  }
  for (int i = 0; i < 3; ++i)
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(o[i] + c0 + 8 * c, x[i][c]);
}

inline void block_values3(const float* const* vr, int64_t d, int64_t nk, const float* const* p,
                          const float* w, float* const* o) {
  for (int64_t c0 = 0; c0 < d; c0 += 32) {
    switch (std::min<int64_t>(4, (d - c0) / 8)) {
      case 4: values_part3<4>(vr, c0, nk, p, w, o); break;
      case 3: values_part3<3>(vr, c0, nk, p, w, o); break;
      case 2: values_part3<2>(vr, c0, nk, p, w, o); break;
      default: values_part3<1>(vr, c0, nk, p, w, o); break;
    }
  }
}

inline void block_values(const float* const* vr, int64_t d, int64_t nk, const float* pa, float wa, float* oa,
                         const float* pb, float wb, float* ob) {
  for (int64_t c0 = 0; c0 < d; c0 += 32) {
    switch (std::min<int64_t>(4, (d - c0) / 8)) {
      case 4: values_part<4>(vr, c0, nk, pa, wa, oa, pb, wb, ob); break;
      case 3: values_part<3>(vr, c0, nk, pa, wa, oa, pb, wb, ob); break;
      case 2: values_part<2>(vr, c0, nk, pa, wa, oa, pb, wb, ob); break;
      default: values_part<1>(vr, c0, nk, pa, wa, oa, pb, wb, ob); break;
    }
  }
}

// The transposed block kt[dd * kKeys + j] = rows[j][dd] for keys j < nk (zeros after), from
// float32 rows: 8 keys x 8 dimensions at a time, transposed in registers (a scalar scatter cost
// ~6x the arithmetic of a decode's three queries; the values stored are the same floats).
inline void transpose_keys(const float* const* rows, int64_t nk, int64_t d, float* kt) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t j0 = 0; j0 < kKeys; j0 += 8) {
    for (int64_t d0 = 0; d0 < d; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = j0 + i < nk ? _mm256_loadu_ps(rows[j0 + i] + d0) : zero;
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = kt + d0 * kKeys + j0;
      _mm256_storeu_ps(o + 0 * kKeys, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * kKeys, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * kKeys, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * kKeys, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * kKeys, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * kKeys, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * kKeys, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * kKeys, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
}

// Where an item's keys come from: a contiguous [KVH, C, D] float32 copy (prefill_attention) or
// the paged pool read in place through a slot list, in its storage format (paged_attention).
// Either fills the transposed K block kt[dd * kKeys + j] (zeros past nk) and the block's V rows
// as float32 row pointers vr[j] (in place for float32, else converted into vbuf); the values are
// the same floats in both, so is everything computed from them.
struct DenseKeys {
  const float* k;
  const float* v;
  int64_t c, d;
  void fill(int64_t kh, int64_t k0, int64_t nk, float* kt, float* /*vbuf*/, const float** vr) const {
    const float* krows[kKeys];
    for (int64_t j = 0; j < nk; ++j) {
      krows[j] = k + (kh * c + k0 + j) * d;
      vr[j] = v + (kh * c + k0 + j) * d;
    }
    transpose_keys(krows, nk, d, kt);
  }
};

struct PagedKeys {
  const uint8_t* k;
  const uint8_t* v;
  const float* k_scale;  // null unless the format is scaled
  const float* v_scale;
  int64_t code, n_slots, d;
  const int64_t* slots;  // the sequence's context, in position order
  void fill(int64_t kh, int64_t k0, int64_t nk, float* kt, float* vbuf, const float** vr) const {
    const float* krows[kKeys];
    {  // copied (converted) into buffers: K rows into the second half of vbuf, V rows into the
       // first. A copy loop keeps many independent loads in flight; reading the pool in place
       // inside the transposes and value sums exposed each block's miss latency (its 4 KB per
       // head is one page, past the hardware prefetcher's reach): 8 vs 0.5 ms per layer for 8
       // decodes over 750 tokens when the pool is not in cache.
      const int64_t es = kv_elem_size(code);
      float* kbuf = vbuf + kKeys * d;
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t at = kh * n_slots + slots[k0 + j];
        load_row(code, k + at * d * es, k_scale ? k_scale[at] : 1.f, d, kbuf + j * d);
        load_row(code, v + at * d * es, v_scale ? v_scale[at] : 1.f, d, vbuf + j * d);
        krows[j] = kbuf + j * d;
        vr[j] = vbuf + j * d;
      }
    }
    transpose_keys(krows, nk, d, kt);
  }
};

// One item: query rows [i0, i1) of KV head kh (all G query heads of it). The item's queries are
// taken two at a time (row-major over (row, head)); each keeps its own causal limit. A query's
// arithmetic does not depend on the item: keys in blocks of 32 from position 0, its own score
// chains, softmax and value sums (the pairing shares loads only). So a token's output is the
// same bits in any chunk, batch, or as a decode (a chunk of one) - the exact path's contract.
//
// A sliding window (window > 0: a query at p sees keys (p - window, p], Gemma's local layers)
// keeps the blocks fixed: a query visits exactly the blocks from the one holding p - window + 1
// to the one holding p, and masks the keys before its window inside the first, so the window
// changes nothing of the contract.
template <typename Keys>
inline void attend_rows(const float* q, const Keys& keys, float* out, int64_t t, int64_t c, int64_t h,
                 int64_t kvh_count, int64_t d, int64_t kh, int64_t i0, int64_t i1, float scale,
                 std::vector<float>& kt, std::vector<float>& vbuf, int64_t window = 0) {
  const int64_t g = h / kvh_count, first = c - t;
  kt.resize(static_cast<size_t>(d * kKeys));
  vbuf.resize(static_cast<size_t>(2 * d * kKeys));
  const float* vr[kKeys];
  const int64_t nq = (i1 - i0) * g;
  std::vector<float> m(nq, -std::numeric_limits<float>::infinity()), l(nq, 0.f);
  std::vector<float> acc(static_cast<size_t>(nq * d), 0.f);
  auto qptr = [&](int64_t qi) { return q + ((i0 + qi / g) * h + kh * g + qi % g) * d; };
  auto qpos = [&](int64_t qi) { return first + i0 + qi / g; };
  const int64_t last_key = first + i1 - 1;  // the highest position any row here sees
  // Per block in three phases over the item's queries (scores, softmax, values): the same
  // operations per query as one query at a time, ordered so that independent queries' softmax
  // chains overlap (a softmax is a chain of dependent steps; one at a time it stalled the
  // pipeline between the score and value loops).
  std::vector<float> sbuf(static_cast<size_t>((nq + 1) * kKeys) + 8);
  float* sc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sbuf.data()) + 31) & ~uintptr_t{31});
  std::vector<float> w(nq);
  const auto lo = [&](int64_t qi) { return window > 0 ? std::max<int64_t>(0, qpos(qi) - window + 1) : 0; };
  for (int64_t k0 = lo(0) / kKeys * kKeys; k0 <= last_key; k0 += kKeys) {
    const int64_t nk = std::min(kKeys, last_key + 1 - k0);
    int64_t q0 = 0, nq_ = nq;
    while (q0 < nq && qpos(q0) < k0) ++q0;  // rows whose whole future this block is
    while (nq_ > q0 && lo(nq_ - 1) >= k0 + nk) --nq_;  // rows whose window starts past it
    if (q0 == nq_) continue;
    keys.fill(kh, k0, nk, kt.data(), vbuf.data(), vr);
    const auto visible = [&](int64_t qi) { return std::min(nk, qpos(qi) - k0 + 1); };
    const auto from = [&](int64_t qi) { return std::max<int64_t>(0, lo(qi) - k0); };
    const int64_t nq = nq_;  // this block's rows: [q0, nq)
    int64_t qs = q0;
    for (; qs + 3 <= nq; qs += 3)
      block_scores3(kt.data(), d, scale, qptr(qs), qptr(qs + 1), qptr(qs + 2), sc + qs * kKeys,
                    sc + (qs + 1) * kKeys, sc + (qs + 2) * kKeys);
    for (; qs < nq; qs += 2) {
      const bool two = qs + 1 < nq;
      block_scores(kt.data(), d, scale, qptr(qs), two ? qptr(qs + 1) : nullptr, sc + qs * kKeys,
                   sc + (qs + 1) * kKeys);
    }
    for (int64_t qi = q0; qi < nq; ++qi) w[qi] = block_softmax(sc + qi * kKeys, from(qi), visible(qi), m[qi], l[qi]);
    int64_t qv = q0;
    for (; qv + 3 <= nq; qv += 3) {
      const float* p[3] = {sc + qv * kKeys, sc + (qv + 1) * kKeys, sc + (qv + 2) * kKeys};
      float* o[3] = {acc.data() + qv * d, acc.data() + (qv + 1) * d, acc.data() + (qv + 2) * d};
      const int64_t vmax = std::max({visible(qv), visible(qv + 1), visible(qv + 2)});
      block_values3(vr, d, vmax, p, w.data() + qv, o);
    }
    for (int64_t qi = qv; qi < nq; qi += 2) {
      const bool two = qi + 1 < nq;
      const int64_t va = visible(qi), vb = two ? visible(qi + 1) : 0;
      block_values(vr, d, std::max(va, vb), sc + qi * kKeys, w[qi], acc.data() + qi * d,
                   sc + (qi + 1) * kKeys, two ? w[qi + 1] : 0.f, two ? acc.data() + (qi + 1) * d : nullptr);
    }
  }
  for (int64_t qi = 0; qi < nq; ++qi) {
    const float inv = 1.f / l[qi];
    const float* o = acc.data() + qi * d;
    float* dst = out + ((i0 + qi / g) * h + kh * g + qi % g) * d;
    for (int64_t cc = 0; cc < d; ++cc) dst[cc] = o[cc] * inv;
  }
}

}  // namespace prefixcache::exact
