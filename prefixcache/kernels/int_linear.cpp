// Exact, batch-invariant linear layer: 4-bit weight groups times integer activations, summed in
// int32, then one float32 epilogue in a fixed order (prefixcache/model/int_linear.py wraps it).
//
//   w[n, k] = q[n, k] * d[n, g] + m[n, g]        q in 0..15, g = k / 32 (GGUF Q4_1 / Q4_0)
//   x[r, k] ~ a[r, k] * s[r, g]                   a integer, |a| <= A (A = 32639 or 127)
//
// Per output (r, n) and group g the kernel computes the exact integers
//   dot = sum_k a[r, k] q[n, k]     sum_a = sum_k a[r, k]
// and then, for g = 0, 1, ... in order, in float32 with separate roundings (no FMA):
//   acc = acc + float(dot) * (s[r, g] * d[n, g])
//   acc = acc + m[n, g] * (s[r, g] * float(sum_a))
// Integer sums are exact whatever the blocking, tiling, threading or batch size, and the float
// epilogue of an output reads only that output's row and column, so a row's result depends on
// that row alone: bit-for-bit the same alone or in any batch, on any thread count, and on every
// ISA path here (vpdpbusd on AVX512-VNNI, vpmaddubsw + vpmaddwd on AVX2: the same integers,
// then the same scalar sequence of IEEE multiplies and adds per lane). The float values fit:
// |dot| <= 32 * 15 * 32639 < 2^24, so float(dot) is exact.
//
// 16-bit activations run as two int8 passes: a = 256 hi + lo with hi, lo in [-128, 127], and
// dot = 256 dot(hi) + dot(lo), still exact. They cost two passes and keep float32-like
// quality (KL 4e-8 vs float32 on the default model); 8-bit activations are one pass (faster,
// KL 1.7e-3: over the quality floor, opt-in). docs/design.md section 2 has the measurements.
//
// Weight layout (IntLinear.pack in int_linear.py), per block of 16 output columns and group:
//   256 bytes of nibbles: [j = 0..3][column c = 0..15][byte b = 0..3], low nibble = weight
//   k = 4 j + b of column c, high nibble = weight k = 16 + 4 j + b (k within the group)
//   then d and m: [blocks, groups, 16] float32 each.
// A 64-byte row j is one VNNI operand (16 columns x 4 consecutive k) after masking a nibble.
//
// Mixed activations (``mixed``, with 16 bits): per row, a group whose magnitude stands out of
// its row is quantized to 16 bits and every other group to 8, as the 16-bit value 256 a8:
//   wide(r, g) = G amax(r, g)^2 > 2 sum_g' amax(r, g')^2   (in double, g' in order)
//   wide:    s = amax / 32639, a = round(x / s)                   (the 16-bit rule)
//   narrow:  s8 = amax / 127, a = 256 round(x / s8), s = s8 / 256  (hi = a8, lo = 0)
// The integers and the epilogue are the 16-bit path's, so every path, skip or not, gives the
// same bits; a narrow group's low pass is all zeros and is skipped (per row and group), so the
// kernel costs about one pass plus the wide groups' share (~11% on the default model). Quality
// between the two (docs/design.md section 2): the decision reads only its own row.
//
// int8_linear is the same for 8-bit weight groups (GGUF Q8_0, or a bf16/float checkpoint
// quantized at load): w[n, k] = q[n, k] * d[n, g], q in -127..127, no offset, so
//   acc = acc + float(dot) * (s[r, g] * d[n, g])
// with dot = sum_k a[r, k] q[n, k] over the full 16-bit (or 8-bit) integers a in one pass of
// 16 x 16 -> 32 bit pair products (vpdpwssd on AVX512-VNNI, vpmaddwd on AVX2): no u8 x s8
// operand, so no offset trick and no saturation (|pair| <= 2 * 32639 * 127). |dot| may pass
// 2^24, so float(dot) rounds: to nearest, the same on every path and in the reference.
// Its layout per block of 16 columns and group: 512 bytes [p = 0..15][column 0..15][2], the
// weights k = 2 p, 2 p + 1 of the column: 32 bytes widen to one 32 x int16 operand.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kCols = 16;              // columns per weight block
constexpr int64_t kBlockBytes = 256;       // nibbles of one block and group
constexpr int64_t kBlockBytes8 = 512;      // int8 weights of one block and group (int8_linear)
constexpr int64_t kRowChunk = 64;          // rows per work item

