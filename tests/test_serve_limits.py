"""``iapo-gym serve`` bounds the work one request can cause, and its budget is a rate (docs/deploy.md, "Limits").

Real parts: the llama.cpp server with the tiny model (behind the counting proxy), the header-echoing
upstream of tests/echo_upstream.py on 127.0.0.1, serve as a process, the official ``openai`` client.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from iapo_gym.llm.spec import load_spec
from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyPrompt
from tests.deploy_helpers import FIRST_CHAR, get_json, mv_policy, post_json, start_serve
from tests.echo_upstream import EchoUpstream
from tests.llm_server import (
    free_port,
    llama_server,  # noqa: F401 (fixture)
    output,
    proxy_stats,
    start_proxy,
    stop,
    tiny_model,  # noqa: F401 (fixture)
    write_spec,
)

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]


def _body(prompt: str, context: str = "high", **extra: Any) -> bytes:
    return json.dumps({"model": f"iapo/{context}", "prompt": prompt, **extra}).encode()


# the serving budget's windows, reservations and stores: tests/test_budget_store.py; serve's budget shared by
# processes and restarts, and counting money: tests/test_serve_budget.py


# ---- one request's work is bounded -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_stack(llama_server: int, tmp_path_factory: pytest.TempPathFactory) -> object:  # noqa: F811
    """llama.cpp <- counting proxy <- serve (default limits); yields (serve port, proxy port, serve process)."""
    folder = tmp_path_factory.mktemp("limits")
    proxy_port, serve_port = free_port(), free_port()
    proxy = start_proxy(llama_server, proxy_port)
    spec = write_spec(folder, proxy_port, sampling={"temperature": 0.9, "max_tokens": 4})
    policy = mv_policy(extractor=FIRST_CHAR).save(folder / "policy.json")
    serve = start_serve(policy, spec, serve_port)
    try:
        yield serve_port, proxy_port, serve
    finally:
        stop(serve)
        stop(proxy)


def test_a_2mb_prompt_beside_a_normal_request(llama_stack: tuple[int, int, Any]) -> None:
    serve_port, proxy_port, serve = llama_stack
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key="unused", max_retries=0, timeout=30)
    before = proxy_stats(proxy_port)["posts"]
    big: dict[str, Any] = {}

    def send_big() -> None:
        try:
            client.completions.create(model="iapo/low", prompt="7 + 5 = " * 250_000)  # 2 MB
        except openai.APIStatusError as exc:
            big["status"], big["code"] = exc.status_code, exc.body["code"]

    t = threading.Thread(target=send_big)
    t.start()
    start = time.monotonic()
    normal = client.completions.create(model="iapo/mid", prompt="1 + 1 =")
    took = time.monotonic() - start
    t.join(30)
    assert big == {"status": 413, "code": "body_too_large"}
    assert normal.model_extra["iapo"]["n"] == 2 and took < 10
    assert proxy_stats(proxy_port)["posts"] - before == 2  # only the normal request's 2 completions went upstream
    # a body announced as 20 MB is refused by its Content-Length, before it is sent
    with socket.create_connection(("127.0.0.1", serve_port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 20000000\r\n\r\n{\"prompt\": \"")
        answer = ""
        while "}}" not in answer:  # the headers and the body may come in two pieces
            piece = s.recv(65536).decode()
            if not piece:
                break
            answer += piece
    assert answer.startswith("HTTP/1.1 413") and '"code": "body_too_large"' in answer, answer
    assert serve.poll() is None


def test_the_prompt_length_limit_refuses_before_the_upstream(llama_server: int, tmp_path: Path) -> None:  # noqa: F811
    proxy_port, port = free_port(), free_port()
    proxy = start_proxy(llama_server, proxy_port)
    spec = write_spec(tmp_path, proxy_port, sampling={"max_tokens": 4})
    serve = start_serve(mv_policy(extractor=FIRST_CHAR).save(tmp_path / "policy.json"), spec, port,
                        extra=["--max-body-bytes", "4000000", "--max-prompt-chars", "500"])
    try:
        status, body, _ = post_json(port, "/v1/completions", _body("7 + 5 = " * 250_000))
        assert status == 400 and body["error"]["code"] == "prompt_too_long" and body["error"]["param"] == "prompt"
        assert "2000003 characters" in body["error"]["message"]  # the template "{query} ->" counted too
        status, body, _ = post_json(port, "/v1/completions", _body("x" * 495, "low"))  # 495 + 6 > 500
        assert status == 400 and body["error"]["code"] == "prompt_too_long"
        assert proxy_stats(proxy_port)["posts"] == 0
        status, body, _ = post_json(port, "/v1/completions", _body("x" * 400, "high"))  # "{query} ->": 403
        assert status == 200 and proxy_stats(proxy_port)["posts"] == 1
    finally:
        stop(serve)
        stop(proxy)


def test_deadline_one_retry_and_a_slow_request_holds_only_its_slot(tmp_path: Path) -> None:
    with EchoUpstream() as up:
        port = free_port()
        spec = write_spec(tmp_path, 0, endpoint={"base_url": up.url, "timeout": 0.6, "max_retries": 5,
                                                 "backoff": 0.01, "max_backoff": 0.02, "concurrency": 1})
        log = tmp_path / "access.jsonl"
        serve = start_serve(mv_policy().save(tmp_path / "policy.json"), spec, port,
                            extra=["--deadline", "5", "--access-log", str(log)])
        try:
            # a timed-out upstream call is retried once, not endpoint.max_retries = 5 times
            start = time.monotonic()
            status, body, headers = post_json(port, "/v1/completions", _body("SLEEP:2 slow", "high"))
            assert status == 502 and body["error"]["code"] == "upstream_unavailable" and headers["Retry-After"]
            assert 1.1 < time.monotonic() - start < 4
            assert sum("SLEEP:2" in b["prompt"] for b in up.bodies) == 2
            # the deadline covers all N completions and retries: 504 at 5 s, while the upstream would take 6 s
            # (its calls time out at 0.6 s, so the deadline is set above them: a slow upstream behind a long timeout)
            serve2_port = free_port()
            spec2 = write_spec(tmp_path / "b", 0, endpoint={"base_url": up.url, "timeout": 30, "max_retries": 1,
                                                            "concurrency": 1})
            serve2 = start_serve(mv_policy().save(tmp_path / "policy.json"), spec2, serve2_port,
                                 extra=["--deadline", "1.5", "--max-concurrency", "4"])
            try:
                results: dict[str, Any] = {}

                def slow() -> None:
                    t = time.monotonic()
                    results["slow"] = post_json(serve2_port, "/v1/completions", _body("SLEEP:6 q", "low"))[:2]
                    results["slow_s"] = time.monotonic() - t

                threads = [threading.Thread(target=slow)]
                threads[0].start()
                time.sleep(0.3)  # the slow request holds its slot and its 3 upstream calls (endpoint.concurrency 1)
                t = time.monotonic()
                status, body, _ = post_json(serve2_port, "/v1/completions", _body("quick", "low"))
                quick_s = time.monotonic() - t
                threads[0].join(30)
                assert status == 200 and body["choices"][0]["text"] == "42" and quick_s < 1.0
                assert results["slow"][0] == 504 and results["slow"][1]["error"]["code"] == "deadline_exceeded"
                assert 1.4 < results["slow_s"] < 3.0
            finally:
                stop(serve2)
            # a caller that goes away cancels its request: the access log has it as 499 at once, not after 2 s
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=0.3)
            with pytest.raises(openai.APITimeoutError):
                client.completions.create(model="iapo/high", prompt="SLEEP:2 gone")
            time.sleep(0.5)
            records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
            gone = [r for r in records if r["status"] == 499]
            assert len(gone) == 1 and gone[0]["error"] == "client_disconnected" and gone[0]["latency_ms"] < 1000
        finally:
            stop(serve)


def test_a_full_queue_gives_503_with_retry_after(tmp_path: Path) -> None:
    with EchoUpstream() as up:
        port = free_port()
        spec = write_spec(tmp_path, 0, endpoint={"base_url": up.url})
        serve = start_serve(mv_policy().save(tmp_path / "policy.json"), spec, port,
                            extra=["--max-concurrency", "1", "--max-queue", "1"])
        try:
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(post_json, port, "/v1/completions", _body(f"SLEEP:1.5 {i}", "high"))
                           for i in range(4)]
                time.sleep(0.2)
                got = [f.result() for f in futures]
            statuses = sorted(s for s, _, _ in got)
            assert statuses == [200, 200, 503, 503], statuses
            for status, body, headers in got:
                if status == 503:
                    assert body["error"]["code"] == "overloaded" and headers["Retry-After"] == "1"
        finally:
            stop(serve)


def test_rate_limit_429_and_health_shows_spend_only_with_the_key(tmp_path: Path) -> None:
    with EchoUpstream() as up:
        port = free_port()
        prices = {"input_price_per_million": 1000.0, "output_price_per_million": 2000.0}
        spec = write_spec(tmp_path, 0, endpoint={"base_url": up.url, **prices})
        # requests/minute limits callers' requests and upstream requests: a request of low (N = 3, one retry) may
        # make 6, so after 3 (one upstream request each, the upstream honours n) 3 + 6 > 8 and the 4th is refused
        serve = start_serve(mv_policy().save(tmp_path / "policy.json"), spec, port,
                            extra=["--api-key-env", "SERVE_KEY", "--rate", "requests/minute=8",
                                   "--rate", "cost/day=10"], env={"SERVE_KEY": "inbound-key-1"})
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="inbound-key-1", max_retries=0)
            for _ in range(3):
                ok = client.completions.create(model="iapo/low", prompt="q")
                # every completion answers 42: the vote of N = 3 is decided by its first wave of 2
                assert ok.choices[0].text == "42" and ok.model_extra["iapo"]["drawn"] == 2
                assert ok.usage.completion_tokens == 2 * 2
            with pytest.raises(openai.RateLimitError) as info:
                client.completions.create(model="iapo/low", prompt="q")
            assert info.value.body["code"] == "rate_limited" and "8 requests per minute" in info.value.message
            assert 1 <= int(info.value.response.headers["Retry-After"]) <= 61  # the window slides: 60 s + a slot
            status, health = get_json(port, "/health")
            assert status == 200 and health["budget"] == {"requests/minute": {"limit": 8.0},
                                                          "cost/day": {"limit": 10.0}}
            assert "spent" not in health and "served" not in health
            status, health = get_json(port, "/health", {"Authorization": "Bearer inbound-key-1"})
            assert health["budget"]["requests/minute"]["used"] == 3 and health["served"] == 3
            assert health["budget"]["requests/minute"]["upstream"] == 3
            # the money at the spec's prices: per request "Q: q\nA:" (3 prompt tokens to this upstream) and 2 x "42"
            assert health["budget"]["cost/day"]["used"] == pytest.approx(3 * (3 * 1000 + 2 * 2 * 2000) / 1e6)
            assert health["spent"] == {"requests": 3, "tokens": 12}  # the upstream honours n: one request each
            assert up.posts == 3 and all(b["n"] == 2 for b in up.bodies)
        finally:
            stop(serve)


def test_a_vote_in_waves_is_charged_whole_and_no_early_stop_draws_all_n(tmp_path: Path) -> None:
    """Each request's vote of N = 3 needs two waves (1, 2 then 1): both carry the caller's max_tokens and seed, and the
    serving budget, /health's spend, usage and the access log count both. With --no-early-stop one wave of all 3."""
    with EchoUpstream(answers=["1", "2", "1"]) as up:
        port = free_port()
        spec = write_spec(tmp_path, 0, endpoint={"base_url": up.url}, scorer={"extractor": "last_number"})
        policy = mv_policy().save(tmp_path / "policy.json")
        log = tmp_path / "access.jsonl"
        serve = start_serve(policy, spec, port, extra=["--rate", "tokens/day=1000", "--access-log", str(log)])
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            got = [client.completions.create(model="iapo/low", prompt="q", max_tokens=2, seed=seed)
                   for seed in (5, 5, 6)]
            for r in got:
                assert r.choices[0].text == "1" and r.model_extra["iapo"]["answers"] == ["1", "2", "1"]
                assert r.model_extra["iapo"]["drawn"] == 3 and r.usage.completion_tokens == 3
            assert [b.get("n", 1) for b in up.bodies] == [2, 1] * 3 and all(b["max_tokens"] == 2 for b in up.bodies)
            seeds = [b["seed"] for b in up.bodies]
            assert seeds[:2] == seeds[2:4] and len({*seeds[:2], *seeds[4:]}) == 4  # by the caller's seed and wave
            status, health = get_json(port, "/health")
            # tokens: prompt ("Q: q\nA:", 3 tokens to this upstream, in each of the 2 waves) plus completion tokens
            assert health["budget"]["tokens/day"]["used"] == 3 * (2 * 3 + 3)
            assert health["spent"] == {"requests": 6, "tokens": 9}
            records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
            assert [(r["n"], r["drawn"], r["completion_tokens"]) for r in records] == [(3, 3, 3)] * 3
        finally:
            stop(serve)
        up.bodies.clear()
        up.turn = 0
        serve = start_serve(policy, spec, port, extra=["--no-early-stop"])
        try:
            status, body, _ = post_json(port, "/v1/completions", _body("q", "low"))
            assert status == 200 and body["iapo"]["drawn"] == 3 and [b["n"] for b in up.bodies] == [3]
            up.answers = ["1"]  # decided after 2 with early stopping: all 3 are drawn all the same
            status, body, _ = post_json(port, "/v1/completions", _body("q", "low"))
            assert status == 200 and body["iapo"]["drawn"] == 3 and [b["n"] for b in up.bodies] == [3, 3]
        finally:
            stop(serve)


