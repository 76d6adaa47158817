"""Benchmark of ``serve --learn`` against a drifting simulated upstream (docs/deploy.md, "Learning while serving").

A table (default ``generated:bon_flat:1``, a tuning level; ``--level 1000001`` is held out) is learned by
``iapo-gym optimize`` (stationary, the table as it is), then served twice, each time in front of a fresh
``iapo-gym simulate TABLE --schedule drift --horizon R``: frozen (plain ``serve``) and learning (``serve --learn
--log``). R requests go through each at concurrency C, each in a context drawn from the table's context
distribution and on a query drawn uniformly, both from a seeded generator, so both servers get the same request
sequence. Every answered request is valued exactly from the table: the expected utility of the served arm (p, N) on
its query and in its context, E[max of N weighted scores] + cost_weight x N x cost(p, q), under the table of the
drift segment the request falls in. The segment is taken from the order in which the answers came back, which is
the simulator's numbering up to the C requests in flight (the simulator numbers a request when it answers it; a
Best-of-N context without a stopping rule is one simulator request).

``--frozen-from-table`` values the frozen policy without serving it: its own arm for each planned request, the
drift segment by the request's place in the plan (serving it changes only which of the requests in flight at a
segment's start fall on either side).

Printed per block of 1,000 requests (or ``--block``): the mean exact utility served, frozen and learning, and the
oracle's (the best arm per context and segment); then the regret the drift opened for the frozen policy and the share
of it ``--learn`` recovered, over the 5,000 requests from the drift's first segment and over the last 1,000 of
them, and the exploration share against its budget.

``--new-prompt``: no drift; the policy is learned on the table without the prompt the table rates best in the most
contexts, and the upstream (``simulate``, stationary) serves every prompt of its spec, which ``serve`` is given:
printed is in how many of the contexts where that prompt is best ``--learn``'s greedy arm uses it at the end, the
share of their requests in the last quarter it served, and how far each context's final greedy arm is from the best.

Run small (the default: 2,000 requests at concurrency 4, a few minutes on two shared cores):
``.venv/bin/python benchmarks/bench_learn.py``; the issue's size on the held-out level:
``.venv/bin/python benchmarks/bench_learn.py --level 1000001 --requests 20000 --concurrency 16 --block 1000``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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
from iapo_gym.tables import write_table  # noqa: E402
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


def serve_plan(args: argparse.Namespace, mode: str, target: str, sim_port: int, schedule: list[str], spec: Path,
               work: Path, plan: list[tuple[str, str]]) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
    """``plan`` sent to a fresh simulator and serve (``--learn`` for mode ``learn``): the answers in arrival order,
    serve's ``/health`` after them and the seconds it took; both processes are stopped whatever happens."""
    sim = start([*CLI, "simulate", target, "--port", str(sim_port), *schedule, "--seed", str(args.seed)], sim_port,
                work / f"sim-{mode}.log")
    serve = None
    try:
        port = free_port()
        extra = ["--learn", "--explore-share", str(args.explore_share), "--log", str(work / "outcomes")] \
            if mode == "learn" else []
        serve = start([*CLI, "serve", str(work / "policy" / "policy.json"), "--upstream", str(spec), "--port",
                       str(port), "--seed", str(args.seed), "--max-concurrency", str(max(16, args.concurrency)),
                       *extra], port, work / f"serve-{mode}.log")
        began = time.perf_counter()
        answered = run_requests(port, plan, args.concurrency)
        health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30))
        return answered, health, time.perf_counter() - began
    finally:
        if serve is not None:
            stop(serve)
        stop(sim)


