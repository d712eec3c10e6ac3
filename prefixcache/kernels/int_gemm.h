// The exact integer GEMM shared by int_linear.cpp (one layer per call) and exact_decode.cpp (a
// whole decode step per call): activation quantization, the tiles of every ISA path, and the
// dispatch of a work item. The arithmetic is documented in int_linear.cpp's header comment.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace prefixcache {

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
  std::vector<int16_t> a16;  // the integers whole (8-bit weight pairs) instead of hi/lo
  std::vector<float> s, ssum;
  std::vector<int32_t> isum;  // per (row, group): sum of a (8-bit weight quads' offset term)
  std::vector<float> ssum16;  // per (row, group, half): s * sum of a over 16 (offsets per 16 weights)
};

// The group maxima of row xr (|x|, 8 lanes at a time) into amax[0 .. groups).
inline void group_maxima(const float* xr, int64_t groups, float* amax) {
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

// Eight int32 lanes that fit int16, as eight int16 in order (packs interleaves the 128-bit lanes).
inline __m128i narrow16(__m256i v) {
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packs_epi32(v, v), 0xD8));
}

// Quantize rows [r0, r1) of x, 8 lanes at a time (one AVX2 build for every ISA path). The
// float operations are IEEE divisions and round-to-nearest-even (the same as torch.round(x / s)),
// so the reference in prefixcache/model/int_linear.py computes the same integers.
inline void quantize_rows(const float* x, int64_t k, int64_t r0, int64_t r1, int bits, bool whole, bool mixed, Quantized& qa) {
  const int64_t groups = k / kGroup;
  const float amax_q = bits == 16 ? 32639.f : 127.f;
  const __m256 vq = _mm256_set1_ps(amax_q), vnq = _mm256_set1_ps(-amax_q);
  const __m256i c128 = _mm256_set1_epi32(128);
  std::vector<float> maxima(static_cast<size_t>(groups));
  const bool halves = !qa.ssum16.empty();  // sums per 16 as well (offsets per 16 weights)
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
      // vhalf: the first 16's sum, kept only where offsets per 16 read it (ssum16)
      __m256i vsum = _mm256_setzero_si256(), vhalf = _mm256_setzero_si256();
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
          if (halves && i < kGroup / 2) vhalf = _mm256_add_epi32(vhalf, a);
          // narrowed by packs (each value fits its type, so the saturation never acts) and stored
          // 8 at a time
          if (whole) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(a16 + i), narrow16(a));
            continue;
          }
          if (bits == 16) {
            const __m256i h = _mm256_srai_epi32(_mm256_add_epi32(a, c128), 8);  // floor((a + 128) / 256)
            const __m256i l = _mm256_sub_epi32(a, _mm256_slli_epi32(h, 8));    // in [-128, 127]
            _mm_storel_epi64(reinterpret_cast<__m128i*>(hi + i), _mm_packs_epi16(narrow16(h), narrow16(h)));
            a = l;
          }
          _mm_storel_epi64(reinterpret_cast<__m128i*>(lo + i), _mm_packs_epi16(narrow16(a), narrow16(a)));
        }
      } else {
        if (lo != nullptr) std::memset(lo, 0, kGroup);
        if (hi != nullptr) std::memset(hi, 0, kGroup);
        if (a16 != nullptr) std::memset(a16, 0, kGroup * sizeof(int16_t));
      }
      alignas(32) int32_t s32[8], h32[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(s32), vsum);
      _mm256_store_si256(reinterpret_cast<__m256i*>(h32), vhalf);
      int32_t sum = 0, first = 0;
      for (int j = 0; j < 8; ++j) sum += s32[j], first += h32[j];  // (first: 0 unless halves)
      const float se = narrow ? s8 / 256.f : s;  // the scale of a (exact: a power of two)
      qa.s[r * groups + g] = se;
      qa.ssum[r * groups + g] = se * static_cast<float>(sum);
      if (!qa.isum.empty()) qa.isum[r * groups + g] = sum;
      if (halves) {
        qa.ssum16[2 * (r * groups + g)] = se * static_cast<float>(first);
        qa.ssum16[2 * (r * groups + g) + 1] = se * static_cast<float>(sum - first);
      }
    }
  }
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Rows [r0, r0 + R) of y at one block of 16 columns from `col` (fewer at the layer's edge,
// none past it).
template <int R>
__attribute__((target("avx512f"))) inline void store_block(const __m512* acc, float* y, int64_t ldy, int64_t r0,
                                                         int64_t col, int64_t n) {
  const int64_t nv = std::min<int64_t>(kCols, n - col);
  if (nv <= 0) return;
  const __mmask16 mk = static_cast<__mmask16>((1u << nv) - 1u);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * ldy + col, mk, acc[r]);
}

// Every element of a narrow tile's C x R registers set to v.
template <int C, int R, typename V>
__attribute__((target("avx512f"))) inline void fill(V (&a)[C][R], V v) {
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) a[c][r] = v;
}

// Column blocks [b0, b1) of a narrow call in runs of kC (then one at a time): tile(b, C) with C
// a std::integral_constant, the narrow tiles' block count.
template <int R, typename Tile>
inline void over_blocks(int64_t b0, int64_t b1, Tile&& tile) {
  constexpr int kC = R == 1 ? 4 : 2;  // R kC independent chains
  int64_t b = b0;
  for (; b + kC <= b1; b += kC) tile(b, std::integral_constant<int, kC>{});
  for (; b < b1; ++b) tile(b, std::integral_constant<int, 1>{});
}

// ---- AVX512-VNNI tiles of vpdpbusd operands (unsigned weights x signed activation bytes),
// for two weight formats (QUADS): 4-bit nibble blocks, or 8-bit quads (u = q + 128, model/
// int_linear.py pack8). Per group a block has 8 operands of 16 columns x 4 consecutive k:
// nibbles: one 64-byte row j gives two (the low nibbles, k = 4 j.., and the high, k = 16 + 4 j..);
// quads: row o is operand o (k = 4 o..). Activations: hi and lo int8 parts (16 bits: the high
// pass, a shift by 8, then the low pass onto it: 256 dot(hi) + dot(lo)); the lo part alone for
// 8 bits; mixed rows skip the low pass of their narrow groups (lo = 0). Quads take the weights'
// offset back in integers (dot(a, q) = dot(a, u) - 128 sum(a): |256 dot(hi, u)| <= 256 * 32 *
// 255 * 128 < 2^31); nibbles keep theirs in the float epilogue (OFF: + m (s sum(a))).
template <bool QUADS>
constexpr int kSteps = QUADS ? 8 : 4;  // 64-byte weight rows per block and group

