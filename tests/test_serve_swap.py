"""Swapping ``serve``'s policy without a dropped request (``iapo_gym.deploy.swap``).

Real parts: ``iapo-gym serve`` as a process before the scripted upstream (a process too), SIGHUP sent to it
with ``os.kill``, ``POST /admin/policy`` over HTTP, callers on keep-alive connections with no retry. Under
load the policy file is replaced and serve signalled again and again: no request may fail, and once a
response shows the new policy's arm (its ``iapo`` object names the prompt and N) every request sent after it
must show that arm too, until the next swap; a bad file is refused and the old arm keeps being served.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from iapo_gym.policyfile import PolicyPrompt
from tests.deploy_helpers import get_json, mv_policy, post_json, start_scripted, start_serve
from tests.llm_server import HERE, free_port, stop, write_spec

pytest.importorskip("uvicorn")

ADMIN = "adm-swap-test-7c6b5a4d3e2f"
KEY = "sk-swap-test-1a2b3c4d5e6f"
QUERY = "1 + 1 ="
# the context 'high' is served by ("short", 1) in A and by ("plain", 3) in B
A = mv_policy()
B = mv_policy({"low": ("plain", 3), "mid": ("short", 2), "high": ("plain", 3)})
ARM = {A.sha256: ("short", 1), B.sha256: ("plain", 3)}
SCRIPT = {"Q: 1 + 1 =\nA:": ["2", "2", "2", "2"], "1 + 1 = ->": ["2", "2", "2", "2"]}
BODY = json.dumps({"model": "iapo/high", "prompt": QUERY}).encode()


def _printed(proc: subprocess.Popen[bytes]) -> str:
    """What serve has printed so far, read without moving the offset it writes at."""
    fd = proc.log_file.fileno()  # type: ignore[attr-defined]
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def _wait_printed(proc: subprocess.Popen[bytes], text: str, count: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _printed(proc).count(text) < count:
        assert time.monotonic() < deadline, f"serve did not print {text!r} {count} times:\n{_printed(proc)[-3000:]}"
        time.sleep(0.02)


def _arm(answer: dict[str, Any]) -> tuple[str, int]:
    return answer["iapo"]["prompt"], answer["iapo"]["n"]


class Load:
    """``callers`` threads, each on its own keep-alive connection, sending the one request until stopped; every
    answer as (sent, received, status, arm or the failure)."""

    def __init__(self, port: int, callers: int) -> None:
        self.port, self.stop = port, threading.Event()
        self.results: list[tuple[float, float, int, Any]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._caller, daemon=True) for _ in range(callers)]
        for t in self.threads:
            t.start()

    def _caller(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                conn.request("POST", "/v1/completions", BODY, headers)
                resp = conn.getresponse()
                status, doc = resp.status, json.loads(resp.read())
                outcome: Any = _arm(doc) if status == 200 else doc
            except Exception as exc:  # a dropped connection is a failed request: nothing retries here
                status, outcome = 0, f"{type(exc).__name__}: {exc}"
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            with self.lock:
                self.results.append((sent, time.monotonic(), status, outcome))
        conn.close()

    def finish(self) -> list[tuple[float, float, int, Any]]:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)
        return sorted(self.results)


def _seen_after(port: int, arm: tuple[str, int], timeout: float = 10.0) -> float:
    """The time a probe request's answer with ``arm`` came (the swap was done before: any request sent later is
    answered by the new policy)."""
    deadline = time.monotonic() + timeout
    while True:
        status, doc, _ = post_json(port, "/v1/completions", BODY, {"Authorization": f"Bearer {KEY}"})
        assert status == 200, doc
        if _arm(doc) == arm:
            return time.monotonic()
        assert time.monotonic() < deadline, f"the swap to {arm} did not show within {timeout} s"
        time.sleep(0.02)


def swap_under_load(tmp_path: Path, seconds: float, every: float, callers: int = 16) -> None:
    """SIGHUP every ``every`` s for ``seconds`` s at ``callers`` concurrent callers (the module docstring's checks);
    the third signal comes with a bad file."""
    up, port = free_port(), free_port()
    scripted = start_scripted(SCRIPT, tmp_path, up)
    spec = write_spec(tmp_path, up, endpoint={"max_retries": 0})
    path = A.save(tmp_path / "policy.json")
    serve = start_serve(path, spec, port, extra=["--api-key-env", "IAPO_SWAP_KEY", "--max-concurrency", "32"],
                        env={"IAPO_SWAP_KEY": KEY})
    load = Load(port, callers)
    # per good swap: (from when every request sent has the arm, until when: the next good swap's signal, the arm)
    phases: list[list[Any]] = [[time.monotonic(), float("inf"), ARM[A.sha256]]]
    served, swapped, refused_at = A, 0, 0.0
    try:
        start = time.monotonic()
        step = 0
        while time.monotonic() - start < seconds:
            time.sleep(every)
            step += 1
            if step == 3:  # a bad file: truncated in the middle; the policy served stays, and its phase goes on
                path.write_text(B.to_json()[:500], encoding="utf-8")
                os.kill(serve.pid, signal.SIGHUP)
                _wait_printed(serve, "policy_refused (SIGHUP)", 1)
                refused_at = time.monotonic()
                continue
            served = B if served is A else A
            served.save(path)  # replaced atomically, then the signal
            phases[-1][1] = time.monotonic()
            os.kill(serve.pid, signal.SIGHUP)
            swapped += 1
            phases.append([_seen_after(port, ARM[served.sha256]), float("inf"), ARM[served.sha256]])
        results = load.finish()
        printed = _printed(serve)
    finally:
        load.stop.set()
        stop(serve)
        stop(scripted)
    failed = [r for r in results if r[2] != 200]
    assert not failed, (len(failed), failed[:5])
    assert len(results) > 10 * seconds, len(results)  # the load was real
    assert printed.count("policy swapped (SIGHUP)") == swapped and swapped >= 3, printed[-3000:]
    assert printed.count("policy_refused (SIGHUP)") == 1, printed[-3000:]
    assert "not a valid JSON policy file" in printed
    # every request sent inside a phase (after its arm showed, answered before the next swap's signal) has its arm
    checked = 0
    for begin, end, arm in phases:
        inside = [r for r in results if begin <= r[0] and r[1] < end]
        assert all(r[3] == arm for r in inside), (arm, [r for r in inside if r[3] != arm][:5])
        checked += len(inside)
    assert checked > len(results) // 2, (checked, len(results))
    assert {r[3] for r in results} == {ARM[A.sha256], ARM[B.sha256]}
    # after the bad file was refused, the policy served before it went on being served
    kept = next(p for p in phases if p[0] < refused_at < p[1])
    after = [r for r in results if refused_at <= r[0] and r[1] < kept[1]]
    assert after and all(r[3] == kept[2] for r in after), after[:5]
    print(f"swap under load: {len(results)} requests at {callers} callers in {seconds:g} s, {swapped} swaps, "
          f"1 bad file refused, {len(failed)} failed")


def test_policy_swapped_under_load_short(tmp_path: Path) -> None:
    swap_under_load(tmp_path, seconds=6.0, every=1.0, callers=16)


@pytest.mark.heavy
def test_policy_swapped_under_load(tmp_path: Path) -> None:
    """The issue's must-show: SIGHUP every 2 s for 30 s at concurrency 16."""
    swap_under_load(tmp_path, seconds=30.0, every=2.0, callers=16)


def _admin(port: int, key: str | None = ADMIN, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    status, doc, _ = post_json(port, "/admin/policy", body, {"Authorization": f"Bearer {key}"} if key else {})
    return status, doc


def test_admin_route_swaps_and_refuses(tmp_path: Path) -> None:
    up, port = free_port(), free_port()
    scripted = start_scripted(SCRIPT, tmp_path, up)
    spec = write_spec(tmp_path, up, endpoint={"max_retries": 0})
    path = A.save(tmp_path / "policy.json")
    serve = start_serve(path, spec, port, extra=["--api-key-env", "IAPO_SWAP_KEY", "--admin-key-env",
                                                 "IAPO_SWAP_ADMIN"],
                        env={"IAPO_SWAP_KEY": KEY, "IAPO_SWAP_ADMIN": ADMIN})
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        assert _admin(port, None)[0] == 403
        assert _admin(port, KEY)[0] == 403  # the inbound key does not open it
        assert _admin(port, body=b'{"path": "/etc/passwd"}')[0] == 400
        status, doc = _admin(port)
        assert status == 200 and doc["status"] == "unchanged" and doc["policy"]["sha256"] == A.sha256
        B.save(path)
        status, doc = _admin(port)
        assert status == 200 and doc["status"] == "swapped", doc
        assert doc["previous"] == A.sha256 and doc["policy"]["sha256"] == B.sha256
        assert {"name": "high", "prompt": "plain", "n": 3} in doc["policy"]["contexts"]
        status, answer, _ = post_json(port, "/v1/completions", BODY, auth)
        assert status == 200 and _arm(answer) == ("plain", 3)
        assert get_json(port, "/health", auth)[1]["policy"] == B.sha256
        # bad files, each refused with the problem named; B keeps serving
        chat = dataclasses.replace(B, api="chat", prompts=tuple(  # the spec's endpoint uses the completions API
            PolicyPrompt(p.id, None, (("user", str(p.template)),)) for p in B.prompts))
        objectives = dataclasses.replace(B, objectives=("exact",))
        other = mv_policy({"low": ("plain", 3), "high": ("plain", 2)})  # another good policy, two contexts
        cases = [(lambda: path.write_text("{", encoding="utf-8"), "not a valid JSON policy file"),
                 (lambda: path.write_text(B.to_json().replace('"n": 3', '"n": 2', 1), encoding="utf-8"),
                  "checksum does not match"),
                 (lambda: chat.save(path), "written for the chat API"),
                 (lambda: objectives.save(path), "objectives ['exact'] differs from the served policy's"),
                 (lambda: path.unlink(), "cannot read policy file")]
        for write, problem in cases:
            write()
            status, doc = _admin(port)
            assert status == 422 and doc["error"]["code"] == "policy_refused", doc
            assert problem in doc["error"]["message"], (problem, doc)
            status, answer, _ = post_json(port, "/v1/completions", BODY, auth)
            assert status == 200 and _arm(answer) == ("plain", 3)
        other.save(path)
        status, doc = _admin(port)
        assert status == 200 and [c["name"] for c in doc["policy"]["contexts"]] == ["low", "high"]
        status, models = get_json(port, "/v1/models", auth)
        assert [m["id"] for m in models["data"]] == ["iapo/low", "iapo/high"]
        status, answer, _ = post_json(port, "/v1/completions", BODY, auth)
        assert status == 200 and _arm(answer) == ("plain", 2)
        status, answer, _ = post_json(port, "/v1/completions", json.dumps({"model": "iapo/mid", "prompt": QUERY})
                                      .encode(), auth)
        assert status == 400 and answer["error"]["code"] == "unknown_context"
    finally:
        printed = _printed(serve)
        stop(serve)
        stop(scripted)
    assert ADMIN not in printed and KEY not in printed
    assert printed.count("policy_refused (POST /admin/policy)") == 5


def test_admin_route_needs_its_own_key(tmp_path: Path) -> None:
    up, port = free_port(), free_port()
    spec = write_spec(tmp_path, up)
    path = A.save(tmp_path / "policy.json")
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "IAPO_SWAP_KEY": KEY}
    run = subprocess.run([sys.executable, "-m", "iapo_gym.cli", "serve", str(path), "--upstream", str(spec),
                          "--port", str(port), "--api-key-env", "IAPO_SWAP_KEY", "--admin-key-env", "IAPO_SWAP_KEY"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 1 and "the admin key must differ" in run.stderr, run.stderr
    assert KEY not in run.stderr
    run = subprocess.run([sys.executable, "-m", "iapo_gym.cli", "serve", str(path), "--upstream", str(spec),
                          "--port", str(port), "--admin-key-env", "IAPO_SWAP_UNSET"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 1 and "'IAPO_SWAP_UNSET', which is not set or empty" in run.stderr, run.stderr


def test_without_admin_key_the_route_does_not_exist(tmp_path: Path) -> None:
    up, port = free_port(), free_port()
    scripted = start_scripted(SCRIPT, tmp_path, up)
    spec = write_spec(tmp_path, up, endpoint={"max_retries": 0})
    serve = start_serve(A.save(tmp_path / "policy.json"), spec, port)
    try:
        status, doc = _admin(port, ADMIN)
        assert status == 404 and doc["error"]["code"] == "not_found"
        assert "/admin" not in doc["error"]["message"].split("the endpoints are", 1)[1]
    finally:
        stop(serve)
        stop(scripted)


def _policies_by_pid(port: int, want: int, timeout: float = 30.0) -> dict[int, str]:
    """Each worker's pid -> the sha256 of the policy it serves (from /health, new connections until ``want`` pids)."""
    seen: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < want:
        assert time.monotonic() < deadline, seen
        status, doc = get_json(port, "/health", {"Authorization": f"Bearer {KEY}"})
        assert status == 200
        seen[doc["pid"]] = doc["policy"]
    return seen


def _all_serve(port: int, sha: str, pids: set[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        seen = _policies_by_pid(port, len(pids))
        if set(seen) == pids and set(seen.values()) == {sha}:
            return
        assert set(seen) == pids, (seen, pids)  # the same workers: none was restarted
        assert time.monotonic() < deadline, seen
        time.sleep(0.1)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP is a POSIX signal")
def test_every_worker_swaps(tmp_path: Path) -> None:
    up, port = free_port(), free_port()
    scripted = start_scripted(SCRIPT, tmp_path, up)
    spec = write_spec(tmp_path, up, endpoint={"max_retries": 0})
    path = A.save(tmp_path / "policy.json")
    serve = start_serve(path, spec, port, extra=["--workers", "2", "--api-key-env", "IAPO_SWAP_KEY",
                                                 "--admin-key-env", "IAPO_SWAP_ADMIN"],
                        env={"IAPO_SWAP_KEY": KEY, "IAPO_SWAP_ADMIN": ADMIN})
    try:
        pids = set(_policies_by_pid(port, 2))
        _all_serve(port, A.sha256, pids)
        B.save(path)
        os.kill(serve.pid, signal.SIGHUP)  # to the supervisor: passed on to each worker, which swaps in place
        _all_serve(port, B.sha256, pids)
        A.save(path)
        status, doc = _admin(port)  # one worker answers, and signals its siblings through the supervisor
        assert status == 200 and doc["status"] == "swapped" and doc["workers"] == "signalled", doc
        _all_serve(port, A.sha256, pids)
        _wait_printed(serve, "policy swapped (SIGHUP)", 3)  # 2 workers on the first signal, the sibling on the 2nd
    finally:
        stop(serve)
        stop(scripted)


def test_docs_swap_commands_run_as_written(tmp_path: Path) -> None:
    """docs/deploy.md, "Swapping the policy": its commands, run in one bash as written (on a free port, not 8000),
    the example spec's endpoint pointed at a local upstream through OPENAI_BASE_URL, as docs/collect.md says."""
    from tests.echo_upstream import EchoUpstream
    from tests.test_docs_commands import ROOT, code_blocks

    text = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8").split("### Swapping the policy", 1)[1]
    block = next(body for lang, body in code_blocks("docs/deploy.md") if lang == "bash" and body in text)
    port = free_port()
    (tmp_path / "examples").mkdir()
    for f in (ROOT / "examples").iterdir():
        if f.is_file():
            (tmp_path / "examples" / f.name).write_bytes(f.read_bytes())
    A.save(tmp_path / "runs" / "arith-policy" / "policy.json")
    B.save(tmp_path / "runs" / "arith-policy-v2" / "policy.json")
    out = tmp_path / "out.txt"
    with EchoUpstream("2") as upstream, out.open("wb") as sink:
        env = {**os.environ, "OPENAI_BASE_URL": upstream.url, "PYTHONPATH": str(ROOT),
               "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
        bash = subprocess.Popen(["bash", "-e", "-c", block.replace("8000", str(port))], cwd=tmp_path, env=env,
                                stdout=sink, stderr=subprocess.STDOUT)
        try:
            assert bash.wait(timeout=120) == 0, out.read_text(encoding="utf-8")[-3000:]
            pid = int((tmp_path / "serve.pid").read_text(encoding="utf-8"))
            status, health = get_json(port, "/health")
            assert status == 200 and health["policy"] == B.sha256
            status, answer, _ = post_json(port, "/v1/completions", BODY)
            assert status == 200 and _arm(answer) == ARM[B.sha256]
        finally:
            if bash.poll() is None:
                bash.kill()
            if (tmp_path / "serve.pid").exists():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int((tmp_path / "serve.pid").read_text(encoding="utf-8")), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]:
            assert time.monotonic() < deadline, "serve did not stop on SIGTERM"
            time.sleep(0.1)
    printed = out.read_text(encoding="utf-8")
    assert printed.count("policy swapped") == 1, printed[-3000:]
    admin = json.loads(next(line for line in printed.splitlines() if line.startswith('{"status"')))  # curl's output
    assert admin["status"] in ("swapped", "unchanged") and admin["policy"]["sha256"] == B.sha256


def test_request_in_flight_finishes_on_the_old_policy(tmp_path: Path) -> None:
    """A request whose upstream call is slow is routed by A to its end though B is swapped in meanwhile; a request
    sent after the swap, answered while the slow one is still in flight, gets B."""
    from tests.echo_upstream import EchoUpstream

    with EchoUpstream("2") as upstream:
        port = free_port()
        spec = write_spec(tmp_path, 0, endpoint={"base_url": upstream.url, "max_retries": 0})
        path = A.save(tmp_path / "policy.json")
        serve = start_serve(path, spec, port)
        slow: dict[str, Any] = {}

        def ask() -> None:
            body = json.dumps({"model": "iapo/high", "prompt": "SLEEP:2 " + QUERY}).encode()
            status, doc, _ = post_json(port, "/v1/completions", body)
            slow.update(status=status, doc=doc, done=time.monotonic())

        caller = threading.Thread(target=ask)
        try:
            caller.start()
            deadline = time.monotonic() + 10
            while not any("SLEEP:2" in b.get("prompt", "") for b in list(upstream.bodies)):
                assert time.monotonic() < deadline, "the slow request did not reach the upstream"
                time.sleep(0.01)
            B.save(path)
            os.kill(serve.pid, signal.SIGHUP)
            _wait_printed(serve, "policy swapped (SIGHUP)", 1)
            status, doc, _ = post_json(port, "/v1/completions", BODY)
            answered = time.monotonic()
            assert status == 200 and _arm(doc) == ARM[B.sha256]
            caller.join(timeout=30)
        finally:
            stop(serve)
    assert slow["done"] > answered  # B answered while the slow request was in flight
    assert slow["status"] == 200 and _arm(slow["doc"]) == ARM[A.sha256], slow
    sent = [b for b in upstream.bodies if "SLEEP:2" in b["prompt"]]
    assert [b["prompt"] for b in sent] == ["SLEEP:2 1 + 1 = ->"]  # A's template, A's N (one call, n = 1)
    assert all(int(b.get("n") or 1) == 1 for b in sent)
