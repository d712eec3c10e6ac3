"""The server's model-free parts, in milliseconds: keys files, tenants and namespaces, the
`serve` command line, OpenAI error bodies."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from prefixcache.cli import build_parser
from prefixcache.server.auth import Tenant, TenantDirectory, load_keys_file
from prefixcache.server.cli import _engine_config
from prefixcache.server.errors import APIError, validation_error
from prefixcache.server.protocol import ChatCompletionRequest, CompletionRequest


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
    cfg = _engine_config(args)
    assert (cfg.enable_prefix_caching, cfg.kv_cache_memory, cfg.block_size) == (False, "1GiB", 32)
    assert (cfg.max_num_seqs, cfg.scheduling_policy) == (4, "lpm")
    with pytest.raises(SystemExit):  # one key or a keys file, not both
        build_parser().parse_args(["serve", "--api-key", "k", "--api-keys-file", "f"])


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


def test_engine_errors_map_to_openai_statuses():
    from prefixcache.async_engine import EngineShutDownError, QueueFullError
    from prefixcache.server.serving import engine_error

    down = engine_error(EngineShutDownError("no new requests"))
    assert isinstance(down, APIError) and down.status == 503
    busy = engine_error(QueueFullError("9 waiting"))
    assert busy.status == 429 and "Retry-After" in busy.headers
    too_long = engine_error(ValueError("maximum context length is 8192 tokens"))
    assert too_long.status == 400
    other = RuntimeError("x")
    assert engine_error(other) is other
