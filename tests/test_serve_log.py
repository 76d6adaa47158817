"""``iapo-gym serve --log DIR``: every answered request in the outcome log, no key in it, the query text only with
``--log-queries``, what a kill -9 loses within the stated bound, rotation within its size and count, and
``iapo-gym data build`` reading the log (docs/deploy.md, "Logging, feedback and off-policy evaluation").

Real parts: serve as a process, the scripted upstream (tests/scripted_llm.py), SQLite files, SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from iapo_gym.outcome_log import log_files, read_log
from tests.deploy_helpers import mv_policy, post_json, start_scripted, start_serve
from tests.llm_server import free_port, stop, write_spec

pytest.importorskip("uvicorn")

KEY = "log-test-inbound-key-3f9a"
UPSTREAM_KEY = "upstream-secret-key-77c1"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCRIPT = {"Q: q\nA:": ["7", "7", "9"], "q ->": ["7", "8"], "Q: secret query 123\nA:": ["5", "5", "5"],
          "secret query 123 ->": ["5", "5"]}


def _complete(port: int, context: str, prompt: str = "q") -> dict[str, Any]:
    status, body, _ = post_json(port, "/v1/completions",
                                json.dumps({"model": f"iapo/{context}", "prompt": prompt}).encode(), AUTH)
    assert status == 200, body
    return body


def _stack(tmp_path: Path, extra: list[str]) -> tuple[Any, Any, int]:
    up = free_port()
    upstream = start_scripted(SCRIPT, tmp_path, up)
    spec = write_spec(tmp_path, up, sampling={"max_tokens": 4}, endpoint={"api_key_env": "UPSTREAM_KEY"})
    policy = mv_policy().save(tmp_path / "policy.json")  # low: plain x 3, mid: short x 2, high: short x 1
    port = free_port()
    try:
        serve = start_serve(policy, spec, port, extra=["--api-key-env", "SERVE_KEY", *extra],
                            env={"SERVE_KEY": KEY, "UPSTREAM_KEY": UPSTREAM_KEY})
    except BaseException:
        stop(upstream)
        raise
    return upstream, serve, port


def test_each_answer_is_logged_with_its_arm_and_outcomes_and_no_key_or_query(tmp_path: Path) -> None:
    upstream, serve, port = _stack(tmp_path, ["--log", str(tmp_path / "log")])
    try:
        answers = [_complete(port, ctx, "secret query 123") for ctx in ("low", "mid", "high", "low")]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", method="POST", headers={
            "Content-Type": "application/json", **AUTH}, data=json.dumps(
            {"model": "iapo/mid", "messages": [{"role": "user", "content": "q"}], "stream": True}).encode())
        with urllib.request.urlopen(req, timeout=30) as resp:
            events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                      if line.startswith("data: {")]
        streamed = events[-1]
    finally:
        stop(serve)  # SIGTERM: the log is written out
        stop(upstream)
    meta, rows = read_log(tmp_path / "log")
    logged = {r.id: r for r in rows}
    assert meta["aggregator"] == "mv" and meta["objectives"] == ["correct"] and meta["queries"] is False
    assert len(logged) == 5  # the four answers and the stream
    assert logged[streamed["id"]].outcomes["votes"] == streamed["iapo"]["votes"]
    for body in answers:
        row = logged[body["id"]]
        iapo = body["iapo"]
        assert (row.context, row.prompt, row.n, row.drawn) == (iapo["context"], iapo["prompt"], iapo["n"],
                                                               iapo["drawn"])
        assert row.propensity == 1.0 and row.query is None and row.reward is None
        assert row.outcomes["answers"] == iapo["answers"] and row.outcomes["votes"] == iapo["votes"]
        assert row.completion_tokens == body["usage"]["completion_tokens"]
        assert row.prompt_tokens == body["usage"]["prompt_tokens"]
        assert abs(row.time - time.time()) < 120
    assert logged[answers[0]["id"]].weights == (1.0, 0.0) and logged[answers[2]["id"]].weights == (1.0, -1.0)
    assert logged[answers[0]["id"]].outcomes["winner"] == "5"
    for f in (tmp_path / "log").iterdir():  # neither key nor the query, in any file the log left
        data = f.read_bytes()
        assert KEY.encode() not in data and UPSTREAM_KEY.encode() not in data and b"secret query" not in data, f


def test_log_queries_keeps_the_query_text(tmp_path: Path) -> None:
    upstream, serve, port = _stack(tmp_path, ["--log", str(tmp_path / "log"), "--log-queries"])
    try:
        body = _complete(port, "mid", "secret query 123")
    finally:
        stop(serve)
        stop(upstream)
    _, rows = read_log(tmp_path / "log")
    (row,) = list(rows)
    assert row.id == body["id"] and row.query == "secret query 123"


@pytest.mark.heavy
def test_kill_9_loses_at_most_the_rows_of_the_last_flush_interval_and_the_log_goes_on(tmp_path: Path) -> None:
    """Under load from 8 callers, serve is killed with -9: every request answered more than flush_ms (200 ms)
    plus a second of slack (a commit and the thread's turn on a loaded machine) before the kill is in the log."""
    flush_ms = 200
    upstream, serve, port = _stack(tmp_path, ["--log", str(tmp_path / "log"), "--log-flush-ms", str(flush_ms)])
    answered: list[tuple[float, str]] = []
    stop_load = threading.Event()

    def caller(i: int) -> None:
        while not stop_load.is_set():
            try:
                status, body, _ = post_json(port, "/v1/completions", json.dumps(
                    {"model": f"iapo/{('low', 'mid', 'high')[i % 3]}", "prompt": "q"}).encode(), AUTH, timeout=5)
            except OSError:
                return
            if status == 200:
                answered.append((time.monotonic(), body["id"]))
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        time.sleep(3.0)
        killed_at = time.monotonic()
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait(10)
        stop_load.set()
        for t in threads:
            t.join(10)
        _, rows = read_log(tmp_path / "log")
        logged = {r.id for r in rows}
        early = [rid for at, rid in answered if at < killed_at - flush_ms / 1000.0 - 1.0]
        assert len(early) > 50, len(answered)
        missing = [rid for rid in early if rid not in logged]
        assert not missing, (len(missing), len(early))
        # restarted on the same folder: the rows kept stay, new ones are added
        port2 = free_port()
        spec, policy = tmp_path / "spec.json", tmp_path / "policy.json"
        serve = start_serve(policy, spec, port2, extra=["--api-key-env", "SERVE_KEY", "--log", str(tmp_path / "log")],
                            env={"SERVE_KEY": KEY, "UPSTREAM_KEY": UPSTREAM_KEY})
        body = _complete(port2, "high")
    finally:
        stop_load.set()
        stop(serve)
        stop(upstream)
    _, rows = read_log(tmp_path / "log")
    after = {r.id for r in rows}
    assert logged <= after and body["id"] in after


def test_rotation_keeps_the_files_bounded_and_expired_ids_get_410(tmp_path: Path) -> None:
    upstream, serve, port = _stack(tmp_path, ["--log", str(tmp_path / "log"), "--log-max-bytes", "65536",
                                              "--log-keep", "1", "--log-flush-ms", "20"])
    try:
        first = _complete(port, "high")["id"]
        ids = [_complete(port, ("low", "mid", "high")[i % 3])["id"] for i in range(450)]
        time.sleep(0.3)
        files = log_files(tmp_path / "log")
        assert [f.name for f in files] == ["outcomes.1.sqlite", "outcomes.sqlite"]
        assert all(f.stat().st_size <= 65536 + 32 * 1024 for f in files), [f.stat().st_size for f in files]
        status, body, _ = post_json(port, "/v1/feedback", json.dumps({"id": first, "reward": True}).encode(), AUTH)
        assert status == 410 and body["error"]["code"] == "expired_id", body
        status, body, _ = post_json(port, "/v1/feedback", json.dumps({"id": ids[-1], "reward": False}).encode(), AUTH)
        assert status == 200, body
        unknown = ids[-1][:-4] + ("0000" if not ids[-1].endswith("0000") else "1111")
        status, body, _ = post_json(port, "/v1/feedback", json.dumps({"id": unknown, "reward": True}).encode(), AUTH)
        assert status == 404 and body["error"]["code"] == "unknown_id", body
    finally:
        stop(serve)
        stop(upstream)
    _, rows = read_log(tmp_path / "log")
    kept = {r.id: r for r in rows}
    assert first not in kept and ids[-1] in kept and kept[ids[-1]].reward is False
    assert 100 < len(kept) < 451


def test_data_build_reads_the_log_and_asks_for_what_it_cannot_infer(tmp_path: Path) -> None:
    upstream, serve, port = _stack(tmp_path, ["--log", str(tmp_path / "log"), "--log-queries"])
    try:
        ids = {ctx: _complete(port, ctx)["id"] for ctx in ("low", "mid")}
        for rid in ids.values():
            assert post_json(port, "/v1/feedback", json.dumps({"id": rid, "reward": True}).encode(), AUTH)[0] == 200
        # served under both prompts, without feedback: its gold answer is unknown
        others = [_complete(port, ctx, "secret query 123")["id"] for ctx in ("low", "mid")]
        assert post_json(port, "/v1/feedback", json.dumps({"id": others[0], "reward": False}).encode(), AUTH)[0] == 200
    finally:
        stop(serve)
        stop(upstream)
    cmd = [sys.executable, "-m", "iapo_gym.cli", "data", "build", str(tmp_path / "log"), "--aggregator", "mv",
           "--test-fraction", "0", "--out", str(tmp_path / "served.h5")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "gold" in run.stderr and "--gold" in run.stderr, run.stderr
    gold = tmp_path / "gold.jsonl"
    gold.write_text(json.dumps({"query": "secret query 123", "gold": "5"}) + "\n")
    run = subprocess.run([*cmd, "--gold", str(gold)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    from iapo_gym.tables import read_table

    table = read_table(tmp_path / "served.h5")
    assert sorted(table.prompts) == ["plain", "short"] and table.n_queries == 2
    # query "q": plain drew 7, 7 (gold 7, from the feedback true); short drew 7, 8; "secret query 123": all 5 (gold)
    plain, short = list(table.prompts).index("plain"), list(table.prompts).index("short")
    gold = table.gold
    assert table.probs[plain, 0, gold[0]] == 1.0 and table.probs[short, 0, gold[0]] == 0.5
    assert table.probs[plain, 1, gold[1]] == 1.0 and table.probs[short, 1, gold[1]] == 1.0
    assert table.attrs["completions"] == 8  # each vote was decided by its first 2 completions


def test_log_refuses_several_workers_and_queries_without_log(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, free_port())
    policy = mv_policy().save(tmp_path / "policy.json")
    base = [sys.executable, "-m", "iapo_gym.cli", "serve", str(policy), "--upstream", str(spec)]
    run = subprocess.run([*base, "--log", str(tmp_path / "log"), "--workers", "2"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1 and "--log keeps one outcome log per process" in run.stderr, run.stderr
    run = subprocess.run([*base, "--log-queries"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "--log-queries needs --log DIR" in run.stderr, run.stderr
    assert not (tmp_path / "log").exists()
