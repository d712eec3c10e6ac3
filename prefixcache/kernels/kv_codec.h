// K/V rows in the cache's storage formats (prefixcache/kv/formats.py): writing one token's row
// of one KV head (quantized as the Python reference does, bit for bit) and reading a row back as
// the float32 values attention computes with.
//
//   code 0 float32 | 1 bfloat16 | 2 int8, scale = absmax / 127 | 3 fp8 e4m3, scale = absmax / 448
//   | 5 int16, scale = absmax / 4095 (13 bits in 16: int_attention.h's integer sums stay in int32)
//
// Rows of every format but int16 are stored whole at their slot: [KVH, N, D]. int16 K/V are
// stored in units of 16 slots in the layouts the integer products read (no transposing copy at
// attention time; int_attention.h): in each KV head's plane, the unit at slots [u, u + 16) holds
//   K: [D / 2][16] int32, dimensions (2p, 2p + 1) of slot u + j at int32 p * 16 + j
//   V: [8][D] int32, dimension e of slots (u + 2i, u + 2i + 1) at int32 i * D + e
// so a unit is still the same 16 * D values (a block of 16 or a multiple of 16 slots keeps its
// bytes together, for the tiers), only permuted inside. Python's mirror: kv/formats.py.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace prefixcache {

enum KVCode : int64_t { kF32 = 0, kBF16 = 1, kI8 = 2, kFP8 = 3, kI16 = 5 };

constexpr int64_t kUnit = 16;  // slots per int16 unit

// Offsets, in int16 elements from the start of a slot's unit, of its dimension e.
inline int64_t unit_k_index(int64_t off, int64_t e) { return ((e >> 1) * kUnit + off) * 2 + (e & 1); }
inline int64_t unit_v_index(int64_t off, int64_t e, int64_t d) { return ((off >> 1) * d + e) * 2 + (off & 1); }

inline bool kv_code_known(int64_t code) { return (code >= kF32 && code <= kFP8) || code == kI16; }
inline bool kv_scaled(int64_t code) { return code == kI8 || code == kFP8 || code == kI16; }
inline int64_t kv_elem_size(int64_t code) { return code == kF32 ? 4 : (code == kBF16 || code == kI16) ? 2 : 1; }

// int16 rows, 8 lanes at a time (d a multiple of 8): the same IEEE operations as the scalar loop
// below for finite x (|x| maxima in any order, x / s, round half to even, the clamp), so the same
// bytes. seen may be null (the caller reads the pool instead).
inline void store_row_i16(const float* x, int64_t d, int16_t* o, float* scale, float* seen) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) vmax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), vmax);
  const float s = std::max(hmax(vmax) / 4095.f, FLT_MIN);
  *scale = s;
  const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps(4095.f), lo = _mm256_set1_ps(-4095.f);
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 r = _mm256_min_ps(
        _mm256_max_ps(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo),
        hi);
    const __m256i q = _mm256_cvtps_epi32(r);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i),
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packs_epi32(q, q), 0xD8)));
    if (seen) _mm256_storeu_ps(seen + i, _mm256_mul_ps(_mm256_cvtepi32_ps(q), vs));
  }
}

