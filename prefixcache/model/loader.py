"""Load Llama-family weights and configuration from a GGUF file or a Hugging Face directory.

Both paths end in the same place: a ``ModelConfig`` and a dict of float tensors under Hugging
Face names (``model.layers.N.self_attn.q_proj.weight`` ...), so ``llama.py`` knows one layout.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from prefixcache.model.config import ModelConfig
from prefixcache.model.paths import ModelNotFoundError, open_gguf, resolve_model_path

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM")  # fmt: skip
_GGUF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}  # fmt: skip
# Architectures whose q and k heads are RMS-normed (one weight of head_dim each) before rotary.
_QK_NORM = ("Qwen3ForCausalLM", "Gemma3ForCausalLM")
# Gemma 3 (text): every sixth layer attends globally, the others over a sliding window with their
# own rotary base; these are its defaults where a file leaves them out (transformers' and
# llama.cpp's: a pattern of 6, local base 10,000).
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10_000.0


class UnsupportedModelError(ValueError):
    """The model's architecture or format is not one this engine runs; the message names it."""


@dataclass(frozen=True)
class Int4Groups:
    """A weight the file stores in 4-bit groups along its input dimension, kept as stored so the
    int4 kernels run the file's own numbers: ``w[o, i] = q[o, i] * scale[o, g] + offset[o, g]``
    with ``g = i // group_size`` (GGUF Q4_1: scale d, offset m; Q4_0: scale d, offset -8 d)."""

    q: torch.Tensor  # [out, in] uint8, values 0..15
    scale: torch.Tensor  # [out, in / group_size] float32 (exact copies of the file's float16)
    offset: torch.Tensor  # [out, in / group_size] float32
    group_size: int

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        out, n = self.q.shape
        g = self.q.view(out, n // self.group_size, self.group_size).float()
        return (g * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)).view(out, n)

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Concatenated along the output dimension (fused q/k/v, gate/up)."""
        return Int4Groups(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
            torch.cat([p.offset for p in parts]), parts[0].group_size,
        )  # fmt: skip


def _dequantize_groups(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, size: int) -> torch.Tensor:
    """``q * scale (+ offset)`` per group of ``size`` along the input: [out, in] float32, each
    weight one multiply (and one add) in float32, as gguf computes them."""
    out, n = q.shape
    w = q.view(out, n // size, size).float() * scale.unsqueeze(-1)
    return (w if offset is None else w + offset.unsqueeze(-1)).view(out, n)


def _cat_offsets(parts) -> torch.Tensor | None:
    """The parts' offsets concatenated (zeros for a part without), or None when none has one."""
    if all(p.offset is None for p in parts):
        return None
    return torch.cat([p.offset if p.offset is not None else torch.zeros_like(p.scale) for p in parts])


