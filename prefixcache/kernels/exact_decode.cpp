// A decode-only step of the exact path through every decoder layer in one call: one parallel
// region per step, the threads meeting at a spinning barrier between the phases of a layer.
//
// Why: op by op, a decode layer is ~12 calls (norms, four integer linears with their
// quantization, rotary, the K/V store, attention, residual adds), each its own OpenMP region
// and Python dispatch; at decode sizes that fixed cost was most of a step (a single sequence:
// ~2.5 ms of kernels in a ~7.6 ms step on Zen 4, more with OMP_WAIT_POLICY=PASSIVE, where every
// region wakes sleeping threads). decode_forward.cpp does the same for the float32 path.
//
// The same bits as the op-by-op path (model/llama.py with IntLinear and paged attention), which
// tests/model/test_exact.py checks with torch.equal (decoded K/V and logits vs prefilled): every
// phase calls the functions the per-layer ops call (rowwise.h, int_gemm.h, exact_attention.h,
// kv_codec.h) on the same rows, each output is computed whole by one thread, and the residual and
// bias adds are the same single float adds.
//
// Per layer, B rows (one new token per sequence), phases separated by barriers:
//   rows   xn = rms_norm(x), quantized                 cols  qkv = xn Wqkv (+ bias)
//   rows   q/k norms; rotate q, k; K, V -> cache slots items attention (rows sharing a prefix, KV head)
//   rows   attn quantized                              cols  x += attn Wo
//   rows   xn = rms_norm(x), quantized                 cols  gu = xn Wgu
//   rows   h = silu(gate) up, quantized                cols  x += h Wdown
// "rows" phases split the B rows between threads; "cols" and "items" phases hand out column
// runs and attention items to whichever thread is free.
//
// Gemma 3's layers run here too, each difference the op path's own step: GeGLU for SwiGLU
// (gelu_tanh_mul_row, fused_ops.cpp's gelu_mul), the sandwich norms (Wo's and Wdown's outputs
// RMS-normed before the residual add: those two "cols" phases write y, and a "rows" phase
// norms it and adds), its score scale, and the sliding-window layers: their own rotary tables,
// the window passed to attention, and, where the pool keeps their K/V in window parts
// (kv/pool.py), the parts' tensors and the step's window slot tables (a second KV side).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "exact_attention.h"
#include "int_attention.h"
#include "int_gemm.h"
#include "kv_codec.h"
#include "rowwise.h"
#include "team.h"

namespace {

using prefixcache::IntScheme;
using prefixcache::IntWeights;
using prefixcache::Quantized;


// Decode rows sharing at least this many keys of cached prefix attend as a group: below it the
// K/V read once saves little.
constexpr int64_t kGroupMinShared = 256;

// PREFIXCACHE_DECODE_GROUPS=0 attends row by row (the same bits; to measure the groups).
bool decode_groups_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("PREFIXCACHE_DECODE_GROUPS");
    return e == nullptr || std::string(e) != "0";
  }();
  return on;
}

// One linear layer's arguments: packed weights and how its activations are quantized.
struct Linear {
  IntWeights w;
  IntScheme sc;
};

