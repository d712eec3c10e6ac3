// Decode attention over the paged KV cache, reading K/V rows where they lie (no gathered copy).
//
// The step's decodes come as "parts" (planned in prefixcache/model/decode_attention.py): a part
// is a list of query rows that all attend the same list of cache slots, a shared prefix
// segment (many rows, read once for all of them) or one row's own tail. Each (part, KV head)
// is one work item computing, for its rows x G query heads, the softmax pieces over its slots:
// max m, sum l and the unnormalised output o. A row's pieces are merged exactly afterwards
// (log-sum-exp), so the result is one softmax over the row's whole context up to float32
// rounding. Items go to threads largest first (their sizes differ by 10x).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "attention.h"

namespace {

void check_parts(const at::Tensor& rows_off, const at::Tensor& rows, const at::Tensor& slots_off,
                 const at::Tensor& slots, int64_t b, int64_t n) {
  for (const at::Tensor* t : {&rows_off, &rows, &slots_off, &slots}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, "int64 vectors");
  }
  const int64_t parts = rows_off.numel() - 1;
  TORCH_CHECK(parts >= 0 && slots_off.numel() == parts + 1, "offsets of parts");
  const int64_t* ro = rows_off.data_ptr<int64_t>();
  const int64_t* so = slots_off.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  TORCH_CHECK(ro[0] == 0 && so[0] == 0 && ro[parts] == rows.numel() && so[parts] == slots.numel(),
              "offsets start at 0 and end at the data");
  for (int64_t p = 0; p < parts; ++p) {
    TORCH_CHECK(ro[p] <= ro[p + 1] && so[p] <= so[p + 1], "offsets never decrease");
    TORCH_CHECK(so[p + 1] > so[p] || ro[p + 1] == ro[p], "a part with rows attends at least one slot");
  }
  for (int64_t i = 0; i < rows.numel(); ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < b, "row out of range");
  for (int64_t i = 0; i < slots.numel(); ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < n, "slot out of range");
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
                            const c10::optional<at::Tensor>& v_scale, int64_t code,
                            const at::Tensor& rows_off, const at::Tensor& rows,
                            const at::Tensor& slots_off, const at::Tensor& slots, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [B, H, D] float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.element_size() == prefixcache::kv_elem_size(code),
              "k_cache, v_cache: [KVH, N, D] contiguous, in the storage of `code`");
  const bool scaled = prefixcache::kv_scaled(code);
  TORCH_CHECK(prefixcache::kv_code_known(code) && code != prefixcache::kI16,
              "unknown kv code (int16 K/V run on the exact path only)");
  TORCH_CHECK(k_scale.has_value() == scaled && v_scale.has_value() == scaled, "scales iff int8/fp8");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t kvh = k_cache.size(0), n = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == d && d % 8 == 0 && d <= prefixcache::kMaxD, "head_dim a multiple of 8, <= 256");
  TORCH_CHECK(h % kvh == 0, "query heads a multiple of KV heads");
  check_parts(rows_off, rows, slots_off, slots, b, n);
  const int64_t parts = rows_off.numel() - 1;
  const int64_t threads = at::get_num_threads();
  const prefixcache::DecodePlan plan = prefixcache::make_plan(
      b, h, d, kvh, n, parts, rows_off.data_ptr<int64_t>(), rows.data_ptr<int64_t>(),
      slots_off.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), threads);
  at::Tensor pm = at::empty({plan.total_rows, h}, q.options());
  at::Tensor pl = at::empty({plan.total_rows, h}, q.options());
  at::Tensor po = at::empty({plan.total_rows, h, d}, q.options());
  at::Tensor out = at::empty({b, h, d}, q.options());
  const float* qp = q.data_ptr<float>();
  if (scaled) {
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && k_scale->is_contiguous() &&
                    k_scale->numel() == kvh * n && v_scale->sizes() == k_scale->sizes() &&
                    v_scale->is_contiguous(), "scales: [KVH, N] float32 contiguous");
  }
  const prefixcache::KVSource ks{static_cast<const uint8_t*>(k_cache.data_ptr()),
                                 scaled ? k_scale->data_ptr<float>() : nullptr, code};
  const prefixcache::KVSource vs{static_cast<const uint8_t*>(v_cache.data_ptr()),
                                 scaled ? v_scale->data_ptr<float>() : nullptr, code};
  at::parallel_for(0, static_cast<int64_t>(plan.per_thread.size()), 1, [&](int64_t t0, int64_t t1) {
    prefixcache::Scratch scratch;
    for (int64_t t = t0; t < t1; ++t) {
      prefixcache::attend_thread(plan, t, qp, ks, vs, static_cast<float>(scale), pm.data_ptr<float>(),
                                 pl.data_ptr<float>(), po.data_ptr<float>(), scratch);
    }
  });
  TORCH_CHECK(prefixcache::merge_rows(plan, 0, b, pm.data_ptr<float>(), pl.data_ptr<float>(),
                                      po.data_ptr<float>(), out.data_ptr<float>()),
              "a decode row attended no slot");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, lib) {
  lib.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
      "int code, Tensor rows_off, Tensor rows, Tensor slots_off, Tensor slots, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("decode_attention", &decode_attention);
}
