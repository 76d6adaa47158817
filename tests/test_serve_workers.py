"""``iapo-gym serve --workers K``: K processes answer on one port, each building its app from the arguments.

Real parts: serve as a process with 2 workers before the scripted upstream; the workers' pids come from
``/health`` (shown to a caller with the inbound key only) and are checked against the process tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy_helpers import get_json, mv_policy, post_json, scripted_stats, start_scripted, start_serve
from tests.llm_server import HERE, free_port, output, stop, write_spec

pytest.importorskip("uvicorn")

KEY = "sk-workers-test-5e4d3c2b1a"


def test_bad_worker_counts_are_refused(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, free_port())
    run = subprocess.run([sys.executable, "-m", "iapo_gym.cli", "serve", str(mv_policy().save(tmp_path / "p.json")),
                          "--upstream", str(spec), "--workers", "0"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert run.returncode == 1 and "--workers must be at least 1, got 0" in run.stderr, run.stderr


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_two_workers_answer_on_one_port(tmp_path: Path) -> None:
    up, port = free_port(), free_port()
    scripted = start_scripted({"1 + 1 = ->": ["2"]}, tmp_path, up)
    spec = write_spec(tmp_path, up, endpoint={"max_retries": 0})
    log = tmp_path / "access.jsonl"
    serve = start_serve(mv_policy().save(tmp_path / "policy.json"), spec, port,
                        extra=["--workers", "2", "--api-key-env", "IAPO_WORKERS_KEY", "--access-log", str(log)],
                        env={"IAPO_WORKERS_KEY": KEY})
    pids: set[int] = set()
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        status, doc = get_json(port, "/health")
        assert status == 200 and "pid" not in doc and "served" not in doc  # not to a caller without the key
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline:
            status, doc = get_json(port, "/health", auth)  # a new connection each time
            assert status == 200
            pids.add(doc["pid"])
        assert len(pids) == 2, pids
        assert all(_parent(pid) == serve.pid for pid in pids)  # both are the serve process's workers
        assert serve.pid not in pids
        body = json.dumps({"model": "iapo/high", "prompt": "1 + 1 ="}).encode()
        for _ in range(6):
            status, answer, _ = post_json(port, "/v1/completions", body, auth)
            assert status == 200 and answer["choices"][0]["text"] == "2"
        assert post_json(port, "/v1/completions", body)[0] == 401  # each worker read the key itself
        assert scripted_stats(up)["requests"] == 6
        # the key went to the workers through their own environment, not the arguments they were given
        for pid in pids:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            assert KEY.encode() not in env[b"IAPO_GYM_SERVE_ARGS"]
            assert json.loads(env[b"IAPO_GYM_SERVE_ARGS"])["api_key_env"] == "IAPO_WORKERS_KEY"
    finally:
        printed = output(serve)
        stop(serve)
        stop(scripted)
    assert KEY not in printed and "2 processes" in printed
    for pid in pids:  # SIGTERM to the supervisor stops its workers
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    lines = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    assert sum(1 for r in lines if r["status"] == 200) == 6  # both workers append to the one access log
