"""The server's model-free parts, in milliseconds: keys files (strict schema, reload), tenants and
namespaces, the metrics key, the `serve` command line, OpenAI error bodies, malformed bodies."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from prefixcache.api.request import SharedPrefix
from prefixcache.cli import build_parser
from prefixcache.config import config_from_cli
from prefixcache.server.base.auth import CacheScope, Tenant, TenantDirectory, load_keys_file
from prefixcache.server.cli import _limits, origin_policy
from prefixcache.server.edge.body import json_containers, parse_json
from prefixcache.server.edge.errors import APIError, validation_error
from prefixcache.server.edge.limits import ServerLimits
from prefixcache.server.edge.origin import LOOPBACK_NAMES, OriginPolicy
from prefixcache.server.openai.protocol import ChatCompletionRequest, CompletionRequest


def test_keys_file_json_yaml_and_flat(tmp_path):
    full = tmp_path / "keys.yaml"
    full.write_text(
        "keys:\n  sk-a: alice\n  sk-o: {tenant: ops, admin: true}\nshared_namespaces: [public]\n"
    )
    keys, shared = load_keys_file(full)
    assert keys == {"sk-a": Tenant("alice"), "sk-o": Tenant("ops", admin=True)}
    assert shared == ["public"]
    flat = tmp_path / "keys.json"
    flat.write_text(json.dumps({"sk-a": "alice", "sk-b": "bob"}))
    assert load_keys_file(flat) == ({"sk-a": Tenant("alice"), "sk-b": Tenant("bob")}, [])


@pytest.mark.parametrize(
    "text",
    ["[1, 2]", "{}", "keys: {sk-a: [1]}", "keys: {sk-a: alice}\nextra: 1", "sk-a: {admin: true}"],
)
def test_bad_keys_files_are_refused(tmp_path, text):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises((ValueError, TypeError)):
        load_keys_file(path)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"keys": {"sk-a": {"tenant": "a", "admin": "false"}}}', "admin"),  # a string: no admin
        ("keys:\n  sk-a: {tenant: a, admin: \"true\"}\n", "admin"),
        ("keys:\n  sk-a: {tenant: a, admin: yes}\n", "admin"),  # YAML 1.1 bool: a string here
        ("keys:\n  sk-a: {tenant: a, role: admin}\n", "role"),  # unknown field
        ("sk-a: alice\nsk-b: bob\nsk-a: mallory\n", "line 3"),  # duplicate key, its line
        ('{\n "sk-a": "alice",\n "sk-a": "mallory"\n}', "line 3"),
    ],
)
def test_keys_file_schema_is_strict(tmp_path, text, needle):
    path = tmp_path / "keys.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        load_keys_file(path)


def test_yaml_keys_and_names_stay_the_strings_they_look_like(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  yes: null\n  0123: 1e3\n  sk-o: {tenant: ops, admin: true}\n")
    keys, _ = load_keys_file(path)
    assert keys == {"yes": Tenant("null"), "0123": Tenant("1e3"), "sk-o": Tenant("ops", True)}


def test_keys_reload_swaps_all_or_nothing(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-a": "alice"}))
    d = TenantDirectory.from_options(api_keys_file=path, admin_key="sk-root")
    assert d.reloadable and d.authenticate("Bearer sk-a") == Tenant("alice")
    path.write_text(json.dumps({"sk-b": "bob"}))
    assert d.reload() == 2  # bob and the admin key from the command line
    assert d.authenticate("Bearer sk-b") == Tenant("bob")
    with pytest.raises(APIError):
        d.authenticate("Bearer sk-a")
    path.write_text('{"sk-c": {"tenant": "c", "admin": "yes"}}')
    with pytest.raises(ValueError):
        d.reload()
    assert d.authenticate("Bearer sk-b") == Tenant("bob")  # a bad file changes nothing
    assert not TenantDirectory.from_options(api_key="k").reloadable


SECRET = "sk-live-9f8e7d6c5b4a"


@pytest.mark.parametrize(
    "text",
    [
        f'{{"keys": {{"{SECRET}": {{"tenant": "a", "admin": "no"}}}}}}',  # schema, full form
        f'{{"{SECRET}": {{"admin": true}}}}',  # schema, flat form (no tenant)
        f'{{"keys": {{"sk-a": "a"}}, "{SECRET}": "b"}}',  # a key outside "keys"
        f'{{\n "{SECRET}": "alice",\n "{SECRET}": "bob"\n}}',  # JSON duplicate
        f"{SECRET}: alice\n{SECRET}: bob\n",  # YAML duplicate
        f"keys:\n  {SECRET}: [alice\n",  # YAML syntax (PyYAML would quote the line)
        f"{SECRET}: admin\n",  # a reserved name
    ],
)
def test_keys_file_errors_never_show_a_key(tmp_path, text):
    """The message is logged on SIGHUP: it names lines, never the key."""
    path = tmp_path / "keys.txt"
    path.write_text(text)
    with pytest.raises((ValueError, TypeError)) as e:
        load_keys_file(path)
    assert SECRET not in str(e.value) and "9f8e" not in str(e.value), str(e.value)
    assert "line" in str(e.value)


@pytest.mark.parametrize("name", ["admin", "default"])
def test_reserved_tenant_names_are_refused_at_load_and_reload(tmp_path, name):
    """A keys-file tenant named like the server's own (--admin-key's "admin", --api-key's and
    the open server's "default") would share their namespace, quota and prompt excerpts."""
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  sk-a: alice\n  sk-x: {{tenant: {name}, admin: true}}\n")
    with pytest.raises(ValueError, match=f"line 3 names tenant '{name}', which is reserved"):
        TenantDirectory.from_options(api_keys_file=path, admin_key="sk-root")
    path.write_text("keys:\n  sk-a: alice\n")
    d = TenantDirectory.from_options(api_keys_file=path, admin_key="sk-root")
    path.write_text(f"sk-a: alice\nsk-x: {name}\n")
    with pytest.raises(ValueError, match="reserved"):
        d.reload()
    assert d.authenticate("Bearer sk-root") == Tenant("admin", admin=True)
    with pytest.raises(APIError):
        d.authenticate("Bearer sk-x")


