// Attention on the integer units, over K/V stored as 16-bit integers (the int16 KV dtype):
// the exact path's attention when the cache holds int16 (the default there since 2026-12-05).
//
// Every query keeps the float path's structure (exact_attention.h): keys in blocks of 32 from
// position 0, one online softmax per query, the block's weights folded into a running output.
// What moves to the integer units are the two products:
//
//   scores  dot_j = sum_d q_d k_jd in int32: q rounded per (token, head) to |q| <= Q(D), K as
//           stored (|k| <= 4095), with Q(D) the widest that keeps D * Q * 4095 < 2^31 (8191 for
//           head_dim 64, 4095 for 128, 2047 for 256); then s_j = (float(dot_j) * sk_j) *
//           (sq * scale), one fixed float sequence.
//   values  per (query, block), w_j = p_j sv_j (the softmax weight times V's scale) rounded to
//           u_j in [0, 16383] against the block's largest w, acc_d = sum_j u_j v_jd in int32
//           (32 * 16383 * 4095 < 2^31), and o_d = o_d * w_old + float(acc_d) * (max w / 16383).
//
// The pool stores int16 K/V in units of 16 slots already in the layouts these products read
// (kv_codec.h), so attention reads them in place: no copy or transposition per block, which
// matters most for decodes (a block of keys serves only a KV head's few queries there).
//
// Integer sums are exact, so they do not depend on the ISA, the blocking or which queries share
// a pass: the AVX512-VNNI path (vpdpwssd, 32 multiply-adds an instruction) and the AVX2 path
// (vpmaddwd + vpaddd) give the same int32. The float steps around them run on ymm (AVX2) or zmm
// (AVX512 hosts) with the same roundings lane by lane (where zmm uses another instruction, as
// vscalefps for the multiply by 2^n, it rounds the same exact product once) and the one
// order-dependent sum in the same order, so they agree too. Steps whose result is known exactly
// are skipped on both: the rescale when a block leaves the maximum where it was (2^0 = 1, o * 1
// = o) and, on zmm, the masks of a block every key of which the query sees. So a token's output
// is the same bits in any chunk, batch, decode, thread count or ISA path: the exact path's
// contract (docs/design.md section 2).
//
// Quality (benchmarks/probes/attention_quant_quality.py): 13-bit K/V, 12-bit q and 14-bit weights
// are each far finer than int8's 8 bits, which missed the 1e-3 KL floor at 2k-token contexts.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "exact_attention.h"
#include "kv_codec.h"

namespace prefixcache::exact {

// |q| after rounding: the widest that keeps d * |q| * 4095 < 2^31 (the scores' int32 sums)
inline float query_max(int64_t d) { return d <= 64 ? 8191.f : d <= 128 ? 4095.f : 2047.f; }
constexpr float kUMax = 16383.f;  // value weights u in [0, kUMax]
constexpr int64_t kIsaAvx2 = 1, kIsaVnni = 2;  // int_gemm.h's codes (3, AMX, runs the VNNI path here)

// One block of 32 keys as the integer products read it: two 16-slot units of the int16 pool
// (kv_codec.h), keys 0-15 and 16-31, in place. K: [D / 2][16] int32 pairs; V: [8][D] int32
// pairs; the scales 16 floats each. A block of 16 keys or fewer reads zeros for its second unit.
struct Units {
  const int32_t* k[2];
  const int32_t* v[2];
  const float* sk[2];
  const float* sv[2];
};

// A query rounded for the integer scores: pairs of int16 as int32 (d / 2 of them) and the float
// that turns float(dot) * sk into a score.
inline float quantize_query(const float* q, int64_t d, float scale, int32_t* pairs) {
  const float qmax = query_max(d);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(q + i)));
  const float sq = std::max(hmax(vmax) / qmax, FLT_MIN);
  const __m256 vs = _mm256_set1_ps(sq), hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
  auto* out = reinterpret_cast<int16_t*>(pairs);
  for (int64_t i = 0; i < d; i += 16) {
    __m256 a = _mm256_div_ps(_mm256_loadu_ps(q + i), vs), b = _mm256_div_ps(_mm256_loadu_ps(q + i + 8), vs);
    a = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
    b = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
    const __m256i p = _mm256_packs_epi32(_mm256_cvttps_epi32(a), _mm256_cvttps_epi32(b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_permute4x64_epi64(p, 0xD8));
  }
  return sq * scale;
}

// ---- the integer products, per ISA; NQ queries share each load ---------------------------------

// Up to four int32 accumulators of 8 lanes for the AVX2 products, in named members: GCC 12 keeps
// an array of __m256i accumulators in registers but copies each one every iteration (vpaddd into
// the product's register, then vmovdqa back: 8 extra instructions per 16 vpmaddwd, which made the
// loops dispatch-bound on Zen 3; measured in the kernels' disassembly). The two product loops are
// kept out of line (noinline): inlined into attend_rows_int, GCC brought the copies back in one
// of their inlined instances.
template <int NV>
struct Acc8 {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  // a_c += x_c . b (vpmaddwd: pairs of int16 products summed into int32), c < NV
  inline void madd(__m256i x0, __m256i x1, __m256i x2, __m256i x3, __m256i b) {
    a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(x0, b));
    if constexpr (NV > 1) a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(x1, b));
    if constexpr (NV > 2) a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(x2, b));
    if constexpr (NV > 3) a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(x3, b));
  }
  inline void store(int32_t* dst) const {
    __m256i* p = reinterpret_cast<__m256i*>(dst);
    _mm256_storeu_si256(p, a0);
    if constexpr (NV > 1) _mm256_storeu_si256(p + 1, a1);
    if constexpr (NV > 2) _mm256_storeu_si256(p + 2, a2);
    if constexpr (NV > 3) _mm256_storeu_si256(p + 3, a3);
  }
};

// dot[i][j] for NQ (1 or 2) queries and the block's 32 keys (AVX2: vpmaddwd pairs summed by vpaddd).
template <int NQ>
__attribute__((noinline)) void scores_avx2(const Units& u, int64_t pairs, const int32_t* const* q, int32_t* const* dot) {
  static_assert(NQ == 1 || NQ == 2);
  Acc8<4> x, y;
  const int32_t* ka = u.k[0];
  const int32_t* kb = u.k[1];
  for (int64_t p = 0; p < pairs; ++p, ka += kUnit, kb += kUnit) {
    const __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ka));
    const __m256i k1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ka) + 1);
    const __m256i k2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb));
    const __m256i k3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb) + 1);
    x.madd(k0, k1, k2, k3, _mm256_set1_epi32(q[0][p]));
    if constexpr (NQ == 2) y.madd(k0, k1, k2, k3, _mm256_set1_epi32(q[1][p]));
  }
  x.store(dot[0]);
  if constexpr (NQ == 2) y.store(dot[1]);
}

