// Probe: where the exact attention kernel's time goes on an AVX-512 host, phase by phase
// (kernels/int_attention.h). One KV head with 3 query heads (the default model's grouping),
// head_dim 64, an int16 pool of 4,096 keys; the last 32 query rows (96 queries) see all of them.
// Prints the whole kernel (attend_rows_int, best of 30 batches) and each phase run alone over the
// same blocks: the scores' products, the softmax one query at a time (softmax_weights512) and 16
// at a time (softmax_weights16), the value products with the fold. Cycles a query-key pair at the
// clock given (measure it: a chain of dependent 1-cycle adds, docs/benchmarks-journal.md "The
// softmax across queries"). The scores' spread is a real one's (a few units of log2), so no
// weight is subnormal; with spreads of hundreds the weights underflow and every phase that
// touches them slows down.
//
// From the repository root (one command, the kernels' flags):
//   g++ -O3 -mavx2 -mfma -mf16c -fno-math-errno -ffp-contract=off -std=c++17 -Iprefixcache/kernels
//   -I.venv/lib/python3.11/site-packages/torch/include -o /tmp/attention_phases
//   benchmarks/probes/attention_phases.cpp && /tmp/attention_phases 3.64
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "int_attention.h"

using namespace prefixcache::exact;
using clk = std::chrono::steady_clock;

static double since(clk::time_point a) { return std::chrono::duration<double>(clk::now() - a).count(); }

int main(int argc, char** argv) {
  const double ghz = argc > 1 ? std::atof(argv[1]) : 3.0;
  const int64_t C = 4096, D = 64, H = 3, KVH = 1, T = 4096, nq = 96;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<int16_t> k(C * D), v(C * D);
  std::vector<float> ks(C, 1e-3f), vs(C, 1e-3f);
  for (auto& x : k) x = static_cast<int16_t>(std::clamp(nd(rng) * 1000.f, -4095.f, 4095.f));
  for (auto& x : v) x = static_cast<int16_t>(std::clamp(nd(rng) * 1000.f, -4095.f, 4095.f));
  std::vector<int64_t> slots(C);
  for (int64_t i = 0; i < C; ++i) slots[i] = i;
  const PagedInt16Keys keys{k.data(), v.data(), ks.data(), vs.data(), C, D, slots.data()};
  std::vector<float> q(T * H * D), out(T * H * D);
  for (auto& x : q) x = nd(rng);
  IntScratch z;
  // a second argument "avx2" times the AVX2 products (the phases' softmax stays on zmm)
  const int64_t isa = argc > 2 && std::strcmp(argv[2], "avx2") == 0 ? kIsaAvx2 : kIsaVnni;

  double whole = 1e9;
  for (int b = 0; b < 30; ++b) {
    const auto a = clk::now();
    for (int r = 0; r < 10; ++r)
      attend_rows_int(q.data(), keys, out.data(), T, C, H, KVH, D, 0, T - 32, T, 0.125f, isa, z);
    whole = std::min(whole, since(a) / 10);
  }
  std::printf("whole kernel: %.3f ms, %.2f cycles a pair\n", whole * 1e3, whole * ghz * 1e9 / (nq * (C - 16.0)));

  std::vector<int32_t> qp(nq * D / 2), up(nq * kKeys / 2);
  alignas(64) static int32_t dots[32 * kKeys];
  std::vector<float> m(nq, -INFINITY), l(nq, 0.f), w(nq), us(nq), o(nq * D, 0.f), qa(nq, 3e-4f);
  std::vector<int64_t> from(nq, 0), vis(nq, kKeys);
  for (int i = 0; i < nq; ++i) quantize_query(q.data() + i * D, D, 0.125f, qp.data() + i * D / 2);
  double t_scores = 0, t_one = 0, t_16 = 0, t_values = 0;
  const int reps = 10;
  for (int r = 0; r < reps; ++r) {
    auto a = clk::now();
    for (int64_t k0 = 0; k0 < C; k0 += kKeys) {
      const Units un = keys.block(0, k0, kKeys);
      for (int qs = 0; qs < nq; qs += kGroupQ) {
        const int32_t* qq[kGroupQ];
        int32_t* dp[kGroupQ];
        for (int i = 0; i < kGroupQ; ++i) qq[i] = qp.data() + (qs + i) * D / 2, dp[i] = dots + ((qs + i) % 32) * kKeys;
        block_scores_int(isa, un, D / 2, kGroupQ, qq, dp);
      }
    }
    t_scores += since(a), a = clk::now();
    for (int64_t k0 = 0; k0 < C; k0 += kKeys) {
      const Units un = keys.block(0, k0, kKeys);
      for (int qi = 0; qi < nq; ++qi)
        w[qi] = softmax_weights512<true>(dots + (qi % 32) * kKeys, un, qa[qi], 0, kKeys, m[qi], l[qi],
                                         up.data() + qi * kKeys / 2, us[qi]);
    }
    t_one += since(a), a = clk::now();
    for (int64_t k0 = 0; k0 < C; k0 += kKeys) {
      const Units un = keys.block(0, k0, kKeys);
      for (int qs = 0; qs < nq; qs += 16) {
        const int32_t* dq[16];
        int32_t* uq[16];
        for (int i = 0; i < 16; ++i) dq[i] = dots + ((qs + i) % 32) * kKeys, uq[i] = up.data() + (qs + i) * kKeys / 2;
        softmax_weights16(dq, un, qa.data() + qs, from.data() + qs, vis.data() + qs, 16, m.data() + qs,
                          l.data() + qs, w.data() + qs, us.data() + qs, uq, z.sm);
      }
    }
    t_16 += since(a), a = clk::now();
    for (int64_t k0 = 0; k0 < C; k0 += kKeys) {
      const Units un = keys.block(0, k0, kKeys);
      for (int qs = 0; qs < nq; qs += kGroupQ) {
        const int32_t* uu[kGroupQ];
        float* op[kGroupQ];
        for (int i = 0; i < kGroupQ; ++i) uu[i] = up.data() + (qs + i) * kKeys / 2, op[i] = o.data() + (qs + i) * D;
        block_values_fold_int(isa, un, D, kKeys / 2, kGroupQ, uu, op, w.data() + qs, us.data() + qs);
      }
    }
    t_values += since(a);
  }
  const double per = ghz * 1e9 / (static_cast<double>(nq) * C * reps);
  std::printf("alone, cycles a pair: scores %.2f, softmax one query at a time %.2f, 16 at a time %.2f, "
              "values and fold %.2f\n", t_scores * per, t_one * per, t_16 * per, t_values * per);
  return 0;
}
