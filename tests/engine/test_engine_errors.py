"""Errors name what is wrong and leave nothing behind; stop conditions, seeds, logprobs; the
`prefixcache generate` CLI.

Validation tests run on the session engine: after each failure its integrity must hold and it
must still serve a normal request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from prefixcache import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("prefixcache")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "prefixcache.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    return subprocess.run(
        cmd + list(args), capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def _assert_clean(llm: LLM, stats_before: dict | None = None) -> None:
    """Nothing half-allocated: integrity holds, no request is left, a normal request works."""
    llm.check_integrity()
    eng = llm.engine
    assert not eng.has_unfinished() and not eng.seqs
    assert eng.kv.pool.counts().in_use == 0
    if stats_before is not None:
        assert llm.cache_stats()["query_tokens"] == stats_before["query_tokens"]
    sp = SamplingParams(max_tokens=2, temperature=0)
    out = llm.generate([PROMPT], sp, cache_salt="errors-ok")
    assert len(out[0].outputs[0].token_ids) == 2
    llm.check_integrity()


# ---- model paths and architectures ------------------------------------------------------------
def test_unknown_model_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(model=str(missing))
    missing_gguf = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        LLM(model=missing_gguf)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2,
        "n_head": 4, "vocab_size": 100,
    }))  # fmt: skip
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=str(tmp_path))


def test_cli_unknown_model_path(tmp_path):
    missing = tmp_path / "missing-model-dir"
    r = _cli("generate", "--prompt", "hi", "--model", str(missing), timeout=120)
    assert r.returncode != 0
    assert str(missing) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


# ---- request validation -----------------------------------------------------------------------
def test_prompt_longer_than_context_names_both_lengths(llm):
    before = llm.cache_stats()
    n = llm.engine.max_model_len + 10
    with pytest.raises(ValueError) as e:
        llm.generate([[100] * n], SamplingParams(max_tokens=1))
    assert str(llm.engine.max_model_len) in str(e.value) and str(n) in str(e.value), str(e.value)
    _assert_clean(llm, before)


@pytest.mark.slow
def test_max_model_len_64():
    small = LLM(max_model_len=64, kv_cache_memory="8MiB")
    assert small.engine.max_model_len == 64
    ids = small.get_tokenizer().encode(PROMPT * 4)
    assert len(ids) > 64
    before = small.cache_stats()
    with pytest.raises(ValueError) as e:
        small.generate([ids], SamplingParams(max_tokens=1))
    msg = str(e.value)
    assert "64" in msg and str(len(ids)) in msg, msg
    # Fits as a prompt, but not with the tokens it asks for.
    with pytest.raises(ValueError, match="64"):
        small.generate([ids[:60]], SamplingParams(max_tokens=10))
    _assert_clean(small, before)
    # A request that fits right up to the limit runs and stops at it.
    out = small.generate([ids[:56]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
    small.check_integrity()


@pytest.mark.parametrize("prompt", ["", []], ids=["text", "ids"])
def test_empty_prompt(llm, prompt):
    before = llm.cache_stats()
    with pytest.raises(ValueError, match="empty"):
        llm.generate([prompt], GREEDY)
    _assert_clean(llm, before)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_say_which(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_token_id_outside_vocabulary(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=str(vocab)):
        llm.generate([[1, 2, vocab]], GREEDY)
    _assert_clean(llm)


def test_invalid_third_prompt_adds_nothing(llm):
    before = llm.cache_stats()
    counts = llm.engine.kv.pool.counts()
    prompts = [PROMPT, PROMPT + " said", ""]
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompts, GREEDY, cache_salt="errors-batch")
    assert llm.engine.kv.pool.counts() == counts
    _assert_clean(llm, before)
    # The valid prompts were not run: their blocks are not in the cache.
    tok = llm.get_tokenizer()
    assert llm.engine.lookup(tok.encode(PROMPT * 2), "errors-batch").num_cached_tokens == 0
    before = llm.cache_stats()
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(prompts, [GREEDY, GREEDY])
    _assert_clean(llm, before)


# ---- stop conditions, sampling, logprobs ------------------------------------------------------
@pytest.fixture(scope="module")
def reference(llm):
    """Greedy continuation of PROMPT without any stop condition."""
    out = llm.generate([PROMPT], GREEDY, cache_salt="errors-ref")[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_tokens
    return out


def test_max_tokens_finishes_with_length(reference):
    assert reference.finish_reason == "length"
    assert reference.stop_reason is None


def test_stop_string_cuts_text(llm, reference):
    words = reference.text.split()
    stop = next(w for w in words[2:] if len(w) >= 3)
    idx = reference.text.index(stop)
    sp = replace(GREEDY, stop=(stop,))
    out = llm.generate([PROMPT], sp, cache_salt="errors-ref")[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == reference.text[:idx]
    assert stop not in out.text
    assert out.token_ids == reference.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(reference.token_ids)
    sp = replace(GREEDY, stop=(stop,), include_stop_str_in_output=True)
    kept = llm.generate([PROMPT], sp, cache_salt="errors-ref")[0].outputs[0]
    assert kept.text == reference.text[: idx + len(stop)]


def test_stop_token_ids(llm, reference):
    j = 5
    tok = reference.token_ids[j]
    first = reference.token_ids.index(tok)
    sp = replace(GREEDY, stop_token_ids=(tok,))
    out = llm.generate([PROMPT], sp, cache_salt="errors-ref")[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == tok
    assert out.token_ids == reference.token_ids[: first + 1]


def test_eos_stops_unless_ignored(llm):
    chat = [{"role": "user", "content": "Say hello."}]
    sp = SamplingParams(max_tokens=64, temperature=0)
    o = llm.chat(chat, sp, cache_salt="errors-eos")[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] in llm.get_tokenizer().stop_token_ids, o
    assert o.stop_reason is None
    n = len(o.token_ids)
    ignored = llm.chat(
        chat, replace(sp, max_tokens=n + 3, ignore_eos=True), cache_salt="errors-eos"
    )
    assert ignored[0].outputs[0].finish_reason == "length"
    assert ignored[0].outputs[0].token_ids[:n] == o.token_ids


def test_seeded_sampling(llm):
    def run(seed, temperature=1.0):
        sp = SamplingParams(max_tokens=8, temperature=temperature, seed=seed, ignore_eos=True)
        return llm.generate([PROMPT], sp, cache_salt="errors-seed")[0].outputs[0].token_ids

    a = run(1234)
    assert run(1234) == a
    others = [run(s) for s in (1, 2, 3)]
    assert any(o != a for o in others), "different seeds gave identical samples"
    # A seeded request samples the same tokens when it shares a batch with others.
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    batch = llm.generate([PROMPT + " never", PROMPT, "Hello"], sp, cache_salt="errors-seed")
    assert batch[1].outputs[0].token_ids == a


def test_logprobs_contain_chosen_token(llm):
    sp = SamplingParams(max_tokens=8, temperature=1.5, seed=7, logprobs=3, ignore_eos=True)
    out = llm.generate([PROMPT], sp, cache_salt="errors-lp")[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 8
    for tok, lps in zip(out.token_ids, out.logprobs):
        assert tok in lps
        assert 3 <= len(lps) <= 4
        assert all(v <= 0 for v in lps.values())
    assert llm.generate([PROMPT], GREEDY, cache_salt="errors-lp")[0].outputs[0].logprobs is None


@pytest.mark.slow
def test_cli_generate_prints_text_cached_tokens_and_ttft():
    prompt = PROMPT + " went out every morning before dawn to cast his nets."
    r = _cli("generate", "--prompt", prompt, "--max-tokens", "4", "--repeat", "2",
             "--kv-cache-memory", "16MiB")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip(), "no generated text printed"
    lines = [ln for ln in r.stderr.splitlines() if "cached" in ln and "ttft" in ln]
    assert len(lines) == 2, r.stderr[-2000:]
    assert "cached 0," in lines[0]
    # run 2 hits all but the last prompt token: the first full block, and the second block's
    # tokens copied token-exactly from run 1's (prompt + output filled it)
    assert "cached 29," in lines[1], lines[1]
