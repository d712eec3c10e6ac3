"""Tokenizer: id parity with transformers on GGUF files, chat templates, documents, HF
directories, streaming detokenization, fingerprints."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from prefixcache.model.paths import ModelNotFoundError, default_model_path
from prefixcache.tokenizer.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    load_tokenizer,
    merge_documents,
)

TEXTS = [
    "",
    " ",
    "   ",
    "\t",
    "\n",
    "\n\n\n",
    " \n \n\t\t\n",
    "Hello world",
    " Hello  world\n\n  x",
    "trailing spaces   ",
    "   leading spaces",
    "x  \t y\r\nz",
    "def f(x):\n\treturn x**2  # square\n",
    "    indented\n        more indented\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "1234567890 3.14159 -42 1e-9 0x1F",
    "😀😃😄 👨‍👩‍👧 🦙🦙",
    "你好，世界！这是一个测试。",
    "東京は日本の首都です。",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "ﬁ Ａ ǅ é é",
    "I'm can't we'll they've SHOULDN'T",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<|im_end|>",
    "<|im_start|> spaced <|im_end|>  ",
    "<s> </s> <unk>",
    "https://example.com/path?q=1&r=2#frag",
    "$$\\sum_{i=1}^{n} i^2$$",
    "naïve café résumé — “quotes” ‘single’ …",
    "\u200b\u00a0\u3000 odd spaces",
]

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ],
    [{"role": "user", "content": "No system prompt here. 你好 🦙"}],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def ref():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# --- parity with transformers ----------------------------------------------------------------


@pytest.mark.slow
def test_ids_match_transformers_on_default_gguf(tok, ref):
    assert tok.vocab_size == len(ref)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    for text in TEXTS:
        expected = ref.encode(text, add_special_tokens=True)
        assert tok.encode(text, add_special_tokens=True) == expected, text
        assert tok.decode(expected) == ref.decode(expected, skip_special_tokens=True), text
        assert tok.decode(expected, skip_special_tokens=False) == ref.decode(expected), text


@pytest.mark.slow
def test_chat_template_matches_transformers(tok, ref):
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected
    expected_ids = ref.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)
    if isinstance(expected_ids, dict) or hasattr(expected_ids, "keys"):
        expected_ids = expected_ids["input_ids"]
    assert tok.encode_chat(CONVERSATIONS[1]) == list(expected_ids)


# A template exercising the environment: loop controls, namespace, tojson, raise_exception,
# trim/lstrip blocks, bos_token, tools, extra variables.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m['role'] not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('bad role ' + m['role']) }}
  {% endif %}
  {% if m['role'] == 'assistant' and skip_assistant %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
[{{ m['role'] }}] {{ m['content'] | trim }}
{% endfor %}
{% if tools %}TOOLS={{ tools | tojson }}{% endif %}
n={{ ns.n }} year={{ strftime_now('%Y')[:2] }}
{% if add_generation_prompt %}[assistant]{% endif %}"""


@pytest.mark.slow
def test_template_environment_matches_transformers(tok, ref):
    tools = [{"type": "function", "function": {"name": "f", "description": "<ünïcode> & co"}}]
    for kwargs in ({}, {"skip_assistant": True}):
        expected = ref.apply_chat_template(
            CONVERSATIONS[1], chat_template=RICH_TEMPLATE, tools=tools, tokenize=False,
            add_generation_prompt=True, **kwargs)
        got = tok.apply_chat_template(CONVERSATIONS[1], chat_template=RICH_TEMPLATE, tools=tools,
                                      **kwargs)
        assert got == expected
    with pytest.raises(Exception, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], chat_template=RICH_TEMPLATE)


