// Probe: attention scores q . K[j] from bf16 pairs, AVX512-BF16 against an AVX2 twin, bit for bit,
// and what each costs against today's float32 FMA scores (exact_attention.h block_scores).
//
// vdpbf16ps adds a lane's two bf16 products to its float32 sum one at a time, the odd pair
// element first, each sum rounded, subnormal results flushed (benchmarks/probes/bf16_dot.cpp
// pinned that order on Zen 4). A product of two bf16 values is exact in float32, so the AVX2 twin
// is two FMAs per pair in that order (FMA of an exact product rounds once, like the add), with
// MXCSR's flush-to-zero and denormals-are-zero set on both paths for the subnormal cases. This
// checks that claim on random heads plus adversarial lanes (tiny values, exact cancellations)
// and times the three ways for a block of 32 queries over 4,096 keys, head dim 64.
//
//   g++ -O3 -march=native -ffp-contract=off benchmarks/probes/bf16_scores.cpp -o /tmp/bf16_scores && /tmp/bf16_scores
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int D = 64, N = 4096, Q = 32;

uint16_t to_bf16(float x) {  // round to nearest even; values below 2^-60 in magnitude become 0
  if (std::fabs(x) < 0x1p-60f) return 0;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

struct Data {
  std::vector<float> qf, kt;          // float32: q [Q][D], K per block of 32 keys transposed [N/32][D][32] (today's layout)
  std::vector<uint16_t> qb, kp;       // bf16: q [Q][D], K per block as pairs [N/32][D/2][32][2]
};

Data make(uint32_t seed) {
  Data x;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  x.qf.resize(Q * D);
  x.kt.resize(size_t(D) * N);
  std::vector<float> k(size_t(N) * D);
  for (auto& v : x.qf) v = nd(rng);
  for (auto& v : k) v = nd(rng) * 2.f;
  for (int j = 0; j < 64; ++j) {  // adversarial keys: tiny values, and pairs that cancel exactly
    for (int d = 0; d < D; ++d) k[size_t(j) * D + d] = (j % 2 ? 1e-30f : 3e-19f) * nd(rng);
  }
  for (int j = 64; j < 96; ++j)
    for (int d = 0; d < D; d += 2) {
      k[size_t(j) * D + d] = x.qf[d + 1];  // q0 k0 = q0 q1, q1 k1 = -q1 q0: the pair sums to 0
      k[size_t(j) * D + d + 1] = -x.qf[d];
    }
  x.qb.resize(Q * D);
  for (int i = 0; i < Q * D; ++i) x.qb[i] = to_bf16(x.qf[i]);
  x.kp.resize(size_t(D) * N);
  for (int j = 0; j < N; ++j)
    for (int d = 0; d < D; ++d) {
      const size_t blk = size_t(j / 32) * 32 * D;
      x.kt[blk + size_t(d) * 32 + j % 32] = k[size_t(j) * D + d];
      x.kp[blk + (size_t(d / 2) * 32 + j % 32) * 2 + d % 2] = to_bf16(k[size_t(j) * D + d]);
    }
  return x;
}

// today's float32 scores: 8 keys a vector, one FMA per dimension; NQ queries share each key load
// (exact_attention.h runs 2 or 3)
template <int NQ>
__attribute__((target("avx2,fma"))) void scores_f32(const Data& x, float* s) {
  for (int q = 0; q < Q; q += NQ)
    for (int j = 0; j < N; j += 32) {
      __m256 a[NQ][4];
      for (int i = 0; i < NQ; ++i)
        for (int t = 0; t < 4; ++t) a[i][t] = _mm256_setzero_ps();
      for (int d = 0; d < D; ++d) {
        const float* row = &x.kt[size_t(j) * D + size_t(d) * 32];
        for (int i = 0; i < NQ; ++i) {
          const __m256 v = _mm256_set1_ps(x.qf[(q + i) * D + d]);
          for (int t = 0; t < 4; ++t) a[i][t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(row + 8 * t), a[i][t]);
        }
      }
      for (int i = 0; i < NQ; ++i)
        for (int t = 0; t < 4; ++t) _mm256_storeu_ps(s + size_t(q + i) * N + j + 8 * t, a[i][t]);
    }
}

// AVX512-BF16: 16 keys a vector, one vdpbf16ps per pair of dimensions
template <int NQ>
__attribute__((target("avx512f,avx512bf16"))) void scores_bf16(const Data& x, float* s) {
  for (int q = 0; q < Q; q += NQ)
    for (int j = 0; j < N; j += 32) {
      __m512 a[NQ][2];
      for (int i = 0; i < NQ; ++i) a[i][0] = a[i][1] = _mm512_setzero_ps();
      for (int p = 0; p < D / 2; ++p) {
        const uint16_t* row = &x.kp[size_t(j) * D + size_t(p) * 64];
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(row), k1 = (__m512bh)_mm512_loadu_si512(row + 32);
        for (int i = 0; i < NQ; ++i) {
          uint32_t pair;
          std::memcpy(&pair, &x.qb[(q + i) * D + 2 * p], 4);
          const __m512bh v = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          a[i][0] = _mm512_dpbf16_ps(a[i][0], k0, v);
          a[i][1] = _mm512_dpbf16_ps(a[i][1], k1, v);
        }
      }
      for (int i = 0; i < NQ; ++i) {
        _mm512_storeu_ps(s + size_t(q + i) * N + j, a[i][0]);
        _mm512_storeu_ps(s + size_t(q + i) * N + j + 16, a[i][1]);
      }
    }
}

// the AVX2 twin: per pair, the odd element's product then the even one's, each an FMA
template <int NQ>
__attribute__((target("avx2,fma"))) void scores_twin(const Data& x, float* s) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int q = 0; q < Q; q += NQ)
    for (int j = 0; j < N; j += 32) {
      __m256 a[NQ][4];
      for (int i = 0; i < NQ; ++i)
        for (int t = 0; t < 4; ++t) a[i][t] = _mm256_setzero_ps();
      for (int p = 0; p < D / 2; ++p) {
        const uint16_t* row = &x.kp[size_t(j) * D + size_t(p) * 64];
        for (int t = 0; t < 4; ++t) {
          const __m256i kv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * t));
          const __m256 k1 = _mm256_castsi256_ps(_mm256_and_si256(kv, hi));
          const __m256 k0 = _mm256_castsi256_ps(_mm256_slli_epi32(kv, 16));
          for (int i = 0; i < NQ; ++i) {
            const __m256 q0 = _mm256_set1_ps(from_bf16(x.qb[(q + i) * D + 2 * p]));
            const __m256 q1 = _mm256_set1_ps(from_bf16(x.qb[(q + i) * D + 2 * p + 1]));
            a[i][t] = _mm256_fmadd_ps(q0, k0, _mm256_fmadd_ps(q1, k1, a[i][t]));
          }
        }
      }
      for (int i = 0; i < NQ; ++i)
        for (int t = 0; t < 4; ++t) _mm256_storeu_ps(s + size_t(q + i) * N + j + 8 * t, a[i][t]);
    }
}

