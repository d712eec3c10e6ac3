"""Start, wait for and stop a benchmarked server, one at a time: shared by serving_figures.py and
side_by_side.py (imported as a sibling module; both are run as scripts from benchmarks/).

Every server gets ``OMP_WAIT_POLICY=PASSIVE`` and its own session (process group), so that
``stop`` ends it with every process it forked (vLLM's engine core) before the next one starts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
# Peers (venvs, builds, converted models) live here; BENCH_DIR lets several worktrees share one,
# e.g. BENCH_DIR=/work/main/.bench. benchmarks/peers/*.sh read the same variable.
BENCH = Path(os.environ.get("BENCH_DIR") or ROOT / ".bench")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path
    started: float  # time.monotonic() just before the process was spawned


def start(name: str, cmd: list[str], url: str, log: Path, env: dict[str, str] | None = None
          ) -> Server:
    """Spawn ``cmd`` (which must listen at ``url``) with its output in ``log``; does not wait."""
    # Every server gets sleeping idle OpenMP threads: on a machine whose cores are shared,
    # spinning ones steal them from everything else (see benchmarks/peers/llamacpp.sh).
    # An empty value in ``env`` unsets a variable (e.g. OMP_WAIT_POLICY="": the runtime's default).
    full_env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v != ""}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=full_env)
    return Server(name, proc, url, log, started)


def wait_ready(server: Server, timeout: float = 600, interval: float = 1.0,
               completion: bool = False) -> dict:
    """Poll ``GET /v1/models`` until it answers 200; with ``completion``, then send 1-token
    completions until one succeeds. Returns ``{"models_s", "completion_s", "model"}``: seconds
    from spawning to each success (``completion_s`` None without ``completion``) and the first
    served model id."""
    deadline = server.started + timeout
    out: dict = {"models_s": None, "completion_s": None, "model": None}
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited ({server.proc.returncode}): see {server.log}")
        try:
            if out["models_s"] is None:
                r = httpx.get(f"{server.url}/v1/models", timeout=2)
                if r.status_code == 200:
                    out["models_s"] = time.monotonic() - server.started
                    out["model"] = r.json()["data"][0]["id"]
                    if not completion:
                        return out
                    continue
            else:
                r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                    "model": out["model"], "prompt": "Hello", "max_tokens": 1,
                    "temperature": 0})
                if r.status_code == 200 and r.json().get("choices"):
                    out["completion_s"] = time.monotonic() - server.started
                    return out
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise RuntimeError(f"{server.name} not ready after {timeout:.0f} s: see {server.log}")


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (from /proc; Linux only)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def memory(pid: int) -> dict:
    """Memory of ``pid`` and its descendants: per process VmRSS / VmHWM (from /proc/PID/status)
    and Pss (from /proc/PID/smaps_rollup), in KiB, and their sums in MiB. Sums of RSS count pages
    shared between processes (libraries, a forked parent's pages) once per process; Pss splits
    them."""
    procs = []
    for p in descendants(pid):
        row: dict = {"pid": p}
        try:
            row["cmd"] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()[:200]
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    row[key] = int(value.split()[0])
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    row["Pss"] = int(line.split()[1])
        except OSError:  # exited meanwhile, or not ours to read
            continue
        procs.append(row)
    total = {k: round(sum(r.get(k, 0) for r in procs) / 1024, 1) for k in ("VmRSS", "VmHWM", "Pss")}
    return {"rss_mib": total["VmRSS"], "hwm_mib": total["VmHWM"], "pss_mib": total["Pss"],
            "processes": procs}


def cpu_ticks(pid: int, tree: bool = True) -> int:
    """CPU time (user + system, clock ticks) of ``pid`` and (``tree``) its live descendants,
    including the children each has reaped."""
    total = 0
    for p in descendants(pid) if tree else [pid]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total


def machine_busy_ticks() -> int:
    """Busy CPU time of the whole machine (clock ticks, all cores): /proc/stat's first line less
    idle and iowait."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[:8]) - fields[3] - fields[4]  # user..steal, less idle and iowait


def _in_group(pid: int, pgid: int) -> bool:
    """Whether ``pid`` is alive (not a zombie) and in process group ``pgid``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[2]) == pgid  # state ppid pgrp ...


def stop(server: Server | subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``timeout``; returns once the server
    and every process it forked are gone (so that the next server has the machine to itself)."""
    proc = server.proc if isinstance(server, Server) else server
    group = proc.pid  # start_new_session: the server leads its own process group
    pids = descendants(proc.pid)
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(group, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + timeout  # forked children may outlive the parent a moment
    while any(_in_group(p, group) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    if any(_in_group(p, group) for p in pids):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