// code per linear: bit 0 = 8-bit weights (int8_linear's layout for the scheme), bit 1 = mixed activations,
// bit 2 = 16-bit activations (else 8), bit 3 = a weight scale (and offset) per 16 (8-bit pairs; GGUF
// Q6_K, Q3_K, Q2_K).
Linear make_linear(const at::Tensor& wq, const at::Tensor& wd, const at::Tensor& wm, int64_t code,
                   int64_t n, int64_t k, int64_t isa) {
  const bool w8 = code & 1;
  const int bits = (code & 4) ? 16 : 8;
  const bool mixed = code & 2;
  const bool s16 = code & 8;
  TORCH_CHECK(!mixed || bits == 16, "mixed activations with 16 bits");
  TORCH_CHECK(!s16 || w8, "scales per 16 weights: 8-bit weights");
  const IntScheme sc{bits, mixed, isa};
  const int64_t groups = k / prefixcache::kGroup, blocks = (n + prefixcache::kCols - 1) / prefixcache::kCols;
  TORCH_CHECK(wq.is_contiguous() && wq.numel() == blocks * groups * (w8 ? prefixcache::kBlockBytes8 : prefixcache::kBlockBytes) &&
                  wq.scalar_type() == (w8 && (s16 || !prefixcache::w8_quads(sc)) ? at::kChar : at::kByte),
              "packed weights of the wrong size or type");
  TORCH_CHECK(wd.is_contiguous() && wd.scalar_type() == at::kFloat &&
                  wd.numel() == (s16 ? 2 : 1) * blocks * groups * prefixcache::kCols,
              "weight scales [blocks, groups, 16] float32 ([blocks, 2 groups, 16] with scales per 16)");
  const bool off = wm.numel() > 0;
  TORCH_CHECK(off || w8, "4-bit groups need their offsets");
  TORCH_CHECK(!off || (wm.is_contiguous() && wm.scalar_type() == at::kFloat && wm.numel() == wd.numel()),
              "weight offsets [blocks, groups, 16] float32");
  return Linear{IntWeights{w8, wq.data_ptr(), wd.data_ptr<float>(), off ? wm.data_ptr<float>() : nullptr, n, k, s16}, sc};
}

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.is_cpu(), name, ": float32 contiguous on CPU");
}

// Where a layer's K/V live and which slots a step's rows read there: the pool's block tensors
// with the step's slot tables, or (Gemma 3) its window parts' tensors with the window tables.
struct Side {
  uint8_t* k = nullptr;
  uint8_t* v = nullptr;
  float* ks = nullptr;
  float* vs = nullptr;
  int64_t n_slots = 0, layers = 0;
  const int64_t* slot = nullptr;  // [B] the new token's slot
  const int64_t* cx = nullptr;    // [B] context length (the new token included)
  const int64_t* so = nullptr;    // [B + 1] offsets into sl
  const int64_t* sl = nullptr;    // every row's context slots
};

// One side's tensors and tables, checked: shapes, dtypes, slots in range, the new token last,
// and int16 contexts in whole units (what attention reads in place).
Side make_side(const at::Tensor& kv_k, const at::Tensor& kv_v, const c10::optional<at::Tensor>& kv_k_scale,
               const c10::optional<at::Tensor>& kv_v_scale, int64_t kv_code, const at::Tensor& slot_mapping,
               const at::Tensor& ctx, const at::Tensor& slots_off, const at::Tensor& slots, int64_t b, int64_t kvh,
               int64_t d) {
  const bool scaled = prefixcache::kv_scaled(kv_code);
  TORCH_CHECK(kv_k.is_contiguous() && kv_v.is_contiguous() && kv_v.sizes() == kv_k.sizes() && kv_k.dim() == 4 &&
                  kv_k.size(1) == kvh && kv_k.size(3) == d && kv_k.element_size() == prefixcache::kv_elem_size(kv_code),
              "kv: [L, KVH, N, D] contiguous, in the storage of kv_code");
  TORCH_CHECK(kv_k_scale.has_value() == scaled && kv_v_scale.has_value() == scaled, "scales iff int8/fp8");
  Side s;
  s.layers = kv_k.size(0), s.n_slots = kv_k.size(2);
  TORCH_CHECK(kv_code != prefixcache::kI16 || s.n_slots % prefixcache::kUnit == 0, "int16 K/V: a pool of whole units");
  if (scaled) {
    TORCH_CHECK(kv_k_scale->scalar_type() == at::kFloat && kv_k_scale->is_contiguous() &&
                    kv_k_scale->numel() == s.layers * kvh * s.n_slots && kv_v_scale->sizes() == kv_k_scale->sizes() &&
                    kv_v_scale->is_contiguous(),
                "scales: [L, KVH, N] float32 contiguous");
    s.ks = kv_k_scale->data_ptr<float>(), s.vs = kv_v_scale->data_ptr<float>();
  }
  s.k = static_cast<uint8_t*>(kv_k.data_ptr()), s.v = static_cast<uint8_t*>(kv_v.data_ptr());
  for (const at::Tensor* t : {&slot_mapping, &ctx, &slots_off, &slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, "index tensors: int64 vectors");
  TORCH_CHECK(slot_mapping.numel() == b && ctx.numel() == b && slots_off.numel() == b + 1, "one sequence per row");
  s.slot = slot_mapping.data_ptr<int64_t>(), s.cx = ctx.data_ptr<int64_t>();
  s.so = slots_off.data_ptr<int64_t>(), s.sl = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(s.slot[r] >= 0 && s.slot[r] < s.n_slots, "slot out of range");
    TORCH_CHECK(s.cx[r] >= 1 && s.so[r] >= 0 && s.so[r] + s.cx[r] <= slots.numel(), "context slots");
    TORCH_CHECK(s.sl[s.so[r] + s.cx[r] - 1] == s.slot[r], "a row's last context slot is its new token's");
    for (int64_t j = 0; j < s.cx[r]; ++j) {
      const int64_t at_ = s.sl[s.so[r] + j];
      TORCH_CHECK(at_ >= 0 && at_ < s.n_slots, "slot out of range");
      TORCH_CHECK(kv_code != prefixcache::kI16 || (at_ % prefixcache::kUnit == j % prefixcache::kUnit &&
                                                   (j % prefixcache::kUnit == 0 || at_ == s.sl[s.so[r] + j - 1] + 1)),
                  "int16 K/V: a context's slots in whole units of 16");
    }
  }
  return s;
}