template <typename F>
double best_seconds(F f, const Data& x, float* s) {
  f(x, s);
  double best = 1e30;
  for (int i = 0; i < 20; ++i) {
    const auto t = std::chrono::steady_clock::now();
    f(x, s);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
  }
  return best;
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::printf("no AVX512-BF16 here\n");
    return 1;
  }
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ | DAZ, on every path
  size_t differ = 0, total = 0;
  for (uint32_t seed = 1; seed <= 8; ++seed) {
    Data x = make(seed);
    std::vector<float> a(size_t(Q) * N), b(size_t(Q) * N);
    scores_bf16<4>(x, a.data());
    scores_twin<2>(x, b.data());
    for (size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], 4) != 0;
    total += a.size();
  }
  std::printf("bf16 scores vs the AVX2 twin: %zu of %zu differ (FTZ/DAZ set)\n", differ, total);
  Data x = make(99);
  std::vector<float> s(size_t(Q) * N);
  const double flops = 2.0 * Q * N * D;
  const double f32 = best_seconds(scores_f32<2>, x, s.data()), bf = best_seconds(scores_bf16<4>, x, s.data()),
               tw = best_seconds(scores_twin<2>, x, s.data());
  std::printf("one thread, %d queries x %d keys x %d: float32 FMA (2 queries a pass) %.1f GFLOP/s, vdpbf16ps (4) %.1f (%.2fx), AVX2 twin (2) %.1f (%.2fx)\n",
              Q, N, D, flops / f32 / 1e9, flops / bf / 1e9, f32 / bf, flops / tw / 1e9, f32 / tw);
  return 0;
}
