"""Converted weights and tokenizer kept between starts, so a second start skips the GGUF parse.

Reading the default model (SmolLM2-135M-Instruct, a 98 MB Q4_1 GGUF file) costs 5-11 s in
``load_weights`` (``gguf.GGUFReader`` builds ~49k vocabulary strings in Python before any tensor,
then the dequantization) and 4-6 s more in ``load_tokenizer`` (the same parse again, then the
BPE pipeline): 16.7 s together, median of 3 on the 2-core development machine under a load
average of ~2. One cache entry holds both results; read back they take 0.75 s there (the file
digest 0.05 s, checksums 0.15 s, ``Tokenizer.from_str`` 0.1-0.3 s, the tensors are mapped):

    load_model(path, cache_dir)  ->  (LoadedWeights, Tokenizer)

Layout, under ``EngineConfig.weights_cache_dir`` ("auto": ``$PREFIXCACHE_CACHE_DIR``, else
``$XDG_CACHE_HOME/prefixcache``, else ``~/.cache/prefixcache``; None turns the cache off)::

    weights/<xxh3_128 of the model file>.v<FORMAT_VERSION>.<build>/
        meta.json            the key parts, ModelConfig, weights_digest, tensor names in load
                             order, the quantized groups' classes and sizes, the tokenizer's ids
                             and chat template, and an xxh3_128 checksum of each file below
        tensors.safetensors  every tensor of LoadedWeights.tensors (float32) under its own name,
                             and the tensors of each quantized group (LoadedWeights.int4 and any
                             other such dict) as <name>:<dict>.<part>, e.g. <name>:int4.q
        tokenizer.json       the ``tokenizers`` pipeline (``Tokenizer.to_str()``)

The entry for the default model is ~700 MB: the float32 copies of the 4-bit weights are kept
(400 MB of it) rather than recomputed (0.8 s on one core). The tensors are memory-mapped, so a
copy the model never reads (the int4 kernels run the groups) costs neither time nor memory.

Key: the model file's content (xxh3_128 over its bytes, ~0.05 s for 98 MB; a renamed or copied
file hits, a file changed in place misses) and the build: FORMAT_VERSION, the source of the code
that converts (``loader.py`` and the ``config.py`` it fills, ``tokenizer/gguf.py``, this module)
and the versions of gguf, numpy, torch, tokenizers and safetensors. A changed file, conversion
or library lands on a new key, so a stale entry is never read; writing the new entry removes the
other builds of the same file.

Safety: an entry is written into a temporary directory beside it, fsynced, then renamed into
place, so a crash or a concurrent start never leaves a half entry under the key; a second process
that finds the entry made uses it, one that loses the race to rename drops its own copy. On read,
meta.json must name the same format, build and file digest and both files must match their
checksums (0.1 s); anything else, an unreadable or truncated file included, counts as a miss: a
warning, a load from the model file, and the entry is replaced. No cache problem fails a start:
an unwritable directory logs a warning and the model loads from its file.

Hugging Face directories are not cached: nothing in them is parsed, a load is reading the
safetensors and a dtype cast (measured on SmolLM2-135M saved as one bf16 safetensors file: 1.0 to
1.5 s for the weights, 0.2 to 0.4 s for ``tokenizer.json``). A cache could save only the cast, at
the price of a second, float32 copy of the checkpoint on disk (twice the size of a bf16 one).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import xxhash

from prefixcache.model import loader as _loader
from prefixcache.model.config import ModelConfig
from prefixcache.model.loader import LoadedWeights
from prefixcache.model.paths import open_gguf, resolve_model_path
from prefixcache.tokenizer.gguf import GGUFTokenizer, read_gguf_tokenizer
from prefixcache.tokenizer.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_gguf_spec

__all__ = ["FORMAT_VERSION", "build_id", "file_digest", "load_model", "resolve_cache_dir", "stats"]

log = logging.getLogger(__name__)

# Bump when the layout or the meaning of an entry changes (the build id changes with this file's
# source anyway; the number makes the change visible in the directory names).
FORMAT_VERSION = 1
# Code and libraries whose change may change what a load returns.
_BUILD_MODULES = ("prefixcache.model.loader", "prefixcache.model.config", "prefixcache.tokenizer.gguf",
                  __name__)  # fmt: skip
_BUILD_PACKAGES = ("gguf", "numpy", "torch", "tokenizers", "safetensors")
# LoadedWeights fields stored as themselves. Every other field must be a dict of name -> a
# dataclass of loader.py (Int4Groups, ...) whose fields are tensors or JSON values: a "group
# dict", stored generically. A field of another shape is never dropped silently: the cache then
# steps aside (_describe).
_PLAIN_FIELDS = ("config", "tensors", "source", "weights_digest")
_TENSORS, _TOKENIZER, _META = "tensors.safetensors", "tokenizer.json", "meta.json"
_STALE_TMP_S = 3600  # a temporary directory this old belongs to a writer that died

# What happened to loads in this process: hit, miss, write, bad (unreadable entry), bypass.
stats: Counter[str] = Counter()


class _BadEntry(ValueError):
    """An entry that is not what its key says: stale metadata, a wrong checksum, missing parts."""


# ---- keys ------------------------------------------------------------------------------------
def resolve_cache_dir(setting: str | Path | None) -> Path | None:
    """The cache root for ``EngineConfig.weights_cache_dir``; None when the cache is off."""
    if setting is None or str(setting).strip().lower() in ("", "none"):
        return None
    if str(setting) == "auto":
        if os.environ.get("PREFIXCACHE_CACHE_DIR"):
            return Path(os.environ["PREFIXCACHE_CACHE_DIR"]).expanduser()
        xdg = os.environ.get("XDG_CACHE_HOME")
        return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "prefixcache"
    return Path(setting).expanduser()


def file_digest(path: Path, chunk_size: int = 1 << 22) -> str:
    """xxh3_128 over the file's bytes, read in chunks."""
    h = xxhash.xxh3_128()
    buf = bytearray(chunk_size)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _package_versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for name in _BUILD_PACKAGES:
        try:
            parts.append(f"{name}={version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name}=-")
    return ",".join(parts)