// Activations of a call, quantized once: per row, hi and lo int8 parts (16-bit) or lo alone
// (8-bit), and per (row, group) the scale s and s * float(sum of a).
struct Quantized {
  std::vector<int8_t> hi, lo;
  std::vector<uint8_t> wide;  // per (row, group), mixed activations: 1 where the group has 16 bits
  std::vector<int16_t> a16;  // the integers whole (int8_linear) instead of hi/lo
  std::vector<float> s, ssum;
};

// The group maxima of row xr (|x|, 8 lanes at a time) into amax[0 .. groups).
void group_maxima(const float* xr, int64_t groups, float* amax) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = xr + g * kGroup;
    __m256 vmax = _mm256_setzero_ps();
    for (int i = 0; i < kGroup; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    amax[g] = _mm_cvtss_f32(m4);
  }
}

// Quantize rows [r0, r1) of x, 8 lanes at a time (one AVX2 build for every ISA path). The
// float operations are IEEE divisions and round-to-nearest-even (the same as torch.round(x / s)),
// so the reference in prefixcache/model/int_linear.py computes the same integers.
void quantize_rows(const float* x, int64_t k, int64_t r0, int64_t r1, int bits, bool whole, bool mixed, Quantized& qa) {
  const int64_t groups = k / kGroup;
  const float amax_q = bits == 16 ? 32639.f : 127.f;
  const __m256 vq = _mm256_set1_ps(amax_q), vnq = _mm256_set1_ps(-amax_q);
  const __m256i c128 = _mm256_set1_epi32(128);
  std::vector<float> maxima(static_cast<size_t>(groups));
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * k;
    group_maxima(xr, groups, maxima.data());
    double energy = 0.0;  // sum of amax^2 in group order (mixed)
    if (mixed)
      for (int64_t g = 0; g < groups; ++g) energy += static_cast<double>(maxima[g]) * maxima[g];
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = xr + g * kGroup;
      const float amax = maxima[g];
      // narrow: a mixed row's ordinary group, 8 bits (a8) carried as the 16-bit 256 a8
      const bool narrow = mixed && !(static_cast<double>(groups) * (static_cast<double>(amax) * amax) > 2.0 * energy);
      if (mixed) qa.wide[r * groups + g] = narrow ? 0 : 1;
      const float s8 = amax / 127.f;
      const float s = narrow ? s8 : amax / amax_q;
      int8_t* lo = whole ? nullptr : qa.lo.data() + r * k + g * kGroup;
      int8_t* hi = !whole && bits == 16 ? qa.hi.data() + r * k + g * kGroup : nullptr;
      int16_t* a16 = whole ? qa.a16.data() + r * k + g * kGroup : nullptr;
      __m256i vsum = _mm256_setzero_si256();
      if (s > 0.f) {
        const __m256 vs = _mm256_set1_ps(s);
        const __m256 hiq = narrow ? _mm256_set1_ps(127.f) : vq, loq = narrow ? _mm256_set1_ps(-127.f) : vnq;
        for (int i = 0; i < kGroup; i += 8) {
          __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xg + i), vs),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          v = _mm256_max_ps(loq, _mm256_min_ps(hiq, v));
          __m256i a = _mm256_cvtps_epi32(v);  // exact: v is an integer
          if (narrow) a = _mm256_slli_epi32(a, 8);  // 256 a8
          vsum = _mm256_add_epi32(vsum, a);
          alignas(32) int32_t lo32[8];
          if (whole) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(lo32), a);
            for (int j = 0; j < 8; ++j) a16[i + j] = static_cast<int16_t>(lo32[j]);
            continue;
          }
          if (bits == 16) {
            const __m256i h = _mm256_srai_epi32(_mm256_add_epi32(a, c128), 8);  // floor((a + 128) / 256)
            const __m256i l = _mm256_sub_epi32(a, _mm256_slli_epi32(h, 8));    // in [-128, 127]
            alignas(32) int32_t hi32[8];
            _mm256_store_si256(reinterpret_cast<__m256i*>(hi32), h);
            _mm256_store_si256(reinterpret_cast<__m256i*>(lo32), l);
            for (int j = 0; j < 8; ++j) hi[i + j] = static_cast<int8_t>(hi32[j]);
          } else {
            _mm256_store_si256(reinterpret_cast<__m256i*>(lo32), a);
          }
          for (int j = 0; j < 8; ++j) lo[i + j] = static_cast<int8_t>(lo32[j]);
        }
      } else {
        if (lo != nullptr) std::memset(lo, 0, kGroup);
        if (hi != nullptr) std::memset(hi, 0, kGroup);
        if (a16 != nullptr) std::memset(a16, 0, kGroup * sizeof(int16_t));
      }
      alignas(32) int32_t s32[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(s32), vsum);
      int32_t sum = 0;
      for (int j = 0; j < 8; ++j) sum += s32[j];
      const float se = narrow ? s8 / 256.f : s;  // the scale of a (exact: a power of two)
      qa.s[r * groups + g] = se;
      qa.ssum[r * groups + g] = se * static_cast<float>(sum);
    }
  }
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- AVX512-VNNI: R rows x one block of 16 columns. A group's 8 weight operands stay in
// registers and serve every row, each row's integer sum is one accumulator (the high pass, a
// shift by 8, then the low pass onto it: 256 dot(hi) + dot(lo)), rows interleaved so R chains of
// vpdpbusd are in flight. (Two blocks with separate hi/lo accumulators spilled to the stack.)
template <int R, bool TWO, bool MIXED>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile512(
    const Quantized& qa, int64_t r0, int64_t k, const uint8_t* wq, const float* wd, const float* wm,
    int64_t b, float* y, int64_t ldy, int64_t n) {
  const int64_t groups = k / kGroup;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[8];
    const uint8_t* blk = wq + (b * groups + g) * kBlockBytes;
    for (int j = 0; j < 4; ++j) {
      const __m512i p = _mm512_loadu_si512(blk + j * 64);
      w[2 * j] = _mm512_and_si512(p, mask);                            // k = 4 j .. 4 j + 3
      w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), mask);  // k = 16 + 4 j ..
    }
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    if (TWO) {
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < R; ++r) {
          const int8_t* h = qa.hi.data() + (r0 + r) * k + g * kGroup + 4 * j;
          dot[r] = _mm512_dpbusd_epi32(dot[r], w[2 * j], _mm512_set1_epi32(load_i32(h)));
          dot[r] = _mm512_dpbusd_epi32(dot[r], w[2 * j + 1], _mm512_set1_epi32(load_i32(h + 16)));
        }
      for (int r = 0; r < R; ++r) dot[r] = _mm512_slli_epi32(dot[r], 8);
    }
    if (MIXED) {  // the low pass of the rows whose group is wide (the others' low bytes are 0)
      for (int r = 0; r < R; ++r) {
        if (!qa.wide[(r0 + r) * groups + g]) continue;
        const int8_t* l = qa.lo.data() + (r0 + r) * k + g * kGroup;
        for (int j = 0; j < 4; ++j) {
          dot[r] = _mm512_dpbusd_epi32(dot[r], w[2 * j], _mm512_set1_epi32(load_i32(l + 4 * j)));
          dot[r] = _mm512_dpbusd_epi32(dot[r], w[2 * j + 1], _mm512_set1_epi32(load_i32(l + 4 * j + 16)));
        }
      }
    } else {
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < R; ++r) {
          const int8_t* l = qa.lo.data() + (r0 + r) * k + g * kGroup + 4 * j;
          dot[r] = _mm512_dpbusd_epi32(dot[r], w[2 * j], _mm512_set1_epi32(load_i32(l)));
          dot[r] = _mm512_dpbusd_epi32(dot[r], w[2 * j + 1], _mm512_set1_epi32(load_i32(l + 16)));
        }
    }
    const __m512 vd = _mm512_loadu_ps(wd + (b * groups + g) * kCols);
    const __m512 vm = _mm512_loadu_ps(wm + (b * groups + g) * kCols);
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (r0 + r) * groups + g;
      const __m512 p = _mm512_mul_ps(_mm512_set1_ps(qa.s[rg]), vd);
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), p));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(vm, _mm512_set1_ps(qa.ssum[rg])));
    }
  }
  const int64_t col = b * kCols;
  const int64_t nv = std::min<int64_t>(kCols, n - col);
  const __mmask16 mk = static_cast<__mmask16>((1u << nv) - 1u);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * ldy + col, mk, acc[r]);
}

