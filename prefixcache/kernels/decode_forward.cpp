// A whole decode step through the decoder layers in one call: one parallel region, the threads
// meeting at a spinning barrier between steps of a layer.
//
// Why: at decode sizes a layer is ~10 kernel calls, each its own OpenMP region; with idle
// threads sleeping between regions (OMP_WAIT_POLICY=PASSIVE, as benchmark harnesses set it)
// every region paid a wake-up, ~7 ms of a 30 ms single-sequence step, plus the Python between
// the calls. Here threads are woken once per step and never leave the region.
//
// Same numbers as the op-by-op path (llama.py with the native kernels), bit for bit: every step
// calls the same row and tile functions (rowwise.h, group_gemv.h, attention.h), each output is
// computed whole by one thread, and a row's attention pieces merge in part order.
//
// Per layer, with B rows (one new token per sequence):
//   rows   xn = rms_norm(x)                         cols  qkv = xn Wqkv (+ bias)
//   rows   rotate q, k; K, V -> cache slots; q copy  items attention pieces (plan per step)
//   rows   merge pieces -> attn                      cols  x += attn Wo
//   rows   xn = rms_norm(x)                         cols  gu = xn Wgu
//   rows   h = silu(gate) up                        cols  x += h Wdown
// "rows" steps split the B rows between threads, "cols" steps split a weight's output rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "attention.h"
#include "group_gemv.h"
#include "rowwise.h"
#include "team.h"

namespace {

using prefixcache::Q4;
using prefixcache::Q8;

// y[:, n0:n1] = x W^T for weight records of kind 0 (q4) or 1 (q8).
inline void gemv(int64_t kind, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n0,
                 int64_t n1, float* y, int64_t ldy) {
  if (n0 >= n1) return;
  if (kind == 0) {
    prefixcache::rows_block<Q4>(x, m, k, w, n0, n1, y, ldy);
  } else {
    prefixcache::rows_block<Q8>(x, m, k, w, n0, n1, y, ldy);
  }
}

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.is_cpu(), name, ": float32 contiguous on CPU");
}

