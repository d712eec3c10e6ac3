"""`prefixcache analyze` end to end on generated logs whose answers are known."""

from __future__ import annotations

import base64
import itertools
import json
import random
import re
import threading
from collections import Counter
from pathlib import Path

import pytest

from prefixcache.analyze import scan
from prefixcache.analyze.analyzer import AnalyzeOptions, analyze_file, analyze_prompts
from prefixcache.analyze.reader import MalformedLine, Prompt, parse_line
from prefixcache.analyze.request_log import RequestLogWriter
from prefixcache.cache.hashing import hash_blocks, root_hash

BS = 16
OPTS = AnalyzeOptions(block_size=BS, kv_bytes_per_token=1000, jobs=1, curve_points=6)


def ids_of(p: Prompt) -> list[int]:
    return p.token_ids if p.token_ids is not None else p.token_array.tolist()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 50_000) for _ in range(n)]


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return path


def structured_log(rng: random.Random, n: int = 600, namespaces: tuple = (None,)):
    """k system prompts, documents with Zipf-like popularity, unique questions.

    System prompts and documents are whole blocks, so the ideal hit rate is analytical: every
    (namespace, system) after its first use saves the system prompt, every (namespace, system,
    document) after its first use saves the document too.
    """
    systems = [tokens(rng, BS * k) for k in (3, 5, 8)]
    docs = [tokens(rng, BS * rng.randrange(4, 20)) for _ in range(12)]
    doc_weights = [1 / (j + 1) for j in range(len(docs))]
    rows, total = [], 0
    seen_sys, seen_doc = Counter(), Counter()
    for i in range(n):
        ns = namespaces[i % len(namespaces)]
        s = rng.randrange(len(systems))
        d = rng.choices(range(len(docs)), doc_weights)[0]
        q = tokens(rng, rng.randrange(5, 60))  # unique; partial blocks never count
        ids = systems[s] + docs[d] + q
        row = {"prompt_token_ids": ids, "timestamp": 1000.0 + i}
        if ns is not None:
            row["user"] = ns
        rows.append(row)
        total += len(ids)
        seen_sys[(ns, s)] += 1
        seen_doc[(ns, s, d)] += 1
    saved = sum((c - 1) * len(systems[s]) for (_, s), c in seen_sys.items())
    saved += sum((c - 1) * len(docs[d]) for (_, _, d), c in seen_doc.items())
    return rows, saved / total, total


@pytest.mark.parametrize("namespaces", [(None,), ("alice", "bob", "carol")])
def test_ideal_hit_rate_is_analytical(tmp_path, namespaces):
    rows, expected, total = structured_log(random.Random(1), namespaces=namespaces)
    s = analyze_file(str(write_jsonl(tmp_path / "log.jsonl", rows)), OPTS)
    assert s["requests"] == len(rows)
    assert s["prompt_tokens"] == total
    assert s["ideal_hit_rate"] == pytest.approx(expected, abs=1e-12)
    assert s["ideal_saved_tokens"] == round(expected * total)
    assert s["namespaces"] == len(namespaces)
    assert s["malformed"]["count"] == 0
    # The curve is monotone, ends at the ideal, and Belady bounds LRU and LFU everywhere.
    curve = s["curve"]
    for a, b in itertools.pairwise(curve):
        assert a["cache_tokens"] < b["cache_tokens"]
        assert a["lru"] <= b["lru"] + 1e-12
    for p in curve:
        assert p["belady"] >= p["lru"] - 1e-12 and p["belady"] >= p["lfu"] - 1e-12
        assert p["cache_bytes"] == p["cache_tokens"] * 1000
    assert curve[-1]["lru"] == pytest.approx(expected)
    lru90 = next(p for p in curve if p["cache_tokens"] == s["lru_90pct_tokens"])
    assert lru90["lru"] >= 0.9 * expected - 1e-12
    # The most-saving prefix is a system prompt + popular document, not a unique question.
    top = s["top_prefixes"][0]
    assert top["requests"] >= 2 and top["tokens"] % BS == 0


