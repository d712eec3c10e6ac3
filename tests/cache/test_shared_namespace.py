"""Shared namespaces share only what a request declares (request.SharedPrefix, docs/design.md §3
"Shared prefixes"): a chat's leading system messages, an admin's warmed prompt. A tenant's
suffix and output stay in its own namespace, so another tenant with the same shared salt can
neither hit them nor learn them through ``diverged_at`` or ``cached_tokens``; the shared part
is still hit by every tenant, outputs are the same bits cold or warm, and the first block after
the shared prefix has the documented key (the join).

The server tests run the app in this process on a real engine (default model) through httpx's
ASGI transport; the engine tests use the suite's offline engines.
"""

from __future__ import annotations

import asyncio
import random
import struct

import httpx
import pytest
import xxhash
from _helpers import PROSE, shared_default_weights

from prefixcache import LLM, SamplingParams
from prefixcache.api.request import SharedPrefix
from prefixcache.cache.hashing import hash_blocks, hash_blocks_after_shared, join_hash, root_hash
from prefixcache.config import EngineConfig
from prefixcache.engine.async_engine import AsyncEngine
from prefixcache.server.app import create_app
from prefixcache.server.base.auth import Tenant, TenantDirectory

B = 16
KEYS = {"sk-alice": Tenant("alice"), "sk-bob": Tenant("bob"), "sk-ops": Tenant("ops", admin=True)}
SYSTEM = "You are the handbook assistant of the Example company. Answer in one short sentence."


def ids(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(1000, 30000), k=n)


@pytest.fixture(scope="module")
def app():
    config = EngineConfig(kv_cache_memory="32MiB", max_model_len=512, seed=0)
    with shared_default_weights():
        engine = AsyncEngine(config)
    app = create_app(engine, tenants=TenantDirectory(KEYS, shared_namespaces=["public"]))
    yield app
    asyncio.run(engine.shutdown(drain=False))


def serve(app, test) -> None:
    """Run ``test(call)`` against the app on a started engine; ``call(key, path, body)``
    returns the JSON answer (asserting a 200)."""

    async def main():
        await app.state.serving.engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:

            async def call(key: str, path: str, body: dict) -> dict:
                r = await http.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
                return r.json()

            await test(call)

    asyncio.run(main())


def chat_body(user: str, salt: str = "public", **extra) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "cache_salt": salt, "return_cache_info": True, **extra}  # fmt: skip


def cached(r: dict) -> int:
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_learns_nothing_of_anothers_suffix_or_output(app):
    """The attack: with a shared salt, bob replays alice's prompt (and her output) or guesses
    its next token; neither cached_tokens nor diverged_at moves past what bob declared shared.
    Before, the whole request was cached in the shared namespace and diverged_at scanned it."""
    secret = ids(1, 40)  # 2 full blocks + 8

    async def test(call):
        a = await call("sk-alice", "/v1/completions", {
            "prompt": secret, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "cache_salt": "public"})  # fmt: skip
        out = a["choices"][0]["text"]
        assert out
        # Alice's own part is hers: she hits it again, to the last token but one (her third
        # block, the prompt's last 8 tokens and her output's first 8, is reused token-exactly).
        again = await call("sk-alice", "/v1/completions", {
            "prompt": secret, "max_tokens": 1, "cache_salt": "public"})  # fmt: skip
        assert cached(again) == 39
        look = await call("sk-bob", "/v1/cache/lookup", {"prompt": secret, "cache_salt": "public"})
        assert look["num_cached_tokens"] == 0
        # Bob: the same prompt, a guess that shares its first 20 tokens, its first 39 (each
        # after dropping his own part, where his previous guess went).
        for guess in (secret, secret[:20] + ids(2, 20), secret[:39] + [7]):
            await call("sk-bob", "/v1/cache/invalidate", {"namespace": "bob/public"})
            r = await call("sk-bob", "/v1/completions", {
                "prompt": guess, "max_tokens": 1, "cache_salt": "public",
                "return_cache_info": True})  # fmt: skip
            info = r["choices"][0]["cache_info"]
            assert cached(r) == 0 and info["cached_tokens"] == 0
            assert (info["reason"], info["diverged_at"]) == ("no_prior_request", None), guess
        # A chat: alice's system message is shared by declaration; her question and answer are
        # not. Bob replays both (the answer as an assistant turn) and a guess of the question.
        q = "My account number is 4471-9920-1183. What is my balance?"
        r = await call("sk-alice", "/v1/chat/completions", chat_body(q, max_tokens=24))
        answer = r["choices"][0]["message"]["content"]
        shared = r["choices"][0]["cache_info"]["shared_tokens"]
        assert shared >= B and r["usage"]["prompt_tokens"] > shared + 2 * B
        replay = chat_body(q, max_tokens=1)
        replay["messages"].append({"role": "assistant", "content": answer})
        for body in (chat_body(q, max_tokens=1), replay, chat_body(q[:30] + "0000", max_tokens=1)):
            await call("sk-bob", "/v1/cache/invalidate", {"namespace": "bob/public"})
            r = await call("sk-bob", "/v1/chat/completions", body)
            info = r["choices"][0]["cache_info"]
            assert cached(r) == shared == info["shared_tokens"]
            assert info["diverged_at"] is None or info["diverged_at"] <= shared
            assert info["namespace"] == "bob/public" and info["shared_namespace"] == "public"

    serve(app, test)


