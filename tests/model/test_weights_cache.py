"""The weights cache (model/weights_cache.py): a cached load of the default GGUF model equals a
fresh one bit for bit, the second load reads no GGUF, stale and corrupt entries are never used
and are rebuilt, and no cache problem fails a load.

One real conversion per module (the `entry` fixture); tests that rebuild an entry hand the cache
that conversion's result (`fast_rebuild`) instead of parsing the file again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import torch

from prefixcache.model import weights_cache as wc
from prefixcache.model.loader import LoadedWeights
from prefixcache.model.paths import default_model_path
from prefixcache.tokenizer.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing tabs\t\t and\nnew lines\r\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after a special token<|im_end|>",
    "Ünïcödé: 日本語のテキスト, emoji 🤖🚀, math ∑∫√",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "1234567890 3.14159 1e-5 0xDEADBEEF",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Name the capital of France."},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Germany?"},
]


@dataclasses.dataclass
class Entry:
    root: Path  # the cache_dir handed to load_model
    fresh: LoadedWeights  # what the miss returned: the loader's own result
    fresh_tok: object
    cached: LoadedWeights  # the second load: read from the entry
    cached_tok: object
    miss_stats: Counter
    hit_stats: Counter
    spec: object  # the GGUFTokenizer the miss read
    readers_opened: int  # gguf.GGUFReader instances the miss made

    @property
    def dirs(self) -> list[Path]:
        return sorted(p for p in (self.root / "weights").iterdir() if not p.name.startswith("."))


def _stats_of(fn):
    before = Counter(wc.stats)
    result = fn()
    after = Counter(wc.stats)
    after.subtract(before)
    return result, +after


@pytest.fixture(scope="module")
def entry(tmp_path_factory) -> Entry:
    root = tmp_path_factory.mktemp("weights-cache")
    gguf = pytest.importorskip("gguf")
    specs, opened = [], []
    real, real_reader = wc.read_gguf_tokenizer, gguf.GGUFReader

    def recording(path, reader=None):
        specs.append(real(path, reader))
        return specs[-1]

    def counting(*args, **kwargs):
        opened.append(args)
        return real_reader(*args, **kwargs)

    with mock.patch.object(wc, "read_gguf_tokenizer", recording), mock.patch.object(gguf, "GGUFReader", counting):
        (fresh, fresh_tok), miss = _stats_of(lambda: wc.load_model(None, root))
    (cached, cached_tok), hit = _stats_of(lambda: wc.load_model(None, root))
    return Entry(root, fresh, fresh_tok, cached, cached_tok, miss, hit, specs[0], len(opened))


@pytest.fixture
def fast_rebuild(entry, monkeypatch):
    """A miss converts nothing: the loader and the tokenizer reader return the module's result,
    and writes skip fsync. Returns the list of paths the loader was asked for."""
    asked = []

    def load_weights(path, reader=None):
        asked.append(Path(path))
        return dataclasses.replace(entry.fresh, source=Path(path))

    monkeypatch.setattr(wc._loader, "load_weights", load_weights)
    monkeypatch.setattr(wc, "open_gguf", lambda path: None)
    monkeypatch.setattr(wc, "read_gguf_tokenizer", lambda path, reader=None: entry.spec)
    monkeypatch.setattr(wc, "_fsync", lambda path: None)  # durability is not what these test
    return asked


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same_weights(a: LoadedWeights, b: LoadedWeights) -> None:
    assert a.weights_digest == b.weights_digest
    assert a.config == b.config
    assert dataclasses.asdict(a.config) == dataclasses.asdict(b.config)
    assert list(a.tensors) == list(b.tensors)  # same names, same order
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (t.dtype, t.shape) == (u.dtype, u.shape), name
        assert torch.equal(_bits(t), _bits(u)), name
    for field in wc._group_fields():  # int4 (and any other dict of quantized groups)
        ga, gb = getattr(a, field), getattr(b, field)
        assert list(ga) == list(gb), field
        for name, g in ga.items():
            h = gb[name]
            assert type(g) is type(h), (field, name)
            for f in dataclasses.fields(g):
                x, y = getattr(g, f.name), getattr(h, f.name)
                if not isinstance(x, torch.Tensor):
                    assert x == y, (field, name, f.name)
                    continue
                assert (x.dtype, x.shape) == (y.dtype, y.shape), (field, name, f.name)
                assert torch.equal(_bits(x), _bits(y)), (field, name, f.name)


# ---- a cached load is the fresh load ---------------------------------------------------------
def test_first_load_converts_and_writes_second_load_hits(entry):
    assert entry.miss_stats == Counter(miss=1, write=1)
    assert entry.hit_stats == Counter(hit=1)
    [d] = entry.dirs
    assert d.name.startswith(wc.file_digest(default_model_path()) + f".v{wc.FORMAT_VERSION}.")
    assert {p.name for p in d.iterdir()} == {"meta.json", "tensors.safetensors", "tokenizer.json"}
    assert not [p for p in (entry.root / "weights").iterdir() if p.name.startswith(".")]


def test_cached_weights_equal_fresh_bit_for_bit(entry):
    assert entry.fresh.int4, "the default model stores 4-bit groups"
    _assert_same_weights(entry.fresh, entry.cached)
    assert entry.cached.source == entry.fresh.source


def _mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process (None: anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= address < hi:
            return parts[5] if len(parts) > 5 and parts[5].startswith("/") else None
    return None


def test_small_tensors_do_not_hold_the_entry_mapped(entry):
    """A model keeps its norms for its life; were they views of the mapped entry, the whole
    mapping and every page the load read would stay resident (332 MiB on Gemma 3 270M)."""
    small = [t for t in entry.cached.tensors.values() if t.numel() * t.element_size() <= wc._OWN_BYTES]
    large = [t for t in entry.cached.tensors.values() if t.numel() * t.element_size() > wc._OWN_BYTES]
    assert small and large
    assert all(_mapped_file(t.data_ptr()) is None for t in small)
    assert _mapped_file(large[0].data_ptr()).endswith("tensors.safetensors")  # (the check sees maps)


def test_cached_tokenizer_gives_identical_ids(entry):
    fresh, cached = entry.fresh_tok, entry.cached_tok
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "add_bos_token",
                 "chat_template", "stop_token_ids", "special_token_ids", "vocab_size"):
        assert getattr(cached, attr) == getattr(fresh, attr), attr
    # The fingerprint enters every prefix-cache key: a cached start must key blocks the same.
    assert cached.fingerprint() == fresh.fingerprint() == load_tokenizer(None).fingerprint()
    for text in TEXTS:
        for special in (False, True):
            ids = fresh.encode(text, add_special_tokens=special)
            assert cached.encode(text, add_special_tokens=special) == ids, text
            assert cached.decode(ids) == fresh.decode(ids)
            assert cached.decode(ids, skip_special_tokens=False) == fresh.decode(ids, False)
    prompt = fresh.apply_chat_template(MESSAGES)
    assert cached.apply_chat_template(MESSAGES) == prompt
    assert cached.encode_chat(MESSAGES) == fresh.encode_chat(MESSAGES)
    assert fresh.encode(prompt) == cached.encode(prompt)


def test_a_miss_parses_the_gguf_once(entry):
    """Opening a gguf.GGUFReader parses every metadata field (Gemma 3's 262k-token vocabulary:
    20-40 s on 2 cores); the weights and the tokenizer of a miss share one."""
    assert entry.miss_stats["miss"] == 1 and entry.readers_opened == 1


def test_hit_reads_no_gguf(entry):
    def boom(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed on a cache hit")

    gguf = pytest.importorskip("gguf")
    with (mock.patch.object(gguf, "GGUFReader", boom),
          mock.patch.object(wc._loader, "load_weights", boom),
          mock.patch.object(wc, "read_gguf_tokenizer", boom)):  # fmt: skip
        (weights, _), stats = _stats_of(lambda: wc.load_model(None, entry.root))
    assert stats == Counter(hit=1)
    assert weights.weights_digest == entry.fresh.weights_digest


def test_copy_of_the_file_hits_the_same_entry(entry, tmp_path, fast_rebuild):
    copy = tmp_path / "renamed.gguf"
    shutil.copyfile(default_model_path(), copy)
    (weights, _), stats = _stats_of(lambda: wc.load_model(copy, entry.root))
    assert stats == Counter(hit=1) and not fast_rebuild
    assert weights.source == copy  # the entry's data, the caller's path


# ---- stale entries ---------------------------------------------------------------------------
def _isolated(entry, tmp_path, own: tuple[str, ...] = ()) -> Path:
    """A cache dir holding the module's entry, for tests that damage or replace it: files are
    hard links (a rebuild renames a new directory in, never writes into them) except those in
    ``own``, copied because the test changes them in place."""
    root = tmp_path / "cache"
    shutil.copytree(entry.root, root, copy_function=os.link)
    for name in own:
        [f] = (root / "weights").glob(f"*/{name}")
        shutil.copyfile(f, f.with_suffix(".copy"))
        os.replace(f.with_suffix(".copy"), f)
    return root


def test_changed_file_misses_and_never_uses_the_old_entry(entry, tmp_path, monkeypatch):
    changed = tmp_path / "changed.gguf"
    shutil.copyfile(default_model_path(), changed)
    with open(changed, "r+b") as f:  # one byte of the last tensor's data
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))
    monkeypatch.setattr(wc, "read_gguf_tokenizer", lambda path, reader=None: entry.spec)
    root = _isolated(entry, tmp_path)
    (weights, _), stats = _stats_of(lambda: wc.load_model(changed, root))
    assert stats == Counter(miss=1, write=1)
    assert weights.weights_digest != entry.fresh.weights_digest  # the changed file's weights
    names = [p.name for p in (root / "weights").iterdir()]
    assert len(names) == 2 and entry.dirs[0].name in names  # the other file keeps its entry
    (again, _), stats = _stats_of(lambda: wc.load_model(changed, root))
    assert stats == Counter(hit=1) and again.weights_digest == weights.weights_digest


def test_other_format_version_is_rebuilt_and_replaces_the_old_build(
    entry, tmp_path, monkeypatch, fast_rebuild
):
    root = _isolated(entry, tmp_path)
    [old] = [p.name for p in (root / "weights").iterdir()]
    monkeypatch.setattr(wc, "FORMAT_VERSION", wc.FORMAT_VERSION + 1)
    _, stats = _stats_of(lambda: wc.load_model(None, root))
    assert stats == Counter(miss=1, write=1) and fast_rebuild == [default_model_path()]
    [new] = [p.name for p in (root / "weights").iterdir()]
    assert new != old and f".v{wc.FORMAT_VERSION}." in new
    assert json.loads((root / "weights" / new / "meta.json").read_text())["format_version"] == (
        wc.FORMAT_VERSION
    )
    _, stats = _stats_of(lambda: wc.load_model(None, root))
    assert stats == Counter(hit=1)


def test_changed_converting_code_is_a_new_build(monkeypatch):
    build = wc.build_id()
    monkeypatch.setattr(wc, "FORMAT_VERSION", wc.FORMAT_VERSION + 1)
    assert wc.build_id() != build
    monkeypatch.undo()
    real = Path.read_bytes
    loader_file = Path(wc._loader.__file__)
    monkeypatch.setattr(
        Path, "read_bytes", lambda p: real(p) + (b"# edited" if p == loader_file else b"")
    )
    assert wc.build_id() != build


@pytest.mark.parametrize("field", ["format_version", "file_digest", "build"])
def test_metadata_naming_another_key_is_not_used(entry, tmp_path, fast_rebuild, field):
    root = _isolated(entry, tmp_path, own=("meta.json",))
    meta_path = next((root / "weights").iterdir()) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta[field] = 0 if field == "format_version" else "0" * len(meta[field])
    meta_path.write_text(json.dumps(meta))
    _, stats = _stats_of(lambda: wc.load_model(None, root))
    assert stats == Counter(bad=1, miss=1, write=1) and fast_rebuild
    assert json.loads(meta_path.read_text())[field] == json.loads(
        (entry.dirs[0] / "meta.json").read_text()
    )[field]  # replaced by a good entry under the same key
    _, stats = _stats_of(lambda: wc.load_model(None, root))
    assert stats == Counter(hit=1)


# ---- corrupt entries -------------------------------------------------------------------------
def _truncate_tensors(d: Path) -> None:
    f = d / "tensors.safetensors"
    os.truncate(f, f.stat().st_size // 2)


def _flip_tensor_byte(d: Path) -> None:
    with open(d / "tensors.safetensors", "r+b") as f:
        f.seek(-5000, os.SEEK_END)
        b = f.read(1)
        f.seek(-5000, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x80]))


CORRUPTIONS = {  # what it damages, how
    "truncated safetensors": ("tensors.safetensors", _truncate_tensors),
    "flipped tensor byte": ("tensors.safetensors", _flip_tensor_byte),
    "garbage meta.json": ("meta.json", lambda d: (d / "meta.json").write_text("{not json")),
    "meta.json a list": ("meta.json", lambda d: (d / "meta.json").write_text("[1, 2]")),
    "garbage tokenizer.json": (
        "tokenizer.json", lambda d: (d / "tokenizer.json").write_text("garbage")
    ),
    "missing tokenizer.json": ("tokenizer.json", lambda d: (d / "tokenizer.json").unlink()),
}


@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_corrupt_entry_is_a_miss_and_rebuilt(entry, tmp_path, fast_rebuild, caplog, damage):
    target, how = CORRUPTIONS[damage]
    root = _isolated(entry, tmp_path, own=(target,))
    [d] = list((root / "weights").iterdir())
    how(d)
    with caplog.at_level(logging.WARNING, logger=wc.__name__):
        (weights, tok), stats = _stats_of(lambda: wc.load_model(None, root))
    assert stats == Counter(bad=1, miss=1, write=1)
    assert "unusable" in caplog.text
    assert weights.weights_digest == entry.fresh.weights_digest
    assert tok.fingerprint() == entry.fresh_tok.fingerprint()
    assert [p.name for p in (root / "weights").iterdir()] == [d.name]  # replaced, no leftovers
    (again, _), stats = _stats_of(lambda: wc.load_model(None, root))
    assert stats == Counter(hit=1)
    _assert_same_weights(entry.fresh, again)


# ---- writing ---------------------------------------------------------------------------------
def test_unwritable_cache_dir_does_not_fail_the_load(entry, tmp_path, fast_rebuild, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # works as root too, unlike a chmod
    with caplog.at_level(logging.WARNING, logger=wc.__name__):
        (weights, tok), stats = _stats_of(lambda: wc.load_model(None, blocker / "cache"))
    assert stats == Counter(miss=1)
    assert "cannot write the weights cache" in caplog.text
    assert weights.weights_digest == entry.fresh.weights_digest
    assert tok.eos_token_id == entry.fresh_tok.eos_token_id


def test_weights_of_a_shape_the_entry_cannot_hold_are_not_cached(entry, tmp_path, monkeypatch,
                                                                  caplog):
    odd = dataclasses.replace(entry.fresh, int4={"x": "not a group"})
    monkeypatch.setattr(wc._loader, "load_weights", lambda path, reader=None: odd)
    monkeypatch.setattr(wc, "read_gguf_tokenizer", lambda path, reader=None: entry.spec)
    with caplog.at_level(logging.WARNING, logger=wc.__name__):
        (weights, _), stats = _stats_of(lambda: wc.load_model(None, tmp_path))
    assert weights is odd and stats == Counter(miss=1)
    assert "int4['x'] is a str" in caplog.text and not (tmp_path / "weights").exists()


def test_failed_write_leaves_no_temporary_directory(entry, tmp_path, fast_rebuild, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    (weights, _), stats = _stats_of(lambda: wc.load_model(None, tmp_path))
    assert stats == Counter(miss=1) and weights.weights_digest == entry.fresh.weights_digest
    assert list((tmp_path / "weights").iterdir()) == []


def test_writer_that_loses_the_race_keeps_the_other_entry(entry, tmp_path):
    root = _isolated(entry, tmp_path)
    [d] = list((root / "weights").iterdir())
    inode = (d / "tensors.safetensors").stat().st_ino
    digest, build = d.name.split(".")[0], d.name.split(".")[2]
    written = wc._write_entry(root / "weights", d.name, entry.fresh, entry.spec, digest, build,
                              replace=False)
    assert written is False  # another process's complete entry is used, not replaced
    assert (d / "tensors.safetensors").stat().st_ino == inode
    assert [p.name for p in (root / "weights").iterdir()] == [d.name]


def test_stale_temporary_directories_are_removed(entry, tmp_path, fast_rebuild, monkeypatch):
    weights_dir = tmp_path / "weights"
    dead = weights_dir / ".tmp-dead-writer"
    live = weights_dir / ".tmp-live-writer"
    for p in (dead, live):
        p.mkdir(parents=True)
        (p / "tensors.safetensors").write_bytes(b"partial")
    os.utime(dead, (0, 0))
    wc.load_model(None, tmp_path)
    assert not dead.exists() and live.exists()


# ---- off, bypass, directories ----------------------------------------------------------------
@pytest.mark.parametrize("setting", [None, "none", "None"])
def test_cache_off_writes_nothing(entry, tmp_path, fast_rebuild, monkeypatch, setting):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "env"))
    _, stats = _stats_of(lambda: wc.load_model(None, setting))
    assert stats == Counter() and fast_rebuild == [default_model_path()]
    assert list(tmp_path.iterdir()) == []


def test_auto_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert wc.resolve_cache_dir("auto") == tmp_path / "a"
    monkeypatch.delenv("PREFIXCACHE_CACHE_DIR")
    assert wc.resolve_cache_dir("auto") == tmp_path / "x" / "prefixcache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert wc.resolve_cache_dir("auto") == tmp_path / "home" / ".cache" / "prefixcache"
    assert wc.resolve_cache_dir(tmp_path / "p") == tmp_path / "p"
    assert wc.resolve_cache_dir(None) is None


def test_test_suite_does_not_write_to_the_home_cache():
    """conftest.py points "auto" at a directory of its own for the session."""
    home_cache = (Path.home() / ".cache").resolve()
    assert home_cache not in wc.resolve_cache_dir("auto").resolve().parents


def test_a_stand_in_loader_bypasses_the_cache(tmp_path):
    """What tests/_helpers.py does by patching prefixcache.engine.llm_engine.load_weights."""
    sentinel = object()
    (weights, tok), stats = _stats_of(
        lambda: wc.load_model(None, tmp_path, load_weights=lambda path: sentinel)
    )
    assert weights is sentinel and stats == Counter(bypass=1)
    assert tok is load_tokenizer(None)
    assert list(tmp_path.iterdir()) == []


def test_hf_directory_is_not_cached(entry, tmp_path):
    from safetensors.torch import save_file

    tok = entry.fresh_tok
    model = tmp_path / "tiny-hf"
    model.mkdir()
    hidden, vocab = 8, tok.vocab_size
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 64, "tie_word_embeddings": True,
        "eos_token_id": tok.eos_token_id,
    }  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    (model / "tokenizer.json").write_text(tok.backend.to_str())
    save_file({"model.embed_tokens.weight": torch.zeros(vocab, hidden)},
              str(model / "model.safetensors"))
    cache = tmp_path / "cache"
    (weights, hf_tok), stats = _stats_of(lambda: wc.load_model(model, cache))
    assert stats == Counter() and not cache.exists()
    assert weights.config.vocab_size == vocab and hf_tok.encode("hi") == tok.encode("hi")


def test_engine_loads_through_the_cache(entry):
    from prefixcache.config import EngineConfig
    from prefixcache.engine.llm_engine import LLMEngine

    engine, stats = _stats_of(
        lambda: LLMEngine(EngineConfig(kv_cache_memory="16MiB", weights_cache_dir=entry.root))
    )
    assert stats == Counter(hit=1)
    assert engine.tokenizer.fingerprint() == entry.fresh_tok.fingerprint()
    assert engine.model_config == entry.fresh.config