// The same for the VNNI products: up to four int32 accumulators of 16 lanes in named members.
// Held in arrays (__m512i a[NQ][NV]), GCC 12 copied every zmm accumulator after each vpdpwssd
// (two vmovdqa a product: 33 instructions for 8 vpdpwssd in the scores loop; measured in the
// kernels' disassembly), as it did the AVX2 loops'. Members are zeroed by zero(): a default
// member initializer would put an AVX-512 instruction in a constructor built for AVX2.
template <int NV>
struct Acc16 {
  __m512i a0, a1, a2, a3;
  __attribute__((target("avx512f"))) inline void zero() {
    a0 = _mm512_setzero_si512();
    a1 = a0, a2 = a0, a3 = a0;
  }
  // a_c += x_c . b (vpdpwssd: pairs of int16 products summed into int32), c < NV
  __attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void madd(__m512i x0, __m512i x1, __m512i x2,
                                                                           __m512i x3, __m512i b) {
    a0 = _mm512_dpwssd_epi32(a0, x0, b);
    if constexpr (NV > 1) a1 = _mm512_dpwssd_epi32(a1, x1, b);
    if constexpr (NV > 2) a2 = _mm512_dpwssd_epi32(a2, x2, b);
    if constexpr (NV > 3) a3 = _mm512_dpwssd_epi32(a3, x3, b);
  }
  __attribute__((target("avx512f"))) inline void store(int32_t* dst) const {
    _mm512_storeu_si512(dst, a0);
    if constexpr (NV > 1) _mm512_storeu_si512(dst + 16, a1);
    if constexpr (NV > 2) _mm512_storeu_si512(dst + 32, a2);
    if constexpr (NV > 3) _mm512_storeu_si512(dst + 48, a3);
  }
};

// dot[i][j] for NQ (1 to 4) queries and the block's 32 keys (VNNI: vpdpwssd).
template <int NQ>
__attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) void scores_vnni(const Units& u, int64_t pairs,
                                                                                   const int32_t* const* q,
                                                                                   int32_t* const* dot) {
  static_assert(NQ >= 1 && NQ <= 4);
  Acc16<2> x, y, z, w;
  x.zero(), y.zero(), z.zero(), w.zero();
  const __m512i none = _mm512_setzero_si512();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i k0 = _mm512_loadu_si512(u.k[0] + p * kUnit), k1 = _mm512_loadu_si512(u.k[1] + p * kUnit);
    x.madd(k0, k1, none, none, _mm512_set1_epi32(q[0][p]));
    if constexpr (NQ > 1) y.madd(k0, k1, none, none, _mm512_set1_epi32(q[1][p]));
    if constexpr (NQ > 2) z.madd(k0, k1, none, none, _mm512_set1_epi32(q[2][p]));
    if constexpr (NQ > 3) w.madd(k0, k1, none, none, _mm512_set1_epi32(q[3][p]));
  }
  x.store(dot[0]);
  if constexpr (NQ > 1) y.store(dot[1]);
  if constexpr (NQ > 2) z.store(dot[2]);
  if constexpr (NQ > 3) w.store(dot[3]);
}

// The value products and the fold into the running output, per query i, from the accumulators'
// registers: acc_d = sum over key pairs jp < npairs of u[i][jp] . vp[jp][d] (exact int32), then
// o_d = o_d * w_old + float(acc_d) * us. o * 1 is o exactly, so an unmoved maximum (w_old == 1)
// skips that multiply: the same bits. The same operations lane by lane on ymm and zmm, so the
// same bits on every path. Run as a pass of its own after the products (until 2026-12-08), the
// fold stored and reloaded every accumulator: 0.46 cycles a query-key pair on a Zen 4 against
// ~0.1 here (benchmarks/probes/attention_phases.cpp; docs/benchmarks-journal.md).
template <int NV>
inline void fold_acc8(const Acc8<NV>& a, float* o, float w_old, float us) {
  const __m256 vw = _mm256_set1_ps(w_old), vu = _mm256_set1_ps(us);
  const bool keep = w_old == 1.f;
  const __m256i r[4] = {a.a0, a.a1, a.a2, a.a3};
  for (int c = 0; c < NV; ++c) {
    const __m256 oc = _mm256_loadu_ps(o + 8 * c);
    _mm256_storeu_ps(o + 8 * c, _mm256_add_ps(keep ? oc : _mm256_mul_ps(oc, vw), _mm256_mul_ps(_mm256_cvtepi32_ps(r[c]), vu)));
  }
}

template <int NV>
__attribute__((target("avx512f"))) inline void fold_acc16(const Acc16<NV>& a, float* o, float w_old, float us) {
  const __m512 vw = _mm512_set1_ps(w_old), vu = _mm512_set1_ps(us);
  const bool keep = w_old == 1.f;
  const __m512i r[4] = {a.a0, a.a1, a.a2, a.a3};
  for (int c = 0; c < NV; ++c) {
    const __m512 oc = _mm512_loadu_ps(o + 16 * c);
    _mm512_storeu_ps(o + 16 * c, _mm512_add_ps(keep ? oc : _mm512_mul_ps(oc, vw), _mm512_mul_ps(_mm512_cvtepi32_ps(r[c]), vu)));
  }
}

// o[i][c0 .. c0 + 8 NV) for NQ (1 or 2) queries (AVX2: vpmaddwd pairs summed by vpaddd). A
// unit's 8 key pairs are rows d int32 apart: one pointer steps through them.
template <int NQ, int NV>
__attribute__((noinline)) void values_fold_avx2(const Units& un, int64_t d, int64_t c0, int64_t npairs,
                                                const int32_t* const* u, float* const* o, const float* w_old,
                                                const float* us) {
  static_assert(NQ == 1 || NQ == 2);
  Acc8<NV> x, y;
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t j0 = 0; j0 < npairs; j0 += 8) {
    const int32_t* row = un.v[j0 >> 3] + c0;
    const int64_t je = std::min<int64_t>(npairs, j0 + 8);
    for (int64_t jp = j0; jp < je; ++jp, row += d) {
      const __m256i* r = reinterpret_cast<const __m256i*>(row);
      const __m256i v0 = _mm256_loadu_si256(r);
      const __m256i v1 = NV > 1 ? _mm256_loadu_si256(r + 1) : zero;
      const __m256i v2 = NV > 2 ? _mm256_loadu_si256(r + 2) : zero;
      const __m256i v3 = NV > 3 ? _mm256_loadu_si256(r + 3) : zero;
      x.madd(v0, v1, v2, v3, _mm256_set1_epi32(u[0][jp]));
      if constexpr (NQ == 2) y.madd(v0, v1, v2, v3, _mm256_set1_epi32(u[1][jp]));
    }
  }
  fold_acc8<NV>(x, o[0] + c0, w_old[0], us[0]);
  if constexpr (NQ == 2) fold_acc8<NV>(y, o[1] + c0, w_old[1], us[1]);
}

// The same for NQ (1 to 4) queries on the VNNI products, o[i][c0 .. c0 + 16 NV).
template <int NQ, int NV>
__attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) void values_fold_vnni(
    const Units& un, int64_t d, int64_t c0, int64_t npairs, const int32_t* const* u, float* const* o,
    const float* w_old, const float* us) {
  static_assert(NQ >= 1 && NQ <= 4);
  Acc16<NV> x, y, z, w;
  x.zero(), y.zero(), z.zero(), w.zero();
  const __m512i none = _mm512_setzero_si512();
  for (int64_t jp = 0; jp < npairs; ++jp) {
    const int32_t* row = un.v[jp >> 3] + (jp & 7) * d + c0;
    const __m512i v0 = _mm512_loadu_si512(row);
    const __m512i v1 = NV > 1 ? _mm512_loadu_si512(row + 16) : none;
    const __m512i v2 = NV > 2 ? _mm512_loadu_si512(row + 32) : none;
    const __m512i v3 = NV > 3 ? _mm512_loadu_si512(row + 48) : none;
    x.madd(v0, v1, v2, v3, _mm512_set1_epi32(u[0][jp]));
    if constexpr (NQ > 1) y.madd(v0, v1, v2, v3, _mm512_set1_epi32(u[1][jp]));
    if constexpr (NQ > 2) z.madd(v0, v1, v2, v3, _mm512_set1_epi32(u[2][jp]));
    if constexpr (NQ > 3) w.madd(v0, v1, v2, v3, _mm512_set1_epi32(u[3][jp]));
  }
  fold_acc16<NV>(x, o[0] + c0, w_old[0], us[0]);
  if constexpr (NQ > 1) fold_acc16<NV>(y, o[1] + c0, w_old[1], us[1]);
  if constexpr (NQ > 2) fold_acc16<NV>(z, o[2] + c0, w_old[2], us[2]);
  if constexpr (NQ > 3) fold_acc16<NV>(w, o[3] + c0, w_old[3], us[3]);
}

