"""Connections to ``iapo-gym serve`` end: head size and time, body time, idle keep-alive, connections per process.

Each bound is checked with both HTTP parsers uvicorn can run (httptools, the serve extra's; h11), against
serve as a process before the scripted upstream, with raw sockets playing the hostile clients; a normal
request is answered meanwhile.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from iapo_gym.deploy.limits import ServeLimits
from tests.deploy_helpers import mv_policy, post_json, scripted_stats, start_scripted, start_serve
from tests.llm_server import HERE, _log_file, free_port, output, stop, wait_ready, write_spec

pytest.importorskip("uvicorn")

HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE, MAX_CONNECTIONS = 2.0, 2.0, 1.0, 500
LINGER = 1.0  # iapo_gym.deploy.connections.LINGER
BODY = json.dumps({"model": "iapo/high", "prompt": "1 + 1 ="}).encode()


def _parsers() -> list[str]:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return ["h11"]  # the serve extra is not installed: h11 alone (its bounds are the same)
    return ["httptools", "h11"]


@pytest.fixture(scope="module", params=_parsers())
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """serve with short limits before the scripted upstream; (serve port, upstream port)."""
    folder = tmp_path_factory.mktemp(f"conn-{request.param}")
    up, port = free_port(), free_port()
    scripted = start_scripted({"1 + 1 = ->": ["2"]}, folder, up)
    spec = write_spec(folder, up, endpoint={"max_retries": 0})
    serve = start_serve(mv_policy().save(folder / "policy.json"), spec, port, extra=[
        "--http", request.param, "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
        "--keep-alive-timeout", str(KEEP_ALIVE), "--max-connections", str(MAX_CONNECTIONS)])
    try:
        yield port, up
    finally:
        stop(serve)
        stop(scripted)


def _normal(port: int) -> None:
    status, doc, _ = post_json(port, "/v1/completions", BODY, timeout=10)
    assert status == 200 and doc["choices"][0]["text"] == "2", (status, doc)


def _answer(sock: socket.socket, timeout: float) -> tuple[int, dict[str, Any], bytes]:
    """Read until the server closes its side; (status, JSON error body, raw head)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), head


def test_limit_values_are_checked() -> None:
    for field in ("header_timeout", "body_timeout", "keep_alive_timeout", "stall_after"):
        with pytest.raises(ValueError, match=f"{field} must be a positive number of seconds, got 0"):
            ServeLimits(**{field: 0})
    for field in ("max_header_bytes", "max_connections"):
        with pytest.raises(ValueError, match=f"{field} must be at least 1, got 0"):
            ServeLimits(**{field: 0})


def test_16mb_of_headers_get_431_after_the_limit(server: tuple[int, int]) -> None:
    port, up = server
    before = scripted_stats(up)["requests"]
    for shape in ("one", "many"):  # one 16 MB header, or 16 MB of 4 KB headers
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sent = {"bytes": 0}

        def flood(s: socket.socket = sock, sent: dict[str, int] = sent, shape: str = shape) -> None:
            s.settimeout(10)
            start = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            chunk = b"a" * 65536 if shape == "one" else b"".join(
                b"X-Pad-%02d: " % i + b"b" * 4083 + b"\r\n" for i in range(16))
            try:
                s.sendall(start + (b"X-Big: " if shape == "one" else b""))
                for _ in range(256):  # 16 MB
                    s.sendall(chunk)
                    sent["bytes"] += len(chunk)
            except OSError:  # the server closed the connection
                pass

        thread = threading.Thread(target=flood)
        thread.start()
        status, doc, _ = _answer(sock, 10)
        thread.join(15)
        sock.close()
        assert status == 431 and doc["error"]["code"] == "headers_too_large", (status, doc)
        assert "16384 bytes" in doc["error"]["message"]
        assert sent["bytes"] < 16 * 2**20, sent  # cut off before the client got its 16 MB out
    assert scripted_stats(up)["requests"] == before
    _normal(port)



