// Probe: the exact integer attention's products (prefixcache/kernels/int_attention.h) on
// AMX-INT8 tiles. Result (docs/benchmarks-journal.md "AMX tiles for attention, tried"): the same int32
// bit for bit, 2.3x / 1.5x faster than the VNNI products for scores / values in isolation, but
// 12% slower in place (the kernel's groups of 16 queries on the tiles, the rest on VNNI): not kept.
//
// Method. AMX multiplies int8 by int8 into int32; the attention's operands are wider (q up to 14
// bits, K/V 13, the value weights u 14, all int16). Each is split into bytes that fit a signed
// int8:  x = 128 xh + xl,  xh = x >> 7,  xl = x & 127, so
//   a . b = 2^14 (ah . bh) + 2^7 (ah . bl + al . bh) + al . bl
// three int32 tile sums combined with shifts and adds: exact, since the true sum fits in int32,
// tiles wrap modulo 2^32 and never saturate. All tiles 16 rows x 64 bytes (one configuration):
//   scores per unit of 16 keys and 64 dimensions: A qh, ql (16 queries); B kh, kl (row r:
//     dimensions 4r..4r+3 of the 16 keys); hh += qh.kh, mid += qh.kl + ql.kh, ll += ql.kl.
//   values per 16 dimensions: A = [uh | ul] (the block's 32 keys twice); B hh = [vh ; 0],
//     mid = [vl ; vh], ll = [0 ; vl]: one product each.
// The B images are built once per (work item, block of 32 keys) from the pool's 16-slot units.
//
// Also found: GCC 12's _tile_loadconfig names only the first 8 bytes of the configuration as read,
// so without a compiler barrier it dropped the stores of the tile shapes and ldtilecfg faulted
// (int_gemm.h's configuration has the barrier since).
//
// It calls the kernel's value products and fold as separate passes (block_values_int,
// fold_values), which int_attention.h has run as one (values_fold_*) since 2026-12-08: build it
// against the kernels it was written for (`git worktree add /tmp/k509 509632f`, then
// -I/tmp/k509/prefixcache/kernels in the command below).
//
// Build and run on a host with amx_int8 (prints ns per query-key pair, one thread):
//   g++ -O3 -mavx2 -mfma -mf16c -ffp-contract=off -Iprefixcache/kernels \
//       -I.venv/lib/python3.11/site-packages/torch/include benchmarks/probes/amx_attention.cpp -o /tmp/amx_attention
//   /tmp/amx_attention
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "int_attention.h"

