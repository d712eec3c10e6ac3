"""Helpers shared by several test modules (imported as ``_helpers``; pytest puts tests/ on the path)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
from pathlib import Path
from unittest import mock

import torch

from prefixcache import kernels
from prefixcache.kv.formats import kv_format
from prefixcache.model.loader import load_weights

# The default model's KV bytes per token in the default KV dtype (``auto``: int16 where the exact
# integer path runs, float32 where it does not): tests size pools in tokens with it.
_DEFAULT_KV = kv_format("auto", torch.float32, exact=kernels.available())
BYTES_PER_TOKEN = _DEFAULT_KV.bytes_per_token(30, 3, 64)
KV_DTYPE = _DEFAULT_KV.name  # int16, or float32 where the kernels are not built


@functools.cache
def _default_weights():
    return load_weights(None)


def shared_default_weights():
    """A context in which engines read the default model's weights once per test process, not
    once per engine (dequantizing the GGUF takes seconds)."""
    return mock.patch("prefixcache.engine.llm_engine.load_weights", lambda model: _default_weights())


def prefill_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prefill (ModelRunner.all_logits). [len(ids), vocab]."""
    return llm.engine.runner.all_logits(ids)


# English prose the cold == warm tests cut prompts from: long enough for many blocks.
PROSE = (
    "Prefix caching stores the attention keys and values of a prompt so that a later request "
    "which starts with the same tokens does not compute them again. Retrieval augmented "
    "generation places long documents at the start of every prompt; chat applications resend "
    "the whole conversation at every turn. The cache is organised in blocks of sixteen tokens, "
    "each named by a hash of every token before and in it, and blocks that nobody uses are "
    "evicted in least recently used order when memory runs out. Paris is the capital of "
    "France, Berlin is the capital of Germany, and Madrid is the capital of Spain. "
)


# ---- the Grafana dashboard and the metrics it queries (test_dashboard*.py) ---------------------
GRAFANA = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "prefixcache.json"


def grafana_metric_names() -> set[str]:
    """Every prefixcache:* series name the dashboard's queries use."""
    dash = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v.get("definition", "") for v in dash["templating"]["list"]]
    return {m for e in exprs for m in re.findall(r"prefixcache:[A-Za-z0-9_:]+", e)}


def served_series(exposition: str) -> set[str]:
    """Series names of a Prometheus text exposition: its samples, and the series its # TYPE
    lines declare (a histogram nothing was observed in yet has no samples, only its type)."""
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            names |= {family, *(family + s for s in suffixes.get(kind, ()))}
        elif line and not line.startswith("#"):
            names.add(re.match(r"[^{\s]+", line).group(0))
    return names


def cold_equals_warm(llm, ids: list[int]):
    """``ids`` (70 tokens or more) cold, then again with 64+ tokens cached beside a companion
    that shares its first 33: the same tokens and logprobs. Returns the cold output."""
    from prefixcache import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    cold = llm.generate([ids], params)[0]
    warm, _companion = llm.generate([ids, ids[:33] + ids[40:60]], params)
    assert warm.num_cached_tokens >= 64
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.outputs[0].logprobs == cold.outputs[0].logprobs
    return cold


@contextlib.contextmanager
def token_budget(llm, budget: int | None):
    """Chunked prefill for the block: the scheduler's token budget per step set to ``budget``
    (None leaves it), restored after."""
    sched = llm.engine.scheduler
    config = sched.config
    if budget is not None:
        sched.config = dataclasses.replace(config, max_num_batched_tokens=budget)
    try:
        yield
    finally:
        sched.config = config


def write_tiny_gguf(path: Path, arch: str, cfg, rope_theta: float, tensors, pre: str = "smollm",
                    sliding_window: int | None = None) -> Path:  # fmt: skip
    """A random tiny model as a GGUF file: ``cfg`` (a transformers config) as the architecture's
    hyperparameters, the default model's vocabulary, ``tensors`` ((GGUF name, float32 array)
    pairs) as written."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope_theta)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    add_default_vocab(w, pre=pre)
    for name, a in tensors:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_default_vocab(writer, pre: str = "smollm") -> None:
    """The default model's GPT-2 vocabulary (tokens, types, merges, bos/eos) copied from its GGUF
    into a ``gguf.GGUFWriter``: GGUF files of random tiny models that our tokenizer reads."""
    import gguf

    from prefixcache.model.paths import default_model_path

    src = gguf.GGUFReader(str(default_model_path()))
    f = src.fields
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([bytes(f["tokenizer.ggml.tokens"].parts[i]).decode() for i in f["tokenizer.ggml.tokens"].data])
    writer.add_token_types([int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data])
    writer.add_token_merges([bytes(f["tokenizer.ggml.merges"].parts[i]).decode() for i in f["tokenizer.ggml.merges"].data])
    writer.add_bos_token_id(int(f["tokenizer.ggml.bos_token_id"].parts[-1][0]))
    writer.add_eos_token_id(int(f["tokenizer.ggml.eos_token_id"].parts[-1][0]))
