"""The import rules of docs/design.md section 5, checked on the source: no import cycle among
our modules (imports inside functions and under TYPE_CHECKING count: a cycle is a cycle however
it is spelled), no forbidden edge (an upper layer imported by a lower one, a concrete KV
connector imported by the engine, torch in the torch-free core), no two packages importing each
other, and design.md's may-import table true to the code."""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest

from prefixcache.api.request import CacheReport
from prefixcache.sequence import SeqKV, SeqOutput, Sequence

ROOT = Path(__file__).resolve().parents[2] / "prefixcache"


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
    # Tokenizers are text, not the model: the server, the ingress, bench and analyze load one
    # without torch; model.paths (a leaf) finds the file.
    ("prefixcache.tokenizer", ["torch", *CORE, *FEATURES, *CONNECTORS, *ENGINE, *UPPER,
                               "prefixcache.kv", "prefixcache.model"], ["prefixcache.model.paths"]),
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
    # The KV cache manager is the cache core's only face (issue #40): the pool, the index and
    # the eviction policies are the manager's to use (test_nothing_reaches_past_the_manager).
    *((who, ["prefixcache.cache.block_pool", "prefixcache.cache.prefix_index",
             "prefixcache.cache.eviction"]) for who in [*ENGINE, *CONNECTORS, *FEATURES]),
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
LEAVES = ["prefixcache.model.config", "prefixcache.model.paths"]


def test_no_two_packages_import_each_other():
    """Layers, not just no cycle of modules: of two packages, at most one imports the other
    (the leaves aside). Each pair this found was a type one layer too high (#40: SegmentRequest
    in segments/, ModelConfig in the loader, BlockHash in cache/, the trace reader in analyze/)."""
    assert [m for m in LEAVES if any(d in MODULES for d in GRAPH[m])] == []
    edges = {(_package(m), _package(d)) for m, deps in GRAPH.items() for d in deps
             if d in MODULES and d not in LEAVES and _package(d) != _package(m)}  # fmt: skip
    assert sorted((a, b) for a, b in edges if a < b and (b, a) in edges) == []


PAST_THE_MANAGER = ("pool", "index")


def _reaches(path: Path) -> list[str]:
    """``x.pool`` / ``x.index`` read anywhere in the file (a call such as ``list.index(v)`` is
    not a reach)."""
    tree = ast.parse(path.read_text())
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return [f"{path.name}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in PAST_THE_MANAGER
            and id(n) not in called]  # fmt: skip


def test_nothing_reaches_past_the_manager():
    """Issue #40: the engine, the connectors and the features use the cache core through
    KVCacheManager only (events, pins, invalidation, integrity, installing restored blocks):
    no ``.pool`` or ``.index`` outside cache/."""
    who = [*ENGINE, *CONNECTORS, *FEATURES]
    bad = [r for m, p in MODULES.items() if _under(m, who) for r in _reaches(p)]
    assert bad == []
    # the check sees a reach where there is one
    assert _reaches(MODULES["prefixcache.cache.manager"])


def _model_calls(path: Path) -> list[str]:
    """Calls that run the model: ``runner.execute(...)`` / ``runner.model(...)`` and the like
    (``ModelRunner``'s forward, the model itself; a Redis pipeline's execute is not one)."""
    tree = ast.parse(path.read_text())
    return [f"{path.name}:{n.lineno} {ast.unparse(n.func)}" for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("execute", "model")
            and ast.unparse(n.func.value).split(".")[-1] in ("runner", "model", "self")]  # fmt: skip


def test_only_the_engine_runs_forwards():
    """Issue #40 step 4: a step has one forward, the engine's. The connectors and the features
    hand it pieces (``KVConnector.prefill``); none runs the model itself (segments used to run
    1 + N forwards of their own per step through a runner API only they used)."""
    who = [*CONNECTORS, *FEATURES]
    assert [r for m, p in MODULES.items() if _under(m, who) for r in _model_calls(p)] == []
    assert _model_calls(MODULES["prefixcache.engine.llm_engine"])  # the check sees a call
    from prefixcache.cache.connector import KVConnector
    from prefixcache.model.runner import ModelRunner

    assert not hasattr(KVConnector, "take_scheduled")
    public = {n for n in vars(ModelRunner) if not n.startswith("_")}
    assert public == {"allocate_kv", "execute", "read_kv", "write_kv", "copy_kv", "all_logits"}


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


# ---- Sequence in parts, one writer each (issue #40) -------------------------------------------
# A part of Sequence (sequence.py) and the one module that writes its fields.
PART_OWNERS = {"kv": (SeqKV, "prefixcache.cache.manager"),
               "out": (SeqOutput, "prefixcache.engine.output")}  # fmt: skip
