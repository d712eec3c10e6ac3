"""Records what an engine computed, keyed by the token ids each number is a function of, and
compares two runs bit for bit (tests/model/test_exact.py, tests/engine/test_cuda.py,
benchmarks/cuda_contract.py).

A token's K/V and the logits after it are functions of exactly the ids up to its position, so
runs in different namespaces, engines and batches compare directly.
"""

from __future__ import annotations

import torch

from prefixcache import SamplingParams


class Recorder:
    """Wraps an engine's runner: the stored K/V of every computed token and the logits of every
    sampled row, keyed by the token ids they are a function of."""

    def __init__(self, engine):
        self.engine = engine
        self.kv: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self.logits: dict[bytes, torch.Tensor] = {}
        self._execute = engine.runner.execute

    def __enter__(self):
        runner, bs = self.engine.runner, self.engine.runner.block_size

        def execute(pieces):  # the step's one forward (sequence.Piece)
            out = self._execute(pieces)
            row = 0
            for p in pieces:
                ids, start, n = p.token_ids, p.start, p.n
                if p.probe:  # (segments' probes store two layers only; none in these tests)
                    continue
                table = runner.window_table  # with window parts: its blocks' parts
                dev = runner.kv.k.device
                window = None if table is None else _slots(table(p.block_table), start, n, bs).to(dev)
                k, v = runner.kv.stored(_slots(p.block_table, start, n, bs).to(dev), window)  # [L, KVH, n, D] as stored
                for j in range(n):
                    self.kv[key(ids[: start + j + 1])] = (k[:, :, j].clone(), v[:, :, j].clone())
                if p.samples:
                    self.logits[key(ids[: start + n])] = out.logits[row].clone()
                    row += 1
            return out

        self.engine.runner.execute = execute
        return self

    def __exit__(self, *exc):
        self.engine.runner.execute = self._execute


def _slots(table: list[int], start: int, n: int, bs: int) -> torch.Tensor:
    return torch.tensor([table[p // bs] * bs + p % bs for p in range(start, start + n)])


def key(ids) -> bytes:
    return torch.tensor(list(ids), dtype=torch.int32).numpy().tobytes()


def compare(ref: Recorder, other: Recorder) -> dict:
    """What two runs computed for the same token ids: how many records both made, whether all
    are bit-for-bit equal, and the largest absolute difference where they are not."""
    kv = ref.kv.keys() & other.kv.keys()
    lg = ref.logits.keys() & other.logits.keys()

    def worst(pairs) -> float:
        return max((float((a.float() - b.float()).abs().max()) for a, b in pairs), default=0.0)

    kv_pairs = [(ref.kv[k][i], other.kv[k][i]) for k in kv for i in (0, 1)]
    lg_pairs = [(ref.logits[k], other.logits[k]) for k in lg]
    return {
        "kv_compared": len(kv), "logits_compared": len(lg),
        "kv_equal": all(torch.equal(a, b) for a, b in kv_pairs),
        "logits_equal": all(torch.equal(a, b) for a, b in lg_pairs),
        "kv_max_abs_diff": worst(kv_pairs), "logits_max_abs_diff": worst(lg_pairs),
    }  # fmt: skip


def assert_same(ref: Recorder, other: Recorder, min_kv: int = 1, min_logits: int = 1) -> None:
    """Every record both runs made is bit-for-bit equal; at least this many were compared."""
    kv = ref.kv.keys() & other.kv.keys()
    lg = ref.logits.keys() & other.logits.keys()
    assert len(kv) >= min_kv and len(lg) >= min_logits, (len(kv), len(lg))
    for k in kv:
        assert torch.equal(ref.kv[k][0], other.kv[k][0]), "K differs"
        assert torch.equal(ref.kv[k][1], other.kv[k][1]), "V differs"
    for k in lg:
        assert torch.equal(ref.logits[k], other.logits[k]), "logits differ"


def run(llm, prompts, max_tokens=4, salt=None) -> Recorder:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with Recorder(llm.engine) as rec:
        llm.generate(prompts, params, cache_salt=salt)
    return rec


def cold_and_warm(llm, ids, shared: int, salts: tuple[str, str]):
    """The prompt ids[:shared] + ids[200:230] computed cold (namespace salts[0]) and warm: its
    prefix first cached with another suffix in namespace salts[1]. Returns both records and the
    warm request's output."""
    prompt = ids[:shared] + ids[200:230]
    cold = run(llm, [prompt], salt=salts[0])
    run(llm, [ids[:shared] + ids[300:320]], salt=salts[1])  # caches the prefix
    with Recorder(llm.engine) as warm:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        out = llm.generate([prompt], params, cache_salt=salts[1])[0]
    return cold, warm, out
