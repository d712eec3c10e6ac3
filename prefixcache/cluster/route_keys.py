"""The block-key chain of a request, computed by the ingress exactly as the engine will.

The router matches these keys against what each replica has been sent, so they must be the
engine's own (docs/design.md "Cache keys"): the same token ids (tokenizer, chat template with
documents merged, BOS rule), the same namespace (the tenant of the API key and ``cache_salt``,
derived by the same ``TenantDirectory``; with a shared salt the same declared shared prefix as
the server's (server/openai/prompt.py, server/cache/routes.py): a chat's leading system
messages, an admin's whole warmed prompt, nothing of a raw prompt), the same model
fingerprint and block size (asked from a replica once). Anything that fails here (no JSON, an
unknown key, a bad message) gives no keys: the request is routed by load, and the replica
answers it with the proper 4xx.

A ``prompt_cache_key`` (OpenAI's field) puts one more key in front of the chain: a digest of
the key and the request's own namespace root. Requests of one tenant with one key then share
a leading key and go to one replica (the router follows the longest matched run), while the
same prompt under another key, or of another tenant, starts elsewhere; the namespace, and so
what a request may hit on that replica, is unchanged. Anthropic's ``/v1/messages`` is rendered
as its replica will (server/anthropic/prompt.py), its breakpoints declaring the shared prefix
under a shared salt (server/anthropic/cache_breakpoints.py).

Length: the ingress is one process in front of every replica, so it tokenizes nothing a replica
would refuse unread. A text longer than ``max_tokens`` (the replicas' context length) times
the vocabulary's longest token in characters cannot fit (the replica's own check,
server/base/serving.py), so it gets no keys, untokenized; a text that may fit is tokenized
once, as the replica will.
"""

from __future__ import annotations

import json

from prefixcache.cache.hashing import hash_blocks, hash_blocks_after_shared, key_hash, root_hash
from prefixcache.server.anthropic.cache_breakpoints import shared_tokens
from prefixcache.server.anthropic.prompt import MessagesRenderer, text_chars
from prefixcache.server.anthropic.protocol import MessagesRequest
from prefixcache.server.base.auth import TenantDirectory
from prefixcache.server.edge.body import check_containers
from prefixcache.server.edge.limits import ServerLimits
from prefixcache.server.openai.protocol import ChatMessage, template_text_chars
from prefixcache.tokenizer.tokenizer import Tokenizer

# The routes whose body names a prompt; everything else is routed by load alone.
PROMPT_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/cache/warm", "/v1/cache/lookup",
                 "/v1/messages")  # fmt: skip
AFFINITY_TAG = b"prefixcache/prompt-cache-key"


def affinity_key(own_root: bytes, prompt_cache_key: str) -> bytes:
    """The routing key of a ``prompt_cache_key`` in a namespace (whose root it is salted with)."""
    return key_hash(AFFINITY_TAG + own_root + prompt_cache_key.encode("utf-8"))


class RouteKeys:
    def __init__(
        self,
        tokenizer: Tokenizer,
        tenants: TenantDirectory,
        fingerprint: str,
        block_size: int,
        max_tokens: int = 32768,
        limits: ServerLimits | None = None,
    ) -> None:
        self.tokenizer, self.tenants = tokenizer, tenants
        self.limits = limits or ServerLimits()
        self.fingerprint, self.block_size, self.max_tokens = fingerprint, block_size, max_tokens
        self.messages = MessagesRenderer(tokenizer)

    def _fits(self, num_chars: int) -> bool:
        return num_chars <= self.max_tokens or num_chars <= self.max_tokens * self.tokenizer.max_token_chars

    def messages_prompt(self, body: dict, shared_salt: bool) -> tuple[list[int] | None, int]:
        """A Messages request's ids and, under a shared salt, the tokens it declares shared,
        as its replica will (cache_breakpoints.shared_tokens; no ids: too long)."""
        req = MessagesRequest.model_validate(body)
        if not self._fits(text_chars(req)):
            return None, 0
        p = self.messages.prompt(req, system_prefix=shared_salt)
        return p.ids, shared_tokens(p) if shared_salt else 0

    def token_ids(self, path: str, body: dict) -> list[int] | None:
        messages = body.get("messages")
        if path == "/v1/chat/completions" or (messages is not None and path in PROMPT_ROUTES[2:]):
            dicts = [ChatMessage.model_validate(m).as_template_dict() for m in messages]
            chars = template_text_chars(dicts)
            if not self._fits(chars):
                return None
            add = body.get("add_generation_prompt", True)
            return list(self.tokenizer.encode_chat(dicts, add_generation_prompt=bool(add)))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # several prompts: route on the first
        if isinstance(prompt, str):
            if not self._fits(len(prompt)):
                return None
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return None

    def keys(self, path: str, authorization: str | None, raw_body: bytes) -> list[bytes]:
        """The full blocks' keys of the request's (first) prompt; [] when there is none."""
        if path not in PROMPT_ROUTES:
            return []
        try:
            check_containers(raw_body, self.limits)  # a body the replica refuses unparsed
            body = json.loads(raw_body)
            if not isinstance(body, dict):
                return []
            tenant = self.tenants.authenticate(authorization)
            scope = self.tenants.scope(tenant, body.get("cache_salt"))
            shared = 0
            if path == "/v1/messages":  # with a shared salt, its breakpoints declare it
                ids, shared = self.messages_prompt(body, scope.shared is not None)
            else:
                ids = self.token_ids(path, body)
            if scope.shared is not None and ids and path != "/v1/messages":
                if tenant.admin and path in PROMPT_ROUTES[2:]:
                    shared = len(ids)  # an admin's warm/lookup: the whole prompt is public
                elif body.get("messages") is not None and path != "/v1/completions":
                    dicts = [ChatMessage.model_validate(m).as_template_dict()
                             for m in body["messages"]]  # fmt: skip
                    shared = self.tokenizer.leading_system_tokens(dicts, ids)
        except Exception:  # noqa: BLE001 - any bad input: route by load, the replica says why
            return []
        if not ids:
            return []
        ids = ids[: self.max_tokens]
        bs = self.block_size
        own = root_hash(self.fingerprint, scope.namespace, block_size=bs)
        k = min(shared, len(ids)) // bs
        if not k:
            chain = hash_blocks(ids, bs, own)
        else:
            public = root_hash(self.fingerprint, scope.shared, block_size=bs)
            chain = hash_blocks_after_shared(ids, bs, public, k, own)
        key = body.get("prompt_cache_key")
        if isinstance(key, str) and key:
            return [affinity_key(own, key), *chain]
        return chain
