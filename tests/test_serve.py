"""``iapo-gym serve`` as a real process on 127.0.0.1, called with the official ``openai`` client.

Upstreams: the real llama.cpp server with the tiny model behind the counting proxy (it counts the
completions it forwards), or the scripted server of tests/scripted_llm.py.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.deploy_helpers import FIRST_CHAR, get_json, mv_policy, post_json, start_scripted, start_serve
from tests.llm_server import (
    free_port,
    llama_server,  # noqa: F401 (fixture)
    output,
    proxy_stats,
    start_llama_server,
    start_proxy,
    stop,
    tiny_model,  # noqa: F401 (fixture)
    write_spec,
)

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

N_OF = {"low": 3, "mid": 2, "high": 1}


def _first_char(text: str) -> str | None:
    m = re.match(r"\A\s*(\S)", text)
    return m.group(1) if m else None


def _post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    status, doc, _ = post_json(port, path, body, headers)
    return status, doc


def _stop_point(answers: list[str | None], n: int) -> int:
    """Where a vote of cap N stops: the first k whose leader leads the runner-up by more than the N - k left."""
    for k in range(1, n + 1):
        counts = sorted(Counter(answers[:k]).values(), reverse=True) + [0]
        if counts[0] - counts[1] > n - k:
            return k
    return n


def _check_vote(iapo: dict[str, Any], text: str, n: int) -> None:
    """The response is the first completion of the most-voted answer; the vote of cap N stopped where it was first
    decided (at least floor(N/2) + 1 completions), and the votes add up to the completions drawn."""
    drawn = iapo["drawn"]
    assert iapo["n"] == n and n // 2 + 1 <= drawn <= n and len(iapo["answers"]) == drawn
    assert drawn == _stop_point(iapo["answers"], n)
    votes = dict((a, v) for a, v in iapo["votes"])
    assert sum(votes.values()) == drawn
    assert votes[iapo["winner"]] == max(votes.values()) and iapo["winner"] in iapo["tied"]
    assert iapo["answers"][iapo["chosen"]] == iapo["winner"] == _first_char(text)
    assert iapo["answers"].index(iapo["winner"]) == iapo["chosen"]


@pytest.fixture(scope="module")
def stack(llama_server: int, tmp_path_factory: pytest.TempPathFactory) -> object:  # noqa: F811
    """llama.cpp <- counting proxy <- iapo-gym serve; yields (serve port, proxy port, access log path)."""
    folder = tmp_path_factory.mktemp("serve")
    proxy_port, serve_port = free_port(), free_port()
    proxy = start_proxy(llama_server, proxy_port)
    spec = write_spec(folder, proxy_port, sampling={"temperature": 0.9, "max_tokens": 4},
                      endpoint={"concurrency": 8})
    policy = mv_policy(extractor=FIRST_CHAR).save(folder / "policy.json")
    log = folder / "access.jsonl"
    serve = start_serve(policy, spec, serve_port, extra=["--access-log", str(log)])
    try:
        yield serve_port, proxy_port, log, serve
    finally:
        stop(serve)
        stop(proxy)


def test_both_apis_with_the_openai_client_and_the_completions_drawn_upstream(stack: tuple[int, int, Path, Any]) -> None:
    serve_port, proxy_port, log, _ = stack
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key="unused", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["iapo/low", "iapo/mid", "iapo/high"]
    calls = 0
    for context, n in N_OF.items():
        for query in ("1 + 1 =", "Name a letter:"):
            before = proxy_stats(proxy_port)
            resp = client.completions.create(model=f"iapo/{context}", prompt=query)
            after = proxy_stats(proxy_port)
            assert resp.object == "text_completion" and len(resp.choices) == 1 and resp.model == f"iapo/{context}"
            assert after["choices"] - before["choices"] == resp.model_extra["iapo"]["drawn"]  # exactly those drawn
            assert resp.usage.completion_tokens == after["completion_tokens"] - before["completion_tokens"]
            assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
            assert resp.usage.prompt_tokens > 0
            iapo = resp.model_extra["iapo"]
            assert iapo["context"] == context and iapo["prompt"] == ("plain" if context == "low" else "short")
            _check_vote(iapo, resp.choices[0].text, n)

            before = after
            chat = client.chat.completions.create(
                model="anything", messages=[{"role": "user", "content": query}], extra_body={"iapo_context": context})
            after = proxy_stats(proxy_port)
            assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
            assert after["choices"] - before["choices"] == chat.model_extra["iapo"]["drawn"]
            assert chat.usage.completion_tokens == after["completion_tokens"] - before["completion_tokens"]
            _check_vote(chat.model_extra["iapo"], chat.choices[0].message.content or "", n)
            calls += 2
    # by weights: the objective weight and the cost weight of "mid"
    resp = client.completions.create(model="iapo/[1.0, -0.2]", prompt="1 + 1 =")
    assert resp.model_extra["iapo"]["context"] == "mid"
    calls += 1
    records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    served = [r for r in records if r["status"] == 200]
    assert len(served) >= calls
    last = served[-1]
    assert last["context"] == "mid" and last["n"] == last["drawn"] == 2  # a vote of 2 needs both
    assert last["completion_tokens"] == resp.usage.completion_tokens
    low = [r for r in served if r["context"] == "low"]
    assert low and all(r["n"] == 3 and 2 <= r["drawn"] <= 3 for r in low)
    assert last["latency_ms"] > 0 and last["path"] == "/v1/completions"


@pytest.mark.heavy
def test_load_32_clients_x_20_requests(stack: tuple[int, int, Path, Any]) -> None:
    serve_port, proxy_port, _, proc = stack
    before = proxy_stats(proxy_port)
    contexts = list(N_OF)

    def client_run(i: int) -> list[tuple[str, int, int]]:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        out = []
        for j in range(20):
            context = contexts[(i + j) % 3]
            if j % 2:
                r = client.completions.create(model=f"iapo/{context}", prompt=f"{i} + {j} =")
                text = r.choices[0].text
            else:
                r = client.chat.completions.create(model=f"iapo/{context}",
                                                   messages=[{"role": "user", "content": f"{i} * {j} ="}])
                text = r.choices[0].message.content or ""
            iapo = r.model_extra["iapo"]
            _check_vote(iapo, text, N_OF[context])
            assert r.usage.completion_tokens >= iapo["drawn"]
            out.append((context, iapo["drawn"], r.usage.completion_tokens))
        return out

    with ThreadPoolExecutor(32) as pool:
        results = [x for batch in pool.map(client_run, range(32)) for x in batch]  # any error is raised here
    after = proxy_stats(proxy_port)
    assert len(results) == 640
    assert after["choices"] - before["choices"] == sum(n for _, n, _ in results)
    assert after["completion_tokens"] - before["completion_tokens"] == sum(t for _, _, t in results)
    assert proc.poll() is None


def test_bad_requests_and_the_inbound_key(tmp_path: Path) -> None:
    up, port = free_port(), free_port()
    # a request with n = k gets the first k texts: the vote's first wave (n = 2) is 2, 3, undecided; its second (n = 1) 2
    scripted = start_scripted({"Q: 1 + 1 =\nA:": ["2", "3", "2"], "FORBIDDEN ->": ["x"]}, tmp_path, up)
    spec = write_spec(tmp_path, up, endpoint={"max_retries": 0})
    policy = mv_policy().save(tmp_path / "policy.json")
    secret = "sk-test-9f8e7d6c5b4a"
    log = tmp_path / "access.jsonl"
    serve = start_serve(policy, spec, port, extra=["--api-key-env", "IAPO_TEST_KEY", "--access-log", str(log)],
                        env={"IAPO_TEST_KEY": secret})
    try:
        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError, match="missing or wrong API key"):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).completions.create(model="iapo/low", prompt="x")
        status, body = _post(port, "/v1/completions", b'{"model": "iapo/low", "prompt": "1 + 1 ="}')
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=base, api_key=secret, max_retries=0)
        ok = client.completions.create(model="iapo/low", prompt="1 + 1 =")
        assert ok.choices[0].text == "2" and ok.model_extra["iapo"]["votes"] == [["2", 2], ["3", 1]]
        assert ok.model_extra["iapo"]["answers"] == ["2", "3", "2"] and ok.model_extra["iapo"]["drawn"] == 3
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="iapo/medium", prompt="1 + 1 =")
        message = str(info.value)
        assert "unknown context 'medium'" in message and all(c in message for c in ("low", "mid", "high"))
        assert [c["name"] for c in info.value.body["contexts"]] == ["low", "mid", "high"]
        with pytest.raises(openai.BadRequestError, match="names no context"):
            client.completions.create(model="gpt-4o", prompt="1 + 1 =")
        auth = {"Authorization": f"Bearer {secret}"}
        for raw, reason in ((b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
                            (b'{"model": "iapo/low"}', "prompt: must be a non-empty string"),
                            (b'{"model": "iapo/low", "prompt": "q", "n": 3}', "policy chooses how many")):
            status, body = _post(port, "/v1/completions", raw, auth)
            assert status == 400 and reason in body["error"]["message"], (raw, body)
        status, body = _post(port, "/v1/chat/completions", b'{"model": "iapo/low", "messages": [{"role": "system", '
                                                           b'"content": "s"}]}', auth)
        assert status == 400 and body["error"]["param"] == "messages[0].role"
        # an upstream 403 is the server's credentials problem, never the caller's: 502 upstream_auth
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="iapo/mid", prompt="FORBIDDEN")
        assert info.value.status_code == 502 and info.value.body["code"] == "upstream_auth"
        assert client.completions.create(model="iapo/low", prompt="1 + 1 =").choices[0].text == "2"
        assert serve.poll() is None
    finally:
        printed = output(serve)
        stop(serve)
        stop(scripted)
    records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    assert Counter(r["status"] for r in records) == Counter({400: 7, 401: 2, 200: 2, 502: 1})
    assert secret not in log.read_text(encoding="utf-8") and secret not in printed and "iapo-gym serve" in printed


def test_missing_key_variable_and_bad_policy_stop_the_command(tmp_path: Path) -> None:
    from iapo_gym.cli import main

    spec = write_spec(tmp_path, free_port())
    policy = mv_policy().save(tmp_path / "policy.json")
    assert main(["serve", str(policy), "--upstream", str(spec), "--api-key-env", "IAPO_UNSET_VARIABLE_X"]) == 1
    text = policy.read_text(encoding="utf-8").replace('"n": 3', '"n": 4')
    (tmp_path / "edited.json").write_text(text, encoding="utf-8")
    assert main(["serve", str(tmp_path / "edited.json"), "--upstream", str(spec)]) == 1


@pytest.mark.heavy
def test_upstream_killed_during_load_gives_502s_then_recovers(tiny_model: Path, tmp_path: Path) -> None:  # noqa: F811
    up, port = free_port(), free_port()
    llama = start_llama_server(tiny_model, up)
    spec = write_spec(tmp_path, up, sampling={"temperature": 0.9, "max_tokens": 4},
                      endpoint={"max_retries": 1, "backoff": 0.05, "max_backoff": 0.1, "timeout": 10})
    policy = mv_policy(extractor=FIRST_CHAR).save(tmp_path / "policy.json")
    serve = start_serve(policy, spec, port)
    stop_load = threading.Event()
    outcomes: list[tuple[int, str]] = []
    lock = threading.Lock()

    def load(i: int) -> None:
        k = 0
        while not stop_load.is_set():
            status, body = _post(port, "/v1/completions", json.dumps({"model": f"iapo/{list(N_OF)[k % 3]}",
                                                                      "prompt": f"{i}+{k}"}).encode())
            k += 1
            with lock:
                outcomes.append((status, body["error"]["message"] if status != 200 else ""))
    try:
        threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        while len([o for o in outcomes if o[0] == 200]) < 20:
            time.sleep(0.05)
        llama.send_signal(signal.SIGKILL)
        llama.wait()
        killed_at = len(outcomes)
        deadline = time.monotonic() + 30
        while len([o for o in outcomes[killed_at:] if o[0] == 502]) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert serve.poll() is None
        status, health = get_json(port, "/health")  # the upstream is down: 503, with its last success and failure
        assert status == 503 and health["status"] == "upstream_down" and health["upstream"]["state"] == "down"
        assert health["upstream"]["last_success"] and health["upstream"]["last_error"] == "upstream_unavailable"
        llama = start_llama_server(tiny_model, up)  # back on the same port
        back_at = len(outcomes)
        deadline = time.monotonic() + 60
        while len([o for o in outcomes[back_at:] if o[0] == 200]) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop_load.set()
        for t in threads:
            t.join()
        status, health = get_json(port, "/health")
        assert status == 200 and health["status"] == "ok" and health["upstream"]["state"] == "up"
    finally:
        stop_load.set()
        printed = output(serve)
        stop(serve)
        stop(llama)
    during = outcomes[killed_at:back_at]
    failed = [m for s, m in during if s == 502]
    assert len(failed) >= 10 and {s for s, _ in during} <= {200, 502}, printed[-3000:]
    # the caller hears the project's message, never the upstream's address or its client's exception
    assert all(m.startswith("the upstream is unavailable") and "127.0.0.1" not in m for m in failed), failed[:3]
    assert "upstream_unavailable" in printed  # the cause goes to the server's log
    assert len([s for s, _ in outcomes[back_at:] if s == 200]) >= 20
    assert outcomes[-1][0] == 200  # normal answers once it is back


def test_graceful_shutdown_finishes_requests_in_flight(tmp_path: Path) -> None:
    up, port = free_port(), free_port()
    scripted = start_scripted({"Q: slow\nA:": ["4", "4", "5"]}, tmp_path, up, delay=1.5)
    spec = write_spec(tmp_path, up)
    serve = start_serve(mv_policy().save(tmp_path / "policy.json"), spec, port)
    results: list[tuple[int, dict[str, Any]]] = []
    try:
        t = threading.Thread(target=lambda: results.append(
            _post(port, "/v1/completions", b'{"model": "iapo/low", "prompt": "slow"}')))
        t.start()
        time.sleep(0.5)  # the request is waiting on the upstream
        serve.send_signal(signal.SIGTERM)
        t.join(timeout=30)
        assert serve.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
    finally:
        stop(serve)
        stop(scripted)
    assert results and results[0][0] == 200 and results[0][1]["choices"][0]["text"] == "4"
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def test_the_specs_lifetime_cap_does_not_stop_serve(tmp_path: Path) -> None:
    """A spec's [budget] caps a collection; serve answers past it (its own budget is a rate, --rate)."""
    up, port = free_port(), free_port()
    scripted = start_scripted({"1 + 1 = ->": ["2"]}, tmp_path, up)
    spec = write_spec(tmp_path, up, budget={"max_requests": 1, "max_tokens_total": 20})
    serve = start_serve(mv_policy().save(tmp_path / "policy.json"), spec, port)
    try:
        for _ in range(5):
            status, body = _post(port, "/v1/completions", b'{"model": "iapo/high", "prompt": "1 + 1 ="}')
            assert status == 200 and body["choices"][0]["text"] == "2"
        status, health = get_json(port, "/health")
        assert status == 200 and health["spent"]["requests"] == 5 and health["served"] == 5
    finally:
        stop(serve)
        stop(scripted)