# The cache report (api.request.CacheReport) a Sequence carries: each field has its writer.
REPORT_WRITERS = {
    "num_cached_tokens": "prefixcache.cache.manager",
    "tier_tokens": "prefixcache.connectors.tiers",
    "num_segment_cached_tokens": "prefixcache.segments.assembler",
    "cache_info": "prefixcache.engine.llm_engine",
    "lease_grants": "prefixcache.engine.llm_engine",
}  # fmt: skip
# Sequence's own fields and who may write them once it is built (none: never written).
FIELD_WRITERS = {
    "request": (), "prompt_token_ids": (), "kv": (), "out": (), "metrics": (),
    "status": ("prefixcache.engine.scheduler", "prefixcache.cache.connector",
               "prefixcache.engine.llm_engine"),
    "arrival_step": ("prefixcache.engine.scheduler",),
    "num_preemptions": ("prefixcache.engine.scheduler",),
    "cache": (),
    "error": ("prefixcache.engine.llm_engine",),
    "generator": ("prefixcache.engine.llm_engine",),
}  # fmt: skip
# The names our code gives a Sequence (``x.seq`` too: a ScheduledSeq's).
SEQ_NAMES = {"seq", "s", "sequence", "victim"}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault",
            "sort", "reverse", "__setitem__", "__delitem__", "popitem"}  # fmt: skip


def _targets(tree: ast.AST):
    """Every expression ``tree`` writes to: assignment and ``del`` targets (tuples unpacked,
    item and slice assignments as their container), and what a mutating method is called on."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in MUTATORS):  # fmt: skip
            targets = [node.func.value]
        else:
            continue
        stack = list(targets)
        while stack:
            t = stack.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                stack.extend(t.elts)
            elif isinstance(t, ast.Starred):
                stack.append(t.value)
            else:
                while isinstance(t, ast.Subscript):
                    t = t.value
                yield t


def _is_seq(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in SEQ_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr == "seq")


def _sequence_writes(source: str) -> list[tuple[str, int]]:
    """(what, line) of each write to a Sequence part's field (``seq.kv.block_table = ...``,
    ``s.seq.kv.block_table.extend(...)``, ``seq.out.text += ...``: ``kv.<field>`` with the field
    one of SeqKV's, so the KV pool called ``kv`` elsewhere does not count) and to a Sequence's
    own field on a name that holds one (``seq.status = ...``)."""
    out = []
    for t in _targets(ast.parse(source)):
        if not isinstance(t, ast.Attribute):
            continue
        v = t.value
        if isinstance(v, ast.Attribute) and v.attr == "cache" and t.attr in REPORT_WRITERS:
            out.append((f"cache.{t.attr}", t.lineno))
        elif isinstance(v, ast.Attribute) and v.attr in PART_OWNERS:
            if t.attr in {f.name for f in fields(PART_OWNERS[v.attr][0])}:
                out.append((f"{v.attr}.{t.attr}", t.lineno))
        elif t.attr in FIELD_WRITERS and _is_seq(v):
            out.append((t.attr, t.lineno))
    return out


WRITES = {m: _sequence_writes(p.read_text()) for m, p in MODULES.items()}


def test_sequence_has_few_fields():
    """Issue #40: at most 15, each in FIELD_WRITERS (a new field says who writes it)."""
    names = [f.name for f in fields(Sequence)]
    assert len(names) <= 15, names
    assert sorted(names) == sorted(FIELD_WRITERS)
    assert sorted(REPORT_WRITERS) == sorted(f.name for f in fields(CacheReport))


def test_each_part_of_a_sequence_has_one_writer():
    """``seq.kv`` is the KV cache manager's, ``seq.out`` the output processor's; a Sequence's
    own fields are written by the modules FIELD_WRITERS names."""
    bad = []
    for mod, writes in sorted(WRITES.items()):
        for what, line in writes:
            part = what.split(".")[0] if "." in what else None
            if part == "cache":
                allowed = (REPORT_WRITERS[what.split(".")[1]],)
            else:
                allowed = (PART_OWNERS[part][1],) if part else FIELD_WRITERS[what]
            if mod not in allowed:
                bad.append(f"{mod}:{line} writes {what}")
    assert bad == []


def test_the_writer_check_sees_writes():
    """The check above would pass if it saw nothing: it must see the owners' writes."""
    manager = {w for w, _ in WRITES["prefixcache.cache.manager"]}
    assert {"kv.block_table", "kv.num_computed_tokens", "kv.block_keys", "kv.join",
            "kv.window_from", "cache.num_cached_tokens"} <= manager  # fmt: skip
    assert {"cache.cache_info", "cache.lease_grants"} <= {
        w for w, _ in WRITES["prefixcache.engine.llm_engine"]}
    assert {"out.text", "out.output_token_ids", "out.finish_reason"} <= {
        w for w, _ in WRITES["prefixcache.engine.output"]}
    assert "status" in {w for w, _ in WRITES["prefixcache.engine.scheduler"]}
    probe = ("def f(seq, s):\n    seq.kv.block_table[0] = 1\n    s.seq.out.text += 'x'\n"
             "    a, seq.kv.join = 1, 2\n    del seq.out.output_logprobs[:]\n"
             "    self.kv.root(None)\n    seq.status = 1\n    job.status = 2\n"
             "    seq.cache.tier_tokens['disk'] = 3\n    self.cache.write_block(1, b'')\n")  # fmt: skip
    found = sorted(w for w, _ in _sequence_writes(probe))
    assert found == ["cache.tier_tokens", "kv.block_table", "kv.join", "out.output_logprobs",
                     "out.text", "status"]