namespace prefixcache::exact {


constexpr int64_t kIsaAmx = 3;  // int_gemm.h's code; the caller has checked the CPU grants AMX
constexpr int kAmxQ = 16;       // queries per tile product

struct alignas(64) AmxAttentionConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-2 the hh / mid / ll sums; 4-7 operands (scores: 4 qh, 5 ql, 6 kh, 7 kl; values: 4 u,
// 5-7 the three V images). Loaded by each call that uses them: other code on this thread
// (oneDNN, the linear layers' tiles) configures the tiles for itself.
__attribute__((target("amx-tile"))) inline void amx_attention_begin() {
  AmxAttentionConfig cfg;
  for (int t = 0; t < 8; ++t)
    if (t != 3) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // GCC's _tile_loadconfig names only the first 8 bytes of the configuration as read: without
  // this barrier it dropped the stores of the tile shapes and ldtilecfg faulted on the garbage
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
__attribute__((target("amx-tile"))) inline void amx_attention_end() { _tile_release(); }

// The B images of one block of 32 keys; the bytes neither image writes stay zero (thread_local).
struct AmxBlock {
  alignas(64) int8_t k[2][kMaxD / 64][2][16 * 64];  // [unit][64-dim chunk][kh, kl][row][64]
  alignas(64) int8_t v[kMaxD / 16][3][16 * 64];     // [16 dims][hh, mid, ll][row][64]
};

// Sixteen int32 pairs from a and b (pair rows r and r + 1 of a unit) as eight groups of four int16
// (a's pair, b's pair) in lane order: lanes 0-7 in lo, 8-15 in hi.
__attribute__((target("avx512f,avx512bw"))) inline void quad_rows(const int32_t* a, const int32_t* b,
                                                                 __m512i& lo, __m512i& hi) {
  const __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b);
  const __m512i i0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(8));
  lo = _mm512_permutex2var_epi32(va, i0, vb);
  hi = _mm512_permutex2var_epi32(va, i1, vb);
}

// 32 int16 -> their high (x >> 7) and low (x & 127) bytes.
__attribute__((target("avx512f,avx512bw"))) inline void split_bytes(__m512i x, __m256i& h, __m256i& l) {
  h = _mm512_cvtepi16_epi8(_mm512_srai_epi16(x, 7));
  l = _mm512_cvtepi16_epi8(_mm512_and_si512(x, _mm512_set1_epi16(127)));
}

// The block's B images from its two units (K: [D / 2][16] int32 pairs; V: [8][D]).
__attribute__((target("avx512f,avx512bw"))) inline void amx_block_images(const int32_t* const* uk,
                                                                        const int32_t* const* uv, int64_t d,
                                                                        AmxBlock& b) {
  __m512i lo, hi;
  __m256i h0, l0, h1, l1;
  for (int u = 0; u < 2; ++u)
    for (int64_t c = 0; c < d / 64; ++c)
      for (int r = 0; r < 16; ++r) {  // dimensions 64c + 4r .. + 3 = pair rows 32c + 2r, + 1
        const int64_t p = 32 * c + 2 * r;
        quad_rows(uk[u] + p * kUnit, uk[u] + (p + 1) * kUnit, lo, hi);
        split_bytes(lo, h0, l0);
        split_bytes(hi, h1, l1);
        int8_t* kh = b.k[u][c][0] + r * 64;
        int8_t* kl = b.k[u][c][1] + r * 64;
        _mm256_store_si256(reinterpret_cast<__m256i*>(kh), h0);
        _mm256_store_si256(reinterpret_cast<__m256i*>(kh + 32), h1);
        _mm256_store_si256(reinterpret_cast<__m256i*>(kl), l0);
        _mm256_store_si256(reinterpret_cast<__m256i*>(kl + 32), l1);
      }
  for (int64_t t = 0; t < d / 16; ++t)
    for (int u = 0; u < 2; ++u)
      for (int r = 0; r < 4; ++r) {  // keys 4r .. 4r + 3 of unit u = pair rows 2r, 2r + 1
        quad_rows(uv[u] + 2 * r * d + 16 * t, uv[u] + (2 * r + 1) * d + 16 * t, lo, hi);
        split_bytes(lo, h0, l0);
        split_bytes(hi, h1, l1);
        const int row = 4 * u + r;
        auto put = [&](int img, int at, __m256i x0, __m256i x1) {
          int8_t* dst = b.v[t][img] + at * 64;
          _mm256_store_si256(reinterpret_cast<__m256i*>(dst), x0);
          _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 32), x1);
        };
        put(0, row, h0, h1);      // hh: [vh ; 0]
        put(1, row, l0, l1);      // mid: [vl ; vh]
        put(1, 8 + row, h0, h1);
        put(2, 8 + row, l0, l1);  // ll: [0 ; vl]
      }
}

// Queries' rounded integers (int16 pairs, d / 2 of them each) as the scores' A rows: high bytes
// to qh[.. d), low to ql.
__attribute__((target("avx512f,avx512bw"))) inline void amx_query_bytes(const int32_t* pairs, int64_t d,
                                                                       int8_t* qh, int8_t* ql) {
  for (int64_t i = 0; i < d; i += 32) {
    __m256i h, l;
    split_bytes(_mm512_loadu_si512(pairs + i / 2), h, l);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qh + i), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ql + i), l);
  }
}

// (hh << 14) + (mid << 7) + ll for 16 sums.
__attribute__((target("avx512f"))) inline __m512i amx_combine(const int32_t* hh, const int32_t* mid,
                                                              const int32_t* ll) {
  const __m512i a = _mm512_slli_epi32(_mm512_load_si512(hh), 14);
  const __m512i b = _mm512_slli_epi32(_mm512_load_si512(mid), 7);
  return _mm512_add_epi32(_mm512_add_epi32(a, b), _mm512_load_si512(ll));
}

