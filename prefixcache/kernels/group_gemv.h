// Group records (4-bit and 8-bit weights in groups of 32) times float32 rows: the tiles shared
// by group_linear.cpp (one layer per call) and decode_forward.cpp (a whole decode step). See
// group_linear.cpp for the record layout and why it is so.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace prefixcache {

constexpr int64_t kGroup = 32;
constexpr int64_t kPrefetchRecords = 16;

inline float read_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

struct Q4 {
  static constexpr int64_t kRecord = 24;
  // 16 bytes = 4 dwords; weight 8c + j (chunk c, lane j) is nibble 2c + j / 4 of dword j % 4.
  // Broadcast to both halves of a register, lane j holds dword j % 4, and one variable shift
  // per chunk brings every lane's nibble down: no byte-widening shuffles.
  static inline void load(const uint8_t* rec, __m256 w[4]) {
    const __m256 vd = _mm256_set1_ps(read_f32(rec)), vm = _mm256_set1_ps(read_f32(rec + 4));
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i sh = _mm256_setr_epi32(8 * c, 8 * c, 8 * c, 8 * c, 8 * c + 4, 8 * c + 4, 8 * c + 4, 8 * c + 4);
      const __m256i v = _mm256_and_si256(_mm256_srlv_epi32(b, sh), mask);
      w[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), vd, vm);
    }
  }
};

struct Q8 {
  static constexpr int64_t kRecord = 36;
  static inline void load(const uint8_t* rec, __m256 w[4]) {
    const __m256 vd = _mm256_set1_ps(read_f32(rec));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 4));
    const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), vd);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), vd);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), vd);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), vd);
  }
};

// One accumulator per output (i, j), summed over groups in order (within a group: weights
// 0-7, 8-15, 16-23, 24-31): the same float32 result whatever tile computed it. MT x NT tiles
// keep <= 8 accumulators: 8 x 1 (a weight rebuilt once serves 8 rows), 4 x 2, 2 x 4, and 1 x 2
// for a lone row (two independent chains hide FMA latency).
template <typename Fmt, int MT, int NT>
inline void tile(const float* x, int64_t k, const uint8_t* q, int64_t n, float* y, int64_t ldy) {
  const int64_t groups = k / kGroup;
  const int64_t row_bytes = groups * Fmt::kRecord;
  __m256 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int j = 0; j < NT; ++j) {
      const uint8_t* rec = q + (n + j) * row_bytes + g * Fmt::kRecord;
      // Past the row's end this touches the next row, or at worst one line past the tensor:
      // a prefetch never faults.
      _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetchRecords * Fmt::kRecord), _MM_HINT_T0);
      __m256 w[4];
      Fmt::load(rec, w);
      for (int i = 0; i < MT; ++i) {
        const float* xr = x + i * k + g * kGroup;
        __m256 a = acc[i][j];
        a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a);
        a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a);
        a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a);
        acc[i][j] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) y[i * ldy + n + j] = hsum(acc[i][j]);
}

template <typename Fmt, int MT, int NT>
void sweep(const float* x, int64_t k, const uint8_t* q, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) tile<Fmt, MT, NT>(x, k, q, n, y, ldy);
  for (; n < n1; ++n) tile<Fmt, MT, 1>(x, k, q, n, y, ldy);
}

// y[:, n0:n1] for all m rows of x.
template <typename Fmt>
void rows_block(const float* x, int64_t m, int64_t k, const uint8_t* q, int64_t n0, int64_t n1,
                float* y, int64_t ldy) {
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) sweep<Fmt, 8, 1>(x + i * k, k, q, n0, n1, y + i * ldy, ldy);
  for (; i + 4 <= m; i += 4) sweep<Fmt, 4, 2>(x + i * k, k, q, n0, n1, y + i * ldy, ldy);
  for (; i + 2 <= m; i += 2) sweep<Fmt, 2, 4>(x + i * k, k, q, n0, n1, y + i * ldy, ldy);
  for (; i < m; ++i) sweep<Fmt, 1, 2>(x + i * k, k, q, n0, n1, y + i * ldy, ldy);
}

}  // namespace prefixcache