def _write_gguf(path: Path, *, model: str, tokens: list[str], types: list[int],
                scores: list[float] | None = None, merges: list[str] | None = None,
                pre: str | None = None, bos: int, eos: int, unk: int | None = None,
                add_bos: bool | None = None, template: str | None = None) -> Path:
    """A vocabulary-only GGUF file, as llama.cpp's ggml-vocab-*.gguf test files are."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if unk is not None:
        w.add_unk_token_id(unk)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _sentencepiece_gguf(path: Path) -> Path:
    """Llama-2 style: byte fallback tokens, scores but no merges (rebuilt from the scores)."""
    words = ["▁the", "▁cat", "▁sat", "▁hello", "▁world", "▁on", "▁mat", "ing", "▁▁", "▁▁▁▁"]
    pieces = sorted({c for w in words for c in w})
    pieces += ["▁t", "th", "he", "▁th", "at", "▁c", "▁s", "ll", "llo", "▁he", "▁hel", "or",
               "▁w", "▁wor", "rld", "▁o", "▁m", "in", "ng", *words]
    pieces = list(dict.fromkeys(pieces))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces,
              "<|user|>", "<think>"]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces)), 3, 4]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *(-float(i) for i in range(len(pieces))), 0.0, 0.0]
    return _write_gguf(path, model="llama", tokens=tokens, types=types, scores=scores, bos=1,
                       eos=2, unk=0, add_bos=True, template="{{ bos_token }}{{ messages[0]['content'] }}")


def _byte_level_gguf(path: Path, endoftext: bool = True) -> Path:
    """Llama-3 style: byte alphabet, merges, the llama-bpe split regex, control tokens, and a
    token stored as text ("€") rather than in the byte alphabet."""
    from prefixcache.tokenizer.gguf import _BYTE_SPELLING

    alphabet = [_BYTE_SPELLING[b] for b in range(256)]
    # "3 4" outranks "12 3": "1234" is 12|34 under GPT-2's split, 123|4 under Llama 3's.
    merges = ["Ġ t", "h e", "Ġt he", "l l", "ll o", "Ġ h", "Ġh e", "Ġhe llo", "1 2", "3 4",
              "12 3", "Ċ Ċ", "Ġ Ġ"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = [*alphabet, *merged, "€", *(["<|endoftext|>"] if endoftext else []),
              "<|begin_of_text|>", "<|eot_id|>", "<think>"]
    types = [*([1] * (len(alphabet) + len(merged) + 1)), *([3] if endoftext else []), 3, 3, 4]
    return _write_gguf(path, model="gpt2", pre="llama-bpe", tokens=tokens, types=types,
                       merges=merges, bos=len(tokens) - 3, eos=len(tokens) - 2, add_bos=True,
                       template="{{ bos_token }}{{ messages[0]['content'] }}<|eot_id|>")


@pytest.mark.slow
def test_synthetic_gguf_families_match_transformers(tmp_path):
    """The 'llama' (sentencepiece) and regex-split 'gpt2' paths, on vocabularies made here."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    texts = ["the cat sat on the mat", " the  cat\n\n  hello", "hello world 123456 é € 🦙 ñ",
             "<s>the</s> <|user|>hello<think>x", "<|begin_of_text|>the hello<|eot_id|>",
             "    ", "   the", "\tthe\n", "mating singing", "x\r\n\r\ny", "1234 (the) 12345678"]
    for make in (_sentencepiece_gguf, _byte_level_gguf):
        path = make(tmp_path / f"{make.__name__}.gguf")
        ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
        ours = load_tokenizer(path)
        assert ours.vocab_size == len(ref)
        assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
        for text in texts:
            expected = ref.encode(text, add_special_tokens=True)
            assert ours.encode(text, add_special_tokens=True) == expected, (make.__name__, text)
            assert ours.decode(expected) == ref.decode(expected, skip_special_tokens=True)
            assert ours.decode(expected, skip_special_tokens=False) == ref.decode(expected)
        assert ours.add_bos_token
        ids = ours.encode_chat([{"role": "user", "content": "the cat"}])
        assert ids.count(ours.bos_token_id) == 1 and ids[0] == ours.bos_token_id
    assert ours.eos_token_id in ours.stop_token_ids


# --- behaviour without transformers ------------------------------------------------------------