// Operands of weight row `step` of a block and group: 1 (quads) or 2 (nibbles), and the k offset
// within the group of operand i.
template <bool QUADS>
__attribute__((target("avx512f,avx512bw"))) inline void step_operands(const uint8_t* blk, int step, __m512i* w) {
  const __m512i p = _mm512_loadu_si512(blk + step * 64);
  if constexpr (QUADS) {
    w[0] = p;
  } else {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    w[0] = _mm512_and_si512(p, mask);                            // k = 4 j .. 4 j + 3
    w[1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), mask);  // k = 16 + 4 j ..
  }
}
template <bool QUADS>
constexpr int64_t operand_k(int step, int i) { return QUADS ? 4 * step : 4 * step + 16 * i; }
template <bool QUADS>
constexpr int kPerStep = QUADS ? 1 : 2;

// One output block's group epilogue for R rows: acc += float(dot) (s d) [+ m (s sum(a))].
// half >= 0: the epilogue of that half of the group (a scale and offset per 16 weights), whose
// sum(a) is over its 16 activations.
template <int R, bool QUADS, bool OFF>
__attribute__((target("avx512f"))) inline void group_epilogue(const Quantized& qa, int64_t r0, int64_t groups,
                                                           int64_t g, const float* d, const float* m,
                                                           const __m512i* dot, __m512* acc, int half = -1) {
  const __m512 vd = _mm512_loadu_ps(d);
  const __m512 vm = OFF ? _mm512_loadu_ps(m) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const int64_t rg = (r0 + r) * groups + g;
    __m512i di = dot[r];
    if constexpr (QUADS) di = _mm512_sub_epi32(di, _mm512_set1_epi32(128 * qa.isum[rg]));
    const __m512 p = _mm512_mul_ps(_mm512_set1_ps(qa.s[rg]), vd);
    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(di), p));
    if (OFF) {
      const float ss = half < 0 ? qa.ssum[rg] : qa.ssum16[2 * rg + half];
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(vm, _mm512_set1_ps(ss)));
    }
  }
}

// R rows x one block of 16 columns: a group's 8 weight operands stay in registers and serve
// every row, each row's integer sum is one accumulator, rows interleaved so R chains of
// vpdpbusd are in flight. (Two blocks with separate hi/lo accumulators spilled to the stack.)
template <int R, bool TWO, bool MIXED, bool OFF, bool QUADS>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile512(
    const Quantized& qa, int64_t r0, int64_t k, const uint8_t* wq, const float* wd, const float* wm,
    int64_t b, float* y, int64_t ldy, int64_t n) {
  constexpr int64_t bytes = QUADS ? kBlockBytes8 : kBlockBytes;
  const int64_t groups = k / kGroup;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[8];
    int64_t koff[8];
    for (int st = 0; st < kSteps<QUADS>; ++st) {
      step_operands<QUADS>(wq + (b * groups + g) * bytes, st, w + kPerStep<QUADS> * st);
      for (int i = 0; i < kPerStep<QUADS>; ++i) koff[kPerStep<QUADS> * st + i] = operand_k<QUADS>(st, i);
    }
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    const int64_t base = r0 * k + g * kGroup;
    if (TWO) {
      for (int o = 0; o < 8; ++o)
        for (int r = 0; r < R; ++r)
          dot[r] = _mm512_dpbusd_epi32(dot[r], w[o], _mm512_set1_epi32(load_i32(qa.hi.data() + base + r * k + koff[o])));
      for (int r = 0; r < R; ++r) dot[r] = _mm512_slli_epi32(dot[r], 8);
    }
    if (MIXED) {  // the low pass of the rows whose group is wide (the others' low bytes are 0)
      for (int r = 0; r < R; ++r) {
        if (!qa.wide[(r0 + r) * groups + g]) continue;
        for (int o = 0; o < 8; ++o)
          dot[r] = _mm512_dpbusd_epi32(dot[r], w[o], _mm512_set1_epi32(load_i32(qa.lo.data() + base + r * k + koff[o])));
      }
    } else {
      for (int o = 0; o < 8; ++o)
        for (int r = 0; r < R; ++r)
          dot[r] = _mm512_dpbusd_epi32(dot[r], w[o], _mm512_set1_epi32(load_i32(qa.lo.data() + base + r * k + koff[o])));
    }
    group_epilogue<R, QUADS, OFF>(qa, r0, groups, g, wd + (b * groups + g) * kCols, OFF ? wm + (b * groups + g) * kCols : nullptr, dot, acc);
  }
  store_block<R>(acc, y, ldy, r0, b * kCols, n);
}

// Narrow calls (1-3 rows: decode): R rows x C blocks. With one block a row's group is one chain
// of dependent vpdpbusd, bound by their latency (a single-sequence decode step spent ~2.8 ms
// there); C blocks give R C independent chains. A block's weight row is loaded (and unpacked)
// per step, once per pass. Each output's integers and epilogue are tile512's: the same bits.
template <int R, int C, bool TWO, bool MIXED, bool OFF, bool QUADS>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile512n(
    const Quantized& qa, int64_t r0, int64_t k, const uint8_t* wq, const float* wd, const float* wm,
    int64_t b, float* y, int64_t ldy, int64_t n) {
  constexpr int64_t bytes = QUADS ? kBlockBytes8 : kBlockBytes;
  constexpr int per = kPerStep<QUADS>;
  const int64_t groups = k / kGroup;
  __m512 acc[C][R];
  fill(acc, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[C][R];
    fill(dot, _mm512_setzero_si512());
    bool lo_rows[R];
    for (int r = 0; r < R; ++r) lo_rows[r] = !MIXED || qa.wide[(r0 + r) * groups + g];
    for (int pass = TWO ? 0 : 1; pass < 2; ++pass) {
      if (pass == 1 && TWO)
        for (int c = 0; c < C; ++c)
          for (int r = 0; r < R; ++r) dot[c][r] = _mm512_slli_epi32(dot[c][r], 8);
      const int8_t* a = (pass == 0 ? qa.hi.data() : qa.lo.data()) + r0 * k + g * kGroup;
      for (int st = 0; st < kSteps<QUADS>; ++st) {
        __m512i w[C][per];
        for (int c = 0; c < C; ++c) step_operands<QUADS>(wq + ((b + c) * groups + g) * bytes, st, w[c]);
        for (int r = 0; r < R; ++r) {
          if (pass == 1 && !lo_rows[r]) continue;  // a narrow group's low bytes are 0
          for (int i = 0; i < per; ++i) {
            const __m512i av = _mm512_set1_epi32(load_i32(a + r * k + operand_k<QUADS>(st, i)));
            for (int c = 0; c < C; ++c) dot[c][r] = _mm512_dpbusd_epi32(dot[c][r], w[c][i], av);
          }
        }
      }
    }
    for (int c = 0; c < C; ++c)
      group_epilogue<R, QUADS, OFF>(qa, r0, groups, g, wd + ((b + c) * groups + g) * kCols,
                                    OFF ? wm + ((b + c) * groups + g) * kCols : nullptr, dot[c], acc[c]);
  }
  for (int c = 0; c < C; ++c) store_block<R>(acc[c], y, ldy, r0, (b + c) * kCols, n);
}

