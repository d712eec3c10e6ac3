"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) over a paged KV cache.

Read top to bottom: norm, rotary embedding, attention block, MLP, layer, model. Shapes are noted
at tensor boundaries; T is the number of new tokens in the flat batch of a step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.model.attention import AttentionMetadata, paged_attention
from prefixcache.model.loader import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; same math as below
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in float32 whatever the weights' dtype, as the reference does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = config.rope_scaling or {}
    kind = rs.get("rope_type") or rs.get("type")
    if rope_freqs is not None:  # GGUF llama3 models store the per-frequency factors
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


class Rotary(nn.Module):
    """cos/sin tables for every position up to max_len, rotate-half convention."""

    def __init__(self, config: ModelConfig, max_len: int, rope_freqs: torch.Tensor | None):
        super().__init__()
        inv = rope_inv_freq(config, rope_freqs)
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [max_len, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; positions: [T]
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, kvh, d = config.num_heads, config.num_kv_heads, config.head_dim
        # q, k and v in one matmul (fused at load from q_proj/k_proj/v_proj): fewer, larger
        # matmuls, which matters most for decode where each one is a thin matrix-vector product.
        self.qkv_proj = nn.Linear(config.hidden_size, (h + 2 * kvh) * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)
        self.h, self.kvh, self.d = h, kvh, d
        self.scale = d**-0.5

    def forward(self, x, positions, rotary, k_cache, v_cache, meta: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) D]
        q, k, v = qkv.split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q = rotary(q.reshape(t, self.h, self.d), positions)  # [T, H, D]
        k = rotary(k.reshape(t, self.kvh, self.d), positions)  # [T, KVH, D]
        v = v.reshape(t, self.kvh, self.d)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # gate and up in one matmul (fused at load from gate_proj/up_proj)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, positions, rotary, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# Checkpoint tensors concatenated (in this order, along the output dim) into one fused matmul.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_len: int, rope_freqs: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config, max_len, rope_freqs)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named float tensors in; tied embeddings share one tensor."""
        tensors = dict(tensors)
        for i in range(self.config.num_layers):
            pre = f"model.layers.{i}."
            for fused, parts in _FUSED.items():
                for kind in ("weight", "bias"):
                    names = [f"{pre}{p}.{kind}" for p in parts]
                    if all(n in tensors for n in names):
                        tensors[f"{pre}{fused}.{kind}"] = torch.cat([tensors.pop(n) for n in names])
        own = dict(self.named_parameters())
        missing = []
        with torch.no_grad():
            for name, p in own.items():
                src_name = name if name.startswith("lm_head") else "model." + name
                src = tensors.get(src_name)
                if src is None and name == "lm_head.weight":
                    src = tensors.get("model.embed_tokens.weight")
                if src is None:
                    missing.append(src_name)
                    continue
                if tuple(src.shape) != tuple(p.shape):
                    raise ValueError(f"{src_name}: shape {tuple(src.shape)} != {tuple(p.shape)}")
                p.copy_(src)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}")
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_k: torch.Tensor,  # [L, KVH, slots, D]
        kv_v: torch.Tensor,
        meta: AttentionMetadata,
        logits_index: torch.Tensor,  # [N] rows of the batch that need logits
    ) -> torch.Tensor:  # [N, vocab] float32
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rotary, kv_k[i], kv_v[i], meta)
        # Logits only where a token is sampled: the last position of each finished prefill and
        # every decode. Projecting all T rows onto a 49k vocabulary would dominate prefill.
        h = self.norm(x.index_select(0, logits_index))
        return self.lm_head(h).float()