def test_a_shared_system_prompt_is_hit_by_others_and_the_suffix_is_not(app):
    """Every tenant of the salt hits the system part; each suffix only its owner; an admin
    warms a public prefix that others' chats hit."""

    async def test(call):
        salt = {"salt": "public"}
        first = await call("sk-alice", "/v1/chat/completions", chat_body("Where is room 12?", **salt))
        shared = first["choices"][0]["cache_info"]["shared_tokens"]
        assert shared >= B
        # (bob's own chats of the test before would be his to reuse, token-exactly: dropped)
        await call("sk-bob", "/v1/cache/invalidate", {"namespace": "bob/public"})
        r = await call("sk-bob", "/v1/chat/completions", chat_body("Who runs payroll?", **salt))
        assert cached(r) == shared > 0
        r = await call("sk-bob", "/v1/chat/completions", chat_body("Who runs payroll?", **salt))
        assert cached(r) > shared  # bob's own suffix, his again
        r = await call("sk-alice", "/v1/chat/completions", chat_body("Who runs payroll?", **salt))
        # ... but not alice's: she reuses only what her own first question's block shares
        # with it (the template's tokens before the question), never bob's suffix
        assert shared <= cached(r) < shared + B
        assert r["choices"][0]["cache_info"]["namespace"] == "alice/public"
        # Without a shared salt nothing is shared at all.
        r = await call("sk-bob", "/v1/chat/completions", chat_body("Where is room 12?", "own"))
        assert cached(r) == 0
        # An admin registers a whole prompt as a public prefix; a non-admin warm of a raw
        # prompt shares nothing.
        pub = [{"role": "system", "content": PROSE}]
        w = await call("sk-ops", "/v1/cache/warm", {
            "messages": pub, "add_generation_prompt": False, "cache_salt": "public"})  # fmt: skip
        assert w["shared_tokens"] == w["num_tokens"] // B * B >= 4 * B
        body = {"messages": [*pub, {"role": "user", "content": "Summarize."}], "max_tokens": 1,
                "cache_salt": "public"}  # fmt: skip
        r = await call("sk-bob", "/v1/chat/completions", body)
        assert cached(r) >= w["shared_tokens"] - B  # the rendering may merge the last tokens
        raw = ids(3, 40)
        w = await call("sk-alice", "/v1/cache/warm", {"prompt": raw, "cache_salt": "public"})
        assert (w["shared_tokens"], w["namespace"]) == (0, "alice/public")
        look = await call("sk-ops", "/v1/cache/lookup", {"prompt": raw, "cache_salt": "public"})
        assert look["num_cached_tokens"] == 0

    serve(app, test)


def messages_body(turn: str, **extra) -> dict:
    """An Anthropic Messages request under the shared salt with automatic caching (one
    breakpoint on the last block: the whole conversation)."""
    return {"model": "SmolLM2-135M-Instruct", "max_tokens": 1, "system": SYSTEM,
            "messages": [{"role": "user", "content": turn}], "cache_control": {"type": "ephemeral"},
            "cache_salt": "public", "return_cache_info": True, **extra}  # fmt: skip


