"""Benchmark: ``iapo-gym serve --learn --log DIR`` killed with -9 at a random point under load, then restarted on the
same log (docs/deploy.md, "Logging, feedback and off-policy evaluation", Durability).

The upstream is ``iapo-gym simulate`` of a Best-of-N table (default ``generated:bon_flat:1``), the served policy a
Best-of-N policy of the simulator's spec with two contexts (each starting on one of the table's prompts, N = 1 and
N = 2), so that ``--learn`` has 10 candidate arms per context to explore and learn. A seeded plan of requests
(context and query drawn from a seeded generator) is sent by ``--concurrency`` callers; once ``--kill-at`` of
them are answered (default: a seeded uniform draw between 20 % and 80 % of the plan) serve gets SIGKILL. It is then
restarted with the same options and log folder, and the rest of the plan goes through it. Measured:

* the **lost rows**: requests a caller got an answer for whose id is not in the log after the kill, and how long
  before the kill each was answered (the stated bound: the rows of the requests answered in the last
  ``--log-flush-ms`` milliseconds, plus the time the log's thread takes to commit);
* **resumed learning**: ``GET /health``'s ``learn`` section right after the restart, against the log: the requests
  chosen and explored it counts (the budget's counts), and each arm's observations against the rows logged for it;
* the **exploration budget** over both lifetimes: the requests explored, as the log and the restarted learner count
  them, never more than ``floor(share x requests chosen)``; with ``--after-concurrency 1`` at every request after
  the restart (the callers' order is the learner's).

Run: ``nice -n 5 .venv/bin/python benchmarks/bench_serve_kill.py`` (5,000 requests at concurrency 16); the numbers
go to stdout as a table and one JSON line. ``tests/test_serve_kill_learn.py`` runs ``kill_and_resume`` small.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from iapo_gym.outcome_log import DEFAULT_FLUSH_MS, read_log  # noqa: E402
from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyPrompt  # noqa: E402
from iapo_gym.seeding import derive_rng  # noqa: E402
from tests.llm_server import _log_file, free_port, output, stop, wait_ready  # noqa: E402

CLI = [sys.executable, "-m", "iapo_gym.cli"]
#: The two contexts of the served policy: name -> (objective weights, prompt index, N).
CONTEXTS = {"a": ((0.0, 0.0, 1.0), 0, 1), "b": ((1.0, 0.0, 0.0), 1, 2)}


def _start(argv: list[str], port: int, name: str) -> subprocess.Popen[bytes]:
    """A server process (simulate or serve) of this checkout, ready on ``port``; its output kept for errors."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = _log_file(name)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    proc.log_file = log  # type: ignore[attr-defined]
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=120)
    except RuntimeError as exc:
        printed = output(proc)
        stop(proc)
        raise RuntimeError(f"{exc}; it printed: {printed[-2000:]}") from None
    except BaseException:
        stop(proc)
        raise
    return proc


