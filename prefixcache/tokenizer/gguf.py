"""GGUF tokenizer metadata -> a ``tokenizers`` pipeline (used by ``tokenizer.py``).

Parity contract: for a GGUF file the ids are those of transformers'
``AutoTokenizer.from_pretrained(dir, gguf_file=name)``, not llama.cpp's (the two disagree on some
whitespace runs). transformers turns the GGUF metadata into a ``tokenizers`` pipeline; this module
builds the same pipeline itself, so transformers is needed only by the tests:

    gpt2 (byte-level BPE): vocab respelled into the byte alphabet, the file's merges,
        pre-tokenizer = Split(regex of tokenizer.ggml.pre, when known) + ByteLevel, or plain
        ByteLevel (GPT-2 regex) otherwise; decoder ByteLevel.
    llama (sentencepiece BPE): vocab as spelled, merges from the file or rebuilt from the scores,
        byte fallback; Metaspace(prepend "first") or, for phi3, a normalizer that prepends;
        decoder Replace + ByteFallback + Fuse + Strip(1 leading space).
    llama with architecture gemma3 (transformers' GemmaTokenizer): space-run tokens respelled
        with "▁", merges rebuilt in vocabulary order (not by score), byte fallback, a
        normalizer " " -> "▁" and no prefix space at all; decoder Replace + ByteFallback +
        Fuse, nothing stripped. No template in the file: Gemma 3's turn format is built in.
    added tokens: CONTROL tokens as special, USER_DEFINED as plain added tokens, then the named
        bos/eos/unk/pad tokens as special where not added yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from prefixcache.model.paths import open_gguf

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL = 3
_USER_DEFINED = 4

# How a BPE family splits text before merging, by tokenizer.ggml.pre (as transformers maps them).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CASED_LETTERS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{suffix}"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{suffix}"
)
_TEKKEN_SPLIT = (
    _CASED_LETTERS.replace("{suffix}", "")
    + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    _CASED_LETTERS.replace("{suffix}", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?")
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable bytes stand for themselves,
    the rest take the code points from U+0100 upward in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {b: chr(b) for b in keep}
    for n, b in enumerate(b for b in range(256) if b not in spelling):
        spelling[b] = chr(0x100 + n)
    return spelling


_BYTE_SPELLING = _byte_alphabet()
_BYTE_CHARS = frozenset(_BYTE_SPELLING.values())


@dataclass(frozen=True)
class GGUFTokenizer:
    """What a GGUF file says about its tokenizer; ids are the file's."""

    backend: Backend
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    extra_stop_token_ids: list[int]
    unmatched_special_tokens: dict[str, int]


def _read_gguf_tokenizer_metadata(path: Path, reader=None) -> dict[str, Any]:
    reader = reader if reader is not None else open_gguf(path)
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.") or key == "general.architecture"
    }


def _rebuild_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges a sentencepiece vocabulary implies: every split of a token into two vocabulary
    tokens, best score first; ties broken by the pieces' lengths, then by vocabulary order."""
    index = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, scores, strict=False))
    found: list[tuple[float, int, int, str, str]] = []
    for token, token_score in score.items():
        pairs = [
            (token[:k], token[k:]) for k in range(1, len(token))
            if token[:k] in index and token[k:] in index
        ]
        pairs.sort(key=lambda p: (index[p[0]], index[p[1]]))
        found.extend((token_score, len(a), len(b), a, b) for a, b in pairs)
    # A stable sort on the negated key keeps vocabulary order within ties.
    found.sort(key=lambda m: (-m[0], -m[1], -m[2]))
    return [(a, b) for _, _, _, a, b in found]


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    if "tokenizer.ggml.merges" in meta:
        return [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tokens = meta["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.scores" not in meta:
        raise ValueError("GGUF tokenizer has neither merges nor scores")
    return _rebuild_merges(tokens, meta["tokenizer.ggml.scores"])


def _byte_level_backend(meta: dict[str, Any]) -> Backend:
    vocab: dict[str, int] = {}
    for i, token in enumerate(meta["tokenizer.ggml.tokens"]):
        # Some files store a token as its text; the BPE vocabulary spells it in the byte alphabet.
        if not set(token) <= _BYTE_CHARS:
            token = "".join(_BYTE_SPELLING[b] for b in token.encode("utf-8"))
        vocab[token] = i
    backend = Backend(BPE(vocab=vocab, merges=_merges(meta), dropout=None,
                           continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(meta: dict[str, Any]) -> Backend:
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    backend = Backend(BPE(vocab=vocab, merges=_merges(meta), fuse_unk=True, byte_fallback=True,
                           dropout=None))
    if meta.get("general.architecture") == "phi3":
        # Phi-3 prepends its space in a normalizer: "  hi" -> "▁▁▁hi", where Metaspace gives "▁▁hi".
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first", split=False
        )
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0),
    ])
    return backend


