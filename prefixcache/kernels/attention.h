// Decode attention pieces shared by decode_attention.cpp (one layer per call) and
// decode_forward.cpp (a whole decode step): the plan of work items, one item's softmax pieces,
// and the exact merge of a row's pieces. See decode_attention.cpp for the method.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kv_codec.h"
#include "vec.h"

namespace prefixcache {

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

// One layer's K or V in the cache: [KVH, N, D] in a storage format (kv_codec.h), with a
// float32 scale per (KV head, slot) for scaled formats.
struct KVSource {
  const uint8_t* data;
  const float* scale;  // null unless scaled
  int64_t code;
};

// Scratch of one thread: scores, and the item's K/V rows as float32 when the cache stores them
// in another format (each row is read and converted once per item).
struct Scratch {
  std::vector<float> scores, k, v;
};

// Softmax pieces of rows [r0, r1) of one part, heads [h0, h0 + g), over the part's slots.
inline void attend_item(const float* q, const KVSource& k, const KVSource& v, int64_t n_slots_total,
                        int64_t h, int64_t d, const int64_t* rows, int64_t nr, const int64_t* slots,
                        int64_t ns, int64_t kvh, int64_t g, float scale, float* pm, float* pl,
                        float* po, Scratch& sc) {
  // Row j of the item as float32: in place for float32 caches, else converted once.
  const float* kbase = nullptr;
  const float* vbase = nullptr;
  const bool direct = k.code == kF32;
  if (direct) {
    kbase = reinterpret_cast<const float*>(k.data) + kvh * n_slots_total * d;
    vbase = reinterpret_cast<const float*>(v.data) + kvh * n_slots_total * d;
  } else {
    sc.k.resize(static_cast<size_t>(ns * d));
    sc.v.resize(static_cast<size_t>(ns * d));
    const int64_t es = kv_elem_size(k.code);
    for (int64_t j = 0; j < ns; ++j) {
      const int64_t at = kvh * n_slots_total + slots[j];
      load_row(k.code, k.data + at * d * es, k.scale ? k.scale[at] : 1.f, d, sc.k.data() + j * d);
      load_row(v.code, v.data + at * d * es, v.scale ? v.scale[at] : 1.f, d, sc.v.data() + j * d);
    }
  }
  const auto krow = [&](int64_t j) { return direct ? kbase + slots[j] * d : sc.k.data() + j * d; };
  const auto vrow = [&](int64_t j) { return direct ? vbase + slots[j] * d : sc.v.data() + j * d; };
  std::vector<float>& scores = sc.scores;
  const int64_t nq = nr * g;
  scores.resize(static_cast<size_t>(nq * ns));
  // scores[qi, j] = q . K[slot_j] * scale, slots outer so a K row is read once for all queries
  for (int64_t j = 0; j < ns; ++j) {
    const float* kr = krow(j);
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
      const float* vr = vrow(j);
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

// The step's plan: which thread computes which (part, KV head) item, and for each decode row
// the pieces it merges, in part order (the order the merge's float operations run in).
struct DecodePlan {
  int64_t b = 0, h = 0, d = 0, kvh = 0, g = 0, n = 0;
  const int64_t* ro = nullptr;  // rows_off [P + 1]
  const int64_t* rp = nullptr;  // rows
  const int64_t* so = nullptr;  // slots_off [P + 1]
  const int64_t* sp = nullptr;  // slots
  int64_t total_rows = 0;
  std::vector<std::vector<Item>> per_thread;
  std::vector<std::vector<int64_t>> row_pieces;
};

// Items go to threads largest first, each onto the least loaded thread (a static split would
// give one thread all the long shared segments).
inline DecodePlan make_plan(int64_t b, int64_t h, int64_t d, int64_t kvh, int64_t n, int64_t parts,
                            const int64_t* ro, const int64_t* rp, const int64_t* so,
                            const int64_t* sp, int64_t threads) {
  DecodePlan p;
  p.b = b, p.h = h, p.d = d, p.kvh = kvh, p.g = h / kvh, p.n = n;
  p.ro = ro, p.rp = rp, p.so = so, p.sp = sp, p.total_rows = ro[parts];
  std::vector<Item> items;
  for (int64_t part = 0; part < parts; ++part) {
    const int64_t nr = ro[part + 1] - ro[part], ns = so[part + 1] - so[part];
    if (nr == 0) continue;
    for (int64_t kh = 0; kh < kvh; ++kh) items.push_back({part, kh, nr * p.g * ns + ns * 2});
  }
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, static_cast<int64_t>(items.size())));
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& c) { return a.cost > c.cost; });
  p.per_thread.assign(threads, {});
  std::vector<int64_t> load(threads, 0);
  for (const Item& it : items) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    p.per_thread[t].push_back(it);
    load[t] += it.cost;
  }
  p.row_pieces.assign(b, {});
  for (int64_t i = 0; i < p.total_rows; ++i) p.row_pieces[rp[i]].push_back(i);
  return p;
}

// The items of thread t: softmax pieces into pm [total_rows, H], pl, po [total_rows, H, D].
inline void attend_thread(const DecodePlan& p, int64_t t, const float* q, const KVSource& k,
                          const KVSource& v, float scale, float* pm, float* pl, float* po,
                          Scratch& scratch) {
  if (t >= static_cast<int64_t>(p.per_thread.size())) return;
  for (const Item& it : p.per_thread[t]) {
    const int64_t r0 = p.ro[it.part], nr = p.ro[it.part + 1] - r0;
    const int64_t s0 = p.so[it.part], ns = p.so[it.part + 1] - s0;
    attend_item(q, k, v, p.n, p.h, p.d, p.rp + r0, nr, p.sp + s0, ns, it.kvh, p.g, scale,
                pm + r0 * p.h, pl + r0 * p.h, po + r0 * p.h * p.d, scratch);
  }
}

// Exact log-sum-exp merge of each row's pieces, rows [r0, r1): out [B, H, D]. Returns false if
// a row has no piece (it attended nothing).
inline bool merge_rows(const DecodePlan& p, int64_t r0, int64_t r1, const float* pm,
                       const float* pl, const float* po, float* out) {
  const int64_t h = p.h, d = p.d;
  for (int64_t row = r0; row < r1; ++row) {
    for (int64_t hh = 0; hh < h; ++hh) {
      float m = -std::numeric_limits<float>::infinity(), l = 0.f;
      float* o = out + (row * h + hh) * d;
      for (int64_t c = 0; c < d; ++c) o[c] = 0.f;
      for (int64_t i : p.row_pieces[row]) {
        const float m_new = std::max(m, pm[i * h + hh]);
        const float w_old = std::exp(m - m_new), w_part = std::exp(pm[i * h + hh] - m_new);
        l = l * w_old + pl[i * h + hh] * w_part;
        const float* oi = po + (i * h + hh) * d;
        for (int64_t c = 0; c < d; ++c) o[c] = o[c] * w_old + oi[c] * w_part;
        m = m_new;
      }
      if (!(l > 0.f)) return false;
      const float inv = 1.f / l;
      for (int64_t c = 0; c < d; ++c) o[c] *= inv;
    }
  }
  return true;
}

}  // namespace prefixcache