def test_parallel_scan_gives_the_same_answer(tmp_path, monkeypatch):
    rows, _, _ = structured_log(random.Random(2), n=300)
    path = str(write_jsonl(tmp_path / "log.jsonl", rows + ["not json"] + rows[:20]))
    one = analyze_file(path, OPTS)
    monkeypatch.setattr(scan, "CHUNK_BYTES", 20_000)  # many ranges, out-of-order finishes
    assert len(scan.byte_ranges(path, scan.CHUNK_BYTES)) > 5
    two = analyze_file(path, AnalyzeOptions(block_size=BS, kv_bytes_per_token=1000, jobs=2,
                                            curve_points=6))
    for key in ("requests", "prompt_tokens", "ideal_saved_tokens", "curve", "malformed",
                "top_prefixes", "distinct_blocks"):
        assert one[key] == two[key], key
    assert one["malformed"]["first_lines"] == {"invalid JSON": [301]}


def test_timestamp_at_the_top_is_a_cache_killer(tmp_path):
    rng = random.Random(3)
    head, body = tokens(rng, 10), tokens(rng, 400)
    rows = []
    for i in range(200):
        stamp = [1000 + i, 2000 + i % 60, 3000 + i % 24, 4000 + i % 7, 5000, 6000 + i % 3]
        rows.append({"prompt_token_ids": head + stamp + body + tokens(rng, 30), "time": i})
    s = analyze_file(str(write_jsonl(tmp_path / "log.jsonl", rows)), OPTS)
    assert s["ideal_hit_rate"] < 0.01  # the timestamp leaves nothing to cache...
    killers = s["cache_killers"]
    assert killers, "planted timestamp not reported"
    k = killers[0]
    assert k["divergence_token"] == 10
    assert k["volatile_tokens"] == 6
    assert k["requests"] >= 190
    assert k["lost_share"] > 0.8  # ...though ~90% of every prompt repeats
    assert "move them after the stable part" in k["suggestion"]
    assert k["example_lines"][0] > k["example_lines"][1]


def test_no_killers_when_prompts_are_stable(tmp_path):
    rows, _, _ = structured_log(random.Random(4), n=300)
    s = analyze_file(str(write_jsonl(tmp_path / "log.jsonl", rows)), OPTS)
    assert s["cache_killers"] == []
    # A document first seen after another system prompt is shared content behind a different
    # prefix: reported apart, not as a killer.
    for entry in s["shared_after_divergence"]:
        assert entry["divergence_token"] == 0
        assert entry["volatile_tokens"] is None or entry["volatile_tokens"] > 64


def test_malformed_lines_are_counted_not_fatal(tmp_path):
    rng = random.Random(5)
    good = [{"prompt_token_ids": tokens(rng, 40)} for _ in range(5)]
    bad = [
        "{not json",
        "[1, 2, 3]",
        json.dumps({"model": "m"}),
        json.dumps({"prompt_token_ids": [1, -2, 3]}),
        json.dumps({"prompt_token_ids": [1, "a", 3]}),
        json.dumps({"prompt_token_ids": [1.5, 2]}),
        json.dumps({"block_hashes": ["zz"], "num_prompt_tokens": 16}),
        json.dumps({"block_hashes": ["00" * 16]}),
        json.dumps({"messages": "hello"}),
    ]
    rows = [good[0], bad[0], good[1], *bad[1:], "", good[2], good[3], good[4]]
    s = analyze_file(str(write_jsonl(tmp_path / "log.jsonl", rows)), OPTS)
    assert s["requests"] == 5
    m = s["malformed"]
    assert m["count"] == len(bad)
    assert m["by_reason"]["invalid JSON"] == 1
    assert m["first_lines"]["invalid JSON"] == [2]
    assert m["by_reason"]["not a JSON object"] == 1
    assert sum(v for k, v in m["by_reason"].items() if "token id" in k) == 3