// ---- AVX2: the same tile in two halves of 8 columns; vpmaddubsw (u8 weight x s8 activation)
// gives 16-bit pair sums, |pair| <= 2 * 15 * 128 = 3840, that never saturate; a group's eight
// of them per lane are summed in 16 bits (|sum| <= 8 * 3840 = 30720 < 2^15: exact, no
// overflow), and one vpmaddwd with ones per group widens the pairs of lanes to the column's
// int32 sum: the same integers as a widening per product, with one multiply-port op in place of
// eight (the kernel is bound by those ports on AVX2).
template <int R, bool TWO, bool MIXED>
inline void tile256(const Quantized& qa, int64_t r0, int64_t k, const uint8_t* wq, const float* wd,
                    const float* wm, int64_t b, int half, float* y, int64_t ldy, int64_t n) {
  const int64_t groups = k / kGroup;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dh[R], dl[R];  // 16-bit pair sums of the group, per row
    for (int r = 0; r < R; ++r) dh[r] = dl[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i p = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(wq + (b * groups + g) * kBlockBytes + j * 64 + half * 32));
      const __m256i w0 = _mm256_and_si256(p, mask);
      const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(p, 4), mask);
      for (int r = 0; r < R; ++r) {
        const int64_t off = (r0 + r) * k + g * kGroup + 4 * j;
        if (!MIXED || qa.wide[(r0 + r) * groups + g]) {  // a narrow group's low bytes are 0
          const __m256i l0 = _mm256_set1_epi32(load_i32(qa.lo.data() + off));
          const __m256i l1 = _mm256_set1_epi32(load_i32(qa.lo.data() + off + 16));
          dl[r] = _mm256_add_epi16(dl[r], _mm256_maddubs_epi16(w0, l0));
          dl[r] = _mm256_add_epi16(dl[r], _mm256_maddubs_epi16(w1, l1));
        }
        if (TWO) {
          const __m256i h0 = _mm256_set1_epi32(load_i32(qa.hi.data() + off));
          const __m256i h1 = _mm256_set1_epi32(load_i32(qa.hi.data() + off + 16));
          dh[r] = _mm256_add_epi16(dh[r], _mm256_maddubs_epi16(w0, h0));
          dh[r] = _mm256_add_epi16(dh[r], _mm256_maddubs_epi16(w1, h1));
        }
      }
    }
    const __m256 vd = _mm256_loadu_ps(wd + (b * groups + g) * kCols + half * 8);
    const __m256 vm = _mm256_loadu_ps(wm + (b * groups + g) * kCols + half * 8);
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (r0 + r) * groups + g;
      __m256i dot = _mm256_madd_epi16(dl[r], ones);
      if (TWO) dot = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(dh[r], ones), 8), dot);
      const __m256 p = _mm256_mul_ps(_mm256_set1_ps(qa.s[rg]), vd);
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(dot), p));
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(vm, _mm256_set1_ps(qa.ssum[rg])));
    }
  }
  const int64_t col = b * kCols + half * 8;
  const int64_t nv = std::min<int64_t>(8, n - col);
  if (nv <= 0) return;
  for (int r = 0; r < R; ++r) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, acc[r]);
    std::memcpy(y + (r0 + r) * ldy + col, tmp, static_cast<size_t>(nv) * sizeof(float));
  }
}