// dot[i][0..32) for 16 queries (A rows qh/ql + i * d) and the block's 32 keys.
__attribute__((target("amx-tile,amx-int8,avx512f"))) inline void scores_amx(const AmxBlock& b, const int8_t* qh,
                                                                          const int8_t* ql, int64_t d,
                                                                          int32_t (*dot)[kKeys]) {
  alignas(64) int32_t s[3][16][16];
  for (int u = 0; u < 2; ++u) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t c = 0; c < d / 64; ++c) {
      _tile_loadd(4, qh + 64 * c, d);
      _tile_loadd(5, ql + 64 * c, d);
      _tile_loadd(6, b.k[u][c][0], 64);
      _tile_loadd(7, b.k[u][c][1], 64);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(1, 5, 6);
      _tile_dpbssd(2, 5, 7);
    }
    _tile_stored(0, s[0], 64);
    _tile_stored(1, s[1], 64);
    _tile_stored(2, s[2], 64);
    for (int i = 0; i < kAmxQ; ++i) _mm512_store_si512(dot[i] + 16 * u, amx_combine(s[0][i], s[1][i], s[2][i]));
  }
}

// acc[i][0..d) = sum_j u_ij v_j for 16 queries: ub rows of 64 bytes ([uh | ul] of the 32 keys).
__attribute__((target("amx-tile,amx-int8,avx512f"))) inline void values_amx(const AmxBlock& b, const int8_t* ub,
                                                                          int64_t d, int32_t* const* acc) {
  alignas(64) int32_t s[3][16][16];
  _tile_loadd(4, ub, 64);
  for (int64_t t = 0; t < d / 16; ++t) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_loadd(5, b.v[t][0], 64);
    _tile_loadd(6, b.v[t][1], 64);
    _tile_loadd(7, b.v[t][2], 64);
    _tile_dpbssd(0, 4, 5);
    _tile_dpbssd(1, 4, 6);
    _tile_dpbssd(2, 4, 7);
    _tile_stored(0, s[0], 64);
    _tile_stored(1, s[1], 64);
    _tile_stored(2, s[2], 64);
    for (int i = 0; i < kAmxQ; ++i) _mm512_storeu_si512(acc[i] + 16 * t, amx_combine(s[0][i], s[1][i], s[2][i]));
  }
}

// One query's value weights (32 int16 in key order, as softmax_weights writes them) as its row of
// the values' A tile: [uh | ul].
__attribute__((target("avx512f,avx512bw"))) inline void amx_weight_bytes(const int32_t* u32, int8_t* row) {
  __m256i h, l;
  split_bytes(_mm512_loadu_si512(u32), h, l);
  _mm256_store_si256(reinterpret_cast<__m256i*>(row), h);
  _mm256_store_si256(reinterpret_cast<__m256i*>(row + 32), l);
}

}  // namespace prefixcache::exact

using namespace prefixcache::exact;

