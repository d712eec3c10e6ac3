"""Start ``prefixcache serve`` in a subprocess and wait until it answers: for tests, benchmarks
and scripts that need a live server.

    with ServerProcess(["--kv-cache-memory", "64MiB"]) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on a free port; its output goes to a temp file (see ``output()``)."""

    def __init__(
        self,
        args: list[str] = (),
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 300.0,
        env: dict[str, str] | None = None,
        listen_socket: socket.socket | None = None,
        cwd: str | Path | None = None,
        command: str = "serve",
    ) -> None:
        """``command``: ``serve``, or ``cluster`` (Ray Serve replicas behind one endpoint).
        ``listen_socket``: a bound, listening socket the server inherits (``--fd``), for
        tests that need socket options set before accept (e.g. a small send buffer)."""
        self.args = list(args)
        self.host = host
        self.port = port
        self.listen_socket = listen_socket
        self.cwd = cwd  # run from another checkout (benchmarks comparing commits)
        self.command = command
        if listen_socket is not None:
            self.host, self.port = listen_socket.getsockname()[:2]
        self.startup_timeout = startup_timeout
        self.env = env
        self.proc: subprocess.Popen | None = None
        fd, self._log_path = tempfile.mkstemp(prefix="prefixcache-serve-", suffix=".log")
        self._log = os.fdopen(fd, "wb")

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        for attempt in range(3):  # a port taken between free_port() and bind: pick another
            if self.listen_socket is None and (self.port is None or attempt):
                self.port = free_port(self.host)
            fds = () if self.listen_socket is None else (self.listen_socket.fileno(),)
            cmd = [
                sys.executable,
                "-m",
                "prefixcache.cli",
                self.command,
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                "--no-access-log",
                *(["--fd", str(fds[0])] if fds else []),
                *self.args,
            ]
            self.proc = subprocess.Popen(
                cmd,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                pass_fds=fds,
                cwd=self.cwd,
            )
            if self._wait_ready():
                return self
            if "address already in use" not in self.output().lower():
                break
        out = self.output()
        self.stop()
        raise RuntimeError(f"server did not start; its output:\n{out[-4000:]}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            # A cluster answers /health as soon as one replica runs; it is ready when its CLI
            # says so (serve.run returned: every replica running), which it prints after.
            if self.command == "cluster" and "serving at" not in self.output():
                time.sleep(0.2)
                continue
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def output(self) -> str:
        return Path(self._log_path).read_text(errors="replace")

    def terminate(self) -> None:
        """Send SIGTERM (the server drains running requests, then exits)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        try:
            self._log.close()
            os.unlink(self._log_path)
        except OSError:
            pass