// The products of up to kGroupQ queries (n of them) on the ISA's path. The queries' pointers
// past n are never read.
constexpr int kGroupQ = 4;
constexpr int64_t kPhaseQ = 32;  // queries per phase of attend_rows_int (measured: 16, 32, 96: 32 fastest)

template <int NQ>
inline void scores_n(int64_t isa, const Units& un, int64_t pairs, const int32_t* const* q, int32_t* const* dot) {
  if (isa >= kIsaVnni) {
    scores_vnni<NQ>(un, pairs, q, dot);
  } else {  // 16 ymm registers: two queries at a time
    scores_avx2<(NQ >= 2 ? 2 : 1)>(un, pairs, q, dot);
    if constexpr (NQ == 3) scores_avx2<1>(un, pairs, q + 2, dot + 2);
    if constexpr (NQ == 4) scores_avx2<2>(un, pairs, q + 2, dot + 2);
  }
}

inline void block_scores_int(int64_t isa, const Units& un, int64_t pairs, int n, const int32_t* const* q,
                             int32_t* const* dot) {
  switch (n) {
    case 4: scores_n<4>(isa, un, pairs, q, dot); break;
    case 3: scores_n<3>(isa, un, pairs, q, dot); break;
    case 2: scores_n<2>(isa, un, pairs, q, dot); break;
    default: scores_n<1>(isa, un, pairs, q, dot); break;
  }
}

template <int NQ>
inline void values_fold_n(int64_t isa, const Units& vp, int64_t d, int64_t npairs, const int32_t* const* u,
                          float* const* o, const float* w_old, const float* us) {
  if (isa >= kIsaVnni) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      switch (std::min<int64_t>(4, (d - c0) / 16)) {
        case 4: values_fold_vnni<NQ, 4>(vp, d, c0, npairs, u, o, w_old, us); break;
        case 3: values_fold_vnni<NQ, 3>(vp, d, c0, npairs, u, o, w_old, us); break;
        case 2: values_fold_vnni<NQ, 2>(vp, d, c0, npairs, u, o, w_old, us); break;
        default: values_fold_vnni<NQ, 1>(vp, d, c0, npairs, u, o, w_old, us); break;
      }
    }
  } else {
    for (int q0 = 0; q0 < NQ; q0 += 2) {
      const int m = std::min(2, NQ - q0);
      const int32_t* const* uq = u + q0;
      float* const* oq = o + q0;
      for (int64_t c0 = 0; c0 < d; c0 += 32) {
        const int64_t nv = std::min<int64_t>(4, (d - c0) / 8);
        if (m == 2) {
          switch (nv) {
            case 4: values_fold_avx2<2, 4>(vp, d, c0, npairs, uq, oq, w_old + q0, us + q0); break;
            case 3: values_fold_avx2<2, 3>(vp, d, c0, npairs, uq, oq, w_old + q0, us + q0); break;
            case 2: values_fold_avx2<2, 2>(vp, d, c0, npairs, uq, oq, w_old + q0, us + q0); break;
            default: values_fold_avx2<2, 1>(vp, d, c0, npairs, uq, oq, w_old + q0, us + q0); break;
          }
        } else {
          switch (nv) {
            case 4: values_fold_avx2<1, 4>(vp, d, c0, npairs, uq, oq, w_old + q0, us + q0); break;
            case 3: values_fold_avx2<1, 3>(vp, d, c0, npairs, uq, oq, w_old + q0, us + q0); break;
            case 2: values_fold_avx2<1, 2>(vp, d, c0, npairs, uq, oq, w_old + q0, us + q0); break;
            default: values_fold_avx2<1, 1>(vp, d, c0, npairs, uq, oq, w_old + q0, us + q0); break;
          }
        }
      }
    }
  }
}

// n (<= kGroupQ) queries' value products over a block's first npairs key pairs, folded into
// their running outputs o[i] with their rescales w_old[i] and units us[i].
inline void block_values_fold_int(int64_t isa, const Units& vp, int64_t d, int64_t npairs, int n,
                                  const int32_t* const* u, float* const* o, const float* w_old, const float* us) {
  switch (n) {
    case 4: values_fold_n<4>(isa, vp, d, npairs, u, o, w_old, us); break;
    case 3: values_fold_n<3>(isa, vp, d, npairs, u, o, w_old, us); break;
    case 2: values_fold_n<2>(isa, vp, d, npairs, u, o, w_old, us); break;
    default: values_fold_n<1>(isa, vp, d, npairs, u, o, w_old, us); break;
  }
}

// ---- the float steps around them (one AVX2 build for every path) --------------------------------

// 2^x for lanes x <= 0, relative error ~2e-6 (far below the value weights' 14 bits): x = n + f
// with n = round(x) and |f| <= 1/2 exact, 2^f by its Taylor polynomial of degree 5, 2^n put into
// the exponent bits. x is clamped to -126 first (2^n stays a normal float; -inf gives 2^-126, a
// weight the callers mask to 0 where it matters).
inline __m256 exp2_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.3333558e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 2^(m - m_new), the running output's rescale: exactly 1 when the maximum did not move (as
// exp2_neg computes 2^0: the polynomial's last step is 0 * p + 1), so most blocks skip it.
inline float rescale(float m, float m_new) {
  return m_new == m ? 1.f : _mm256_cvtss_f32(exp2_neg(_mm256_set1_ps(m - m_new)));
}

// The keys of vector c (8 keys from 8c) that a query sees: from <= j < visible, all ones there.
inline __m256i keep256(int64_t from, int64_t visible, int c) {
  const __m256i vis = _mm256_set1_epi32(static_cast<int32_t>(visible));
  const __m256i fr = _mm256_set1_epi32(static_cast<int32_t>(from) - 1);
  const __m256i j = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * c));
  return _mm256_and_si256(_mm256_cmpgt_epi32(vis, j), _mm256_cmpgt_epi32(j, fr));
}

// u_j = round(w_j * r) as int16 pairs in key order (the block's 32 weights in four vectors).
inline void store_weights256(const __m256* w, __m256 r, int32_t* u32) {
  __m256i q[4];
  for (int c = 0; c < 4; ++c)
    q[c] = _mm256_cvttps_epi32(_mm256_round_ps(_mm256_mul_ps(w[c], r), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // int32 -> int16 in key order: packs interleaves the 128-bit lanes, permute4x64 restores them
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u32), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u32 + 8), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
}

