"""``/health`` sees a hung upstream: SIGSTOP of the upstream process turns it 503, SIGCONT brings it back.

Real parts: the scripted upstream (tests/scripted_llm.py) and serve, both as processes; the upstream is
stopped and continued with real signals.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from iapo_gym.deploy.server import PROBE_EVERY, PROBE_TIMEOUT
from tests.deploy_helpers import get_json, mv_policy, post_json, start_scripted, start_serve
from tests.llm_server import free_port, stop, write_spec

pytest.importorskip("uvicorn")

BODY = json.dumps({"model": "iapo/high", "prompt": "1 + 1 ="}).encode()


def _until(port: int, status: int, within: float) -> tuple[float, dict[str, Any]]:
    """Poll /health until it answers ``status``; (seconds it took, the answer). Fails after ``within`` s."""
    start = time.monotonic()
    while True:
        got, doc = get_json(port, "/health")
        if got == status:
            return time.monotonic() - start, doc
        assert time.monotonic() - start < within, (got, doc)
        time.sleep(0.1)


@pytest.fixture()
def stack(tmp_path: Path) -> Any:
    up, port = free_port(), free_port()
    scripted = start_scripted({"1 + 1 = ->": ["2"]}, tmp_path, up)
    spec = write_spec(tmp_path, up, endpoint={"max_retries": 0, "timeout": 30})
    serve = start_serve(mv_policy().save(tmp_path / "policy.json"), spec, port,
                        extra=["--stall-after", "2", "--deadline", "20"])
    try:
        yield port, scripted
    finally:
        os.kill(scripted.pid, signal.SIGCONT)
        stop(serve)
        stop(scripted)


def test_a_stopped_upstream_turns_health_503_within_the_probe_timeout(stack: tuple[int, Any]) -> None:
    port, scripted = stack
    assert post_json(port, "/v1/completions", BODY)[0] == 200
    assert get_json(port, "/health")[1]["upstream"]["state"] == "up"
    os.kill(scripted.pid, signal.SIGSTOP)
    took, doc = _until(port, 503, PROBE_EVERY + PROBE_TIMEOUT + 3)
    assert took <= PROBE_EVERY + PROBE_TIMEOUT + 1, took  # the probe's own timeout, not the endpoint's 30 s
    assert doc["status"] == "upstream_down" and doc["upstream"]["state"] == "down"
    assert "127.0.0.1" not in json.dumps(doc)  # nothing of the upstream's address
    os.kill(scripted.pid, signal.SIGCONT)
    took, doc = _until(port, 200, PROBE_EVERY + PROBE_TIMEOUT + 3)
    assert doc["status"] == "ok" and doc["upstream"]["state"] == "up"
    assert post_json(port, "/v1/completions", BODY)[0] == 200


def test_requests_waiting_past_stall_after_are_a_stall(stack: tuple[int, Any]) -> None:
    port, scripted = stack
    assert post_json(port, "/v1/completions", BODY)[0] == 200
    os.kill(scripted.pid, signal.SIGSTOP)
    answers: list[int] = []
    caller = threading.Thread(target=lambda: answers.append(post_json(port, "/v1/completions", BODY)[0]))
    caller.start()
    time.sleep(0.3)
    # the probe gets no answer either, but with a request waiting that alone proves nothing (an upstream may
    # answer /models only between completions): the request waiting past --stall-after 2 s does
    took, doc = _until(port, 503, 2 + PROBE_TIMEOUT + 3)
    assert doc["status"] == "upstream_stalled" and doc["upstream"]["stalled_requests"] == 1, doc
    assert doc["in_flight"] == 1
    os.kill(scripted.pid, signal.SIGCONT)
    caller.join(20)
    assert answers == [200]  # the stalled request is answered once the upstream goes on
    _, doc = _until(port, 200, PROBE_EVERY + PROBE_TIMEOUT + 3)
    assert doc["upstream"]["stalled_requests"] == 0