def test_reader_formats():
    [p] = parse_line(json.dumps({"model": "m", "prompt": "hi", "user": "u1", "timestamp": 5}))
    assert (p.text, p.namespace, p.time) == ("hi", "u1", 5.0)
    [p] = parse_line(json.dumps({"body": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]}]},
        "time": "2024-05-01T00:00:00Z"}))
    assert p.messages[0]["content"] == "ab" and p.time == 1714521600.0
    ps = parse_line(json.dumps({"prompt": [[1, 2], [3]]}))
    assert [ids_of(p) for p in ps] == [[1, 2], [3]]
    assert [p.text for p in parse_line(json.dumps({"prompt": ["a", "b"]}))] == ["a", "b"]
    # The numpy fast path and the json path agree, also with spaces and nesting.
    line = '{"x": {"prompt_token_ids": [9]}, "prompt_token_ids" : [ 1, 2 ,3 ], "tenant": "t"}'
    [p] = parse_line(line)
    assert ids_of(p) == [1, 2, 3] and p.namespace == "t"
    [p] = parse_line('{"body": {"prompt_token_ids": [4, 5]}}')
    assert ids_of(p) == [4, 5]
    [p] = parse_line('{"prompt_token_ids": [4, 5], "tenant": "x"}')  # the numpy fast path
    assert p.token_array is not None and ids_of(p) == [4, 5]
    with pytest.raises(MalformedLine):
        parse_line('{"prompt_token_ids": [1, 4294967296]}')
    with pytest.raises(MalformedLine):
        parse_line('{"prompt_token_ids": [1, 2e3]}')


