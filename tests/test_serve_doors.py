"""``iapo-gym serve`` answers only the hosts it is meant for, and refuses to listen beyond loopback without a key.

Real parts: serve as a process in front of the scripted upstream (tests/scripted_llm.py, which counts the
requests it gets), ``curl``, and headless Chromium with a host-resolver rule for the DNS-rebinding page.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iapo_gym.deploy.limits import ServeLimits, host_name
from tests.deploy_helpers import mv_policy, scripted_stats, start_scripted, start_serve
from tests.llm_server import HERE, free_port, output, stop, write_spec

pytest.importorskip("uvicorn")

CURL = shutil.which("curl")
SCRIPT = {"1 + 1 = ->": ["2"], "Q: 1 + 1 =\nA:": ["2", "2", "2"]}
BODY = json.dumps({"model": "iapo/high", "prompt": "1 + 1 ="})


def _request(port: int, method: str, path: str, host: str, body: str | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    """One request with the Host header ``host``, with curl where it is installed (else http.client)."""
    extra = {"Content-Type": "application/json", **(headers or {})} if body is not None else dict(headers or {})
    if CURL:
        cmd = [CURL, "-s", "-i", "-X", method, "-H", f"Host: {host}", f"http://127.0.0.1:{port}{path}"]
        for k, v in extra.items():
            cmd += ["-H", f"{k}: {v}"]
        if body is not None:
            cmd += ["--data-binary", body]
        raw = subprocess.run(cmd, capture_output=True, check=True, timeout=30).stdout.decode()
        head, _, text = raw.partition("\r\n\r\n")
        status = int(head.split()[1])
        got = {line.split(":", 1)[0].lower(): line.split(":", 1)[1].strip() for line in head.split("\r\n")[1:]}
        return status, json.loads(text) if text else {}, got
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.putrequest(method, path, skip_host=True)
    conn.putheader("Host", host)
    for k, v in extra.items():
        conn.putheader(k, v)
    data = body.encode() if body is not None else b""
    if body is not None:
        conn.putheader("Content-Length", str(len(data)))
    conn.endheaders(data or None)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, json.loads(text) if text else {}, {k.lower(): v for k, v in resp.getheaders()}


def test_host_names_are_parsed_and_bad_entries_refused() -> None:
    assert host_name("API.Example.com:8000") == ("api.example.com", 8000)
    assert host_name("localhost.") == ("localhost", None)
    assert host_name("[::1]:8000") == ("[::1]", 8000)
    assert host_name("10.0.0.5") == ("10.0.0.5", None)
    for bad in ("http://x.example", "x.example/path", "x.example:0", "x.example:99999", "a b", "[::1", "",
                "x.example:port", "ex\u00e4mple.com"):
        with pytest.raises(ValueError, match="a host is NAME or NAME:PORT"):
            host_name(bad)
    with pytest.raises(ValueError, match="'evil example'"):
        ServeLimits(allowed_hosts=("evil example",))


ALLOWED = re.compile(r"(?:(?:localhost|127\.0\.0\.1|api\.example)\.?|\[::1\])(:[0-9]+)?", re.I)


@settings(max_examples=2000, deadline=None, database=None, derandomize=True)
@given(st.one_of(st.binary(max_size=40),
                 st.tuples(st.sampled_from(["localhost", "127.0.0.1", "[::1]", "api.example", "LocalHost", "evil"]),
                           st.sampled_from(["", ".", ":", ":8000", ":0", ":65536", ":80:80", "x", ".evil", " ", "\x00"]),
                           st.binary(max_size=3)).map(lambda t: (t[0] + t[1]).encode() + t[2])))
def test_host_check_fuzzed(value: bytes) -> None:
    """Any Host header value: answered only when it names an allowed host with at most a valid port, never an error."""
    refused = _fuzz_app()._host_refused({b"host": value}, 1)
    text = value.decode("latin-1").strip()
    match = ALLOWED.fullmatch(text)
    valid = match is not None and (match.group(1) is None or 0 < int(match.group(1)[1:]) < 65536)
    assert (refused is None) == valid, (value, refused)
    if refused is not None:
        assert refused.status == 421 and refused.code == "host_not_allowed"


@functools.cache
def _fuzz_app() -> Any:
    """A ServeApp (never started) with one allowed host besides the defaults."""
    import tempfile

    from iapo_gym.deploy.router import Router
    from iapo_gym.deploy.server import create_app

    folder = Path(tempfile.mkdtemp(prefix="iapo-hosts-"))
    router = Router(mv_policy(), write_spec(folder, free_port()))
    return create_app(router, limits=ServeLimits(allowed_hosts=("api.example",)), log=open(os.devnull, "w"))  # noqa: SIM115


@pytest.fixture(scope="module")
def doors(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """serve (CORS open to any origin, one extra allowed host) before the scripted upstream; (serve port, upstream)."""
    folder = tmp_path_factory.mktemp("doors")
    up, port = free_port(), free_port()
    scripted = start_scripted(SCRIPT, folder, up)
    spec = write_spec(folder, up, endpoint={"max_retries": 0})
    serve = start_serve(mv_policy().save(folder / "policy.json"), spec, port,
                        extra=["--cors-origin", "*", "--allowed-host", "api.example", "--allowed-host", "pinned:81"])
    try:
        yield port, up
    finally:
        stop(serve)
        stop(scripted)


def test_a_foreign_host_header_is_refused_on_every_route(doors: tuple[int, int]) -> None:
    port, up = doors
    before = scripted_stats(up)["requests"]
    for host in ("evil.example", f"evil.example:{port}", "rebind.test", "127.0.0.1.evil.example", "pinned:82", "x y"):
        for method, path, body in (("POST", "/v1/completions", BODY), ("POST", "/v1/chat/completions", "{}"),
                                   ("GET", "/health", None), ("GET", "/v1/models", None), ("GET", "/nowhere", None),
                                   ("OPTIONS", "/v1/completions", None)):
            headers = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"} \
                if method == "OPTIONS" else None
            status, doc, got = _request(port, method, path, host, body, headers)
            assert status == 421, (host, method, path, status, doc)
            assert doc["error"]["code"] == "host_not_allowed" and doc["error"]["type"] == "invalid_request_error"
            assert "access-control-allow-origin" not in got  # a refusal opens nothing to a browser
            assert got.get("connection") == "close"
    assert scripted_stats(up)["requests"] == before  # nothing reached the upstream
    # the names it answers to: the bound address, localhost's, and the allowed ones (any port unless pinned)
    for host in (f"127.0.0.1:{port}", "localhost", f"LOCALHOST:{port}", f"[::1]:{port}", "api.example",
                 "api.example:443", "pinned:81"):
        status, doc, _ = _request(port, "POST", "/v1/completions", host, BODY)
        assert status == 200 and doc["choices"][0]["text"] == "2", (host, status, doc)
    assert scripted_stats(up)["requests"] == before + 7


def test_no_host_header_is_refused(doors: tuple[int, int]) -> None:
    port, _ = doors
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")  # HTTP/1.0 may omit Host: the server still wants one
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split()[1] == b"400" and json.loads(body)["error"]["code"] == "missing_host"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # an allowed Host and a foreign one
        s.sendall(b"GET /health HTTP/1.1\r\nHost: evil.example\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.split()[1] == b"400", data[:200]


def _serve_cmd(policy: Path, spec: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "iapo_gym.cli", "serve", str(policy), "--upstream", str(spec), "--port", str(port),
            *extra]


def test_listening_beyond_loopback_needs_a_key(tmp_path: Path) -> None:
    up, port = free_port(), free_port()
    spec = write_spec(tmp_path, up)
    policy = mv_policy().save(tmp_path / "policy.json")
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    for host in ("0.0.0.0", "::", "192.0.2.7", "serve.example"):
        run = subprocess.run(_serve_cmd(policy, spec, port, "--host", host), capture_output=True, text=True,
                             timeout=60, env=env)
        assert run.returncode == 1, run.stderr
        assert f"--host {host} listens beyond this machine" in run.stderr and "--api-key-env" in run.stderr
        assert "--insecure-no-key" in run.stderr
    # with --insecure-no-key it serves, with a warning; the Host check still holds
    scripted = start_scripted(SCRIPT, tmp_path, up)
    serve = start_serve(policy, spec, port, extra=["--host", "0.0.0.0", "--insecure-no-key"])
    try:
        assert "warning: listening on 0.0.0.0 without an inbound key" in output(serve)
        assert _request(port, "GET", "/health", f"0.0.0.0:{port}")[0] == 200  # the bound address
        assert _request(port, "GET", "/health", "evil.example")[0] == 421
    finally:
        stop(serve)
        stop(scripted)


# ---- DNS rebinding in a real browser -------------------------------------------------------------------------

PAGE = b"""<!doctype html><html><body><script>
window.result = null;
async function attack(url) {
  window.result = null;
  try {
    const r = await fetch(url, {method: "POST", headers: {"Content-Type": "application/json"},
                                body: JSON.stringify({model: "iapo/high", prompt: "1 + 1 ="})});
    window.result = {status: r.status, body: await r.text()};
  } catch (e) {
    window.result = {error: String(e)};
  }
}
</script><p>a page of rebind.test</p></body></html>"""


class _Page(BaseHTTPRequestHandler):
    """The attacker's page, served at rebind.test:PORT."""

    protocol_version = "HTTP/1.0"
    timeout = 0.3  # a connection the browser opened ahead (and left idle) is closed before the name is rebound

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(PAGE)