def _trickle(sock: socket.socket, data: bytes, cut: threading.Event) -> threading.Thread:
    """A thread sending ``data`` one byte a second on ``sock`` until it is sent, ``cut`` is set or the socket fails."""
    def send() -> None:
        try:
            for byte in data:
                if cut.is_set():
                    return
                sock.sendall(bytes([byte]))
                time.sleep(1.0)
        except OSError:
            pass

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def _trickled(port: int, sock: socket.socket, data: bytes, timeout: float) -> tuple[int, dict[str, Any], bytes, float]:
    """Send ``data`` on ``sock`` one byte a second while a normal request is answered; the answer on ``sock``
    (status, body, head) and the seconds it took, the socket closed after."""
    cut = threading.Event()
    started = time.monotonic()
    thread = _trickle(sock, data, cut)
    _normal(port)  # answered meanwhile
    status, doc, head = _answer(sock, timeout)
    elapsed = time.monotonic() - started
    cut.set()
    thread.join(5)
    sock.close()
    return status, doc, head, elapsed


def test_a_head_sent_one_byte_a_second_gets_408(server: tuple[int, int]) -> None:
    port, _ = server
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    status, doc, _, elapsed = _trickled(port, sock, head, HEADER_TIMEOUT + 10)
    assert status == 408 and doc["error"]["code"] == "request_timeout", (status, doc)
    assert HEADER_TIMEOUT - 0.2 < elapsed < HEADER_TIMEOUT + 3, elapsed


def test_a_body_sent_one_byte_a_second_gets_408(server: tuple[int, int]) -> None:
    port, up = server
    before = scripted_stats(up)["requests"]
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(BODY))
    status, doc, head, elapsed = _trickled(port, sock, BODY, BODY_TIMEOUT + 10)
    assert status == 408 and doc["error"]["code"] == "request_timeout", (status, doc)
    assert b"connection: close" in head.lower()
    assert BODY_TIMEOUT - 0.2 < elapsed < BODY_TIMEOUT + 3, elapsed
    assert scripted_stats(up)["requests"] == before + 1  # the normal request only


def test_an_idle_keep_alive_connection_is_closed(server: tuple[int, int]) -> None:
    port, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        sock.settimeout(KEEP_ALIVE + 5)
        try:
            while sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        idle = time.monotonic() - answered
    assert KEEP_ALIVE - 0.2 < idle < KEEP_ALIVE + 2, idle


def _closed(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the server has closed (readable at once: EOF or reset)."""
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    ready = sel.select(timeout=0)
    sel.close()
    return len(ready)


def test_2000_idle_connections_are_bounded_and_cut(server: tuple[int, int]) -> None:
    port, _ = server
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    socks: list[socket.socket] = []
    try:
        for _ in range(2000):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        opened = time.monotonic()
        _normal(port)  # a caller is answered while the idle connections are held
        time.sleep(0.5)
        still_open = len(socks) - _closed(socks)
        assert still_open <= MAX_CONNECTIONS, still_open  # past the cap the oldest idle ones were closed
        # the rest are closed once the head timeout passes without a byte
        deadline = opened + HEADER_TIMEOUT + 3
        while _closed(socks) < len(socks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _closed(socks) == len(socks)
    finally:
        for s in socks:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    _normal(port)


def test_max_connections_fit_the_open_files_limit(tmp_path: Path) -> None:
    """Where the hard open-files limit is below --max-connections, serve says so and serves with fewer."""
    up, port = free_port(), free_port()
    scripted = start_scripted({"1 + 1 = ->": ["2"]}, tmp_path, up)
    spec = write_spec(tmp_path, up, endpoint={"max_retries": 0})
    cmd = [sys.executable, "-m", "iapo_gym.cli", "serve", str(mv_policy().save(tmp_path / "policy.json")),
           "--upstream", str(spec), "--port", str(port), "--max-connections", "1024"]
    log = _log_file("serve-nofile")
    serve = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent,
                             env={**os.environ, "PYTHONPATH": str(HERE.parent)},
                             preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
    serve.log_file = log  # type: ignore[attr-defined]
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", serve)
        assert "the open-files limit (256) leaves room for 192 connections, not --max-connections 1024" in output(serve)
        _normal(port)
    finally:
        stop(serve)
        stop(scripted)
