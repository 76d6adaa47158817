"""``iapo-gym serve``'s budget is the deployment's, not a process's: processes on one store share it under load,
a restart (SIGTERM, or kill -9 mid-request) keeps the day's spend, and a cost rate counts the money at the spec's
prices (docs/deploy.md, "The serving budget").

Real parts: serve as processes, the scripted upstream (tests/scripted_llm.py, whose usage is known), the
llama.cpp server with the tiny model behind the counting proxy (the upstream's reported usage), SQLite files,
a real ``redis-server`` (skipped with the reason when the binary is absent), threads of callers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.deploy_helpers import FIRST_CHAR, get_json, mv_policy, post_json, scripted_stats, start_scripted, start_serve
from tests.llm_server import (
    free_port,
    llama_server,  # noqa: F401 (fixture)
    proxy,  # noqa: F401 (fixture)
    proxy_stats,
    start_proxy,
    stop,
    tiny_model,  # noqa: F401 (fixture)
    write_spec,
)
from tests.redis_server import redis_url  # noqa: F401 (fixture)

pytest.importorskip("uvicorn")

KEY = {"Authorization": "Bearer budget-key"}
ENV = {"SERVE_KEY": "budget-key"}


def _body(context: str, prompt: str = "q") -> bytes:
    return json.dumps({"model": f"iapo/{context}", "prompt": prompt}).encode()


def _load(ports: list[int], count: int, threads: int = 16, contexts: tuple[str, ...] = ("high", "mid")) \
        -> list[tuple[int, dict[str, Any]]]:
    """``count`` completions from ``threads`` callers, spread over the servers on ``ports`` and the contexts; a 429
    whose Retry-After is 1 s (requests in flight hold the room) is asked again shortly, as a patient client would."""
    def one(i: int) -> tuple[int, dict[str, Any]]:
        give_up = time.monotonic() + 60
        while True:
            status, body, headers = post_json(ports[i % len(ports)], "/v1/completions",
                                              _body(contexts[i % len(contexts)]), KEY)
            if status != 429 or headers.get("Retry-After") != "1" or time.monotonic() > give_up:
                return status, body
            time.sleep(0.01)
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(count)))


def _budget(port: int) -> dict[str, Any]:
    status, health = get_json(port, "/health", KEY)
    assert status == 200, health
    budget: dict[str, Any] = health["budget"]
    return budget


def _two_servers_under_load(tmp_path: Path, store: list[str], workers: bool = False) -> None:
    """Two serve processes on one store (or, with ``workers``, one serve of ``--workers 2``), 300 requests from 16
    threads: the callers' requests, the upstream's requests and its tokens stay within the limits; every process
    reports the same shared spend."""
    up_port = free_port()
    upstream = start_scripted({"q ->": ["7", "7"]}, tmp_path, up_port)
    spec = write_spec(tmp_path, up_port, sampling={"max_tokens": 4})
    policy = mv_policy().save(tmp_path / "policy.json")  # high: N = 1, mid: N = 2 (both "q ->")
    rates = ["--rate", "requests/day=60", "--rate", "tokens/day=240"]
    ports = [free_port()] if workers else [free_port(), free_port()]
    servers = []
    try:
        for port in ports:
            servers.append(start_serve(policy, spec, port, extra=[*rates, *store, "--api-key-env", "SERVE_KEY",
                                                                  *(["--workers", "2"] if workers else [])], env=ENV))
        got = _load(ports, 300)
        ok = [b for s, b in got if s == 200]
        assert {s for s, _ in got} <= {200, 429}, [b for s, b in got if s not in (200, 429)][:3]
        assert all(b["error"]["code"] == "rate_limited" for s, b in got if s == 429)
        stats = scripted_stats(up_port)
        # every limit holds against what the upstream counted (each actual spend is at most its worst case)
        tokens = stats["prompt_tokens"] + stats["completion_tokens"]
        assert len(ok) <= 60 and stats["requests"] <= 60 and tokens <= 240, (len(ok), stats)
        # and the day was used up to within one request's worst case: the smallest (high: N = 1, 2 attempts of at
        # most 4 + 2 + 4 prompt and 4 + 3 completion tokens) no longer fits
        assert stats["requests"] + 2 > 60 or tokens + 2 * (4 + 2 + 4 + 4 + 3) > 240, (len(ok), stats)
        served_by: dict[int, int] = {}  # what each process answered (the kernel decides how workers share calls)
        for attempt in range(64):  # every process sees the deployment's spend
            status, health = get_json(ports[attempt % len(ports)], "/health", KEY)
            budget = health["budget"]
            served_by[health["pid"]] = health["served"]
            assert budget["requests/day"]["used"] == len(ok) and budget["requests/day"]["upstream"] == stats["requests"]
            assert budget["tokens/day"]["used"] == stats["prompt_tokens"] + stats["completion_tokens"]
            assert budget["requests/day"]["reserved"] == 0
            if len(served_by) == 2 and attempt >= 7:
                break
        # both processes were asked, and the spend they share is what they answered between them
        assert len(served_by) == 2 and sum(served_by.values()) == len(ok), (served_by, len(ok))
    finally:
        for proc in servers:
            stop(proc)
        stop(upstream)


def test_two_processes_on_one_sqlite_store_and_a_restart_keeps_the_days_spend(tmp_path: Path) -> None:
    _two_servers_under_load(tmp_path, [])  # the default store: budget.sqlite beside the policy file
    assert (tmp_path / "budget.sqlite").is_file()
    # SIGTERM'd above; a new process of the deployment starts from the day's spend, not from zero
    up_port = free_port()
    upstream = start_scripted({"q ->": ["7"]}, tmp_path / "again", up_port)
    spec = write_spec(tmp_path, up_port, sampling={"max_tokens": 4})  # the same spec file, a new upstream port
    port = free_port()
    serve = start_serve(tmp_path / "policy.json", spec, port,
                        extra=["--rate", "requests/day=60", "--rate", "tokens/day=240", "--api-key-env", "SERVE_KEY"],
                        env=ENV)
    try:
        before = _budget(port)
        assert before["requests/day"]["used"] >= 40 and before["tokens/day"]["used"] >= 100
        got = _load([port], 40, threads=4)
        assert {s for s, _ in got} == {429}, (before, got[:3])  # the day's budget is spent
        assert _budget(port) == before and scripted_stats(up_port)["requests"] == 0
    finally:
        stop(serve)
        stop(upstream)


@pytest.mark.heavy
def test_workers_share_the_default_sqlite_store(tmp_path: Path) -> None:
    _two_servers_under_load(tmp_path, [], workers=True)


def test_two_processes_on_one_redis_server(tmp_path: Path, redis_url: str) -> None:  # noqa: F811
    _two_servers_under_load(tmp_path, ["--budget-store", redis_url, "--budget-name", "arith-prod"])
    assert not (tmp_path / "budget.sqlite").exists()


@pytest.mark.heavy
def test_a_process_killed_mid_request_leaves_its_worst_case_held_then_spent(tmp_path: Path) -> None:
    """kill -9 while a request waits on the upstream: the next process finds the reservation held (not lost, not
    zero), and once the request's deadline plus the margin is past it counts as spent whole."""
    up_port = free_port()
    upstream = start_scripted({"q ->": ["7"]}, tmp_path, up_port, delay=3.0)
    spec = write_spec(tmp_path, up_port, sampling={"max_tokens": 4})
    policy = mv_policy().save(tmp_path / "policy.json")
    extra = ["--rate", "requests/day=50", "--rate", "tokens/day=1000", "--deadline", "2", "--upstream-retries", "0",
             "--api-key-env", "SERVE_KEY"]
    port = free_port()
    serve = start_serve(policy, spec, port, extra=extra, env=ENV)
    def caller() -> None:  # its server is killed under it: the connection just ends
        with contextlib.suppress(OSError):
            post_json(port, "/v1/completions", _body("high"), KEY, 10)
    worker = threading.Thread(target=caller, daemon=True)
    try:
        worker.start()
        deadline = time.monotonic() + 10
        while _budget(port)["requests/day"]["reserved"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        held = _budget(port)["tokens/day"]["reserved"]
        assert held == 1 * (len("q ->") + 2 + 4 + 4 + 3)  # N = 1, one attempt: the prompt's bound and max_tokens + 3
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait()
        killed_at = time.monotonic()
    finally:
        stop(serve)
    serve = start_serve(policy, spec, port, extra=extra, env=ENV)
    try:
        budget = _budget(port)
        assert budget["tokens/day"] == {"limit": 1000.0, "used": 0, "reserved": held}
        time.sleep(max(0.0, killed_at + 2 + 10 + 0.5 - time.monotonic()))  # deadline 2 s + the 10 s margin
        budget = _budget(port)
        assert budget["tokens/day"] == {"limit": 1000.0, "used": held, "reserved": 0}
        assert budget["requests/day"]["used"] == 1 and budget["requests/day"]["upstream"] == 1
    finally:
        stop(serve)
        stop(upstream)
        worker.join(timeout=10)


def test_a_cost_rate_holds_against_the_upstreams_reported_usage_at_the_specs_prices(
        proxy: int, tmp_path: Path) -> None:  # noqa: F811
    """Prices per endpoint in the spec (per million prompt and completion tokens): serve's cost/day counts prompt
    plus completion tokens at them, exactly what the upstream reported, and never lets the day pass its limit."""
    prices = {"input_price_per_million": 1000.0, "output_price_per_million": 3000.0}  # 0.001 and 0.003 a token
    spec = write_spec(tmp_path, proxy, endpoint=prices, extra={"currency": "USD"})
    policy = mv_policy(extractor=FIRST_CHAR).save(tmp_path / "policy.json")
    port = free_port()
    serve = start_serve(policy, spec, port, extra=["--rate", "cost/day=0.6", "--api-key-env", "SERVE_KEY"], env=ENV)
    try:
        got = _load([port], 60, threads=4, contexts=("high", "mid", "low"))
        ok = sum(s == 200 for s, _ in got)
        assert {s for s, _ in got} == {200, 429}
        stats = proxy_stats(proxy)
        money = (stats["prompt_tokens"] * 1000.0 + stats["completion_tokens"] * 3000.0) / 1e6
        assert money <= 0.6  # the limit holds against what the upstream reported
        # used up to within one request's worst case: high, 2 attempts of at most 10 prompt and 6 + 3 completion tokens
        assert money + 2 * (10 * 0.001 + 9 * 0.003) > 0.6
        budget = _budget(port)["cost/day"]
        assert budget["used"] == pytest.approx(money, abs=1e-9) and budget["reserved"] == 0
        # the prompt tokens count: the old count (completion tokens only) would have been far lower
        assert stats["prompt_tokens"] * 1000.0 / 1e6 > 0.25 * money and ok >= 3
    finally:
        stop(serve)


def test_an_attempt_whose_usage_is_unknown_counts_its_bound(llama_server: int, tmp_path: Path) -> None:  # noqa: F811
    """The upstream fails the first attempt with a 500 (it may have done the work; no usage comes back): the budget
    counts that attempt's bound (the prompt's bytes, 2 more per space, + 4; max_tokens + 3) besides the retry's
    reported usage. The tiny model spells the prompt " q ->" as bytes with each space as U+2581 (3 bytes), after
    a begin-of-sequence token: 10 tokens, just what the bound allows."""
    proxy_port = free_port()
    proxy_proc = start_proxy(llama_server, proxy_port, schedule=["500"])
    spec = write_spec(tmp_path, proxy_port)  # max_tokens 6
    port = free_port()
    serve = start_serve(mv_policy(extractor=FIRST_CHAR).save(tmp_path / "policy.json"), spec, port,
                        extra=["--rate", "tokens/day=1000", "--rate", "requests/day=10"])
    try:
        status, body, _ = post_json(port, "/v1/completions", _body("high"))
        assert status == 200, body
        stats = proxy_stats(proxy_port)
        assert stats["posts"] == 2 and stats["injected"] == 1
        budget = _budget(port)
        bound = len("q ->") + 2 * 1 + 4
        assert budget["tokens/day"]["used"] == bound + (6 + 3) + stats["prompt_tokens"] + stats["completion_tokens"]
        assert stats["prompt_tokens"] == bound  # the bound holds (tightly) for the attempt that reported its usage
        assert budget["requests/day"]["used"] == 1 and budget["requests/day"]["upstream"] == 2
    finally:
        stop(serve)
        stop(proxy_proc)


def test_the_prompt_token_bound_holds_on_a_real_tokenizer(llama_server: int) -> None:  # noqa: F811
    """``prices.prompt_token_bound`` against the tokens llama.cpp counts, completions and chat (its default chat
    template): never below. The tiny model's vocabulary is bytes only, so a space (SentencePiece's U+2581) costs
    3 tokens: the worst case the bound allows for, which these plain prompts meet exactly."""
    from iapo_gym.llm.prices import prompt_token_bound

    def counted(path: str, body: dict[str, Any]) -> int:
        status, answer, _ = post_json(llama_server, path, json.dumps({"model": "tiny", "max_tokens": 1, **body})
                                      .encode())
        assert status == 200, answer
        return int(answer["usage"]["prompt_tokens"])

    for prompt in ("q ->", "Q: What is 7 times 6?\nA:", "héllo wörld  x", "\u4e2d\u6587 \U0001F600"):
        assert counted("/v1/completions", {"prompt": prompt}) <= prompt_token_bound(prompt)  # (equal, here)
    for messages in ([{"role": "user", "content": "q ->"}],
                     [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "7 x 6?"}],
                     [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "x y"},
                      {"role": "user", "content": "z"}]):
        assert counted("/v1/chat/completions", {"messages": messages}) <= prompt_token_bound(messages)


