"""Why did this miss: a request's prompt compared with an earlier response's of the same tenant.

The clients' own fields: Anthropic's ``diagnostics: {"previous_message_id"}`` on
``/v1/messages`` (answered as ``diagnostics.cache_miss_reason``), and on the OpenAI routes
``prompt_cache_options.comparison_response_id`` (the name OpenAI's Responses API uses; answered
as ``prompt_cache_diagnostics``). Each names an earlier response; the answer says where the
two prompts diverge: the token, the message (``message_index``, ``part``: "tools", "system",
"messages.3") and the character in its content (``content_offset``), and whether the *text*
changed there or the *chat template* rendered the same text differently (the tokens diverge
before any text does: another template, tools rendered differently, a generation prompt). When
the prompts do not diverge but less was read than they share, the prefix was evicted.

What is kept, and for whom. A request that opts in (``diagnostics`` present, even with a null
id; ``prompt_cache_options`` present) is remembered under its response id: its token ids, the
text of each part, its model, namespace and ``prompt_cache_key``. Per tenant, in its own
bounded store (``MAX_RESPONSES`` responses, ``MAX_TOKENS`` token ids and ``MAX_CHARS``
characters; the oldest go first), and all tenants together within ``MAX_TOTAL_TOKENS`` and
``MAX_TOTAL_CHARS``: past those, the tenant holding the most gives up its oldest (the rule of
the tiers, cache/shares.py), so however many tenants a keys file names the store stays bounded
and no tenant loses a response to another's while within its share. An id is looked up only among the caller's own responses:
another tenant's id is "not found", exactly as a made-up one, and no answer reads anything but
the caller's two prompts. Comparing renders at most a few prefixes (a binary search over the
parts), in a worker thread.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_RESPONSES = 64
MAX_TOKENS = 1 << 20
MAX_CHARS = 8 << 20
MAX_TOTAL_TOKENS = 8 << 20  # every tenant's together (~32 MiB of ids)
MAX_TOTAL_CHARS = 64 << 20


@dataclass(frozen=True)
class PromptRecord:
    """What a comparison needs of one request. ``parts``: (label, text) in prompt order, a
    message's text led by its role; ``key``: its ``prompt_cache_key``."""

    ids: array
    parts: tuple[tuple[str, str], ...]
    model: str
    namespace: str
    key: str | None = None

    @classmethod
    def of(cls, ids, parts, model: str, namespace: str, key: str | None = None) -> PromptRecord:
        return cls(array("I", ids), tuple(parts), model, namespace, key)

    @property
    def chars(self) -> int:
        return sum(len(t) for _, t in self.parts)


class ResponseStore:
    """Each tenant's remembered prompts, by response id (bounded: see the module)."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_tokens: int = MAX_TOKENS,
                 max_chars: int = MAX_CHARS, max_total_tokens: int = MAX_TOTAL_TOKENS,
                 max_total_chars: int = MAX_TOTAL_CHARS) -> None:  # fmt: skip
        self.max_responses, self.max_tokens, self.max_chars = max_responses, max_tokens, max_chars
        self.max_total_tokens, self.max_total_chars = max_total_tokens, max_total_chars
        self._lock = threading.Lock()
        self._by_tenant: dict[str, OrderedDict[str, PromptRecord]] = {}
        self._held: dict[str, list[int]] = {}  # tenant -> [tokens, chars] it holds
        self.total_tokens = self.total_chars = 0

    def _remove(self, tenant: str, response_id: str | None = None) -> None:
        """Forget one of ``tenant``'s records (default: its oldest)."""
        mine = self._by_tenant[tenant]
        if response_id is None:
            _, old = mine.popitem(last=False)
        else:
            old = mine.pop(response_id)
        held = self._held[tenant]
        held[0] -= len(old.ids)
        held[1] -= old.chars
        self.total_tokens -= len(old.ids)
        self.total_chars -= old.chars
        if not mine:
            del self._by_tenant[tenant], self._held[tenant]

    def put(self, tenant: str, response_id: str, record: PromptRecord) -> None:
        if len(record.ids) > self.max_tokens or record.chars > self.max_chars:
            return  # larger than a tenant's whole store: not kept
        with self._lock:
            if response_id in self._by_tenant.get(tenant, {}):
                self._remove(tenant, response_id)
            mine = self._by_tenant.setdefault(tenant, OrderedDict())
            held = self._held.setdefault(tenant, [0, 0])
            mine[response_id] = record
            held[0] += len(record.ids)
            held[1] += record.chars
            self.total_tokens += len(record.ids)
            self.total_chars += record.chars
            while (len(mine) > self.max_responses or held[0] > self.max_tokens
                   or held[1] > self.max_chars):  # fmt: skip
                self._remove(tenant)
            while self.total_tokens > self.max_total_tokens or self.total_chars > self.max_total_chars:
                # Everyone's together: the tenant holding the most gives up its oldest.
                self._remove(max(self._held, key=lambda t: self._held[t]))

    def get(self, tenant: str, response_id: str) -> PromptRecord | None:
        with self._lock:
            return self._by_tenant.get(tenant, {}).get(response_id)