# GemmaTokenizer's own bos/eos/unk/pad/mask defaults, which transformers adds as special tokens
# before the file's (all of them CONTROL tokens of a Gemma 3 file anyway). Gemma's vocabulary
# also holds "<s>" and "</s>" as ordinary text tokens, so Llama's defaults must not apply here.
_GEMMA_DEFAULT_SPECIALS = ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>")


def _gemma_tokens(tokens: Sequence[str]) -> list[str]:
    """Gemma files store a token of two or more spaces as real spaces ("  "), where the
    pipeline (whose normalizer turns every space into "▁") looks it up as "▁▁": the BPE
    vocabulary, and the merges rebuilt from it, spell such tokens with "▁", one per character.
    The test is transformers': whitespace-only with a space. Only the BPE model sees this
    spelling; the added tokens are picked from the file's (``_add_gguf_special_tokens``), where
    "  " is no vocabulary key, so these USER_DEFINED tokens are not added: BPE matches them."""
    return ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]


def _gemma_backend(meta: dict[str, Any]) -> Backend:
    """Gemma 3's sentencepiece BPE as transformers' GemmaTokenizer builds it from a GGUF file.

    Differences from ``_sentencepiece_backend`` (Llama's):
      * space-run tokens respelled (``_gemma_tokens``).
      * merges: Gemma files have none (one that had would be used), and Gemma's scores do not
        follow its merge order, the order of the vocabulary does: the merges are rebuilt with
        score = -position.
      * no prefix space: Gemma never prepends "▁" (the file says add_space_prefix False), so
        there is no Metaspace; a normalizer writes each space as "▁" instead, and the decoder
        strips nothing ("Hello" and " Hello" round-trip as written).
      * unk_token "<unk>" on the model (never produced with byte fallback, kept for parity).
    transformers' pre-tokenizer Split(" ", merged_with_previous) is kept too, although it sees
    only normalized text (no spaces left) and splits nothing: the pipeline is then theirs.
    """
    tokens = _gemma_tokens(meta["tokenizer.ggml.tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = (_merges(meta) if "tokenizer.ggml.merges" in meta
              else _rebuild_merges(tokens, range(0, -len(tokens), -1)))
    backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                           dropout=None, unk_token="<unk>" if "<unk>" in vocab else None))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