// One row: x [d] float32 -> dst (storage), *scale (scaled codes), seen [d] (what is stored, as
// float32; may be null). Mirrors KVFormat.quantize/dequantize op for op (float32 division, round
// half to even, clamp), so both paths store the same bytes.
inline void store_row(int64_t code, const float* x, int64_t d, void* dst, float* scale, float* seen) {
  if (code == kF32) {
    std::memcpy(dst, x, d * sizeof(float));
    if (seen && seen != x) std::memcpy(seen, x, d * sizeof(float));
    return;
  }
  if (code == kBF16) {
    auto* o = static_cast<c10::BFloat16*>(dst);
    for (int64_t i = 0; i < d; ++i) {
      o[i] = c10::BFloat16(x[i]);
      if (seen) seen[i] = static_cast<float>(o[i]);
    }
    return;
  }
  if (code == kI16 && d % 8 == 0) {
    store_row_i16(x, d, static_cast<int16_t*>(dst), scale, seen);
    return;
  }
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float qmax = code == kI8 ? 127.f : code == kI16 ? 4095.f : 448.f;
  const float s = std::max(amax / qmax, FLT_MIN);
  *scale = s;
  if (code == kI16) {
    auto* o = static_cast<int16_t*>(dst);
    for (int64_t i = 0; i < d; ++i) {
      const float r = std::min(std::max(std::nearbyint(x[i] / s), -4095.f), 4095.f);
      o[i] = static_cast<int16_t>(r);
      if (seen) seen[i] = static_cast<float>(o[i]) * s;
    }
  } else if (code == kI8) {
    auto* o = static_cast<int8_t*>(dst);
    for (int64_t i = 0; i < d; ++i) {
      const float r = std::min(std::max(std::nearbyint(x[i] / s), -127.f), 127.f);
      o[i] = static_cast<int8_t>(r);
      if (seen) seen[i] = static_cast<float>(o[i]) * s;
    }
  } else {
    auto* o = static_cast<c10::Float8_e4m3fn*>(dst);
    for (int64_t i = 0; i < d; ++i) {
      o[i] = c10::Float8_e4m3fn(x[i] / s);
      if (seen) seen[i] = static_cast<float>(o[i]) * s;
    }
  }
}

// One token's K or V row of one KV head into its slot of a plane ([N, D] in the storage format):
// store_row's numbers, placed whole at the slot, or for int16 scattered into the slot's unit.
inline void store_token(int64_t code, const float* x, int64_t d, uint8_t* plane, int64_t slot, bool is_v,
                        float* scale, float* seen) {
  if (code != kI16) {
    store_row(code, x, d, plane + slot * d * kv_elem_size(code), scale, seen);
    return;
  }
  int16_t row[256];
  store_row(code, x, d, row, scale, seen);
  auto* unit = reinterpret_cast<int16_t*>(plane) + (slot - slot % kUnit) * d;
  const int64_t off = slot % kUnit;
  if (is_v) {  // int16 by int16: the other slot of each pair may be another thread's token
    for (int64_t e = 0; e < d; ++e) unit[unit_v_index(off, e, d)] = row[e];
  } else {  // dimension pairs (2p, 2p + 1) whole, as one int32 each (unit_k_index)
    auto* unit32 = reinterpret_cast<int32_t*>(unit);
    int32_t pairs[128];
    std::memcpy(pairs, row, d * sizeof(int16_t));
    for (int64_t p = 0; p < d / 2; ++p) unit32[p * kUnit + off] = pairs[p];
  }
}

// 8 stored values -> float32 (before the scale). fp8 e4m3: exponent and mantissa moved into a
// float's fields and multiplied by 2^120 (exact, subnormals included), the sign put back.
inline __m256 load8(int64_t code, const uint8_t* p) {
  if (code == kBF16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  }
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if (code == kI8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m256i v = _mm256_cvtepu8_epi32(b);
  const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7F)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  const __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(1.329227995784916e36f));
  return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}

// A stored row (d a multiple of 8) -> out [d] float32, the values attention sees.
inline void load_row(int64_t code, const void* src, float scale, int64_t d, float* out) {
  const auto* p = static_cast<const uint8_t*>(src);
  if (code == kF32) {
    std::memcpy(out, src, d * sizeof(float));
    return;
  }
  const int64_t es = kv_elem_size(code);
  const __m256 vs = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < d; i += 8) {
    __m256 f = load8(code, p + i * es);
    if (code != kBF16) f = _mm256_mul_ps(f, vs);
    _mm256_storeu_ps(out + i, f);
  }
}

}  // namespace prefixcache
