"""Prompts → token ids and role spans, with the model's tokenizer and chat template.

Role spans come from rendering the chat template incrementally: the tokens that
``messages[:i + 1]`` adds over ``messages[:i]`` (both without the generation prompt) belong to
message ``i`` (its content plus the template's markup around it), so the spans tile the prompt
and match what the server prefills. Tokens after the last message (the generation prompt) are
counted as ``template``. Documents (role ``document``) are counted as such although the template
merges them into the system message.
This costs one template rendering per message, which is fine for a log analysis; a prompt
given as token ids or hashes has no roles and counts as ``unknown``.

The tokenizer is imported lazily: a log of token ids or block hashes needs none.
"""

from __future__ import annotations

from typing import Any, Protocol

# (role, start, end) token spans; a plain-text prompt is one "prompt" span.
Span = tuple[str, int, int]


class ChatTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]: ...


def load_tokenizer(path: str | None) -> Any:
    """``prefixcache.tokenizer.tokenizer.load_tokenizer``; ``None`` = the default model's."""
    from prefixcache.tokenizer.tokenizer import load_tokenizer as _load

    return _load(path)


def encode_text(tok: ChatTokenizer, text: str) -> tuple[list[int], list[Span]]:
    ids = list(tok.encode(text))
    return ids, [("prompt", 0, len(ids))]


def encode_messages(tok: ChatTokenizer, messages: list[dict]) -> tuple[list[int], list[Span]]:
    """Token ids of the rendered chat (with the generation prompt) and each message's span."""
    # The template moves documents into the system message (``merge_documents``); putting them
    # right after it here renders the same text and keeps each prefix a prefix of the next.
    messages = _documents_first(messages)
    ids = list(tok.encode_chat(messages))
    spans: list[Span] = []
    start = 0
    for i, m in enumerate(messages):
        end = len(tok.encode_chat(messages[: i + 1], add_generation_prompt=False))
        end = max(start, min(len(ids), end))
        spans.append((_role(m), start, end))
        start = end
    if start < len(ids):
        spans.append(("template", start, len(ids)))
    return ids, spans


def _documents_first(messages: list[dict]) -> list[dict]:
    docs = [m for m in messages if m.get("role") == "document"]
    if not docs:
        return messages
    rest = [m for m in messages if m.get("role") != "document"]
    k = 1 if rest and rest[0].get("role") == "system" else 0
    return rest[:k] + docs + rest[k:]


def _role(message: dict) -> str:
    role = str(message.get("role", "unknown"))
    return "tool" if role == "function" else role
