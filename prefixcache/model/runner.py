"""Model runner: the sole caller of the model. Turns a scheduled batch into tensors, runs the
model, returns logits; and, for the KV connectors (segment caching), computes K/V without
sampling, into the pool or a private cache, reads and writes K/V, and probes layer 1.

It sees sequences only through what it is handed (token ids, positions, block tables); it never
sees queues or decides what runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from prefixcache import kernels
from prefixcache.kv.pool import KVCache, KVLayout
from prefixcache.model.attention import build_metadata
from prefixcache.model.decode_attention import slots_of
from prefixcache.model.llama import LlamaModel, rerotate
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
        # float32 on CUDA too: measured on an H200 (benchmarks/cuda_contract.py), bf16's sums
        # change with the batch shape by whole bf16 steps and 3-4 of 24 greedy continuations
        # changed when batched or chunked; float32's moved by ~2e-5 and none changed. On the
        # default model float32 was also the faster there (decode 10.1 vs 17.6 ms a token).
        return torch.float32
    if name == "float16" and device.type == "cpu":
        raise ValueError("dtype float16 is supported on CUDA only; use float32 or bfloat16 on CPU")
    return DTYPES[name]


@dataclass(frozen=True)
class Piece:
    """Tokens ``token_ids[start:start + n]`` at positions start.., computed into the blocks of
    ``block_table`` with attention over every slot before ``start``; nothing sampled."""

    token_ids: Seq[int]
    block_table: list[int]
    start: int
    n: int


@dataclass(frozen=True)
class PrivateKV:
    """A KV cache of the pool's format for one sequence of up to ``capacity`` tokens, outside
    the pool (``ModelRunner.private_kv``): K/V computed there touch no other request's."""

    cache: KVCache
    block_table: list[int]
    capacity: int


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

    def _forward(self, tables, starts, counts, ids, pos, cache: KVCache, rows: list[int],
                 window_tables: list[list[int]] | None = None) -> torch.Tensor:  # fmt: skip
        meta = build_metadata(tables, starts, counts, self.block_size, self.device,
                              native=self.model.native, exact=self.model.exact,
                              windowed=self.model.windowed, window_tables=window_tables)  # fmt: skip
        dev = self.device
        return self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            cache,
            meta,
            torch.tensor(rows, dtype=torch.long, device=dev),
        )

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; returns float32 logits [N, vocab] for the sequences that sample, in
        batch order."""
        ids: list[int] = []
        pos: list[int] = []
        logits_rows: list[int] = []
        for s in batch:
            seq, start, n = s.seq, s.seq.kv.num_computed_tokens, s.num_new_tokens
            ids.extend(seq.all_token_ids[start : start + n])
            pos.extend(range(start, start + n))
            if s.samples:
                logits_rows.append(len(ids) - 1)
        tables = [s.seq.kv.block_table for s in batch]
        return self._forward(
            tables, [s.seq.kv.num_computed_tokens for s in batch],
            [s.num_new_tokens for s in batch], ids, pos, self.kv, logits_rows,
            None if self.window_table is None else [self.window_table(t) for t in tables],
        )  # fmt: skip

    @torch.inference_mode()
    def run(self, pieces: list[Piece], private: PrivateKV | None = None) -> None:
        """Compute the K/V of ``pieces`` in one forward, into the pool (or ``private``); nothing
        is sampled. Pieces may share a block table: every layer stores all the forward's new
        K/V before any of them attends (attention.py), so a piece attends over an earlier piece
        of the same forward exactly as if that piece had been computed in a forward before it."""
        ids: list[int] = []
        pos: list[int] = []
        for p in pieces:
            ids.extend(p.token_ids[p.start : p.start + p.n])
            pos.extend(range(p.start, p.start + p.n))
        cache = self.kv if private is None else private.cache
        self._forward([p.block_table for p in pieces], [p.start for p in pieces],
                      [p.n for p in pieces], ids, pos, cache, [])  # fmt: skip

    def private_kv(self, num_tokens: int) -> PrivateKV:
        """A private cache for one sequence of ``num_tokens`` tokens, in the pool's format."""
        bs, lay = self.block_size, self.kv.layout
        nblocks = -(-num_tokens // bs)
        cache = KVCache(self.config, KVLayout(nblocks, bs, lay.bytes_per_token, lay.kv_format), self.device)
        return PrivateKV(cache, list(range(nblocks)), num_tokens)

    @torch.inference_mode()
    def read_kv(self, private: PrivateKV, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions ``[start, end)`` of a private cache, as the float32 values attention
        reads (dequantized): ``[layers, kv_heads, end - start, head_dim]`` each."""
        slots = torch.arange(start, end, device=self.device)  # its block table is 0, 1, ...
        ks, vs = [], []
        for i in range(self.config.num_layers):
            k, v = private.cache.layer(i).gather(slots, torch.float32)
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
            self.kv.layer(i, native).store(slots, kt, vt)

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
    def probe(self, token_ids: Seq[int], block_table: list[int], start: int, end: int,
              max_chunk: int) -> torch.Tensor:  # fmt: skip
        """The layer-1 V deviation of each token in ``[start, end)`` (float32 on the CPU,
        ``[end - start]``): layer 0 runs over the tokens (storing their exact layer-0 K/V), then
        layer 1's K/V of its output replace what was placed in the pool, and the squared
        distance between the two is the token's deviation (segments/blend.py). Tokens before
        ``start`` must be in the pool; the deviation of a token nothing was placed for is
        meaningless (its layer-1 slot held nothing)."""
        model, dev, bs = self.model, self.device, self.block_size
        layer1 = self.kv.layer(1, model.native)
        out = []
        for a in range(start, end, max_chunk):
            n = min(max_chunk, end - a)
            meta = build_metadata([block_table], [a], [n], bs, dev, native=model.native,
                                  exact=model.exact, windowed=model.windowed)  # fmt: skip
            ids = torch.tensor(token_ids[a : a + n], dtype=torch.long, device=dev)
            k, v = model.layer1_kv(ids, torch.arange(a, a + n, device=dev), self.kv, meta)
            _, placed = layer1.gather(meta.slot_mapping, torch.float32)  # [KVH, n, D]
            _, exact = layer1.store(meta.slot_mapping, k, v)  # [n, KVH, D] as attention reads it
            out.append((exact.float() - placed.transpose(0, 1)).square().sum((1, 2)).cpu())
        return torch.cat(out) if out else torch.empty(0)

    @torch.inference_mode()
    def all_logits(self, ids: list[int], last: int | None = None) -> torch.Tensor:
        """Next-token logits at every position of one prompt, [len(ids), vocab] float32 (the
        ``last`` positions only when given: [last, vocab]), from a single prefill on a private
        KV cache (the engine's pool is not touched): for quality measurements (perplexity, KL
        between weight formats) and parity tests."""
        n = len(ids)
        private = self.private_kv(n)
        rows = list(range(0 if last is None else max(0, n - last), n))
        return self._forward([private.block_table], [0], [n], ids, range(n), private.cache, rows)
