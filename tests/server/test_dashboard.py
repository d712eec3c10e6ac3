"""The live dashboard (`GET /dashboard`) in a real headless browser, and its data route
`GET /v1/cache/dashboard` under hostile tenants.

One live server (a small KV cache: 34 blocks of 16 tokens) and one browser for the module. The
browser is Debian's chromium (`make chromium`; `make test` installs it) driven by playwright
through `executable_path`; playwright's own browsers are never downloaded.

Set DASHBOARD_SCREENSHOT=path to keep the admin page's screenshot (docs/dashboard.png is one).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import httpx
import pytest
from _helpers import grafana_metric_names, served_series

from prefixcache.server.launcher import ServerProcess

pytestmark = pytest.mark.slow

KEYS = {
    "keys": {
        "sk-alice": "alice",
        "sk-bob": "bob",
        "sk-ops": {"tenant": "ops", "admin": True},
    },
    "shared_namespaces": ["public"],
}
# Alice's prompt text, which nobody but alice may ever see (admins included).
SECRET = (
    "Alice's merger memo, strictly confidential: Northwind acquires Contoso for 41 dollars a "
    "share; announce on Friday after the close."
)
# The admin's own prompt (its text shows in the admin's list of top prefixes).
SYSTEM = (
    "You are the support assistant of Northwind Traders. Answer in at most two sentences, "
    "quote the order number, never promise a refund, and pass anything about invoices to the "
    "billing team. Orders ship from Rotterdam within three working days; returns are accepted "
    "for thirty days with the original packaging and the delivery note."
)
POLL_MS = 300
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    args = ["--api-keys-file", str(keys), "--kv-cache-memory", "24MiB", "--max-model-len", "1024"]
    with ServerProcess(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("Debian's chromium is missing: run `make chromium` (make test does)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield b
        b.close()


class Client:
    def __init__(self, server, key: str | None):
        self.base = server.base_url
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def get(self, path: str, status: int = 200) -> httpx.Response:
        r = httpx.get(self.base + path, headers=self.headers, timeout=60)
        assert r.status_code == status, r.text
        return r

    def post(self, path: str, body: dict) -> dict:
        r = httpx.post(self.base + path, json=body, headers=self.headers, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def usage(self, prompt, **extra) -> dict:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
        return self.post("/v1/completions", body)["usage"]

    def complete(self, prompt, **extra) -> int:
        return self.usage(prompt, **extra)["prompt_tokens_details"]["cached_tokens"]

    def data(self) -> dict:
        return self.get("/v1/cache/dashboard").json()


def ids(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 29000 for i in range(n)]


class Page:
    """One tab, logged in with ``key`` (None: no login, as on an open server); fails the test
    on any console error or page error."""

    def __init__(self, browser, server, key: str | None):
        self.context = browser.new_context(viewport={"width": 1280, "height": 1000})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(f"{server.base_url}/dashboard?interval={POLL_MS}")
        if key is not None:
            self.page.fill("#key", key)
            self.page.click("#connect")
        self.wait("document.querySelector('[data-metric=hit_rate]').textContent !== '–'")

    def wait(self, js: str, arg=None) -> None:
        # Polled from here, not with page.wait_for_function: that one re-checks inside the page
        # with eval() whenever its first check is false, which the page's Content-Security-Policy
        # (script-src 'self') refuses, so it failed only when the page was slower than the first
        # check (seen once under a parallel suite). page.evaluate goes through the debugger
        # protocol, which the policy does not govern.
        deadline = time.monotonic() + WAIT_MS / 1000
        while not self.page.evaluate(js, arg):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {WAIT_MS} ms waiting for: {js}")
            time.sleep(0.05)

    def metric(self, name: str) -> str:
        return self.page.text_content(f"[data-metric={name}]")

    def number(self, name: str) -> float:
        return float(self.metric(name).rstrip("%"))

    def wait_metric(self, name: str, op: str, value: float) -> float:
        """Wait until the figure ``name`` compares ``op`` (">" or "<") to ``value``."""
        self.wait(
            "([n, op, v]) => { const t = document.querySelector(`[data-metric=${n}]`)"
            ".textContent; const x = parseFloat(t); return op === '>' ? x > v : x < v; }",
            [name, op, value],
        )
        return self.number(name)

    def wait_for_poll(self) -> None:
        """Until the page has drawn data fetched after now (its 'updated' time changes)."""
        before = self.page.text_content("#status")
        self.wait("(b) => document.querySelector('#status').textContent !== b", before)
        self.wait("(b) => document.querySelector('#status').textContent !== b",
                  self.page.text_content("#status"))  # fmt: skip

    def close(self) -> None:
        assert self.errors == [], self.errors
        self.context.close()


def test_an_open_server_connects_without_a_click(browser):
    """`make serve` (no keys): the page shows the server at once, with no key asked for. A
    server of its own, started and stopped here, before the module's server with keys."""
    with ServerProcess(["--kv-cache-memory", "16MiB", "--max-model-len", "256"]) as srv:
        assert Client(srv, None).get("/dashboard/auth").json() == {"auth_required": False}
        tab = Page(browser, srv, None)  # waits for the first figures
        try:
            assert tab.page.text_content("#scope") == "tenant default (admin): the whole server"
            assert tab.page.is_hidden("#login") and tab.page.is_hidden("#forget")
            assert tab.page.is_visible("#board")
        finally:
            tab.close()