def _health(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
        return dict(json.loads(resp.read()))


def _ask(port: int, item: tuple[str, str], timeout: float = 30) -> dict[str, Any]:
    """One completion request (context, query); the response (raises OSError when serve is gone)."""
    body = json.dumps({"model": f"iapo/{item[0]}", "prompt": item[1]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return dict(json.loads(resp.read()))


def _answer(body: dict[str, Any]) -> dict[str, Any]:
    iapo = body["iapo"]
    return {"id": body["id"], "context": iapo["context"], "prompt": iapo["prompt"], "n": int(iapo["n"]),
            "explored": bool(iapo["learn"]["explored"])}


def kill_and_resume(folder: Path, *, requests: int, concurrency: int, kill_at: int, share: float, seed: int,
                    after_concurrency: int | None = None, flush_ms: float = DEFAULT_FLUSH_MS,
                    table: str = "generated:bon_flat:1") -> dict[str, Any]:
    """The run of the module docstring in ``folder``: ``requests`` planned, SIGKILL once ``kill_at`` are answered,
    the rest after the restart (at ``after_concurrency`` callers, default ``concurrency``). Returns what it saw:
    the callers' answers of each lifetime, the log's rows after the kill and at the end, ``/health``'s ``learn``
    right after the restart and at the end, and when the kill came (``time.monotonic``)."""
    folder.mkdir(parents=True, exist_ok=True)
    sim_port = free_port()
    spec_path = folder / "sim.json"
    subprocess.run([*CLI, "simulate", table, "--port", str(sim_port), "--write-spec", str(spec_path)], check=True,
                   cwd=ROOT, capture_output=True)
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    queries = [json.loads(line)["text"] for line in (folder / "sim.queries.jsonl").read_text().splitlines() if line]
    prompts = [p["id"] for p in spec["prompts"]]
    PolicyFile(
        task=spec["task"], aggregator="bon", api="completions", n_max=int(spec["n_max"]),
        objectives=tuple(spec["scorer"]["objectives"]), scorer={**spec["scorer"], "grid": None},
        sampling=spec["sampling"], prompts=tuple(PolicyPrompt(p["id"], p["template"]) for p in spec["prompts"]),
        contexts=tuple(PolicyContext(name, w, 0.0, 1.0 / len(CONTEXTS), prompts[p], n)
                       for name, (w, p, n) in CONTEXTS.items()),
        learned={"agent": "bench_serve_kill"}).save(folder / "policy.json")
    rng = derive_rng(seed, "benchmarks.bench_serve_kill.plan")
    names = sorted(CONTEXTS)
    plan = [(names[int(rng.integers(len(names)))], queries[int(rng.integers(len(queries)))]) for _ in range(requests)]
    log_dir = folder / "log"
    serve_args = ["--learn", "--explore-share", str(share), "--seed", str(seed), "--log", str(log_dir),
                  "--log-flush-ms", str(flush_ms), "--max-concurrency", str(max(64, 2 * concurrency))]
    sim = _start([*CLI, "simulate", table, "--port", str(sim_port), "--seed", str(seed), "--max-connections", "1024"],
                 sim_port, "simulate")
    procs = [sim]
    try:
        port = free_port()
        serve = _start([*CLI, "serve", str(folder / "policy.json"), "--upstream", str(spec_path), "--port", str(port),
                        *serve_args], port, "serve")
        procs.append(serve)
        # ---- the first lifetime: load until kill_at answers, then SIGKILL -------------------------------------
        lock = threading.Lock()
        before: list[tuple[float, dict[str, Any]]] = []  # (monotonic time the caller had it, answer)
        errors: list[str] = []
        killed = threading.Event()
        next_item = iter(range(requests))
        sent: set[int] = set()

        def caller() -> None:
            while not killed.is_set():
                with lock:
                    i = next(next_item, None)
                    if i is None:
                        return
                    sent.add(i)
                try:
                    body = _ask(port, plan[i])
                except (OSError, urllib.error.URLError) as exc:
                    if not killed.is_set():
                        errors.append(f"request {i}: {exc}")
                    return
                now = time.monotonic()
                with lock:
                    before.append((now, _answer(body)))
                    if len(before) >= kill_at and not killed.is_set():
                        os.kill(serve.pid, signal.SIGKILL)  # at once, from the thread that saw the count
                        killed.set()
                        killed_at.append(time.monotonic())

        killed_at: list[float] = []
        threads = [threading.Thread(target=caller) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        serve.wait(30)
        if errors or not killed_at:
            raise RuntimeError(f"the load before the kill failed ({errors[:3]}), or never reached {kill_at} answers: "
                               f"{output(serve)[-2000:]}")
        _, rows = read_log(log_dir)
        after_kill = list(rows)
        # ---- the second lifetime: restart on the log, the rest of the plan -----------------------------------
        port2 = free_port()
        serve2 = _start([*CLI, "serve", str(folder / "policy.json"), "--upstream", str(spec_path), "--port",
                         str(port2), *serve_args], port2, "serve")
        procs.append(serve2)
        resumed = _health(port2)["learn"]
        rest = [plan[i] for i in range(requests) if i not in sent]
        after: list[dict[str, Any]] = []
        if (after_concurrency or concurrency) == 1:
            after = [_answer(_ask(port2, item)) for item in rest]
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(after_concurrency or concurrency) as pool:
                after = [_answer(b) for b in pool.map(lambda item: _ask(port2, item), rest)]
        final = _health(port2)["learn"]
        stop(serve2)  # SIGTERM: the log is written out
        procs.remove(serve2)
        _, rows = read_log(log_dir)
        at_end = list(rows)
    finally:
        for p in reversed(procs):
            stop(p)
    return {"before": before, "killed_at": killed_at[0], "after_kill": after_kill, "resumed": resumed,
            "after": after, "final": final, "at_end": at_end, "share": share, "flush_ms": flush_ms,
            "kill_at": kill_at, "requests": requests, "after_concurrency": after_concurrency or concurrency}


def arm_evidence(learn: dict[str, Any]) -> dict[tuple[str, str, int], float]:
    """Per (context, prompt, N), the evidence ``GET /health``'s ``learn`` section shows for the arm: its (discounted)
    observations, ``weight``, the learner's prior included."""
    return {(name, arm["prompt"], int(arm["n"])): float(arm.get("weight", arm.get("observed", 0)))
            for name, ctx in learn["contexts"].items() for arm in ctx["arms"]}


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """What ``kill_and_resume`` saw, as the numbers the docs report and the test checks."""
    logged = {r.id for r in run["after_kill"]}
    answered = {a["id"] for _, a in run["before"]}
    lost = [(run["killed_at"] - at, a) for at, a in run["before"] if a["id"] not in logged]
    per_arm = Counter((r.context, r.prompt, r.n) for r in run["after_kill"])
    evidence = arm_evidence(run["resumed"])
    share = run["share"]
    log_explored = sum(bool(r.outcomes["learn"]["explored"]) for r in run["after_kill"])
    end_explored = sum(bool(r.outcomes["learn"]["explored"]) for r in run["at_end"])
    # one caller after the restart: the budget at each request, in the learner's order (else: None)
    over: int | None = None
    if run["after_concurrency"] == 1:
        explored, chosen, over = run["resumed"]["explored"], run["resumed"]["chosen"], 0
        for a in run["after"]:
            chosen += 1
            explored += a["explored"]
            over += explored > math.floor(share * chosen + 1e-9)
    return {
        "answered_before_kill": len(answered), "logged_after_kill": len(logged),
        "lost": len(lost), "lost_explored": sum(a["explored"] for _, a in lost),
        "lost_max_age_ms": max((age for age, _ in lost), default=0.0) * 1000,
        "logged_not_answered": len(logged - answered),
        "answered_in_last_flush": sum(1 for at, _ in run["before"] if run["killed_at"] - at <= run["flush_ms"] / 1000),
        "resumed_chosen": run["resumed"]["chosen"], "resumed_explored": run["resumed"]["explored"],
        "log_chosen": sum(1 for r in run["after_kill"] if "learn" in r.outcomes), "log_explored": log_explored,
        "arms_logged": len(per_arm), "arms_with_evidence": sum(evidence.get(arm, 0) > 0 for arm in per_arm),
        "after": len(run["after"]), "final_chosen": run["final"]["chosen"], "final_explored": run["final"]["explored"],
        "rows_at_end": len(run["at_end"]), "explored_at_end": end_explored,
        "budget_at_end": math.floor(share * len(run["at_end"]) + 1e-9), "over_budget_after_restart": over,
        "final_budget": math.floor(share * run["final"]["chosen"] + 1e-9),
    }


def main() -> None:
    """Run ``kill_and_resume`` at the options' size and print the table and its JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kill-at", type=int, help="answers before the kill (default: seeded, 20-80 %% of --requests)")
    ap.add_argument("--explore-share", type=float, default=0.1)
    ap.add_argument("--log-flush-ms", type=float, default=DEFAULT_FLUSH_MS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table", default="generated:bon_flat:1")
    args = ap.parse_args()
    kill_at = args.kill_at or int(derive_rng(args.seed, "benchmarks.bench_serve_kill.kill").integers(
        args.requests // 5, 4 * args.requests // 5))
    with tempfile.TemporaryDirectory(prefix="bench-serve-kill-") as tmp:
        run = kill_and_resume(Path(tmp), requests=args.requests, concurrency=args.concurrency, kill_at=kill_at,
                              share=args.explore_share, seed=args.seed, flush_ms=args.log_flush_ms, table=args.table)
    s = summary(run)
    print(f"serve --learn --log killed with -9 after {kill_at} of {args.requests} answers at concurrency "
          f"{args.concurrency}, restarted on its log; {args.table}, --explore-share {args.explore_share}, "
          f"--log-flush-ms {args.log_flush_ms:g}, seed {args.seed}; {os.cpu_count()} cores shared with other jobs")
    print(f"lost rows: {s['lost']} of {s['answered_before_kill']} answered (explored among them: {s['lost_explored']}), "
          f"the oldest answered {s['lost_max_age_ms']:.0f} ms before the kill; {s['answered_in_last_flush']} answered in "
          f"the last {args.log_flush_ms:g} ms; {s['logged_not_answered']} logged but never received by a caller")
    print(f"resumed: chosen {s['resumed_chosen']} / explored {s['resumed_explored']} (the log: {s['log_chosen']} / "
          f"{s['log_explored']}); of the {s['arms_logged']} arms (context, prompt, N) the log served, "
          f"{s['arms_with_evidence']} have evidence in the restarted learner")
    print(f"after the restart: {s['after']} requests; at the end the log holds {s['rows_at_end']} rows, "
          f"{s['explored_at_end']} explored (budget {s['budget_at_end']}); the restarted learner counts "
          f"{s['final_explored']} of {s['final_chosen']} explored (budget {s['final_budget']})")
    print(json.dumps({"kill_at": kill_at, **s}))


if __name__ == "__main__":
    main()
