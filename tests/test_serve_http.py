"""``iapo-gym serve``'s HTTP layer (Starlette): HEAD on the GET routes, one of each header it reads, the app mounted
under a prefix (``root_path``), and the access log written off the event loop.

Real parts: serve as a process before the echo upstream (tests/echo_upstream.py) for what goes over the wire
(HEAD, repeated headers: raw sockets); the app in this process through httpx2's ASGI transport for a mount under
a prefix and for a stalled access log (a real pipe whose reader stops reading, as a stuck log shipper would).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.deploy_helpers import mv_policy, start_serve
from tests.echo_upstream import EchoUpstream
from tests.llm_server import free_port, stop, write_spec

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx2")

KEY = "sk-http-layer-5d4c3b2a"
BODY = b'{"model": "iapo/high", "prompt": "1 + 1 ="}'


def _raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` (it asks to close the connection), read to the end; (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """serve (inbound key KEY) before the echo upstream; yields (serve port, upstream)."""
    folder = tmp_path_factory.mktemp("http")
    with EchoUpstream("7") as up:
        port = free_port()
        spec = write_spec(folder, 0, endpoint={"base_url": up.url, "max_retries": 0})
        serve = start_serve(mv_policy().save(folder / "policy.json"), spec, port,
                            extra=["--api-key-env", "SERVE_HTTP_KEY"], env={"SERVE_HTTP_KEY": KEY})
        try:
            yield port, up
        finally:
            stop(serve)


def test_head_is_answered_on_the_get_routes_without_a_body(served: tuple[int, EchoUpstream]) -> None:
    port, _ = served
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    for path in (b"/v1/models", b"/v1/models/iapo/low", b"/health"):
        get = _raw(port, b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth + b"Connection: close\r\n\r\n")
        head = _raw(port, b"HEAD " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth + b"Connection: close\r\n\r\n")
        assert get[0] == head[0] == 200 and get[2], (path, get, head)
        assert head[2] == b"" and head[1]["content-type"] == "application/json"  # the head of the GET, no body
        if path != b"/health":  # /health's times change between the two calls
            assert int(head[1]["content-length"]) == len(get[2])
    # HEAD needs the key where GET does, and is no method of the completion routes
    status, _, body = _raw(port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, headers, body = _raw(port, b"HEAD /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert status == 405 and headers["allow"] == "POST" and body == b""


def test_a_header_the_server_reads_sent_twice_is_refused(served: tuple[int, EchoUpstream]) -> None:
    """Two Authorization headers (the right key in either), two Content-Types: 400, nothing goes upstream."""
    port, up = served
    before = up.posts
    good, bad = f"Authorization: Bearer {KEY}\r\n".encode(), b"Authorization: Bearer wrong\r\n"
    json_type = b"Content-Type: application/json\r\n"
    length = b"Content-Length: %d\r\n" % len(BODY)
    for extra in (good + bad, bad + good, good + good, good + json_type + b"Content-Type: text/plain\r\n",
                  good + b"Origin: http://a.example\r\nOrigin: http://b.example\r\n"):
        headers = extra if b"Content-Type" in extra else extra + json_type
        status, got, body = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + length +
                                 b"Connection: close\r\n\r\n" + BODY)
        error = json.loads(body)["error"]
        assert status == 400 and error["code"] == "duplicate_header", (extra, status, body)
        name = error["param"]
        assert name in ("authorization", "content-type", "origin") and name in error["message"]
    assert up.posts == before
    status, _, body = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + good + json_type + length +
                           b"Connection: close\r\n\r\n" + BODY)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "7" and up.posts == before + 1


def _app(folder: Path, up: EchoUpstream, access_log: Any = None, **limits: Any) -> Any:
    from iapo_gym.deploy.limits import ServeLimits
    from iapo_gym.deploy.router import Router
    from iapo_gym.deploy.server import create_app

    spec = write_spec(folder, 0, endpoint={"base_url": up.url, "max_retries": 0})
    return create_app(Router(mv_policy(), spec), access_log=access_log, limits=ServeLimits(**limits),
                      log=open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115 (lives with the app)


def test_the_app_mounted_under_a_prefix_answers_there(tmp_path: Path) -> None:
    """Starlette's routing honours ``root_path``: the app mounted at /iapo in another app serves /iapo/v1/..., with
    its Host check, CORS and errors unchanged."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    with EchoUpstream("7") as up:
        serve = _app(tmp_path, up, cors_origins=("http://app.example",))
        outer = Starlette(routes=[Mount("/iapo", app=serve)])

        async def run() -> None:
            await serve.router.start(serve.client_options())
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=outer),
                                             base_url="http://127.0.0.1") as client:
                    models = await client.get("/iapo/v1/models")
                    assert models.status_code == 200
                    assert [m["id"] for m in models.json()["data"]] == ["iapo/low", "iapo/mid", "iapo/high"]
                    one = await client.get("/iapo/v1/models/iapo/mid")
                    assert one.status_code == 200 and one.json()["id"] == "iapo/mid"
                    answer = await client.post("/iapo/v1/completions", content=BODY,
                                               headers={"Content-Type": "application/json"})
                    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "7"
                    preflight = await client.options("/iapo/v1/completions", headers={
                        "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
                    assert preflight.status_code == 204
                    assert preflight.headers["access-control-allow-origin"] == "http://app.example"
                    missing = await client.get("/iapo/v1/nothing")
                    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
                    foreign = await client.get("/iapo/v1/models", headers={"Host": "evil.example"})
                    assert foreign.status_code == 421 and foreign.json()["error"]["code"] == "host_not_allowed"
                    # the prefix is the mount's: the same paths without it are not this app's
                    assert (await client.get("/v1/models")).status_code == 404
            finally:
                await serve.router.aclose()

        asyncio.run(run())
    assert up.posts == 1


def test_a_stalled_access_log_holds_only_the_requests_it_logs(tmp_path: Path) -> None:
    """The access log goes to a pipe whose reader has stopped reading (full): the completion waits for its line
    (it is in the log before its answer is complete) while the server goes on answering other requests."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        while True:
            os.write(write_end, b"x" * 65536)
    except BlockingIOError:
        pass  # the pipe is full: the next line waits for the reader
    os.set_blocking(write_end, True)
    stream = os.fdopen(write_end, "w", encoding="utf-8")
    drained: list[bytes] = []
    go = threading.Event()

    def drain() -> None:  # the reader comes back when told (or after 8 s, so that a blocked loop fails, not hangs)
        go.wait(8)
        while chunk := os.read(read_end, 65536):
            drained.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with EchoUpstream("7") as up:
        serve = _app(tmp_path, up, access_log=stream)

        async def run() -> None:
            await serve.router.start(serve.client_options())
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=serve),
                                             base_url="http://127.0.0.1", timeout=30) as client:
                    logged = asyncio.ensure_future(client.post("/v1/completions", content=BODY,
                                                               headers={"Content-Type": "application/json"}))
                    deadline = time.monotonic() + 5
                    while up.posts == 0 and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(0.3)  # the answer is in; its line waits for the pipe
                    for _ in range(5):  # the event loop is free: other requests are answered meanwhile
                        models = await asyncio.wait_for(client.get("/v1/models"), 2)
                        assert models.status_code == 200
                    assert not logged.done() and not go.is_set()  # not complete before its line is written
                    go.set()
                    answer = await asyncio.wait_for(logged, 10)
                    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "7"
            finally:
                await serve.router.aclose()
                serve.access.close()

        asyncio.run(run())
    stream.close()  # the reader sees the end of the pipe
    reader.join(10)
    os.close(read_end)
    lines = b"".join(drained).lstrip(b"x").decode().splitlines()
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    assert record["status"] == 200 and record["path"] == "/v1/completions" and record["context"] == "high"
