// Probe: decode rows that share a cached prefix, attended row by row (attend_rows_int, what
// exact_decode did for every row) and as one group (attend_decode_group_int: the shared blocks'
// K/V read once for every row's queries, the same bits). One KV head with 3 query heads (the
// default model's grouping), head_dim 64, an int16 pool; each row's context is a 4,096-key
// shared prefix and 128 keys of its own. Prints the best of 20 runs for 1, 2, 4 and 8 rows and
// cycles a query-key pair at the clock given (measure it: docs/benchmarks-journal.md "The
// softmax across queries").
//
// From the repository root (one command, the kernels' flags):
//   g++ -O3 -mavx2 -mfma -mf16c -fno-math-errno -ffp-contract=off -std=c++17 -Iprefixcache/kernels
//   -I.venv/lib/python3.11/site-packages/torch/include -o /tmp/decode_groups
//   benchmarks/probes/decode_groups.cpp && /tmp/decode_groups 3.45
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include "int_attention.h"
using namespace prefixcache::exact;
using clk = std::chrono::steady_clock;
static double since(clk::time_point a) { return std::chrono::duration<double>(clk::now() - a).count(); }
int main(int argc, char** argv) {
  const double ghz = argc > 1 ? std::atof(argv[1]) : 3.0;
  const int64_t C = 4224, D = 64, H = 3, KVH = 1, NR = 8;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<int16_t> k(C * NR * D), v(C * NR * D);
  const int64_t NS = C * NR;
  std::vector<float> ks(NS, 1e-3f), vs(NS, 1e-3f);
  for (auto& x : k) x = static_cast<int16_t>(std::clamp(nd(rng) * 1000.f, -4095.f, 4095.f));
  for (auto& x : v) x = static_cast<int16_t>(std::clamp(nd(rng) * 1000.f, -4095.f, 4095.f));
  // row r: shared slots [0, 4096) then its own 128 slots at 4096 + r * 128 ... (whole units)
  std::vector<std::vector<int64_t>> slots(NR);
  for (int r = 0; r < NR; ++r) {
    for (int64_t i = 0; i < 4096; ++i) slots[r].push_back(i);
    for (int64_t i = 0; i < C - 4096; ++i) slots[r].push_back(4096 + r * 128 + i);
  }
  std::vector<float> q(NR * H * D), out(NR * H * D);
  for (auto& x : q) x = nd(rng) * 0.3f;
  IntScratch z;
  for (int n : {1, 2, 4, 8}) {
    double per_row = 1e9, grouped = 1e9;
    std::vector<PagedInt16Keys> keys;
    std::vector<const float*> qs; std::vector<float*> os; std::vector<int64_t> cx;
    for (int r = 0; r < n; ++r) {
      keys.push_back({k.data(), v.data(), ks.data(), vs.data(), NS, D, slots[r].data()});
      qs.push_back(q.data() + r * H * D); os.push_back(out.data() + r * H * D); cx.push_back(C);
    }
    for (int b = 0; b < 20; ++b) {
      auto a = clk::now();
      for (int r = 0; r < n; ++r) attend_rows_int(qs[r], keys[r], os[r], 1, C, H, KVH, D, 0, 0, 1, 0.125f, kIsaVnni, z);
      per_row = std::min(per_row, since(a));
      a = clk::now();
      attend_decode_group_int(qs.data(), keys.data(), os.data(), cx.data(), n, 4096, H, KVH, D, 0, 0.125f, kIsaVnni, z);
      grouped = std::min(grouped, since(a));
    }
    const double pairs = double(n) * H * C;
    std::printf("rows %d: row by row %.3f ms (%.2f cycles a pair), grouped %.3f ms (%.2f)\n", n, per_row * 1e3,
                per_row * ghz * 1e9 / pairs, grouped * 1e3, grouped * ghz * 1e9 / pairs);
  }
}