def test_a_guess_of_anothers_private_turn_under_a_shared_salt_learns_nothing(app):
    """Issue #37 item 7: on /v1/messages the first breakpoint was the declared shared prefix,
    so automatic caching shared the whole conversation with every tenant of the salt, and
    ``cached_tokens`` / ``diverged_at`` told a guess of another's turn from a wrong one. Now the
    shared prefix stops at the tools and system unless a breakpoint says ``shared``: alice's
    exact guess of bob's private turn and a wrong guess get identical counts and explanations."""
    private = "My PIN is 4471 and my salary is 91,250 dollars; file my tax form."
    wrong = "My PIN is 9999 and my salary is 12,000 dollars; file my tax form."

    async def test(call):
        b = await call("sk-bob", "/v1/messages", messages_body(private))
        shared = b["cache_info"]["shared_tokens"]
        assert B <= shared < b["usage"]["input_tokens"] + b["usage"]["cache_read_input_tokens"] + \
            b["usage"]["cache_creation_input_tokens"] - B  # the system only, not the turn
        seen = []
        for guess in (private, wrong):
            await call("sk-alice", "/v1/cache/invalidate", {"namespace": "alice/public"})
            r = await call("sk-alice", "/v1/messages", messages_body(guess))
            info = {k: v for k, v in r["cache_info"].items()}
            seen.append((r["usage"]["cache_read_input_tokens"], info))
        assert seen[0] == seen[1], seen
        assert seen[0][0] == shared  # the system prompt: public by declaration, hit by both
        # A breakpoint marked shared declares everything up to it: then the turn is public.
        await call("sk-bob", "/v1/messages", messages_body(
            private, cache_control={"type": "ephemeral", "shared": True}, cache_salt="public"))
        await call("sk-alice", "/v1/cache/invalidate", {"namespace": "alice/public"})
        r = await call("sk-alice", "/v1/messages", messages_body(
            private, cache_control={"type": "ephemeral", "shared": True}))
        assert r["usage"]["cache_read_input_tokens"] > shared

    serve(app, test)


def test_outputs_are_the_same_bits_with_the_shared_prefix_from_cache(llm, llm_cold):
    """Bob's request reuses alice's shared prefix (its blocks) and runs his own suffix: tokens
    and logprobs equal the uncached engine's."""
    tok = llm.get_tokenizer()
    system = tok.encode(PROSE, add_special_tokens=False)[: 3 * B + 5]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    shared = [SharedPrefix("sn-public", len(system))]
    prompt_a, prompt_b = system + ids(4, 20), system + ids(5, 23)
    llm.generate([prompt_a], sp, cache_salt="sn-alice", shared_prefixes=shared)
    warm = llm.generate([prompt_b], sp, cache_salt="sn-bob", shared_prefixes=shared)[0]
    assert warm.num_cached_tokens == 3 * B  # the shared prefix's whole blocks, nothing more
    cold = llm_cold.generate([prompt_b], sp)[0]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.outputs[0].logprobs == cold.outputs[0].logprobs
    llm.engine.check_integrity()


def test_the_block_after_a_shared_prefix_has_the_documented_join_key(llm):
    """Known answer: the first block after the shared prefix chains from
    H("prefixcache/shared-join" || u32(2) || last shared key || root(own namespace)), so its key
    is not the same tokens' key in the shared namespace, and differs per owner."""
    root = root_hash("example-model", "public", block_size=4)
    own = root_hash("example-model", "alice/public", block_size=4)
    last = hash_blocks(list(range(1, 9)), 4, root)[-1]
    join = xxhash.xxh3_128_digest(b"prefixcache/shared-join" + struct.pack("<I", 2) + last + own)
    assert join_hash(last, own) == join
    # The values docs/design.md §3 gives (a change here is a change of the key format).
    assert join.hex() == "55445614d53885669e92730293da5c23"
    after = hash_blocks_after_shared(list(range(1, 13)), 4, root, 2, own)
    assert after[:2] == hash_blocks(list(range(1, 9)), 4, root)
    assert after[2] == xxhash.xxh3_128_digest(join + struct.pack("<4I", 9, 10, 11, 12))
    assert after[2].hex() == "0d9603be96f761e7aef2a8fe084a3774"
    # In the engine: the shared blocks are the shared namespace's, the next one chains from
    # the join, and the KV events name its parent as the last shared block.
    kv = llm.engine.kv
    prompt = ids(6, 3 * B)
    shared = SharedPrefix("public", 2 * B + 3)  # rounded down: 2 whole blocks
    keys = kv.keys_for(prompt, "alice/public", shared)
    in_shared = hash_blocks(prompt, B, kv.root("public"))
    assert keys[:2] == in_shared[:2]
    j = join_hash(keys[1], kv.root("alice/public"))
    assert keys[2] == xxhash.xxh3_128_digest(j + struct.pack(f"<{B}I", *prompt[2 * B :]))
    assert keys[2] != in_shared[2]
    assert keys[2] != kv.keys_for(prompt, "bob/public", shared)[2]
    assert keys[2] not in hash_blocks(prompt, B, kv.root("alice/public"))
    llm.generate([prompt + [5]], SamplingParams(max_tokens=1), cache_salt="alice/public",
                 shared_prefixes=[shared])  # fmt: skip
    assert kv.event_parent(j, "alice/public") == keys[1]
    assert kv.event_parent(kv.root("public"), "public") is None