def test_metrics_key():
    d = TenantDirectory.from_options(api_key="sk-1", admin_key="sk-root")
    d.authenticate_metrics("Bearer scrape", "scrape")
    d.authenticate_metrics("Bearer sk-root", "scrape")  # admins may scrape
    for header in (None, "Bearer nope", "scrape"):
        with pytest.raises(APIError) as e:
            d.authenticate_metrics(header, "scrape")
        assert e.value.status == 401


def test_bad_tenant_names_are_refused():
    with pytest.raises(ValueError, match="'/'"):
        TenantDirectory({"k": Tenant("a/b")})
    with pytest.raises(ValueError, match="shared namespace"):
        TenantDirectory({"k": Tenant("public")}, shared_namespaces=["public"])
    with pytest.raises(ValueError, match="either"):
        TenantDirectory.from_options(api_key="k", api_keys_file="f")


def test_authentication():
    d = TenantDirectory.from_options(api_keys_file=None, api_key="sk-1", admin_key="sk-root")
    assert d.authenticate("Bearer sk-1") == Tenant("default", admin=True)
    assert d.authenticate("bearer sk-root") == Tenant("admin", admin=True)
    for header in (None, "", "Bearer nope", "Basic sk-1", "sk-1"):
        with pytest.raises(APIError) as e:
            d.authenticate(header)
        assert e.value.status == 401 and e.value.body()["error"]["code"] == "invalid_api_key"
    open_server = TenantDirectory()
    assert not open_server.auth_required
    assert open_server.authenticate(None) == Tenant("default", admin=True)


def test_namespaces_are_derived_by_the_server():
    d = TenantDirectory({"ka": Tenant("alice"), "kb": Tenant("bob")}, shared_namespaces=["public"])
    alice, bob = Tenant("alice"), Tenant("bob")
    assert d.namespace(alice, None) == "alice"
    assert d.namespace(alice, "x") == "alice/x"
    assert d.namespace(bob, "alice") == "bob/alice"  # a salt never reaches another tenant
    assert d.namespace(alice, "public") == d.namespace(bob, "public") == "public"
    # A request with a shared salt is cached in the tenant's own part; only what it declares
    # shared goes to the shared namespace (docs/server.md "Shared prefixes").
    assert d.scope(alice, "public") == CacheScope("alice/public", "public")
    assert d.scope(alice, "x") == CacheScope("alice/x") and d.scope(alice, None).shared is None
    assert d.scope(bob, "public").prefix(0) is None
    assert d.scope(bob, "public").prefix(40) == SharedPrefix("public", 40)
    with pytest.raises(APIError):
        d.namespace(alice, "")
    assert d.owns(alice, "alice") and d.owns(alice, "alice/x")
    assert not d.owns(alice, "bob") and not d.owns(alice, "alicex") and not d.owns(alice, "public")
    assert d.owns(Tenant("ops", admin=True), "bob")


