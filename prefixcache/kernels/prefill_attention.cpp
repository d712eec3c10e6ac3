// Causal attention of a prefill chunk: q [T, H, D] over k, v [KVH, C, D], where the last T keys
// are the queries' own (query i sits at position C - T + i and sees keys 0 .. C - T + i).
//
// Flash-style: each work item is one KV head and a block of query rows; it walks the visible
// keys in blocks of 32, transposes the block of K once (so a query's 32 scores come out of
// vector FMAs, no horizontal sums), and keeps a running max, sum and output per query (online
// softmax), so no [T, C] score matrix is ever written. Float32 throughout.
//
// Why: the torch path (chunked bmm, masked_fill, softmax, bmm) spent ~25% of a 1,000-token
// prefill on attention, mostly in small GEMMs with K = 64 and passes over score matrices.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <array>

#include "exact_attention.h"
#include "int_attention.h"
#include "int_gemm.h"
#include "kv_codec.h"
#include "parallel.h"

namespace {

using namespace prefixcache::exact;

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [T, H, D] float32 contiguous");
  TORCH_CHECK(k.dim() == 3 && k.scalar_type() == at::kFloat && k.is_contiguous() && v.sizes() == k.sizes() &&
                  v.is_contiguous() && v.scalar_type() == at::kFloat, "k, v: [KVH, C, D] float32 contiguous");
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), kvh = k.size(0), c = k.size(1);
  TORCH_CHECK(k.size(2) == d && d % 8 == 0 && d <= kMaxD, "head_dim a multiple of 8, <= 256");
  TORCH_CHECK(h % kvh == 0 && t <= c && t > 0, "query heads a multiple of KV heads; 0 < T <= C");
  at::Tensor out = at::empty_like(q);
  const int64_t blocks = (t + kRows - 1) / kRows, items = blocks * kvh;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Later row blocks see more keys: items are taken last block first (the longest first), each
  // by whichever thread is free (parallel.h).
  const DenseKeys keys{kp, vp, c, d};
  prefixcache::parallel_items(items, [&](int64_t i) {
    thread_local std::vector<float> kt, vbuf;
    const int64_t it = items - 1 - i;
    const int64_t kh = it % kvh, blk = it / kvh;
    const int64_t i0 = blk * kRows, i1 = std::min(t, i0 + kRows);
    attend_rows(qp, keys, op, t, c, h, kvh, d, kh, i0, i1, static_cast<float>(scale), kt, vbuf);
  });
  return out;
}