@dataclass(frozen=True)
class Comparison:
    """Where ``current`` diverges from ``previous``. ``changed``: "model", "cache_salt",
    "prompt_cache_key", "prompt" (see ``cause`` and ``part``) or None (no divergence)."""

    changed: str | None
    diverged_at_token: int  # tokens the two prompts share
    previous_tokens: int
    current_tokens: int
    part: str | None = None  # the first part that differs ("tools", "system", "messages.3")
    message_index: int | None = None
    content_offset: int | None = None  # characters of that part's content that agree
    cause: str | None = None  # "text" or "chat_template"

    def reusable(self, block_size: int) -> int:
        """Prompt tokens the current request could read had nothing been evicted: the shared
        prefix in whole blocks, never its last token (a prompt's last token is computed)."""
        n = min(self.diverged_at_token, self.current_tokens - 1)
        return max(0, n) // block_size * block_size


def compare(previous: PromptRecord, current: PromptRecord,
            render_prefix: Callable[[int], list[int]] | None) -> Comparison:  # fmt: skip
    """``render_prefix(k)``: the current request's first ``k`` parts rendered alone, no
    generation prompt (None: a raw prompt, whose only part is its text)."""
    d = _common(previous.ids, current.ids)
    base = {"diverged_at_token": d, "previous_tokens": len(previous.ids),
            "current_tokens": len(current.ids)}
    if previous.model != current.model:
        return Comparison("model", **base)
    if previous.namespace != current.namespace:
        return Comparison("cache_salt", **base)
    if previous.key != current.key:
        return Comparison("prompt_cache_key", **base)
    if d == len(current.ids) or d == len(previous.ids):
        return Comparison(None, **base)  # one prompt starts with the other
    prev, cur = previous.parts, current.parts
    i = next((j for j, (a, b) in enumerate(zip(prev, cur)) if a != b), min(len(prev), len(cur)))
    if render_prefix is None or not cur:
        return Comparison("prompt", **base, cause="text")
    def start(k: int) -> int:  # where part k begins in the current prompt's tokens
        return _common(render_prefix(k), current.ids) if k else 0

    if i < min(len(prev), len(cur)) or len(prev) > len(cur):
        # A part differs (or the current prompt has fewer): the text changed there, unless
        # the tokens diverged before it begins, where the text is the same.
        if d >= start(i):
            return Comparison("prompt", **base, **_where(cur, prev, i), cause="text")
    elif d >= start(len(prev)):
        return Comparison(None, **base)  # the same parts, then new ones: no divergence
    k = _part_of(d, len(cur), start)
    return Comparison("prompt", **base, **_where(cur, prev, k), cause="chat_template")


def _where(cur, prev, i: int) -> dict:
    label = cur[i][0] if i < len(cur) else prev[i][0]
    a = cur[i][1] if i < len(cur) else ""
    b = prev[i][1] if i < len(prev) else ""
    role_end = a.find("\n") + 1 if label.startswith("messages.") else 0
    index = int(label.split(".")[1]) if label.startswith("messages.") else None
    return {"part": label, "message_index": index,
            "content_offset": max(0, _common(a, b) - role_end)}  # fmt: skip


def _part_of(token: int, num_parts: int, start) -> int:
    """The part token ``token`` of the current prompt falls in (binary search on starts)."""
    lo, hi = 0, num_parts - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if start(mid) <= token:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# -- what each API's answer shows (openai/diagnostics.py, anthropic/diagnostics.py) ------------

_DETAIL = ("diverged_at_token", "part", "message_index", "content_offset", "cause")


def details(c: Comparison) -> dict:
    """Where the prompts diverge, the fields that are known."""
    return {k: getattr(c, k) for k in _DETAIL if getattr(c, k) is not None}
