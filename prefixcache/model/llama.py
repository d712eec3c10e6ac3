"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3, Gemma 3) over a paged KV cache.

Read top to bottom: norm, rotary embedding, attention block, MLP, layer, model. Shapes are noted
at tensor boundaries; T is the number of new tokens in the flat batch of a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixcache import kernels
from prefixcache.kv.pool import KVCache, LayerKV
from prefixcache.model.attention import AttentionMetadata, paged_attention
from prefixcache.model.config import ModelConfig
from prefixcache.model.int_linear import IntLinear
from prefixcache.model.linear import LARGE_M, GroupLinear, make_linear, quantize_int4, quantize_int8
from prefixcache.model.loader import Int4Groups, Int8Groups, Int8Groups16, LoadedWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, native: bool = False) -> torch.Tensor:
    if native:  # one pass in C++ (prefixcache/kernels/fused_ops.cpp)
        return kernels.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:  # one fused op; same math as below
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Normalise in float32 whatever the weights' dtype, as the reference does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig, rope_freqs: torch.Tensor | None = None,
                  local: bool = False) -> torch.Tensor:  # fmt: skip
    """Rotary frequencies; ``local``: those of sliding-window layers (their own base, unscaled)."""
    d = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = {} if local else config.rope_scaling or {}
    kind = rs.get("rope_type") or rs.get("type")
    if rope_freqs is not None and not local:  # GGUF llama3 models store the per-frequency factors
        inv = inv / rope_freqs.double()
    elif kind == "llama3":
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / rs["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv.float()


class Rotary:
    """cos/sin tables for every position up to max_len, rotate-half convention.

    ``rotate_half(x) = cat(-x2, x1)``, so ``x cos + rotate_half(x) sin`` is
    ``x cos + roll(x, D/2) sin'`` with ``sin' = cat(-sin1, sin2)``: the sign lives in the table
    and a rotation is three ops (roll, mul, addcmul) for q and k of a layer together.
    """

    def __init__(self, config: ModelConfig, max_len: int, rope_freqs: torch.Tensor | None, device,
                 local: bool = False):  # fmt: skip
        inv = rope_inv_freq(config, rope_freqs, local)
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [max_len, D/2]
        # Half tables: the full ones repeat cos and negate sin's first half, so they are built
        # per step for its positions only (the same numbers; 64 MB less for Gemma 3's two
        # bases at 32k positions).
        self.half_cos = freqs.cos().to(device)  # [max_len, D/2]
        self.half_sin = freqs.sin().to(device)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, D] float32 at ``positions``: ``cat(cos, cos)``, ``cat(-sin, sin)``."""
        c = self.half_cos.index_select(0, positions)
        s = self.half_sin.index_select(0, positions)
        return torch.cat([c, c], dim=-1), torch.cat([-s, s], dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, native: bool = False):
        """cos, signed sin for the step's positions, [T, 1, D] ([T, D] for the native rotary):
        built once per step, used by every layer."""
        cos, sin = self.rows(positions)
        cos, sin = cos.to(dtype), sin.to(dtype)
        if native:
            return cos, sin
        return cos.unsqueeze(1), sin.unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos, sin: [T, 1, D]
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin)


def rerotate(k: torch.Tensor, shift: int, rotary: Rotary) -> torch.Tensor:
    """Cached K moved to new positions (segment caching places a document's K computed alone):
    ``k`` [..., n, head_dim] float32 rotated for positions p..p+n-1 -> rotated for
    p+shift..p+shift+n-1. A rotation by a then by b is a rotation by a + b, so the positional
    part is exact (to float32 rounding); what it cannot fix is that k was computed without the
    context that now precedes it (what recomputation is for). A negative shift rotates back:
    R(-d) has cos(d) and -sin(d). V carries no position and is copied unchanged."""
    if shift == 0:
        return k
    at = torch.tensor([abs(shift)], device=rotary.half_cos.device)
    cos, sin = (t[0].to(k.dtype) for t in rotary.rows(at))  # [head_dim], the rotate-half convention
    return rotate(k, cos, sin if shift > 0 else -sin)


class DecoderLayer:
    """Attention block then MLP block, each pre-normed with a residual around it (Gemma 3: and
    post-normed inside it, ``out_norms``)."""

    def __init__(self, config: ModelConfig, norms: tuple[torch.Tensor, torch.Tensor], qkv, o,
                 gate_up, down, native: bool, qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
                 out_norms: tuple[torch.Tensor, torch.Tensor] | None = None, window: int = 0):  # fmt: skip
        self.input_norm, self.post_norm = norms  # before attention, before the MLP
        # Qwen3, Gemma 3: an RMSNorm over each q and each k head (weights of head_dim) before rotary
        self.qk_norms = qk_norms
        self.out_norms = out_norms  # Gemma 3: on attention's and the MLP's outputs
        self.window = window  # > 0: a sliding-window layer (keys (p - window, p])
        self.gelu = config.hidden_act == "gelu_tanh"  # GeGLU, else SwiGLU
        self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj = qkv, o, gate_up, down
        self.h, self.kvh, self.d = config.num_heads, config.num_kv_heads, config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.score_scale
        self.native = native  # the fused C++ element-wise ops (float32 on CPU)
        self.isa = "avx2"  # the exact path's integer ISA for attention (LlamaModel sets it)

    def qkv(self, x, cos, sin):
        """q [T, H, D], k [T, KVH, D] (both rotated) and v [T, KVH, D] of the layer input x: what
        the layer stores and attends with, before any attention."""
        t, h, kvh, d, native = x.shape[0], self.h, self.kvh, self.d, self.native
        qkv = self.qkv_proj(rms_norm(x, self.input_norm, self.eps, native))  # [T, (H + 2 KVH) D]
        if self.qk_norms is not None:  # per head, row by row: a token's heads never see its batch
            for (a, n), w in zip(((0, h), (h, kvh)), self.qk_norms):
                heads = qkv[:, a * d : (a + n) * d].reshape(t * n, d).contiguous()  # (one head: a view)
                qkv[:, a * d : (a + n) * d] = rms_norm(heads, w, self.eps, native).view(t, n * d)
        if native:
            kernels.rope_(qkv, h + kvh, cos, sin)  # q and k heads, in place
            qk = qkv[:, : (h + kvh) * d].view(t, h + kvh, d)
        else:
            qk = rotate(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), cos, sin)  # [T, H + KVH, D]
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
        return qk[:, :h], qk[:, h:], v

    def __call__(self, x, cos, sin, kv: LayerKV, meta: AttentionMetadata, qkv=None):
        """``qkv``: ``self.qkv(x, cos, sin)`` when the caller already has it (a probe)."""
        t, h, d, native = x.shape[0], self.h, self.d, self.native
        q, k, v = self.qkv(x, cos, sin) if qkv is None else qkv
        o = paged_attention(q, k, v, kv, meta, self.scale, self.isa, self.window)  # [T, H, D]
        o = self.o_proj(o.reshape(t, h * d))
        if self.out_norms is not None:
            o = rms_norm(o, self.out_norms[0], self.eps, native)
        x = o.add_(x)
        gate_up = self.gate_up_proj(rms_norm(x, self.post_norm, self.eps, native))
        if native:
            y = self.down_proj((kernels.gelu_mul if self.gelu else kernels.silu_mul)(gate_up))
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            y = self.down_proj(act.mul_(up))
        if self.out_norms is not None:
            y = rms_norm(y, self.out_norms[1], self.eps, native)
        return y.add_(x)


# Checkpoint tensors concatenated (in this order, along the output dim) into one fused matmul:
# fewer, larger matmuls, which matters most for decode where each is a thin matrix-vector product.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass
class ProbeRows:
    """The forward's last rows are probes (``sequence.Piece.probe``, segments/blend.py): they
    run through layer 0 like any row (storing layer-0 K/V, attending), then only layer 1's K/V
    are computed from its output and stored over what that layer's slots held; the squared
    distance between the V stored and the V held, summed over KV heads, is each row's
    ``deviation``. The other rows go on through every layer, as if the probes were not there
    (on the exact path a row's bits never depend on its companions: docs/design.md)."""

    keep: int  # the rows before the probes
    slots: torch.Tensor  # the probes' slots
    rest: AttentionMetadata | None  # the metadata of the first ``keep`` rows alone
    deviation: torch.Tensor | None = None  # [probe rows] float32 on the CPU, set by the forward


class LlamaModel:
    """The decoder over a paged KV cache; linear layers are kernels from ``linear.py``.

    ``weight_format``: "dense" (every weight a float matrix in the compute dtype), "file" (the
    file's own 4/8-bit groups where it stores them, run by the group kernels), "int4"/"int8"
    (every decoder layer in groups of that width, quantized here where the file has none). The
    output projection stays 8-bit or dense: its logits decide greedy choices and logprobs.

    ``activations``: "float32" (float32 activations), or "int16"/"mixed"/"int8"/"auto": the
    decoder's layers as ``IntLinear`` (exact integer sums, model/int_linear.py) with attention
    and the output projection in a fixed order for every row, so each token's K/V and logits
    are bit-for-bit independent of its batch, its chunking and of whether its context came
    from the cache ("auto": mixed for 4-bit groups and the file's own 8-bit ones, int16 for 8-bit
    groups made at load, where that runs; else float32). ``self.exact`` says which ran.
    """

    def __init__(
        self,
        weights: LoadedWeights,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: str = "dense",
        activations: str = "float32",
    ):
        cfg = self.config = weights.config
        tensors = weights.tensors
        self.requantized = False  # whether any layer holds numbers other than the file's

        def tensor(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"weights missing from the checkpoint: {name}")
            return tensors[name]

        def stored_groups(names: list[str]):
            for table, cat in ((weights.int4, Int4Groups.cat), (weights.int8, Int8Groups.cat),
                               (weights.groups16, Int8Groups16.cat)):  # fmt: skip
                if all(n in table for n in names):
                    return cat([table[n] for n in names]) if len(names) > 1 else table[names[0]]
            return None

        def linear(names: list[str], shape: tuple[int, int], fmt: str, bias_names=()):
            # The float weights only where they are used: reading (and concatenating) the
            # float copies of kept groups would fault in every page of a mapped weights-cache
            # entry (400 MB more resident at ready for Gemma 3 270M).
            shapes = [tuple(tensor(n).shape) for n in names]
            if any(len(s) != 2 or s[1] != shape[1] for s in shapes) or sum(s[0] for s in shapes) != shape[0]:
                raise ValueError(f"{names[0]}: shape {shapes} != {shape}")

            def dense() -> torch.Tensor:
                return torch.cat([tensor(n) for n in names]) if len(names) > 1 else tensor(names[0])
            biases = [tensors.get(n) for n in bias_names]
            b = torch.cat(biases) if biases and all(x is not None for x in biases) else None
            groups = stored_groups(names)
            if bits is not None and names[0] != head_name:
                # The file's own 4- or 8-bit groups as stored; anything else (a bf16/float
                # checkpoint, other GGUF types) quantized here: to 4 bits when asked, else to
                # 8-bit groups (w8a16 stays within the quality floor, docs/design.md section 2).
                want = Int4Groups if weight_format == "int4" else Int8Groups if weight_format == "int8" else None
                made_here = groups is None or (want is not None and not isinstance(groups, want))
                if made_here:
                    w = dense()
                    groups = quantize_int4(w) if weight_format == "int4" else quantize_int8(w)
                    self.requantized = True
                # auto: mixed activations (8 bits for most groups, one kernel pass) where the
                # activations are the only rounding the model sees besides the file's own: its
                # 4-bit groups, or its 8-bit groups as stored. 8-bit groups made here from a
                # float checkpoint keep 16 bits: their own rounding already takes most of the
                # quality floor (KL 8.7e-4 of 1e-3; mixed on top 1.3e-3, docs/design.md
                # section 2).
                mixed = bits == 16 and (activations == "mixed" or (
                    activations == "auto" and cfg.architecture not in _AUTO_INT16
                    and (isinstance(groups, Int4Groups) or not made_here)))  # fmt: skip
                return IntLinear(groups, b, bits, isa, mixed)
            lin = make_linear(dense(), b, fmt, dtype, device, groups)
            if lin.kind != "dense" and (groups is None or lin.kind != _KIND[type(groups)]):
                self.requantized = True
            return lin

        h, kvh, d, hid = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        inter = cfg.intermediate_size
        # The fused C++ ops and native decode attention: float32 on CPU, shapes they take.
        self.native = (
            device.type == "cpu" and dtype == torch.float32 and d % 16 == 0 and d <= 256
            and hid % 8 == 0 and inter % 8 == 0 and kernels.available()
        )  # fmt: skip
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in tensors
        head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        bits = self._activation_bits(activations, weight_format, weights)
        isa = self.isa = kernels.isa() if bits is not None else None
        self.exact = bits is not None
        self.layers = []
        for i in range(cfg.num_layers):
            pre = f"model.layers.{i}."

            def fused(name: str, shape: tuple[int, int], pre=pre) -> object:
                parts = [f"{pre}{p}" for p in _FUSED.get(name, (name,))]
                return linear([p + ".weight" for p in parts], shape, weight_format,
                              [p + ".bias" for p in parts])  # fmt: skip

            norms = tuple(
                tensor(f"{pre}{n}.weight").to(device=device, dtype=dtype)
                for n in ("input_layernorm", "pre_feedforward_layernorm" if cfg.sandwich_norms
                          else "post_attention_layernorm")
            )  # fmt: skip
            out_norms = tuple(
                tensor(f"{pre}{n}.weight").to(device=device, dtype=dtype)
                for n in ("post_attention_layernorm", "post_feedforward_layernorm")
            ) if cfg.sandwich_norms else None  # fmt: skip
            qk_norms = tuple(
                tensor(f"{pre}self_attn.{n}.weight").to(device=device, dtype=dtype)
                for n in ("q_norm", "k_norm")
            ) if cfg.qk_norm else None  # fmt: skip
            self.layers.append(DecoderLayer(
                cfg, norms,
                fused("self_attn.qkv_proj", ((h + 2 * kvh) * d, hid)),
                fused("self_attn.o_proj", (hid, h * d)),
                fused("mlp.gate_up_proj", (2 * inter, hid)),
                fused("mlp.down_proj", (hid, inter)),
                self.native,
                qk_norms,
                out_norms,
                cfg.window_of(i),
            ))  # fmt: skip
            self.layers[-1].isa = isa or "avx2"
        # The embedding table: on the exact path, where the file stores it in groups (GGUF
        # Q4/Q8), those groups as stored, rows dequantized at lookup (the same float32 numbers
        # as the whole table dequantized at load, at a quarter of its memory or less: 460 MB
        # saved on Gemma 3 270M's 262k x 640 table); else the float table.
        # A tied head holding those very groups (8-bit, packed in pairs) serves the rows itself:
        # no second copy (180 MB on Gemma 3 270M).
        embed_groups = stored_groups(["model.embed_tokens.weight"]) if self.exact else None
        self.embed_weight = (
            GroupEmbedding(embed_groups, device, dtype) if embed_groups is not None
            else tensor("model.embed_tokens.weight").to(device=device, dtype=dtype)
        )  # fmt: skip
        self.norm = tensor("model.norm.weight").to(device=device, dtype=dtype)
        if self.exact:
            # The head on the exact path: its groups (the file's, else 8-bit groups made here)
            # times integer activations through the integer kernel: exact sums and one fixed
            # epilogue per logit, so a row's logits do not depend on the other rows (a dense
            # GEMM's would), at 3.5x the float32 group kernel's speed for one row and 1.8x for
            # eight (Zen 4, the default model's 49k x 576 head). Its activations are mixed
            # where the file's own groups are the head (auto, as the layers' rule; mixed and
            # int8 too): one vpdpbusd pass for most groups, where Gemma 3's 262k x 640 head on
            # the 8 rows of a decode step took 14.3-14.8 ms with 16 bits and 12.1-12.4 mixed
            # (Zen 4), for KL +1.2e-4 on Gemma 3 and +1.9e-4 on SmolLM2 against the float
            # reference (docs/design.md section 2, "The head's activations"). Groups made here
            # keep 16 bits.
            groups = stored_groups([head_name])
            mixed = activations in ("mixed", "int8") or (activations == "auto" and groups is not None)
            if groups is None:
                w = tensor(head_name)
                if tuple(w.shape) != (cfg.vocab_size, hid):
                    raise ValueError(f"{head_name}: shape {tuple(w.shape)} != {(cfg.vocab_size, hid)}")
                groups = quantize_int8(w)
                self.requantized = True
            self.lm_head = IntLinear(groups, None, 16, isa, mixed)
        else:
            head_fmt = {"dense": "dense", "file": "file"}.get(weight_format, "int8")
            self.lm_head = linear([head_name], (cfg.vocab_size, hid), head_fmt)
        if tied and self.lm_head.kind == "dense":
            self.lm_head.weight = self.embed_weight  # one tensor for both (packing copies it)
        if tied and isinstance(embed_groups, Int8Groups) and self.lm_head.rows_readable:
            # (tied on the exact path: the head was made from these very groups)
            self.embed_weight = GroupEmbedding(None, device, dtype, head=self.lm_head)
        # What the decoder's sums are: "float32", or the exact kinds present, e.g. "w4a16" or
        # "w4a16+w8a16" (a GGUF mixing Q4 and Q8 layers).
        self.arithmetic = "float32" if bits is None else "+".join(
            sorted({lin.kind for layer in self.layers for lin in _linears(layer)}))  # fmt: skip
        self.rotary = Rotary(cfg, max_len, tensors.get("rope_freqs"), device)
        # Sliding-window layers (Gemma 3) rotate with their own base.
        self.windowed = any(layer.window for layer in self.layers)
        self.local_rotary = Rotary(cfg, max_len, None, device, local=True) if self.windowed else None
        # Gemma: the embeddings times sqrt(hidden), rounded to the compute dtype first (as in
        # transformers), so the float reference matches.
        self.embed_scale = (torch.tensor(cfg.embed_scale, dtype=torch.float32).to(dtype)
                            if cfg.embed_scale != 1.0 else None)  # fmt: skip
        self.dtype = dtype
        self.fused_layers = self._fused_layers()
        self.exact_layers = self._exact_layers()

    def _activation_bits(self, activations: str, weight_format: str, weights: LoadedWeights):
        """16 or 8 for the exact integer path, None for float32 activations; an error when
        int16/int8 are asked for where they cannot run."""
        if activations == "float32":
            return None
        why = None
        if not self.native:
            why = "the native CPU kernels in float32 (CPU, dtype float32, AVX2, kernels built)"
        elif weight_format not in ("file", "int4", "int8"):
            why = "weight groups (--quantization auto, int4 or int8; 'none' is the float32 reference)"
        if why is not None:
            if activations == "auto":
                return None
            raise ValueError(f"activations {activations!r} needs {why}")
        return 8 if activations == "int8" else 16  # mixed: 16 with 8-bit groups

    def _exact_layers(self):
        """The per-layer arguments of ``kernels.exact_decode`` (an exact decode-only step in one
        native call), or None off the exact path."""
        if not self.exact or self.config.hidden_act not in ("silu", "gelu_tanh"):
            return None
        lins = [lin for layer in self.layers for lin in _linears(layer)]
        if not all(isinstance(lin, IntLinear) for lin in lins):
            return None
        biases = [layer.qkv_proj.bias for layer in self.layers]
        if any(lin.bias is not None for layer in self.layers for lin in _linears(layer)[1:]):
            return None  # only qkv biases (Qwen2) are fused
        if any(b is None for b in biases) and not all(b is None for b in biases):
            return None
        empty = torch.empty(0)
        return (
            [layer.input_norm for layer in self.layers],
            [layer.post_norm for layer in self.layers],
            [lin.wq for lin in lins],
            [lin.wd for lin in lins],
            [empty if lin.wm is None else lin.wm for lin in lins],
            [int(lin.wide) | 2 * int(lin.mixed) | 4 * int(lin.bits == 16) | 8 * int(lin.sixteens) for lin in lins],
            [] if biases[0] is None else biases,
            [w for layer in self.layers for w in (layer.qk_norms or ())],
            [w for layer in self.layers for w in (layer.out_norms or ())],  # Gemma 3's sandwich
            [layer.window for layer in self.layers],
            int(self.config.hidden_act == "gelu_tanh"),
        )  # fmt: skip

    def _fused_layers(self):
        """The per-layer arguments of ``kernels.decode_forward`` (every layer of a decode-only
        step in one native call), or None when some layer cannot run there (dense weights,
        bf16, no kernels)."""
        if not self.native or self.config.qk_norm or not _plain(self.config):  # the native step has no q/k norms
            return None
        lins = [_linears(layer) for layer in self.layers]
        if not all(isinstance(lin, GroupLinear) and lin.large_m > 0 for row in lins for lin in row):
            return None
        biases = [row[0].bias for row in lins]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            return None
        return (
            [layer.input_norm for layer in self.layers],
            [layer.post_norm for layer in self.layers],
            *([row[j].records for row in lins] for j in range(4)),
            [0 if lin.kind == "q4" else 1 for row in lins for lin in row],
            [] if biases[0] is None else biases,
        )  # fmt: skip

    def describe(self) -> str:
        """What the linear layers run as, e.g. 'q4 layers (57.0 MB) + q8 head (29.9 MB), float32
        activations'."""
        kinds = "+".join(sorted({lin.kind for layer in self.layers for lin in _linears(layer)}))
        nbytes = sum(lin.nbytes for layer in self.layers for lin in _linears(layer))
        head = f"{self.lm_head.kind} head ({self.lm_head.nbytes / 1e6:.1f} MB)"
        if self.exact:
            return f"{kinds} layers ({nbytes / 1e6:.1f} MB, exact integer sums, {self.isa}) + {head}"
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{kinds} layers ({nbytes / 1e6:.1f} MB) + {head}, {dtype} activations"

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv: KVCache,  # the paged pool: K, V [L, KVH, slots, D] in its KV format
        meta: AttentionMetadata,
        logits_index: torch.Tensor,  # [N] rows of the batch that need logits
        probe: ProbeRows | None = None,
    ) -> torch.Tensor:  # [N, vocab] float32
        x = self._embed(input_ids)  # [T, hidden]
        cos, sin = self.rotary.tables(positions, x.dtype, self.native)
        d = meta.decode
        if probe is not None:
            x = self._probed_layers(x, cos, sin, kv, meta, probe)
        elif (self.fused_layers is not None and not meta.seqs and d is not None
                and d.native is not None and x.shape[0] <= LARGE_M):  # fmt: skip
            # a decode-only step: every layer in one native call, the same numbers
            cfg = self.config
            x = kernels.decode_forward(
                x, cos, sin, self.fused_layers, kv, meta.slot_mapping, d.native,
                cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, cfg.head_dim**-0.5,
            )  # fmt: skip
        elif (self.exact_layers is not None and meta.paged is not None
              and x.shape[0] == meta.paged.q_len.numel()
              and (not kv.windowed or meta.window is not None)):  # fmt: skip
            # an exact decode-only step (one new token per sequence): every layer in one native
            # call, the same bits as the loop below
            cfg = self.config
            local = self.local_rotary.tables(positions, x.dtype, self.native) if self.windowed else None
            x = kernels.exact_decode(
                x, cos, sin, self.exact_layers, kv, meta, self.isa, cfg.num_heads, cfg.num_kv_heads,
                cfg.intermediate_size, cfg.rms_norm_eps, cfg.score_scale, local,
            )  # fmt: skip
        else:
            if kv.windowed and meta.window is None:
                raise ValueError("a pool with window parts needs the step's window tables (build_metadata)")
            local = self.local_rotary.tables(positions, x.dtype, self.native) if self.windowed else None
            for i, layer in enumerate(self.layers):
                c, s = local if layer.window else (cos, sin)
                m = meta.window if kv.is_window_layer(i) else meta  # (window parts' slots)
                x = layer(x, c, s, kv.layer(i, self.native), m)
        # Logits only where a token is sampled: the last position of each finished prefill and
        # every decode. Projecting all T rows onto a 49k vocabulary would dominate prefill.
        h = rms_norm(x.index_select(0, logits_index), self.norm, self.config.rms_norm_eps, self.native)
        return self.lm_head(h).float()


    def _probed_layers(self, x, cos, sin, kv: KVCache, meta, probe: ProbeRows):
        """The layer loop of a forward whose last rows are probes (``ProbeRows``); returns the
        other rows' output."""
        if len(self.layers) < 2:
            raise ValueError("a one-layer model has no layer 1 to probe")
        if kv.windowed or self.windowed:
            raise ValueError("probes run on models without sliding-window layers")
        keep = probe.keep
        x = self.layers[0](x, cos, sin, kv.layer(0, self.native), meta)
        layer, kv1 = self.layers[1], kv.layer(1, self.native)
        q, k, v = layer.qkv(x, cos, sin)
        _, held = kv1.gather(probe.slots, torch.float32)  # [KVH, n, D], before the store
        _, stored = kv1.store(probe.slots, k[keep:], v[keep:])  # [n, KVH, D] as attention reads it
        probe.deviation = (stored.float() - held.transpose(0, 1)).square().sum((1, 2)).cpu()
        if keep == 0:
            return x[:0]
        cos, sin = cos[:keep], sin[:keep]
        x = layer(x[:keep], cos, sin, kv1, probe.rest, (q[:keep], k[:keep], v[:keep]))
        for i in range(2, len(self.layers)):
            x = self.layers[i](x, cos, sin, kv.layer(i, self.native), probe.rest)
        return x

    def rotary_of(self, layer: int) -> Rotary:
        """The rotary tables a layer's K is rotated with."""
        return self.local_rotary if self.layers[layer].window else self.rotary

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.embed_weight
        x = e.lookup(input_ids) if isinstance(e, GroupEmbedding) else F.embedding(input_ids, e)
        return x if self.embed_scale is None else x.mul_(self.embed_scale)


_KIND = {Int4Groups: "q4", Int8Groups: "q8", Int8Groups16: "q6"}

# Architectures whose activations need 16 bits everywhere under "auto": Gemma 3 270M Q4_K_M,
# KL vs float32 over 8 ShareGPT texts: mixed 1.9e-3 (over the 1e-3 floor), int16 4.6e-4
# (docs/benchmarks-journal.md "Gemma 3 270M Q4_K_M"); its embeddings are scaled by sqrt(hidden) and
# GeGLU leaves wider rows than SwiGLU.
_AUTO_INT16 = frozenset({"Gemma3ForCausalLM"})


class GroupEmbedding:
    """An embedding table kept as the file's 4- or 8-bit groups; ``lookup`` dequantizes the
    rows asked for with the groups' own formula, so a row is bit-for-bit the row of the table
    dequantized whole (float32 elementwise: q * scale (+ offset))."""

    def __init__(self, groups: Int4Groups | Int8Groups | None, device: torch.device, dtype: torch.dtype,
                 head: IntLinear | None = None):  # fmt: skip
        """``head``: a tied head holding these groups packed; its rows are read in place
        (``IntLinear.rows``) and no copy is kept here."""
        keep = head is None
        self.q = groups.q.to(device) if keep else None
        self.scale = groups.scale.to(device) if keep else None
        self.offset = groups.offset.to(device) if keep and groups.offset is not None else None
        self.group = getattr(groups, "group_size", 32)
        self.dtype, self.head = dtype, head

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.head is not None:
            return self.head.rows(ids).to(self.dtype)
        n, k = ids.shape[0], self.q.shape[1]
        q = self.q.index_select(0, ids).view(n, k // self.group, self.group).float()
        x = q * self.scale.index_select(0, ids).unsqueeze(-1)
        if self.offset is not None:
            x = x + self.offset.index_select(0, ids).unsqueeze(-1)
        return x.view(n, k).to(self.dtype)


def _plain(config: ModelConfig) -> bool:
    """Whether the float32 one-call decode step (decode_forward.cpp) runs this architecture:
    SwiGLU, two norms a layer, no sliding window, the default score scale (not Gemma 3, which
    runs layer by layer there; the exact one-call step, exact_decode.cpp, runs it)."""
    return (config.hidden_act == "silu" and not config.sandwich_norms and not config.local_layers
            and config.attn_scale is None and config.embed_scale == 1.0)  # fmt: skip


def _linears(layer: DecoderLayer):
    return (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