// Rows [r0, r1) x column blocks [b0, b1) through the tiles above.
template <bool TWO, bool MIXED, bool OFF, bool QUADS>
inline void rows512(const Quantized& qa, int64_t r0, int64_t r1, int64_t k, const uint8_t* wq,
                    const float* wd, const float* wm, int64_t b0, int64_t b1, float* y, int64_t n) {
  const auto narrow = [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    over_blocks<R>(b0, b1, [&](int64_t b, auto c) {
      tile512n<R, decltype(c)::value, TWO, MIXED, OFF, QUADS>(qa, r0, k, wq, wd, wm, b, y, n, n);
    });
  };
  switch (r1 - r0) {  // narrow calls: several blocks per tile
    case 1: narrow(std::integral_constant<int, 1>{}); return;
    case 2: narrow(std::integral_constant<int, 2>{}); return;
    case 3: narrow(std::integral_constant<int, 3>{}); return;
    default: break;
  }
  for (int64_t b = b0; b < b1; ++b) {
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) tile512<4, TWO, MIXED, OFF, QUADS>(qa, r, k, wq, wd, wm, b, y, n, n);
    switch (r1 - r) {
      case 3: tile512<3, TWO, MIXED, OFF, QUADS>(qa, r, k, wq, wd, wm, b, y, n, n); break;
      case 2: tile512<2, TWO, MIXED, OFF, QUADS>(qa, r, k, wq, wd, wm, b, y, n, n); break;
      case 1: tile512<1, TWO, MIXED, OFF, QUADS>(qa, r, k, wq, wd, wm, b, y, n, n); break;
      default: break;
    }
  }
}

inline bool cpu_has_vnni512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
}

// ---- AMX-INT8 (Intel Sapphire Rapids and later): the same integers from tile products. One
// tile product per group (A: 16 rows x the group's 32 activation bytes; B: the group's 8 weight
// quad rows x 16 columns, which is the layout of the 8-bit quads and of the nibbles unpacked),
// so each int32 sum is a group's dot exactly as vpdpbusd computes it: tdpbsud takes signed
// activation bytes against unsigned weight bytes, as vpdpbusd does with the operands swapped.
// 16 bits: a high pass and a low pass into separate tiles, combined as (hi << 8) + lo (the VNNI
// tiles' integers: shift then add). The sums are stored and run through group_epilogue eight
// rows at a time: the same float operations in the same order as every other path, so the same
// bits (tests/model/test_exact.py passed on an AMX host, Intel Xeon family 6 model 207). Full
// 16-row blocks only; an item's remaining rows take the AVX512-VNNI tiles.
// Measured (docs/benchmarks-journal.md "A GPU machine"; benchmarks/probes/amx_groups.cpp): one
// group per tile product stores and converts every group's sums, which caps AMX at ~1/3 of its
// whole-K rate; per layer shape it ran int16 activations 1.1-1.4x and int8 1.1-1.3x the VNNI
// tiles.
inline bool cpu_has_amx() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1u) || !((d >> 25) & 1u)) return false;  // AMX-TILE, AMX-INT8
    if (!cpu_has_vnni512()) return false;                       // the remainder rows' tiles
    // Linux hands a process the tile data state only on request (ARCH_REQ_XCOMP_PERM for
    // XFEATURE_XTILEDATA); it holds for every thread of the process.
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return has;
}

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configure this thread's tiles (per work item: other code on the thread, oneDNN, configures
// them for itself).
__attribute__((target("amx-tile"))) inline void load_tiles(const AmxTileConfig& cfg) {
  // GCC's _tile_loadconfig names only the first 8 bytes of the configuration as read; the
  // barrier keeps the stores of the tile shapes (a probe without it faulted in ldtilecfg:
  // benchmarks/probes/amx_attention.cpp)
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// The epilogue of one group over 16 rows of one block of 16 columns, from its stored tile sums
// (row r's at lo + r ld and, TWO, hi + r ld: dot = (hi << 8) + lo), into acc (row r at
// acc + r lda) in place: group_epilogue eight rows at a time, so its bits. rows_amx's and
// rows_amx_w8's.
template <bool TWO, bool QUADS, bool OFF>
__attribute__((target("avx512f"))) inline void tile_epilogue16(const Quantized& qa, int64_t r0, int64_t groups,
                                                             int64_t g, const float* d, const float* m,
                                                             const int32_t* hi, const int32_t* lo, int64_t ld,
                                                             float* acc, int64_t lda) {
  for (int h = 0; h < 16; h += 8) {
    __m512i dot[8];
    __m512 a[8];
    for (int r = 0; r < 8; ++r) {
      dot[r] = _mm512_load_si512(lo + (h + r) * ld);
      if (TWO) dot[r] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi + (h + r) * ld), 8), dot[r]);
      a[r] = _mm512_load_ps(acc + (h + r) * lda);
    }
    group_epilogue<8, QUADS, OFF>(qa, r0 + h, groups, g, d, m, dot, a);
    for (int r = 0; r < 8; ++r) _mm512_store_ps(acc + (h + r) * lda, a[r]);
  }
}

