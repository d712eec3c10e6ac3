"""docs/design.md is spot-checkable (issue #40): every file, module and identifier it names in
backticks exists and holds, outside section 10 (the changelog, which names old paths on
purpose). Read with ast, nothing imported: a renamed file, module, class or method the
document still names fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "prefixcache"
DESIGN = REPO / "docs" / "design.md"


def _body() -> str:
    text = DESIGN.read_text()
    return text[: text.index("## 10. Changelog")]


def _tokens() -> set[str]:
    return {t.rstrip(",;:") for t in re.findall(r"`([^`\s]+)`", _body())}


FILES = {p.relative_to(REPO).as_posix() for p in REPO.rglob("*")
         if ".git" not in p.parts and ".venv" not in p.parts and ".bench" not in p.parts}  # fmt: skip
BASENAMES = {f.rsplit("/", 1)[-1] for f in FILES}
MODULES = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
           for p in ROOT.rglob("*.py")}  # fmt: skip


BASES: dict[str, set[str]] = {}  # class name -> the names of its bases (ours by name)


def _names_in(tree: ast.AST) -> dict[str, set[str]]:
    """Top-level names of a module, and for each class the names it defines (methods, class
    attributes and fields, ``self.x`` assignments in its methods)."""
    out: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[""].add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out[""].update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out[""].update((a.asname or a.name).split(".")[0] for a in node.names)
        if isinstance(node, ast.ClassDef):
            names = out.setdefault(node.name, set())
            BASES.setdefault(node.name, set()).update(
                b.id for b in node.bases if isinstance(b, ast.Name))
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(sub.name)
                elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                    names.add(sub.target.id)
                elif isinstance(sub, ast.Assign):
                    names.update(t.id for t in sub.targets if isinstance(t, ast.Name))
                if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                    names.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                                 and isinstance(t.value, ast.Name) and t.value.id == "self")  # fmt: skip
    return out


NAMES = {m: _names_in(ast.parse(p.read_text())) for m, p in MODULES.items()}
CLASSES: dict[str, list[set[str]]] = {}
for _names in NAMES.values():
    for _cls, _members in _names.items():
        if _cls:
            CLASSES.setdefault(_cls, []).append(_members)


def _is_path(t: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]*)+|[\w-]+\.(py|cpp|h|md|sh|toml|js|css|html)", t))


def _path_exists(t: str) -> bool:
    t = t.rstrip("/")
    if t.startswith("/"):  # an HTTP route
        return True
    prefixes = ["", "prefixcache/", "docs/", "benchmarks/", "tests/"]
    if any(p + t in FILES for p in prefixes):
        return True
    return "/" not in t and t in BASENAMES  # a file named in its folder's context


def _resolves(t: str) -> bool | None:
    """True/False for a dotted name rooted at one of our modules or classes; None if it is
    neither (a library's name, an expression)."""
    parts = t.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        mod = mod if mod.startswith("prefixcache") else "prefixcache." + mod
        if mod in MODULES:
            rest = parts[i:]
            if not rest:
                return True
            names = NAMES[mod]
            if rest[0] not in names[""]:
                return False
            return len(rest) == 1 or rest[1] in _members(rest[0])
    if parts[0] in CLASSES and len(parts) == 2:
        return parts[1] in _members(parts[0])
    return None


def _members(cls: str, seen=()) -> set[str]:
    """A class's names, its bases' (ours, by name) included."""
    out = set().union(*CLASSES.get(cls, [set()]))
    for base in BASES.get(cls, ()):
        if base not in seen:
            out |= _members(base, (*seen, cls))
    return out


def test_every_file_design_md_names_exists():
    missing = sorted(t for t in _tokens() if _is_path(t) and not _path_exists(t))
    assert missing == []
    paths = [t for t in _tokens() if _is_path(t)]
    assert len(paths) >= 30 and not _path_exists("cache/no_such_module.py")


def test_every_module_and_identifier_design_md_names_holds():
    dotted = [t for t in _tokens() if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", t)
              and not _is_path(t)]  # fmt: skip
    false = sorted(t for t in dotted if _resolves(t) is False)
    assert false == []
    # the checks see what they check: names that hold, and ones that would not
    assert _resolves("cache.manager.KVCacheManager") and _resolves("KVCacheManager.install")
    assert _resolves("cache.manager.NoSuchThing") is False and _resolves("BlockPool.nope") is False
    assert sum(_resolves(t) is True for t in dotted) >= 30
