// Writing new tokens' K and V into the paged cache in its storage format (kv_codec.h), and
// returning what was stored as float32: attention over a chunk's own tokens must see the stored
// values, exactly as a later request that finds them in the cache will.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "kv_codec.h"
#include "parallel.h"

namespace {

// k_new, v_new [T, KVH, D] float32 -> cache [KVH, N, D] at slots [T]; scales [KVH, N].
// want_seen false: returns two empty tensors (callers that attend from the pool in place).
std::tuple<at::Tensor, at::Tensor> kv_store(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                            const c10::optional<at::Tensor>& k_scale,
                                            const c10::optional<at::Tensor>& v_scale, int64_t code,
                                            const at::Tensor& slots, const at::Tensor& k_new,
                                            const at::Tensor& v_new, bool want_seen) {
  TORCH_CHECK(prefixcache::kv_code_known(code), "unknown kv code");
  const bool scaled = prefixcache::kv_scaled(code);
  TORCH_CHECK(k_new.dim() == 3 && k_new.scalar_type() == at::kFloat && v_new.sizes() == k_new.sizes() &&
                  v_new.scalar_type() == at::kFloat, "k_new, v_new: [T, KVH, D] float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.element_size() == prefixcache::kv_elem_size(code),
              "caches: [KVH, N, D] contiguous in the storage of `code`");
  const int64_t t = k_new.size(0), kvh = k_new.size(1), d = k_new.size(2), n = k_cache.size(1);
  TORCH_CHECK(k_cache.size(0) == kvh && k_cache.size(2) == d && d % 8 == 0, "shapes");
  TORCH_CHECK(code != prefixcache::kI16 || (d <= 256 && n % prefixcache::kUnit == 0), "int16: D <= 256, whole units");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == t && slots.is_contiguous(), "slots: [T] int64");
  TORCH_CHECK(k_scale.has_value() == scaled && v_scale.has_value() == scaled, "scales iff int8/fp8");
  if (scaled) {
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && k_scale->is_contiguous() &&
                    k_scale->numel() == kvh * n && v_scale->sizes() == k_scale->sizes() &&
                    v_scale->is_contiguous(), "scales: [KVH, N] float32 contiguous");
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < n, "slot out of range");
  const at::Tensor kc = k_new.contiguous(), vc = v_new.contiguous();
  at::Tensor k_seen = want_seen ? at::empty_like(kc) : at::empty({0}, kc.options());
  at::Tensor v_seen = want_seen ? at::empty_like(vc) : at::empty({0}, vc.options());
  const int64_t es = prefixcache::kv_elem_size(code);
  auto* kd = static_cast<uint8_t*>(k_cache.data_ptr());
  auto* vd = static_cast<uint8_t*>(v_cache.data_ptr());
  float* ksc = scaled ? k_scale->data_ptr<float>() : nullptr;
  float* vsc = scaled ? v_scale->data_ptr<float>() : nullptr;
  const float* kx = kc.data_ptr<float>();
  const float* vx = vc.data_ptr<float>();
  float* ko = want_seen ? k_seen.data_ptr<float>() : nullptr;
  float* vo = want_seen ? v_seen.data_ptr<float>() : nullptr;
  prefixcache::parallel_chunks(t * kvh, 64, [&](int64_t b0, int64_t b1) {
    float unused;
    for (int64_t i = b0; i < b1; ++i) {
      const int64_t tok = i / kvh, h = i % kvh, at_ = h * n + sp[tok];
      prefixcache::store_token(code, kx + i * d, d, kd + h * n * d * es, sp[tok], false, scaled ? ksc + at_ : &unused,
                               ko ? ko + i * d : nullptr);
      prefixcache::store_token(code, vx + i * d, d, vd + h * n * d * es, sp[tok], true, scaled ? vsc + at_ : &unused,
                               vo ? vo + i * d : nullptr);
    }
  });
  return {k_seen, v_seen};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, lib) {
  lib.def(
      "kv_store(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!)? k_scale, Tensor(d!)? v_scale, "
      "int code, Tensor slots, Tensor k_new, Tensor v_new, bool want_seen=True) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("kv_store", &kv_store);
}