template <bool TWO, bool OFF, bool QUADS>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni"))) inline void rows_amx(
    const Quantized& qa, int64_t r0, int64_t r1, int64_t k, const uint8_t* wq, const float* wd,
    const float* wm, int64_t b0, int64_t b1, float* y, int64_t n) {
  const int64_t full = r0 + (r1 - r0) / 16 * 16;
  if (full > r0) {
    // Tiles: 0, 1 high sums of blocks b, b + 1; 2, 3 low sums; 4 high and 5 low activation
    // bytes; 6, 7 the two blocks' weights.
    AmxTileConfig cfg;
    for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    for (int t = 4; t < 6; ++t) cfg.rows[t] = 16, cfg.colsb[t] = kGroup;
    for (int t = 6; t < 8; ++t) cfg.rows[t] = kGroup / 4, cfg.colsb[t] = 64;
    load_tiles(cfg);
    constexpr int64_t bytes = QUADS ? kBlockBytes8 : kBlockBytes;
    const int64_t groups = k / kGroup;
    alignas(64) float acc[kRowChunk / 16][16][32];
    alignas(64) int32_t sums[2][16][32];  // [high, low][row][two blocks' columns]
    alignas(64) uint8_t unpacked[2][512];  // a group's nibbles as quad rows
    const __m512i mask = _mm512_set1_epi8(0x0F);
    // up to kRowChunk rows at a time (exact_decode passes a whole batch as one item)
    for (int64_t c0 = r0; c0 < full; c0 += kRowChunk)
    for (int64_t b = b0; b < b1; b += 2) {
      const int64_t row_blocks = std::min<int64_t>(kRowChunk, full - c0) / 16;
      const int nb = b + 1 < b1 ? 2 : 1;
      std::memset(acc, 0, sizeof acc);
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* wt[2];
        for (int c = 0; c < nb; ++c) {
          const uint8_t* blk = wq + ((b + c) * groups + g) * bytes;
          if constexpr (QUADS) {
            wt[c] = blk;
          } else {  // row j's low nibbles are quads k = 4 j.., its high ones k = 16 + 4 j..
            for (int j = 0; j < 4; ++j) {
              const __m512i v = _mm512_loadu_si512(blk + j * 64);
              _mm512_store_si512(unpacked[c] + j * 64, _mm512_and_si512(v, mask));
              _mm512_store_si512(unpacked[c] + (4 + j) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
            }
            wt[c] = unpacked[c];
          }
        }
        _tile_loadd(6, wt[0], 64);
        if (nb == 2) _tile_loadd(7, wt[1], 64);
        for (int64_t rb = 0; rb < row_blocks; ++rb) {
          const int64_t rr = c0 + rb * 16, base = rr * k + g * kGroup;
          if (TWO) {
            _tile_zero(0);
            _tile_loadd(4, qa.hi.data() + base, k);
            _tile_dpbsud(0, 4, 6);
            _tile_stored(0, &sums[0][0][0], 128);
            if (nb == 2) {
              _tile_zero(1);
              _tile_dpbsud(1, 4, 7);
              _tile_stored(1, &sums[0][0][16], 128);
            }
          }
          _tile_zero(2);
          _tile_loadd(5, qa.lo.data() + base, k);
          _tile_dpbsud(2, 5, 6);
          _tile_stored(2, &sums[1][0][0], 128);
          if (nb == 2) {
            _tile_zero(3);
            _tile_dpbsud(3, 5, 7);
            _tile_stored(3, &sums[1][0][16], 128);
          }
          for (int c = 0; c < nb; ++c)
            tile_epilogue16<TWO, QUADS, OFF>(qa, rr, groups, g, wd + ((b + c) * groups + g) * kCols,
                                             OFF ? wm + ((b + c) * groups + g) * kCols : nullptr,
                                             &sums[0][0][16 * c], &sums[1][0][16 * c], 32, &acc[rb][0][16 * c], 32);
        }
      }
      for (int64_t rb = 0; rb < row_blocks; ++rb)
        for (int c = 0; c < nb; ++c) {
          __m512 out[16];
          for (int r = 0; r < 16; ++r) out[r] = _mm512_load_ps(&acc[rb][r][16 * c]);
          store_block<16>(out, y, n, c0 + rb * 16, (b + c) * kCols, n);
        }
    }
    _tile_release();
  }
  if (full < r1) rows512<TWO, false, OFF, QUADS>(qa, full, r1, k, wq, wd, wm, b0, b1, y, n);
}

// The ISA code a caller passed (the Python side chooses; PREFIXCACHE_ISA forces a lower one).
inline void check_isa(int64_t isa) {
  TORCH_CHECK(isa >= 1 && isa <= 3, "isa: 1 (avx2), 2 (avx512-vnni) or 3 (amx)");
  // AMX first: a host without AVX512-VNNI lacks AMX too, and the refusal names what was asked
  TORCH_CHECK(isa != 3 || cpu_has_amx(), "this CPU or its OS does not provide AMX-INT8");
  TORCH_CHECK(isa == 1 || cpu_has_vnni512(), "this CPU lacks AVX512-VNNI");
}

// rows512 or, on AMX (isa 3), rows_amx: the same bits. Mixed activations stay on the VNNI
// tiles: they skip a narrow group's low pass row by row, which a 16-row tile product cannot,
// and measured no faster through AMX (equal end to end, -17% to +6% per layer shape; docs/
// benchmarks-journal.md "A GPU machine"; the AMX variant, with the pass skipped where all 16 rows
// were narrow, passed tests/model/test_exact.py there before it was set aside).
template <bool TWO, bool MIXED, bool OFF, bool QUADS>
inline void rows_vnni(const Quantized& qa, int64_t r0, int64_t r1, int64_t k, const uint8_t* wq,
                      const float* wd, const float* wm, int64_t b0, int64_t b1, float* y, int64_t n,
                      int64_t isa) {
  if constexpr (!MIXED) {
    if (isa == 3 && r1 - r0 >= 16) {
      rows_amx<TWO, OFF, QUADS>(qa, r0, r1, k, wq, wd, wm, b0, b1, y, n);
      return;
    }
  }
  rows512<TWO, MIXED, OFF, QUADS>(qa, r0, r1, k, wq, wd, wm, b0, b1, y, n);
}

// The R rows of an AVX2 tile's half block (8 columns from `col`; fewer at the layer's edge).
template <int R>
inline void store_half(const __m256* acc, float* y, int64_t ldy, int64_t col, int64_t n) {
  const int64_t nv = std::min<int64_t>(8, n - col);
  if (nv <= 0) return;
  for (int r = 0; r < R; ++r) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, acc[r]);
    std::memcpy(y + r * ldy + col, tmp, static_cast<size_t>(nv) * sizeof(float));
  }
}