# Gemma 3's turn format. Its GGUF files carry no template (the model's tokenizer_config.json
# has it), so it is built in; it lives in this module, not tokenizer/chat.py, because this
# module's source is part of the weights cache key (weights_cache.py), which stores the
# template. It renders as the official template does: BOS, then each message as
# "<start_of_turn>{role}\n{content | trim}<end_of_turn>\n" with "assistant" written "model";
# a leading system message is no turn of its own: its text (untrimmed) and "\n\n" open the
# first turn; roles must alternate user / assistant; list content renders its text parts
# (trimmed) and an image part as "<start_of_image>". The generation prompt opens a model turn.
# "<end_of_turn>" in the template makes that token a stop token (Tokenizer.stop_token_ids).
_GEMMA3_CHAT_TEMPLATE = r"""
{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set system = messages[0]['content'] -%}
    {%- set opening = (system if system is string else system[0]['text']) + '\n\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set opening = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
    {%- endif -%}
    {{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) -}}
    {{- '\n' + (opening if loop.first else '') -}}
    {%- set content = message['content'] -%}
    {%- if content is string -%}
        {{- content | trim -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part['type'] == 'image' -%}
                {{- '<start_of_image>' -}}
            {%- elif part['type'] == 'text' -%}
                {{- part['text'] | trim -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('Invalid content type') -}}
    {%- endif -%}
    {{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""


def _add_gguf_special_tokens(backend: Backend, meta: dict[str, Any], named: list[str]) -> None:
    """Added tokens in transformers' order; the order and the flags decide the ids of tokens
    not in the vocabulary and which ids ``skip_special_tokens`` drops."""
    tokens = meta["tokenizer.ggml.tokens"]
    byte_level = meta["tokenizer.ggml.model"] == "gpt2"
    # transformers first builds a GPT2Tokenizer / LlamaTokenizer / GemmaTokenizer, whose default
    # bos, eos and unk (Gemma: and pad, mask) tokens become special tokens; a token once added
    # as special stays skipped on decode when a later step re-adds it as a plain token (Phi-3's
    # "</s>").
    # Deliberate difference: transformers also adds such a token, or a named special token whose
    # text is no vocabulary key, under a NEW id past the model's vocabulary (Llama 3 gains
    # "<|endoftext|>" at 128256, DeepSeek's BOS text gets 32257 instead of 32013). An id the
    # embedding table lacks would crash the model, so here no token ever gets a new id: a class
    # default is then plain text, and a named token keeps the file's id (Tokenizer matches it).
    if byte_level:
        defaults = ["<|endoftext|>"]
    elif meta.get("general.architecture") == "gemma3":
        defaults = list(_GEMMA_DEFAULT_SPECIALS)
    else:
        defaults = ["<s>", "</s>", "<unk>"]
    backend.add_special_tokens(
        [AddedToken(t, special=True) for t in defaults if backend.token_to_id(t) is not None]
    )
    types = meta.get("tokenizer.ggml.token_type") or ()
    # A byte-level "control" token spelled outside the byte alphabet is a llama.cpp mislabel;
    # adding it would grow the vocabulary past the model's, so it is left out.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL and (not byte_level or set(t) <= _BYTE_CHARS)
    ]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=True)
    backend.add_tokens([
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _USER_DEFINED and t in vocab
    ])
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    for token in named:
        if token not in added and backend.token_to_id(token) is not None:
            backend.add_special_tokens([AddedToken(token, special=True)])
            added.add(token)


def read_gguf_tokenizer(path: Path, reader=None) -> GGUFTokenizer:
    """The tokenizer a GGUF file describes, as transformers would build it (see module doc).
    ``reader``: the file's ``gguf.GGUFReader`` when the caller already opened one."""
    meta = _read_gguf_tokenizer_metadata(path, reader)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"GGUF file has no tokenizer metadata: {path}")
    architecture = meta.get("general.architecture")
    gemma3 = kind == "llama" and architecture == "gemma3"  # not a gemma3 file with another vocab
    if kind == "gpt2":
        backend = _byte_level_backend(meta)
    elif gemma3:
        backend = _gemma_backend(meta)
    elif kind == "llama" and architecture not in ("gemma", "gemma2"):
        backend = _sentencepiece_backend(meta)
    else:
        # Gemma 1 and 2 files would take the Gemma 3 pipeline in transformers too, but none
        # has been checked against it here.
        raise ValueError(
            f"unsupported GGUF tokenizer {kind!r} (architecture {architecture!r}) in {path}; "
            "supported: 'gpt2' (byte-level BPE) and 'llama' (sentencepiece BPE; of the Gemma "
            "family, gemma3 only)"
        )
    tokens = meta["tokenizer.ggml.tokens"]

    def special_id(name: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    ids = {n: special_id(k) for n, k in
           (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    _add_gguf_special_tokens(backend, meta, [tokens[i] for i in ids.values() if i is not None])
    # A named token whose text the backend cannot match (a byte-level file that stores it
    # unspelled, like DeepSeek's "<｜begin▁of▁sentence｜>") is matched by Tokenizer itself.
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    unmatched = {tokens[i]: i for i in ids.values() if i is not None and tokens[i] not in added}
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = kind == "llama"  # llama.cpp's default for a sentencepiece vocabulary
    extra_stops = [special_id(k) for k in ("eot", "eom")]
    template = meta.get("tokenizer.chat_template")
    if template is None and gemma3:
        template = _GEMMA3_CHAT_TEMPLATE
    return GGUFTokenizer(
        backend=backend, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
        unk_token_id=ids["unk"], pad_token_id=ids["pad"], add_bos_token=bool(add_bos),
        chat_template=template, extra_stop_token_ids=[i for i in extra_stops if i is not None],
        unmatched_special_tokens=unmatched,
    )
