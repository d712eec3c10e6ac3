// K/V rows in the cache's storage formats (prefixcache/kv/formats.py): writing one token's row
// of one KV head (quantized as the Python reference does, bit for bit) and reading a row back as
// the float32 values attention computes with.
//
//   code 0 float32 | 1 bfloat16 | 2 int8, scale = absmax / 127 | 3 fp8 e4m3, scale = absmax / 448
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace prefixcache {

enum KVCode : int64_t { kF32 = 0, kBF16 = 1, kI8 = 2, kFP8 = 3 };

inline int64_t kv_elem_size(int64_t code) { return code == kF32 ? 4 : code == kBF16 ? 2 : 1; }

// One row: x [d] float32 -> dst (storage), *scale (scaled codes), seen [d] (what is stored, as
// float32). Mirrors KVFormat.quantize/dequantize op for op (float32 division, round half to
// even, clamp), so both paths store the same bytes.
inline void store_row(int64_t code, const float* x, int64_t d, void* dst, float* scale, float* seen) {
  if (code == kF32) {
    std::memcpy(dst, x, d * sizeof(float));
    if (seen != x) std::memcpy(seen, x, d * sizeof(float));
    return;
  }
  if (code == kBF16) {
    auto* o = static_cast<c10::BFloat16*>(dst);
    for (int64_t i = 0; i < d; ++i) {
      o[i] = c10::BFloat16(x[i]);
      seen[i] = static_cast<float>(o[i]);
    }
    return;
  }
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float qmax = code == kI8 ? 127.f : 448.f;
  const float s = std::max(amax / qmax, FLT_MIN);
  *scale = s;
  if (code == kI8) {
    auto* o = static_cast<int8_t*>(dst);
    for (int64_t i = 0; i < d; ++i) {
      const float r = std::min(std::max(std::nearbyint(x[i] / s), -127.f), 127.f);
      o[i] = static_cast<int8_t>(r);
      seen[i] = static_cast<float>(o[i]) * s;
    }
  } else {
    auto* o = static_cast<c10::Float8_e4m3fn*>(dst);
    for (int64_t i = 0; i < d; ++i) {
      o[i] = c10::Float8_e4m3fn(x[i] / s);
      seen[i] = static_cast<float>(o[i]) * s;
    }
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