@dataclass(frozen=True)
class Int8Groups:
    """A weight the file stores as int8 groups of 32 with one scale each (GGUF Q8_0, Q5_0;
    IQ4_NL and IQ4_XS: q the grid values), kept
    as stored: ``w[o, i] = q[o, i] * scale[o, i // 32]`` (exact in float32); with ``offset``
    (GGUF Q5_1, Q5_K: 5-bit q in 0..31 and a minimum per group) ``+ offset[o, i // 32]``."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out, in / 32] float32 (exact copies of the file's float16)
    offset: torch.Tensor | None = None  # [out, in / 32] float32

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        return _dequantize_groups(self.q, self.scale, self.offset, 32)

    @staticmethod
    def cat(parts: list[Int8Groups]) -> Int8Groups:
        return Int8Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), _cat_offsets(parts))


@dataclass(frozen=True)
class Int8Groups16:
    """A weight the file stores as small integers in groups of 16 with one scale each, kept as
    stored: ``w[o, i] = q[o, i] * scale[o, i // 16]`` (``+ offset[o, i // 16]`` with a minimum;
    ``bits`` the file's width of q).
    GGUF Q6_K: q in [-32, 31], scale = d sc (a super-block of 256 weights holds 16 int8 scales sc
    and a float16 d). GGUF Q3_K: q in [-4, 3], scale = d (sc - 32) (16 6-bit scales). GGUF Q2_K:
    q in [0, 3], scale = d sc and offset = -(dmin m) (4-bit sc and m per 16). Each scale is an
    11-bit by at most 8-bit product, exact in float32, and so is its product with q: the file's
    numbers as gguf's own dequantization computes them.

    The integer kernels run them as 8-bit weight pairs whose groups of 32 have two scales, one
    per 16 (``model/int_linear.py``, kernels/int_gemm.h ``S16``)."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out, in / 16] float32
    bits: int = 6
    group_size: int = 16
    offset: torch.Tensor | None = None  # [out, in / 16] float32

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        return _dequantize_groups(self.q, self.scale, self.offset, 16)

    @staticmethod
    def cat(parts: list[Int8Groups16]) -> Int8Groups16:
        return Int8Groups16(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                            max(p.bits for p in parts), 16, _cat_offsets(parts))  # fmt: skip


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # float32, Hugging Face names
    source: Path
    # sha256 over the weight bytes as stored (no dequantization needed to key them).
    weights_digest: str
    # Linear weights stored as 4-bit groups in the file (GGUF Q4_0/Q4_1), under the same names
    # as their float32 copies in ``tensors`` (which equal ``Int4Groups.dequantize()``).
    int4: dict[str, Int4Groups] = field(default_factory=dict)
    # The same for weights stored as 8-bit groups (GGUF Q8_0; the default model's embedding,
    # which is also its output projection).
    int8: dict[str, Int8Groups] = field(default_factory=dict)
    # And as small integers in groups of 16 (GGUF Q6_K, Q3_K, Q2_K).
    groups16: dict[str, Int8Groups16] = field(default_factory=dict)


# ---- Hugging Face directory -----------------------------------------------------------------
def _config_from_hf(cfg: dict, name: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else cfg.get("model_type", "<none>")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    window = cfg.get("sliding_window")
    # A sliding window shorter than the context changes attention; we refuse rather than be wrong.
    # (Qwen2/Qwen3 configs carry a sliding_window that applies only with use_sliding_window.)
    windowed = (arch == "MistralForCausalLM"
                or (arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window", False)))
    if (windowed and window
            and window < cfg.get("max_position_embeddings", 0)):  # fmt: skip
        raise UnsupportedModelError(f"{arch} with a sliding window ({window} tokens) is not supported")
    heads = cfg["num_attention_heads"]
    # transformers >= 5 writes rope_theta and the scaling into one "rope_parameters" dict.
    rope = cfg.get("rope_parameters") or {}
    if arch == "Gemma3ForCausalLM":
        return _gemma3_config_from_hf(cfg, name)
    return ModelConfig(
        architecture=arch if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") else "LlamaForCausalLM",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch in _QK_NORM,
        rope_scaling=cfg.get("rope_scaling") or rope or None,
        name=name,
    )


def _gemma3_layers(num_layers: int, layer_types=None, pattern: int = _GEMMA3_PATTERN) -> tuple[bool, ...]:
    """Which layers slide: the config's layer_types, else every layer but each pattern-th."""
    if layer_types:
        if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
            raise UnsupportedModelError(f"Gemma 3 layer_types not understood: {layer_types!r}")
        return tuple(t == "sliding_attention" for t in layer_types)
    return tuple(bool((i + 1) % pattern) for i in range(num_layers))


def _gemma3_config_from_hf(cfg: dict, name: str) -> ModelConfig:
    if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
        raise UnsupportedModelError("Gemma 3 with logit soft-capping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with bidirectional attention is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"Gemma 3 with activation {act!r} is not supported")
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention") or {}
    local = rope.get("sliding_attention") or {}
    for kind in (full, local, cfg.get("rope_scaling") or {}):
        if (kind.get("rope_type") or kind.get("type") or "default") != "default":
            raise UnsupportedModelError(f"Gemma 3 with rope scaling {kind!r} is not supported")
    return ModelConfig(
        architecture="Gemma3ForCausalLM",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or 256,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)),
        max_position_embeddings=cfg.get("max_position_embeddings", 131_072),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        qk_norm=True,
        name=name,
        hidden_act="gelu_tanh",
        sandwich_norms=True,
        embed_scale=cfg["hidden_size"] ** 0.5,
        attn_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5,
        sliding_window=cfg.get("sliding_window", 4096),
        local_layers=_gemma3_layers(layers, cfg.get("layer_types"), cfg.get("sliding_window_pattern", 6)),
        rope_local_theta=local.get("rope_theta", cfg.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA)),
    )


def _load_hf_dir(path: Path) -> LoadedWeights:
    from safetensors import safe_open

    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelNotFoundError(f"invalid config.json in {path}: {e}") from e
    config = _config_from_hf(cfg, path.name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in model directory {path}")
    tensors: dict[str, torch.Tensor] = {}
    digest = hashlib.sha256()
    for f in files:  # sharded or not: every shard holds disjoint names
        with safe_open(str(f), framework="pt") as sf:
            for k in sorted(sf.keys()):
                t = sf.get_tensor(k)
                digest.update(k.encode())
                digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
                digest.update(str(tuple(t.shape)).encode())
                tensors[k] = t.float()
    if config.architecture == "Gemma3ForCausalLM":  # Gemma's norms multiply by 1 + w
        for k, w in list(tensors.items()):
            if k.endswith("norm.weight"):
                tensors[k] = w + 1.0
    return LoadedWeights(config, tensors, path, digest.hexdigest())


# ---- GGUF -----------------------------------------------------------------------------------
def _reverse_rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the two rotary halves of each q/k head; undo it so the
    weights use Hugging Face's rotate-half convention."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _int4_groups(data: np.ndarray, kind, shape: tuple[int, int]) -> Int4Groups | None:
    """The 4-bit groups of a GGUF Q4_0/Q4_1/Q4_K tensor, or None for any other type.

    Q4_0/Q4_1: a block holds 32 weights: float16 d (and m for Q4_1), then 16 bytes whose low
    nibbles are weights 0..15 and high nibbles weights 16..31.

    Q4_K: a super-block of 256 weights is 8 groups of 32: float16 d and dmin, 12 bytes packing
    each group's 6-bit scale sc and 6-bit minimum m, then 128 bytes whose 32-byte chunk j holds
    group 2j in its low nibbles and group 2j + 1 in its high ones; w = (d sc) q - (dmin m). The
    products d sc and dmin m (11-bit by 6-bit significands) are exact in float32, so a group's
    scale and offset are the file's numbers exactly (as gguf's own dequantization computes them).
    """
    import gguf

    T = gguf.GGMLQuantizationType
    out, n = shape
    if kind == T.Q4_K:
        blocks = np.ascontiguousarray(data).reshape(-1, 144)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [sb, 1]
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = _k_scales(blocks[:, 4:16])
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(-1, 256)
        scale = d * sc.astype(np.float32)
        offset = -(dmin * mn.astype(np.float32))
        return Int4Groups(
            torch.from_numpy(np.ascontiguousarray(q).reshape(out, n)),
            torch.from_numpy(scale.reshape(out, n // 32)),
            torch.from_numpy(offset.reshape(out, n // 32)),
            32,
        )
    if kind not in (T.Q4_0, T.Q4_1):
        return None
    head = 2 if kind == T.Q4_0 else 4
    blocks = np.ascontiguousarray(data).reshape(-1, head + 16)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32) if head == 4 else -8 * d
    qs = blocks[:, head:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # [blocks, 32]
    return Int4Groups(
        torch.from_numpy(q.reshape(out, n)),
        torch.from_numpy(d.reshape(out, n // 32)),
        torch.from_numpy(m.reshape(out, n // 32)),
        32,
    )


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 groups' 6-bit scales and minimums of a Q4_K/Q5_K super-block's 12 bytes: [sb, 8]."""
    packed = packed.reshape(-1, 3, 4)
    a, b, c = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=1)
    return sc, mn


# The non-linear grid of GGUF IQ4_NL and IQ4_XS: a 4-bit index selects one of these int8 values
# (llama.cpp's kvalues_iq4nl).
_IQ4_GRID = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _int8_groups(data: np.ndarray, kind, shape: tuple[int, int]) -> Int8Groups | None:
    """The 8-bit groups of a GGUF Q8_0 tensor (a float16 d, then 32 int8) or Q5_0 tensor (a
    float16 d, 4 bytes of the weights' fifth bits, 16 bytes of their low nibbles as in Q4_0;
    w = d (q - 16), so q - 16 in [-16, 15] is an int8 group with the file's scale), or None for
    another type. Q5_0 kept this way runs the 8-bit kernels at 8 bits a weight (the file's 5.5).

    IQ4_NL (a float16 d, then 16 bytes of 4-bit indices, low nibbles first as in Q4_0; w = d
    grid[i]) and IQ4_XS (a super-block of 8 groups of 32: float16 d, 2 bytes of the groups'
    scales' high bit pairs, 4 bytes of their low nibbles, then each group's 16 bytes of indices;
    w = d (ls - 32) grid[i], ls the 6-bit scale): the grid values are int8 (|v| <= 127), so a
    group is an int8 group of grid values with the scale d or d (ls - 32), an 11-bit by 6-bit
    product exact in float32: the file's numbers, 8 bits a weight against its 4.5-4.25.

    With a minimum per group (``offset``): Q5_1 (d, m, the fifth bits, the low nibbles; w = d q
    + m, q in 0..31) and Q5_K (a super-block of 8 groups of 32 as Q4_K: d, dmin, the 12 bytes of
    6-bit scales and minimums, then 32 bytes whose bit g of byte l is weight l's fifth bit in
    group g, then Q4_K's nibbles; w = (d sc) q - (dmin m)). The products d sc and dmin m are
    exact in float32, so a group's scale and offset are the file's numbers, as gguf computes."""
    import gguf

    T = gguf.GGMLQuantizationType
    out, n = shape
    if kind == T.Q5_1:
        blocks = np.ascontiguousarray(data).reshape(-1, 24)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        high = np.unpackbits(blocks[:, 4:8], axis=1, bitorder="little")  # [blocks, 32]
        low = np.concatenate([blocks[:, 8:] & 0x0F, blocks[:, 8:] >> 4], axis=1)
        q = (low | (high << 4)).astype(np.int8)
        return Int8Groups(torch.from_numpy(q.reshape(out, n)), torch.from_numpy(d.reshape(out, n // 32)),
                          torch.from_numpy(m.reshape(out, n // 32)))  # fmt: skip
    if kind == T.Q5_K:
        blocks = np.ascontiguousarray(data).reshape(-1, 176)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [sb, 1]
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = _k_scales(blocks[:, 4:16])
        high = (blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        low = blocks[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = ((low & 0x0F).reshape(-1, 8, 32) | (high << 4)).astype(np.int8).reshape(-1, 256)
        scale = d * sc.astype(np.float32)
        offset = -(dmin * mn.astype(np.float32))
        return Int8Groups(torch.from_numpy(np.ascontiguousarray(q).reshape(out, n)),
                          torch.from_numpy(scale.reshape(out, n // 32)),
                          torch.from_numpy(offset.reshape(out, n // 32)))  # fmt: skip
    if kind == T.Q5_0:
        blocks = np.ascontiguousarray(data).reshape(-1, 22)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        high = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")  # [blocks, 32] bit i of weight i
        low = np.concatenate([blocks[:, 6:] & 0x0F, blocks[:, 6:] >> 4], axis=1)
        q = ((low | (high << 4)).astype(np.int16) - 16).astype(np.int8)
        return Int8Groups(torch.from_numpy(q.reshape(out, n)), torch.from_numpy(d.reshape(out, n // 32)))
    if kind == T.IQ4_NL:
        blocks = np.ascontiguousarray(data).reshape(-1, 18)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        q = _IQ4_GRID[np.concatenate([blocks[:, 2:] & 0x0F, blocks[:, 2:] >> 4], axis=1)]
        return Int8Groups(torch.from_numpy(q.reshape(out, n)), torch.from_numpy(d.reshape(out, n // 32)))
    if kind == T.IQ4_XS:
        blocks = np.ascontiguousarray(data).reshape(-1, 136)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [sb, 1]
        high = (blocks[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [sb, 8]
        low = (blocks[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(-1, 8) & 0x0F
        scale = d * ((low | (high << 4)).astype(np.float32) - 32.0)
        idx = blocks[:, 8:].reshape(-1, 8, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = _IQ4_GRID[(idx & 0x0F).reshape(-1, 256)]
        return Int8Groups(torch.from_numpy(q.reshape(out, n)), torch.from_numpy(scale.reshape(out, n // 32)))
    if kind != T.Q8_0:
        return None
    blocks = np.ascontiguousarray(data).reshape(-1, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8)
    return Int8Groups(torch.from_numpy(q.reshape(out, n)), torch.from_numpy(d.reshape(out, n // 32)))


def _groups16(data: np.ndarray, kind, shape: tuple[int, int]) -> Int8Groups16 | None:
    """The groups of 16 of a GGUF Q6_K, Q3_K or Q2_K tensor, or None for another type.

    Q6_K: a super-block of 256 weights is 210 bytes: 128 bytes of low nibbles, 64 of high bit
    pairs, 16 int8 scales, float16 d. In each half of 128 weights, low-nibble bytes l and 32 + l
    give weights l, 32 + l (low nibbles) and 64 + l, 96 + l (high nibbles); high byte l gives
    their fifth and sixth bits at shifts 0, 2, 4, 6. w = d sc[i // 16] (q - 32).

    Q3_K: 110 bytes: 32 bytes of high bits (weight 32 b + l: bit b of byte l), 64 bytes of
    2-bit values (in each half of 128, byte l at shifts 0, 2, 4, 6 gives weights l, 32 + l,
    64 + l, 96 + l), 12 bytes packing 16 6-bit scales (low nibbles in bytes 0-7, low then high;
    their top two bits in bytes 8-11 at shifts 0, 2, 4, 6), float16 d. q = low - 4 where the
    high bit is 0 (else low), w = d (sc - 32) q.

    Q2_K: 84 bytes: 16 bytes of 4-bit scales (low nibble) and minimums (high nibble), 64 bytes
    of 2-bit values (as Q3_K's), float16 d and dmin. w = (d sc) q - (dmin m)."""
    import gguf

    T = gguf.GGMLQuantizationType
    out, n = shape
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)

    def two_bits(b: np.ndarray) -> np.ndarray:  # [sb, 64] bytes -> [sb, 256]: byte l of each half of 128
        return ((b.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)  # at shifts 0-6: l, 32 + l, ...

    offset = None
    if kind == T.Q6_K:
        blocks = np.ascontiguousarray(data).reshape(-1, 210)
        ql = blocks[:, :128].reshape(-1, 2, 2, 32)  # [sb, half, byte run, l]
        qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # [sb, half, 1, l]
        low = np.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
        high = (qh >> shifts) & 3  # [sb, half, 4, 32]
        q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(-1, 256)
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # [sb, 16]
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)  # [sb, 1]
        bits = 6
    elif kind == T.Q3_K:
        blocks = np.ascontiguousarray(data).reshape(-1, 110)
        low = two_bits(blocks[:, 32:96])
        high = ((blocks[:, :32].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(-1, 256)
        q = (low.astype(np.int8) - 4 * (1 - high.astype(np.int8))).astype(np.int8)
        packed = blocks[:, 96:108]
        lo4 = (packed[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(-1, 16) & 0x0F
        hi2 = (packed[:, 8:12].reshape(-1, 1, 4) >> shifts.reshape(1, 4, 1)).reshape(-1, 16) & 3
        sc = ((lo4 | (hi2 << 4)).astype(np.int16) - 32).astype(np.float32)  # [sb, 16]
        d = blocks[:, 108:110].copy().view(np.float16).astype(np.float32)
        bits = 3
    elif kind == T.Q2_K:
        blocks = np.ascontiguousarray(data).reshape(-1, 84)
        q = two_bits(blocks[:, 16:80]).astype(np.int8)
        sc = (blocks[:, :16] & 0x0F).astype(np.float32)
        mn = (blocks[:, :16] >> 4).astype(np.float32)
        d = blocks[:, 80:82].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 82:84].copy().view(np.float16).astype(np.float32)
        offset = torch.from_numpy((-(dmin * mn)).reshape(out, n // 16))
        bits = 2
    else:
        return None
    return Int8Groups16(torch.from_numpy(np.ascontiguousarray(q).reshape(out, n)),
                        torch.from_numpy((d * sc).reshape(out, n // 16)), bits, 16, offset)  # fmt: skip


def _gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def _load_gguf(path: Path, reader=None) -> LoadedWeights:
    import gguf

    reader = reader if reader is not None else open_gguf(path)
    arch = _gguf_field(reader, "general.architecture", "<none>")
    if arch not in _GGUF_ARCH:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(_GGUF_ARCH)}"
        )

    def g(key, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    heads = int(g("attention.head_count"))
    kv_heads = int(g("attention.head_count_kv", heads))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(g("vocab_size", len(tokens_field.data) if tokens_field else 0))
    rope_scaling = None
    if g("rope.scaling.type") not in (None, "none"):
        rope_scaling = {
            "type": g("rope.scaling.type"),
            "factor": g("rope.scaling.factor", 1.0),
            "original_max_position_embeddings": g("rope.scaling.original_context_length"),
        }
    gemma = {}
    if arch == "gemma3":
        layers = int(g("block_count"))
        gemma = {
            "hidden_act": "gelu_tanh", "sandwich_norms": True, "embed_scale": hidden**0.5,
            # llama.cpp: 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B
            "attn_scale": int(g("attention.key_length", 256)) ** -0.5,
            "sliding_window": int(g("attention.sliding_window", 4096)),
            "local_layers": _gemma3_layers(layers),
            "rope_local_theta": _GEMMA3_LOCAL_THETA,
        }  # fmt: skip
        if heads == 32 and hidden == 5376:  # the 27B's query_pre_attn_scalar is hidden / heads
            gemma["attn_scale"] = (hidden / heads) ** -0.5
    config = ModelConfig(
        **gemma,
        architecture=_GGUF_ARCH[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(g("attention.key_length", hidden // heads)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
        qk_norm=_GGUF_ARCH[arch] in _QK_NORM,
        rope_scaling=rope_scaling,
        name=path.stem,
    )
    rename = {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    if arch == "gemma3":  # llama.cpp's ffn_norm is Gemma's pre-MLP norm; its norms hold 1 + w
        rename |= {"ffn_norm": "pre_feedforward_layernorm",
                   "post_attention_norm": "post_attention_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    int4: dict[str, Int4Groups] = {}
    int8: dict[str, Int8Groups] = {}
    groups16: dict[str, Int8Groups16] = {}
    digest = hashlib.sha256()
    T = gguf.GGMLQuantizationType
    widened: dict[str, int] = {}  # quantized types this engine widens to float32, tensors each
    for t in reader.tensors:
        digest.update(t.name.encode())
        digest.update(np.ascontiguousarray(t.data).tobytes())
        if t.name == "rope_freqs.weight":  # llama3-style frequency factors
            tensors["rope_freqs"] = torch.from_numpy(np.array(t.data, dtype=np.float32))
            continue
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, base, kind = parts[1], parts[2], parts[3]
            hf = f"model.layers.{layer}.{rename[base]}.{kind}"
        else:
            hf = f"{rename[parts[0]]}.{parts[1]}"
        shape = (int(t.shape[1]), int(t.shape[0])) if len(t.shape) == 2 else None
        heads_of = {"attn_q": heads, "attn_k": kv_heads}
        permute = arch in ("llama", "mistral") and parts[0] == "blk" and parts[2] in heads_of
        groups = _int4_groups(t.data, t.tensor_type, shape) if shape else None
        if groups is not None:
            # Rows (output features) are independent, so the rope permutation applies to the
            # groups as to the float weights.
            if permute:
                n = heads_of[parts[2]]
                groups = Int4Groups(
                    *(torch.from_numpy(_reverse_rope_permute(x.numpy(), n).copy())
                      for x in (groups.q, groups.scale, groups.offset)),
                    groups.group_size,
                )  # fmt: skip
            int4[hf] = groups
            tensors[hf] = groups.dequantize()
            continue
        groups8 = _int8_groups(t.data, t.tensor_type, shape) if shape else None
        if groups8 is not None:
            if permute:
                n = heads_of[parts[2]]
                groups8 = Int8Groups(
                    *(None if x is None else torch.from_numpy(_reverse_rope_permute(x.numpy(), n).copy())
                      for x in (groups8.q, groups8.scale, groups8.offset))
                )  # fmt: skip
            int8[hf] = groups8
            tensors[hf] = groups8.dequantize()
            continue
        g16 = _groups16(t.data, t.tensor_type, shape) if shape else None
        if g16 is not None:
            if permute:
                n = heads_of[parts[2]]
                q, sc, off = (None if x is None else torch.from_numpy(_reverse_rope_permute(x.numpy(), n).copy())
                              for x in (g16.q, g16.scale, g16.offset))  # fmt: skip
                g16 = Int8Groups16(q, sc, g16.bits, 16, off)
            groups16[hf] = g16
            tensors[hf] = g16.dequantize()
            continue
        if shape is not None and t.tensor_type not in (T.F32, T.F16, T.BF16):
            widened[t.tensor_type.name] = widened.get(t.tensor_type.name, 0) + 1
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except NotImplementedError as e:
            raise UnsupportedModelError(
                f"{path.name}: tensor {t.name} is stored as {t.tensor_type.name}, a GGUF type this "
                f"engine cannot read ({e}); supported from the file's integers: Q4_0, Q4_1, Q4_K, "
                "Q2_K, Q3_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, IQ4_NL, IQ4_XS; widened at load: the other types the gguf package dequantizes"
            ) from None
        if permute:
            arr = _reverse_rope_permute(arr, heads_of[parts[2]])
        tensors[hf] = torch.from_numpy(np.array(arr, copy=not arr.flags.writeable, order="C"))
    if widened:
        log.warning("%s: %s widened to float32 at load (not run from the file's integers; the "
                    "exact path makes 8-bit groups of them)", path.name,
                    ", ".join(f"{n} ({c} tensors)" for n, c in sorted(widened.items())))  # fmt: skip
    return LoadedWeights(config, tensors, path, digest.hexdigest(), int4, int8, groups16)


def load_weights(model: str | Path | None, reader=None) -> LoadedWeights:
    """Weights and config from a GGUF file or a HF directory; ``None`` = the default model.
    ``reader``: the file's ``gguf.GGUFReader`` when the caller has one (paths.open_gguf)."""
    path = resolve_model_path(model)
    return _load_hf_dir(path) if path.is_dir() else _load_gguf(path, reader)