// Up to four rows' vectors in named members, visited by a compile-time row loop: arrays of
// __m256i made GCC 12 copy every accumulator per update and spill the float sums (23 register
// copies in tile256<4, true, true>, the AVX2 host's hottest loop). The same cause as the
// attention's Acc8 (int_attention.h); docs/design.md section 6, "AVX2 loops keep their sums in
// named registers".
template <typename V>
struct RowRegs {
  V v0, v1, v2, v3;
  template <int r>
  V& at() {
    if constexpr (r == 0) return v0;
    else if constexpr (r == 1) return v1;
    else if constexpr (r == 2) return v2;
    else return v3;
  }
};
// f(std::integral_constant<int, r>) for r = 0 .. R - 1 (R = 1 or 4).
template <int R, typename F>
inline void each_row(F&& f) {
  static_assert(R == 1 || R == 4);
  f(std::integral_constant<int, 0>{});
  if constexpr (R == 4) {
    f(std::integral_constant<int, 1>{});
    f(std::integral_constant<int, 2>{});
    f(std::integral_constant<int, 3>{});
  }
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
  RowRegs<__m256> acc;
  each_row<R>([&](auto r) { acc.template at<r>() = _mm256_setzero_ps(); });
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    RowRegs<__m256i> dh, dl;  // 16-bit pair sums of the group, per row
    each_row<R>([&](auto r) { dh.template at<r>() = dl.template at<r>() = _mm256_setzero_si256(); });
    // per row, once a group: where its activations start, and whether its low bytes count (a
    // narrow group's are 0)
    const int8_t* lo[R];
    const int8_t* hi[R];
    bool low[R];
    each_row<R>([&](auto r) {
      const int64_t off = (r0 + r) * k + g * kGroup;
      lo[r] = qa.lo.data() + off;
      hi[r] = TWO ? qa.hi.data() + off : nullptr;
      low[r] = !MIXED || qa.wide[(r0 + r) * groups + g];
    });
    const uint8_t* wg = wq + (b * groups + g) * kBlockBytes + half * 32;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64));
      const __m256i w0 = _mm256_and_si256(p, mask);
      const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(p, 4), mask);
      // pass: a row's pair products of activations 4j..4j+3 (against w0) and of the four 16
      // places later (against w1), summed, then added to its sum: 16-bit sums that never
      // overflow, so integer adds in this order give the same bits as one product at a time
      auto pass = [&](const int8_t* a) {
        return _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(load_i32(a + 4 * j))),
                                _mm256_maddubs_epi16(w1, _mm256_set1_epi32(load_i32(a + 4 * j + 16))));
      };
      each_row<R>([&](auto r) {
        if (TWO) dh.template at<r>() = _mm256_add_epi16(dh.template at<r>(), pass(hi[r]));
        if (low[r]) dl.template at<r>() = _mm256_add_epi16(dl.template at<r>(), pass(lo[r]));
      });
    }
    const __m256 vd = _mm256_loadu_ps(wd + (b * groups + g) * kCols + half * 8);
    const __m256 vm = _mm256_loadu_ps(wm + (b * groups + g) * kCols + half * 8);
    each_row<R>([&](auto r) {
      const int64_t rg = (r0 + r) * groups + g;
      __m256i dot = _mm256_madd_epi16(dl.template at<r>(), ones);
      if (TWO) dot = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(dh.template at<r>(), ones), 8), dot);
      const __m256 p = _mm256_mul_ps(_mm256_set1_ps(qa.s[rg]), vd);
      __m256& a = acc.template at<r>();
      a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_cvtepi32_ps(dot), p));
      a = _mm256_add_ps(a, _mm256_mul_ps(vm, _mm256_set1_ps(qa.ssum[rg])));
    });
  }
  __m256 out[R];
  each_row<R>([&](auto r) { out[r] = acc.template at<r>(); });
  store_half<R>(out, y + r0 * ldy, ldy, b * kCols + half * 8, n);
}

template <bool TWO, bool MIXED>
inline void rows_avx2(const Quantized& qa, int64_t r0, int64_t r1, int64_t k, const uint8_t* wq,
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
// S16 (GGUF Q6_K: a weight scale per 16): each group of 32 is two sub-groups of 8 pairs, each
// its own exact int32 sum and its own epilogue with its scale (wd [blocks, 2 groups, 16]), the
// first before the second; the activations' scale stays the group of 32's. No offsets.
template <bool S16>
constexpr int kSubs = S16 ? 2 : 1;
template <bool S16>
inline const float* sub_scales(const float* wd, int64_t b, int64_t groups, int64_t g, int h) {
  return wd + ((b * groups + g) * kSubs<S16> + h) * kCols;
}

template <int R, bool OFF, bool S16>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile512_w8(
    const Quantized& qa, int64_t r0, int64_t k, const int8_t* wq, const float* wd, const float* wm,
    int64_t b, float* y, int64_t ldy, int64_t n) {
  constexpr int kPairs = kGroup / 2 / kSubs<S16>;
  const int64_t groups = k / kGroup;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* blk = wq + (b * groups + g) * kBlockBytes8;
    for (int h = 0; h < kSubs<S16>; ++h) {
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
      for (int p = h * kPairs; p < (h + 1) * kPairs; ++p) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + p * 32)));
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, qa.a16.data() + (r0 + r) * k + g * kGroup + 2 * p, 4);
          dot[r] = _mm512_dpwssd_epi32(dot[r], _mm512_set1_epi32(pair), w);
        }
      }
      group_epilogue<R, false, OFF>(qa, r0, groups, g, sub_scales<S16>(wd, b, groups, g, h),
                                    OFF ? sub_scales<S16>(wm, b, groups, g, h) : nullptr, dot, acc, S16 ? h : -1);
    }
  }
  store_block<R>(acc, y, ldy, r0, b * kCols, n);
}

