"""KV bytes per token of a model, to express cache sizes in bytes.

    bytes/token = 2 (K and V) × layers × kv_heads × head_dim × dtype bytes

SmolLM2-135M (30 layers, 3 KV heads, head_dim 64) in float16: 23,040 bytes, 22.5 KiB a token.
Read from the GGUF metadata (``<arch>.block_count``, ``<arch>.attention.head_count_kv``,
``<arch>.embedding_length / <arch>.attention.head_count``) or a Hugging Face ``config.json``;
no torch, no weights loaded. ``GGUFReader`` parses the whole vocabulary too (~5 s of CPU for
SmolLM2), so a GGUF file's layout is remembered in ``~/.cache/prefixcache/kv_layouts.json``
(``$XDG_CACHE_HOME``), keyed by path, size and modification time.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}


@dataclass(frozen=True)
class KVLayout:
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def kv_layout(model: str | Path | None, dtype_bytes: int = 2) -> KVLayout:
    """The KV layout of a GGUF file or HF directory; ``None`` = the default model."""
    from prefixcache.model.paths import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        cfg = json.loads((path / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        return KVLayout(
            model=path.name,
            num_layers=int(cfg["num_hidden_layers"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            dtype_bytes=dtype_bytes,
        )
    return _cached_gguf_layout(path.resolve(), dtype_bytes)


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "prefixcache" / "kv_layouts.json"


def _cached_gguf_layout(path: Path, dtype_bytes: int) -> KVLayout:
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    cache = _cache_file()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(key), dict):
        try:
            return KVLayout(**{**known[key], "dtype_bytes": dtype_bytes})
        except TypeError:
            pass
    layout = _gguf_layout(path, dtype_bytes)
    known[key] = asdict(layout)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(cache)
    except OSError:
        pass  # a read-only home: read the file again next time
    return layout


def _gguf_layout(path: Path, dtype_bytes: int) -> KVLayout:
    import gguf

    fields = gguf.GGUFReader(str(path)).fields

    def get(key: str) -> object:
        f = fields.get(key)
        if f is None:
            return None
        try:
            return f.contents()
        except AttributeError:  # older gguf: the value is the part data[0] points at
            return f.parts[f.data[0]].tolist()[0]

    arch = get("general.architecture") or "llama"
    if isinstance(arch, bytes):
        arch = arch.decode()
    layers = get(f"{arch}.block_count")
    heads = get(f"{arch}.attention.head_count")
    kv_heads = get(f"{arch}.attention.head_count_kv") or heads
    head_dim = get(f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = int(get(f"{arch}.embedding_length")) // int(heads)
    name = get("general.name") or path.stem
    return KVLayout(str(name), int(layers), int(kv_heads), int(head_dim), dtype_bytes)