template <bool TWO, bool MIXED>
void rows_avx512(const Quantized& qa, int64_t r0, int64_t r1, int64_t k, const uint8_t* wq,
                 const float* wd, const float* wm, int64_t b0, int64_t b1, float* y, int64_t n) {
  for (int64_t b = b0; b < b1; ++b) {
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) tile512<4, TWO, MIXED>(qa, r, k, wq, wd, wm, b, y, n, n);
    switch (r1 - r) {
      case 3: tile512<3, TWO, MIXED>(qa, r, k, wq, wd, wm, b, y, n, n); break;
      case 2: tile512<2, TWO, MIXED>(qa, r, k, wq, wd, wm, b, y, n, n); break;
      case 1: tile512<1, TWO, MIXED>(qa, r, k, wq, wd, wm, b, y, n, n); break;
      default: break;
    }
  }
}

template <bool TWO, bool MIXED>
void rows_avx2(const Quantized& qa, int64_t r0, int64_t r1, int64_t k, const uint8_t* wq,
               const float* wd, const float* wm, int64_t b0, int64_t b1, float* y, int64_t n) {
  for (int64_t b = b0; b < b1; ++b) {
    for (int half = 0; half < 2; ++half) {
      int64_t r = r0;
      for (; r + 4 <= r1; r += 4) tile256<4, TWO, MIXED>(qa, r, k, wq, wd, wm, b, half, y, n, n);
      for (; r < r1; ++r) tile256<1, TWO, MIXED>(qa, r, k, wq, wd, wm, b, half, y, n, n);
    }
  }
}

