"""A model's architecture as the engine runs it: ``ModelConfig``, what the loader reads from a
GGUF file or a Hugging Face ``config.json`` (``loader.py``) and what the model, the KV pool and
the tiers are sized by. A leaf: it imports nothing of ours, so ``kv/`` (below the model) can
take the type without importing the loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3: each q and k head RMS-normed (weights q_norm, k_norm) before rotary
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    name: str = "model"
    # Gemma 3. The MLP's activation ("silu", or "gelu_tanh": GeGLU); sandwich norms (an RMSNorm
    # after attention and after the MLP too, four per layer); a factor on the embeddings
    # (sqrt(hidden)); the attention's score scale (None: head_dim ** -0.5); sliding-window
    # layers: ``sliding_window`` tokens (a query at p sees keys in (p - W, p]) in the layers
    # where ``local_layers`` is True, whose rotary base is ``rope_local_theta``. Every norm
    # weight is stored as its multiplier (Gemma's checkpoints hold w for x * (1 + w): the loader
    # adds the 1, as llama.cpp's GGUF files already have it).
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    attn_scale: float | None = None
    sliding_window: int | None = None
    local_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None

    def __post_init__(self):  # a tuple however given (JSON gives a list): configs compare equal
        object.__setattr__(self, "local_layers", tuple(bool(x) for x in self.local_layers))

    @property
    def score_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def window_of(self, layer: int) -> int:
        """The sliding window of a layer in tokens, 0 for a global one."""
        return self.sliding_window if self.local_layers and self.local_layers[layer] else 0

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem
