"""Benchmark of ``serve --learn`` against a drifting simulated upstream (docs/deploy.md, "Learning while serving").

A table (default ``generated:bon_flat:1``) is learned by ``iapo-gym optimize`` (stationary, the table as it is), then
served twice, each time in front of a fresh ``iapo-gym simulate TABLE --schedule drift --horizon R``: frozen (plain
``serve``) and learning (``serve --learn --log``). R requests go through each at concurrency C, each in a context
drawn from the table's context distribution and on a query drawn uniformly, both from a seeded generator, so both
servers get the same request sequence. Every answered request is valued exactly from the table: the expected
utility of the served arm (p, N) on its query and in its context, E[max of N weighted scores] + cost_weight x N x
cost(p, q), under the table of the drift segment the request falls in. The segment is taken from the order in
which the answers came back, which is the simulator's numbering up to the C requests in flight (the simulator
numbers a request when it answers it; a Best-of-N context without a stopping rule is one simulator request).

Printed per block of 1,000 requests (or ``--block``): the mean exact utility served, frozen and learning, and the
oracle's (the best arm per context and segment); then the regret the drift opened for the frozen policy and the share
of it ``--learn`` recovered within 5,000 requests after the drift's first segment, and the exploration share.

Run small (the default: 2,000 requests at concurrency 4, a few minutes on two shared cores):
``.venv/bin/python benchmarks/bench_learn.py``; the issue's size:
``.venv/bin/python benchmarks/bench_learn.py --requests 20000 --concurrency 16 --block 1000``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from iapo_gym.exact import exact_reward  # noqa: E402
from iapo_gym.online.schedule import build_schedule  # noqa: E402
from iapo_gym.seeding import derive_rng  # noqa: E402
from iapo_gym.tasks.generated import level_table  # noqa: E402
from tests.llm_server import free_port, stop, wait_ready  # noqa: E402

CLI = [sys.executable, "-m", "iapo_gym.cli"]


def start(argv: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    """A server process (simulate or serve), ready on ``port``; its output goes to ``log``."""
    out = open(log, "ab")  # noqa: SIM115 (the process's output for its lifetime)
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=120)
    except BaseException:
        stop(proc)
        raise
    return proc


def run_requests(port: int, plan: list[tuple[str, str]], concurrency: int) -> list[dict[str, Any]]:
    """Send ``plan`` (context name, query text) at ``concurrency``; each answer's iapo object in arrival order."""
    lock = threading.Lock()
    answered: list[dict[str, Any]] = []

    def one(item: tuple[str, str]) -> None:
        body = json.dumps({"model": f"iapo/{item[0]}", "prompt": item[1]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            iapo = json.loads(resp.read())["iapo"]
        with lock:
            answered.append({"query": item[1], **iapo})

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, plan))
    return answered


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="bon_flat")
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--requests", type=int, default=2000, help="requests per server (default 2000; the issue: 20000)")
    ap.add_argument("--concurrency", type=int, default=4, help="callers at once (default 4; the issue: 16)")
    ap.add_argument("--block", type=int, default=200, help="requests per reported block (default 200)")
    ap.add_argument("--explore-share", type=float, default=0.05)
    ap.add_argument("--budget", type=int, default=2000, help="optimize's training budget (completions)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures as JSON to this file")
    args = ap.parse_args()

    table = level_table(args.family, args.level)
    schedule = build_schedule("drift", table, args.requests)
    starts = [s.start for s in schedule.segments]
    work = Path(tempfile.mkdtemp(prefix="iapo-bench-learn-"))
    target = f"generated:{args.family}:{args.level}"
    sim_port = free_port()
    spec = work / "spec.json"
    subprocess.run([*CLI, "simulate", target, "--port", str(sim_port), "--write-spec", str(spec)], check=True,
                   cwd=ROOT, capture_output=True)
    subprocess.run([*CLI, "data", "generate", args.family, "--levels", f"{args.level}:{args.level}", "--out",
                    str(work / "tables")], check=True, cwd=ROOT, capture_output=True)
    table_file = work / "tables" / f"{args.family}-{args.level}.h5"
    subprocess.run([*CLI, "optimize", str(table_file), "--spec", str(spec), "--budget", str(args.budget), "--seed",
                    str(args.seed), "--out", str(work / "policy"), "--quiet"], check=True, cwd=ROOT, capture_output=True)
    policy = json.loads((work / "policy" / "policy.json").read_text())
    names = [c["name"] for c in policy["contexts"]]
    weights = np.array([[*c["objective_weights"], c["cost_weight"]] for c in policy["contexts"]])
    assert np.allclose(weights, table.context_weights), "the policy's contexts are the table's, in its order"
    rng = derive_rng(args.seed, "bench_learn", "requests")
    contexts = rng.choice(len(names), size=args.requests, p=np.asarray(table.context_probs) /
                          np.sum(table.context_probs))
    queries = rng.integers(table.n_queries, size=args.requests)
    plan = [(names[c], f"Question {table.queries[q]}?") for c, q in zip(contexts, queries, strict=True)]
    q_index = {f"Question {q}?": i for i, q in enumerate(table.queries)}
    c_index = {n: i for i, n in enumerate(names)}
    p_index = {p: i for i, p in enumerate(table.prompts)}

    # exact utility (C, P, Q, N_max) per segment: task reward under each context plus its cost term
    cost = table.cost_matrix()
    n = np.arange(1, table.n_max + 1, dtype=np.float64)
    utilities = []
    for s in range(len(schedule.segments)):
        seg = schedule.table_at(table, s)
        exact = exact_reward(seg)
        reward = exact.reward[exact.rows(seg.n_contexts)]  # (C, P, Q, N_max)
        if table.aggregator == "mv":  # the credit, times the objective weight
            reward = reward * weights[:, :1, None, None]
        utilities.append(reward + weights[:, -1][:, None, None, None] * cost[None, :, :, None] * n)
    oracle = [u.mean(axis=2).reshape(len(names), -1).max(axis=1) for u in utilities]  # per segment (C,)

    results: dict[str, Any] = {"table": target, "requests": args.requests, "concurrency": args.concurrency,
                               "segments": starts, "explore_share": args.explore_share}
    for mode in ("frozen", "learn"):
        sim = start([*CLI, "simulate", target, "--port", str(sim_port), "--schedule", "drift", "--horizon",
                     str(args.requests), "--seed", str(args.seed)], sim_port, work / f"sim-{mode}.log")
        port = free_port()
        extra = ["--learn", "--explore-share", str(args.explore_share), "--log", str(work / "outcomes")] \
            if mode == "learn" else []
        serve = start([*CLI, "serve", str(work / "policy" / "policy.json"), "--upstream", str(spec), "--port",
                       str(port), "--seed", str(args.seed), "--max-concurrency", str(max(16, args.concurrency)),
                       *extra], port, work / f"serve-{mode}.log")
        began = time.perf_counter()
        try:
            answered = run_requests(port, plan, args.concurrency)
            health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30))
        finally:
            stop(serve)
            stop(sim)
        seconds = time.perf_counter() - began
        served = np.empty(len(answered))
        best = np.empty(len(answered))
        for t, a in enumerate(answered):
            seg = int(np.searchsorted(starts, t, side="right") - 1)
            c, p, q = c_index[a["context"]], p_index[a["prompt"]], q_index[a["query"]]
            served[t] = utilities[seg][c, p, q, int(a["n"]) - 1]
            best[t] = oracle[seg][c]
        results[mode] = {"served": served.tolist(), "oracle": best.tolist(), "seconds": seconds,
                         "learn": {k: v for k, v in health.get("learn", {}).items() if k != "contexts"}}

    blocks = range(0, args.requests, args.block)
    print(f"{target}: {args.requests} requests at concurrency {args.concurrency}; drift segments start at "
          f"requests {starts}")
    print(f"{'requests':>13} {'frozen':>8} {'learn':>8} {'oracle':>8}")
    for b in blocks:
        f = np.mean(results["frozen"]["served"][b:b + args.block])
        g = np.mean(results["learn"]["served"][b:b + args.block])
        o = np.mean(results["frozen"]["oracle"][b:b + args.block])
        print(f"{b:>6}-{b + args.block - 1:<6} {f:8.4f} {g:8.4f} {o:8.4f}")
    drift = starts[1] if len(starts) > 1 else args.requests
    window = slice(drift, min(args.requests, drift + 5000))
    opened = float(np.mean(np.subtract(results["frozen"]["oracle"], results["frozen"]["served"])[window]))
    left = float(np.mean(np.subtract(results["learn"]["oracle"], results["learn"]["served"])[window]))
    recovered = (opened - left) / opened if opened > 0 else float("nan")
    learn = results["learn"]["learn"]
    print(f"regret per request from the drift (request {drift}) over the next {window.stop - window.start}: frozen "
          f"{opened:.4f}, --learn {left:.4f} (recovered {recovered:.1%})")
    print(f"--learn explored {learn.get('explored')} of {learn.get('chosen')} requests (budget "
          f"{args.explore_share:.0%}); wall time frozen {results['frozen']['seconds']:.1f} s, learn "
          f"{results['learn']['seconds']:.1f} s")
    results["recovered"] = recovered
    if args.json:
        Path(args.json).write_text(json.dumps(results) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    os.environ.pop("OPENAI_BASE_URL", None)
    sys.exit(main())