// ---- 8-bit weights, AVX512-VNNI: R rows x one block of 16 columns; per pair p of the group
// one widened weight operand serves every row (vpdpwssd: lane c += a[2p] q[c, 2p] +
// a[2p + 1] q[c, 2p + 1]).
template <int R, bool OFF>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile512_w8(
    const Quantized& qa, int64_t r0, int64_t k, const int8_t* wq, const float* wd, const float* wm,
    int64_t b, float* y, int64_t ldy, int64_t n) {
  const int64_t groups = k / kGroup;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* blk = wq + (b * groups + g) * kBlockBytes8;
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int p = 0; p < kGroup / 2; ++p) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + p * 32)));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, qa.a16.data() + (r0 + r) * k + g * kGroup + 2 * p, 4);
        dot[r] = _mm512_dpwssd_epi32(dot[r], _mm512_set1_epi32(pair), w);
      }
    }
    const __m512 vd = _mm512_loadu_ps(wd + (b * groups + g) * kCols);
    const __m512 vm = OFF ? _mm512_loadu_ps(wm + (b * groups + g) * kCols) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (r0 + r) * groups + g;
      const __m512 sd = _mm512_mul_ps(_mm512_set1_ps(qa.s[rg]), vd);
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), sd));
      if (OFF) acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(vm, _mm512_set1_ps(qa.ssum[rg])));
    }
  }
  const int64_t col = b * kCols;
  const int64_t nv = std::min<int64_t>(kCols, n - col);
  const __mmask16 mk = static_cast<__mmask16>((1u << nv) - 1u);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * ldy + col, mk, acc[r]);
}

// ---- 8-bit weights, AVX2: half a block (8 columns), vpmaddwd on the widened pairs.
template <int R, bool OFF>
inline void tile256_w8(const Quantized& qa, int64_t r0, int64_t k, const int8_t* wq, const float* wd,
                       const float* wm, int64_t b, int half, float* y, int64_t ldy, int64_t n) {
  const int64_t groups = k / kGroup;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* blk = wq + (b * groups + g) * kBlockBytes8 + half * 16;
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    for (int p = 0; p < kGroup / 2; ++p) {
      const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + p * 32)));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, qa.a16.data() + (r0 + r) * k + g * kGroup + 2 * p, 4);
        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_set1_epi32(pair), w));
      }
    }
    const __m256 vd = _mm256_loadu_ps(wd + (b * groups + g) * kCols + half * 8);
    const __m256 vm = OFF ? _mm256_loadu_ps(wm + (b * groups + g) * kCols + half * 8) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (r0 + r) * groups + g;
      const __m256 sd = _mm256_mul_ps(_mm256_set1_ps(qa.s[rg]), vd);
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r]), sd));
      if (OFF) acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(vm, _mm256_set1_ps(qa.ssum[rg])));
    }
  }
  const int64_t col = b * kCols + half * 8;
  const int64_t nv = std::min<int64_t>(8, n - col);
  if (nv <= 0) return;
  for (int r = 0; r < R; ++r) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, acc[r]);
    std::memcpy(y + (r0 + r) * ldy + col, tmp, static_cast<size_t>(nv) * sizeof(float));
  }
}

