"""server/ by API surface (issue #40 step 5), checked on the source: the shared base, the HTTP
edge and observability import no API package; neither API imports the other. Only
server/app.py names them all (each package hands its routes, renderer and error dialect to the
base as a ``Surface``). Imports inside functions and under TYPE_CHECKING count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parent.parent / "prefixcache" / "server"
PKG = "prefixcache.server"
OPENAI, ANTHROPIC, CACHE = f"{PKG}.openai", f"{PKG}.anthropic", f"{PKG}.cache"
APIS = [OPENAI, ANTHROPIC, CACHE]


def _module(path: Path) -> str:
    parts = path.relative_to(SERVER.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (a name imported from a package counts as its submodule)."""
    mod = _module(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _files(folder: str) -> list[Path]:
    return sorted((SERVER / folder).rglob("*.py"))


def _under(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _offenders(folders, forbidden) -> list[tuple[str, str]]:
    return sorted((_module(f), name) for folder in folders for f in _files(folder)
                  for name in _imports(f) if _under(name, forbidden))  # fmt: skip


def test_the_shared_server_base_imports_neither_api():
    assert _offenders(["base"], APIS) == []


@pytest.mark.parametrize("folder", ["edge", "observability"])
def test_the_edge_and_observability_import_no_api(folder):
    assert _offenders([folder], APIS) == []


@pytest.mark.parametrize("api,other", [("openai", ANTHROPIC), ("anthropic", OPENAI),
                                       ("anthropic", CACHE), ("openai", CACHE)])  # fmt: skip
def test_an_api_does_not_import_another(api, other):
    assert _offenders([api], [other]) == []


def test_the_checks_see_the_imports():
    """The checks above would pass on an empty tree: they must not."""
    assert f"{PKG}.base.serving.Serving" in _imports(SERVER / "base" / "app.py")
    assert f"{ANTHROPIC}.prompt.MessagesRenderer" in _imports(SERVER / "anthropic" / "surface.py")
    app = _imports(SERVER / "app.py")
    assert all(any(_under(n, [api]) for n in app) for api in APIS)  # the one place naming them
    assert len(_files("base")) >= 6 and len(_files("openai")) >= 5
