"""Test helpers for the deploy tests: policies written in code, the scripted server and ``iapo-gym serve`` as processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyPrompt
from tests.llm_server import HERE, _log_file, proxy_stats, start_with_stats, stop, wait_ready

TEMPLATES = {"plain": "Q: {query}\nA:", "short": "{query} ->"}


def mv_policy(arms: dict[str, tuple[str, int]] | None = None, *, extractor: dict[str, Any] | None = None,
              n_max: int = 4, sampling: dict[str, Any] | None = None) -> PolicyFile:
    """A majority-vote policy over the contexts low/mid/high (cost weights 0, -0.2, -1) of the tiny spec's prompts."""
    arms = arms or {"low": ("plain", 3), "mid": ("short", 2), "high": ("short", 1)}
    cost = {"low": 0.0, "mid": -0.2, "high": -1.0}
    return PolicyFile(
        task="tiny", aggregator="mv", api="completions", n_max=n_max, objectives=("correct",),
        scorer=extractor or {"extractor": "last_number", "choices": "ABCDE"}, sampling=sampling,
        prompts=tuple(PolicyPrompt(pid, TEMPLATES[pid]) for pid in sorted({p for p, _ in arms.values()})),
        contexts=tuple(PolicyContext(name, (1.0,), cost[name], 1.0 / len(arms), p, n)
                       for name, (p, n) in arms.items()),
        learned={"agent": "test"}, estimate={"method": None})


def bon_policy(n: int = 4) -> PolicyFile:
    """A Best-of-N policy with two contexts that weigh the two objectives of tests.llm_scorer oppositely."""
    return PolicyFile(
        task="tiny", aggregator="bon", api="completions", n_max=n, objectives=("length", "digits"),
        scorer={"callable": "tests.llm_scorer:score", "reward_url": None, "objectives": ["length", "digits"],
                "grid": 0.5, "score_range": [-1.0, 1.0]},
        sampling=None, prompts=(PolicyPrompt("plain", TEMPLATES["plain"]),),
        contexts=(PolicyContext("long", (0.9, 0.1), -0.1, 0.5, "plain", n),
                  PolicyContext("digits", (0.1, 0.9), -0.1, 0.5, "plain", n)),
        learned={"agent": "test"}, estimate={"method": None})


def start_scripted(script: dict[str, list[str]], folder: Path, port: int, *, ignore_n: bool = False,
                   delay: float = 0.0) -> subprocess.Popen[bytes]:
    """tests/scripted_llm.py on 127.0.0.1:port with ``script``, ready to answer."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"script-{port}.json"
    path.write_text(json.dumps(script), encoding="utf-8")
    cmd = [sys.executable, str(HERE / "scripted_llm.py"), "--port", str(port), "--script", str(path)]
    if ignore_n:
        cmd.append("--ignore-n")
    if delay:
        cmd += ["--delay", str(delay)]
    return start_with_stats(cmd, "scripted", port)


def scripted_stats(port: int) -> dict[str, int]:
    """The scripted server's counters."""
    return proxy_stats(port)


def start_serve(policy: Path, spec: Path, port: int, *, extra: list[str] | None = None,
                env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``iapo-gym serve`` (this checkout's code) on 127.0.0.1:port, ready to answer."""
    root = str(HERE.parent)
    cmd = [sys.executable, "-m", "iapo_gym.cli", "serve", str(policy), "--upstream", str(spec), "--port", str(port),
           *(extra or [])]
    full_env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    full_env.pop("OPENAI_BASE_URL", None)
    log = _log_file("serve")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=root)
    proc.log_file = log  # type: ignore[attr-defined]
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=60)
    except BaseException:
        stop(proc)
        raise
    return proc


#: The tiny model's answer as a policy extractor: its first visible character.
FIRST_CHAR = {"extractor": "regex", "pattern": r"\A\s*(\S)"}


def post_json(port: int, path: str, body: bytes, headers: dict[str, str] | None = None,
              timeout: float = 60) -> tuple[int, dict[str, Any], Any]:
    """POST ``body`` as JSON to 127.0.0.1:port; the status, the decoded JSON answer and the headers (errors too)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def get_json(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """GET from 127.0.0.1:port; the status and the decoded JSON answer (errors too)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