def test_serve_command_line():
    args = build_parser().parse_args([
        "serve", "--no-enable-prefix-caching", "--kv-cache-memory", "1GiB", "--block-size", "32",
        "--max-num-seqs", "4", "--scheduling-policy", "lpm", "--port", "9000",
        "--shared-namespace", "a", "--shared-namespace", "b", "--served-model-name", "m1", "m2",
    ])  # fmt: skip
    assert args.port == 9000 and args.shared_namespace == ["a", "b"]
    assert args.served_model_name == ["m1", "m2"] and callable(args.func)
    cfg = config_from_cli(args)
    assert (cfg.enable_prefix_caching, cfg.kv_cache_memory, cfg.block_size) == (False, "1GiB", 32)
    assert (cfg.max_num_seqs, cfg.scheduling_policy) == (4, "lpm")
    with pytest.raises(SystemExit):  # one key or a keys file, not both
        build_parser().parse_args(["serve", "--api-key", "k", "--api-keys-file", "f"])
    args = build_parser().parse_args([
        "serve", "--max-body-bytes", "1MiB", "--max-n", "4", "--send-timeout", "2.5",
        "--max-waiting-per-tenant", "7", "--max-pin-ttl", "60", "--metrics-key", "m",
    ])  # fmt: skip
    limits = _limits(args)
    assert (limits.max_body_bytes, limits.max_n, limits.send_timeout) == (1 << 20, 4, 2.5)
    cfg = config_from_cli(args)
    assert (cfg.tenant_waiting_limit, cfg.max_pin_ttl_seconds) == (7, 60.0)
    assert args.metrics_key == "m"
    with pytest.raises(ValueError):
        ServerLimits(send_timeout=0)



def test_the_engine_flags_are_the_config_fields():
    """Issue #40: the flags are generated from config.py's fields, so a default is written once:
    no flags give EngineConfig() exactly, every field but the internal ones has exactly one
    flag, and the flags whose words need converting (a 'none', a renamed flag) land right."""
    from dataclasses import fields

    from prefixcache.config import COMPONENTS, EngineConfig

    assert config_from_cli(build_parser().parse_args(["serve"])) == EngineConfig()
    off_cli = {f.name for c in COMPONENTS for f in fields(c) if f.metadata["cli"] is None}
    assert off_cli == {"lpm_max_wait_steps", "lpm_max_queue", "kv_events_rank"}
    names = [f.name for c in COMPONENTS for f in fields(c)]
    assert sorted(names) == sorted(f.name for f in fields(EngineConfig))  # each field once
    parser = build_parser()._subparsers._group_actions[0].choices["serve"]
    dests = [a.dest for a in parser._actions]
    assert all(dests.count(n) == 1 for n in names if n not in off_cli)
    cfg = config_from_cli(build_parser().parse_args([
        "serve", "--weights-cache-dir", "none", "--shared-window", "5", "--health-stall-timeout",
        "9", "--kv-events-endpoint", "tcp://127.0.0.1:5999", "--kv-events-token-ids",
        "--no-partial-block-reuse", "--tier-compression", "lz4", "--max-model-len", "300",
    ]))  # fmt: skip
    assert cfg.weights_cache_dir is None and cfg.shared_window_s == 5.0
    assert cfg.health_stall_seconds == 9.0 and cfg.kv_events_token_ids is True
    assert (cfg.partial_block_reuse, cfg.tier_compression, cfg.max_model_len) == (False, "lz4", 300)
    with pytest.raises(SystemExit):  # choices come from the config's tuples
        build_parser().parse_args(["serve", "--eviction-policy", "fifo"])


def test_each_config_component_checks_its_own_fields_alone():
    from prefixcache.config import CacheConfig, EngineConfig, SchedulerConfig, TiersConfig

    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=3)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="remote cache URL"):
        TiersConfig(remote_cache="http://x:1")
    with pytest.raises(ValueError, match="max_num_seqs"):  # and as part of the whole
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=3)
    assert isinstance(EngineConfig(), CacheConfig)

