"""Request-log lines → prompts: the input formats `prefixcache analyze` accepts.

One JSON object per line, in any of these shapes (detected per line, so a log may mix them):

- the server's own log (``request_log.py``): ``block_hashes`` (hex cache keys) and
  ``num_prompt_tokens``; ``prompt_token_ids`` too when it was written with text;
- an OpenAI request body: ``prompt`` (a string, a list of strings, a list of token ids or a
  list of such lists: one request each) or ``messages`` (chat), optional ``model``, ``user``;
  the body may sit under ``"body"`` as in OpenAI batch files;
- any object with ``prompt_token_ids``: already tokenized, no tokenizer needed.

The timestamp is read from ``time``, ``timestamp``, ``created``, ``ts`` or ``arrival_time``
(epoch seconds or an ISO 8601 string). The namespace (prefix-cache isolation) is
``namespace``, else ``tenant``, else ``user``.

A line that cannot be read raises :class:`MalformedLine` whose message is the short reason the
report counts it under; nothing here is fatal to the analysis.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime

import numpy as np

_TIME_KEYS = ("time", "timestamp", "created", "ts", "arrival_time", "request_time")
_TOKEN_KEY = b'"prompt_token_ids"'
_MAX_TOKEN_ID = 2**32 - 1  # the hash chain encodes ids as uint32


class MalformedLine(ValueError):
    """A log line that is not a usable request; ``str(e)`` is the reason shown in the report."""


@dataclass
class Prompt:
    """One request's prompt as found in the log, before tokenization.

    Exactly one of ``token_ids`` (or ``token_array``), ``block_hashes``, ``text``, ``messages``
    is what the analysis uses, in that order of preference (token ids can be re-blocked at any block size; hashes
    are taken as they are).
    """

    time: float | None = None
    namespace: str | None = None
    token_ids: list[int] | None = None
    token_array: np.ndarray | None = None  # the ids instead, when parsed as an array
    block_hashes: list[bytes] | None = None
    num_prompt_tokens: int | None = None  # given with block_hashes
    log_block_size: int | None = None  # block size the logged hashes were made with
    text: str | None = None
    messages: list[dict] | None = None


def parse_line(line: bytes | str) -> list[Prompt]:
    """The prompts of one log line (usually one; a batched ``prompt`` list gives several)."""
    if isinstance(line, str):
        line = line.encode("utf-8")
    line = line.strip()
    if not line:
        return []
    token_ids, rest = _split_token_array(line) if _TOKEN_KEY in line else (None, line)
    obj = _load(rest)
    if token_ids is not None:
        if isinstance(obj, dict) and obj.get("prompt_token_ids") == []:
            obj["prompt_token_ids"] = token_ids
        else:  # the fast path cut something it should not have: parse the line as it is
            obj = _load(line)
    if not isinstance(obj, dict):
        raise MalformedLine("not a JSON object")
    return _prompts_from_object(obj)


def _load(line: bytes) -> object:
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MalformedLine("invalid JSON") from e


def _prompts_from_object(obj: dict) -> list[Prompt]:
    body = obj.get("body")
    if isinstance(body, dict) and not any(k in obj for k in ("prompt", "messages")):
        obj = {**body, **{k: v for k, v in obj.items() if k != "body"}}
    base = Prompt(time=_timestamp(obj), namespace=_namespace(obj))

    if obj.get("prompt_token_ids") is not None:
        ids = obj["prompt_token_ids"]
        if isinstance(ids, np.ndarray):  # the fast path: ids stay an array until needed
            _check_range(ids)
            base.token_array = ids
        else:
            base.token_ids = _token_list(ids)
        return [base]
    if obj.get("block_hashes") is not None:
        return [_hashed(obj, base)]
    if obj.get("messages") is not None:
        base.messages = _messages(obj["messages"])
        return [base]
    if obj.get("prompt") is not None:
        return _from_prompt(obj["prompt"], base)
    if isinstance(obj.get("text"), str):
        base.text = obj["text"]
        return [base]
    raise MalformedLine("no prompt, messages, prompt_token_ids or block_hashes")


def _from_prompt(prompt: object, base: Prompt) -> list[Prompt]:
    if isinstance(prompt, str):
        return [_replace(base, text=prompt)]
    if isinstance(prompt, list):
        if not prompt:
            raise MalformedLine("empty prompt")
        if all(isinstance(p, str) for p in prompt):
            return [_replace(base, text=p) for p in prompt]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [_replace(base, token_ids=_token_list(prompt))]
        if all(isinstance(p, list) for p in prompt):
            return [_replace(base, token_ids=_token_list(p)) for p in prompt]
    raise MalformedLine("prompt is not a string, token list or list of them")


def _replace(base: Prompt, **kw: object) -> Prompt:
    p = Prompt(**base.__dict__)
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def _hashed(obj: dict, base: Prompt) -> Prompt:
    hashes = obj["block_hashes"]
    if not isinstance(hashes, list):
        raise MalformedLine("block_hashes is not a list")
    try:
        base.block_hashes = [bytes.fromhex(h) for h in hashes]
    except (TypeError, ValueError) as e:
        raise MalformedLine("block hash is not hex") from e
    if any(len(h) != len(base.block_hashes[0]) or not h for h in base.block_hashes):
        raise MalformedLine("block hashes of unequal length")
    n = obj.get("num_prompt_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise MalformedLine("block_hashes without num_prompt_tokens")
    bs = obj.get("block_size")
    if bs is not None and (not isinstance(bs, int) or bs < 1):
        raise MalformedLine("bad block_size")
    if bs is not None and len(hashes) * bs > n:
        raise MalformedLine("more block hashes than num_prompt_tokens allows")
    base.num_prompt_tokens = n
    base.log_block_size = bs
    return base


def _messages(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise MalformedLine("messages is not a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise MalformedLine("message without a role")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        elif not isinstance(content, str):
            raise MalformedLine("message content is not a string or a list of parts")
        out.append({**m, "content": content})
    return out


def _token_list(ids: object) -> list[int]:
    if not isinstance(ids, list):
        raise MalformedLine("prompt_token_ids is not a list")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= _MAX_TOKEN_ID:
            raise MalformedLine("token id is not an integer in [0, 2**32)")
    return ids


def _check_range(ids: np.ndarray) -> None:
    if ids.size and (ids.min() < 0 or ids.max() > _MAX_TOKEN_ID):
        raise MalformedLine("token id is not an integer in [0, 2**32)")


def _split_token_array(line: bytes) -> tuple[np.ndarray | None, bytes]:
    """Fast path for the dominant cost: parse ``"prompt_token_ids": [..]`` with numpy.

    ``json.loads`` of a 2,000-int list costs ~3x numpy's text parser. The array is cut out, the
    rest of the line is parsed by ``json`` with ``[]`` left in its place. Any doubt (nested key,
    non-integer items) returns ``None`` and the line unchanged: the slow path then decides.
    """
    k = line.find(_TOKEN_KEY)
    i = k + len(_TOKEN_KEY)
    while i < len(line) and line[i] in b" \t":
        i += 1
    if i >= len(line) or line[i] != ord(":"):
        return None, line
    a = line.find(b"[", i)
    if a < 0 or line[i + 1 : a].strip():
        return None, line
    b = line.find(b"]", a)
    if b < 0:
        return None, line
    body = line[a + 1 : b]
    if not body.strip():
        arr = np.zeros(0, dtype=np.int64)
    else:
        if any(c in body for c in (b".", b"e", b"E", b"[", b'"', b"n", b"t", b"f")):
            return None, line
        arr = np.fromstring(body, dtype=np.int64, sep=",")  # text mode: not deprecated
        if arr.size != body.count(b",") + 1:
            return None, line
    return arr, line[:a] + b"[]" + line[b + 1 :]


def _timestamp(obj: dict) -> float | None:
    for key in _TIME_KEYS:
        v = obj.get(key)
        if v is None:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
        if isinstance(v, str):
            try:
                return datetime.fromisoformat(v).timestamp()  # 3.11 reads "Z"
            except ValueError:
                try:
                    return float(v)
                except ValueError:
                    continue
    return None


def _namespace(obj: dict) -> str | None:
    for key in ("namespace", "tenant", "user"):
        v = obj.get(key)
        if isinstance(v, str) and v:
            return v
    return None