// One query's step over one block, from its integer scores: the online softmax in base 2 and the
// block's value weights.
//   z_j = (float(dot_j) * sk_j) * qa2 for keys from <= j < visible (qa2 = sq * scale * log2 e),
//   -inf elsewhere (from > 0: the keys before a sliding window)
//   m' = max(m, max_j z_j); p_j = 2^(z_j - m') (0 past visible); l = l * 2^(m - m') + sum_j p_j
//   w_j = p_j sv_j; u_j = round(w_j * (16383 / max w)) as pairs (keys 2jp, 2jp + 1) in u32[jp]
// Returns 2^(m - m'), the factor the running output is rescaled by; us = max w / 16383, the float
// one unit of u stands for (0, with u all 0, when every weight is 0).
// Full: every key of the block visible (no window start, no future), so no masks: masking with
// all ones is the identity, so the same values (as softmax_weights512<true>).
template <bool Full>
inline float softmax_weights(const int32_t* dot, const Units& un, float qa2, int64_t from, int64_t visible,
                             float& m, float& l, int32_t* u32, float& us) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), va = _mm256_set1_ps(qa2);
  __m256 z[4], keep[4];
  __m256 bm = ninf;
  for (int c = 0; c < 4; ++c) {
    const __m256 t = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dot + 8 * c)));
    const __m256 sk = _mm256_loadu_ps(un.sk[c >> 1] + 8 * (c & 1));
    z[c] = _mm256_mul_ps(_mm256_mul_ps(t, sk), va);
    if constexpr (!Full) {
      keep[c] = _mm256_castsi256_ps(keep256(from, visible, c));
      z[c] = _mm256_blendv_ps(ninf, z[c], keep[c]);
    }
    bm = _mm256_max_ps(bm, z[c]);
  }
  const float m_new = std::max(m, hmax(bm));
  const float w_old = rescale(m, m_new);
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 p[4], w[4];
  __m256 sum = _mm256_setzero_ps(), wm = _mm256_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    p[c] = exp2_neg(_mm256_sub_ps(z[c], vm));
    w[c] = _mm256_mul_ps(p[c], _mm256_loadu_ps(un.sv[c >> 1] + 8 * (c & 1)));
    if constexpr (!Full) {
      // masked again: a slot past the context may hold any bytes, its scale a NaN (0 * NaN)
      p[c] = _mm256_and_ps(p[c], keep[c]);
      w[c] = _mm256_and_ps(w[c], keep[c]);
    }
    wm = _mm256_max_ps(wm, w[c]);
  }
  sum = _mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3]));
  l = l * w_old + hsum(sum);
  m = m_new;
  const float mx = hmax(wm);
  if (!(mx > 0.f)) {
    std::memset(u32, 0, kKeys / 2 * sizeof(int32_t));
    us = 0.f;
    return w_old;
  }
  store_weights256(w, _mm256_set1_ps(kUMax / mx), u32);
  us = mx * (1.f / kUMax);
  return w_old;
}

// exp2_neg and softmax_weights on zmm (AVX512 hosts): the same operations lane by lane, and the
// one order-dependent reduction (the sum of p) in the AVX2 code's order, so the same bits.
__attribute__((target("avx512f"))) inline __m512 exp2_neg512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  // p 2^n in one instruction: vscalefps rounds p x 2^n once, as the AVX2 code's multiply by
  // the power of two built in the exponent bits does (n is an integer in [-126, 0])
  return _mm512_scalef_ps(p, n);
}

// The maximum of v's 16 lanes in every lane (max is exact: any order gives the same value).
__attribute__((target("avx512f"))) inline __m512 lanes_max(__m512 v) {
  v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = _mm512_max_ps(v, _mm512_permute_ps(v, 0x4E));
  return _mm512_max_ps(v, _mm512_permute_ps(v, 0xB1));
}

__attribute__((target("avx512f,avx512dq"))) inline __m256 halves_add(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// The keys of unit c (16 keys from 16c) that a query sees: from <= j < visible.
__attribute__((target("avx512f"))) inline __mmask16 keep512(int64_t from, int64_t visible, int c) {
  const __m512i vis = _mm512_set1_epi32(static_cast<int32_t>(visible));
  const __m512i fr = _mm512_set1_epi32(static_cast<int32_t>(from) - 1);
  const __m512i j = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_epi32(16 * c));
  return _mm512_cmpgt_epi32_mask(vis, j) & _mm512_cmpgt_epi32_mask(j, fr);
}

// u_j = round(w_j * r) as int16 pairs in key order (the block's 32 weights in two units).
__attribute__((target("avx512f,avx512bw"))) inline void store_weights512(__m512 w0, __m512 w1, __m512 r, int32_t* u32) {
  const __m512 w[2] = {w0, w1};
  for (int c = 0; c < 2; ++c) {
    const __m512i q = _mm512_cvttps_epi32(
        _mm512_roundscale_ps(_mm512_mul_ps(w[c], r), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u32 + 8 * c), _mm512_cvtsepi32_epi16(q));
  }
}

// Full: every key of the block visible (no window start, no future), so no masks (the same
// values: masking with all ones is the identity).
template <bool Full>
__attribute__((target("avx512f,avx512bw,avx512dq"))) inline float softmax_weights512(
    const int32_t* dot, const Units& un, float qa2, int64_t from, int64_t visible, float& m, float& l,
    int32_t* u32, float& us) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), va = _mm512_set1_ps(qa2);
  __m512 z[2];
  __mmask16 keep[2] = {0xFFFF, 0xFFFF};
  for (int c = 0; c < 2; ++c) {  // keys 16c .. 16c + 15: unit c
    const __m512 t = _mm512_cvtepi32_ps(_mm512_load_si512(dot + 16 * c));
    z[c] = _mm512_mul_ps(_mm512_mul_ps(t, _mm512_loadu_ps(un.sk[c])), va);
    if constexpr (!Full) {
      keep[c] = keep512(from, visible, c);
      z[c] = _mm512_mask_blend_ps(keep[c], ninf, z[c]);
    }
  }
  const __m512 vm = _mm512_max_ps(_mm512_set1_ps(m), lanes_max(_mm512_max_ps(z[0], z[1])));
  const float m_new = _mm512_cvtss_f32(vm);
  const float w_old = rescale(m, m_new);
  __m512 p[2], w[2];
  for (int c = 0; c < 2; ++c) {
    p[c] = exp2_neg512(_mm512_sub_ps(z[c], vm));
    w[c] = _mm512_mul_ps(p[c], _mm512_loadu_ps(un.sv[c]));
    if constexpr (!Full) {
      p[c] = _mm512_maskz_mov_ps(keep[c], p[c]);
      w[c] = _mm512_maskz_mov_ps(keep[c], w[c]);
    }
  }
  // (keys 0-7 + 8-15) + (16-23 + 24-31), as softmax_weights adds them
  l = l * w_old + hsum(_mm256_add_ps(halves_add(p[0]), halves_add(p[1])));
  m = m_new;
  const float mx = _mm512_cvtss_f32(lanes_max(_mm512_max_ps(w[0], w[1])));
  if (!(mx > 0.f)) {
    std::memset(u32, 0, kKeys / 2 * sizeof(int32_t));
    us = 0.f;
    return w_old;
  }
  store_weights512(w[0], w[1], _mm512_set1_ps(kUMax / mx), u32);
  us = mx * (1.f / kUMax);
  return w_old;
}

