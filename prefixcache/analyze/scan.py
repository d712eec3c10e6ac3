"""The one streaming pass over a log: read, tokenize, hash — in parallel, results in log order.

The file is cut into byte ranges at line starts; each worker process reads its ranges itself
(no prompt text crosses a pipe), parses the lines, tokenizes text if needed, and hashes the
full blocks with the cache's own hash chain (``prefixcache.cache.hashing``). What comes back
per request is small: its block keys, token count, namespace, time, a few content features and
role spans. The caller consumes them in log order (``imap``), so the analysis is a single
ordered stream however many processes hash.

Hashing and JSON parsing dominate; both run in the workers, and hashing skips the prefix a
prompt shares with a recent one (``chain_reuse.py``). ``jobs=1`` runs in-process.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from prefixcache.analyze import prompts as prompts_mod
from prefixcache.analyze.chain_reuse import ChainReuse
from prefixcache.analyze.killers import content_features
from prefixcache.analyze.reader import MalformedLine, Prompt, parse_line
from prefixcache.cache.hashing import root_hash

# Root of every chain the analyzer hashes itself. Only identity within one log matters, so it
# is a constant (not the model's fingerprint): a tokenizer that loads late changes nothing.
ANALYZE_FINGERPRINT = "prefixcache-analyze"
CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class ScanConfig:
    block_size: int = 16
    tokenizer: str | None = None  # path; None = the default model's tokenizer
    features: bool = True  # content features for the cache-killer search


class Scanned(NamedTuple):
    """One request as the pass sees it (``error`` set: the line was skipped)."""

    line: int  # 1-based line number in the log (or index in a dataset)
    offset: int  # byte offset of the line, to re-read it for excerpts; -1 if none
    sub: int  # index of the prompt within its line
    error: str | None
    namespace: str | None = None
    time: float | None = None
    n_tokens: int = 0
    hashes: list[bytes] | None = None
    features: tuple[list[int], list[int]] | None = None  # (positions, hashes)
    spans: list[tuple[str, int, int]] | None = None


class PromptHasher:
    """Prompt → (tokens, hashes, features, spans); loads the tokenizer on first need."""

    def __init__(self, config: ScanConfig, tokenizer: Any = None) -> None:
        self.config = config
        self._tok = tokenizer
        self._tok_error: str | None = None
        self._roots: dict[str | None, bytes] = {}
        self._chains = ChainReuse(config.block_size)

    def tokenizer(self) -> Any:
        if self._tok is None and self._tok_error is None:
            try:
                self._tok = prompts_mod.load_tokenizer(self.config.tokenizer)
            except Exception as e:  # noqa: BLE001 - reported per line, the pass goes on
                self._tok_error = f"needs a tokenizer ({type(e).__name__}: {e})"[:200]
        if self._tok is None:
            raise MalformedLine(self._tok_error or "needs a tokenizer")
        return self._tok

    def token_ids(self, p: Prompt) -> tuple[list[int] | None, list | None]:
        """The prompt's token ids and role spans (``None`` ids: it comes as hashes)."""
        if p.token_ids is not None:
            return p.token_ids, None
        if p.token_array is not None:
            return p.token_array.tolist(), None
        if p.block_hashes is not None:
            return None, None
        if p.messages is not None:
            return prompts_mod.encode_messages(self.tokenizer(), p.messages)
        return prompts_mod.encode_text(self.tokenizer(), p.text or "")

    def process(self, p: Prompt, line: int, offset: int, sub: int) -> Scanned:
        bs = self.config.block_size
        if p.token_array is not None:
            arr, spans = p.token_array, None
        else:
            ids, spans = self.token_ids(p)
            arr = None if ids is None else np.asarray(ids, dtype=np.int64)
        features = None
        if arr is None:
            hashes = p.block_hashes or []
            n_tokens = int(p.num_prompt_tokens or 0)
            if p.log_block_size is not None and p.log_block_size != bs:
                raise MalformedLine(
                    f"hashes made with block size {p.log_block_size}, analysing with {bs}"
                )
            if len(hashes) * bs > n_tokens:
                raise MalformedLine("more block hashes than num_prompt_tokens / block size")
        else:
            root = self._roots.get(p.namespace)
            if root is None:
                root = self._roots[p.namespace] = root_hash(
                    ANALYZE_FINGERPRINT, p.namespace, block_size=bs
                )
            hashes = self._chains.hash(root, arr)
            n_tokens = len(arr)
            if self.config.features:
                features = content_features(arr)
        return Scanned(line, offset, sub, None, p.namespace, p.time, n_tokens, hashes,
                       features, spans)


def scan_lines(
    data: bytes, base_offset: int, base_line: int, hasher: PromptHasher
) -> tuple[int, list[Scanned]]:
    """Process the lines of one byte range; returns ``(lines in it, results)``."""
    out: list[Scanned] = []
    offset = base_offset
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for k, raw in enumerate(lines):
        line_no = base_line + k
        try:
            for sub, p in enumerate(parse_line(raw)):
                try:
                    out.append(hasher.process(p, line_no, offset, sub))
                except MalformedLine as e:
                    out.append(Scanned(line_no, offset, sub, str(e)))
        except MalformedLine as e:
            out.append(Scanned(line_no, offset, 0, str(e)))
        offset += len(raw) + 1
    return len(lines), out


def byte_ranges(path: str, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """Cut a file into ranges of about ``chunk`` bytes that start at line starts."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        pos = chunk
        while pos < size:
            f.seek(pos)
            f.readline()
            pos = f.tell()
            if pos >= size:
                break
            if pos > cuts[-1]:
                cuts.append(pos)
            pos += chunk
    cuts.append(size)
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


_WORKER: dict[str, Any] = {}


def _init_worker(path: str, config: ScanConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER["path"] = path
    _WORKER["hasher"] = PromptHasher(config)


def _scan_range(rng: tuple[int, int]) -> tuple[int, list[Scanned]]:
    start, end = rng
    with open(_WORKER["path"], "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    return scan_lines(data, start, 0, _WORKER["hasher"])


def scan_file(
    path: str, config: ScanConfig, jobs: int = 1, tokenizer: Any = None
) -> Iterator[Scanned]:
    """Every request of the log at ``path``, in order, hashed; ``jobs`` worker processes."""
    ranges = byte_ranges(path)
    if jobs <= 1 or len(ranges) <= 1:
        hasher = PromptHasher(config, tokenizer)
        base = 1
        for start, end in ranges:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
            n, results = scan_lines(data, start, base, hasher)
            base += n
            yield from results
        return
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    with ctx.Pool(jobs, initializer=_init_worker, initargs=(path, config)) as pool:
        base = 1
        for n, results in pool.imap(_scan_range, ranges, chunksize=1):
            for s in results:
                yield s._replace(line=s.line + base)
            base += n


def scan_prompts(
    prompts: Iterable[Prompt], config: ScanConfig, tokenizer: Any = None
) -> Iterator[Scanned]:
    """The same pass over prompts already in memory (a bench dataset); in-process."""
    hasher = PromptHasher(config, tokenizer)
    for i, p in enumerate(prompts):
        try:
            yield hasher.process(p, i + 1, -1, 0)
        except MalformedLine as e:
            yield Scanned(i + 1, -1, 0, str(e))
