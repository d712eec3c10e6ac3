"""The kernels' own thread pool (prefixcache/kernels/parallel.h): every item once, the same
numbers on any thread count or caller, usable from several Python threads at once, and alive
again in a forked child (whose parent's helper threads did not come with it)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from prefixcache import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the CPU kernels")


def _rows(n: int = 1000, width: int = 576) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, width, generator=g), torch.rand(width, generator=g) + 0.5


def _helpers() -> int:
    """This process's pool helpers (parallel.h names them)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            n += f.read().strip() == "pc-kernel-pool"
    return n


@pytest.fixture
def two_threads():
    """The suite runs one intra-op thread (conftest.py); these tests need the pool's helper."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_every_row_once_and_the_same_bits_on_any_thread_count():
    x, w = _rows()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernels.rms_norm(x, w, 1e-5)
        torch.set_num_threads(2)
        pooled = [kernels.rms_norm(x, w, 1e-5) for _ in range(20)]
    finally:
        torch.set_num_threads(saved)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5)  # every row computed (no gaps)
    for y in pooled:
        assert torch.equal(y, alone)


def test_callers_on_several_python_threads(two_threads):
    """One job holds the pool at a time; another caller runs its items alone, with the same
    numbers."""
    x, w = _rows()
    want = kernels.rms_norm(x, w, 1e-5)
    bad: list[int] = []

    def work(k: int) -> None:
        for _ in range(30):
            if not torch.equal(kernels.rms_norm(x, w, 1e-5), want):
                bad.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not bad


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_gets_a_pool_of_its_own(two_threads):
    """The parent's pool has started its helper; a child has only the forking thread. It must
    finish its kernels with the same numbers and run them on helpers of its own again (the
    atfork handler), not alone on one thread for the rest of its life."""
    x, w = _rows()
    want = kernels.rms_norm(x, w, 1e-5)  # the pool's helpers start here, in the parent
    assert _helpers() >= 1
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's atexit hooks
        code = 1
        try:
            before = _helpers()
            # compared in numpy: a torch op this large would open an OpenMP region, and libgomp
            # hangs in a child whose parent ran regions with 2 threads (not the pool's doing)
            same = all(np.array_equal(kernels.rms_norm(x, w, 1e-5).numpy(), want.numpy()) for _ in range(5))
            after = _helpers()
            os.write(wfd, f"{int(same)} {before} {after}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's kernel call did not return")
        time.sleep(0.05)
    same, before, after = map(int, os.read(r, 64).decode().split())
    os.close(r)
    assert os.waitstatus_to_exitcode(status) == 0
    assert same == 1
    assert before == 0 and after >= 1  # the parent's helper did not come; one of its own did


_CHILD = """
import os, torch                        # torch first: OpenMP keeps the runtime's own policy
from prefixcache import kernels
assert kernels.available()
torch.set_num_threads(2)
g = torch.Generator().manual_seed(3)
x, w = torch.randn(1000, 576, generator=g), torch.rand(576, generator=g) + 0.5
y = [kernels.rms_norm(x, w, 1e-5) for _ in range(5)]
pool = sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pc-kernel-pool"
           for t in os.listdir("/proc/self/task"))
print(os.environ.get("OMP_WAIT_POLICY"), pool, all(torch.equal(a, y[0]) for a in y), flush=True)
torch.save(y[0], os.environ["OUT"])
"""


def test_with_spinning_openmp_the_items_stay_in_openmp(tmp_path):
    """torch loaded before prefixcache with no wait policy: OpenMP's threads spin between regions,
    so prefixcache leaves the variable alone and the kernels keep to OpenMP (no pool helper to
    fight them for the cores), with the same numbers."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OUT"] = str(tmp_path / "y.pt")
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()  # fmt: skip
    assert out == ["None", "0", "True"]
    x, w = _rows()
    assert torch.equal(torch.load(env["OUT"]), kernels.rms_norm(x, w, 1e-5))