// softmax_weights512 for up to 16 queries at once, the same bits per query. Called one query at
// a time, the step was a ~130-cycle chain of dependent operations (two 16-lane maximum trees, the
// rescale's branch, a division, the sum tree), of which the out-of-order core overlapped little:
// 2.4 cycles per query-key pair alone against 2.1 for the scores' products on a Zen 4
// (docs/benchmarks-journal.md "The softmax across queries, and a pool whose join waits only for
// its participants"; benchmarks/probes/attention_phases.cpp). Here the per-query work is only the
// lane-wise parts; the three reductions (the block's maximum score, the sum of p, the largest
// weight) run transposed: level 1 folds a query's two vectors of 16 keys into one (its 32 values
// as 16 partials), then levels 2-5 (reduce16) fold 16 queries' partials into one vector, a lane a
// query. Each query's sum keeps softmax_weights' tree: level 1 is halves_add on each unit,
// level 2 adds the two units' halves, levels 3-5 are hsum's three steps; float addition is
// commutative, so only that grouping matters, and it is the same. Maxima need no order. The
// scalars become lanes: the rescale 2^(m - m') (1 where the maximum stayed, as rescale()), l * w
// + sum, the division kUMax / max w, each the same IEEE operation per lane.
//
struct MaxOp512 {
  __attribute__((target("avx512f"))) __m512 operator()(__m512 a, __m512 b) const { return _mm512_max_ps(a, b); }
};
struct AddOp512 {
  __attribute__((target("avx512f"))) __m512 operator()(__m512 a, __m512 b) const { return _mm512_add_ps(a, b); }
};

// Level 1 of a query's two vectors a, b: lanes 0-7 fold a's halves, lanes 8-15 b's.
template <typename Op>
__attribute__((target("avx512f"))) inline __m512 fold_units(__m512 a, __m512 b, Op op) {
  return op(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}

// Levels 2-5: h[q] holds query q's 16 partials after fold_units; returns lane q = query q's
// result. Level 2 pairs queries (2i, 2i + 1) and adds lanes i to lanes 8 + i of each (the two
// units); level 3 leaves query k's four partials in 128-bit chunk k of four queries' vector;
// levels 4 and 5 fold within chunks (lanes 0 + 2 and 1 + 3, then 0 + 1: hsum's order), which
// leaves query k + 4j in lane 4k + j, put back in order by one permutation.
template <typename Op>
__attribute__((target("avx512f"))) inline __m512 reduce16(const __m512* h, Op op) {
  __m512 c[8], s[4], x[2];
  for (int i = 0; i < 8; ++i)
    c[i] = op(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x44), _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    s[i] = op(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    x[i] = op(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44), _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
  const __m512 r = op(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// Per-phase buffers of softmax_weights16 and softmax_weights8 (64-byte aligned inside IntScratch).
struct SoftmaxGroupBuf {
  alignas(64) float z[16][kKeys];
  alignas(64) float w[16][kKeys];
  alignas(64) float m_new[16];
  alignas(64) float r[16];
  alignas(64) float mx[16];
};

// Queries 0 .. n - 1 (n <= 16): dot[i] their 32 integer scores, qa2[i], from[i] and visible[i]
// as softmax_weights takes them; m, l, w_old, us arrays of n (in and out as its arguments are);
// u[i] the query's 16 value-weight pairs.
__attribute__((target("avx512f,avx512bw,avx512dq"))) inline void softmax_weights16(
    const int32_t* const* dot, const Units& un, const float* qa2, const int64_t* from, const int64_t* visible,
    int n, float* m, float* l, float* w_old, float* us, int32_t* const* u, SoftmaxGroupBuf& b) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 sk0 = _mm512_loadu_ps(un.sk[0]), sk1 = _mm512_loadu_ps(un.sk[1]);
  const __m512 sv0 = _mm512_loadu_ps(un.sv[0]), sv1 = _mm512_loadu_ps(un.sv[1]);
  const MaxOp512 max_op;
  const AddOp512 add_op;
  __mmask16 keep[16][2];
  __m512 h[16];
  for (int i = 0; i < n; ++i) {
    const __m512 va = _mm512_set1_ps(qa2[i]);
    __m512 z0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dot[i])), sk0), va);
    __m512 z1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dot[i] + 16)), sk1), va);
    if (from[i] == 0 && visible[i] == kKeys) {
      keep[i][0] = keep[i][1] = 0xFFFF;
    } else {
      keep[i][0] = keep512(from[i], visible[i], 0);
      keep[i][1] = keep512(from[i], visible[i], 1);
      z0 = _mm512_mask_blend_ps(keep[i][0], ninf, z0);
      z1 = _mm512_mask_blend_ps(keep[i][1], ninf, z1);
    }
    _mm512_store_ps(b.z[i], z0);
    _mm512_store_ps(b.z[i] + 16, z1);
    h[i] = fold_units(z0, z1, max_op);
  }
  for (int i = n; i < 16; ++i) h[i] = ninf;
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
  const __m512 m_old = _mm512_mask_loadu_ps(ninf, live, m);
  const __m512 m_new = _mm512_max_ps(m_old, reduce16(h, max_op));
  // rescale(): 1 where the maximum stayed (-inf to -inf included), else 2^(m - m')
  const __m512 wo = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_old, m_new, _CMP_EQ_OQ),
                                         exp2_neg512(_mm512_sub_ps(m_old, m_new)), _mm512_set1_ps(1.f));
  _mm512_store_ps(b.m_new, m_new);
  __m512 hw[16];
  for (int i = 0; i < n; ++i) {
    const __m512 vm = _mm512_set1_ps(b.m_new[i]);
    __m512 p0 = exp2_neg512(_mm512_sub_ps(_mm512_load_ps(b.z[i]), vm));
    __m512 p1 = exp2_neg512(_mm512_sub_ps(_mm512_load_ps(b.z[i] + 16), vm));
    __m512 w0 = _mm512_mul_ps(p0, sv0), w1 = _mm512_mul_ps(p1, sv1);
    // masked again: a slot past the context may hold any bytes, its scale a NaN (0 * NaN)
    if (keep[i][0] != 0xFFFF || keep[i][1] != 0xFFFF) {  // (all ones: the identity)
      p0 = _mm512_maskz_mov_ps(keep[i][0], p0), p1 = _mm512_maskz_mov_ps(keep[i][1], p1);
      w0 = _mm512_maskz_mov_ps(keep[i][0], w0), w1 = _mm512_maskz_mov_ps(keep[i][1], w1);
    }
    _mm512_store_ps(b.w[i], w0);
    _mm512_store_ps(b.w[i] + 16, w1);
    h[i] = fold_units(p0, p1, add_op);
    hw[i] = fold_units(w0, w1, max_op);
  }
  for (int i = n; i < 16; ++i) h[i] = hw[i] = _mm512_setzero_ps();
  const __m512 sum = reduce16(h, add_op), mx = reduce16(hw, max_op);
  const __m512 l_new = _mm512_add_ps(_mm512_mul_ps(_mm512_mask_loadu_ps(_mm512_setzero_ps(), live, l), wo), sum);
  const __mmask16 pos = _mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ);
  _mm512_mask_storeu_ps(m, live, m_new);
  _mm512_mask_storeu_ps(l, live, l_new);
  _mm512_mask_storeu_ps(w_old, live, wo);
  _mm512_mask_storeu_ps(us, live, _mm512_maskz_mul_ps(pos, mx, _mm512_set1_ps(1.f / kUMax)));
  _mm512_store_ps(b.r, _mm512_div_ps(_mm512_set1_ps(kUMax), mx));
  _mm512_store_ps(b.mx, mx);
  for (int i = 0; i < n; ++i) {
    if (!(b.mx[i] > 0.f)) {  // every weight 0
      std::memset(u[i], 0, kKeys / 2 * sizeof(int32_t));
      continue;
    }
    store_weights512(_mm512_load_ps(b.w[i]), _mm512_load_ps(b.w[i] + 16), _mm512_set1_ps(b.r[i]), u[i]);
  }
}

