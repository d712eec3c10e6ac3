// Probe: which scalar float32 sequence reproduces vdpbf16ps (AVX512-BF16) bit for bit on this CPU,
// the question an AVX2 twin of a bf16 attention path has to answer (docs/benchmarks-journal.md, "Where a
// hit's time goes now"). Random bf16 pairs and float32 accumulators: a sixteenth of the inputs
// subnormal, a sixteenth tiny normals (their products are subnormal), the rest moderate; each
// candidate emulation is compared with the instruction lane by lane.
//
//   g++ -O1 -ffp-contract=off -o /tmp/bf16_dot benchmarks/probes/bf16_dot.cpp && /tmp/bf16_dot
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

static float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static float flush(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x; }
static bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

__attribute__((target("avx512f,avx512bf16,avx512vl"))) static void instruction(const float* acc, const uint16_t* a,
                                                                              const uint16_t* b, float* out) {
  __m256bh va, vb;
  std::memcpy(&va, a, 32);
  std::memcpy(&vb, b, 32);
  _mm256_storeu_ps(out, _mm256_dpbf16_ps(_mm256_loadu_ps(acc), va, vb));
}

int main() {
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::printf("this CPU has no AVX512-BF16\n");
    return 0;
  }
  const char* names[] = {"c + a0 b0, then + a1 b1 (subnormals flushed)", "c + a1 b1, then + a0 b0 (subnormals flushed)",
                         "c + (a0 b0 + a1 b1)", "one rounding (float64 sum)",
                         "c + a1 b1, then + a0 b0 (products flushed too)"};
  constexpr int kN = 5;
  long lanes = 0, differ[kN] = {0}, value_differ[kN] = {0};
  std::mt19937 rng(1);
  for (int it = 0; it < 200000; ++it) {
    float acc[8], out[8];
    uint16_t a[16], b[16];
    const auto draw = [&]() {
      const uint32_t u = rng(), kind = rng() % 16;
      if (kind == 0) return u & 0x807FFFFFu;                   // subnormal
      if (kind == 1) return (u & 0x80FFFFFFu) | 0x00800000u;   // tiny normal
      return (u & 0x8FFFFFFFu) | 0x30000000u;                  // moderate
    };
    for (int i = 0; i < 16; ++i) a[i] = uint16_t(draw() >> 16), b[i] = uint16_t(draw() >> 16);
    for (int i = 0; i < 8; ++i) {
      uint32_t u = rng();
      u = rng() % 8 == 0 ? (u & 0x807FFFFF) : (u & 0x8FFFFFFF) | 0x20000000;
      std::memcpy(&acc[i], &u, 4);
    }
    instruction(acc, a, b, out);
    for (int i = 0; i < 8; ++i, ++lanes) {
      const float a0 = flush(from_bf16(a[2 * i])), a1 = flush(from_bf16(a[2 * i + 1]));
      const float b0 = flush(from_bf16(b[2 * i])), b1 = flush(from_bf16(b[2 * i + 1]));
      const float c = flush(acc[i]);
      volatile float t, e[kN];
      t = flush(c + a0 * b0), e[0] = flush(t + a1 * b1);
      t = flush(c + a1 * b1), e[1] = flush(t + a0 * b0);
      t = a0 * b0 + a1 * b1, e[2] = flush(c + flush(t));
      e[3] = flush(float(double(c) + double(a0) * b0 + double(a1) * b1));
      t = flush(c + flush(a1 * b1)), e[4] = flush(t + flush(a0 * b0));
      for (int k = 0; k < kN; ++k) {
        differ[k] += !same_bits(e[k], out[i]);
        value_differ[k] += !(e[k] == out[i]) && !(std::isnan(e[k]) && std::isnan(out[i]));
      }
    }
  }
  for (int k = 0; k < kN; ++k)
    std::printf("%-48s lanes %ld: %ld differ in bits, %ld in value\n", names[k], lanes, differ[k], value_differ[k]);
}
