"""``iapo-gym serve``'s errors reveal nothing of its upstream, and it takes JSON only (docs/deploy.md, "Errors").

The upstream is tests/echo_upstream.py on 127.0.0.1: it echoes the ``Authorization`` header it got, the
prompt and its own address in its 401/403/4xx/500 bodies, as some providers do in part.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from iapo_gym.deploy.errors import MASK, Masker
from tests.deploy_helpers import mv_policy, start_serve
from tests.echo_upstream import EchoUpstream
from tests.llm_server import free_port, output, stop, write_spec

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

UPSTREAM_KEY = "sk-7Hq2Lr9XvT4mNc8Zp1Ws"
INBOUND_KEY = "sk-Qa5Rt8Yu2Io6Pk3Lm9Nb"


def _request(port: int, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
             method: str | None = None) -> tuple[int, bytes, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def _pieces(secret: str, size: int = 6) -> list[str]:
    return [secret[i:i + size] for i in range(len(secret) - size + 1)]


def test_masker_hides_whole_and_partial_secrets() -> None:
    mask = Masker([UPSTREAM_KEY, None, "", "abc"])
    text = f"key {UPSTREAM_KEY} or sk-7Hq2L...8Zp1Ws, abc and ab"
    masked = mask(text)
    assert masked == f"key {MASK} or {MASK}...{MASK}, {MASK} and ab"
    assert not any(p in masked for p in _pieces(UPSTREAM_KEY))
    assert mask("nothing secret") == "nothing secret"


@pytest.fixture(scope="module")
def echo_stack(tmp_path_factory: pytest.TempPathFactory) -> object:
    """Echo upstream (expects UPSTREAM_KEY) <- serve (inbound key INBOUND_KEY); yields (port, upstream, serve)."""
    folder = tmp_path_factory.mktemp("errors")
    with EchoUpstream() as up:
        port = free_port()
        spec = write_spec(folder, 0, endpoint={"base_url": up.url, "api_key_env": "ECHO_UPSTREAM_KEY",
                                               "max_retries": 3, "backoff": 0.01, "max_backoff": 0.02})
        serve = start_serve(mv_policy().save(folder / "policy.json"), spec, port,
                            extra=["--api-key-env", "SERVE_INBOUND_KEY"],
                            env={"ECHO_UPSTREAM_KEY": UPSTREAM_KEY, "SERVE_INBOUND_KEY": INBOUND_KEY})
        try:
            yield port, up, serve
        finally:
            stop(serve)


def test_upstream_errors_reach_the_caller_as_the_projects_own(echo_stack: tuple[int, EchoUpstream, Any]) -> None:
    port, up, serve = echo_stack
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=INBOUND_KEY, max_retries=0)
    expected = {401: (502, "upstream_auth", None), 403: (502, "upstream_auth", None),
                400: (502, "upstream_rejected", 400), 404: (502, "upstream_rejected", 404),
                422: (502, "upstream_rejected", 422), 500: (502, "upstream_unavailable", None),
                503: (502, "upstream_unavailable", None)}
    for upstream_status, (status, code, shown) in expected.items():
        for chat in (False, True):
            query = f"STATUS:{upstream_status} my private question"
            before = up.posts
            with pytest.raises(openai.APIStatusError) as info:
                if chat:
                    client.chat.completions.create(model="iapo/high", messages=[{"role": "user", "content": query}])
                else:
                    client.completions.create(model="iapo/high", prompt=query)
            err = info.value
            assert err.status_code == status and err.body["code"] == code, (upstream_status, err.body)
            assert err.body.get("upstream_status") == shown
            assert not isinstance(err, openai.AuthenticationError)  # never the caller's own 401
            raw = err.response.text
            for leak in (UPSTREAM_KEY, *_pieces(UPSTREAM_KEY), "127.0.0.1", str(up.port), "private question",
                         "Incorrect API key", "Bearer"):
                assert leak not in raw, (leak, raw)
            # 5xx is retried (once in serve, though the spec allows 3); a refusal is not retried
            assert up.posts - before == (2 if upstream_status >= 500 else 1)
    assert all(h["authorization"] == f"Bearer {UPSTREAM_KEY}" for h in up.headers)  # the key went to its host
    log = output(serve)
    assert "upstream_auth" in log and "upstream_rejected" in log and MASK in log
    for leak in (UPSTREAM_KEY, *_pieces(UPSTREAM_KEY), INBOUND_KEY):
        assert leak not in log, leak


def test_json_bodies_only_no_cors_and_404s_in_the_openai_shape(echo_stack: tuple[int, EchoUpstream, Any]) -> None:
    port, up, _ = echo_stack
    auth = {"Authorization": f"Bearer {INBOUND_KEY}"}
    body = json.dumps({"model": "iapo/high", "prompt": "1 + 1 ="}).encode()
    before = up.posts
    # a browser form can send text/plain or form-encoded bodies without a preflight: refused, nothing spent
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        status, raw, headers = _request(port, "/v1/completions", body, {**auth, "Content-Type": content_type,
                                                                        "Origin": "http://evil.example"})
        assert status == 415 and json.loads(raw)["error"]["code"] == "unsupported_media_type", content_type
        assert headers.get("access-control-allow-origin") is None
    assert up.posts == before
    status, raw, headers = _request(port, "/v1/completions", body, {**auth, "Content-Type": "application/json; "
                                    "charset=utf-8", "Origin": "http://evil.example"})
    assert status == 200 and headers.get("access-control-allow-origin") is None
    status, raw, _ = _request(port, "/v1/completions", None, {"Origin": "http://evil.example",
                                                             "Access-Control-Request-Method": "POST"}, "OPTIONS")
    assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"  # no preflight answered
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=INBOUND_KEY, max_retries=0)
    assert client.models.retrieve("iapo/mid").id == "iapo/mid"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    for method, path in (("GET", "/v1/nothing"), ("POST", "/v1/embeddings"), ("GET", "/")):
        status, raw, _ = _request(port, path, b"{}" if method == "POST" else None,
                                  {**auth, "Content-Type": "application/json"}, method)
        error = json.loads(raw)["error"]
        assert status == 404 and error["code"] == "not_found" and set(error) >= {"message", "type", "code"}
    status, raw, _ = _request(port, "/v1/completions", None, auth, "GET")
    assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"
    with pytest.raises(openai.AuthenticationError):  # models need the inbound key too
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()


def test_cors_only_for_the_origins_given(tmp_path: Path) -> None:
    with EchoUpstream() as up:
        port = free_port()
        spec = write_spec(tmp_path, 0, endpoint={"base_url": up.url})
        serve = start_serve(mv_policy().save(tmp_path / "policy.json"), spec, port,
                            extra=["--cors-origin", "http://app.example"])
        try:
            status, _, headers = _request(port, "/v1/chat/completions", None, {
                "Origin": "http://app.example", "Access-Control-Request-Method": "POST"}, "OPTIONS")
            assert status == 204 and headers["access-control-allow-origin"] == "http://app.example"
            assert "content-type" in headers["access-control-allow-headers"]
            status, _, headers = _request(port, "/v1/chat/completions", None, {
                "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}, "OPTIONS")
            assert status == 403 and headers.get("access-control-allow-origin") is None
            body = json.dumps({"model": "iapo/high", "messages": [{"role": "user", "content": "q"}]}).encode()
            status, _, headers = _request(port, "/v1/chat/completions", body, {
                "Origin": "http://app.example", "Content-Type": "application/json"})
            assert status == 200 and headers["access-control-allow-origin"] == "http://app.example"
        finally:
            stop(serve)


def test_a_refused_reward_call_ends_only_its_request(tmp_path: Path) -> None:
    """Best-of-N through a reward endpoint: its refusal is 502 ``upstream_rejected`` for that request only."""
    import dataclasses
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.deploy_helpers import bon_policy

    class Reward(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            refuse = "REFUSE" in body["query"]
            data = json.dumps({"error": f"no: {body['query']}"} if refuse else
                              {"scores": {"length": 0.5, "digits": 1.0}}).encode()
            self.send_response(400 if refuse else 200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    reward = ThreadingHTTPServer(("127.0.0.1", 0), Reward)
    threading.Thread(target=reward.serve_forever, daemon=True).start()
    policy = bon_policy(n=2)
    policy = dataclasses.replace(policy, scorer={**policy.scorer, "callable": None,
                                                 "reward_url": f"http://127.0.0.1:{reward.server_port}/score"})
    with EchoUpstream() as up:
        port = free_port()
        spec = write_spec(tmp_path, 0, endpoint={"base_url": up.url})
        serve = start_serve(policy.save(tmp_path / "policy.json"), spec, port)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            assert client.completions.create(model="iapo/long", prompt="q").model_extra["iapo"]["aggregator"] == "bon"
            with pytest.raises(openai.InternalServerError) as info:
                client.completions.create(model="iapo/long", prompt="REFUSE this")
            assert info.value.status_code == 502 and info.value.body["code"] == "upstream_rejected"
            assert "REFUSE" not in info.value.response.text
            for _ in range(3):  # the scorer keeps serving the other requests
                assert client.completions.create(model="iapo/digits", prompt="q").choices[0].text == "42"
        finally:
            stop(serve)
            reward.shutdown()
            reward.server_close()


def test_direct_requests_carry_account_headers_only_where_the_openai_key_goes() -> None:
    """serve sends its upstream requests directly; the OPENAI_* account headers go only with OPENAI_API_KEY."""
    from iapo_gym.llm.client import direct_headers
    from iapo_gym.llm.spec import Route

    env = {"OPENAI_ORG_ID": "org-1", "OPENAI_PROJECT_ID": "proj-1", "OPENAI_CUSTOM_HEADERS": "X-Team: blue\nno colon"}
    openai_route = Route("LLM endpoint", "https://api.openai.com/v1", "OPENAI_API_KEY", "the OpenAI API")
    assert direct_headers(openai_route, env) == {"Accept": "application/json", "OpenAI-Organization": "org-1",
                                                 "OpenAI-Project": "proj-1", "X-Team": "blue"}
    for key_env in ("OTHER_PROVIDER_KEY", None):
        assert direct_headers(Route("LLM endpoint", "http://127.0.0.1:9/v1", key_env, "spec"), env) == {
            "Accept": "application/json"}
