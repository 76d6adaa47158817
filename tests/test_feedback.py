"""``POST /v1/feedback``: authenticated like the other routes, idempotent, refusals naming the bad field, and the
reward joined to its request's row of the outcome log (docs/deploy.md, "Logging, feedback and off-policy
evaluation").

Real parts: serve as a process with ``--log``, the scripted upstream (tests/scripted_llm.py), SQLite files.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from iapo_gym.deploy.feedback import read_feedback
from iapo_gym.deploy.params import RequestError
from iapo_gym.outcome_log import read_log
from tests.deploy_helpers import mv_policy, post_json, start_scripted, start_serve
from tests.llm_server import free_port, stop, write_spec

pytest.importorskip("uvicorn")

KEY = {"Authorization": "Bearer feedback-key"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, int]]:
    """A serve with ``--log`` and an inbound key, and one without ``--log``: (port, log folder, port without log)."""
    tmp = tmp_path_factory.mktemp("feedback")
    up = free_port()
    upstream = start_scripted({"q ->": ["7", "8"], "Q: q\nA:": ["7", "7", "9"]}, tmp, up)
    spec = write_spec(tmp, up, sampling={"max_tokens": 4})
    policy = mv_policy().save(tmp / "policy.json")
    port, plain = free_port(), free_port()
    servers = []
    try:
        servers.append(start_serve(policy, spec, port, extra=["--api-key-env", "SERVE_KEY", "--log", str(tmp / "log")],
                                   env={"SERVE_KEY": "feedback-key"}))
        servers.append(start_serve(policy, spec, plain))
        yield port, tmp / "log", plain
    finally:
        for s in servers:
            stop(s)
        stop(upstream)


def _answer(port: int, context: str = "mid") -> str:
    status, body, _ = post_json(port, "/v1/completions", json.dumps({"model": f"iapo/{context}", "prompt": "q"}).encode(),
                                KEY)
    assert status == 200, body
    rid: str = body["id"]
    return rid


def _feedback(port: int, doc: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    status, body, _ = post_json(port, "/v1/feedback", json.dumps(doc).encode(), KEY if headers is None else headers)
    return status, body


def _row(folder: Path, rid: str) -> Any:
    _, rows = read_log(folder)
    return next(r for r in rows if r.id == rid)


def test_feedback_is_joined_once_and_repeated_idempotently(stack: tuple[int, Path, int]) -> None:
    port, folder, _ = stack
    rid = _answer(port)
    before = time.time()
    assert _feedback(port, {"id": rid, "reward": True}) == (200, {"id": rid, "reward": True, "recorded": True})
    row = _row(folder, rid)  # committed before the 200
    assert row.reward is True and before - 1 <= row.reward_time <= time.time() + 1
    assert _feedback(port, {"id": rid, "reward": True})[0] == 200  # the same reward again
    status, body = _feedback(port, {"id": rid, "reward": False})
    assert status == 409 and body["error"]["code"] == "feedback_conflict" and body["error"]["param"] == "reward"
    assert _row(folder, rid).reward is True  # the first reward stays
    other = _answer(port, "high")
    assert _feedback(port, {"id": other, "reward": 0.25})[0] == 200
    assert _feedback(port, {"id": other, "reward": 0.5})[0] == 409
    vector = _answer(port, "low")
    assert _feedback(port, {"id": vector, "reward": [1]})[0] == 200  # one value per objective ("correct")
    assert _row(folder, other).reward == 0.25 and _row(folder, vector).reward == [1.0]


def test_feedback_right_after_the_answer_finds_its_row(stack: tuple[int, Path, int]) -> None:
    """A row waits up to --log-flush-ms before its commit; feedback arriving sooner still finds it."""
    port, folder, _ = stack
    for _ in range(5):
        rid = _answer(port)
        assert _feedback(port, {"id": rid, "reward": False})[0] == 200
        assert _row(folder, rid).reward is False


@pytest.mark.parametrize(("doc", "status", "code", "param"), [
    ({"reward": True}, 400, "missing_field", "id"),
    ({"id": "cmpl-1"}, 400, "missing_field", "reward"),
    ({"id": "cmpl-1", "reward": True, "extra": 1}, 400, "unknown_parameter", "extra"),
    ({"id": 17, "reward": True}, 422, "invalid_value", "id"),
    ({"id": "", "reward": True}, 422, "invalid_value", "id"),
    ({"id": "cmpl-1", "reward": "yes"}, 422, "invalid_value", "reward"),
    ({"id": "cmpl-1", "reward": None}, 422, "invalid_value", "reward"),
    ({"id": "cmpl-1", "reward": [1, 2]}, 422, "invalid_value", "reward"),
    ({"id": "cmpl-1", "reward": ["1"]}, 422, "invalid_value", "reward"),
    ([1, 2], 400, "invalid_json", None),
])
def test_bad_bodies_are_refused_naming_the_field(stack: tuple[int, Path, int], doc: Any, status: int, code: str,
                                                  param: str | None) -> None:
    got, body = _feedback(stack[0], doc)
    assert (got, body["error"]["code"], body["error"]["param"]) == (status, code, param), body


def test_unknown_ids_unauthorized_callers_and_a_server_without_log(stack: tuple[int, Path, int]) -> None:
    port, _, plain = stack
    rid = _answer(port)
    status, body = _feedback(port, {"id": "cmpl-" + "0" * 32, "reward": True})
    assert status == 404 and body["error"]["code"] == "unknown_id"
    status, body = _feedback(port, {"id": rid, "reward": True}, headers={})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = _feedback(port, {"id": rid, "reward": True}, headers={"Authorization": "Bearer wrong"})
    assert status == 401
    status, body, _ = post_json(port, "/v1/feedback", b"not json", KEY)
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body = _feedback(plain, {"id": rid, "reward": True}, headers={})
    assert status == 404 and "--log" in body["error"]["message"]
    # nothing of the refused attempts was recorded
    assert _row(stack[1], rid).reward is None


def test_the_vector_length_follows_the_objectives() -> None:
    assert read_feedback(b'{"id": "a", "reward": [0.5, -1]}', ("helpful", "harmless")) == ("a", [0.5, -1.0])
    with pytest.raises(RequestError, match="one number per objective"):
        read_feedback(b'{"id": "a", "reward": [0.5]}', ("helpful", "harmless"))
    with pytest.raises(RequestError, match="finite"):
        read_feedback(b'{"id": "a", "reward": [0.5, 1e999]}', ("helpful", "harmless"))
