"""The engine on a GPU: it serves, hits its cache, and keeps what docs/engine.md "On CUDA" says
holds there: greedy tokens identical cold vs warm, alone vs batched, chunked vs whole (float32,
auto's choice on CUDA). The bitwise contract is the CPU exact path's (tests/model/test_exact.py);
benchmarks/cuda_contract.py measures the bits on a GPU. The GPU tests skip where torch sees no
GPU, as in CI; the first two run everywhere."""

from __future__ import annotations

import os

import pytest
import torch
from _helpers import PROSE, token_budget

from prefixcache import LLM, SamplingParams, kernels
from prefixcache.engine.llm_engine import _float_kernels
from prefixcache.model.runner import resolve_dtype

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

B = 16


def test_auto_is_float32_on_every_device():
    # bf16 on an H200 changed 3-4 of 24 greedy continuations when batched or chunked
    for device in ("cpu", "cuda", "cuda:1"):
        assert resolve_dtype("auto", torch.device(device)) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cuda")) == torch.bfloat16


def test_float_blocks_name_whose_kernels_computed_them():
    assert _float_kernels(torch.device("cpu")) == (kernels.supported_isas() or ["generic"])[0]


@pytest.fixture(scope="module")
def gpu_llm():
    return LLM(device="cuda", kv_cache_memory="512MiB", seed=0)


def _salt() -> str:
    return os.urandom(8).hex()


def _tokens(llm, prompts, salt=None, n=12):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, cache_salt=salt)]


@gpu
def test_defaults_on_cuda(gpu_llm):
    runner = gpu_llm.engine.runner
    assert runner.kv.k.device.type == "cuda" and runner.kv.k.dtype == torch.float32
    assert not runner.model.exact
    assert _float_kernels(torch.device("cuda")).startswith("cuda:")


@gpu
def test_a_hit_reuses_the_prefix_and_the_cache_stays_consistent(gpu_llm):
    ids = gpu_llm.get_tokenizer().encode(PROSE * 4)
    salt = _salt()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = gpu_llm.generate([ids[:100] + ids[200:210]], params, cache_salt=salt)[0]
    second = gpu_llm.generate([ids[:100] + ids[300:310]], params, cache_salt=salt)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 100
    assert len(second.outputs[0].token_ids) == 8
    gpu_llm.check_integrity()


@gpu
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_cold_equals_warm_batched_and_chunked(gpu_llm, k):
    ids = gpu_llm.get_tokenizer().encode(PROSE * 4)
    prompts = [ids[s : s + shared] + ids[s + 300 : s + 320]
               for s in (0, 40, 90) for shared in (k * B - 1, k * B, k * B + 1)]  # fmt: skip
    cold = [_tokens(gpu_llm, [p], salt=_salt())[0] for p in prompts]
    salt = _salt()
    for p in prompts:  # cache each prompt's prefix with another suffix
        _tokens(gpu_llm, [p[: len(p) - 20] + [11, 12]], salt=salt, n=1)
    warm = _tokens(gpu_llm, prompts, salt=salt)
    assert warm == cold
    with token_budget(gpu_llm, 23):
        assert _tokens(gpu_llm, prompts, salt=_salt()) == cold
    gpu_llm.check_integrity()
