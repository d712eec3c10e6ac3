"""The import rules of docs/design.md section 5, checked on the source: no import cycle among
our modules (imports inside functions and under TYPE_CHECKING count: a cycle is a cycle however
it is spelled), and no forbidden edge (an upper layer imported by a lower one, a concrete KV
connector imported by the engine, torch in the torch-free core)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "prefixcache"


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in ROOT.rglob("*.py")}


def _imports(mod: str, path: Path) -> set[str]:
    """Every module ``mod`` imports anywhere in its file: ours resolved to the module (or the
    package, for a name that is not a module), others by their top-level name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for n in names:
            if not n.startswith("prefixcache"):
                out.add(n.split(".")[0])
                continue
            while n not in MODULES and "." in n:
                n = n.rsplit(".", 1)[0]
            if n != mod:
                out.add(n)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _under(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_there_is_no_import_cycle():
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in MODULES:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert cycles == []


# (who, what it must never import: modules/packages of ours or top-level names like torch,
#  [the exceptions])
API = ["prefixcache.api", "prefixcache.config"]
CORE = ["prefixcache.cache", "prefixcache.sequence"]
FEATURES = ["prefixcache.segments", "prefixcache.tiers", "prefixcache.events"]
CONNECTORS = ["prefixcache.connectors"]
ENGINE = ["prefixcache.engine"]
UPPER = ["prefixcache.server", "prefixcache.cluster", "prefixcache.bench", "prefixcache.analyze",
         "prefixcache.cli", "prefixcache.generate_cli"]  # fmt: skip
TORCH_FREE = [*API, *CORE, "prefixcache.tiers", "prefixcache.events", "prefixcache.segments.plan",
              "prefixcache.engine.scheduler", "prefixcache.engine.fairness"]  # fmt: skip
RULES = [
    *((m, ["torch"]) for m in TORCH_FREE),
    # config validates the KV events endpoints with events/access.py, which imports nothing of ours
    ("prefixcache.config", ["prefixcache"], ["prefixcache.events.access"]),
    ("prefixcache.events.access", ["prefixcache"]),
    ("prefixcache.api.errors", ["prefixcache"]),
    ("prefixcache.kernels", ["prefixcache"]),
    # api/ is the boundary: plain data and protocols, the lowest layer (a segments request's
    # SegmentRequest and SegmentOptions are api/segments.py's, not the segments feature's)
    ("prefixcache.api", [*CORE, *FEATURES, *CONNECTORS, *ENGINE, *UPPER, "prefixcache.model", "prefixcache.kv"]),
    # The cache core knows no feature: connectors plug in through cache/connector.py.
    ("prefixcache.cache", [*FEATURES, *CONNECTORS, *ENGINE, *UPPER, "prefixcache.model", "prefixcache.kv"]),
    # The cache core imports sequence.py, never the reverse (a block key's type: api/keys.py).
    ("prefixcache.sequence", [*CORE, *FEATURES, *CONNECTORS, *ENGINE, *UPPER, "prefixcache.model"]),
    # The model imports kv/, never the reverse: the architecture kv/ is sized by is
    # model/config.py's ModelConfig, a leaf (not the loader's).
    ("prefixcache.kv", [*FEATURES, *CONNECTORS, *ENGINE, *UPPER, "prefixcache.model"],
     ["prefixcache.model.config"]),
    ("prefixcache.model.config", ["prefixcache"]),
    ("prefixcache.model", [*FEATURES, *CONNECTORS, *ENGINE, *UPPER]),
    # Features are libraries: they know no connector, no engine, no server.
    ("prefixcache.tiers", [*CONNECTORS, *ENGINE, *UPPER, "prefixcache.model", "prefixcache.kv",
                           "prefixcache.segments", "prefixcache.events"]),
    ("prefixcache.events", [*CONNECTORS, *ENGINE, *UPPER, "prefixcache.model", "prefixcache.tiers",
                            "prefixcache.segments", "prefixcache.cache.connector"]),
    # Segments reach the model through the runner's public API only.
    ("prefixcache.segments", [*CONNECTORS, *ENGINE, *UPPER, "prefixcache.tiers", "prefixcache.events",
                              "prefixcache.kv", "prefixcache.model"], ["prefixcache.model.runner"]),
    ("prefixcache.connectors", [*ENGINE, *UPPER]),
    # The engine knows the connector protocol, never a concrete connector (connectors/build.py
    # does), and no feature: a segments request's data is api/segments.py's.
    ("prefixcache.engine", [*FEATURES, *CONNECTORS, *UPPER], ["prefixcache.connectors.build"]),
    ("prefixcache.engine.scheduler", ["prefixcache.model", "prefixcache.kv"]),
    ("prefixcache.server", ["prefixcache.engine.llm_engine", "prefixcache.engine.scheduler",
                            "prefixcache.model.runner", "prefixcache.cache.manager",
                            "prefixcache.cache.block_pool", *CONNECTORS, "prefixcache.cluster"]),
    # analyze may import bench (its datasets, the Mooncake trace reader), never the reverse.
    ("prefixcache.bench", [*ENGINE, *CONNECTORS, "prefixcache.server", "prefixcache.cache",
                           "prefixcache.model.runner", "prefixcache.analyze"]),
]


@pytest.mark.parametrize("rule", RULES, ids=[r[0] for r in RULES])
def test_no_forbidden_import(rule):
    """(who, never[, except]): nothing under ``who`` imports what is under ``never`` (its own
    package aside), except what is under ``except``."""
    who, never, allowed = (*rule, ())[:3]
    never_ours = [n for n in never if n.startswith("prefixcache")]
    never_theirs = {n for n in never if not n.startswith("prefixcache")}
    bad = sorted(
        (m, t)
        for m, deps in GRAPH.items()
        if _under(m, [who])
        for t in deps
        if t in never_theirs
        or (_under(t, never_ours) and not _under(t, [who]) and not _under(t, allowed))
    )
    assert bad == []


def _package(mod: str) -> str:
    """``prefixcache.X`` for a module under it (a top-level module is its own package)."""
    return ".".join(mod.split(".")[:2])


# A leaf imports nothing of ours, so it sits below every layer whichever package holds it: kv/
# takes ModelConfig from model/config.py though model/ imports kv/.
LEAVES = ["prefixcache.model.config"]


def test_no_two_packages_import_each_other():
    """Layers, not just no cycle of modules: of two packages, at most one imports the other
    (the leaves aside). Each pair this found was a type one layer too high (#40: SegmentRequest
    in segments/, ModelConfig in the loader, BlockHash in cache/, the trace reader in analyze/)."""
    assert [m for m in LEAVES if any(d in MODULES for d in GRAPH[m])] == []
    edges = {(_package(m), _package(d)) for m, deps in GRAPH.items() for d in deps
             if d in MODULES and d not in LEAVES and _package(d) != _package(m)}  # fmt: skip
    assert sorted((a, b) for a, b in edges if a < b and (b, a) in edges) == []


def test_the_server_builds_an_async_engine_in_cli_only():
    users = sorted(m for m, deps in GRAPH.items() if _under(m, ["prefixcache.server"])
                   and "prefixcache.engine.async_engine" in deps)  # fmt: skip
    assert users == ["prefixcache.server.cli"]


def test_the_rules_see_the_imports():
    """The checks above would pass on an empty graph: they must not."""
    assert "prefixcache.cache.connector" in GRAPH["prefixcache.engine.llm_engine"]
    assert "prefixcache.connectors.build" in GRAPH["prefixcache.engine.llm_engine"]
    assert "torch" in GRAPH["prefixcache.model.llama"]
    assert "prefixcache.engine.llm_engine" in GRAPH["prefixcache.engine.async_engine"]
    assert "prefixcache.engine.async_engine" in GRAPH["prefixcache.server.cli"]  # inside a function