int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  const int64_t d = 64, N = 20000;
  static AmxBlock blk{};
  alignas(64) static int8_t qh[16 * 64], ql[16 * 64], ub[16 * 64];
  alignas(64) static int32_t dot[16][32];
  std::vector<int32_t> acc(16 * 64), up(16 * 16);
  std::vector<float> o(16 * 64);
  int32_t* ap[16];
  for (int i = 0; i < 16; ++i) ap[i] = acc.data() + i * 64;
  alignas(64) static int32_t kv[2][64 * 16]; alignas(64) static float sc[16];
  for (auto& x : sc) x = 1e-3f;
  for (int i = 0; i < 16; ++i) for (int j = 0; j < 32; ++j) dot[i][j] = (i * 37 + j * 11) % 1000;
  Units un; for (int i = 0; i < 2; ++i) { un.k[i] = kv[i]; un.v[i] = kv[i]; un.sk[i] = sc; un.sv[i] = sc; }
  float m[16], l[16], us[16];
  for (int i = 0; i < 16; ++i) m[i] = 0, l[i] = 1;
  auto soft = [&]() { for (int i = 0; i < 16; ++i) { float w = softmax_weights(dot[i], un, 0.01f, 0, 32, m[i], l[i], up.data() + i * 16, us[i]); fold_values(o.data() + i * 64, ap[i], 64, w, us[i]); m[i] = 0; } };
  // the same int32 as the VNNI products, on random operands at their widths
  {
    std::mt19937 rng(1);
    auto r16 = [&](int lim) { return static_cast<int16_t>(static_cast<int>(rng() % (2 * lim + 1)) - lim); };
    alignas(64) static int32_t k2[2][64 * 16], v2[2][64 * 16], qpairs[16][32], upairs[16][16];
    for (int u = 0; u < 2; ++u)
      for (int i = 0; i < 64 * 16; ++i) {
        k2[u][i] = static_cast<uint16_t>(r16(4095)) | (static_cast<uint16_t>(r16(4095)) << 16);
        v2[u][i] = static_cast<uint16_t>(r16(4095)) | (static_cast<uint16_t>(r16(4095)) << 16);
      }
    for (int i = 0; i < 16; ++i) {
      for (int p = 0; p < 32; ++p) qpairs[i][p] = static_cast<uint16_t>(r16(8191)) | (static_cast<uint16_t>(r16(8191)) << 16);
      for (int p = 0; p < 16; ++p) upairs[i][p] = (rng() % 16384) | ((rng() % 16384) << 16);
    }
    Units ru = un;
    for (int u = 0; u < 2; ++u) ru.k[u] = k2[u], ru.v[u] = v2[u];
    static AmxBlock b2{};
    amx_block_images(ru.k, ru.v, d, b2);
    alignas(64) static int8_t qh2[16 * 64], ql2[16 * 64], ub2[16 * 64];
    for (int i = 0; i < 16; ++i) {
      amx_query_bytes(qpairs[i], d, qh2 + i * 64, ql2 + i * 64);
      amx_weight_bytes(upairs[i], ub2 + i * 64);
    }
    alignas(64) static int32_t da[16][32], dv[16][32];
    std::vector<int32_t> aa(16 * 64), av(16 * 64);
    int32_t* pa[16];
    int32_t* pv[16];
    for (int i = 0; i < 16; ++i) pa[i] = aa.data() + i * 64, pv[i] = av.data() + i * 64;
    amx_attention_begin();
    scores_amx(b2, qh2, ql2, d, da);
    values_amx(b2, ub2, d, pa);
    amx_attention_end();
    for (int g = 0; g < 16; g += 4) {
      const int32_t* q4[4] = {qpairs[g], qpairs[g + 1], qpairs[g + 2], qpairs[g + 3]};
      const int32_t* u4[4] = {upairs[g], upairs[g + 1], upairs[g + 2], upairs[g + 3]};
      int32_t* d4[4] = {dv[g], dv[g + 1], dv[g + 2], dv[g + 3]};
      block_scores_int(kIsaVnni, ru, 32, 4, q4, d4);
      block_values_int(kIsaVnni, ru, d, 16, 4, u4, pv + g);
    }
    const bool same = std::memcmp(da, dv, sizeof da) == 0 && aa == av;
    printf("AMX products equal to VNNI's: %s\n", same ? "yes" : "NO");
    if (!same) return 1;
  }
  amx_attention_begin();
  auto ns = [&](auto a, auto b) { return std::chrono::duration<double, std::nano>(b - a).count() / N / 512; };
  for (int rep = 0; rep < 2; ++rep) {
  auto t0 = std::chrono::steady_clock::now();
  for (int n = 0; n < N; ++n) soft();
  auto t1 = std::chrono::steady_clock::now();
  for (int n = 0; n < N; ++n) { scores_amx(blk, qh, ql, d, dot); values_amx(blk, ub, d, ap); }
  auto t2 = std::chrono::steady_clock::now();
  for (int n = 0; n < N; ++n) { scores_amx(blk, qh, ql, d, dot); soft(); values_amx(blk, ub, d, ap); }
  auto t3 = std::chrono::steady_clock::now();
  amx_attention_end();
  alignas(64) static int32_t qp[4][32];
  const int32_t* qpp[4] = {qp[0], qp[1], qp[2], qp[3]};
  int32_t* dp[4] = {dot[0], dot[1], dot[2], dot[3]};
  auto t4 = std::chrono::steady_clock::now();
  for (int n = 0; n < N; ++n) for (int g = 0; g < 4; ++g) { block_scores_int(kIsaVnni, un, 32, 4, qpp, dp); block_values_int(kIsaVnni, un, 64, 16, 4, qpp, ap); }
  auto t5 = std::chrono::steady_clock::now();
  amx_attention_begin();
  printf("per pair ns: softmax+fold %.3f | products: amx %.3f, vnni %.3f | amx products and softmax interleaved %.3f\n",
         ns(t0, t1), ns(t1, t2), ns(t4, t5), ns(t2, t3));
  }
  amx_attention_end();
}