def test_a_cost_rate_needs_the_specs_prices_and_a_limit_below_one_request_stops_the_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from iapo_gym.cli import main
    from iapo_gym.deploy.router import Router
    from iapo_gym.deploy.server import create_app
    from iapo_gym.llm.budget import Budget, parse_rate

    policy = mv_policy().save(tmp_path / "policy.json")
    spec = write_spec(tmp_path, free_port(), sampling={"max_tokens": 100}, budget={"price_per_1k_tokens": 1.0})
    assert main(["serve", str(policy), "--upstream", str(spec), "--rate", "cost/day=5"]) == 1
    assert "its endpoints give no input_price_per_million" in capsys.readouterr().err
    # low: N = 3 of "Q: \nA:" (6 bytes, 2 more for its space, + 4), 2 attempts: 6 x (12 + 103) = 690 tokens
    assert main(["serve", str(policy), "--upstream", str(spec), "--rate", "tokens/minute=689"]) == 1
    assert "tokens/minute limit of 689 is below the worst case of the smallest request in context 'low'" in \
        capsys.readouterr().err
    create_app(Router(policy, spec), budget=Budget([parse_rate("tokens/minute=690")]))  # fits exactly
    assert main(["serve", str(policy), "--upstream", str(spec), "--rate", "requests/minute=5"]) == 1  # 6 attempts
    assert "requests/minute limit of 5 is below" in capsys.readouterr().err
    assert main(["serve", str(policy), "--upstream", str(spec), "--rate", "requests/minute=6",
                 "--budget-store", "ftp://x/y"]) == 1
    assert "got the scheme 'ftp'" in capsys.readouterr().err