def test_an_open_server_on_a_non_loopback_address_needs_an_explicit_flag(tmp_path, capsys):
    """Issue #37: with no API key every caller is the admin; bound beyond loopback that was
    served without a word. Now it is refused (exit 2, before the model loads) unless
    --allow-open-remote says so, as the KV events stream's --kv-events-allow-remote."""
    from prefixcache.cli import main
    from prefixcache.server.base.auth import TenantDirectory
    from prefixcache.server.cli import check_open_bind

    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "--allow-open-remote" in err and "admin" in err
    keys = tmp_path / "keys.json"
    keys.write_text('{"sk-a": "alice"}')

    def ok(*argv: str, tenants=None) -> bool:
        try:
            check_open_bind(tenants or TenantDirectory(), build_parser().parse_args(["serve", *argv]))
        except ValueError:
            return False
        return True

    assert not ok("--host", "10.0.0.5") and not ok("--host", "::")
    assert ok() and ok("--host", "localhost") and ok("--host", "::1")
    assert ok("--host", "0.0.0.0", "--allow-open-remote")
    assert ok("--host", "0.0.0.0", tenants=TenantDirectory.from_options(api_keys_file=keys))


def test_origin_policy_follows_the_bind_address():
    """The Host check is on for a loopback bind or with --allowed-hosts; off for a wildcard
    bind (reached by names we cannot know). The Origin and Content-Type checks are always on."""

    def policy(*argv: str) -> OriginPolicy:
        return origin_policy(build_parser().parse_args(["serve", *argv]))

    json_post = {"content-type": "application/json", "host": "gpu-box.lan:8000"}
    assert policy() == OriginPolicy(LOOPBACK_NAMES, check_host=True)
    assert policy().check("POST", json_post).code == "host_not_allowed"
    wide = policy("--host", "0.0.0.0")
    assert not wide.check_host and wide.check("POST", json_post) is None
    assert wide.check("POST", {**json_post, "origin": "http://gpu-box.lan:8000"}).status == 403
    assert wide.check("POST", {"host": "gpu-box.lan"}).status == 415
    named = policy("--host", "0.0.0.0", "--allowed-hosts", "gpu-box.lan,GPU.example.",
                   "--allowed-hosts", "[fd00::1]")  # fmt: skip
    assert named.check_host and named.allowed_hosts == LOOPBACK_NAMES | {
        "gpu-box.lan", "gpu.example", "fd00::1"}  # fmt: skip
    assert named.check("POST", {**json_post, "origin": "https://gpu.example"}) is None
    assert named.check("GET", {"host": "[fd00::1]:80"}) is None
    assert named.check("GET", {"host": "other.lan"}).code == "host_not_allowed"
    assert policy("--host", "10.0.0.5").allowed_hosts == LOOPBACK_NAMES | {"10.0.0.5"}
    for malformed in ("::1", "localhost:port", "[::1", ""):
        assert policy().check("GET", {"host": malformed}).code == "host_not_allowed", malformed
    for bad in ("http://gpu-box.lan", "gpu-box.lan:8000", "a/b"):
        with pytest.raises(ValueError):
            policy("--allowed-hosts", bad)


def test_validation_errors_name_the_field():
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": 5})
    err = validation_error(e.value)
    assert err.status == 422 and err.param == "prompt"
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "wizard", "content": "x"}]})
    assert validation_error(e.value).param == "messages.0.role"
    body = APIError(429, "busy", code="queue_full").body()["error"]
    assert body == {"message": "busy", "type": "rate_limit_error", "param": None,
                    "code": "queue_full"}  # fmt: skip