// softmax_weights for up to 8 queries at once on AVX2 (ymm), the same bits per query: as
// softmax_weights16 on zmm, the lane-wise parts per query and the three reductions transposed
// across the queries (a query a lane), the sum in hsum's tree. Per query its four vectors fold
// first as softmax_weights folds them ((p0 + p1) + (p2 + p3); maxima in any order), then
// reduce8: level 1 adds each query's 128-bit halves (hsum's first step), level 2 its lanes 0 + 2
// and 1 + 3, level 3 those two; that leaves queries 0, 2, 4, 6 in the low half and 1, 3, 5, 7 in
// the high half, put back in order by one permutation.
template <typename Op>
inline __m256 reduce8(const __m256* h, Op op) {
  __m256 s[4], x[2];
  for (int i = 0; i < 4; ++i)
    s[i] = op(_mm256_permute2f128_ps(h[2 * i], h[2 * i + 1], 0x20), _mm256_permute2f128_ps(h[2 * i], h[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)
    x[i] = op(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44), _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
  // low half: queries 0, 2, 4, 6; high half: 1, 3, 5, 7
  const __m256 r = op(_mm256_shuffle_ps(x[0], x[1], 0x88), _mm256_shuffle_ps(x[0], x[1], 0xDD));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

struct MaxOp256 {
  __m256 operator()(__m256 a, __m256 b) const { return _mm256_max_ps(a, b); }
};
struct AddOp256 {
  __m256 operator()(__m256 a, __m256 b) const { return _mm256_add_ps(a, b); }
};

// Queries 0 .. n - 1 (n <= 8), arguments as softmax_weights16's (b: its buffers, the first 8 rows).
inline void softmax_weights8(const int32_t* const* dot, const Units& un, const float* qa2, const int64_t* from,
                             const int64_t* visible, int n, float* m, float* l, float* w_old, float* us,
                             int32_t* const* u, SoftmaxGroupBuf& b) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sk[4], sv[4];
  for (int c = 0; c < 4; ++c) {
    sk[c] = _mm256_loadu_ps(un.sk[c >> 1] + 8 * (c & 1));
    sv[c] = _mm256_loadu_ps(un.sv[c >> 1] + 8 * (c & 1));
  }
  const MaxOp256 max_op;
  const AddOp256 add_op;
  alignas(32) int32_t keep[8][kKeys];  // per key: all ones where the query sees it
  bool full[8];
  __m256 h[8], hw[8];
  for (int i = 0; i < n; ++i) {
    full[i] = from[i] == 0 && visible[i] == kKeys;
    const __m256 va = _mm256_set1_ps(qa2[i]);
    __m256 bm = ninf;
    for (int c = 0; c < 4; ++c) {
      const __m256 t = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dot[i] + 8 * c)));
      __m256 z = _mm256_mul_ps(_mm256_mul_ps(t, sk[c]), va);
      if (!full[i]) {
        const __m256i k = keep256(from[i], visible[i], c);
        _mm256_store_si256(reinterpret_cast<__m256i*>(keep[i] + 8 * c), k);
        z = _mm256_blendv_ps(ninf, z, _mm256_castsi256_ps(k));
      }
      _mm256_store_ps(b.z[i] + 8 * c, z);
      bm = _mm256_max_ps(bm, z);
    }
    h[i] = bm;
  }
  for (int i = n; i < 8; ++i) h[i] = ninf;
  const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
  const __m256 m_old = _mm256_blendv_ps(ninf, _mm256_maskload_ps(m, live), _mm256_castsi256_ps(live));
  const __m256 m_new = _mm256_max_ps(m_old, reduce8(h, max_op));
  // rescale(): 1 where the maximum stayed (-inf to -inf included), else 2^(m - m')
  const __m256 wo = _mm256_blendv_ps(exp2_neg(_mm256_sub_ps(m_old, m_new)), _mm256_set1_ps(1.f),
                                     _mm256_cmp_ps(m_old, m_new, _CMP_EQ_OQ));
  _mm256_store_ps(b.m_new, m_new);
  for (int i = 0; i < n; ++i) {
    const __m256 vm = _mm256_set1_ps(b.m_new[i]);
    __m256 p[4], wm = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      p[c] = exp2_neg(_mm256_sub_ps(_mm256_load_ps(b.z[i] + 8 * c), vm));
      __m256 w = _mm256_mul_ps(p[c], sv[c]);
      if (!full[i]) {  // masked again: a slot past the context may hold any bytes, its scale a NaN
        const __m256 k = _mm256_load_ps(reinterpret_cast<const float*>(keep[i] + 8 * c));
        p[c] = _mm256_and_ps(p[c], k);
        w = _mm256_and_ps(w, k);
      }
      _mm256_store_ps(b.w[i] + 8 * c, w);
      wm = _mm256_max_ps(wm, w);
    }
    h[i] = _mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3]));
    hw[i] = wm;
  }
  for (int i = n; i < 8; ++i) h[i] = hw[i] = _mm256_setzero_ps();
  const __m256 sum = reduce8(h, add_op), mx = reduce8(hw, max_op);
  const __m256 l_new = _mm256_add_ps(_mm256_mul_ps(_mm256_maskload_ps(l, live), wo), sum);
  const __m256 pos = _mm256_cmp_ps(mx, _mm256_setzero_ps(), _CMP_GT_OQ);
  _mm256_maskstore_ps(m, live, m_new);
  _mm256_maskstore_ps(l, live, l_new);
  _mm256_maskstore_ps(w_old, live, wo);
  _mm256_maskstore_ps(us, live, _mm256_and_ps(pos, _mm256_mul_ps(mx, _mm256_set1_ps(1.f / kUMax))));
  _mm256_store_ps(b.r, _mm256_div_ps(_mm256_set1_ps(kUMax), mx));
  _mm256_store_ps(b.mx, mx);
  for (int i = 0; i < n; ++i) {
    if (!(b.mx[i] > 0.f)) {  // every weight 0
      std::memset(u[i], 0, kKeys / 2 * sizeof(int32_t));
      continue;
    }
    const __m256 w[4] = {_mm256_load_ps(b.w[i]), _mm256_load_ps(b.w[i] + 8), _mm256_load_ps(b.w[i] + 16),
                         _mm256_load_ps(b.w[i] + 24)};
    store_weights256(w, _mm256_set1_ps(b.r[i]), u[i]);
  }
}

// Zeros standing for the missing second unit of a block of 16 keys or fewer.
struct ZeroUnit {
  alignas(64) int32_t kv[kMaxD / 2 * kUnit] = {};
  alignas(64) float s[kUnit] = {};
};
inline const ZeroUnit& zero_unit() {
  static const ZeroUnit z;
  return z;
}