class _Attack:
    """Headless Chromium resolving rebind.test to 127.0.0.1, the scripted upstream, and serve processes."""

    def __init__(self, folder: Path) -> None:
        from tests.test_html_site import chrome

        self.folder, self.up = folder, free_port()
        self.scripted = start_scripted(SCRIPT, folder, self.up)
        self.spec = write_spec(folder, self.up, endpoint={"max_retries": 0})
        self.policy = mv_policy().save(folder / "policy.json")
        self.driver = chrome(extra=("--host-resolver-rules=MAP rebind.test 127.0.0.1",))

    def close(self) -> None:
        self.driver.quit()
        stop(self.scripted)

    def load(self, port: int) -> ThreadingHTTPServer:
        """The page served at rebind.test:PORT and loaded; the page server is returned (still serving)."""
        page = ThreadingHTTPServer(("127.0.0.1", port), _Page)
        threading.Thread(target=page.serve_forever, daemon=True).start()
        self.driver.get(f"http://rebind.test:{port}/")
        assert "a page of rebind.test" in self.driver.page_source
        return page

    def fetch(self, url: str) -> dict[str, Any]:
        """What the page's script saw of its POST to ``url``."""
        self.driver.execute_script("attack(arguments[0])", url)
        deadline = time.monotonic() + 20
        result = None
        while result is None and time.monotonic() < deadline:
            result = self.driver.execute_script("return window.result")
            time.sleep(0.05)
        assert result is not None, "the page's fetch did not finish"
        return dict(result)

    def rebound(self, extra: list[str]) -> tuple[dict[str, Any], int]:
        """The page loaded from rebind.test:PORT, then serve started on that port (the name now leads to the
        victim's server, as after a DNS rebinding), then the page's same-origin fetch of /v1/completions;
        (what the script saw, requests the upstream got meanwhile)."""
        port = free_port()
        page = self.load(port)
        page.shutdown()
        page.server_close()
        before = scripted_stats(self.up)["requests"]
        serve = start_serve(self.policy, self.spec, port, extra=extra)
        try:
            return self.fetch("/v1/completions"), scripted_stats(self.up)["requests"] - before
        finally:
            stop(serve)


