"""Faults around `prefixcache serve`: a full disk under the request log, half-sent requests, too
many connections, a client that stops reading its stream, SIGTERM with a stuck client.

One live server on the default model. It inherits a listening socket with a 4 KiB send buffer
(``--fd``), so a client that stops reading blocks the server's sends after ~75 KB instead of the
megabytes the kernel would otherwise buffer. Its request log is /dev/full: every write fails
with ENOSPC, as on a full disk. The SIGTERM test stops the server, so it runs last.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from prefixcache.server.launcher import ServerProcess

pytestmark = pytest.mark.slow

MAX_CONNECTIONS = 6
HEADER_TIMEOUT = 2
SEND_TIMEOUT = 1


@pytest.fixture(scope="module")
def server():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # inherited by accepted ones
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    args = ["--kv-cache-memory", "32MiB", "--max-model-len", "512", "--log-requests", "/dev/full",
            "--max-connections", str(MAX_CONNECTIONS), "--header-timeout", str(HEADER_TIMEOUT),
            "--send-timeout", str(SEND_TIMEOUT)]  # fmt: skip
    with ServerProcess(args, listen_socket=listener) as srv:
        yield srv
    listener.close()


def counter(server, name: str) -> float:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"{name} not in /metrics")


def engine_stats(server) -> dict:
    return httpx.get(server.base_url + "/v1/cache/stats").json()["engine"]


def wait_idle(server, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        e = engine_stats(server)
        if e["num_running"] == 0 and e["num_waiting"] == 0 and e["in_use_blocks"] == 0:
            return e
        assert time.monotonic() < deadline, f"engine not idle: {e}"
        time.sleep(0.1)


def test_a_full_disk_under_the_request_log_fails_no_request(server):
    for i in range(3):
        body = {"prompt": f"Request number {i} of the disk-full test", "max_tokens": 2}
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30  # the log thread writes after the answer
    while counter(server, "prefixcache:request_log_errors_total") < 3:
        assert time.monotonic() < deadline, "the failed writes were not counted"
        time.sleep(0.1)
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}


def _half_sent(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")  # never finished
    return s


def _closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_half_sent_requests_time_out_and_connections_are_capped(server):
    held = [_half_sent(server.port) for _ in range(MAX_CONNECTIONS)]
    extra = socket.create_connection(("127.0.0.1", server.port))
    assert _closed_by_server(extra, within=HEADER_TIMEOUT / 2)  # over the cap: closed at once
    for s in held:  # no request's headers within HEADER_TIMEOUT: closed
        assert _closed_by_server(s, within=30)
        s.close()
    extra.close()
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200  # the slots came back


def test_a_client_that_stops_reading_is_cancelled_and_its_blocks_freed(server):
    before = wait_idle(server)["generation_tokens_total"]
    n, max_tokens = 4, 480  # to the end: 1,920 tokens; cancelled: buffers + 1 s of decode
    body = {"prompt": "Count: one, two, three,", "max_tokens": max_tokens, "n": n,
            "ignore_eos": True, "logprobs": 20, "stream": True, "temperature": 0}  # fmt: skip
    payload = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    deadline = time.monotonic() + 120  # ~700 bytes an event: the buffers fill in ~100 events
    while engine_stats(server)["num_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = wait_idle(server, timeout=120)["generation_tokens_total"]
    s.close()
    # Cancelled SEND_TIMEOUT after its sends blocked, not run to the end for nobody.
    assert after - before < n * max_tokens / 2
    assert httpx.get(server.base_url + "/v1/debug/integrity").json()["ok"]


def test_sigterm_exits_although_a_client_never_reads(server):
    """No --graceful-shutdown-timeout (wait for running requests): the stuck stream is cancelled
    by the send timeout, so the drain ends and the process exits."""
    body = {"prompt": "Tell a long story.", "max_tokens": 400, "n": 4, "ignore_eos": True,
            "logprobs": 20, "stream": True}  # fmt: skip
    payload = json.dumps(body).encode()
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(("127.0.0.1", server.port))
    stuck.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    deadline = time.monotonic() + 120
    while engine_stats(server)["num_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.terminate()
    # uvicorn re-raises the SIGTERM after its graceful shutdown: rc 0 or -SIGTERM.
    assert server.wait(timeout=120) in (0, -15)
    stuck.close()