// The keys of one sequence in an int16 pool, read in place: its context's slots come in whole
// units (16 consecutive slots from a multiple of 16; the callers check), so a block of 32 keys
// is two units found through the slots of its first and 17th keys.
struct PagedInt16Keys {
  const int16_t* k;  // [KVH, N, D] in units
  const int16_t* v;
  const float* k_scale;  // [KVH, N]
  const float* v_scale;
  int64_t n_slots, d;
  const int64_t* slots;  // the sequence's context, in position order
  Units block(int64_t kh, int64_t k0, int64_t nk) const {
    Units u;
    const ZeroUnit& zero = zero_unit();
    for (int i = 0; i < 2; ++i) {
      if (i * kUnit >= nk) {
        u.k[i] = u.v[i] = zero.kv;
        u.sk[i] = u.sv[i] = zero.s;
        continue;
      }
      const int64_t at = kh * n_slots + slots[k0 + i * kUnit];
      u.k[i] = reinterpret_cast<const int32_t*>(k + at * d);
      u.v[i] = reinterpret_cast<const int32_t*>(v + at * d);
      u.sk[i] = k_scale + at;
      u.sv[i] = v_scale + at;
    }
    return u;
  }
};

// Per-thread buffers of attend_rows_int, reused across items.
struct IntScratch {
  std::vector<int32_t> qpairs, dots, upairs;
  std::vector<float> qa, m, l, w, us, o;
  SoftmaxGroupBuf sm;
};

// Sizes z for nq queries and empties their running state (the maximum, the sum, the output);
// the callers quantize the queries into z.qpairs and z.qa.
inline void start_queries(IntScratch& z, int64_t nq, int64_t pairs, int64_t d) {
  z.qpairs.resize(static_cast<size_t>(nq * pairs));
  z.dots.resize(static_cast<size_t>(nq * kKeys) + 16);
  z.upairs.resize(static_cast<size_t>(nq * kKeys / 2));
  z.qa.resize(nq);
  z.w.resize(nq);
  z.us.resize(nq);
  z.m.assign(nq, -std::numeric_limits<float>::infinity());
  z.l.assign(nq, 0.f);
  z.o.assign(static_cast<size_t>(nq * d), 0.f);
}

// One block of keys (un) for the queries [q0, nq) of z, which go on from the blocks before it:
// visible(qi) keys of the block from from(qi) are query qi's (its causal limit, its window).
// Each query's operations depend on its own scores alone, whichever queries share the block.
template <class Visible, class From>
inline void attend_block_int(const Units& un, int64_t q0, int64_t nq, int64_t pairs, int64_t d, int64_t isa,
                             IntScratch& z, const Visible& visible, const From& from) {
  // dots are 64-byte aligned per query only when kKeys * 4 is a multiple of 64 (it is: 128)
  int32_t* dots = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(z.dots.data()) + 63) & ~uintptr_t{63});
  // In phases over up to kPhaseQ queries: every query's scores, then every softmax, then every
  // value product with its fold. Each query's operations are the same in any grouping (so are
  // its bits); the phases give the out-of-order core many queries' independent softmax chains at
  // once, where one group's (4 queries) latency-bound chain sat between its products.
  for (int64_t ps = q0; ps < nq; ps += kPhaseQ) {
    const int64_t pe = std::min(nq, ps + kPhaseQ);
    for (int64_t qs = ps; qs < pe; qs += kGroupQ) {
      const int n = static_cast<int>(std::min<int64_t>(kGroupQ, pe - qs));
      const int32_t* qp[kGroupQ];
      int32_t* dp[kGroupQ];
      for (int i = 0; i < n; ++i) {
        qp[i] = z.qpairs.data() + (qs + i) * pairs;
        dp[i] = dots + (qs + i - ps) * kKeys;
      }
      block_scores_int(isa, un, pairs, n, qp, dp);
    }
    // 16 queries at a time on AVX512 hosts, 8 on AVX2, where there are 4 or more
    // (softmax_weights16 and softmax_weights8: the same bits as one at a time, which is
    // cheaper for the few queries of a decode)
    int64_t qi = ps;
    {
      const int64_t width = isa >= kIsaVnni ? 16 : 8;
      for (; pe - qi >= 4; qi += width) {
        const int n = static_cast<int>(std::min<int64_t>(width, pe - qi));
        const int32_t* dq[16];
        int32_t* uq[16];
        int64_t fq[16], vq[16];
        for (int i = 0; i < n; ++i) {
          dq[i] = dots + (qi + i - ps) * kKeys;
          uq[i] = z.upairs.data() + (qi + i) * (kKeys / 2);
          fq[i] = from(qi + i), vq[i] = visible(qi + i);
        }
        if (width == 16)
          softmax_weights16(dq, un, z.qa.data() + qi, fq, vq, n, z.m.data() + qi, z.l.data() + qi,
                            z.w.data() + qi, z.us.data() + qi, uq, z.sm);
        else
          softmax_weights8(dq, un, z.qa.data() + qi, fq, vq, n, z.m.data() + qi, z.l.data() + qi,
                           z.w.data() + qi, z.us.data() + qi, uq, z.sm);
      }
    }
    for (; qi < pe; ++qi) {
      const int32_t* dq = dots + (qi - ps) * kKeys;
      int32_t* uq = z.upairs.data() + qi * (kKeys / 2);
      const int64_t fq = from(qi), vq = visible(qi);
      const bool full = fq == 0 && vq == kKeys;  // every key seen: no masks
      float& m = z.m[qi];
      float& l = z.l[qi];
      if (isa < kIsaVnni)
        z.w[qi] = full ? softmax_weights<true>(dq, un, z.qa[qi], fq, vq, m, l, uq, z.us[qi])
                       : softmax_weights<false>(dq, un, z.qa[qi], fq, vq, m, l, uq, z.us[qi]);
      else
        z.w[qi] = full ? softmax_weights512<true>(dq, un, z.qa[qi], fq, vq, m, l, uq, z.us[qi])
                       : softmax_weights512<false>(dq, un, z.qa[qi], fq, vq, m, l, uq, z.us[qi]);
    }
    for (int64_t qs = ps; qs < pe; qs += kGroupQ) {
      const int n = static_cast<int>(std::min<int64_t>(kGroupQ, pe - qs));
      int64_t vmax = 0;
      const int32_t* up[kGroupQ];
      float* op[kGroupQ];
      for (int i = 0; i < n; ++i) {
        vmax = std::max(vmax, visible(qs + i));
        up[i] = z.upairs.data() + (qs + i) * (kKeys / 2);
        op[i] = z.o.data() + (qs + i) * d;
      }
      block_values_fold_int(isa, un, d, (vmax + 1) / 2, n, up, op, z.w.data() + qs, z.us.data() + qs);
    }
  }
}

