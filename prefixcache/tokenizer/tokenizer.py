"""Text <-> token ids: loaded from GGUF metadata or a Hugging Face directory, chat templates,
document merging and streaming detokenization.

    tok = load_tokenizer(None)              # the default model; or a .gguf file, or a HF dir
    ids = tok.encode_chat(messages)         # prompt ids, documents merged into the system prefix
    det = IncrementalDetokenizer(tok, ids)  # det.add(new_ids) -> text delta while generating

For a GGUF file the ids are those of transformers' ``AutoTokenizer.from_pretrained(dir,
gguf_file=name)`` (``tokenizer/gguf.py`` rebuilds its pipeline), not llama.cpp's; for a
directory, those of its ``tokenizer.json``. Special tokens are never added by the backend: ``encode`` prepends BOS itself when asked and the
model says ``add_bos_token``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from prefixcache.model.paths import ModelNotFoundError, resolve_model_path
from prefixcache.tokenizer.chat import compile_template, merge_documents, plain_message
from prefixcache.tokenizer.gguf import GGUFTokenizer, read_gguf_tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "load_tokenizer", "merge_documents"]

# Tokens that end an assistant turn; each is a stop token when the chat template writes it.
_END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>",
)


# ---------------------------------------------------------------------------------------------
# Loading a GGUF file or a Hugging Face directory


def tokenizer_from_gguf_spec(spec: GGUFTokenizer, source: str) -> Tokenizer:
    """The Tokenizer of what a GGUF file says (``read_gguf_tokenizer``); the weights cache
    (``weights_cache.py``) keeps the spec and builds the Tokenizer through here too."""
    return Tokenizer(
        spec.backend, bos_token_id=spec.bos_token_id, eos_token_id=spec.eos_token_id,
        unk_token_id=spec.unk_token_id, pad_token_id=spec.pad_token_id,
        add_bos_token=spec.add_bos_token, chat_template=spec.chat_template,
        extra_stop_token_ids=spec.extra_stop_token_ids, source=source,
        unmatched_special_tokens=spec.unmatched_special_tokens,
    )


def _tokenizer_from_gguf(path: Path) -> Tokenizer:
    return tokenizer_from_gguf_spec(read_gguf_tokenizer(path), str(path))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _template_from_config(directory: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _read_json(directory / "chat_template.json").get("chat_template")
    return template


def _tokenizer_from_hf_dir(directory: Path) -> Tokenizer:
    try:
        backend = _Backend.from_file(str(directory / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ModelNotFoundError(f"cannot load {directory / 'tokenizer.json'}: {exc}") from exc
    backend.no_truncation()
    backend.no_padding()
    config = _read_json(directory / "tokenizer_config.json")
    model_config = _read_json(directory / "config.json")
    generation = _read_json(directory / "generation_config.json")
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    for entry in (config.get("added_tokens_decoder") or {}).values():
        if entry.get("content") and entry["content"] not in present:
            backend.add_tokens([AddedToken(
                entry["content"], special=bool(entry.get("special")),
                normalized=bool(entry.get("normalized", not entry.get("special"))),
                lstrip=bool(entry.get("lstrip")), rstrip=bool(entry.get("rstrip")),
                single_word=bool(entry.get("single_word")),
            )])

    def named_id(name: str) -> int | None:
        token = _token_content(config.get(f"{name}_token"))
        if token is not None and backend.token_to_id(token) is not None:
            return backend.token_to_id(token)
        ids = _id_list(generation.get(f"{name}_token_id")) or _id_list(
            model_config.get(f"{name}_token_id"))
        return ids[0] if ids else None

    bos = named_id("bos")
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # Llama 3 style: the tokenizer.json post-processor writes BOS
        probe = backend.encode("a", add_special_tokens=True).ids
        add_bos = bos is not None and len(probe) > 1 and probe[0] == bos
    extra = _id_list(generation.get("eos_token_id")) + _id_list(model_config.get("eos_token_id"))
    return Tokenizer(
        backend, bos_token_id=bos, eos_token_id=named_id("eos"), unk_token_id=named_id("unk"),
        pad_token_id=named_id("pad"), add_bos_token=bool(add_bos),
        chat_template=_template_from_config(directory, config), extra_stop_token_ids=extra,
        source=str(directory),
    )


# ---------------------------------------------------------------------------------------------
# Tokenizer


class Tokenizer:
    """A loaded tokenizer. Immutable after construction; use :func:`load_tokenizer`."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        extra_stop_token_ids: Iterable[int] = (),
        source: str = "",
        unmatched_special_tokens: Mapping[str, int] | None = None,
    ) -> None:
        if eos_token_id is None:
            raise ValueError(f"tokenizer from {source or 'memory'} names no EOS token")
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = int(eos_token_id)
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = bool(add_bos_token) and bos_token_id is not None
        self.chat_template = chat_template
        self.source = source
        # One past the highest id, added tokens included: the rows an embedding table needs.
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        stops = {self.eos_token_id, *(int(i) for i in extra_stop_token_ids)}
        for token in _END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(token)
            if token_id is not None and chat_template and token in chat_template:
                stops.add(token_id)
        self.stop_token_ids = frozenset(stops)
        self.special_token_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        # Special tokens the backend does not know as such: split out of text before encoding,
        # skipped on decode. Empty for almost every model.
        self._unmatched = dict(unmatched_special_tokens or {})
        self._unmatched_re = (
            re.compile("|".join(re.escape(t) for t in sorted(self._unmatched, key=len, reverse=True)))
            if self._unmatched else None
        )
        self.special_token_ids |= frozenset(self._unmatched.values())
        self._fingerprint: str | None = None
        self._max_token_chars: int | None = None

    @property
    def max_token_chars(self) -> int:
        """The longest token of the vocabulary, in characters (computed once, ~0.2 s): a text
        of more than ``n`` times this many characters is more than ``n`` tokens, which a length
        check can tell before tokenizing it. Racing first calls compute the same number."""
        if self._max_token_chars is None:
            ids = [[i] for i in self._backend.get_vocab(with_added_tokens=True).values()]
            texts = self._backend.decode_batch(ids, skip_special_tokens=False)
            self._max_token_chars = max(1, max(map(len, texts), default=1))
        return self._max_token_chars

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return _tokenizer_from_gguf(Path(path))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        return _tokenizer_from_hf_dir(Path(path))

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self._token(self.eos_token_id)

    @property
    def backend(self) -> _Backend:
        """The ``tokenizers.Tokenizer`` (do not mutate it: the fingerprint is cached)."""
        return self._backend

    # -- ids ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_start|>``) stay whole.
        ``add_special_tokens`` prepends BOS when the model's config asks for it."""
        if self._unmatched_re is None:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        else:
            ids, start = [], 0
            for match in self._unmatched_re.finditer(text):
                ids += self._backend.encode(text[start:match.start()], add_special_tokens=False).ids
                ids.append(self._unmatched[match.group()])
                start = match.end()
            ids += self._backend.encode(text[start:], add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if skip_special_tokens and self._unmatched:
            skip = set(self._unmatched.values())
            ids = [i for i in ids if i not in skip]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_each(self, ids: Iterable[int], skip_special_tokens: bool = True) -> list[str]:
        """``[decode([i]) for i in ids]`` in one backend call (the text of each id alone)."""
        skip = set(self._unmatched.values()) if skip_special_tokens else set()
        return self._backend.decode_batch(
            [[] if i in skip else [i] for i in ids], skip_special_tokens=skip_special_tokens
        )

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text, rendered as transformers renders it; documents merged first.

        ``kwargs`` reach the template as variables (``enable_thinking=False`` ...);
        ``chat_template=`` renders another template instead of the model's."""
        template = kwargs.pop("chat_template", None) or self.chat_template
        if not template:
            raise ValueError(f"model {self.source!r} has no chat template; pass a plain prompt")
        context = {
            name: self._token(i)
            for name, i in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id),
                            ("unk_token", self.unk_token_id), ("pad_token", self.pad_token_id))
            if i is not None
        }
        context.update(kwargs)
        context.setdefault("documents", None)
        return compile_template(template).render(
            messages=merge_documents(plain_message(m) for m in messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **context,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """The ids of the rendered chat; BOS prepended when the model wants one and the
        template did not write it already."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        **kwargs)
        ids = self.encode(text)
        if self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def leading_system_tokens(self, messages: Sequence[Mapping[str, Any]], ids: Sequence[int]) -> int:
        """How many leading ``ids`` (the rendering of ``messages``) render the leading
        ``system`` messages alone: the longest common prefix of ``ids`` and the rendering of
        those messages without the rest (no generation prompt). Every such token comes from
        them and the template, never from a later message: a token merging across the
        boundary differs, and the count stops before it. 0 when there is none, or when the
        template cannot render them alone."""
        lead = []
        for m in messages:
            if m.get("role") != "system":
                break
            lead.append(m)
        if not lead:
            return 0
        try:
            head = self.encode_chat(lead, add_generation_prompt=False)
        except (ValueError, KeyError, TypeError, jinja2.TemplateError):
            return 0
        n = 0
        for x, y in zip(head, ids):
            if x != y:
                break
            n += 1
        return n

    def encode_chat_segments(self, messages, add_generation_prompt: bool = True, **kwargs):
        """cache_mode="segments": the ids with each document's span (tokenizer/segments.py)."""
        from prefixcache.tokenizer.segments import encode_chat_segments

        return encode_chat_segments(self, messages, add_generation_prompt, **kwargs)

    # -- identity -----------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 over everything that decides ids and prompts: the whole tokenizers pipeline
        (vocab, merges, added tokens, normalizer, pre-tokenizer, decoder), the special ids,
        add_bos and the chat template. Canonical JSON, so stable across processes."""
        if self._fingerprint is None:
            state = {
                "backend": json.loads(self._backend.to_str()),
                "bos": self.bos_token_id, "eos": self.eos_token_id, "unk": self.unk_token_id,
                "pad": self.pad_token_id, "add_bos": self.add_bos_token,
                "stop": sorted(self.stop_token_ids), "chat_template": self.chat_template,
                "unmatched": self._unmatched,
            }
            canonical = json.dumps(state, sort_keys=True, ensure_ascii=False,
                                   separators=(",", ":"))
            self._fingerprint = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
        return self._fingerprint


class IncrementalDetokenizer:
    """Streams the text of generated ids as deltas whose concatenation is their full decode.

    Each step decodes only a short window ``ids[prefix:]`` and compares it with the decode of
    ``ids[prefix:read]``, the text already emitted from that window:

        ids:  ... | prefix ......... read | new ids ...
                    `-- emitted text --'  `-- delta = decode(window)[len(emitted):]

    Both decodes start at the same id, so what a decoder does at the start of a decode
    (sentencepiece drops one leading space) cancels out. A window whose text ends in U+FFFD
    holds back: the ids so far end inside a multi-byte character. Offsets advance only when
    text is emitted, so ``read`` always sits on a character boundary, and the text of
    ``ids[prefix:read]`` is never empty once anything was emitted (the ids since the previous
    emission made text). With a prompt, the window starts a few prompt ids back, so the first
    new token decodes as it reads after the prompt.
    """

    _PROMPT_CONTEXT = 5  # prompt ids decoded ahead of the first new one

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or ())
        self._read = len(self._ids)
        self._prefix = max(self._read - self._PROMPT_CONTEXT, 0)
        self._emitted = self._decode(self._prefix, self._read)
        self.text = ""

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tok.decode(self._ids[start:stop], skip_special_tokens=self._skip)

    def add(self, new_ids: Iterable[int]) -> str:
        """Append ids; return the text they complete (may be empty while a character is open)."""
        self._ids.extend(new_ids)
        window = self._decode(self._prefix)
        if len(window) <= len(self._emitted) or window.endswith("\ufffd"):
            return ""
        return self._emit(window)

    def flush(self) -> str:
        """At the end of a stream: whatever is held back, broken characters included."""
        window = self._decode(self._prefix)
        return self._emit(window) if len(window) > len(self._emitted) else ""

    def _emit(self, window: str) -> str:
        delta = window[len(self._emitted):]
        self.text += delta
        self._prefix, self._emitted = self._read, self._decode(self._read)
        self._read = len(self._ids)
        return delta


# ---------------------------------------------------------------------------------------------
# Loading


_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
             "chat_template.jinja", "chat_template.json")


@lru_cache(maxsize=8)
def _load_cached(path: str, stamp: tuple) -> Tokenizer:
    del stamp  # only part of the cache key: a rewritten file loads afresh
    p = Path(path)
    return _tokenizer_from_hf_dir(p) if p.is_dir() else _tokenizer_from_gguf(p)


def _stamp(path: Path) -> tuple:
    files = [path / name for name in _HF_FILES] if path.is_dir() else [path]
    return tuple(
        (f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files if f.is_file()
    )


def load_tokenizer(model: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file or a Hugging Face directory; ``None`` = the default model.

    A directory needs ``tokenizer.json`` (``config.json`` is not required for the tokenizer
    alone). Loads are cached per process by path and modification time.
    """
    path = Path(model).expanduser() if model is not None else None
    if path is None or not (path.is_dir() and (path / "tokenizer.json").is_file()):
        path = resolve_model_path(model)
        if path.is_dir() and not (path / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"model directory has no tokenizer.json: {path}")
    path = path.resolve()
    return _load_cached(str(path), _stamp(path))
