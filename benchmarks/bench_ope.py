"""Benchmark of ``iapo-gym evaluate-log`` on real logged traffic against exact values (docs/deploy.md,
"iapo-gym evaluate-log").

A Best-of-N table (default ``generated:bon_shape:1``: 7 contexts, 20 prompts, N up to 10) is learned by
``iapo-gym optimize``; the policy is served by ``iapo-gym serve --learn --explore-share S --log DIR`` in front of
``iapo-gym simulate`` (stationary), and R requests (default 20,000) go through it at concurrency C, each in a context
drawn from the table's context distribution and on a query drawn uniformly, from a seeded generator. The outcome log
that leaves is the logged traffic. Three candidate policy files are written, each the served policy with other arms
from the learner's candidate arms (every servable prompt with every N of the policy's contexts), so that
textbook IPS has support:

- ``served``: the policy file as served (the learner's greedy arm, mostly);
- ``cheaper``: in the policy's four most likely contexts the same prompt with the next smaller N of the policy's
  Ns (the same N where it is the smallest), elsewhere the policy's arm (the learner's uniform part gives each of
  its K = 20 x 10 arms 0.2 x 0.1 / 200 of the requests: a rarer context may see none, and then IPS has no
  estimate);
- ``best``: in each context the learner's candidate arm of the highest exact value.

Each is estimated with ``iapo_gym.ope.evaluate`` (what ``evaluate-log`` prints) and compared with its exact
value: per context the table's exact expected utility of the candidate's arm over the uniform query distribution,
E[max of N weighted scores] + cost_weight x N x unit cost (the unit cost the log's rows carry, the served policy's
``arm_estimates``), weighted by the logged context frequencies. Printed per candidate: the exact value, each
estimator's value and 95 % interval, whether the exact value is inside, and the DR / IPS interval width ratio.

DR uses the nested observation where ``iapo_gym.ope.logging_model`` determines the learner's distribution from
the log (each row's record of ``serve --learn``: the greedy arm, the contender and the uniform part over its K
candidate arms); a log of a learner that explores otherwise gets the general DR, and the ``evaluate-log``
report's last line says which.

The log is kept in ``--work`` (default ``results/ope-log``, untracked) and reused when it holds the requests already
(``--fresh`` regenerates it). Generating 20,000 requests through HTTP takes several minutes on two shared cores.

    .venv/bin/python benchmarks/bench_ope.py                   # the issue's size: 20,000 requests
    .venv/bin/python benchmarks/bench_ope.py --requests 2000 --work results/ope-small
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_learn import run_requests, start  # noqa: E402

from iapo_gym.exact import exact_reward  # noqa: E402
from iapo_gym.ope import evaluate  # noqa: E402
from iapo_gym.outcome_log import read_log  # noqa: E402
from iapo_gym.policyfile import PolicyFile, load_policy  # noqa: E402
from iapo_gym.seeding import derive_rng  # noqa: E402
from iapo_gym.tasks.generated import level_table  # noqa: E402
from tests.llm_server import free_port, stop  # noqa: E402

CLI = [sys.executable, "-m", "iapo_gym.cli"]


def make_log(work: Path, table: Any, family: str, level: int, args: argparse.Namespace) -> Path:
    """The outcome log of ``args.requests`` requests served by ``serve --learn`` in front of ``simulate``."""
    outcomes = work / "outcomes"
    target = f"generated:{family}:{level}"
    spec = work / "spec.json"
    sim_port = free_port()
    subprocess.run([*CLI, "simulate", target, "--port", str(sim_port), "--write-spec", str(spec)], check=True,
                   cwd=ROOT, capture_output=True)
    subprocess.run([*CLI, "data", "generate", family, "--levels", f"{level}:{level}", "--out", str(work / "tables")],
                   check=True, cwd=ROOT, capture_output=True)
    subprocess.run([*CLI, "optimize", str(work / "tables" / f"{family}-{level}.h5"), "--spec", str(spec), "--budget",
                    str(args.budget), "--seed", str(args.seed), "--out", str(work / "policy"), "--quiet"], check=True,
                   cwd=ROOT, capture_output=True)
    policy = json.loads((work / "policy" / "policy.json").read_text())
    names = [c["name"] for c in policy["contexts"]]
    rng = derive_rng(args.seed, "bench_ope", "requests")
    contexts = rng.choice(len(names), size=args.requests, p=np.asarray(table.context_probs) /
                          np.sum(table.context_probs))
    queries = rng.integers(table.n_queries, size=args.requests)
    plan = [(names[c], f"Question {table.queries[q]}?") for c, q in zip(contexts, queries, strict=True)]
    sim = start([*CLI, "simulate", target, "--port", str(sim_port), "--seed", str(args.seed)], sim_port,
                work / "sim.log")
    port = free_port()
    if outcomes.exists():
        for f in outcomes.iterdir():
            f.unlink()
    serve = start([*CLI, "serve", str(work / "policy" / "policy.json"), "--upstream", str(spec), "--port", str(port),
                   "--seed", str(args.seed), "--max-concurrency", str(max(16, args.concurrency)), "--learn",
                   "--explore-share", str(args.explore_share), "--log", str(outcomes), "--log-queries"], port,
                  work / "serve.log")
    began = time.perf_counter()
    try:
        run_requests(port, plan, args.concurrency)
    finally:
        stop(serve)
        stop(sim)
    print(f"logged {args.requests} requests in {time.perf_counter() - began:.0f} s")
    return outcomes


def candidates(policy: PolicyFile, utility: np.ndarray, prompts: list[str]) -> dict[str, PolicyFile]:
    """The three candidate policy files (module docstring); ``utility``: exact (C, P, N_max) per context and arm."""
    servable = sorted(p.id for p in policy.prompts if p.servable)
    ns = sorted({c.n for c in policy.contexts})
    cheaper, best = [], []
    frequent = sorted(range(len(policy.contexts)), key=lambda i: -policy.contexts[i].probability)[:4]
    for i, c in enumerate(policy.contexts):
        lower = [n for n in ns if n < c.n]
        cheaper.append(dataclasses.replace(c, n=lower[-1] if lower and i in frequent else c.n, value=None))
        arms = [(p, n) for p in servable for n in ns]
        p, n = max(arms, key=lambda a: utility[i, prompts.index(a[0]), a[1] - 1])
        best.append(dataclasses.replace(c, prompt=p, n=n, value=None))
    return {"served": policy, "cheaper": dataclasses.replace(policy, contexts=tuple(cheaper)),
            "best": dataclasses.replace(policy, contexts=tuple(best))}


def coverage(seeds: int, requests: int) -> dict[str, Any]:
    """Each estimator's interval coverage, mean error and the median DR / IPS width over ``seeds`` simulated logs of
    ``requests`` rows of ``tests/test_ope_nested.py``'s learner (its table, the logging rule of ``serve --learn``
    with its default uniform part, and three candidates)."""
    from iapo_gym.deploy.learn import DEFAULT_SPREAD
    from tests.test_ope_nested import CANDIDATES, _candidate, _exact, _simulate

    stats: dict[str, dict[str, list[float]]] = {k: {"ips": [], "snips": [], "dr": [], "ratio": [], "err": []}
                                                for k in CANDIDATES}
    for seed in range(seeds):
        rows = _simulate(requests, 10_000 + seed, directed=True, spread=DEFAULT_SPREAD)
        for name, arms in CANDIDATES.items():
            _, overall, _ = evaluate(rows, _candidate(arms))
            true = _exact(arms, rows)
            s = stats[name]
            for label in ("ips", "snips", "dr"):
                e = getattr(overall, label)
                s[label].append(math.nan if e is None else float(e.covers(true)))
            s["err"].append(math.nan if overall.dr is None else overall.dr.value - true)
            if overall.ips is not None and overall.dr is not None:
                s["ratio"].append((overall.dr.high - overall.dr.low) / (overall.ips.high - overall.ips.low))
    print(f"{seeds} simulated logs of {requests} requests (tests/test_ope_nested.py's learner): the share of logs "
          "whose 95 % interval holds the exact value (of those with an estimate), DR's mean error, median DR/IPS width")
    print(f"{'candidate':<9} {'IPS':>10} {'SNIPS':>10} {'DR':>10} {'DR error':>18} {'DR/IPS':>7}")
    for name, s in stats.items():
        def share(v: list[float]) -> str:
            a = np.asarray(v)
            a = a[~np.isnan(a)]
            return f"{a.mean():.1%} ({a.size})" if a.size else "-"
        err = np.asarray(s["err"])
        err = err[~np.isnan(err)]
        print(f"{name:<9} {share(s['ips']):>10} {share(s['snips']):>10} {share(s['dr']):>10} "
              f"{err.mean():+.4f} +- {err.std(ddof=1) / math.sqrt(err.size):.4f} {np.median(s['ratio']):7.3f}")
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="bon_shape")
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--requests", type=int, default=20000, help="logged requests (default 20000)")
    ap.add_argument("--concurrency", type=int, default=16, help="callers at once (default 16)")
    ap.add_argument("--explore-share", type=float, default=0.2, help="serve --learn --explore-share (default 0.2)")
    ap.add_argument("--budget", type=int, default=2000, help="optimize's training budget (completions)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=str(ROOT / "results" / "ope-log"), help="folder of the log and the policies")
    ap.add_argument("--fresh", action="store_true", help="regenerate the log even when one is there")
    ap.add_argument("--json", help="write the figures as JSON to this file")
    ap.add_argument("--coverage", type=int, metavar="SEEDS",
                    help="instead: the intervals' coverage over SEEDS simulated logs of --requests rows each")
    args = ap.parse_args()
    if args.coverage:
        stats = coverage(args.coverage, args.requests)
        if args.json:
            Path(args.json).write_text(json.dumps(stats) + "\n", encoding="utf-8")
        return 0

    table = level_table(args.family, args.level)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    outcomes = work / "outcomes"
    have = 0
    if outcomes.exists() and not args.fresh:
        try:
            have = sum(1 for _ in read_log(outcomes)[1])
        except Exception:  # noqa: BLE001 (no usable log: make one)
            have = 0
    if have < args.requests:
        make_log(work, table, args.family, args.level, args)
    _, rows_iter = read_log(outcomes)
    rows = list(rows_iter)
    policy = load_policy(work / "policy" / "policy.json")
    prompts = [str(p) for p in table.prompts]
    unit = {str(e["id"]): float(e["cost"]) for e in (policy.arm_estimates or {}).get("prompts", ())}
    # exact expected utility per (context, prompt, N), over the uniform query distribution, in the log's cost unit
    exact = exact_reward(table)
    reward = exact.reward[exact.rows(table.n_contexts)].mean(axis=2)  # (C, P, N_max)
    n = np.arange(1, table.n_max + 1, dtype=np.float64)
    cost_unit = np.array([unit.get(p, 0.0) for p in prompts])
    weights = np.array([[*c.objective_weights, c.cost_weight] for c in policy.contexts])
    assert np.allclose(weights, table.context_weights), "the policy's contexts are the table's, in its order"
    utility = reward + weights[:, -1][:, None, None] * cost_unit[None, :, None] * n[None, None, :]
    names = [c.name for c in policy.contexts]
    freq = np.array([sum(r.context == name for r in rows) for name in names], dtype=np.float64) / len(rows)
    explored = sum(bool((r.outcomes.get("learn") or {}).get("explored")) for r in rows)
    print(f"generated:{args.family}:{args.level}: {len(rows)} logged requests, {explored} explored "
          f"({explored / len(rows):.1%}; --explore-share {args.explore_share})")
    print(f"{'candidate':<9} {'exact':>8}  {'IPS':<27} {'SNIPS':<27} {'DR':<27} {'in DR':>5} {'DR/IPS':>7}")
    out: dict[str, Any] = {"table": f"generated:{args.family}:{args.level}", "requests": len(rows),
                           "explored": explored, "candidates": {}}
    for label, cand in candidates(policy, utility, prompts).items():
        per = np.array([utility[i, prompts.index(c.prompt), c.n - 1] for i, c in enumerate(cand.contexts)])
        true = float(freq @ per)
        began = time.perf_counter()
        _, overall, _ = evaluate(rows, cand)
        seconds = time.perf_counter() - began

        def cell(e: Any) -> str:
            return "no support" if e is None else f"{e.value:.4f} [{e.low:.4f}, {e.high:.4f}]"
        ratio = float("nan")
        if overall.dr is not None and overall.ips is not None:
            ratio = (overall.dr.high - overall.dr.low) / (overall.ips.high - overall.ips.low)
        inside = overall.dr is not None and overall.dr.covers(true)
        print(f"{label:<9} {true:8.4f}  {cell(overall.ips):<27} {cell(overall.snips):<27} {cell(overall.dr):<27} "
              f"{'yes' if inside else 'no':>5} {ratio:7.3f}   ({seconds:.2f} s)")
        out["candidates"][label] = {"exact": true, "ratio": ratio, "dr_covers": inside,
                                    **{k: None if getattr(overall, k) is None else getattr(overall, k).to_dict()
                                       for k in ("ips", "snips", "dr", "logged")}}
        (work / f"candidate-{label}.json").write_text(cand.to_json(), encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    os.environ.pop("OPENAI_BASE_URL", None)
    sys.exit(main())