def test_no_id_past_the_files_vocabulary(tmp_path):
    """transformers gives a Llama-3 style file an extra "<|endoftext|>" at a new id the model's
    embedding lacks; here that text stays plain text."""
    path = _byte_level_gguf(tmp_path / "noeot.gguf", endoftext=False)
    size = len(gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].data)
    tok = load_tokenizer(path)
    assert tok.vocab_size == size
    assert max(tok.encode("a<|endoftext|>b<|begin_of_text|>")) < size
    assert tok.decode(tok.encode("a<|endoftext|>b")) == "a<|endoftext|>b"


def test_default_model_basics(tok):
    assert tok.vocab_size == 49152
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>") == 2
    assert tok.eos_token_id in tok.stop_token_ids
    assert tok.id_to_token(tok.eos_token_id) == "<|im_end|>"
    assert not tok.add_bos_token
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    assert "<|im_start|>" in tok.chat_template
    # Special tokens written in text stay whole.
    assert tok.encode("<|im_start|>user") == [1, *tok.encode("user")]


def test_decode_round_trip(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
    plain = "Hello <|im_end|> world"
    assert tok.decode(tok.encode(plain)) == "Hello  world"


def test_no_chat_template_is_a_clear_error(tok, tmp_path):
    directory = _save_hf_dir(tok, tmp_path / "hf", chat_template=None)
    bare = load_tokenizer(directory)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_documents_merge_into_system_prefix(tok):
    docs = [
        {"role": "document", "title": "Manual", "content": "Press the red button."},
        {"role": "document", "name": "faq.md", "content": "Q: Why? A: Because."},
        {"role": "document", "content": "Untitled text."},
    ]
    system = {"role": "system", "content": "Answer from the documents."}
    merged = merge_documents([system, docs[0], {"role": "user", "content": "Q"}, *docs[1:]])
    assert [m["role"] for m in merged] == ["system", "user"]
    assert merged[0]["content"] == (
        "Answer from the documents.\n\n# Documents\n\n## Manual\nPress the red button.\n\n"
        "## faq.md\nQ: Why? A: Because.\n\n## Document 3\nUntitled text."
    )
    prompts = [
        tok.apply_chat_template([system, *docs, {"role": "user", "content": q}])
        for q in ("How do I start it?", "What colour is the button, and why does it matter?")
    ]
    for prompt in prompts:
        sys_at, doc_at = prompt.index("Answer from"), prompt.index("# Documents")
        assert sys_at < doc_at < prompt.index("Untitled text.") < prompt.index("<|im_start|>user")
        assert prompt.index("## Manual") < prompt.index("## faq.md") < prompt.index("## Document 3")
    ids = [tok.encode_chat([system, *docs, {"role": "user", "content": q}])
           for q in ("How do I start it?", "What colour is the button?")]
    shared = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    prefix = prompts[0][: prompts[0].index("<|im_start|>user")]
    assert shared >= len(tok.encode(prefix))
    # Without a system message one is created, so the model's default system prompt is not used.
    no_system = tok.apply_chat_template([docs[0], {"role": "user", "content": "hi"}])
    assert no_system.startswith("<|im_start|>system\n# Documents\n\n## Manual\n")
    assert "SmolLM" not in no_system
    # Messages without documents are left as they are.
    assert merge_documents(CONVERSATIONS[1]) == CONVERSATIONS[1]


def _save_hf_dir(tok: Tokenizer, directory: Path, *, chat_template: str | None = "model",
                 **config) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
    cfg = {
        "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "pad_token": tok.id_to_token(tok.pad_token_id), "unk_token": tok.id_to_token(tok.unk_token_id),
        "add_bos_token": tok.add_bos_token,
        "chat_template": tok.chat_template if chat_template == "model" else chat_template,
        **config,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return directory


def test_hf_directory_round_trip(tok, tmp_path):
    directory = _save_hf_dir(tok, tmp_path / "hf")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = load_tokenizer(directory)
    for text in TEXTS:
        assert loaded.encode(text, add_special_tokens=True) == tok.encode(text, True), text
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)
        assert loaded.encode_chat(messages) == tok.encode_chat(messages)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.stop_token_ids == {0, 2}  # generation_config's list joins the stop set


def test_hf_directory_bos_from_post_processor(tok, tmp_path):
    """Llama 3 style: no add_bos_token key, the tokenizer.json post-processor writes BOS."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    backend = Backend.from_str(tok.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    directory = tmp_path / "llama3ish"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(backend.to_str(), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
         "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    loaded = load_tokenizer(directory)
    assert loaded.add_bos_token
    assert loaded.encode("hi") == tok.encode("hi")  # the backend never adds it by itself
    assert loaded.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi")]
    assert loaded.encode_chat([{"role": "user", "content": "hi"}]) == [1, *tok.encode("hi")]


def _stream(tok, ids, prompt_ids=None, seed=0):
    det = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    rng = random.Random(seed)
    deltas, i = [], 0
    while i < len(ids):
        step = rng.choice((1, 1, 1, 2, 3))
        deltas.append(det.add(ids[i:i + step]))
        i += step
    deltas.append(det.flush())
    return det, deltas


def test_incremental_detokenizer_matches_full_decode(tok, tmp_path):
    text = ("Emoji 😀👨‍👩‍👧🦙 then 中文字符测试，日本語のテキスト、한국어 텍스트 and "
            "Ελληνικά · mixed\n\tcode: print('🦙')  done")
    ids = tok.encode(text)
    for seed in range(3):
        det, deltas = _stream(tok, ids, seed=seed)
        assert "".join(deltas) == det.text == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)
    # With a prompt: the continuation's text as it reads after the prompt.
    prompt = tok.encode("User said: ")
    det, deltas = _stream(tok, ids, prompt_ids=prompt)
    assert "".join(deltas) == text
    # Sentencepiece decoding drops the space of a decode's first token; specials are skipped.
    spm = load_tokenizer(_sentencepiece_gguf(tmp_path / "spm.gguf"))
    ids = spm.encode("hello 🦙 the cat<|user|> sat ñ on the mat")
    ids[3:3] = [spm.eos_token_id]
    for seed in range(3):
        det, deltas = _stream(spm, ids, seed=seed)
        assert "".join(deltas) == spm.decode(ids)
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_partial_characters(tok):
    ids = tok.encode("🦙")
    assert len(ids) > 1  # the llama emoji is several byte tokens in this vocabulary
    det = IncrementalDetokenizer(tok)
    assert [det.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert det.add(ids[-1:]) == "🦙"


def test_fingerprint_stable_across_processes_and_sensitive(tok, tmp_path):
    code = "from prefixcache.tokenizer.tokenizer import load_tokenizer; print(load_tokenizer().fingerprint())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == tok.fingerprint()
    assert len(tok.fingerprint()) == 64
    same = load_tokenizer(_save_hf_dir(tok, tmp_path / "same"))
    assert same.fingerprint() == tok.fingerprint()
    data = json.loads(tok.backend.to_str())
    vocab = data["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == n) for n in (1000, 1001))
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids trade places
    changed = tmp_path / "changed"
    _save_hf_dir(tok, changed)
    (changed / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    assert load_tokenizer(changed).fingerprint() != tok.fingerprint()
    other_template = load_tokenizer(_save_hf_dir(tok, tmp_path / "tpl", chat_template="{{ 1 }}"))
    assert other_template.fingerprint() != tok.fingerprint()


def test_bad_paths_name_the_path(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(ModelNotFoundError, match="nope"):
        load_tokenizer(missing)
    empty = tmp_path / "emptydir"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="emptydir"):
        load_tokenizer(empty)
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="emptydir"):
        load_tokenizer(empty)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="weights.bin"):
        load_tokenizer(not_gguf)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelNotFoundError, match="corrupt.gguf"):
        load_tokenizer(corrupt)