// ---- 8-bit weights, AVX512-VNNI, narrow calls (1-3 rows): R rows x C blocks, R C independent
// vpdpwssd chains (one block's 16 dependent ones were latency-bound); tile512_w8's integers and
// epilogue, so its bits.
template <int R, int C, bool OFF, bool S16>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile512n_w8(
    const Quantized& qa, int64_t r0, int64_t k, const int8_t* wq, const float* wd, const float* wm,
    int64_t b, float* y, int64_t ldy, int64_t n) {
  constexpr int kPairs = kGroup / 2 / kSubs<S16>;
  const int64_t groups = k / kGroup;
  __m512 acc[C][R];
  fill(acc, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g)
  for (int h = 0; h < kSubs<S16>; ++h) {
    __m512i dot[C][R];
    fill(dot, _mm512_setzero_si512());
    for (int p = h * kPairs; p < (h + 1) * kPairs; ++p) {
      __m512i w[C];
      for (int c = 0; c < C; ++c)
        w[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(wq + ((b + c) * groups + g) * kBlockBytes8 + p * 32)));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, qa.a16.data() + (r0 + r) * k + g * kGroup + 2 * p, 4);
        const __m512i a = _mm512_set1_epi32(pair);
        for (int c = 0; c < C; ++c) dot[c][r] = _mm512_dpwssd_epi32(dot[c][r], a, w[c]);
      }
    }
    for (int c = 0; c < C; ++c)
      group_epilogue<R, false, OFF>(qa, r0, groups, g, sub_scales<S16>(wd, b + c, groups, g, h),
                                    OFF ? sub_scales<S16>(wm, b + c, groups, g, h) : nullptr, dot[c], acc[c],
                                    S16 ? h : -1);
  }
  for (int c = 0; c < C; ++c) store_block<R>(acc[c], y, ldy, r0, (b + c) * kCols, n);
}

template <int R, bool OFF, bool S16>
inline void narrow512_w8(const Quantized& qa, int64_t r0, int64_t k, const int8_t* wq, const float* wd,
                         const float* wm, int64_t b0, int64_t b1, float* y, int64_t n) {
  over_blocks<R>(b0, b1, [&](int64_t b, auto c) {
    tile512n_w8<R, decltype(c)::value, OFF, S16>(qa, r0, k, wq, wd, wm, b, y, n, n);
  });
}

// ---- 8-bit weights, AVX2: half a block (8 columns), vpmaddwd on the widened pairs.
template <int R, bool OFF, bool S16>
inline void tile256_w8(const Quantized& qa, int64_t r0, int64_t k, const int8_t* wq, const float* wd,
                       const float* wm, int64_t b, int half, float* y, int64_t ldy, int64_t n) {
  constexpr int kPairs = kGroup / 2 / kSubs<S16>;
  const int64_t groups = k / kGroup;
  RowRegs<__m256> acc;  // named registers, the loop unrolled: see RowRegs
  each_row<R>([&](auto r) { acc.template at<r>() = _mm256_setzero_ps(); });
  for (int64_t g = 0; g < groups; ++g)
  for (int h = 0; h < kSubs<S16>; ++h) {
    const int8_t* blk = wq + (b * groups + g) * kBlockBytes8 + half * 16;
    RowRegs<__m256i> dot;
    const int16_t* a[R];  // each row's activations of this group
    each_row<R>([&](auto r) {
      dot.template at<r>() = _mm256_setzero_si256();
      a[r] = qa.a16.data() + (r0 + r) * k + g * kGroup;
    });
#pragma GCC unroll 4
    for (int p = h * kPairs; p < (h + 1) * kPairs; ++p) {
      const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + p * 32)));
      each_row<R>([&](auto r) {
        int32_t pair;
        std::memcpy(&pair, a[r] + 2 * p, 4);
        __m256i& d = dot.template at<r>();
        d = _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_set1_epi32(pair), w));
      });
    }
    const __m256 vd = _mm256_loadu_ps(sub_scales<S16>(wd, b, groups, g, h) + half * 8);
    const __m256 vm = OFF ? _mm256_loadu_ps(sub_scales<S16>(wm, b, groups, g, h) + half * 8) : _mm256_setzero_ps();
    each_row<R>([&](auto r) {
      const int64_t rg = (r0 + r) * groups + g;
      const __m256 sd = _mm256_mul_ps(_mm256_set1_ps(qa.s[rg]), vd);
      __m256& o = acc.template at<r>();
      o = _mm256_add_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(dot.template at<r>()), sd));
      if (OFF) o = _mm256_add_ps(o, _mm256_mul_ps(vm, _mm256_set1_ps(S16 ? qa.ssum16[2 * rg + h] : qa.ssum[rg])));
    });
  }
  __m256 out[R];
  each_row<R>([&](auto r) { out[r] = acc.template at<r>(); });
  store_half<R>(out, y + r0 * ldy, ldy, b * kCols + half * 8, n);
}