def test_page_and_data_route_auth(server):
    anon = Client(server, None)
    assert anon.get("/dashboard/auth").json() == {"auth_required": True}
    page = anon.get("/dashboard")
    assert "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    # Everything the page loads comes from this server: no CDN, no other origin.
    srcs = re.findall(r'(?:src|href)="([^"]*)"', page.text)
    assert srcs and all(s.startswith("/dashboard/") or s == "data:," for s in srcs), srcs
    for s in srcs:
        if s.startswith("/"):
            anon.get(s)
    anon.get("/dashboard/..%2Fapp.py", status=404)
    anon.get("/dashboard/nothing.js", status=404)
    anon.get("/v1/cache/dashboard", status=401)
    Client(server, "sk-wrong").get("/v1/cache/dashboard", status=401)


@pytest.fixture(scope="module")
def admin_tab(server, browser):
    """The admin's tab, open through the tests below (its charts span them all)."""
    tab = Page(browser, server, "sk-ops")
    yield tab
    tab.close()


def test_admin_page_shows_hits_pins_and_invalidations(server, admin_tab):
    ops = Client(server, "sk-ops")
    tab = admin_tab
    queried = tab.number("query_tokens")
    first = ops.usage(SYSTEM, return_cache_info=True)  # its miss is explained
    n = first["prompt_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0 and n > 64
    tab.wait_metric("query_tokens", ">", queried + n - 1)
    cold = tab.number("hit_rate")
    saved = tab.number("tokens_saved")
    hit = (n - 1) // 16 * 16  # every full block but the one holding the last token
    assert ops.complete(SYSTEM) == hit
    assert tab.wait_metric("hit_rate", ">", cold) > cold
    assert tab.wait_metric("tokens_saved", ">", saved) == saved + hit
    assert tab.number("requests_running") == 0 and tab.number("requests_waiting") == 0
    # its own prefix, with its text
    tab.wait("() => document.querySelector('#prefixes').textContent.includes('Northwind')")
    assert 0 <= tab.number("kv_usage") <= 100

    pinned = tab.number("pinned_blocks")
    out = ops.post("/v1/cache/warm", {"prompt": ids(2, 40), "pin": True, "ttl_seconds": 600})
    assert out["pinned_blocks"] == 2
    assert tab.wait_metric("pinned_blocks", ">", pinned) == pinned + 2

    cached = tab.number("cached_blocks")
    assert cached >= hit // 16 + 2  # the repeated prompt's blocks and the 2 pinned ones
    dropped = ops.post("/v1/cache/invalidate", {})["dropped_blocks"]
    assert dropped >= hit // 16 + 2
    assert tab.wait_metric("cached_blocks", "<", cached) == cached - dropped
    assert tab.number("pinned_blocks") == 0  # invalidation drops the pins too

    # The miss of the first request is explained; the hit is not a miss.
    tab.wait("() => document.querySelector('#misses').textContent.includes('no_prior_request')")
    assert tab.page.text_content("#misses").count("no_prior_request") == 1
    assert tab.errors == []


def test_tenant_sees_only_its_own_namespace(server, browser, admin_tab, tmp_path):
    alice, bob, ops = (Client(server, k) for k in ("sk-alice", "sk-bob", "sk-ops"))
    for _ in range(2):
        alice.complete(SECRET)
    alice.complete(ids(3, 40), cache_salt="drafts")
    bob.complete(ids(4, 40))
    assert bob.complete(ids(4, 40)) == 32

    # The data route: bob's view has no trace of alice, and alice's traffic moves none of
    # bob's figures.
    mine = bob.data()
    text = json.dumps(mine)
    assert mine["tenant"] == "bob" and mine["admin"] is False
    assert "alice" not in text and "merger" not in text and "drafts" not in text
    assert [n["namespace"] for n in mine["namespaces"]] == ["bob"]
    assert list(mine["activity"]["tenants"]) == ["bob"]
    assert mine["summary"]["tokens_saved"] == mine["stats"]["prefix_cache_hits_total"] == 32
    assert mine["summary"]["free_blocks"] is None  # the shared pool's counts are not his
    # his first request missed, unexplained (he did not ask); the repeat was a hit
    assert mine["activity"]["miss_reasons"] == {"not_explained": 1}
    assert mine["activity"]["requests"]["hit_requests"] == 1
    alice.complete(SECRET)
    done = time.time()
    again = bob.data()
    while again["time"] <= done:  # a snapshot read after alice's request (they live 0.5 s)
        time.sleep(0.1)
        again = bob.data()
    for part in ("summary", "namespaces", "activity"):
        assert again[part] == mine[part], part

    # Alice sees her own prefix's text; the admin sees that it exists, never its text.
    own = alice.data()["activity"]["top_prefixes"]
    assert any("merger" in (p["excerpt"] or "") for p in own)
    seen = ops.data()
    admin_view = [p for p in seen["activity"]["top_prefixes"] if p["namespace"] == "alice"]
    assert admin_view and all(p["excerpt"] is None for p in admin_view)
    assert "merger" not in json.dumps(seen)
    assert {"alice", "alice/drafts", "bob"} <= {n["namespace"] for n in seen["namespaces"]}

    # The page: bob's tab shows his numbers and nothing of alice.
    tab = Page(browser, server, "sk-bob")
    try:
        tab.wait("() => document.querySelector('#namespaces').textContent.includes('bob')")
        assert tab.number("tokens_saved") == 32
        body = tab.page.text_content("body")
        assert "alice" not in body and "merger" not in body and "drafts" not in body
        assert "your namespaces only" in tab.page.text_content("#scope")
        assert tab.page.is_hidden("#tenants-section")
    finally:
        tab.close()

    # The admin's tab lists every tenant but no text of theirs.
    tab = admin_tab
    tab.wait("() => document.querySelector('#tenants').textContent.includes('alice')")
    assert "merger" not in tab.page.text_content("body")
    assert "another tenant's: not shown" in tab.page.text_content("#prefixes")
    tab.wait_for_poll()
    shot = os.environ.get("DASHBOARD_SCREENSHOT") or str(tmp_path / "dashboard.png")
    tab.page.screenshot(path=shot, full_page=True)
    assert tab.errors == []


def test_grafana_dashboard_metrics_are_served(server):
    """Every prefixcache:* series the Grafana dashboard queries is in this server's /metrics."""
    admin = {"Authorization": "Bearer sk-ops"}  # with keys, /metrics needs an admin key
    served = served_series(httpx.get(server.base_url + "/metrics", headers=admin).text)
    missing = grafana_metric_names() - served
    assert not missing, missing
