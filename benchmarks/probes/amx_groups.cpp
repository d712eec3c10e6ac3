// Probe: can AMX-INT8 beat the AVX512-VNNI group kernels while keeping their exactness?
//
// The exact path's sums are per group of 32 inputs (the GGUF's groups): an int32 dot product
// per (row, column, group), then a float epilogue in one fixed order, so a row's numbers never
// depend on the blocking. AMX computes 16x16 int32 tiles; with one group per tile product
// (A tile 16 rows x 32 bytes, B tile 8 rows x 64 bytes) its sums are the same integers, and the
// epilogue reads them back from a stored tile. This measures that scheme on int8 x int8 groups
// (tdpbssd) against a scalar reference of the same arithmetic (bitwise) and reports GOP/s, to
// compare with benchmarks/kernel_rates.py on the same host (ours, and torch._int_mm).
//
// Build and run (a host with amx_int8; docs/benchmarks-journal.md "A GPU machine"):
//   g++ -O3 -march=sapphirerapids -fopenmp -ffp-contract=off benchmarks/probes/amx_groups.cpp -o /tmp/amx_groups
//   /tmp/amx_groups            # OMP_NUM_THREADS sets the threads
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int G = 32;  // inputs per group

bool amx_permitted() {
  // Linux hands out the tile data state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 4; t++) c.rows[t] = 16, c.colsb[t] = 64;  // C: 16 x 16 int32
  for (int t = 4; t < 6; t++) c.rows[t] = 16, c.colsb[t] = 32;  // A: 16 rows x one group
  for (int t = 6; t < 8; t++) c.rows[t] = 8, c.colsb[t] = 64;   // B: one group x 16 columns
  _tile_loadconfig(&c);
}

struct Problem {
  int m, k, n, groups;
  std::vector<int8_t> a;      // [m][k]
  std::vector<int8_t> w;      // [n][k]
  std::vector<int8_t> packed; // [n/16][groups][8][16][4]: B tiles, k in quads
  std::vector<float> sa;      // [m][groups]
  std::vector<float> sw;      // [groups][n]
};

