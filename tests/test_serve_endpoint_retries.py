"""Each upstream endpoint of ``iapo-gym serve`` keeps its own retry settings (docs/deploy.md, "Limits").

Two echo upstreams (tests/echo_upstream.py) on 127.0.0.1 answer 503 to a prompt containing ``STATUS:503``.
Endpoint ``a`` backs off for seconds, endpoint ``b`` for hundredths of one; serve's ``--upstream-retries``
caps both. A context whose arm is at ``b`` must fail over ``b``'s own short backoff and retries, not
``a``'s, and ``a``'s context must still wait ``a``'s backoff.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyPrompt
from tests.deploy_helpers import post_json, start_serve
from tests.echo_upstream import EchoUpstream
from tests.llm_server import free_port, stop

pytest.importorskip("uvicorn")

TEMPLATE = "Q: {query}\nA:"
SLOW_BACKOFF = 3.0  # endpoint a: the first retry waits 1.5-4.5 s (backoff x a jitter in [0.5, 1.5))


def _spec(folder: Path, urls: dict[str, str]) -> Path:
    """Two endpoints with different backoff and max_retries, one prompt each."""
    (folder / "queries.jsonl").write_text(json.dumps({"id": "q0", "text": "1 + 1", "gold": "2"}) + "\n")
    settings = {"a": {"backoff": SLOW_BACKOFF, "max_backoff": SLOW_BACKOFF, "max_retries": 3},
                "b": {"backoff": 0.01, "max_backoff": 0.01, "max_retries": 2}}
    doc = {"task": "two-endpoints", "aggregator": "mv", "n_max": 2,
           "endpoints": [{"id": name, "base_url": url, "model": "echo", "timeout": 20, "concurrency": 2,
                          **settings[name]} for name, url in urls.items()],
           "sampling": {"temperature": 0.0, "max_tokens": 4, "seed": 1},
           "prompts": [{"id": "plain", "template": TEMPLATE}], "queries": {"path": "queries.jsonl"},
           "scorer": {"extractor": "regex", "pattern": r"\A\s*(\S)"}, "build": {"test_fraction": 0.0}}
    path = folder / "spec.json"
    path.write_text(json.dumps(doc))
    return path


def _policy(folder: Path) -> Path:
    """Context ``slow`` answered at endpoint a, ``fast`` at endpoint b, one completion each."""
    policy = PolicyFile(
        task="two-endpoints", aggregator="mv", api="completions", n_max=2, objectives=("correct",),
        scorer={"extractor": "regex", "pattern": r"\A\s*(\S)"}, sampling=None,
        prompts=(PolicyPrompt("a/plain", TEMPLATE), PolicyPrompt("b/plain", TEMPLATE)),
        contexts=(PolicyContext("slow", (1.0,), 0.0, 0.5, "a/plain", 1),
                  PolicyContext("fast", (1.0,), 0.0, 0.5, "b/plain", 1)),
        learned={"agent": "test"}, estimate={"method": None})
    return policy.save(folder / "policy.json")


def test_each_endpoint_retries_with_its_own_backoff_capped_by_upstream_retries(tmp_path: Path) -> None:
    with EchoUpstream("7") as a, EchoUpstream("7") as b:
        port = free_port()
        serve = start_serve(_policy(tmp_path), _spec(tmp_path, {"a": a.url, "b": b.url}), port,
                            extra=["--upstream-retries", "1"])
        try:
            body = {"model": "iapo/fast", "prompt": "STATUS:503 please"}
            started, before = time.monotonic(), b.posts
            status, doc, _ = post_json(port, "/v1/completions", json.dumps(body).encode())
            fast_seconds = time.monotonic() - started
            assert status == 502 and doc["error"]["code"] == "upstream_unavailable", doc
            assert b.posts - before == 2 and a.posts == 0  # one call and one retry (the cap), all at b
            assert fast_seconds < 0.75 * SLOW_BACKOFF / 2, f"b's retry waited {fast_seconds:.2f} s: a's backoff?"

            body = {"model": "iapo/slow", "prompt": "STATUS:503 please"}
            started, before = time.monotonic(), a.posts
            status, doc, _ = post_json(port, "/v1/completions", json.dumps(body).encode())
            slow_seconds = time.monotonic() - started
            assert status == 502 and doc["error"]["code"] == "upstream_unavailable", doc
            assert a.posts - before == 2  # a's max_retries 3, capped at 1 by --upstream-retries
            assert slow_seconds >= SLOW_BACKOFF / 2, f"a's retry waited only {slow_seconds:.2f} s"
        finally:
            stop(serve)
