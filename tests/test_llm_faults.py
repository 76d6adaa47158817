"""The collector under faults, with real parts: a llama.cpp server killed with -9, a collector killed with -9,
and a fault-injecting proxy in front of a reward endpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from iapo_gym import IAPOEnv
from iapo_gym.cli import main as cli_main
from iapo_gym.llm.collect import collect
from iapo_gym.llm.spec import load_spec
from tests.llm_scorer import score
from tests.llm_server import (
    RewardServer,
    free_port,
    llama_server,  # noqa: F401 (fixture)
    proxy_stats,
    start_llama_server,
    start_proxy,
    stop,
    tiny_model,  # noqa: F401 (fixture)
    write_spec,
)

ROOT = Path(__file__).resolve().parents[1]
#: The shape of the run in the issue: 2 prompts x 60 queries x N_max 6 = 720 completions.
QUERIES_60 = [{"id": f"q{i}", "text": f"What is {i} + {i}?", "gold": str(2 * i)} for i in range(60)]
TOTAL = 2 * 60 * 6


def _collector(spec: Path, out: Path, quiet: bool = True) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "iapo_gym.cli", "collect", str(spec), "--out", str(out)] + (["--quiet"] if quiet else [])
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _whole_lines(log: Path) -> list[dict]:
    """Every line of the log, each a complete JSON object; the file ends with a newline (no partial line)."""
    data = log.read_bytes()
    assert not data or data.endswith(b"\n"), data[-200:]
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


def _cache_rows(path: Path) -> tuple[int, int]:
    with sqlite3.connect(path) as db:
        n, tokens = db.execute("SELECT COUNT(*), COALESCE(SUM(tokens), 0) FROM completions").fetchone()
    return int(n), int(tokens)


@pytest.mark.heavy
def test_dead_endpoint_stops_within_seconds_spends_nothing_on_refusals_and_resumes(
        tmp_path: Path, tiny_model: Path) -> None:  # noqa: F811
    port = free_port()
    server = start_llama_server(tiny_model, port)
    spec = write_spec(tmp_path, port, n_max=6, queries=QUERIES_60, sampling={"temperature": 0.9},
                      endpoint={"concurrency": 8, "max_retries": 2, "backoff": 0.5, "max_backoff": 30.0},
                      budget={"max_requests": 1000})
    out = tmp_path / "a"
    log = out / "tiny.jsonl"
    proc = _collector(spec, out)
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_bytes().count(b"\n") >= 30):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.005)
        server.send_signal(signal.SIGKILL)
        server.wait()
        killed = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)
        stopped_after = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
        stop(server)
    err, summary = stderr.decode(), stdout.decode()
    assert proc.returncode == 3, err
    kept = len(_whole_lines(log))
    assert 0 < kept < TOTAL
    assert "unreachable" in err and f"{kept} of {TOTAL} completions are kept" in err
    assert "run the same command again to resume" in err
    # one request's retries (waits of at most 0.75 s and 1.5 s), then nothing new starts
    assert stopped_after < 30, stopped_after
    requests = int(re.search(r"(\d+) requests", summary).group(1))  # type: ignore[union-attr]
    tokens = int(re.search(r"(\d+) completion tokens", summary).group(1))  # type: ignore[union-attr]
    received, received_tokens = _cache_rows(out / "cache.sqlite")
    assert received >= kept
    # only requests that may have been processed count: answered ones, and those on the wire at the kill
    # (at most 8, plus a few the dying server's listen queue may have taken); refused connections count none
    assert requests <= received + 16, (requests, received)
    assert tokens <= received_tokens + 16 * (6 + 3)

    server = start_llama_server(tiny_model, port)
    try:
        again = _collector(spec, out)
        _, err2 = again.communicate(timeout=300)
        assert again.returncode == 0, err2.decode()
        straight = _collector(spec, tmp_path / "b")
        _, err3 = straight.communicate(timeout=300)
        assert straight.returncode == 0, err3.decode()
    finally:
        stop(server)
    resumed, uninterrupted = _whole_lines(log), _whole_lines(tmp_path / "b" / "tiny.jsonl")
    assert len(resumed) == len(uninterrupted) == TOTAL == len({r["key"] for r in resumed})
    assert ({r["key"]: (r["text"], r["tokens"], r["answer"]) for r in resumed}
            == {r["key"]: (r["text"], r["tokens"], r["answer"]) for r in uninterrupted})
    a, b = IAPOEnv(path=str(out / "tiny.h5")).table, IAPOEnv(path=str(tmp_path / "b" / "tiny.h5")).table
    assert np.array_equal(a.probs, b.probs) and np.array_equal(a.cost, b.cost)
    assert a.prompts == b.prompts and a.queries == b.queries


def test_the_log_grows_with_progress_and_holds_only_whole_lines(tmp_path: Path, llama_server: int) -> None:  # noqa: F811
    port = free_port()
    proxy = start_proxy(llama_server, port)
    spec = write_spec(tmp_path, port, n_max=6, queries=QUERIES_60, endpoint={"concurrency": 8})
    out = tmp_path / "out"
    proc = _collector(spec, out, quiet=False)
    try:
        deadline = time.monotonic() + 120
        while (answered := proxy_stats(port)["forwarded"]) < 119:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        stop(proxy)
    lines = _whole_lines(out / "tiny.jsonl")
    # the workers hold at most 8 groups of 6 open; everything else answered is in the log
    assert len(lines) >= answered - 8 * 6 > 0, (len(lines), answered)
    assert len({r["key"] for r in lines}) == len(lines)
    err = stderr.decode()
    assert "completions logged" in err and "in flight" in err and "from the cache" in err


def _reward_spec(tmp_path: Path, llm_port: int, reward_port: int, n_max: int = 2, **endpoint: object) -> Path:
    return write_spec(tmp_path, llm_port, aggregator="bon", n_max=n_max, endpoint=dict(endpoint),
                      scorer={"reward_url": f"http://127.0.0.1:{reward_port}/score",
                              "objectives": ["length", "digits"]})


def test_reward_endpoint_survives_503_429_500_and_a_dropped_connection(tmp_path: Path,
                                                                       llama_server: int) -> None:  # noqa: F811
    with RewardServer() as reward:
        port = free_port()
        proxy = start_proxy(reward.port, port, ["503", "503", "429", "500", "drop"])
        try:
            spec = load_spec(_reward_spec(tmp_path, llama_server, port, concurrency=2))
            t0 = time.monotonic()
            result = collect(spec, tmp_path / "out", progress=False)
            elapsed = time.monotonic() - t0
            stats = proxy_stats(port)
        finally:
            stop(proxy)
    assert result.complete and stats["injected"] == 5
    assert result.reward_retries == 5 and result.reward_requests == 12 + 5 == stats["posts"]
    assert len(reward.bodies) == 12
    assert elapsed >= 1.0  # Retry-After: 1 on the 503s (the backoff alone waits under 0.1 s)
    assert all(r["scores"] == score(r["text"], "") for r in _whole_lines(result.log))


def test_reward_endpoint_failing_past_max_retries_stops_cleanly(tmp_path: Path, llama_server: int,  # noqa: F811
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with RewardServer() as reward:
        port = free_port()
        proxy = start_proxy(reward.port, port, ["503"] * 20)
        try:
            # one worker, one completion per group: one reward request at a time
            spec = _reward_spec(tmp_path, llama_server, port, n_max=1, concurrency=1, max_retries=2)
            code = cli_main(["collect", str(spec), "--out", str(tmp_path / "out"), "--quiet"])
            stats = proxy_stats(port)
        finally:
            stop(proxy)
    err = capsys.readouterr().err
    assert code == 1 and "giving up on the reward endpoint" in err and "after 2 retries" in err and "503" in err
    assert stats["posts"] == 3 and not reward.bodies  # one request's 3 attempts, then nothing more was sent
    _whole_lines(tmp_path / "out" / "tiny.jsonl")


def test_unreachable_reward_endpoint_exits_3(tmp_path: Path, llama_server: int,  # noqa: F811
                                             capsys: pytest.CaptureFixture[str]) -> None:
    spec = _reward_spec(tmp_path, llama_server, free_port(), max_retries=1)
    assert cli_main(["collect", str(spec), "--out", str(tmp_path / "out"), "--quiet"]) == 3
    err = capsys.readouterr().err
    assert "reward endpoint" in err and "unreachable" in err and "run the same command again to resume" in err