// attend_rows (exact_attention.h) on the integer units: query rows [i0, i1) of KV head kh (all G
// query heads of it) over an int16 cache. Same item shapes, causal limits and output layout.
// A sliding window (window > 0) as attend_rows: the blocks a query visits and its masks depend
// on its own position only.
inline void attend_rows_int(const float* q, const PagedInt16Keys& keys, float* out, int64_t t, int64_t c,
                            int64_t h, int64_t kvh_count, int64_t d, int64_t kh, int64_t i0, int64_t i1,
                            float scale, int64_t isa, IntScratch& z, int64_t window = 0) {
  const int64_t g = h / kvh_count, first = c - t, pairs = d / 2;
  const int64_t nq = (i1 - i0) * g;
  start_queries(z, nq, pairs, d);
  auto qptr = [&](int64_t qi) { return q + ((i0 + qi / g) * h + kh * g + qi % g) * d; };
  auto qpos = [&](int64_t qi) { return first + i0 + qi / g; };
  // the scores' float factor per query, in base 2 (softmax_weights): (sq * scale) * log2 e
  for (int64_t qi = 0; qi < nq; ++qi)
    z.qa[qi] = quantize_query(qptr(qi), d, scale, z.qpairs.data() + qi * pairs) * 1.44269504088896341f;
  const int64_t last_key = first + i1 - 1;
  const auto lo = [&](int64_t qi) { return window > 0 ? std::max<int64_t>(0, qpos(qi) - window + 1) : 0; };
  for (int64_t k0 = lo(0) / kKeys * kKeys; k0 <= last_key; k0 += kKeys) {
    const int64_t nk = std::min(kKeys, last_key + 1 - k0);
    int64_t q0 = 0, nq_ = nq;
    while (q0 < nq && qpos(q0) < k0) ++q0;  // rows whose whole future this block is
    while (nq_ > q0 && lo(nq_ - 1) >= k0 + nk) --nq_;  // rows whose window starts past it
    if (q0 == nq_) continue;
    const Units un = keys.block(kh, k0, nk);
    const auto visible = [&](int64_t qi) { return std::min(nk, qpos(qi) - k0 + 1); };
    const auto from = [&](int64_t qi) { return std::max<int64_t>(0, lo(qi) - k0); };
    attend_block_int(un, q0, nq_, pairs, d, isa, z, visible, from);
  }
  for (int64_t qi = 0; qi < nq; ++qi) {
    const float inv = 1.f / z.l[qi];
    const float* o = z.o.data() + qi * d;
    float* dst = out + ((i0 + qi / g) * h + kh * g + qi % g) * d;
    for (int64_t cc = 0; cc < d; ++cc) dst[cc] = o[cc] * inv;
  }
}

// Decode rows of several sequences whose contexts hold the same first `shared` slots (the blocks
// of a cached prefix they share; a multiple of kKeys): row i's query (the G heads of KV head kh)
// at q[i] over keys[i] (ctx[i] of them, its own token last), its output at out[i]. The shared
// blocks are read once for every row's queries, then each row reads its own blocks. Each query
// visits the same blocks in the same order with the same operations as attend_rows_int gives
// it alone (a one-row chunk: every key of a block before its last is visible), so its bits are
// the same; only which queries share a block's pass differs (design.md, "Attention in a fixed
// order"). Where several sequences share a long prefix this reads its K/V once a step, not once
// a sequence.
inline void attend_decode_group_int(const float* const* q, const PagedInt16Keys* keys, float* const* out,
                                    const int64_t* ctx, int64_t n, int64_t shared, int64_t h, int64_t kvh_count,
                                    int64_t d, int64_t kh, float scale, int64_t isa, IntScratch& z) {
  const int64_t g = h / kvh_count, pairs = d / 2, nq = n * g;
  start_queries(z, nq, pairs, d);
  for (int64_t qi = 0; qi < nq; ++qi)
    z.qa[qi] = quantize_query(q[qi / g] + (kh * g + qi % g) * d, d, scale, z.qpairs.data() + qi * pairs) *
               1.44269504088896341f;
  const auto whole = [](int64_t) { return kKeys; };
  const auto none = [](int64_t) { return int64_t{0}; };
  for (int64_t k0 = 0; k0 < shared; k0 += kKeys)
    attend_block_int(keys[0].block(kh, k0, kKeys), 0, nq, pairs, d, isa, z, whole, none);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k0 = shared; k0 < ctx[i]; k0 += kKeys) {
      const int64_t nk = std::min(kKeys, ctx[i] - k0);
      attend_block_int(keys[i].block(kh, k0, nk), i * g, (i + 1) * g, pairs, d, isa, z,
                       [nk](int64_t) { return nk; }, none);
    }
  for (int64_t qi = 0; qi < nq; ++qi) {
    const float inv = 1.f / z.l[qi];
    const float* o = z.o.data() + qi * d;
    float* dst = out[qi / g] + (kh * g + qi % g) * d;
    for (int64_t cc = 0; cc < d; ++cc) dst[cc] = o[cc] * inv;
  }
}

// Decode rows grouped by the prefix their contexts share: rows whose first `shared` slots are
// the same (shared a multiple of kKeys, at least min_shared); a row that shares less with the
// rows before it is a group of its own (shared 0). Groups are then halved, largest first, until
// there are at least `min_groups` (work items for every thread) or none has two rows.
struct DecodeGroup {
  std::vector<int64_t> rows;
  int64_t shared = 0;
};

inline std::vector<DecodeGroup> shared_prefix_groups(const int64_t* slots_off, const int64_t* slots, const int64_t* ctx,
                                                     int64_t b, int64_t min_shared, int64_t min_groups) {
  // Rows by the slot of their first key: only rows that start in the same block can share one.
  std::vector<int64_t> order(static_cast<size_t>(b));
  for (int64_t r = 0; r < b; ++r) order[r] = r;
  const auto first = [&](int64_t r) { return ctx[r] > 0 ? slots[slots_off[r]] : int64_t{-1}; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return first(a) < first(c); });
  // Keys row r shares with row l from position 0, whole blocks, and short of either's last key
  // (each row's own new token is never shared). Slots come in whole units of kUnit consecutive
  // slots, so comparing each unit's first slot compares the unit.
  const auto common = [&](int64_t l, int64_t r) {
    const int64_t limit = std::min(ctx[l], ctx[r]) - 1;
    int64_t j = 0;
    while (j < limit && slots[slots_off[l] + j] == slots[slots_off[r] + j]) j += kUnit;
    return std::min(j, limit) / kKeys * kKeys;
  };
  std::vector<DecodeGroup> groups;
  for (size_t i = 0; i < order.size();) {
    size_t e = i + 1;
    while (e < order.size() && first(order[e]) == first(order[i]) && first(order[i]) >= 0) ++e;
    std::vector<int64_t> left(order.begin() + static_cast<std::ptrdiff_t>(i), order.begin() + static_cast<std::ptrdiff_t>(e));
    while (!left.empty()) {  // the first row left leads; those sharing at least half its best join
      DecodeGroup grp;
      grp.rows.push_back(left[0]);
      std::vector<int64_t> c(left.size(), 0);
      int64_t best = 0;
      for (size_t k = 1; k < left.size(); ++k) best = std::max(best, c[k] = common(left[0], left[k]));
      std::vector<int64_t> rest;
      grp.shared = best;
      for (size_t k = 1; k < left.size(); ++k)
        if (best >= min_shared && c[k] >= std::max(min_shared, best / 2)) {
          grp.rows.push_back(left[k]);
          grp.shared = std::min(grp.shared, c[k]);
        } else {
          rest.push_back(left[k]);
        }
      if (grp.rows.size() == 1) grp.shared = 0;
      groups.push_back(std::move(grp));
      left = std::move(rest);
    }
    i = e;
  }
  while (static_cast<int64_t>(groups.size()) < min_groups) {
    auto big = std::max_element(groups.begin(), groups.end(),
                                [](const DecodeGroup& a, const DecodeGroup& c) { return a.rows.size() < c.rows.size(); });
    if (big == groups.end() || big->rows.size() < 2) break;
    DecodeGroup half;
    half.shared = big->shared;
    const size_t keep = big->rows.size() / 2;
    half.rows.assign(big->rows.begin() + static_cast<std::ptrdiff_t>(keep), big->rows.end());
    big->rows.resize(keep);
    if (big->rows.size() == 1) big->shared = 0;
    if (half.rows.size() == 1) half.shared = 0;
    groups.push_back(std::move(half));
  }
  return groups;
}

}  // namespace prefixcache::exact