def test_engine_errors_map_to_openai_statuses_by_type():
    from prefixcache.api.errors import (
        ContextLengthError,
        EngineShutDownError,
        InvalidRequestError,
        QueueFullError,
        SequenceFailedError,
        TenantQuotaError,
    )
    from prefixcache.server.edge.errors import from_engine_error

    down = from_engine_error(EngineShutDownError("no new requests"))
    assert isinstance(down, APIError) and down.status == 503
    busy = from_engine_error(QueueFullError("9 waiting"))
    assert busy.status == 429 and busy.headers["Retry-After"] == "1"
    share = from_engine_error(TenantQuotaError("over share", retry_after=3))
    assert (share.status, share.code, share.headers["Retry-After"]) == (
        429, "tenant_quota_exceeded", "3")  # fmt: skip
    too_long = from_engine_error(ContextLengthError("too long", param="prompt"))
    assert (too_long.status, too_long.param, too_long.code) == (
        400, "prompt", "context_length_exceeded")  # fmt: skip
    # The class decides, never the text: a "length" in a plain message is no context error.
    bad = from_engine_error(InvalidRequestError("the length of the stop list", param="stop"))
    assert (bad.status, bad.param, bad.code) == (400, "stop", None)
    # Our own faults are 500s that carry the request id and not the exception's text.
    ours = from_engine_error(SequenceFailedError("r1", RuntimeError("secret internals")), "rid7")
    assert ours.status == 500 and "rid7" in ours.message and "secret" not in ours.message
    for other in (RuntimeError("x"), ValueError("maximum context length")):
        assert from_engine_error(other) is None  # an untyped error is a bug: a logged 500


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (b'{"temperature": NaN}', "invalid_json", None),
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", "invalid_json", None),
        (b"[" * 100_000 + b"]" * 100_000, "json_too_complex", None),  # counted before parsing
        (b'{"a":' * 40 + b"1" + b"}" * 40, "invalid_json", None),  # deeper than 32
        (b'{"messages": [' + b'{"a": []},' * 5000 + b"{}]}", "json_too_complex", None),
        (b'{"prompt": "ok \\ud800"}', "invalid_text", "prompt"),
        (b'{"messages": [{"content": "\\udfff"}]}', "invalid_text", "messages.0.content"),
        (b'{"\\ud800": 1}', "invalid_text", None),
        (b"\xff{}", "invalid_json", None),
        (b"[1]", "invalid_json", None),
        (b"", "invalid_json", None),
    ],
)
def test_malformed_bodies_are_400s_naming_the_problem(raw, code, param):
    with pytest.raises(APIError) as e:
        parse_json(raw, ServerLimits())
    assert (e.value.status, e.value.code, e.value.param) == (400, code, param)


def test_a_snapshot_is_read_by_one_reader_at_a_time_on_its_own_thread():
    """server/observability/snapshot.py: callers that arrive while a read is under way share it; an untrusted
    caller reuses a read younger than max_age, a fresh one never does; a caller that leaves
    does not cancel the read the others wait for."""
    import threading

    from prefixcache.server.observability.snapshot import Snapshot, SnapshotReader

    reads, release = [], threading.Event()

    def read() -> int:
        reads.append(threading.current_thread().name)
        assert release.wait(10)
        return len(reads)

    now = [0.0]
    reader = SnapshotReader()
    snap = Snapshot(read, reader, max_age=1.0, clock=lambda: now[0])

    async def main():
        waiting = [asyncio.ensure_future(snap.get(fresh=True)) for _ in range(20)]
        await asyncio.sleep(0.05)
        release.set()
        assert await asyncio.gather(*waiting) == [1] * 20  # one read for all of them
        assert reads == ["prefixcache-snapshot_0"]
        assert await snap.get(fresh=True) == 2  # fresh: a read of its own once that one ended
        assert await snap.get() == 2 and len(reads) == 2  # untrusted: reused within max_age
        now[0] = 1.5
        assert await snap.get() == 3
        release.clear()
        leaver, stayer = asyncio.ensure_future(snap.get(fresh=True)), asyncio.ensure_future(snap.get(fresh=True))
        await asyncio.sleep(0.05)
        leaver.cancel()
        release.set()
        assert await stayer == 4

    try:
        asyncio.run(main())
    finally:
        release.set()
        reader.close()


def test_brackets_inside_strings_are_not_counted_as_containers():
    """The container bound counts the body's objects and arrays exactly (body.json_containers):
    brackets in a text, escaped quotes and backslashes included, are not containers."""
    text = '{[' * 20000 + '"{\\' + '\\"[' + "x\\"
    raw = json.dumps({"prompt": text, "messages": [{"a": [[], {}]}]}).encode()
    assert json_containers(raw, ServerLimits().max_json_containers) == 6
    assert json_containers(raw, -1) == 6  # the exact count (the quick one is over any limit)
    assert parse_json(raw, ServerLimits())["prompt"] == text


def test_valid_text_and_paired_surrogates_pass():
    data = parse_json(b'{"prompt": "emoji \\ud83d\\ude00", "n": 2}', ServerLimits())
    assert data == {"prompt": "emoji \U0001f600", "n": 2}