Problem make(int m, int k, int n, uint32_t seed) {
  Problem p{m, k, n, k / G, {}, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> q(-128, 127);
  std::uniform_real_distribution<float> s(1e-3f, 2e-2f);
  p.a.resize(size_t(m) * k);
  p.w.resize(size_t(n) * k);
  for (auto& x : p.a) x = int8_t(q(rng));
  for (auto& x : p.w) x = int8_t(q(rng));
  for (int i = 0; i < 64 && i < m; i++) std::memset(&p.a[size_t(i) * k], i % 2 ? 127 : -128, k);  // extremes
  p.sa.resize(size_t(m) * p.groups);
  p.sw.resize(size_t(p.groups) * n);
  for (auto& x : p.sa) x = s(rng);
  for (auto& x : p.sw) x = s(rng);
  p.packed.resize(size_t(n) * k);
  for (int c = 0; c < n; c++)
    for (int kk = 0; kk < k; kk++) {
      int g = kk / G, kq = (kk % G) / 4, t = kk % 4, nb = c / 16, j = c % 16;
      p.packed[((size_t(nb) * p.groups + g) * 8 + kq) * 64 + j * 4 + t] = p.w[size_t(c) * k + kk];
    }
  return p;
}

// The arithmetic, plainly: per group an exact int32 dot, then acc = acc + isum * (sw * sa).
void reference(const Problem& p, std::vector<float>& out) {
  out.assign(size_t(p.m) * p.n, 0.f);
#pragma omp parallel for
  for (int r = 0; r < p.m; r++)
    for (int c = 0; c < p.n; c++) {
      float acc = 0.f;
      for (int g = 0; g < p.groups; g++) {
        int32_t isum = 0;
        for (int i = 0; i < G; i++)
          isum += int32_t(p.a[size_t(r) * p.k + g * G + i]) * p.w[size_t(c) * p.k + g * G + i];
        acc = acc + float(isum) * (p.sw[size_t(g) * p.n + c] * p.sa[size_t(r) * p.groups + g]);
      }
      out[size_t(r) * p.n + c] = acc;
    }
}

// One group's four tile products of a 32 x 32 block into C tiles 0-3 (A tiles 4, 5; B 6, 7).
void group_products(const Problem& p, int r0, int c0, int g) {
  _tile_loadd(4, &p.a[size_t(r0) * p.k + g * G], p.k);
  _tile_loadd(5, &p.a[size_t(r0 + 16) * p.k + g * G], p.k);
  _tile_loadd(6, &p.packed[(size_t(c0 / 16) * p.groups + g) * 512], 64);
  _tile_loadd(7, &p.packed[(size_t(c0 / 16 + 1) * p.groups + g) * 512], 64);
  _tile_dpbssd(0, 4, 6);
  _tile_dpbssd(1, 4, 7);
  _tile_dpbssd(2, 5, 6);
  _tile_dpbssd(3, 5, 7);
}

void store_sums(int32_t (&sums)[32][32]) {
  _tile_stored(0, &sums[0][0], 128);
  _tile_stored(1, &sums[0][16], 128);
  _tile_stored(2, &sums[16][0], 128);
  _tile_stored(3, &sums[16][16], 128);
}

// 32 x 32 output blocks: two A tiles (rows), two B tiles (columns), four C tiles; per group the
// four products, a store of the sums, and the epilogue from the stored block.
void amx(const Problem& p, std::vector<float>& out) {
  out.assign(size_t(p.m) * p.n, 0.f);
  const int mb = p.m / 32, nb = p.n / 32;
#pragma omp parallel
  {
    configure_tiles();
    alignas(64) int32_t sums[32][32];
    alignas(64) float acc[32][32];
#pragma omp for schedule(static)
    for (int blk = 0; blk < mb * nb; blk++) {
      const int c0 = (blk % nb) * 32, r0 = (blk / nb) * 32;
      std::memset(acc, 0, sizeof acc);
      for (int g = 0; g < p.groups; g++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        group_products(p, r0, c0, g);
        store_sums(sums);
        const __m512 w0 = _mm512_loadu_ps(&p.sw[size_t(g) * p.n + c0]);
        const __m512 w1 = _mm512_loadu_ps(&p.sw[size_t(g) * p.n + c0 + 16]);
        for (int r = 0; r < 32; r++) {
          const __m512 s = _mm512_set1_ps(p.sa[size_t(r0 + r) * p.groups + g]);
          const __m512 v0 = _mm512_cvtepi32_ps(_mm512_load_si512(&sums[r][0]));
          const __m512 v1 = _mm512_cvtepi32_ps(_mm512_load_si512(&sums[r][16]));
          _mm512_store_ps(&acc[r][0], _mm512_add_ps(_mm512_load_ps(&acc[r][0]), _mm512_mul_ps(v0, _mm512_mul_ps(w0, s))));
          _mm512_store_ps(&acc[r][16], _mm512_add_ps(_mm512_load_ps(&acc[r][16]), _mm512_mul_ps(v1, _mm512_mul_ps(w1, s))));
        }
      }
      for (int r = 0; r < 32; r++) std::memcpy(&out[size_t(r0 + r) * p.n + c0], acc[r], sizeof acc[r]);
    }
    _tile_release();
  }
}

// The ceiling: the same tiles summing all of K in int32 (per-channel scales, as torch._int_mm
// would use): no per-group store or epilogue. Not the exact path's arithmetic; not compared.
void amx_whole_k(const Problem& p, std::vector<float>& out) {
  out.assign(size_t(p.m) * p.n, 0.f);
  const int mb = p.m / 32, nb = p.n / 32;
#pragma omp parallel
  {
    configure_tiles();
    alignas(64) int32_t sums[32][32];
#pragma omp for schedule(static)
    for (int blk = 0; blk < mb * nb; blk++) {
      const int c0 = (blk % nb) * 32, r0 = (blk / nb) * 32;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int g = 0; g < p.groups; g++) {
        group_products(p, r0, c0, g);
      }
      store_sums(sums);
      for (int r = 0; r < 32; r++)
        for (int c = 0; c < 32; c++)
          out[size_t(r0 + r) * p.n + c0 + c] = float(sums[r][c]) * p.sw[c0 + c] * p.sa[size_t(r0 + r) * p.groups];
    }
    _tile_release();
  }
}

double seconds(void (*f)(const Problem&, std::vector<float>&), const Problem& p, std::vector<float>& out) {
  f(p, out);  // warm
  double best = 1e30;
  for (int i = 0; i < 5; i++) {
    auto t = std::chrono::steady_clock::now();
    f(p, out);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
  }
  return best;
}

}  // namespace

int main() {
  if (!amx_permitted()) {
    std::printf("AMX tile data not permitted by the kernel\n");
    return 1;
  }
  std::printf("threads %d\n", omp_get_max_threads());
  const int shapes[][3] = {{128, 1536, 576}, {512, 1536, 576}, {512, 576, 1536}, {128, 8192, 2048},
                           {512, 8192, 2048}, {512, 2048, 8192}};
  for (auto& s : shapes) {
    Problem p = make(s[0], s[1], s[2], 7);
    std::vector<float> ref, got;
    reference(p, ref);
    double t = seconds(amx, p, got);
    size_t diff = 0;
    for (size_t i = 0; i < ref.size(); i++) diff += std::memcmp(&ref[i], &got[i], 4) != 0;
    const double ops = 2.0 * s[0] * s[1] * s[2];
    const double t_whole = seconds(amx_whole_k, p, got);
    std::printf("M=%d K=%d N=%d  amx int8 groups %8.1f GOP/s (differing outputs %zu of %zu)  whole-K ceiling %8.1f GOP/s\n",
                s[0], s[1], s[2], ops / t / 1e9, diff, ref.size(), ops / t_whole / 1e9);
  }
  return 0;
}