// ---- 8-bit weight pairs on AMX-INT8: wide calls (16 rows or more) with the integers whole,
// which is how 16-bit activations meet 8-bit weights with a scale per 32 (Gemma 3's Q5_0 and
// Q8_0 layers by default). AMX multiplies bytes only, so each activation is split as
// a = 256 hi + lo with lo in [-128, 127] (hi = floor((a + 128) / 256), the quads' split in
// quantize_rows) and two tile products against the block's signed weight bytes (tdpbssd) give
// sum(a q) = 256 sum(hi q) + sum(lo q): vpdpwssd's int32 exactly (|256 sum(hi q)| <= 2^27). The
// pairs are reordered per item into the B tiles' layout (quad row j: weights 4j .. 4j + 3 of each
// column), one word interleave of two pair rows. One tile product per group, its sums stored and
// run through group_epilogue in tile512_w8's order: the same bits. Returns the first row it did
// not run (an item's rows past its last 16 take the VNNI tiles).
// Measured on an Intel Xeon (family 6 model 167, 2 threads; docs/benchmarks-journal.md "8-bit
// weight pairs on AMX"): 1.10-1.37x the VNNI pairs on Gemma 3's shapes at 512 rows. Storing and
// converting every group's sums bounds it, as it bounds rows_amx (design.md section 6). Groups
// with a scale per 16 (Q6_K) ran 0.93-0.97x through it (a tile product and an epilogue per 16
// weights): they stay on the VNNI tiles.
template <bool OFF>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni"))) inline int64_t rows_amx_w8(
    const Quantized& qa, int64_t r0, int64_t r1, int64_t k, const int8_t* wq, const float* wd,
    const float* wm, int64_t b0, int64_t b1, float* y, int64_t n) {
  const int64_t groups = k / kGroup, full = r0 + (r1 - r0) / 16 * 16, rows = full - r0, nblk = b1 - b0;
  if (rows == 0) return r0;
  thread_local std::vector<int8_t> hi, lo, wt;
  hi.resize(static_cast<size_t>(rows * k));
  lo.resize(static_cast<size_t>(rows * k));
  wt.resize(static_cast<size_t>(nblk * groups * kBlockBytes8));
  const __m512i c128 = _mm512_set1_epi16(128);
  for (int64_t r = 0; r < rows; ++r) {  // k is a multiple of 32
    const int16_t* a = qa.a16.data() + (r0 + r) * k;
    for (int64_t i = 0; i < k; i += 32) {
      const __m512i v = _mm512_loadu_si512(a + i);
      const __m512i h = _mm512_srai_epi16(_mm512_add_epi16(v, c128), 8);  // |a| <= 32639: no wrap
      const __m512i l = _mm512_sub_epi16(v, _mm512_slli_epi16(h, 8));
      // group-major, [16-row block][group][row][32]: a tile's 16 rows in 8 cache lines
      const int64_t at = ((r / 16 * groups + i / kGroup) * 16 + r % 16) * kGroup;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi.data() + at), _mm512_cvtepi16_epi8(h));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo.data() + at), _mm512_cvtepi16_epi8(l));
    }
  }
  // word 2c of quad row j = pair row 2j's column c, word 2c + 1 = pair row 2j + 1's
  alignas(64) int16_t order[32];
  for (int c = 0; c < 16; ++c) order[2 * c] = static_cast<int16_t>(c), order[2 * c + 1] = static_cast<int16_t>(16 + c);
  const __m512i perm = _mm512_load_si512(order);
  for (int64_t i = 0; i < nblk * groups; ++i) {
    const int8_t* src = wq + (b0 * groups + i) * kBlockBytes8;
    for (int j = 0; j < 8; ++j)
      _mm512_storeu_si512(wt.data() + i * kBlockBytes8 + j * 64,
                          _mm512_permutexvar_epi16(perm, _mm512_loadu_si512(src + j * 64)));
  }
  // tiles: 0, 1 the hi and lo sums of a block b, 2, 3 those of block b + 1; 4, 5 the hi and lo
  // activation bytes; 6, 7 the two blocks' weights: four independent tile products a step.
  AmxTileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) cfg.rows[t] = 16, cfg.colsb[t] = kGroup;
  for (int t = 6; t < 8; ++t) cfg.rows[t] = kGroup / 4, cfg.colsb[t] = 64;
  load_tiles(cfg);
  // Pipelined: group g + 1's products are issued before group g's epilogue, so the tile unit and
  // the vector units overlap (the sums alternate between two buffers); each output's epilogues
  // still run in group order, tile512_w8's.
  alignas(64) int32_t sums[2][2][2][16][16];  // [group parity][block][hi, lo][row][column]
  alignas(64) float acc[2][16][16];           // [block][row][column]
  for (int64_t rr = r0; rr < full; rr += 16)
    for (int64_t b = b0; b < b1; b += 2) {
      const int nb = b + 1 < b1 ? 2 : 1;
      const int8_t* ah = hi.data() + (rr - r0) * k;
      const int8_t* al = lo.data() + (rr - r0) * k;
      const int8_t* wb = wt.data() + (b - b0) * groups * kBlockBytes8;
      auto products = [&](int64_t g) {  // group g's sums into sums[g & 1]
        auto& sm = sums[g & 1];
        _tile_loadd(4, ah + g * 16 * kGroup, kGroup);
        _tile_loadd(5, al + g * 16 * kGroup, kGroup);
        _tile_loadd(6, wb + g * kBlockBytes8, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 5, 6);
        if (nb == 2) {
          _tile_loadd(7, wb + (groups + g) * kBlockBytes8, 64);
          _tile_zero(2);
          _tile_zero(3);
          _tile_dpbssd(2, 4, 7);
          _tile_dpbssd(3, 5, 7);
        }
        _tile_stored(0, &sm[0][0][0][0], 64);
        _tile_stored(1, &sm[0][1][0][0], 64);
        if (nb == 2) {
          _tile_stored(2, &sm[1][0][0][0], 64);
          _tile_stored(3, &sm[1][1][0][0], 64);
        }
      };
      std::memset(acc, 0, sizeof acc);
      products(0);
      for (int64_t g = 0; g < groups; ++g) {
        if (g + 1 < groups) products(g + 1);
        for (int c = 0; c < nb; ++c) {
          const float* d = wd + ((b + c) * groups + g) * kCols;
          const float* m = OFF ? wm + ((b + c) * groups + g) * kCols : nullptr;
          const auto& sm = sums[g & 1][c];
          tile_epilogue16<true, false, OFF>(qa, rr, groups, g, d, m, &sm[0][0][0], &sm[1][0][0], 16, &acc[c][0][0], 16);
        }
      }
      for (int c = 0; c < nb; ++c) {
        __m512 out[16];
        for (int r = 0; r < 16; ++r) out[r] = _mm512_load_ps(&acc[c][r][0]);
        store_block<16>(out, y, n, rr, (b + c) * kCols, n);
      }
    }
  _tile_release();
  return full;
}

template <bool OFF, bool S16>
inline void rows_w8(const Quantized& qa, int64_t r0, int64_t r1, int64_t k, const int8_t* wq, const float* wd,
             const float* wm, int64_t b0, int64_t b1, float* y, int64_t n, int64_t isa) {
  if (isa >= 2 && r1 - r0 < 4) {  // narrow calls: several blocks per tile (tile512n_w8)
    switch (r1 - r0) {
      case 1: narrow512_w8<1, OFF, S16>(qa, r0, k, wq, wd, wm, b0, b1, y, n); return;
      case 2: narrow512_w8<2, OFF, S16>(qa, r0, k, wq, wd, wm, b0, b1, y, n); return;
      case 3: narrow512_w8<3, OFF, S16>(qa, r0, k, wq, wd, wm, b0, b1, y, n); return;
      default: return;
    }
  }
  // AMX: wide calls' full 16-row blocks (rows_amx_w8; scales per 32 only), the rest below
  if constexpr (!S16)
    if (isa == 3 && r1 - r0 >= 16) r0 = rows_amx_w8<OFF>(qa, r0, r1, k, wq, wd, wm, b0, b1, y, n);
  for (int64_t b = b0; b < b1; ++b) {
    if (isa >= 2) {  // pairs on the VNNI tiles
      int64_t r = r0;
      for (; r + 4 <= r1; r += 4) tile512_w8<4, OFF, S16>(qa, r, k, wq, wd, wm, b, y, n, n);
      switch (r1 - r) {
        case 3: tile512_w8<3, OFF, S16>(qa, r, k, wq, wd, wm, b, y, n, n); break;
        case 2: tile512_w8<2, OFF, S16>(qa, r, k, wq, wd, wm, b, y, n, n); break;
        case 1: tile512_w8<1, OFF, S16>(qa, r, k, wq, wd, wm, b, y, n, n); break;
        default: break;
      }
    } else {
      for (int half = 0; half < 2; ++half) {
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4) tile256_w8<4, OFF, S16>(qa, r, k, wq, wd, wm, b, half, y, n, n);
        for (; r < r1; ++r) tile256_w8<1, OFF, S16>(qa, r, k, wq, wd, wm, b, half, y, n, n);
      }
    }
  }
}