@pytest.mark.heavy
def test_a_dns_rebinding_page_in_chromium_is_refused(tmp_path: Path) -> None:
    attack = _Attack(tmp_path)
    try:
        result, spent = attack.rebound([])
        assert result.get("status") == 421, result  # the page's own script sees the refusal
        assert json.loads(result["body"])["error"]["code"] == "host_not_allowed"
        assert spent == 0  # and nothing reached the upstream
        # the same page against a server told to answer rebind.test reads the answer: the Host check is what refuses
        result, spent = attack.rebound(["--allowed-host", "rebind.test"])
        assert result.get("status") == 200, result
        assert json.loads(result["body"])["choices"][0]["text"] == "2" and spent == 1
        # a page on another port of rebind.test, CORS open to every origin: by the name, refused (the preflight
        # gets the 421, so the script sees a failed fetch); by 127.0.0.1, which serve answers, it goes through
        page_port, port = free_port(), free_port()
        page = attack.load(page_port)
        serve = start_serve(attack.policy, attack.spec, port, extra=["--cors-origin", "*"])
        try:
            before = scripted_stats(attack.up)["requests"]
            result = attack.fetch(f"http://rebind.test:{port}/v1/completions")
            assert "status" not in result and "Failed to fetch" in result["error"], result
            assert scripted_stats(attack.up)["requests"] == before
            result = attack.fetch(f"http://127.0.0.1:{port}/v1/completions")
            assert result.get("status") == 200 and scripted_stats(attack.up)["requests"] == before + 1, result
        finally:
            stop(serve)
            page.shutdown()
            page.server_close()
    finally:
        attack.close()
