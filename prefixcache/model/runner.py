"""Model runner: turns a scheduled batch into tensors, runs the model, returns logits.

It sees sequences only through what the scheduler hands it (token ids, computed counts, block
tables); it never sees queues or decides what runs.
"""

from __future__ import annotations

import logging

import torch

from prefixcache import kernels
from prefixcache.kv.pool import KVCache, KVLayout
from prefixcache.model.attention import build_metadata
from prefixcache.model.llama import LlamaModel
from prefixcache.model.loader import LoadedWeights
from prefixcache.sequence import ScheduledSeq

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def weight_format(quantization: str, device: torch.device) -> str:
    """The ``LlamaModel`` weight format a ``quantization`` setting runs as (see linear.py).

    auto: on CPU, the file's own 4/8-bit groups where it stores them (GGUF Q4_0/Q4_1/Q8_0); on
    the exact path (``LlamaModel``) other layers are quantized to 8-bit groups at load, with
    float32 activations they run dense.
    """
    if quantization in ("int4", "int8"):
        if device.type != "cpu":
            raise ValueError(
                f"quantization {quantization!r} runs on CPU only; use 'none' on {device}"
            )
        return quantization
    if quantization == "auto" and device.type == "cpu" and kernels.available():
        return "file"
    return "dense"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "float16" and device.type == "cpu":
        raise ValueError("dtype float16 is supported on CUDA only; use float32 or bfloat16 on CPU")
    return DTYPES[name]


class ModelRunner:
    def __init__(
        self,
        weights: LoadedWeights,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        layout: KVLayout,
        weight_format: str = "dense",
        activations: str = "float32",
    ):
        self.config = weights.config
        self.device = device
        self.dtype = dtype
        self.block_size = layout.block_size
        self.model = LlamaModel(weights, max_model_len, dtype, device, weight_format, activations)
        self.kv = KVCache(weights.config, layout, device)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; returns float32 logits [N, vocab] for the sequences that sample, in
        batch order."""
        ids: list[int] = []
        pos: list[int] = []
        logits_rows: list[int] = []
        for s in batch:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            ids.extend(seq.all_token_ids[start : start + n])
            pos.extend(range(start, start + n))
            if s.samples:
                logits_rows.append(len(ids) - 1)
        meta = build_metadata(
            [s.seq.block_table for s in batch],
            [s.seq.num_computed_tokens for s in batch],
            [s.num_new_tokens for s in batch],
            self.block_size,
            self.device,
            native=self.model.native,
            exact=self.model.exact,
        )
        dev = self.device
        return self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            self.kv,
            meta,
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )

    @torch.inference_mode()
    def all_logits(self, ids: list[int]) -> torch.Tensor:
        """Next-token logits at every position of one prompt, [len(ids), vocab] float32, from a
        single prefill on a private KV cache (the engine's pool is not touched): for quality
        measurements (perplexity, KL between weight formats) and parity tests."""
        bs, n = self.block_size, len(ids)
        nblocks = -(-n // bs)
        lay = self.kv.layout
        private = KVCache(self.config, KVLayout(nblocks, bs, lay.bytes_per_token, lay.kv_format), self.device)
        meta = build_metadata([list(range(nblocks))], [0], [n], bs, self.device,
                              native=self.model.native, exact=self.model.exact)  # fmt: skip
        rows = torch.arange(n, device=self.device)
        return self.model(torch.tensor(ids, device=self.device), rows, private, meta, rows)