def without_prompt(table: Any, spec: dict[str, Any], prompt: str) -> tuple[Any, dict[str, Any]]:
    """The table and the spec document without ``prompt`` (what the policy is learned on in ``--new-prompt``)."""
    keep = [i for i, p in enumerate(table.prompts) if p != prompt]
    changes: dict[str, Any] = {"prompts": tuple(table.prompts[i] for i in keep), "probs": table.probs[keep],
                               "cost": table.cost[keep]}
    if getattr(table, "atoms", None) is not None:
        changes["atoms"] = table.atoms[keep]
    reduced = dataclasses.replace(table, **changes)
    doc = dict(spec, prompts=[p for p in spec["prompts"] if p["id"] != prompt])
    return reduced, doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="bon_flat")
    ap.add_argument("--level", type=int, default=1, help="the generated level (default 1, a tuning level; held out: "
                                                         ">= 1000000)")
    ap.add_argument("--requests", type=int, default=2000, help="requests per server (default 2000; the issue: 20000)")
    ap.add_argument("--concurrency", type=int, default=4, help="callers at once (default 4; the issue: 16)")
    ap.add_argument("--block", type=int, default=200, help="requests per reported block (default 200)")
    ap.add_argument("--explore-share", type=float, default=0.05)
    ap.add_argument("--budget", type=int, default=2000, help="optimize's training budget (completions)")
    ap.add_argument("--new-prompt", action="store_true",
                    help="instead of a drift: the policy is learned without the prompt the table rates best in the "
                         "most contexts, the upstream (stationary) serves it; report where --learn adopts it")
    ap.add_argument("--frozen-from-table", action="store_true",
                    help="value the frozen policy from the table (its arm for each planned request, the segment by "
                         "the request's place in the plan) instead of serving it: half the wall time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures as JSON to this file")
    args = ap.parse_args()

    table = level_table(args.family, args.level)
    schedule = build_schedule("stationary" if args.new_prompt else "drift", table, args.requests)
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

    # exact utility (C, P, Q, N_max) per segment: task reward under each context plus its cost term
    weights = np.asarray(table.context_weights, dtype=np.float64)  # (C, objectives + cost weight)
    cost = table.cost_matrix()
    n = np.arange(1, table.n_max + 1, dtype=np.float64)
    utilities = []
    for s in range(len(schedule.segments)):
        drifted = schedule.table_at(table, s)
        exact = exact_reward(drifted)
        reward = exact.reward[exact.rows(drifted.n_contexts)]  # (C, P, Q, N_max)
        if table.aggregator == "mv":  # the credit, times the objective weight
            reward = reward * weights[:, :1, None, None]
        utilities.append(reward + weights[:, -1][:, None, None, None] * cost[None, :, :, None] * n)
    means = [u.mean(axis=2) for u in utilities]  # per segment (C, P, N_max)
    oracle = [m.reshape(len(weights), -1).max(axis=1) for m in means]  # per segment (C,)
    best_prompt = [int(np.argmax(m.max(axis=2)[c])) for m in means[-1:] for c in range(len(weights))]

    new_prompt = None
    optimize_spec, optimize_table = spec, table_file
    if args.new_prompt:  # withhold the prompt that is best in the most contexts from the policy
        new_prompt = table.prompts[int(np.bincount(best_prompt, minlength=table.n_prompts).argmax())]
        reduced, doc = without_prompt(table, json.loads(spec.read_text()), new_prompt)
        optimize_table = write_table(reduced, work / "reduced.h5")
        optimize_spec = work / "reduced-spec.json"
        optimize_spec.write_text(json.dumps(doc), encoding="utf-8")
    subprocess.run([*CLI, "optimize", str(optimize_table), "--spec", str(optimize_spec), "--budget", str(args.budget),
                    "--seed", str(args.seed), "--out", str(work / "policy"), "--quiet"], check=True, cwd=ROOT,
                   capture_output=True)
    policy = json.loads((work / "policy" / "policy.json").read_text())
    names = [c["name"] for c in policy["contexts"]]
    policy_weights = np.array([[*c["objective_weights"], c["cost_weight"]] for c in policy["contexts"]])
    assert np.allclose(policy_weights, table.context_weights), "the policy's contexts are the table's, in its order"
    rng = derive_rng(args.seed, "bench_learn", "requests")
    contexts = rng.choice(len(names), size=args.requests, p=np.asarray(table.context_probs) /
                          np.sum(table.context_probs))
    queries = rng.integers(table.n_queries, size=args.requests)
    plan = [(names[c], f"Question {table.queries[q]}?") for c, q in zip(contexts, queries, strict=True)]
    q_index = {f"Question {q}?": i for i, q in enumerate(table.queries)}
    c_index = {n: i for i, n in enumerate(names)}
    p_index = {p: i for i, p in enumerate(table.prompts)}

    results: dict[str, Any] = {"table": target, "requests": args.requests, "concurrency": args.concurrency,
                               "segments": starts, "explore_share": args.explore_share, "new_prompt": new_prompt}
    sim_schedule = [] if args.new_prompt else ["--schedule", "drift", "--horizon", str(args.requests)]
    for mode in ("frozen", "learn"):
        if mode == "frozen" and args.frozen_from_table:  # the policy's own arm for every planned request, in order
            own = {c["name"]: {"prompt": c["prompt"], "n": c["n"]} for c in policy["contexts"]}
            answered = [{"context": name, "query": query, **own[name]} for name, query in plan]
            health: dict[str, Any] = {}
            seconds = 0.0
        else:
            answered, health, seconds = serve_plan(args, mode, target, sim_port, sim_schedule, spec, work, plan)
        served = np.empty(len(answered))
        best = np.empty(len(answered))
        arms = []
        for t, a in enumerate(answered):
            seg = int(np.searchsorted(starts, t, side="right") - 1)
            c, p, q = c_index[a["context"]], p_index[a["prompt"]], q_index[a["query"]]
            served[t] = utilities[seg][c, p, q, int(a["n"]) - 1]
            best[t] = oracle[seg][c]
            arms.append([a["context"], a["prompt"], int(a["n"])])
        results[mode] = {"served": served.tolist(), "oracle": best.tolist(), "seconds": seconds, "arms": arms,
                         "learn": health.get("learn", {})}

    blocks = range(0, args.requests, args.block)
    what = f"the policy learned without prompt {new_prompt}" if new_prompt else \
        f"drift segments start at requests {starts}"
    print(f"{target}: {args.requests} requests at concurrency {args.concurrency}; {what}")
    print(f"{'requests':>13} {'frozen':>8} {'learn':>8} {'oracle':>8}   (mean exact utility served)")
    for b in blocks:
        f = np.mean(results["frozen"]["served"][b:b + args.block])
        g = np.mean(results["learn"]["served"][b:b + args.block])
        o = np.mean(results["frozen"]["oracle"][b:b + args.block])
        print(f"{b:>6}-{b + args.block - 1:<6} {f:8.4f} {g:8.4f} {o:8.4f}")
    learn = results["learn"]["learn"]
    chosen, explored = int(learn.get("chosen", 0)), int(learn.get("explored", 0))
    within = explored <= math.floor(args.explore_share * chosen + 1e-9)
    regret = {m: np.subtract(results[m]["oracle"], results[m]["served"]) for m in ("frozen", "learn")}
    if new_prompt is None:
        drift = starts[1] if len(starts) > 1 else args.requests
        window = slice(drift, min(args.requests, drift + 5000))
        last = slice(max(drift, window.stop - 1000), window.stop)
        opened, left = float(np.mean(regret["frozen"][window])), float(np.mean(regret["learn"][window]))
        recovered = (opened - left) / opened if opened > 0 else float("nan")
        opened_last, left_last = float(np.mean(regret["frozen"][last])), float(np.mean(regret["learn"][last]))
        recovered_last = (opened_last - left_last) / opened_last if opened_last > 0 else float("nan")
        print(f"regret per request over the {window.stop - window.start} requests from the drift (request {drift}): "
              f"frozen {opened:.4f}, --learn {left:.4f} (recovered {recovered:.1%})")
        print(f"regret per request over requests {last.start}-{last.stop - 1} (the last 1,000 of them): frozen "
              f"{opened_last:.4f}, --learn {left_last:.4f} (recovered {recovered_last:.1%})")
        results.update(recovered=recovered, recovered_last=recovered_last, opened=opened, left=left)
    else:
        j = p_index[new_prompt]
        best_there = [names[c] for c in range(len(names)) if best_prompt[c] == j]
        greedy = {name: state["greedy"][0] for name, state in learn.get("contexts", {}).items()}
        adopted = [name for name in best_there if greedy.get(name) == new_prompt]
        elsewhere = [name for name in names if name not in best_there and greedy.get(name) == new_prompt]
        tail = slice(args.requests * 3 // 4, args.requests)
        arms = results["learn"]["arms"][tail]
        share = np.mean([a[1] == new_prompt for a in arms if a[0] in best_there]) if best_there else float("nan")
        print(f"new prompt {new_prompt}: the table rates it best in {len(best_there)} of {len(names)} contexts; "
              f"--learn's greedy arm uses it at the end in {len(adopted)} of them (and in {len(elsewhere)} other "
              f"contexts); share of their requests it served in the last quarter: {share:.1%}")
        final = {name: state["greedy"] for name, state in learn.get("contexts", {}).items()}
        gaps = [float(oracle[-1][c_index[name]] - means[-1][c_index[name], p_index[p], n - 1])
                for name, (p, n) in final.items()]
        print(f"--learn's greedy arms at the end: exact regret per context mean {np.mean(gaps):.4f}, largest "
              f"{np.max(gaps):.4f} (the frozen policy's: mean {np.mean(regret['frozen']):.4f} per request)")
        results.update(new_prompt_best=best_there, adopted=adopted, adopted_elsewhere=elsewhere,
                       served_share_last_quarter=float(share), greedy_gaps=gaps)
    print(f"--learn explored {explored} of {chosen} requests ({explored / max(1, chosen):.2%}; budget "
          f"{args.explore_share:.0%}: floor({args.explore_share} x {chosen}) = "
          f"{math.floor(args.explore_share * chosen + 1e-9)}, {'within' if within else 'EXCEEDED'}); "
          f"total utility per 1,000 requests: frozen {1000 * np.mean(results['frozen']['served']):.2f}, --learn "
          f"{1000 * np.mean(results['learn']['served']):.2f}; wall time frozen {results['frozen']['seconds']:.1f} s, "
          f"learn {results['learn']['seconds']:.1f} s")
    results["within_budget"] = within
    if args.json:
        Path(args.json).write_text(json.dumps(results) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    os.environ.pop("OPENAI_BASE_URL", None)
    sys.exit(main())
