"""server/ by API surface (issue #40 step 5), checked on the source: the shared base, the HTTP
edge and observability import no API package; neither API imports the other. Only
server/app.py names them all (each package hands its routes, renderer and error dialect to the
base as a ``Surface``). Imports inside functions and under TYPE_CHECKING count."""

from __future__ import annotations

import pytest
from test_layering import GRAPH, _under  # the import graph, read once for both files

PKG = "prefixcache.server"
OPENAI, ANTHROPIC, CACHE = f"{PKG}.openai", f"{PKG}.anthropic", f"{PKG}.cache"
APIS = [OPENAI, ANTHROPIC, CACHE]


def _modules(folder: str) -> list[str]:
    return sorted(m for m in GRAPH if _under(m, [f"{PKG}.{folder}"]))


def _offenders(folders, forbidden) -> list[tuple[str, str]]:
    return sorted((m, d) for folder in folders for m in _modules(folder)
                  for d in GRAPH[m] if _under(d, forbidden))  # fmt: skip


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
    assert f"{PKG}.base.serving" in GRAPH[f"{PKG}.base.app"]
    assert f"{ANTHROPIC}.prompt" in GRAPH[f"{ANTHROPIC}.surface"]
    app = GRAPH[f"{PKG}.app"]
    assert all(any(_under(n, [api]) for n in app) for api in APIS)  # the one place naming them
    assert len(_modules("base")) >= 6 and len(_modules("openai")) >= 5
    assert _offenders(["app"], [ANTHROPIC])  # app.py does name an API: a check would see it