@pytest.mark.slow
def test_a_disk_tier_restores_both_parts_of_a_crossing_chain(tmp_path, llm_cold):
    """A restart restores the shared run and then the owner's run (one namespace per restore
    job); another tenant gets the shared run only. Outputs equal the uncached engine's."""
    tok = llm_cold.get_tokenizer()
    system = tok.encode(PROSE, add_special_tokens=False)[: 2 * B]
    prompt = system + ids(7, 2 * B + 5)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    shared = [SharedPrefix("public", len(system))]
    first = LLM(kv_cache_memory="24MiB", disk_cache_dir=tmp_path, seed=0)
    first.generate([prompt], sp, cache_salt="alice", shared_prefixes=shared)
    assert first.engine.connectors.flush()
    del first
    second = LLM(kv_cache_memory="24MiB", disk_cache_dir=tmp_path, seed=0)
    alice = second.generate([prompt], sp, cache_salt="alice", shared_prefixes=shared)[0]
    assert alice.num_cached_tokens == 4 * B  # 2 shared blocks, then her 2 (a second job)
    assert second.cache_stats()["tiers"]["disk"]["hit_tokens"] == 4 * B
    bob = second.generate([prompt], sp, cache_salt="bob", shared_prefixes=shared)[0]
    assert bob.num_cached_tokens == 2 * B  # the shared blocks (in RAM now); alice's are hers
    expect = llm_cold.generate([prompt], sp)[0].outputs[0].token_ids
    assert bob.outputs[0].token_ids == alice.outputs[0].token_ids == expect
    second.check_integrity()


def test_a_shared_prefix_is_written_to_the_tiers_with_the_default_retention(tmp_path):
    """Issue #37: a block's retention is that of the request that registered it first, so the
    first tenant to cache a shared prefix decided for everyone whether it reached the tiers
    ("in_memory") or expired there after a day ("24h"). A request's retention now applies to
    its own blocks: the shared run is written without a deadline, whoever asks what."""
    from prefixcache.tiers.disk import SUBDIR

    eng = LLM(kv_cache_memory="24MiB", disk_cache_dir=tmp_path, seed=0).engine
    prompt = ids(31, 3 * B) + ids(32, B + 4)  # 3 shared blocks, then one of the tenant's own
    sp = SamplingParams(max_tokens=1, temperature=0)

    def run(rid: str, tenant: str, retention: str, own: list[int]) -> None:
        eng.add_request(rid, prompt[: 3 * B] + own, sp, f"{tenant}/public", tenant=tenant,
                        shared_prefix=SharedPrefix("public", 3 * B), retention=retention)
        while eng.has_unfinished():
            eng.step()
        assert eng.connectors.flush()

    def files() -> list[list[str]]:  # per record: its name's parts (a deadline makes three)
        return sorted(p.name.split(".") for p in (tmp_path / SUBDIR).glob("*/*.blk"))

    run("a", "alice", "in_memory", prompt[3 * B :])
    assert [len(f) for f in files()] == [2, 2, 2]  # the shared run: written, no deadline
    run("b", "bob", "24h", ids(33, B + 4))
    assert sorted(len(f) for f in files()) == [2, 2, 2, 3]  # + bob's own block, with its day
    eng.check_integrity()