at::Tensor exact_decode(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                        at::TensorList input_norms, at::TensorList post_norms, at::TensorList wq,
                        at::TensorList wd, at::TensorList wm, at::IntArrayRef codes,
                        at::TensorList qkv_bias, at::TensorList qk_norms, at::TensorList out_norms,
                        at::IntArrayRef windows, int64_t gelu, int64_t isa,
                        const at::Tensor& kv_k, const at::Tensor& kv_v, const c10::optional<at::Tensor>& kv_k_scale,
                        const c10::optional<at::Tensor>& kv_v_scale, int64_t kv_code,
                        const at::Tensor& slot_mapping, const at::Tensor& ctx,
                        const at::Tensor& slots_off, const at::Tensor& slots,
                        const c10::optional<at::Tensor>& local_cos, const c10::optional<at::Tensor>& local_sin,
                        at::TensorList parts, at::IntArrayRef in_parts, const c10::optional<at::Tensor>& parts_k_scale,
                        const c10::optional<at::Tensor>& parts_v_scale, at::TensorList parts_tables,
                        int64_t num_heads, int64_t num_kv_heads, int64_t ffn, double eps_d, double scale_d) {
  check_f32(x_in, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  prefixcache::check_isa(isa);
  const int64_t layers = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK(layers > 0 && post_norms.size() == input_norms.size() && wq.size() == 4 * input_norms.size() &&
                  wd.size() == wq.size() && wm.size() == wq.size() && static_cast<int64_t>(codes.size()) == 4 * layers,
              "four linears per layer, each with weights, scales, offsets and a code");
  TORCH_CHECK(qkv_bias.empty() || static_cast<int64_t>(qkv_bias.size()) == layers, "qkv bias per layer or none");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers, "q and k norms per layer or none");
  TORCH_CHECK(out_norms.empty() || static_cast<int64_t>(out_norms.size()) == 2 * layers,
              "attention and MLP output norms per layer or none");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == layers && static_cast<int64_t>(in_parts.size()) == layers,
              "a window (0: global) and a KV side per layer");
  TORCH_CHECK(gelu == 0 || gelu == 1, "gelu: 0 (SwiGLU) or 1 (GeGLU, gelu_tanh)");
  TORCH_CHECK(prefixcache::kv_code_known(kv_code), "unknown kv code");
  const int64_t b = x_in.size(0), hid = x_in.size(1);
  const int64_t h = num_heads, kvh = num_kv_heads, d = kv_k.dim() == 4 ? kv_k.size(3) : 0;
  TORCH_CHECK(kvh > 0 && h % kvh == 0 && d % 16 == 0 && d > 0 && d <= prefixcache::exact::kMaxD, "head shapes");
  // The two KV sides: the blocks' tensors, and the window parts' where the pool has them.
  Side sides[2];
  sides[0] = make_side(kv_k, kv_v, kv_k_scale, kv_v_scale, kv_code, slot_mapping, ctx, slots_off, slots, b, kvh, d);
  const bool has_parts = !parts.empty();
  TORCH_CHECK(parts.size() == (has_parts ? 2u : 0u) && parts_tables.size() == (has_parts ? 4u : 0u),
              "window parts: K and V tensors and four tables, or none");
  if (has_parts) {
    sides[1] = make_side(parts[0], parts[1], parts_k_scale, parts_v_scale, kv_code, parts_tables[0], parts_tables[1],
                         parts_tables[2], parts_tables[3], b, kvh, d);
  }
  // layer -> its index in its side's tensors (the pool's order: kv/pool.py KVCache._where)
  std::vector<int64_t> kv_index(static_cast<size_t>(layers));
  {
    int64_t count[2] = {0, 0};
    for (int64_t l = 0; l < layers; ++l) {
      TORCH_CHECK(windows[l] >= 0 && (in_parts[l] == 0 || in_parts[l] == 1), "window >= 0, side 0 or 1");
      TORCH_CHECK(!in_parts[l] || (has_parts && windows[l] > 0), "only sliding-window layers live in window parts");
      kv_index[l] = count[in_parts[l]]++;
    }
    TORCH_CHECK(count[0] <= sides[0].layers && count[1] <= sides[1].layers, "more layers than the pool holds");
  }
  const bool windowed = std::any_of(windows.begin(), windows.end(), [](int64_t w) { return w > 0; });
  TORCH_CHECK(local_cos.has_value() == windowed && local_sin.has_value() == windowed,
              "the local rotary tables iff some layer has a window");
  const bool integer = kv_code == prefixcache::kI16;  // int16 K/V: the integer units (int_attention.h)
  const int64_t attn_isa = std::min<int64_t>(isa, prefixcache::exact::kIsaVnni);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == b && cos.size(1) == d && sin.sizes() == cos.sizes(), "cos, sin: [B, D]");
  if (windowed) {
    check_f32(*local_cos, "local_cos");
    check_f32(*local_sin, "local_sin");
    TORCH_CHECK(local_cos->sizes() == cos.sizes() && local_sin->sizes() == cos.sizes(), "local cos, sin: [B, D]");
  }
  const int64_t width = (h + 2 * kvh) * d;
  TORCH_CHECK(ffn > 0 && ffn % prefixcache::kGroup == 0 && hid % prefixcache::kGroup == 0 &&
                  (h * d) % prefixcache::kGroup == 0,
              "widths in groups of 32");
  std::vector<Linear> lin;
  lin.reserve(static_cast<size_t>(4 * layers));
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t outs[4] = {width, hid, 2 * ffn, hid}, ins[4] = {hid, h * d, hid, ffn};
    for (int j = 0; j < 4; ++j) {
      const int64_t i = 4 * l + j;
      lin.push_back(make_linear(wq[i], wd[i], wm[i], codes[i], outs[j], ins[j], isa));
    }
    check_f32(input_norms[l], "input_norm");
    check_f32(post_norms[l], "post_norm");
    TORCH_CHECK(input_norms[l].numel() == hid && post_norms[l].numel() == hid, "norm widths");
    if (!qk_norms.empty()) {
      check_f32(qk_norms[2 * l], "q_norm");
      check_f32(qk_norms[2 * l + 1], "k_norm");
      TORCH_CHECK(qk_norms[2 * l].numel() == d && qk_norms[2 * l + 1].numel() == d, "q/k norm widths");
    }
    if (!out_norms.empty()) {
      check_f32(out_norms[2 * l], "attention output norm");
      check_f32(out_norms[2 * l + 1], "MLP output norm");
      TORCH_CHECK(out_norms[2 * l].numel() == hid && out_norms[2 * l + 1].numel() == hid, "output norm widths");
    }
    if (!qkv_bias.empty()) {
      check_f32(qkv_bias[l], "qkv_bias");
      TORCH_CHECK(qkv_bias[l].numel() == width, "qkv bias width");
    }
  }
  const int64_t es = prefixcache::kv_elem_size(kv_code);
  const bool scaled = prefixcache::kv_scaled(kv_code);
  const bool sandwich = !out_norms.empty();

  const auto opts = x_in.options();
  at::Tensor x = x_in.clone();
  at::Tensor xn = at::empty({b, std::max(hid, ffn)}, opts), qkv = at::empty({b, width}, opts);
  at::Tensor q = at::empty({b, h, d}, opts), attn = at::empty({b, h, d}, opts);
  at::Tensor proj = at::empty({b, hid}, opts), gu = at::empty({b, 2 * ffn}, opts);
  float* xp = x.data_ptr<float>();
  float* xnp = xn.data_ptr<float>();
  float* qkvp = qkv.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* attnp = attn.data_ptr<float>();
  float* projp = proj.data_ptr<float>();
  float* gup = gu.data_ptr<float>();
  const float* rot_cos[2] = {cos.data_ptr<float>(), windowed ? local_cos->data_ptr<float>() : nullptr};
  const float* rot_sin[2] = {sin.data_ptr<float>(), windowed ? local_sin->data_ptr<float>() : nullptr};
  const float eps = static_cast<float>(eps_d), scale = static_cast<float>(scale_d);

  // The quantized activations of each linear's input, sized for the widest scheme it needs.
  Quantized qa;
  {
    size_t widest = static_cast<size_t>(std::max({hid, h * d, ffn}));
    qa.hi.resize(b * widest), qa.lo.resize(b * widest), qa.a16.resize(b * widest);
    qa.wide.resize(b * widest / prefixcache::kGroup);
    qa.s.resize(b * widest / prefixcache::kGroup), qa.ssum.resize(b * widest / prefixcache::kGroup);
    qa.isum.resize(b * widest / prefixcache::kGroup);
    if (std::any_of(lin.begin(), lin.end(), [](const Linear& L) { return L.w.s16; }))
      qa.ssum16.resize(2 * b * widest / prefixcache::kGroup);
  }
  // Work counters of the dynamic phases: per layer, qkv / o / gate_up / down / attention.
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[5 * layers]);
  for (int64_t i = 0; i < 5 * layers; ++i) next[i].store(0, std::memory_order_relaxed);
  const int threads = std::max(1, at::get_num_threads());
  // Rows whose contexts share a cached prefix attend in groups on the int16 path's global layers
  // (attend_decode_group_int: the shared K/V read once a step, the same bits as row by row);
  // at least two items a thread where the rows allow. PREFIXCACHE_DECODE_GROUPS=0: row by row.
  std::vector<prefixcache::exact::DecodeGroup> groups;
  if (integer && decode_groups_enabled()) {
    groups = prefixcache::exact::shared_prefix_groups(sides[0].so, sides[0].sl, sides[0].cx, b, kGroupMinShared,
                                                      (2 * threads + kvh - 1) / kvh);
  } else {
    for (int64_t r = 0; r < b; ++r) groups.push_back({{r}, 0});
  }
  // Column runs per item: at least four items per thread where the layer allows.
  const auto per_item = [&](int64_t blocks) {
    return std::clamp<int64_t>(blocks / (4 * threads), 1, 8);
  };
  // qkv = xn Wqkv (+ bias) and friends: column runs of the layer handed out dynamically.
  const auto gemm_cols = [&](const Linear& L, std::atomic<int64_t>& counter, float* y, const float* bias,
                             const float* residual) {
    const int64_t blocks = L.w.blocks(), pi = per_item(blocks), items = (blocks + pi - 1) / pi;
    for (int64_t it = counter.fetch_add(1, std::memory_order_relaxed); it < items;
         it = counter.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t b0 = it * pi, b1 = std::min(blocks, b0 + pi);
      prefixcache::gemm_item(qa, L.w, L.sc, 0, b, b0, b1, y);
      const int64_t c0 = b0 * prefixcache::kCols, c1 = std::min(L.w.n, b1 * prefixcache::kCols);
      if (bias != nullptr)
        for (int64_t r = 0; r < b; ++r)
          for (int64_t c = c0; c < c1; ++c) y[r * L.w.n + c] = y[r * L.w.n + c] + bias[c];
      if (residual != nullptr)  // x += y, as the op path's y.add_(x)
        for (int64_t r = 0; r < b; ++r)
          for (int64_t c = c0; c < c1; ++c) xp[r * hid + c] = y[r * hid + c] + xp[r * hid + c];
    }
  };
  const auto quantize = [&](const Linear& L, const float* src, int64_t k, int64_t r0, int64_t r1) {
    prefixcache::quantize_rows(src, k, r0, r1, L.sc.bits, prefixcache::whole_activations(L.w.w8, L.sc, L.w.s16),
                               L.sc.mixed, qa);
  };

  prefixcache::run_team(threads, [&](const int t, const int nt, prefixcache::SpinBarrier* barrier) {
    std::vector<float> kt, vbuf;
    std::unique_ptr<prefixcache::exact::IntScratch> z(integer ? new prefixcache::exact::IntScratch : nullptr);
    // a decode group's rows (queries, outputs, keys, contexts), reused by every item of the step
    std::vector<const float*> gq;
    std::vector<float*> go;
    std::vector<prefixcache::exact::PagedInt16Keys> gk;
    std::vector<int64_t> gc;
    float unused_scale;
    const auto [r0, r1] = prefixcache::share(b, t, nt);
    for (int64_t l = 0; l < layers; ++l) {
      const Linear& Lqkv = lin[4 * l];
      const Linear& Lo = lin[4 * l + 1];
      const Linear& Lgu = lin[4 * l + 2];
      const Linear& Ldown = lin[4 * l + 3];
      const Side& S = sides[in_parts[l]];
      const int64_t window = windows[l], stride = kvh * S.n_slots;  // scales per layer; x d for K/V
      uint8_t* kl = S.k + kv_index[l] * stride * d * es;
      uint8_t* vl = S.v + kv_index[l] * stride * d * es;
      float* ksl = scaled ? S.ks + kv_index[l] * stride : nullptr;
      float* vsl = scaled ? S.vs + kv_index[l] * stride : nullptr;
      const float* cp = rot_cos[window > 0];
      const float* snp = rot_sin[window > 0];
      const float* in_norm = input_norms[l].data_ptr<float>();
      const float* post_norm = post_norms[l].data_ptr<float>();
      // x += rms_norm(y) row by row (the sandwich norms), as the op path's o.add_(x)
      const auto norm_add = [&](const float* w) {
        for (int64_t r = r0; r < r1; ++r) {
          float* y = projp + r * hid;
          prefixcache::rms_norm_row(y, w, eps, hid, y);
          for (int64_t c = 0; c < hid; ++c) xp[r * hid + c] = y[c] + xp[r * hid + c];
        }
      };
      for (int64_t r = r0; r < r1; ++r) prefixcache::rms_norm_row(xp + r * hid, in_norm, eps, hid, xnp + r * hid);
      quantize(Lqkv, xnp, hid, r0, r1);
      barrier->wait();
      gemm_cols(Lqkv, next[5 * l], qkvp, qkv_bias.empty() ? nullptr : qkv_bias[l].data_ptr<float>(), nullptr);
      barrier->wait();
      // rotate q and k; K and V into their cache slots (attention reads them back as stored)
      for (int64_t r = r0; r < r1; ++r) {
        float* row = qkvp + r * width;
        if (!qk_norms.empty()) {  // Qwen3, Gemma 3: each q head, then each k head, RMS-normed in place
          const float* qn = qk_norms[2 * l].data_ptr<float>();
          const float* kn = qk_norms[2 * l + 1].data_ptr<float>();
          for (int64_t j = 0; j < h + kvh; ++j)
            prefixcache::rms_norm_row(row + j * d, j < h ? qn : kn, eps, d, row + j * d);
        }
        prefixcache::rope_row(row, h + kvh, cp + r * d, snp + r * d, d);
        for (int64_t kh = 0; kh < kvh; ++kh) {
          const int64_t at_ = kh * S.n_slots + S.slot[r];
          prefixcache::store_token(kv_code, row + (h + kh) * d, d, kl + kh * S.n_slots * d * es, S.slot[r], false,
                                   scaled ? ksl + at_ : &unused_scale, nullptr);
          prefixcache::store_token(kv_code, row + (h + kvh + kh) * d, d, vl + kh * S.n_slots * d * es, S.slot[r],
                                   true, scaled ? vsl + at_ : &unused_scale, nullptr);
        }
        std::memcpy(qp + r * h * d, row, h * d * sizeof(float));
      }
      barrier->wait();
      if (integer && window == 0 && in_parts[l] == 0) {  // items (group of rows, KV head)
        const int64_t items = static_cast<int64_t>(groups.size()) * kvh;
        std::atomic<int64_t>& counter = next[5 * l + 4];
        for (int64_t it = counter.fetch_add(1, std::memory_order_relaxed); it < items;
             it = counter.fetch_add(1, std::memory_order_relaxed)) {
          const prefixcache::exact::DecodeGroup& grp = groups[it / kvh];
          const int64_t kh = it % kvh, n = static_cast<int64_t>(grp.rows.size());
          gq.clear(), go.clear(), gk.clear(), gc.clear();
          for (const int64_t r : grp.rows) {
            gq.push_back(qp + r * h * d);
            go.push_back(attnp + r * h * d);
            gk.push_back({reinterpret_cast<const int16_t*>(kl), reinterpret_cast<const int16_t*>(vl), ksl, vsl,
                          S.n_slots, d, S.sl + S.so[r]});
            gc.push_back(S.cx[r]);
          }
          prefixcache::exact::attend_decode_group_int(gq.data(), gk.data(), go.data(), gc.data(), n, grp.shared, h,
                                                      kvh, d, kh, scale, attn_isa, *z);
        }
      } else {  // attention items (row, KV head), each a one-query chunk of paged_attention
        const int64_t items = b * kvh;
        std::atomic<int64_t>& counter = next[5 * l + 4];
        for (int64_t it = counter.fetch_add(1, std::memory_order_relaxed); it < items;
             it = counter.fetch_add(1, std::memory_order_relaxed)) {
          const int64_t r = it / kvh, kh = it % kvh;
          const int64_t* ctx_slots = S.sl + S.so[r];
          if (integer) {
            const prefixcache::exact::PagedInt16Keys keys{reinterpret_cast<const int16_t*>(kl),
                                                          reinterpret_cast<const int16_t*>(vl), ksl, vsl,
                                                          S.n_slots, d, ctx_slots};
            prefixcache::exact::attend_rows_int(qp + r * h * d, keys, attnp + r * h * d, 1, S.cx[r], h, kvh, d, kh,
                                                0, 1, scale, attn_isa, *z, window);
            continue;
          }
          const prefixcache::exact::PagedKeys keys{kl, vl, ksl, vsl, kv_code, S.n_slots, d, ctx_slots};
          prefixcache::exact::attend_rows(qp + r * h * d, keys, attnp + r * h * d, 1, S.cx[r], h, kvh, d, kh, 0,
                                          1, scale, kt, vbuf, window);
        }
      }
      barrier->wait();
      quantize(Lo, attnp, h * d, r0, r1);
      barrier->wait();
      gemm_cols(Lo, next[5 * l + 1], projp, nullptr, sandwich ? nullptr : xp);
      barrier->wait();
      if (sandwich) norm_add(out_norms[2 * l].data_ptr<float>());
      for (int64_t r = r0; r < r1; ++r) prefixcache::rms_norm_row(xp + r * hid, post_norm, eps, hid, xnp + r * hid);
      quantize(Lgu, xnp, hid, r0, r1);
      barrier->wait();
      gemm_cols(Lgu, next[5 * l + 2], gup, nullptr, nullptr);
      barrier->wait();
      for (int64_t r = r0; r < r1; ++r) {
        if (gelu)
          prefixcache::gelu_tanh_mul_row(gup + r * 2 * ffn, ffn, xnp + r * ffn);
        else
          prefixcache::silu_mul_row(gup + r * 2 * ffn, ffn, xnp + r * ffn);
      }
      quantize(Ldown, xnp, ffn, r0, r1);
      barrier->wait();
      gemm_cols(Ldown, next[5 * l + 3], projp, nullptr, sandwich ? nullptr : xp);
      barrier->wait();
      // No barrier after it: the next layer's first phase reads x of this thread's own rows
      // (the same static shares), and y is next written after three more barriers.
      if (sandwich) norm_add(out_norms[2 * l + 1].data_ptr<float>());
    }
  });
  return x;
}