at::Tensor decode_forward(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                          at::TensorList input_norms, at::TensorList post_norms,
                          at::TensorList qkv_w, at::TensorList o_w, at::TensorList gate_up_w,
                          at::TensorList down_w, at::IntArrayRef kinds, at::TensorList qkv_bias,
                          const at::Tensor& kv_k, const at::Tensor& kv_v,
                          const c10::optional<at::Tensor>& kv_k_scale,
                          const c10::optional<at::Tensor>& kv_v_scale, int64_t kv_code,
                          const at::Tensor& slot_mapping, const at::Tensor& rows_off,
                          const at::Tensor& rows, const at::Tensor& slots_off,
                          const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads,
                          double eps_d, double scale_d) {
  check_f32(x_in, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(prefixcache::kv_code_known(kv_code) && kv_code != prefixcache::kI16,
              "unknown kv code (int16 K/V run on the exact path only)");
  const bool scaled = prefixcache::kv_scaled(kv_code);
  TORCH_CHECK(kv_k.is_contiguous() && kv_v.is_contiguous() && kv_v.scalar_type() == kv_k.scalar_type() &&
                  kv_k.element_size() == prefixcache::kv_elem_size(kv_code),
              "kv_k, kv_v: contiguous, in the storage of kv_code");
  TORCH_CHECK(kv_k_scale.has_value() == scaled && kv_v_scale.has_value() == scaled, "scales iff int8/fp8");
  const int64_t layers = static_cast<int64_t>(qkv_w.size());
  TORCH_CHECK(input_norms.size() == qkv_w.size() && post_norms.size() == qkv_w.size() &&
                  o_w.size() == qkv_w.size() && gate_up_w.size() == qkv_w.size() &&
                  down_w.size() == qkv_w.size() && static_cast<int64_t>(kinds.size()) == 4 * layers,
              "one of each weight per layer, four kinds per layer");
  TORCH_CHECK(qkv_bias.empty() || static_cast<int64_t>(qkv_bias.size()) == layers, "qkv bias per layer or none");
  TORCH_CHECK(kv_k.dim() == 4 && kv_k.size(0) >= layers && kv_v.sizes() == kv_k.sizes(), "kv: [L, KVH, N, D]");
  const int64_t b = x_in.size(0), hid = x_in.size(1);
  const int64_t h = num_heads, kvh = num_kv_heads, d = kv_k.size(3), n_slots = kv_k.size(2);
  TORCH_CHECK(kv_k.size(1) == kvh && h % kvh == 0 && d % 16 == 0 && d <= prefixcache::kMaxD, "head shapes");
  TORCH_CHECK(cos.size(0) == b && cos.size(1) == d && sin.sizes() == cos.sizes(), "cos, sin: [B, D]");
  TORCH_CHECK(hid % 32 == 0 && (h * d) % 32 == 0, "widths in groups of 32");
  const int64_t width = (h + 2 * kvh) * d;
  TORCH_CHECK(layers > 0, "at least one layer");
  const int64_t inter2 = gate_up_w[0].size(0), inter = inter2 / 2;
  TORCH_CHECK(inter % 32 == 0, "intermediate size in groups of 32");
  const auto record = [](int64_t kind) { return kind == 0 ? Q4::kRecord : Q8::kRecord; };
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* kind = kinds.data() + 4 * l;
    const at::Tensor* ws[4] = {&qkv_w[l], &o_w[l], &gate_up_w[l], &down_w[l]};
    const int64_t outs[4] = {width, hid, inter2, hid}, ins[4] = {hid, h * d, hid, inter};
    for (int j = 0; j < 4; ++j) {
      TORCH_CHECK(kind[j] == 0 || kind[j] == 1, "kind 0 (q4) or 1 (q8)");
      TORCH_CHECK(ws[j]->scalar_type() == at::kByte && ws[j]->is_contiguous() && ws[j]->dim() == 2 &&
                      ws[j]->size(0) == outs[j] && ws[j]->size(1) == ins[j] / 32 * record(kind[j]),
                  "layer ", l, " weight ", j, ": records of the wrong shape");
    }
    check_f32(input_norms[l], "input_norm");
    check_f32(post_norms[l], "post_norm");
    TORCH_CHECK(input_norms[l].numel() == hid && post_norms[l].numel() == hid, "norm widths");
    if (!qkv_bias.empty()) {
      check_f32(qkv_bias[l], "qkv_bias");
      TORCH_CHECK(qkv_bias[l].numel() == width, "qkv bias width");
    }
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == b, "slot_mapping: [B] int64");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) TORCH_CHECK(slot[r] >= 0 && slot[r] < n_slots, "slot out of range");
  for (const at::Tensor* t : {&rows_off, &rows, &slots_off, &slots}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, "int64 vectors");
  }
  const int64_t parts = rows_off.numel() - 1;
  const int64_t* ro = rows_off.data_ptr<int64_t>();
  const int64_t* so = slots_off.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  TORCH_CHECK(parts >= 0 && slots_off.numel() == parts + 1 && ro[0] == 0 && so[0] == 0 &&
                  ro[parts] == rows.numel() && so[parts] == slots.numel(), "offsets of parts");
  for (int64_t p = 0; p < parts; ++p) {
    TORCH_CHECK(ro[p] <= ro[p + 1] && so[p] <= so[p + 1] && (so[p + 1] > so[p] || ro[p + 1] == ro[p]),
                "parts: offsets never decrease, a part with rows has slots");
  }
  for (int64_t i = 0; i < rows.numel(); ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < b, "row out of range");
  for (int64_t i = 0; i < slots.numel(); ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < n_slots, "slot out of range");
  std::vector<char> covered(b, 0);
  for (int64_t i = 0; i < rows.numel(); ++i) covered[rp[i]] = 1;
  for (int64_t r = 0; r < b; ++r) TORCH_CHECK(covered[r], "a decode row attends no part");

  const int threads = std::max(1, at::get_num_threads());
  const prefixcache::DecodePlan plan =
      prefixcache::make_plan(b, h, d, kvh, n_slots, parts, ro, rp, so, sp, threads);
  const auto opts = x_in.options();
  at::Tensor x = x_in.clone();
  at::Tensor xn = at::empty({b, hid}, opts), qkv = at::empty({b, width}, opts);
  at::Tensor q = at::empty({b, h, d}, opts), attn = at::empty({b, h, d}, opts);
  at::Tensor proj = at::empty({b, hid}, opts), gu = at::empty({b, inter2}, opts);
  at::Tensor act = at::empty({b, inter}, opts);
  at::Tensor pm = at::empty({plan.total_rows, h}, opts), pl = at::empty({plan.total_rows, h}, opts);
  at::Tensor po = at::empty({plan.total_rows, h, d}, opts);
  float* xp = x.data_ptr<float>();
  float* xnp = xn.data_ptr<float>();
  float* qkvp = qkv.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* attnp = attn.data_ptr<float>();
  float* projp = proj.data_ptr<float>();
  float* gup = gu.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  float* pmp = pm.data_ptr<float>();
  float* plp = pl.data_ptr<float>();
  float* pop = po.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  const float eps = static_cast<float>(eps_d), scale = static_cast<float>(scale_d);
  const int64_t layer_stride = kvh * n_slots;  // elements per layer of the scales; x d for K/V
  const int64_t es = prefixcache::kv_elem_size(kv_code);
  if (scaled) {
    TORCH_CHECK(kv_k_scale->scalar_type() == at::kFloat && kv_k_scale->is_contiguous() &&
                    kv_k_scale->numel() == kv_k.size(0) * layer_stride &&
                    kv_v_scale->sizes() == kv_k_scale->sizes() && kv_v_scale->is_contiguous(),
                "scales: [L, KVH, N] float32 contiguous");
  }
  uint8_t* kbase = static_cast<uint8_t*>(kv_k.data_ptr());
  uint8_t* vbase = static_cast<uint8_t*>(kv_v.data_ptr());
  float* ksbase = scaled ? kv_k_scale->data_ptr<float>() : nullptr;
  float* vsbase = scaled ? kv_v_scale->data_ptr<float>() : nullptr;
  std::atomic<bool> merged_ok{true};

  prefixcache::run_team(threads, [&](const int t, const int nt, prefixcache::SpinBarrier* barrier) {
    prefixcache::Scratch scratch;
    float unused_scale;
    const auto [r0, r1] = prefixcache::share(b, t, nt);
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t* kind = kinds.data() + 4 * l;
      uint8_t* kl = kbase + l * layer_stride * d * es;
      uint8_t* vl = vbase + l * layer_stride * d * es;
      float* ksl = scaled ? ksbase + l * layer_stride : nullptr;
      float* vsl = scaled ? vsbase + l * layer_stride : nullptr;
      const prefixcache::KVSource ksrc{kl, ksl, kv_code}, vsrc{vl, vsl, kv_code};
      const float* in_norm = input_norms[l].data_ptr<float>();
      const float* post_norm = post_norms[l].data_ptr<float>();
      // xn = rms_norm(x)
      for (int64_t r = r0; r < r1; ++r) prefixcache::rms_norm_row(xp + r * hid, in_norm, eps, hid, xnp + r * hid);
      barrier->wait();
      {  // qkv = xn Wqkv + bias
        const auto [c0, c1] = prefixcache::share(width, t, nt, 16);
        gemv(kind[0], xnp, b, hid, qkv_w[l].data_ptr<uint8_t>(), c0, c1, qkvp, width);
        if (!qkv_bias.empty()) {
          const float* bias = qkv_bias[l].data_ptr<float>();
          for (int64_t r = 0; r < b; ++r)
            for (int64_t c = c0; c < c1; ++c) qkvp[r * width + c] = qkvp[r * width + c] + bias[c];
        }
      }
      barrier->wait();
      // rotate q and k; K and V into their cache slots (stored in the KV format; this step
      // attends to them as stored, read back from the cache); q into [B, H, D]
      for (int64_t r = r0; r < r1; ++r) {
        float* row = qkvp + r * width;
        prefixcache::rope_row(row, h + kvh, cp + r * d, snp + r * d, d);
        for (int64_t kh = 0; kh < kvh; ++kh) {
          const int64_t at_ = kh * n_slots + slot[r];
          prefixcache::store_row(kv_code, row + (h + kh) * d, d, kl + at_ * d * es,
                                 scaled ? ksl + at_ : &unused_scale, nullptr);
          prefixcache::store_row(kv_code, row + (h + kvh + kh) * d, d, vl + at_ * d * es,
                                 scaled ? vsl + at_ : &unused_scale, nullptr);
        }
        std::memcpy(qp + r * h * d, row, h * d * sizeof(float));
      }
      barrier->wait();
      for (int64_t i = t; i < static_cast<int64_t>(plan.per_thread.size()); i += nt) {
        prefixcache::attend_thread(plan, i, qp, ksrc, vsrc, scale, pmp, plp, pop, scratch);
      }
      barrier->wait();
      if (!prefixcache::merge_rows(plan, r0, r1, pmp, plp, pop, attnp)) merged_ok = false;
      barrier->wait();
      {  // x = attn Wo + x
        const auto [c0, c1] = prefixcache::share(hid, t, nt, 16);
        gemv(kind[1], attnp, b, h * d, o_w[l].data_ptr<uint8_t>(), c0, c1, projp, hid);
        for (int64_t r = 0; r < b; ++r)
          for (int64_t c = c0; c < c1; ++c) xp[r * hid + c] = projp[r * hid + c] + xp[r * hid + c];
      }
      barrier->wait();
      for (int64_t r = r0; r < r1; ++r) prefixcache::rms_norm_row(xp + r * hid, post_norm, eps, hid, xnp + r * hid);
      barrier->wait();
      {  // gu = xn Wgu
        const auto [c0, c1] = prefixcache::share(inter2, t, nt, 16);
        gemv(kind[2], xnp, b, hid, gate_up_w[l].data_ptr<uint8_t>(), c0, c1, gup, inter2);
      }
      barrier->wait();
      for (int64_t r = r0; r < r1; ++r) prefixcache::silu_mul_row(gup + r * inter2, inter, actp + r * inter);
      barrier->wait();
      {  // x = act Wdown + x
        const auto [c0, c1] = prefixcache::share(hid, t, nt, 16);
        gemv(kind[3], actp, b, inter, down_w[l].data_ptr<uint8_t>(), c0, c1, projp, hid);
        for (int64_t r = 0; r < b; ++r)
          for (int64_t c = c0; c < c1; ++c) xp[r * hid + c] = projp[r * hid + c] + xp[r * hid + c];
      }
      barrier->wait();
    }
  });
  TORCH_CHECK(merged_ok.load(), "a decode row attended no slot");
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, lib) {
  lib.def(
      "decode_forward(Tensor x, Tensor cos, Tensor sin, Tensor[] input_norms, Tensor[] post_norms, "
      "Tensor[] qkv, Tensor[] o, Tensor[] gate_up, Tensor[] down, int[] kinds, Tensor[] qkv_bias, "
      "Tensor(a!) kv_k, Tensor(b!) kv_v, Tensor(c!)? kv_k_scale, Tensor(d!)? kv_v_scale, int kv_code, "
      "Tensor slot_mapping, Tensor rows_off, Tensor rows, "
      "Tensor slots_off, Tensor slots, int num_heads, int num_kv_heads, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("decode_forward", &decode_forward);
}
