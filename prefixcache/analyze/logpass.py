"""One pass over a request log: the analysis's options, what ``LogPass`` keeps per request as
the scanned requests stream by (block trie, ideal hits, roles, killer candidates), and ``Source``,
which reads a single request back for the report's excerpts."""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass

from prefixcache.analyze import trie
from prefixcache.analyze.killers import KillerDetector
from prefixcache.analyze.reader import Prompt, parse_line
from prefixcache.analyze.scan import Scanned


@dataclass(frozen=True)
class AnalyzeOptions:
    block_size: int = 16
    tokenizer: str | None = None  # for text prompts; None = the default model's tokenizer
    model: str | None = None  # for KV bytes per token; None = the tokenizer path or default
    kv_dtype_bytes: int = 2
    kv_bytes_per_token: int | None = None  # given: skip reading the model's metadata
    jobs: int = 0  # worker processes; 0 = one per core for large logs, in-process otherwise
    curve_points: int = 8  # cache sizes simulated for LFU and Belady
    top_k: int = 10
    killers: bool = True
    measure: bool = False  # time the engine's prefill to estimate TTFT savings
    device: str = "cpu"  # for measure

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.curve_points < 2:
            raise ValueError("curve_points must be >= 2")


class LogPass:
    """Consumes the scanned requests in log order; holds what the summary needs."""

    def __init__(self, block_size: int, killers: bool = True) -> None:
        self.block_size = block_size
        self.trie = trie.BlockTrie()
        self.killers = KillerDetector() if killers else None
        self.leaf = array("i")
        self.n_tokens = array("q")
        self.known = array("i")  # leading blocks already seen (ideal cache)
        self.line = array("q")
        self.offset = array("q")
        self.sub = array("i")
        self.malformed: Counter[str] = Counter()
        self.malformed_lines: dict[str, list[int]] = {}
        self.role_tokens: Counter[str] = Counter()
        self.role_cached: Counter[str] = Counter()
        self.namespaces: set[str | None] = set()
        self.t_min = float("inf")
        self.t_max = float("-inf")
        self.hashed_requests = 0  # requests given as block hashes: no roles, no killers

    def feed(self, s: Scanned) -> None:
        if s.error is not None:
            self.malformed[s.error] += 1
            lines = self.malformed_lines.setdefault(s.error, [])
            if len(lines) < 5:
                lines.append(s.line)
            return
        r = len(self.leaf)
        added = self.trie.add(s.hashes, r)
        bs = self.block_size
        cached = added.known_blocks * bs
        self.leaf.append(added.leaf)
        self.n_tokens.append(s.n_tokens)
        self.known.append(added.known_blocks)
        self.line.append(s.line)
        self.offset.append(s.offset)
        self.sub.append(s.sub)
        if len(self.namespaces) < 100_000:
            self.namespaces.add(s.namespace)
        if s.time is not None:
            self.t_min = min(self.t_min, s.time)
            self.t_max = max(self.t_max, s.time)
        if s.spans:
            for role, a, b in s.spans:
                self.role_tokens[role] += b - a
                self.role_cached[role] += max(0, min(b, cached) - a)
            covered = s.spans[-1][2] if s.spans else 0
            if covered < s.n_tokens:
                self.role_tokens["unknown"] += s.n_tokens - covered
        else:
            self.role_tokens["unknown"] += s.n_tokens
            self.role_cached["unknown"] += cached
        if s.features is None:
            self.hashed_requests += 1
        elif self.killers is not None:
            self.killers.observe(r, *s.features, s.n_tokens, cached, bs)


class Source:
    """Re-reads single requests (for excerpts) from a log file or an in-memory list."""

    def __init__(self, path: str | None = None, prompts: list[Prompt] | None = None) -> None:
        self.path = path
        self.prompts = prompts

    def prompt(self, line: int, offset: int, sub: int) -> Prompt:
        if self.prompts is not None:
            return self.prompts[line - 1]
        with open(self.path, "rb") as f:
            f.seek(offset)
            return parse_line(f.readline())[sub]