// The decode groups exact_decode forms for a step's tables (for tests and tools): [B, 2], each
// row's group (numbered in the order formed) and the keys its group shares.
at::Tensor decode_groups(const at::Tensor& ctx, const at::Tensor& slots_off, const at::Tensor& slots, int64_t min_shared,
                         int64_t min_groups) {
  for (const auto* t : {&ctx, &slots_off, &slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, "int64 contiguous vectors");
  const int64_t b = ctx.numel();
  TORCH_CHECK(slots_off.numel() == b + 1, "slots_off: [B + 1]");
  const int64_t* cx = ctx.data_ptr<int64_t>();
  const int64_t* so = slots_off.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r)
    TORCH_CHECK(cx[r] > 0 && so[r] >= 0 && so[r] + cx[r] <= slots.numel(), "context slots");
  const auto groups =
      prefixcache::exact::shared_prefix_groups(so, slots.data_ptr<int64_t>(), cx, b, min_shared, min_groups);
  at::Tensor out = at::empty({b, 2}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (size_t g = 0; g < groups.size(); ++g)
    for (const int64_t r : groups[g].rows) o[2 * r] = static_cast<int64_t>(g), o[2 * r + 1] = groups[g].shared;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, lib) {
  lib.def("decode_groups(Tensor ctx, Tensor slots_off, Tensor slots, int min_shared, int min_groups) -> Tensor");
  lib.def(
      "exact_decode(Tensor x, Tensor cos, Tensor sin, Tensor[] input_norms, Tensor[] post_norms, "
      "Tensor[] wq, Tensor[] wd, Tensor[] wm, int[] codes, Tensor[] qkv_bias, Tensor[] qk_norms, "
      "Tensor[] out_norms, int[] windows, int gelu, int isa, "
      "Tensor(a!) kv_k, Tensor(b!) kv_v, Tensor(c!)? kv_k_scale, Tensor(d!)? kv_v_scale, int kv_code, "
      "Tensor slot_mapping, Tensor ctx, Tensor slots_off, Tensor slots, Tensor? local_cos, Tensor? local_sin, "
      "Tensor(e!)[] parts, int[] in_parts, Tensor(f!)? parts_k_scale, Tensor(g!)? parts_v_scale, Tensor[] parts_tables, "
      "int num_heads, int num_kv_heads, int ffn, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, lib) {
  lib.impl("exact_decode", &exact_decode);
  lib.impl("decode_groups", &decode_groups);
}