@pytest.mark.heavy
def test_600_requests_on_the_example_spec_without_a_503(llama_server: int, tmp_path: Path) -> None:  # noqa: F811
    """The example spec caps a collection's requests; serve answers past its cap (its budget is a rate)."""
    text = (ROOT / "examples" / "collect_llamacpp.toml").read_text(encoding="utf-8")
    cap = load_spec(ROOT / "examples" / "collect_llamacpp.toml").budget.max_requests
    assert cap is not None and cap < 1200  # the 600 requests below draw at least 300 + 300 x 3 completions
    proxy_port = free_port()
    proxy = start_proxy(llama_server, proxy_port)
    try:
        (tmp_path / "collect_llamacpp.toml").write_text(
            text.replace("http://127.0.0.1:8080/v1", f"http://127.0.0.1:{proxy_port}/v1"), encoding="utf-8")
        shutil.copy(ROOT / "examples" / "collect_llamacpp_queries.jsonl", tmp_path)
        spec = load_spec(tmp_path / "collect_llamacpp.toml")
        policy = PolicyFile(
            task=spec.task, aggregator="mv", api="completions", n_max=spec.n_max, objectives=("correct",),
            scorer={"extractor": "last_number"}, sampling=spec.sampling.as_dict(),
            prompts=tuple(PolicyPrompt(p.id, p.text) for p in spec.prompts),
            contexts=(PolicyContext("one", (1.0,), -1.0, 0.5, "direct", 1),
                      PolicyContext("five", (1.0,), -0.1, 0.5, "check", 5)),
            learned={"agent": "test"}, estimate={"method": None}).save(tmp_path / "policy.json")
        port = free_port()
        serve = start_serve(policy, tmp_path / "collect_llamacpp.toml", port)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)

            def run(i: int) -> tuple[int, int, int]:
                context = "five" if i % 2 == 0 else "one"
                r = client.completions.create(model=f"iapo/{context}", prompt=f"What is {i} + 1?", max_tokens=2)
                return r.model_extra["iapo"]["n"], r.model_extra["iapo"]["drawn"], r.usage.completion_tokens

            with ThreadPoolExecutor(16) as pool:
                done = list(pool.map(run, range(600)))  # any error (a 503 included) is raised here
            assert len(done) == 600 and sum(n for n, _, _ in done) == 300 + 300 * 5
            assert all(n // 2 + 1 <= d <= n for n, d, _ in done)  # a vote of cap 5 draws 3 to 5
            assert all(t <= d * (2 + 3) for _, d, t in done)  # max_tokens = 2 honoured (llama.cpp may end a character)
            status, health = get_json(port, "/health")
            stats = proxy_stats(proxy_port)  # llama.cpp ignores n: one upstream request per completion
            assert status == 200 and health["spent"]["requests"] == stats["posts"] == sum(d for _, d, _ in done) > cap
        finally:
            printed = output(serve)
            stop(serve)
    finally:
        stop(proxy)
    assert re.search(r"spending cap", printed) is None