template <bool OFF>
void rows_w8(const Quantized& qa, int64_t r0, int64_t r1, int64_t k, const int8_t* wq, const float* wd,
             const float* wm, int64_t b0, int64_t b1, float* y, int64_t n, int64_t isa) {
  for (int64_t b = b0; b < b1; ++b) {
    if (isa == 2) {
      int64_t r = r0;
      for (; r + 4 <= r1; r += 4) tile512_w8<4, OFF>(qa, r, k, wq, wd, wm, b, y, n, n);
      switch (r1 - r) {
        case 3: tile512_w8<3, OFF>(qa, r, k, wq, wd, wm, b, y, n, n); break;
        case 2: tile512_w8<2, OFF>(qa, r, k, wq, wd, wm, b, y, n, n); break;
        case 1: tile512_w8<1, OFF>(qa, r, k, wq, wd, wm, b, y, n, n); break;
        default: break;
      }
    } else {
      for (int half = 0; half < 2; ++half) {
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4) tile256_w8<4, OFF>(qa, r, k, wq, wd, wm, b, half, y, n, n);
        for (; r < r1; ++r) tile256_w8<1, OFF>(qa, r, k, wq, wd, wm, b, half, y, n, n);
      }
    }
  }
}

bool cpu_has_vnni512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
}

// isa: 2 = AVX512-VNNI, 1 = AVX2 (the Python side chooses; PREFIXCACHE_ISA forces a lower one).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wd, const at::Tensor& wm,
                       int64_t n, int64_t bits, int64_t isa, bool mixed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu(), "x: [M, K] float32 on CPU");
  TORCH_CHECK(bits == 8 || bits == 16, "activation bits: 8 or 16");
  TORCH_CHECK(!mixed || bits == 16, "mixed activations are 8 or 16 bits per group: bits 16");
  TORCH_CHECK(isa == 1 || isa == 2, "isa: 1 (avx2) or 2 (avx512-vnni)");
  TORCH_CHECK(isa == 1 || cpu_has_vnni512(), "this CPU lacks AVX512-VNNI");
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  const int64_t blocks = (n + kCols - 1) / kCols;
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(wq.is_contiguous() && wq.scalar_type() == at::kByte && wq.numel() == blocks * groups * kBlockBytes,
              "wq: packed nibbles [blocks * groups * 256] uint8");
  TORCH_CHECK(wd.is_contiguous() && wm.is_contiguous() && wd.scalar_type() == at::kFloat &&
                  wm.scalar_type() == at::kFloat && wd.numel() == blocks * groups * kCols &&
                  wm.numel() == wd.numel(),
              "wd, wm: [blocks, groups, 16] float32");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* xp = xc.data_ptr<float>();
  Quantized qa;
  qa.lo.resize(static_cast<size_t>(m * k));
  if (bits == 16) qa.hi.resize(static_cast<size_t>(m * k));
  if (mixed) qa.wide.resize(static_cast<size_t>(m * groups));
  qa.s.resize(static_cast<size_t>(m * groups));
  qa.ssum.resize(static_cast<size_t>(m * groups));
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    quantize_rows(xp, k, r0, r1, static_cast<int>(bits), false, mixed, qa);
  });
  const uint8_t* wqp = wq.data_ptr<uint8_t>();
  const float* wdp = wd.data_ptr<float>();
  const float* wmp = wm.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Work items: (chunk of rows, run of 8 column blocks). Any split gives the same bits: each
  // output is computed whole by one item.
  const int64_t row_chunks = (m + kRowChunk - 1) / kRowChunk;
  constexpr int64_t kBlocksPerItem = 8;
  const int64_t col_items = (blocks + kBlocksPerItem - 1) / kBlocksPerItem;
  const bool two = bits == 16;
  at::parallel_for(0, row_chunks * col_items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t rc = it / col_items, ci = it % col_items;
      const int64_t r0 = rc * kRowChunk, r1 = std::min(m, r0 + kRowChunk);
      const int64_t b0 = ci * kBlocksPerItem, b1 = std::min(blocks, b0 + kBlocksPerItem);
      if (isa == 2) {
        if (mixed) rows_avx512<true, true>(qa, r0, r1, k, wqp, wdp, wmp, b0, b1, yp, n);
        else if (two) rows_avx512<true, false>(qa, r0, r1, k, wqp, wdp, wmp, b0, b1, yp, n);
        else rows_avx512<false, false>(qa, r0, r1, k, wqp, wdp, wmp, b0, b1, yp, n);
      } else {
        if (mixed) rows_avx2<true, true>(qa, r0, r1, k, wqp, wdp, wmp, b0, b1, yp, n);
        else if (two) rows_avx2<true, false>(qa, r0, r1, k, wqp, wdp, wmp, b0, b1, yp, n);
        else rows_avx2<false, false>(qa, r0, r1, k, wqp, wdp, wmp, b0, b1, yp, n);
      }
    }
  });
  return y;
}

