"""``iapo-gym collect`` against a real llama.cpp server (and a real error-injecting proxy): no mocks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from iapo_gym import IAPOEnv
from iapo_gym.cli import main as cli_main
from iapo_gym.llm.client import EndpointError
from iapo_gym.llm.collect import collect
from iapo_gym.llm.spec import SpecError, load_spec
from tests.llm_server import (
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


def _lines(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]


def _collector(spec: Path, out: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "iapo_gym.cli", "collect", str(spec), "--out", str(out), "--quiet"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_lines(log: Path, at_least: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and log.read_bytes().count(b"\n") >= at_least:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    raise AssertionError(f"{log} did not reach {at_least} lines")


def test_example_spec_is_valid() -> None:
    spec = load_spec(ROOT / "examples" / "collect_llamacpp.toml")
    assert spec.aggregator == "mv" and spec.n_max == 8 and len(spec.prompts) == 3 and len(spec.queries) == 5
    assert all(q.gold for q in spec.queries)


@pytest.mark.parametrize(("change", "field"), [
    ({"drop": "n_max"}, "n_max"),
    ({"scorer": {"extractor": "first_word"}}, "scorer.extractor"),
    ({"prompts": [{"id": "a", "template": "no placeholder"}]}, "prompts[0].template"),
    ({"queries": [{"id": "x", "text": "a", "gold": "1"}, {"id": "x", "text": "b", "gold": "2"}]}, "'id' repeats"),
    ({"queries": [{"id": "x", "text": "a"}]}, "'gold' is needed"),
    ({"endpoint": {"base_url": "ftp://x"}}, "endpoint.base_url"),
    ({"aggregator": "bon", "scorer": {"objectives": ["a"]}}, "scorer.callable"),
    ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
])
def test_bad_specs_are_refused_before_any_request(tmp_path: Path, change: dict, field: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    proxy = start_proxy(free_port(), port)  # nothing behind it: any request would be counted here
    try:
        spec = write_spec(tmp_path, port, queries=change.get("queries"), endpoint=change.get("endpoint"),
                          sampling=change.get("sampling"), scorer=change.get("scorer"),
                          aggregator=change.get("aggregator", "mv"))
        doc = json.loads(spec.read_text())
        if "drop" in change:
            del doc[change["drop"]]
        if "prompts" in change:
            doc["prompts"] = change["prompts"]
        spec.write_text(json.dumps(doc))
        out = tmp_path / "out"
        assert cli_main(["collect", str(spec), "--out", str(out), "--quiet"]) == 1
        err = capsys.readouterr().err
        assert field in err, err
        assert not out.exists()  # nothing half-written
        assert proxy_stats(port)["posts"] == 0
    finally:
        stop(proxy)


def test_full_collect_both_aggregators_then_psst(tmp_path: Path, llama_server: int) -> None:  # noqa: F811
    from agents import make

    for aggregator in ("mv", "bon"):
        spec = load_spec(write_spec(tmp_path / aggregator, llama_server, aggregator=aggregator))
        result = collect(spec, tmp_path / aggregator / "out", progress=False)
        assert result.complete and result.total == 2 * 3 * 4 and result.table is not None
        lines = _lines(result.log)
        assert len({line["key"] for line in lines}) == 24
        assert all(1 <= line["tokens"] <= 6 for line in lines)  # usage from the server
        env = IAPOEnv(path=str(result.table))
        assert env.table.aggregator == aggregator and env.n_prompts == 2 and env.table.n_queries == 3
        assert env.table.attrs["completions"] == 24 and "tiny" in env.table.attrs["collected"]
        assert "api_key" not in json.dumps(env.table.attrs).lower()
        env.reset(seed=0)
        policy = make("psst", seed=0).train(env, 40)
        assert env.budget_used <= 40 and len(policy) == env.n_contexts
        # a rerun on the same folder finds nothing to do and rebuilds the same table
        again = collect(spec, tmp_path / aggregator / "out", progress=False)
        assert again.new == 0 and again.requests == 0 and again.total == 24
        assert np.array_equal(IAPOEnv(path=str(again.table)).table.probs, env.table.probs)


def test_kill_9_then_resume_matches_an_uninterrupted_run(tmp_path: Path, llama_server: int) -> None:  # noqa: F811
    spec = write_spec(tmp_path, llama_server, n_max=16, endpoint={"concurrency": 1})
    proc = _collector(spec, tmp_path / "a")
    log = tmp_path / "a" / "tiny.jsonl"
    _wait_lines(log, 20, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert log.read_bytes().count(b"\n") < 96
    with log.open("ab") as f:  # as if the kill had landed in the middle of a write
        f.write(b'{"key": "plain/q0/3", "prompt": "pl')
    assert cli_main(["collect", str(spec), "--out", str(tmp_path / "a"), "--quiet"]) == 0
    resumed = _lines(log)
    assert cli_main(["collect", str(spec), "--out", str(tmp_path / "b"), "--quiet"]) == 0
    straight = _lines(tmp_path / "b" / "tiny.jsonl")
    assert len(resumed) == len(straight) == 2 * 3 * 16
    assert len({r["key"] for r in resumed}) == 96

    def content(rows: list[dict]) -> dict:
        return {r["key"]: (r["text"], r["tokens"], r["answer"]) for r in rows}
    assert content(resumed) == content(straight)


@pytest.mark.heavy
def test_server_killed_and_restarted_mid_run(tmp_path: Path, tiny_model: Path) -> None:  # noqa: F811
    port = free_port()
    server = start_llama_server(tiny_model, port)
    spec = write_spec(tmp_path, port, n_max=16, endpoint={"concurrency": 2, "max_retries": 30, "backoff": 0.1,
                                                          "max_backoff": 0.5})
    proc = _collector(spec, tmp_path / "out")
    try:
        _wait_lines(tmp_path / "out" / "tiny.jsonl", 10, proc)
        server.send_signal(signal.SIGKILL)
        server.wait()
        time.sleep(1.0)
        assert proc.poll() is None  # still retrying
        server = start_llama_server(tiny_model, port)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        assert b"retries" in out and b" 0 retries" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
        stop(server)
    assert len({r["key"] for r in _lines(tmp_path / "out" / "tiny.jsonl")}) == 96


def test_injected_errors_are_retried_with_backoff(tmp_path: Path, llama_server: int) -> None:  # noqa: F811
    port = free_port()
    proxy = start_proxy(llama_server, port, ["429", "500", "drop", "slow"], slow=6.0)
    try:
        spec = load_spec(write_spec(tmp_path, port, n_max=2, endpoint={"concurrency": 1, "timeout": 2.0}))
        result = collect(spec, tmp_path / "out", progress=False)
        stats = proxy_stats(port)
    finally:
        stop(proxy)
    assert result.complete and len(_lines(result.log)) == 12
    assert stats["injected"] == 4 and result.retries >= 4  # (more if a loaded machine passes the timeout)
    assert result.requests == 12 + result.retries


def test_retry_after_is_honoured(tmp_path: Path, llama_server: int) -> None:  # noqa: F811
    port = free_port()
    proxy = start_proxy(llama_server, port, ["429"])
    try:
        spec = load_spec(write_spec(tmp_path, port, n_max=1, endpoint={"concurrency": 1},
                                    queries=[{"id": "a", "text": "x", "gold": "1"}]))
        t0 = time.monotonic()
        result = collect(spec, tmp_path / "out", progress=False)
        elapsed = time.monotonic() - t0
    finally:
        stop(proxy)
    assert result.complete and result.retries == 1
    assert elapsed >= 1.0  # Retry-After: 1 (the backoff alone would wait under 0.1 s)


@pytest.mark.parametrize(("status", "words"), [("400", "HTTP 400"), ("401", "HTTP 401 (unauthorized")])
def test_client_errors_stop_at_once(tmp_path: Path, llama_server: int, status: str, words: str) -> None:  # noqa: F811
    port = free_port()
    proxy = start_proxy(llama_server, port, [status])
    try:
        spec = load_spec(write_spec(tmp_path, port, endpoint={"concurrency": 1}))
        with pytest.raises(EndpointError, match=words.replace("(", r"\(")):
            collect(spec, tmp_path / "out", progress=False)
        assert proxy_stats(port)["posts"] == 1  # not retried, nothing else sent
    finally:
        stop(proxy)


def test_spending_cap_holds_under_16_concurrent_requests(tmp_path: Path, llama_server: int) -> None:  # noqa: F811
    port = free_port()
    proxy = start_proxy(llama_server, port)
    try:
        spec_path = write_spec(tmp_path, port, n_max=16, endpoint={"concurrency": 16},
                               sampling={"max_tokens": 6, "temperature": 0.9}, budget={"max_tokens_total": 100})
        result = collect(load_spec(spec_path), tmp_path / "out", progress=False)
        stats = proxy_stats(port)
        assert result.budget_exhausted and not result.complete and result.table is None
        assert stats["max_in_flight"] > 1  # the requests really were concurrent
        assert stats["completion_tokens"] <= 100 and result.tokens == stats["completion_tokens"]
        assert sum(r["tokens"] for r in _lines(result.log)) <= 100
        # a request cap too, then resume with the cap lifted: exactly every completion, none twice. use_n = "yes"
        # plans one request per group (6 fit the cap, so the run starts); llama.cpp then answers one completion
        # per request and the cap stops the run in flight
        spec2 = write_spec(tmp_path, port, n_max=16, endpoint={"concurrency": 16, "use_n": "yes"},
                           sampling={"max_tokens": 6, "temperature": 0.9}, budget={"max_requests": 10}, name="s2.json")
        before = proxy_stats(port)["posts"]
        capped = collect(load_spec(spec2), tmp_path / "out", progress=False)
        assert capped.budget_exhausted and proxy_stats(port)["posts"] - before <= 10 and capped.requests <= 10
        final = collect(load_spec(write_spec(tmp_path, port, n_max=16, endpoint={"concurrency": 16},
                                             sampling={"max_tokens": 6, "temperature": 0.9}, name="s3.json")),
                        tmp_path / "out", progress=False)
    finally:
        stop(proxy)
    assert final.complete and len({r["key"] for r in _lines(final.log)}) == 96 == len(_lines(final.log))


def test_resume_with_a_different_spec_is_refused(tmp_path: Path, llama_server: int) -> None:  # noqa: F811
    collect(load_spec(write_spec(tmp_path, llama_server, n_max=1)), tmp_path / "out", progress=False)
    other = load_spec(write_spec(tmp_path, llama_server, n_max=1, sampling={"temperature": 0.5}, name="o.json"))
    with pytest.raises(SpecError, match="different sampling"):
        collect(other, tmp_path / "out", progress=False)


def test_openai_env_vars_override_the_spec(tmp_path: Path, llama_server: int,  # noqa: F811
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_spec(write_spec(tmp_path, free_port(), n_max=1))  # the spec's port has no server
    monkeypatch.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{llama_server}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-test-key")
    result = collect(spec, tmp_path / "out", progress=False)
    assert result.complete
    for path in (tmp_path / "out").iterdir():
        assert b"sk-secret-test-key" not in path.read_bytes(), path


def test_reward_endpoint_scorer_and_chat_api(tmp_path: Path, llama_server: int) -> None:  # noqa: F811
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.llm_scorer import score

    seen: list[dict] = []

    class Reward(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            data = json.dumps({"scores": score(body["completion"], body["query"])}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Reward)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        spec_path = write_spec(tmp_path, llama_server, aggregator="bon", n_max=2,
                               endpoint={"api": "chat"},
                               scorer={"reward_url": f"http://127.0.0.1:{server.server_port}/score",
                                       "objectives": ["length", "digits"]})
        doc = json.loads(spec_path.read_text())
        doc["prompts"] = [{"id": "sys", "messages": [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "{query}"}]},
                          {"id": "bare", "messages": [{"role": "user", "content": "Q: {query}"}]}]
        spec_path.write_text(json.dumps(doc))
        result = collect(load_spec(spec_path), tmp_path / "out", progress=False)
    finally:
        server.shutdown()
    assert result.complete and len(seen) == 2 * 3 * 2
    lines = _lines(result.log)
    assert all(r["scores"] == score(r["text"], "") for r in lines)  # what the endpoint answered, logged as is
    assert {s["query"] for s in seen} == {"1 + 1 =", "What is 7 times 6?", "Name a letter:"}
    env = IAPOEnv(path=str(result.table))
    assert env.table.objective_names == ("length", "digits")


def test_missing_openai_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from iapo_gym.llm.client import require_openai

    monkeypatch.setitem(sys.modules, "openai", None)  # what an install without the [llm] extra sees
    with pytest.raises(ImportError, match=r'pip install "iapo-gym\[llm\]"'):
        require_openai()


def test_collect_takes_a_contexts_file(tmp_path: Path, llama_server: int) -> None:  # noqa: F811
    """``collect --contexts FILE`` gives the table the file's contexts, and ``contexts_source`` says so; without it
    the spec's ``[[contexts]]`` are named as the source; a file weighing the wrong number of objectives is refused."""
    spec_path = write_spec(tmp_path, llama_server, aggregator="mv")
    out = tmp_path / "out"
    (tmp_path / "users.json").write_text(json.dumps({"contexts": [
        {"name": "free", "objective_weights": [1.0], "cost_weight": 0.0, "probability": 0.25},
        {"name": "thrifty", "objective_weights": [1.0], "cost_weight": -0.5, "probability": 0.75}]}))
    assert cli_main(["collect", str(spec_path), "--out", str(out), "--quiet",
                     "--contexts", str(tmp_path / "users.json")]) == 0
    table = IAPOEnv(path=str(out / f"{load_spec(spec_path).task}.h5")).table
    assert table.context_names == ("free", "thrifty")
    assert np.array_equal(table.context_weights, [[1.0, 0.0], [1.0, -0.5]])
    assert np.array_equal(table.context_probs, [0.25, 0.75])
    assert table.attrs["contexts_source"] == ("2 contexts over 1 objective, cost weights 0, 0.5, not uniform: "
                                              "the contexts file users.json")
    (tmp_path / "two.json").write_text(json.dumps({"contexts": [
        {"name": "a", "objective_weights": [0.5, 0.5], "cost_weight": 0.0, "probability": 1.0}]}))
    assert cli_main(["collect", str(spec_path), "--out", str(out), "--quiet",
                     "--contexts", str(tmp_path / "two.json")]) == 1