_versions: str | None = None


def build_id() -> str:
    """16 hex digits over FORMAT_VERSION, the converting code and the library versions."""
    global _versions
    if _versions is None:
        _versions = _package_versions()
    h = xxhash.xxh3_64(f"format={FORMAT_VERSION};{_versions}".encode())
    for name in _BUILD_MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        h.update(name.encode())
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()


def _entry_name(digest: str, build: str) -> str:
    return f"{digest}.v{FORMAT_VERSION}.{build}"


def _checksum(path: Path) -> str:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_128(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return xxhash.xxh3_128(m).hexdigest()


# ---- loading ---------------------------------------------------------------------------------
def load_model(
    model: str | Path | None,
    cache_dir: str | Path | None = "auto",
    load_weights: Any = None,
) -> tuple[LoadedWeights, Tokenizer]:
    """Weights and tokenizer of a GGUF file or HF directory (``None``: the default model),
    through the cache in ``cache_dir`` for a GGUF file (see the module doc).

    ``load_weights``: the engine passes its module-level name. Anything other than
    ``loader.load_weights`` (tests patch ``prefixcache.engine.llm_engine.load_weights`` to share one load
    per process) supplies the weights itself: the cache is not consulted.
    """
    path = resolve_model_path(model)
    if load_weights is not None and load_weights is not _loader.load_weights:
        stats["bypass"] += 1
        return load_weights(path), load_tokenizer(path)
    root = None
    if not path.is_dir():
        try:
            root = resolve_cache_dir(cache_dir)
        except (OSError, RuntimeError) as e:  # Path.home() without a home
            log.warning("weights cache off: cannot resolve %r: %s", cache_dir, e)
    if root is None:
        return _loader.load_weights(path), load_tokenizer(path)
    return _load_gguf_cached(path, root / "weights")


def _load_gguf_cached(path: Path, weights_dir: Path) -> tuple[LoadedWeights, Tokenizer]:
    t0 = time.perf_counter()
    try:
        digest, build = file_digest(path), build_id()
    except OSError as e:  # an unreadable model file: the loader says so in its own words
        log.warning("weights cache skipped for %s: %s", path, e)
        return _loader.load_weights(path), load_tokenizer(path)
    entry = weights_dir / _entry_name(digest, build)
    found = entry.exists()
    if found:
        try:
            loaded = _read_entry(entry, path, digest, build)
        except Exception as e:  # noqa: BLE001 - whatever is wrong, the model file is still there
            stats["bad"] += 1
            log.warning("weights cache entry %s is unusable (%s: %s); rebuilding it from %s",
                        entry, type(e).__name__, e, path)
        else:
            stats["hit"] += 1
            log.info("weights and tokenizer of %s from the cache %s in %.2f s",
                     path.name, entry, time.perf_counter() - t0)
            return loaded
    stats["miss"] += 1
    # One reader for both (paths.open_gguf: opening one parses every metadata field; the weights
    # and the tokenizer each opening their own made a first start of Gemma 3 69 s on a Zen 3).
    reader = open_gguf(path)
    weights = _loader.load_weights(path, reader)
    spec = read_gguf_tokenizer(path, reader)
    del reader
    tokenizer = tokenizer_from_gguf_spec(spec, str(path.resolve()))
    t1 = time.perf_counter()
    try:
        if _write_entry(weights_dir, entry.name, weights, spec, digest, build, replace=found):
            stats["write"] += 1
            log.info("%s read in %.1f s; converted weights and tokenizer cached in %s (%.1f s)",
                     path.name, t1 - t0, entry, time.perf_counter() - t1)
    except Exception as e:  # noqa: BLE001 - a read-only or full disk must not stop the start
        log.warning("cannot write the weights cache in %s (%s: %s); %s loads from its file at "
                    "every start", weights_dir, type(e).__name__, e, path.name)
    return weights, tokenizer


def _read_entry(entry: Path, path: Path, digest: str, build: str) -> tuple[LoadedWeights, Tokenizer]:
    from safetensors.torch import load_file
    from tokenizers import Tokenizer as Backend

    meta = json.loads((entry / _META).read_text(encoding="utf-8"))
    want = {"format_version": FORMAT_VERSION, "build": build, "file_digest": digest}
    got = {k: meta.get(k) for k in want}
    if got != want:
        raise _BadEntry(f"stale metadata {got}, expected {want}")
    if set(meta["weights_fields"]) != {f.name for f in dataclasses.fields(LoadedWeights)}:
        raise _BadEntry("LoadedWeights changed since the entry was written")
    if set(meta["groups"]) != set(_group_fields()):
        raise _BadEntry("the entry's group dicts are not LoadedWeights'")
    for name in (_TENSORS, _TOKENIZER):
        if _checksum(entry / name) != meta["checksums"][name]:
            raise _BadEntry(f"{name} does not match its checksum")
    stored = load_file(str(entry / _TENSORS))  # memory-mapped, copy on write
    names = meta["tensors"]
    expected = set(names) | {
        _group_key(name, field, part)
        for field, items in meta["groups"].items()
        for name, item in items.items()
        for part in item["tensors"]
    }
    if set(stored) != expected:
        raise _BadEntry(f"{_TENSORS} holds {len(stored)} tensors, expected {len(expected)}")
    groups = {}
    for field, items in meta["groups"].items():
        groups[field] = {}
        for name, item in items.items():
            cls = getattr(_loader, item["class"], None)
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                raise _BadEntry(f"unknown group class {item['class']!r}")
            parts = {p: stored[_group_key(name, field, p)] for p in item["tensors"]}
            groups[field][name] = cls(**parts, **item["values"])
    weights = LoadedWeights(
        config=ModelConfig(**meta["config"]), tensors={n: _own_if_small(stored[n]) for n in names},
        source=path, weights_digest=meta["weights_digest"], **groups,
    )
    backend = Backend.from_str((entry / _TOKENIZER).read_text(encoding="utf-8"))
    spec = GGUFTokenizer(backend=backend, **meta["tokenizer"])
    return weights, tokenizer_from_gguf_spec(spec, str(path.resolve()))


# Tensors this small are copied out of the mapped entry: a model keeps its norms for its life,
# and one kept view holds the whole mapping and every page the load read in (measured on Gemma
# 3 270M: 218 norms, 0.4 MiB, kept 332 MiB of the 1.3 GB entry resident after packing).
_OWN_BYTES = 1 << 20


def _own_if_small(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.numel() * t.element_size() <= _OWN_BYTES else t


# ---- writing ---------------------------------------------------------------------------------
def _json_value(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars from the file's metadata
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} in the weights cache")


def _group_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(LoadedWeights) if f.name not in _PLAIN_FIELDS]


def _group_key(name: str, field: str, part: str) -> str:
    return f"{name}:{field}.{part}"


def _json_round_trip(value: Any) -> Any:
    return json.loads(json.dumps(value, default=_json_value))


class _NotCacheable(ValueError):
    """What a load returned has a shape the entry cannot hold exactly."""


def _describe(
    weights: LoadedWeights, spec: GGUFTokenizer
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The metadata (JSON-ready) and the tensors of an entry. Raises _NotCacheable when a round
    trip would not give back equal values (the entry would then differ from a fresh load)."""
    config = _json_round_trip(dataclasses.asdict(weights.config))
    tok = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "backend"}
    tok = _json_round_trip(tok)
    if dataclasses.asdict(ModelConfig(**config)) != dataclasses.asdict(weights.config) or (
        GGUFTokenizer(backend=spec.backend, **tok) != spec
    ):
        raise _NotCacheable("the config or the tokenizer metadata does not survive JSON")
    arrays: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def put(key: str, t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        if t.untyped_storage().data_ptr() in storages:  # safetensors refuses shared memory
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        arrays[key] = t

    for name, t in weights.tensors.items():
        put(name, t)
    groups: dict[str, dict[str, Any]] = {}
    for field in _group_fields():
        items = getattr(weights, field)
        if not isinstance(items, dict):
            raise _NotCacheable(f"LoadedWeights.{field} is not a dict of groups")
        groups[field] = {}
        for name, g in items.items():
            cls = type(g)
            if not dataclasses.is_dataclass(g) or getattr(_loader, cls.__name__, None) is not cls:
                raise _NotCacheable(f"LoadedWeights.{field}[{name!r}] is a {cls.__name__}")
            parts, values = [], {}
            for f in dataclasses.fields(g):
                v = getattr(g, f.name)
                if isinstance(v, torch.Tensor):
                    parts.append(f.name)
                    put(_group_key(name, field, f.name), v)
                else:
                    values[f.name] = v
            if _json_round_trip(values) != values:
                raise _NotCacheable(f"LoadedWeights.{field}[{name!r}] does not survive JSON")
            groups[field][name] = {"class": cls.__name__, "tensors": parts, "values": values}
    meta = {
        "weights_fields": sorted(f.name for f in dataclasses.fields(LoadedWeights)),
        "config": config,
        "weights_digest": weights.weights_digest,
        "tensors": list(weights.tensors),
        "groups": groups,
        "tokenizer": tok,
    }
    return meta, arrays


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    """Move a directory out of the way in one rename, then delete it (readers that have its
    files mapped keep them until they let go)."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _write_entry(
    weights_dir: Path, name: str, weights: LoadedWeights, spec: GGUFTokenizer, digest: str,
    build: str, replace: bool,
) -> bool:
    """Write the entry atomically; False when it was not written (not cacheable, or another
    process put a complete entry in place first)."""
    from safetensors.torch import save_file

    try:
        described, arrays = _describe(weights, spec)
    except _NotCacheable as e:
        log.warning("weights cache: %s; %s loads from its file", e, weights.source.name)
        return False
    weights_dir.mkdir(parents=True, exist_ok=True)
    entry = weights_dir / name
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=weights_dir))
    try:
        save_file(arrays, str(tmp / _TENSORS))
        (tmp / _TOKENIZER).write_text(spec.backend.to_str(), encoding="utf-8")
        meta = {
            "format_version": FORMAT_VERSION,
            "build": build,
            "file_digest": digest,
            "source": str(weights.source),
            "source_size": weights.source.stat().st_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **described,
        }
        for f in (_TENSORS, _TOKENIZER):
            _fsync(tmp / f)  # before the checksum: it then reads what the disk holds
        meta["checksums"] = {f: _checksum(tmp / f) for f in (_TENSORS, _TOKENIZER)}
        (tmp / _META).write_text(json.dumps(meta, indent=1, ensure_ascii=False), encoding="utf-8")
        _fsync(tmp / _META)
        _fsync(tmp)
        if replace:
            _discard(entry)
        try:
            os.rename(tmp, entry)
        except OSError:
            if (entry / _META).is_file():  # another process got there first: use theirs
                log.info("weights cache entry %s was written by another process", entry)
                return False
            raise
        _fsync(weights_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _prune(weights_dir, entry)
    return True


def _prune(weights_dir: Path, keep: Path) -> None:
    """Other builds of the same model file, leftovers of dead writers and trash."""
    digest = keep.name.split(".")[0]
    now = time.time()
    try:
        siblings = list(weights_dir.iterdir())
    except OSError:
        return
    for p in siblings:
        try:
            if p == keep:
                continue
            if p.name.startswith(f"{digest}."):
                log.info("weights cache: removing %s, an older build of the same file", p.name)
                _discard(p)
            elif p.name.startswith((".tmp-", ".trash-")) and now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