# ---- docs/design.md's may-import table, read as rules -----------------------------------------
DESIGN = ROOT.parent / "docs" / "design.md"
ALL = "*"  # "everything of ours"
# The words a cell may use besides backticked modules and packages (relative to prefixcache;
# `prefixcache` itself is the package's __init__ only).
WORDS = {"features": FEATURES, "connectors": CONNECTORS, "upper layers": UPPER,
         "everything of ours": [ALL], "nothing of ours": []}  # fmt: skip
THIRD_PARTY = {"torch", "ray"}


def _covers(item: str, mod: str) -> bool:
    if item == ALL:
        return True
    return mod == item or (item != "prefixcache" and mod.startswith(item + "."))


def _cell(text: str) -> tuple[list, set]:
    """A cell: (our modules and packages, third-party names; groups as their members). Words
    in parentheses are remarks; items are separated by commas and semicolons."""
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", "", text)
    ours, theirs = [], set()
    for item in (i.strip() for i in re.split(r"[,;]", text)):
        if m := re.fullmatch(r"`([\w.]+)/?`", item):
            ours.append("prefixcache" if m[1] == "prefixcache" else f"prefixcache.{m[1]}")
        elif item in WORDS:
            ours.append(tuple(WORDS[item]))  # a group: any member counts as its use
        elif item in THIRD_PARTY:
            theirs.add(item)
        elif item:
            raise AssertionError(f"design.md's import table: {item!r} is not a module, a group "
                                 f"({', '.join(WORDS)}) or {' or '.join(sorted(THIRD_PARTY))}")
    return ours, theirs


def _flat(items) -> list[str]:
    return [x for i in items for x in (i if isinstance(i, tuple) else (i,))]


def _design_table() -> list[tuple[list, tuple, tuple]]:
    lines = DESIGN.read_text().splitlines()
    start = lines.index("| package | may import | never |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        who, may, never = (c.strip() for c in line.strip().strip("|").split("|"))
        rows.append((_flat(_cell(who)[0]), _cell(may), _cell(never)))
    return rows


TABLE = _design_table()


def _row_of(mod: str):
    """The most specific row naming ``mod`` (``engine.scheduler`` before ``engine/``)."""
    named = [(len(w), i) for i, row in enumerate(TABLE) for w in row[0] if _covers(w, mod)]
    return TABLE[max(named)[1]] if named else None


def test_design_md_import_table_is_true():
    """design.md section 5's table, cell by cell, against the import graph: a false cell fails.

    - every module has a row, and what it imports outside its own package is under its row's
      "may import" (its most specific row's);
    - nothing a row covers imports what is under its "never", unless it is under a "may import"
      entry more specific than that (`kv/` may import `model.config`, never the rest of `model`);
    - every "may import" entry is imported by some module of its row (none is stale), and every
      name in the table exists."""
    problems = []
    for row in TABLE:
        for name in [*row[0], *_flat(row[1][0]), *_flat(row[2][0])]:
            if not any(_covers(name, m) for m in MODULES):
                problems.append(f"{name}: no such module or package")
    used = set()
    for mod, deps in sorted(GRAPH.items()):
        row = _row_of(mod)
        if row is None:
            problems.append(f"{mod}: no row in the table")
            continue
        may = _flat(row[1][0])
        for dep in sorted(deps):
            if dep in row[1][1]:
                used.add((id(row), dep))
            if dep not in MODULES or _package(dep) == _package(mod):
                continue
            found = [m for m in may if _covers(m, dep)]
            used.update((id(row), m) for m in found)
            if not found:
                problems.append(f"{mod} imports {dep}: not in its row's may-import cell")
        for other in TABLE:
            if not any(_covers(w, mod) for w in other[0]):
                continue
            for dep in sorted(deps):
                if dep in other[2][1]:
                    problems.append(f"{mod} imports {dep}: its row says never")
                if dep not in MODULES or _package(dep) == _package(mod):
                    continue
                for never in _flat(other[2][0]):
                    exempt = any(_covers(never, m) and _covers(m, dep) and m != never
                                 for m in _flat(other[1][0]))  # fmt: skip
                    if _covers(never, dep) and not exempt:
                        problems.append(f"{mod} imports {dep}: its row says never {never}")
    for row in TABLE:
        for item in [*row[1][0], *sorted(row[1][1])]:
            members = item if isinstance(item, tuple) else (item,)
            if members and not any((id(row), m) in used for m in members):
                problems.append(f"row {row[0]}: no module of it imports {item}")
    assert problems == []


def test_the_table_is_read():
    """The check above would pass on an empty table: it must not."""
    assert len(TABLE) >= 15
    assert _row_of("prefixcache.engine.scheduler")[0] == ["prefixcache.engine.scheduler",
                                                         "prefixcache.engine.fairness"]
    assert _row_of("prefixcache.engine.llm_engine")[0] == ["prefixcache.engine"]
    with pytest.raises(AssertionError, match="not a module"):
        _cell("`cache`, the cache core")