// Column blocks per work item: 8 (128 columns, whose weights a row tile reuses from L1) when
// there are row chunks enough to share out, fewer for narrow calls (decode) so that every thread
// has several items to take (parallel.h): 5 items of 8 blocks for a 576-wide decode layer left
// one thread 3 and the other 2.
inline int64_t blocks_per_item(int64_t row_chunks, int64_t blocks) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if (row_chunks >= 4 * threads) return 8;
  return std::clamp<int64_t>(blocks * row_chunks / (4 * threads), 1, 8);
}


// One layer's packed weights (model/int_linear.py): 4-bit nibble blocks (w4), or 8-bit quads
// or pairs (w8, the layout by scheme: w8_quads; with ``wm`` when they are 4-bit values held
// as 8-bit); s16: 8-bit pairs with a scale (and with ``wm`` an offset) per 16 weights (GGUF
// Q6_K, Q3_K, Q2_K; wd, wm [blocks, 2 groups, 16]), whatever the scheme.
struct IntWeights {
  bool w8;
  const void* wq;
  const float* wd;
  const float* wm;  // null for symmetric 8-bit groups
  int64_t n, k;
  bool s16 = false;
  int64_t blocks() const { return (n + kCols - 1) / kCols; }
};

// How activations are quantized and which ISA path runs.
struct IntScheme {
  int bits;  // 8 or 16
  bool mixed;
  int64_t isa;  // 3 = AMX-INT8 (wide calls; AVX512-VNNI for the rest), 2 = AVX512-VNNI, 1 = AVX2
};

// How 8-bit weights are packed for a scheme (model/int_linear.py pack8, the same rule): quads
// (vpdpbusd operands, activations in hi/lo int8 parts) on AVX512-VNNI with 8-bit or mixed
// activations, where they run one pass; pairs (vpdpwssd / vpmaddwd on the integers whole,
// a16) otherwise.
inline bool w8_quads(const IntScheme& sc) { return sc.isa >= 2 && (sc.bits == 8 || sc.mixed); }

// Whether a layer's activations are quantized as whole 16-bit integers (8-bit weight pairs,
// which 16-weight groups always are: mixed and 8-bit activations are 16-bit integers there too)
// rather than hi/lo int8 parts.
inline bool whole_activations(bool w8, const IntScheme& sc, bool s16 = false) {
  return w8 && (s16 || !w8_quads(sc));
}

// Buffers of m rows for a layer of input width k.
inline void size_quantized(Quantized& qa, int64_t m, int64_t k, const IntScheme& sc, bool w8, bool s16 = false) {
  const int64_t groups = k / kGroup;
  if (whole_activations(w8, sc, s16)) {
    qa.a16.resize(static_cast<size_t>(m * k));
  } else {
    qa.lo.resize(static_cast<size_t>(m * k));
    if (sc.bits == 16) qa.hi.resize(static_cast<size_t>(m * k));
  }
  if (w8 && w8_quads(sc)) qa.isum.resize(static_cast<size_t>(m * groups));
  if (s16) qa.ssum16.resize(static_cast<size_t>(2 * m * groups));
  if (sc.mixed) qa.wide.resize(static_cast<size_t>(m * groups));
  qa.s.resize(static_cast<size_t>(m * groups));
  qa.ssum.resize(static_cast<size_t>(m * groups));
}

// Rows [r0, r1) x column blocks [b0, b1) of y [m, n] = x W^T, from the quantized rows.
inline void gemm_item(const Quantized& qa, const IntWeights& w, const IntScheme& sc, int64_t r0,
                      int64_t r1, int64_t b0, int64_t b1, float* y) {
  if (w.w8 && w8_quads(sc) && !w.s16) {  // quads: 8-bit or mixed activations
    const auto* wq = static_cast<const uint8_t*>(w.wq);
    const bool off = w.wm != nullptr;
    if (sc.mixed) {
      if (off) rows_vnni<true, true, true, true>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n, sc.isa);
      else rows_vnni<true, true, false, true>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n, sc.isa);
    } else {
      if (off) rows_vnni<false, false, true, true>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n, sc.isa);
      else rows_vnni<false, false, false, true>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n, sc.isa);
    }
    return;
  }
  if (w.w8) {
    const auto* wq = static_cast<const int8_t*>(w.wq);
    if (w.s16 && w.wm != nullptr) rows_w8<true, true>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n, sc.isa);
    else if (w.s16) rows_w8<false, true>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n, sc.isa);
    else if (w.wm != nullptr) rows_w8<true, false>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n, sc.isa);
    else rows_w8<false, false>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n, sc.isa);
    return;
  }
  const auto* wq = static_cast<const uint8_t*>(w.wq);
  if (sc.isa >= 2) {
    if (sc.mixed) rows_vnni<true, true, true, false>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n, sc.isa);
    else if (sc.bits == 16) rows_vnni<true, false, true, false>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n, sc.isa);
    else rows_vnni<false, false, true, false>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n, sc.isa);
  } else {
    if (sc.mixed) rows_avx2<true, true>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n);
    else if (sc.bits == 16) rows_avx2<true, false>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n);
    else rows_avx2<false, false>(qa, r0, r1, w.k, wq, w.wd, w.wm, b0, b1, y, w.n);
  }
}

}  // namespace prefixcache
