"""OpenAI's prompt caching fields on a live `prefixcache serve` with a disk tier, through the
official ``openai`` client: ``prompt_cache_retention`` ("24h": written through to the disk tier
with a deadline and restored from it after a restart; "in_memory": never written there) and
``prompt_cache_key`` (per-key stats of the tenant's own; a key never reaches another tenant's
cache).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from prefixcache.server.launcher import ServerProcess
from prefixcache.tiers.disk import SUBDIR

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"keys": {"sk-alice": "alice", "sk-bob": "bob"}}
SYSTEM = ("You are the travel desk of the Example company. Answer in one sentence and name the "
          "policy section the answer comes from.")  # fmt: skip


def chat(c, user: str, **kw):
    return c.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        extra_body={"return_cache_info": True}, **kw,
    )  # fmt: skip


def records(root) -> list[str]:
    return sorted(p.name for p in (root / SUBDIR).glob("*/*.blk"))


def test_retention_24h_is_written_with_a_deadline_and_survives_a_restart(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    disk = tmp_path / "kv"
    args = ["--api-keys-file", str(keys), "--kv-cache-memory", "32MiB", "--max-model-len", "512",
            "--disk-cache-dir", str(disk)]  # fmt: skip
    day = "Which hotel class may I book for a two-day trip to Lyon?"
    ram = "Which hotel class may I book for a week in Oslo?"
    with ServerProcess(args) as srv:
        alice = openai.OpenAI(api_key="sk-alice", base_url=srv.base_url + "/v1", max_retries=0)
        chat(alice, day, prompt_cache_retention="24h")
        # Its system prompt's blocks are cached (and written) already; its question's are not
        # written at all: "in_memory" keeps what it registers in RAM.
        chat(alice, ram, prompt_cache_retention="in_memory")
    # Shutdown flushed the tier's queue: every written record carries its deadline.
    written = records(disk)
    assert written and all(len(n.split(".")) == 3 for n in written)  # <name>.<deadline>.blk
    with ServerProcess(args) as srv:
        alice = openai.OpenAI(api_key="sk-alice", base_url=srv.base_url + "/v1", max_retries=0)
        back = chat(alice, day, prompt_cache_retention="24h")
        info = back.choices[0].model_extra["cache_info"]
        assert info["cached_tokens_by_tier"]["disk"] >= 32  # restored from the tier
        assert back.usage.prompt_tokens_details.cached_tokens >= 32
        # The in_memory prompt shares only the system prompt's blocks with the 24h one: its
        # own (the question) were never written, so only those shared blocks come back.
        again = chat(alice, ram)
        assert again.usage.prompt_tokens_details.cached_tokens < back.usage.prompt_tokens_details.cached_tokens
        with pytest.raises(openai.UnprocessableEntityError):
            chat(alice, day, prompt_cache_retention="forever")
        done = alice.completions.create(model=MODEL, prompt="Paris is", max_tokens=2,
                                        extra_body={"prompt_cache_retention": "in_memory"})  # fmt: skip
        assert done.choices[0].text is not None


def test_prompt_cache_key_counts_per_key_and_never_widens_the_cache(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    args = ["--api-keys-file", str(keys), "--kv-cache-memory", "32MiB", "--max-model-len", "512"]
    with ServerProcess(args) as srv:
        alice = openai.OpenAI(api_key="sk-alice", base_url=srv.base_url + "/v1", max_retries=0)
        bob = openai.OpenAI(api_key="sk-bob", base_url=srv.base_url + "/v1", max_retries=0)
        q = "May I fly business class to Tokyo?"
        chat(alice, q, prompt_cache_key="user-17")
        hit = chat(alice, q, prompt_cache_key="user-17")
        assert hit.usage.prompt_tokens_details.cached_tokens >= 32
        # Bob names alice's key: his request is still his own namespace's, and hits nothing.
        other = chat(bob, q, prompt_cache_key="user-17")
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        mine = httpx.get(srv.base_url + "/v1/cache/stats",
                         headers={"Authorization": "Bearer sk-alice"}).json()["prompt_cache_keys"]
        assert mine["user-17"]["requests"] == 2
        assert mine["user-17"]["cached_tokens"] == hit.usage.prompt_tokens_details.cached_tokens
        assert mine["user-17"]["prompt_tokens"] == 2 * hit.usage.prompt_tokens
        his = httpx.get(srv.base_url + "/v1/cache/stats",
                        headers={"Authorization": "Bearer sk-bob"}).json()["prompt_cache_keys"]
        assert his == {"user-17": {"requests": 1, "prompt_tokens": other.usage.prompt_tokens,
                                   "cached_tokens": 0, "hit_rate": 0.0}}  # fmt: skip
        with pytest.raises(openai.BadRequestError):
            chat(alice, q, prompt_cache_options={"ttl": "30m"})