// wm (optional): per-group offsets as int4_linear's, for 4-bit weights held as int8 (q in
// 0..15): then the epilogue is int4_linear's too, acc + float(dot) (s d) + m (s sum(a)), with
// the same integer dot (256 dot(hi) + dot(lo) == dot(a)), so the bits equal int4_linear's.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wd,
                       const std::optional<at::Tensor>& wm, int64_t n, int64_t bits, int64_t isa, bool mixed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu(), "x: [M, K] float32 on CPU");
  TORCH_CHECK(bits == 8 || bits == 16, "activation bits: 8 or 16");
  TORCH_CHECK(!mixed || bits == 16, "mixed activations are 8 or 16 bits per group: bits 16");
  TORCH_CHECK(isa == 1 || isa == 2, "isa: 1 (avx2) or 2 (avx512-vnni)");
  TORCH_CHECK(isa == 1 || cpu_has_vnni512(), "this CPU lacks AVX512-VNNI");
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  const int64_t blocks = (n + kCols - 1) / kCols;
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(wq.is_contiguous() && wq.scalar_type() == at::kChar && wq.numel() == blocks * groups * kBlockBytes8,
              "wq: packed int8 weights [blocks * groups * 512]");
  TORCH_CHECK(wd.is_contiguous() && wd.scalar_type() == at::kFloat && wd.numel() == blocks * groups * kCols,
              "wd: [blocks, groups, 16] float32");
  const bool off = wm.has_value();
  TORCH_CHECK(!off || (wm->is_contiguous() && wm->scalar_type() == at::kFloat && wm->numel() == wd.numel()),
              "wm: [blocks, groups, 16] float32");
  const float* wmp = off ? wm->data_ptr<float>() : nullptr;
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* xp = xc.data_ptr<float>();
  Quantized qa;
  qa.a16.resize(static_cast<size_t>(m * k));
  if (mixed) qa.wide.resize(static_cast<size_t>(m * groups));
  qa.s.resize(static_cast<size_t>(m * groups));
  qa.ssum.resize(static_cast<size_t>(m * groups));
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    quantize_rows(xp, k, r0, r1, static_cast<int>(bits), true, mixed, qa);
  });
  const int8_t* wqp = wq.data_ptr<int8_t>();
  const float* wdp = wd.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t row_chunks = (m + kRowChunk - 1) / kRowChunk;
  constexpr int64_t kBlocksPerItem = 8;
  const int64_t col_items = (blocks + kBlocksPerItem - 1) / kBlocksPerItem;
  at::parallel_for(0, row_chunks * col_items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t rc = it / col_items, ci = it % col_items;
      const int64_t r0 = rc * kRowChunk, r1 = std::min(m, r0 + kRowChunk);
      const int64_t b0 = ci * kBlocksPerItem, b1 = std::min(blocks, b0 + kBlocksPerItem);
      if (off) rows_w8<true>(qa, r0, r1, k, wqp, wdp, wmp, b0, b1, yp, n, isa);
      else rows_w8<false>(qa, r0, r1, k, wqp, wdp, wmp, b0, b1, yp, n, isa);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, lib) {
  lib.def("int4_linear(Tensor x, Tensor wq, Tensor wd, Tensor wm, int n, int bits, int isa, bool mixed=False) -> Tensor");
  lib.def("int8_linear(Tensor x, Tensor wq, Tensor wd, Tensor? wm, int n, int bits, int isa, bool mixed=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("int4_linear", &int4_linear);
  lib.impl("int8_linear", &int8_linear);
}
