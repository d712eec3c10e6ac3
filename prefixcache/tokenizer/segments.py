"""Chat prompts for cache_mode="segments": the prompt ids with each document's token span.

The boundary convention (docs/segments.md): the prompt renders as in prefix mode — the system
text, then ``# Documents``, then one section per document — except that

- each document is tokenized on its own, as the text ``"## <title>\\n<content>\\n\\n"``, so its
  ids depend on nothing around it (one BPE pass over the whole prompt could merge tokens across
  a document's edges, and then the same document would tokenize differently in other company);
- a document without a title or name is headed ``## Document`` (prefix mode numbers them
  ``Document N``, which would make a document's tokens depend on its place in the list);
- the text before the first document (template header, system text, ``# Documents``) and after
  the last one (the rest of the conversation) are tokenized as two pieces.

So a segments prompt can differ by a few tokens from the prefix-mode prompt of the same
messages; both are ordinary prompts of ids, and a cold run of the segments ids is the exact
reference for segments mode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.tokenizer.chat import _message_text, plain_message

# Stands for the documents while the template renders; split on afterwards.
_SENTINEL = "\u241ePREFIXCACHE-DOCUMENTS\u241e"


@dataclass(frozen=True)
class SegmentedPrompt:
    token_ids: list[int]
    spans: tuple[tuple[int, int], ...]  # [start, end) of each document, in message order


def document_text(doc: Mapping[str, Any]) -> str:
    title = doc.get("title") or doc.get("name") or "Document"
    return f"## {title}\n{_message_text(doc.get('content'))}\n\n"


def encode_chat_segments(
    tok, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
) -> SegmentedPrompt:
    """``tok``: a ``tokenizer.tokenizer.Tokenizer``. Without documents: the prefix-mode ids, no span."""
    msgs = [plain_message(m) for m in messages]
    docs = [m for m in msgs if m.get("role") == "document"]
    if not docs:
        return SegmentedPrompt(tok.encode_chat(msgs, add_generation_prompt, **kwargs), ())
    if any(_SENTINEL in _message_text(m.get("content")) for m in msgs):
        raise ValueError("a message contains the reserved document marker")
    rest = [m for m in msgs if m.get("role") != "document"]
    block = "# Documents\n\n" + _SENTINEL
    for i, m in enumerate(rest):
        if m.get("role") == "system":
            text = _message_text(m.get("content"))
            rest[i] = {**m, "content": f"{text}\n\n{block}" if text else block}
            break
    else:
        rest.insert(0, {"role": "system", "content": block})
    rendered = tok.apply_chat_template(rest, add_generation_prompt=add_generation_prompt, **kwargs)
    if rendered.count(_SENTINEL) != 1:
        raise ValueError("the chat template did not render the system message exactly once")
    pre, post = rendered.split(_SENTINEL)
    ids = tok.encode(pre)
    if tok.add_bos_token and ids[:1] != [tok.bos_token_id]:
        ids.insert(0, tok.bos_token_id)
    spans = []
    for d in docs:
        start = len(ids)
        ids += tok.encode(document_text(d))
        spans.append((start, len(ids)))
    ids += tok.encode(post)
    return SegmentedPrompt(ids, tuple(spans))
