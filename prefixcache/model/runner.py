"""Model runner: the sole caller of the model. Turns a step's pieces (``sequence.Piece``: the
scheduled chunks, and a connector's own prefill pieces) into tensors, runs the model once,
returns the logits (and the probes' deviations); reads and writes K/V by block table for the
connectors that move it (segments place documents, partial blocks are copied).

It sees sequences only through what it is handed (token ids, positions, block tables); it never
sees queues or decides what runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixcache import kernels
from prefixcache.kv.pool import KVCache, KVLayout
from prefixcache.model.attention import build_metadata
from prefixcache.model.decode_attention import slots_of
from prefixcache.model.llama import LlamaModel, ProbeRows, rerotate
from prefixcache.model.loader import LoadedWeights
from prefixcache.sequence import Piece

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
        # float32 on CUDA too: measured on an H200 (benchmarks/cuda_contract.py), bf16's sums
        # change with the batch shape by whole bf16 steps and 3-4 of 24 greedy continuations
        # changed when batched or chunked; float32's moved by ~2e-5 and none changed. On the
        # default model float32 was also the faster there (decode 10.1 vs 17.6 ms a token).
        return torch.float32
    if name == "float16" and device.type == "cpu":
        raise ValueError("dtype float16 is supported on CUDA only; use float32 or bfloat16 on CPU")
    return DTYPES[name]


@dataclass(frozen=True)
class StepOutput:
    """What one forward gives back: float32 logits ``[N, vocab]`` for the pieces that sample,
    in batch order, and each probe piece's deviation (``ProbeRows``), by piece."""

    logits: torch.Tensor
    probes: list[tuple[Piece, torch.Tensor]]

    def deviation(self, piece: Piece) -> torch.Tensor:
        return next(d for p, d in self.probes if p is piece)


class ModelRunner:
    def __init__(
        self,
        weights: LoadedWeights,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        weight_format: str = "dense",
        activations: str = "float32",
    ):
        """The model; its KV pool comes with ``allocate_kv`` (its format can depend on the model:
        ``auto`` is int16 on the exact path)."""
        self.config = weights.config
        self.device = device
        self.dtype = dtype
        self.model = LlamaModel(weights, max_model_len, dtype, device, weight_format, activations)

    def allocate_kv(self, layout: KVLayout, window_table: Callable[[list[int]], list[int]] | None = None) -> None:
        """The pool; with window parts, ``window_table`` maps a block table to its parts (the
        cache manager's ``WindowParts.table``: which part holds each block's window layers)."""
        self.block_size = layout.block_size
        self.kv = KVCache(self.config, layout, self.device)
        self.window_table = window_table

    def _meta(self, pieces: list[Piece]):
        tables = [p.block_table for p in pieces]
        return build_metadata(
            tables, [p.start for p in pieces], [p.n for p in pieces], self.block_size,
            self.device, native=self.model.native, exact=self.model.exact,
            windowed=self.model.windowed,
            window_tables=None if self.window_table is None else [self.window_table(t) for t in tables],
        )  # fmt: skip

    @torch.inference_mode()
    def execute(self, pieces: list[Piece]) -> StepOutput:
        """The step's one forward over ``pieces`` (probes last, whatever their order here)."""
        probes = [p for p in pieces if p.probe]
        if probes:
            pieces = [p for p in pieces if not p.probe]
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        for p in pieces + probes:
            ids.extend(p.token_ids[p.start : p.start + p.n])
            pos.extend(range(p.start, p.start + p.n))
            if p.samples:
                rows.append(len(ids) - 1)
        meta = self._meta(pieces + probes)
        probe = None
        if probes:
            keep = len(ids) - sum(p.n for p in probes)
            probe = ProbeRows(keep, meta.slot_mapping[keep:], self._meta(pieces) if pieces else None)
        dev = self.device
        logits = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            self.kv, meta, torch.tensor(rows, dtype=torch.long, device=dev), probe,
        )  # fmt: skip
        if probe is None:
            return StepOutput(logits, [])
        return StepOutput(logits, list(zip(probes, probe.deviation.split([p.n for p in probes]))))

    @torch.inference_mode()
    def read_kv(self, block_table: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions ``[start, end)`` of ``block_table`` in the pool, as the float32
        values attention reads (dequantized): ``[layers, kv_heads, end - start, head_dim]``
        each."""
        slots = slots_of(block_table, start, end, self.block_size).to(self.device)
        ks, vs = [], []
        for i in range(self.config.num_layers):
            k, v = self.kv.layer(i).gather(slots, torch.float32)
            ks.append(k.clone())
            vs.append(v.clone())
        return torch.stack(ks), torch.stack(vs)

    @torch.inference_mode()
    def write_kv(self, block_table: list[int], start: int, k: torch.Tensor, v: torch.Tensor,
                 shift: int = 0) -> None:  # fmt: skip
        """Write K, V ``[layers, kv_heads, n, head_dim]`` (float32) at positions start.. of
        ``block_table`` in the pool, K re-rotated by ``shift`` positions first (model/llama.py
        ``rerotate``), both quantized into the pool's KV format by the pool's own store."""
        n = k.shape[2]
        slots = slots_of(block_table, start, start + n, self.block_size).to(self.device)
        native = self.model.native
        for i in range(k.shape[0]):
            # [kv_heads, n, D] -> [n, kv_heads, D], in the compute dtype the pool's store takes
            kt = rerotate(k[i], shift, self.model.rotary_of(i)).transpose(0, 1).to(self.dtype).contiguous()
            vt = v[i].transpose(0, 1).to(self.dtype).contiguous()
            self.kv.layer(i, native).store(slots, kt, vt, seen=False)

    @torch.inference_mode()
    def copy_kv(self, copies) -> None:
        """For each ``cache.manager.BlockCopy``, the K/V of block ``src``'s first ``num_tokens``
        tokens into block ``dst``'s (and of their window parts), bytes as stored (token-exact
        reuse of a partial block: the copied K/V are the bits a cold run computes)."""
        parts = None
        if self.window_table is not None:  # both blocks' parts are held until the copy ran
            parts = [(*self.window_table([src, dst]), n) for src, dst, n in copies]
        self.kv.copy_tokens(copies, parts)

    @torch.inference_mode()
    def all_logits(self, ids: list[int], last: int | None = None) -> torch.Tensor:
        """Next-token logits at every position of one prompt, [len(ids), vocab] float32 (the
        ``last`` positions only when given: [last, vocab]), from a single prefill on a private
        KV cache (the engine's pool is not touched): for quality measurements (perplexity, KL
        between weight formats) and parity tests."""
        n, bs, lay, dev, model = len(ids), self.block_size, self.kv.layout, self.device, self.model
        nblocks = -(-n // bs)
        cache = KVCache(self.config, KVLayout(nblocks, bs, lay.bytes_per_token, lay.kv_format), dev)
        meta = build_metadata([list(range(nblocks))], [0], [n], bs, dev, native=model.native,
                              exact=model.exact, windowed=model.windowed)  # fmt: skip
        rows = list(range(0 if last is None else max(0, n - last), n))
        return model(torch.tensor(ids, dtype=torch.long, device=dev), torch.arange(n, device=dev),
                     cache, meta, torch.tensor(rows, dtype=torch.long, device=dev))  # fmt: skip