// Every sequence of a step at once over the paged pool, read in place: sequence s has q_len[s]
// queries at rows q_start[s].. of q (positions ctx[s] - q_len[s] ..) and its context at
// slots[slots_off[s] .. + ctx[s]]. The same per-query arithmetic as prefill_attention, so a
// decode (q_len 1) gives the bits its token gets in any prefill. window > 0: a sliding window
// (a query at p sees keys (p - window, p]); 0: every earlier key.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                           const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                           int64_t code, const at::Tensor& q_start, const at::Tensor& q_len,
                           const at::Tensor& ctx, const at::Tensor& slots_off, const at::Tensor& slots,
                           double scale, int64_t isa, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [T, H, D] float32 contiguous");
  TORCH_CHECK(kc.dim() == 3 && kc.is_contiguous() && vc.is_contiguous() && vc.sizes() == kc.sizes(),
              "k, v cache: [KVH, N, D] contiguous");
  const int64_t h = q.size(1), d = q.size(2), kvh = kc.size(0), n_slots = kc.size(1);
  TORCH_CHECK(kc.size(2) == d && d % 8 == 0 && d <= kMaxD && h % kvh == 0, "head shapes");
  const bool integer = code == prefixcache::kI16;  // int16 K/V: the integer units (int_attention.h)
  TORCH_CHECK(!integer || d % 16 == 0, "int16 K/V: head_dim a multiple of 16");
  prefixcache::check_isa(isa);
  TORCH_CHECK(kc.element_size() == prefixcache::kv_elem_size(code), "cache element size vs format");
  for (const auto* t : {&q_start, &q_len, &ctx, &slots_off, &slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors: int64 contiguous");
  const int64_t ns = q_start.numel();
  TORCH_CHECK(q_len.numel() == ns && ctx.numel() == ns && slots_off.numel() == ns + 1, "per-sequence sizes");
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* cx = ctx.data_ptr<int64_t>();
  const int64_t* so = slots_off.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < ns; ++s) {
    TORCH_CHECK(ql[s] > 0 && ql[s] <= cx[s] && qs[s] >= 0 && qs[s] + ql[s] <= q.size(0), "query rows");
    TORCH_CHECK(so[s] >= 0 && so[s] + cx[s] <= slots.numel(), "context slots");
    for (int64_t j = 0; j < cx[s]; ++j)
      TORCH_CHECK(sl[so[s] + j] >= 0 && sl[so[s] + j] < n_slots, "slot out of range");
  }
  const float* ksp = k_scale.has_value() ? k_scale->data_ptr<float>() : nullptr;
  const float* vsp = v_scale.has_value() ? v_scale->data_ptr<float>() : nullptr;
  TORCH_CHECK((ksp == nullptr) == !prefixcache::kv_scaled(code), "scales iff scaled format");
  // items: (sequence, block of kRows query rows, KV head), the most keys first, each taken by
  // whichever thread is free (parallel.h)
  std::vector<std::array<int64_t, 3>> items;
  std::vector<int64_t> cost;
  for (int64_t s = 0; s < ns; ++s)
    for (int64_t b = 0; b * kRows < ql[s]; ++b)
      for (int64_t kh = 0; kh < kvh; ++kh) {
        items.push_back({s, b, kh});
        cost.push_back((cx[s] - ql[s] + std::min(ql[s], (b + 1) * kRows)) * std::min(kRows, ql[s] - b * kRows));
      }
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b2) { return cost[a] > cost[b2]; });
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto* kp = static_cast<const uint8_t*>(kc.data_ptr());
  const auto* vp = static_cast<const uint8_t*>(vc.data_ptr());
  if (integer) {
    // int16 pools are read in units of 16 slots (kv_codec.h): every context must come in them
    TORCH_CHECK(n_slots % prefixcache::kUnit == 0, "int16 K/V: a pool of whole units");
    for (int64_t s = 0; s < ns; ++s)
      for (int64_t j = 0; j < cx[s]; ++j)
        TORCH_CHECK(sl[so[s] + j] % prefixcache::kUnit == j % prefixcache::kUnit &&
                        (j % prefixcache::kUnit == 0 || sl[so[s] + j] == sl[so[s] + j - 1] + 1),
                    "int16 K/V: a context's slots in whole units of 16 (block_size a multiple of 16)");
    const int64_t path = std::min<int64_t>(isa, kIsaVnni);  // AMX hosts: the VNNI products
    const auto* k16 = static_cast<const int16_t*>(kc.data_ptr());
    const auto* v16 = static_cast<const int16_t*>(vc.data_ptr());
    prefixcache::parallel_items(static_cast<int64_t>(items.size()), [&](int64_t i) {
      thread_local IntScratch z;
      const auto [s, b, kh] = items[order[i]];
      const PagedInt16Keys keys{k16, v16, ksp, vsp, n_slots, d, sl + so[s]};
      const int64_t i0 = b * kRows, i1 = std::min(ql[s], i0 + kRows);
      const int64_t base = qs[s] * h * d;
      attend_rows_int(qp + base, keys, op + base, ql[s], cx[s], h, kvh, d, kh, i0, i1,
                      static_cast<float>(scale), path, z, window);
    });
    return out;
  }
  prefixcache::parallel_items(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local std::vector<float> kt, vbuf;
    const auto [s, b, kh] = items[order[i]];
    const PagedKeys keys{kp, vp, ksp, vsp, code, n_slots, d, sl + so[s]};
    const int64_t i0 = b * kRows, i1 = std::min(ql[s], i0 + kRows);
    const int64_t base = qs[s] * h * d;
    attend_rows(qp + base, keys, op + base, ql[s], cx[s], h, kvh, d, kh, i0, i1,
                static_cast<float>(scale), kt, vbuf, window);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, lib) {
  lib.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  lib.def("paged_attention(Tensor q, Tensor kc, Tensor vc, Tensor? k_scale, Tensor? v_scale, int code, "
          "Tensor q_start, Tensor q_len, Tensor ctx, Tensor slots_off, Tensor slots, float scale, int isa, "
          "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("prefill_attention", &prefill_attention);
  lib.impl("paged_attention", &paged_attention);
}