def test_request_log_round_trip(tmp_path):
    """Server log (hashes only, written from threads) → analyzer: same answer as token ids."""
    rows, expected, total = structured_log(random.Random(6), n=200, namespaces=("a", "b"))
    path = tmp_path / "requests.jsonl"
    writer = RequestLogWriter(path)
    roots = {ns: root_hash("server-model", ns, block_size=BS) for ns in ("a", "b")}

    def serve(chunk):
        for row in chunk:
            ids, ns = row["prompt_token_ids"], row["user"]
            writer.log(time=row["timestamp"], tenant=ns, namespace=ns, num_prompt_tokens=len(ids),
                       block_hashes=hash_blocks(ids, BS, roots[ns]), num_cached_tokens=0,
                       text="secret", prompt_token_ids=ids)

    # One thread per namespace keeps each namespace's order (the ideal depends on it).
    by_ns = [[r for r in rows if r["user"] == ns] for ns in ("a", "b")]
    threads = [threading.Thread(target=serve, args=(c,)) for c in by_ns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    with pytest.raises(ValueError):
        writer.log(time=0, tenant=None, namespace=None, num_prompt_tokens=0, block_hashes=[])
    lines = path.read_text().splitlines()
    assert len(lines) == len(rows)
    first = json.loads(lines[0])
    assert "text" not in first and "prompt_token_ids" not in first  # no content unless asked
    assert all(len(h) == 32 for h in first["block_hashes"])
    s = analyze_file(str(path), OPTS)
    assert s["requests"] == len(rows) and s["prompt_tokens"] == total
    assert s["ideal_hit_rate"] == pytest.approx(expected, abs=1e-12)
    assert s["namespaces"] == 2

    # With text: the token ids are logged and the analyzer re-blocks them at its block size.
    path2 = tmp_path / "with_text.jsonl"
    with RequestLogWriter(path2, include_text=True, block_size=BS) as w:
        ids = rows[0]["prompt_token_ids"]
        w.log(time=1.0, tenant=None, namespace=None, num_prompt_tokens=len(ids),
              block_hashes=hash_blocks(ids, BS, roots["a"]), text="t", prompt_token_ids=ids)
    rec = json.loads(path2.read_text())
    assert rec["text"] == "t" and rec["prompt_token_ids"] == ids and rec["block_size"] == BS
    [p] = parse_line(path2.read_text())
    assert ids_of(p) == ids


def test_hash_log_with_other_block_size_is_reported(tmp_path):
    row = {"block_hashes": ["00" * 16, "11" * 16], "num_prompt_tokens": 64, "block_size": 32}
    s = analyze_file(str(write_jsonl(tmp_path / "log.jsonl", [row])), OPTS)
    assert s["requests"] == 0
    assert list(s["malformed"]["by_reason"]) == ["hashes made with block size 32, analysing with 16"]


class CharTokenizer:
    """One token per character; a chat template that writes ``<role>`` before each message."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode_chat(self, messages, add_generation_prompt=True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


def test_role_shares_from_chat_messages():
    rng = random.Random(7)
    system = "You are a careful assistant. " * 4
    doc = "".join(rng.choice("abcdefgh ") for _ in range(300))
    prompts, expected = [], Counter()
    for i in range(20):
        user = "".join(rng.choice("xyz") for _ in range(40)) + f" (question {i})"
        # The document comes after the user message here; the template puts it first.
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user},
                {"role": "document", "content": doc}]
        prompts.append(Prompt(messages=msgs))
        expected["system"] += len("<system>") + len(system)
        expected["document"] += len("<document>") + len(doc)
        expected["user"] += len("<user>") + len(user)
        expected["template"] += len("<assistant>")
    s = analyze_prompts(prompts, OPTS, tokenizer=CharTokenizer())
    total = sum(expected.values())
    assert s["prompt_tokens"] == total
    assert s["share_by_role"] == pytest.approx({k: v / total for k, v in expected.items()})
    cached = s["cached_share_by_role"]
    assert cached["system"] > 0.9 and cached["document"] > 0.9 and cached["user"] < 0.1
    # Excerpts are decoded text when prompts were text.
    assert "You are" in s["top_prefixes"][0]["head"]


def test_text_prompts_without_tokenizer_are_counted(tmp_path, monkeypatch):
    from prefixcache.analyze import prompts as prompts_mod

    def broken(path):
        raise FileNotFoundError("no model here")

    monkeypatch.setattr(prompts_mod, "load_tokenizer", broken)
    rows = [{"prompt": "hello"}, {"prompt_token_ids": list(range(40))}]
    s = analyze_file(str(write_jsonl(tmp_path / "log.jsonl", rows)), OPTS)
    assert s["requests"] == 1
    [(reason, n)] = s["malformed"]["by_reason"].items()
    assert reason.startswith("needs a tokenizer") and n == 1


def test_cli_writes_report(tmp_path, capsys):
    from prefixcache.cli import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576}))
    rows, expected, _ = structured_log(random.Random(8), n=200)
    log = write_jsonl(tmp_path / "log.jsonl", rows + ["garbage"])
    out = tmp_path / "report"
    rc = main(["analyze", str(log), "--model", str(model), "--report", str(out), "--jobs", "1"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ideal hit rate" in printed and "1 malformed" in printed
    s = json.loads((out / "summary.json").read_text())
    for key in ("requests", "prompt_tokens", "ideal_hit_rate", "share_by_role", "curve",
                "lru_90pct_tokens", "top_prefixes", "cache_killers"):
        assert key in s, key
    assert set(s["curve"][0]) >= {"cache_tokens", "lru", "lfu", "belady", "cache_bytes"}
    assert s["kv"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert s["ideal_hit_rate"] == pytest.approx(expected)
    assert (out / "report.md").read_text().startswith("# Prefix-cache analysis")
    for png in ("curve.png", "roles.png", "positions.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # report.html: one file with the same plots inside, the log's text escaped
    page = (out / "report.html").read_text()
    assert page.startswith("<!doctype html>") and "Top shared prefixes" in page
    for png in ("curve.png", "roles.png", "positions.png"):
        inline = base64.b64encode((out / png).read_bytes()).decode()
        assert f'src="data:image/png;base64,{inline}"' in page, png
    assert not re.search(r'(?:src|href)="(?!data:)', page)  # nothing outside the file
    assert main(["analyze", str(tmp_path / "missing.jsonl")]) == 2


def test_html_report_escapes_the_log_text():
    from prefixcache.analyze.html_report import html

    evil = "<script>alert(1)</script> & <b>"
    s = {
        "source": "<img src=x>", "requests": 2, "malformed": {"count": 0, "by_reason": {}},
        "prompt_tokens": 64, "block_size": 16, "namespaces": 1, "distinct_blocks": 2,
        "ideal_hit_rate": 0.5, "ideal_saved_tokens": 32, "lru_90pct_tokens": 32,
        "lru_full_tokens": 32, "curve": [], "share_by_role": {evil: 1.0},
        "cached_share_by_role": {}, "share_by_position": [],
        "top_prefixes": [{"tokens": 32, "requests": 2, "request_share": 1.0, "saved_tokens": 32,
                          "saved_share": 1.0, "first_line": 1, "head": evil, "tail": evil}],
        "cache_killers": [{"requests": 1, "lost_tokens": 16, "lost_share": 0.25,
                           "example_lines": [1, 2], "excerpt": evil, "other_excerpt": evil,
                           "suggestion": evil}],
    }  # fmt: skip
    page = html(s, ".", [])
    assert "<script>" not in page and "<img src=x>" not in page and "<b>alert" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;b&gt;" in page


def test_default_model_kv_bytes(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from prefixcache.analyze import model_info
    from prefixcache.model.paths import ModelNotFoundError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        layout = model_info.kv_layout(None)  # reads the GGUF metadata
    except ModelNotFoundError:
        pytest.skip("default model not installed")
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (30, 3, 64)
    assert layout.bytes_per_token == 23_040
    assert model_info._cache_file().is_file()

    def no_reading(*a):
        raise AssertionError("the cached layout should have been used")

    monkeypatch.setattr(model_info, "_gguf_layout", no_reading)
    assert model_info.kv_layout(None, dtype_bytes=4).bytes_per_token == 46_080


class WordTokenizer(CharTokenizer):
    """Words " ab", " ac", ... are single tokens (what bench's synthetic text is made of)."""

    vocab_size = 400

    def __init__(self) -> None:
        letters = "abcdefghijklmnopqrstuvwxyz"
        self.pieces = [" " + letters[i // 26 % 26] + letters[i % 26] + "x" for i in range(400)]
        self.ids = {p: i for i, p in enumerate(self.pieces)}

    def encode(self, text: str) -> list[int]:
        import re

        return [self.ids.get(t, 1000 + ord(t[0])) if len(t) > 1 else 1000 + ord(t)
                for t in re.findall(r" [a-z]+|.", text, re.DOTALL)]

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] if i < 1000 else chr(i - 1000) for i in ids)


def test_cli_bench_dataset(tmp_path, monkeypatch, capsys):
    pytest.importorskip("prefixcache.bench.datasets")
    from prefixcache.analyze import prompts as prompts_mod
    from prefixcache.cli import main

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda path: WordTokenizer())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}))
    rc = main(["analyze", "--dataset", "rag", "--num-prompts", "60", "--model", str(model),
               "--dataset-option", "rag_num_documents=4", "--dataset-option",
               "rag_docs_per_prompt=1", "--json"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    assert s["requests"] == 60 and s["source"] == "dataset:rag"
    assert {"system", "user"} <= set(s["share_by_role"])
    assert s["ideal_hit_rate"] > 0.5  # one system prompt and 4 documents for 60 requests
    assert s["kv"]["bytes_per_token"] == 2 * 2 * 4 * 16 * 2


def test_ttft_estimate_from_prefill_times():
    import numpy as np

    from prefixcache.analyze.measure import ttft_estimate

    points = [(n, 0.01 + 0.001 * n) for n in (32, 256, 1024, 2048)]
    n = np.array([1000, 2000, 500])
    cached = np.array([992, 0, 500])  # a fully cached prompt still computes one token
    t = ttft_estimate(points, n, cached, "cpu")
    assert t["mean_cold_s"] == pytest.approx(0.01 + 0.001 * n.mean())
    assert t["mean_ideal_s"] == pytest.approx(0.01 + 0.001 * (8 + 2000 + 1) / 3)
    assert t["total_saved_s"] == pytest.approx(0.001 * (992 + 499))


@pytest.mark.slow
def test_role_spans_with_the_default_tokenizer():
    from prefixcache.analyze.prompts import encode_messages, load_tokenizer
    from prefixcache.model.paths import ModelNotFoundError

    try:
        tok = load_tokenizer(None)
    except ModelNotFoundError:
        pytest.skip("default model not installed")
    msgs = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What is in the report?"},
            {"role": "document", "content": "Quarterly revenue grew 12 percent.", "title": "Q3"},
            {"role": "assistant", "content": "Revenue grew."},
            {"role": "user", "content": "By how much?"}]
    ids, spans = encode_messages(tok, msgs)
    assert ids == tok.encode_chat(msgs)  # the prompt the server would prefill
    assert spans[0][1] == 0 and spans[-1][2] == len(ids)
    assert all(a[2] == b[1] for a, b in itertools.pairwise(spans))  # they tile the prompt
    roles = [r for r, _, _ in spans]
    assert roles[:3] == ["system", "document", "user"]  # the template puts documents first
    doc = next((a, b) for r, a, b in spans if r == "document")
    assert "Quarterly revenue" in tok.decode(ids[doc[0]:doc[1]])
