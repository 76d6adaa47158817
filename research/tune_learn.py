"""The learner of ``serve --learn`` driven in-process against tables' drift schedules: how its hyper-parameters
(``--learn-half-life``, ``--learn-bonus``, ``--explore-share``, ``--learn-prior``, ``--learn-spread``) were
chosen (docs/deploy.md, "Learning while serving").

``benchmarks/bench_learn.py`` measures the real thing (``serve`` in front of ``simulate``) and takes minutes per
thousand requests; this drives ``ServeLearner`` directly, without HTTP, in seconds per level: per generated level,
the policy ``iapo-gym optimize`` learns on the table, the same seeded request sequence as ``bench_learn.py``
(contexts by the table's distribution, queries uniform), each request's completions drawn from the table of its
drift segment and learned from ``--lag`` requests late (the requests in flight at concurrency 16), every served arm
valued exactly. Printed per level: the regret per request the drift opened for the frozen policy over the 5,000
requests from the drift, the share of it the learner recovered, the learner's regret before the drift beyond the
frozen policy's, and the share of requests explored. Choose on tuning levels (< 10,000) only.

``.venv/bin/python research/tune_learn.py --levels 1,3,4,6,7`` (about a minute);
``--half-life 1500 --bonus 2 --spread 0.1`` etc. set the learner's options.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from iapo_gym.deploy.learn import (  # noqa: E402
    DEFAULT_BONUS,
    DEFAULT_EXPLORE_SHARE,
    DEFAULT_HALF_LIFE,
    DEFAULT_PRIOR_WEIGHT,
    DEFAULT_SPREAD,
    ServeLearner,
)
from iapo_gym.deploy.router import Routed  # noqa: E402
from iapo_gym.exact import exact_reward  # noqa: E402
from iapo_gym.llm.client import Completion  # noqa: E402
from iapo_gym.online.schedule import build_schedule  # noqa: E402
from iapo_gym.policyfile import load_policy  # noqa: E402
from iapo_gym.seeding import derive_rng  # noqa: E402
from iapo_gym.tasks.generated import level_table  # noqa: E402

CLI = [sys.executable, "-m", "iapo_gym.cli"]


def learned_policy(family: str, level: int, budget: int, seed: int, work: Path) -> Path:
    """``iapo-gym optimize``'s policy of the level (as ``bench_learn.py`` learns it)."""
    spec = work / "spec.json"
    run: dict[str, Any] = {"check": True, "cwd": ROOT, "capture_output": True}
    subprocess.run([*CLI, "simulate", f"generated:{family}:{level}", "--port", "9", "--write-spec", str(spec)], **run)
    subprocess.run([*CLI, "data", "generate", family, "--levels", f"{level}:{level}", "--out", str(work)], **run)
    subprocess.run([*CLI, "optimize", str(work / f"{family}-{level}.h5"), "--spec", str(spec), "--budget",
                    str(budget), "--seed", str(seed), "--out", str(work / "policy"), "--quiet"], **run)
    return work / "policy" / "policy.json"


def run_level(family: str, level: int, args: argparse.Namespace, work: Path) -> dict[str, float]:
    """The frozen policy and the learner on one level's drift schedule: their exact regrets per request."""
    table = level_table(family, level)
    if table.aggregator != "bon" or table.atoms is None:
        raise SystemExit(f"{family}:{level} is not a Best-of-N table (this driver draws score vectors)")
    schedule = build_schedule("drift", table, args.requests)
    starts = [s.start for s in schedule.segments]
    policy = load_policy(learned_policy(family, level, args.budget, args.seed, work))
    rng = derive_rng(args.seed, "bench_learn", "requests")
    probs = np.asarray(table.context_probs) / np.sum(table.context_probs)
    contexts = rng.choice(len(policy.contexts), size=args.requests, p=probs)
    queries = rng.integers(table.n_queries, size=args.requests)
    n = np.arange(1, table.n_max + 1, dtype=np.float64)
    cost = table.cost_matrix()
    tables, utilities = [], []
    for s in range(len(schedule.segments)):
        drifted = schedule.table_at(table, s)
        exact = exact_reward(drifted)
        reward = exact.reward[exact.rows(drifted.n_contexts)]
        tables.append(np.cumsum(drifted.probs, axis=2))
        utilities.append(reward + table.context_weights[:, -1][:, None, None, None] * cost[None, :, :, None] * n)
    oracle = [u.mean(axis=2).reshape(table.n_contexts, -1).max(axis=1) for u in utilities]
    index = {p: i for i, p in enumerate(table.prompts)}
    learner = ServeLearner(policy, explore_share=args.explore_share, seed=args.seed, prior_weight=args.prior,
                           half_life=args.half_life, bonus=args.bonus, spread=args.spread)
    draws = derive_rng(args.seed, "tune_learn", "draws")
    late: collections.deque[Routed] = collections.deque()
    frozen, learned = np.empty(args.requests), np.empty(args.requests)
    for t in range(args.requests):
        seg = int(np.searchsorted(starts, t, side="right") - 1)
        c, q = int(contexts[t]), int(queries[t])
        ctx = policy.contexts[c]
        frozen[t] = oracle[seg][c] - utilities[seg][c, index[ctx.prompt], q, ctx.n - 1]
        choice = learner.choose(ctx)
        assert choice is not None
        ctx = choice.context
        p = index[ctx.prompt]
        learned[t] = oracle[seg][c] - utilities[seg][c, p, q, ctx.n - 1]
        cdf = tables[seg][p, q]
        atoms = np.minimum(np.searchsorted(cdf, draws.random(ctx.n) * cdf[-1], side="right"), table.n_atoms - 1)
        vectors = table.atoms[p, q, atoms]
        weighted = vectors @ np.asarray(ctx.objective_weights)
        chosen = int(np.argmax(weighted))
        completions = [Completion(f"completion {m}", 1, "stop") for m in atoms]
        late.append(Routed(completions[chosen].text, "stop", chosen, ctx, ctx.prompt, completions,
                           scores=[float(w) for w in weighted],
                           objective_scores=[dict(zip(table.objective_names, map(float, v), strict=True))
                                             for v in vectors]))
        if len(late) > args.lag:
            learner.observe(f"r{t}", late.popleft())
    drift = starts[1] if len(starts) > 1 else args.requests
    window = slice(drift, min(args.requests, drift + 5000))
    opened, left = float(frozen[window].mean()), float(learned[window].mean())
    return {"level": level, "drift": drift, "opened": opened, "left": left,
            "recovered": (opened - left) / opened if opened > 0 else float("nan"),
            "before": float(learned[:drift].mean() - frozen[:drift].mean()),
            "explored": learner.explored / max(1, learner.chosen)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="bon_flat")
    ap.add_argument("--levels", default="1,3,4,6,7", help="comma-separated generated levels (tuning: < 10000)")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--lag", type=int, default=16, help="requests between a choice and its outcome (default 16)")
    ap.add_argument("--budget", type=int, default=2000, help="optimize's training budget (completions)")
    ap.add_argument("--explore-share", type=float, default=DEFAULT_EXPLORE_SHARE)
    ap.add_argument("--prior", type=float, default=DEFAULT_PRIOR_WEIGHT)
    ap.add_argument("--half-life", type=float, default=DEFAULT_HALF_LIFE)
    ap.add_argument("--bonus", type=float, default=DEFAULT_BONUS)
    ap.add_argument("--spread", type=float, default=DEFAULT_SPREAD)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = []
    for level in (int(x) for x in args.levels.split(",")):
        with tempfile.TemporaryDirectory(prefix="iapo-tune-learn-") as work:
            rows.append(run_level(args.family, level, args, Path(work)))
        r = rows[-1]
        print(f"{args.family}:{level}: drift at {r['drift']}; regret over 5,000 requests from it: frozen "
              f"{r['opened']:.4f}, learner {r['left']:.4f} (recovered {r['recovered']:.1%}); before it the learner "
              f"{r['before']:+.4f} per request beside frozen; explored {r['explored']:.2%}", flush=True)
    print(f"mean recovered {np.nanmean([r['recovered'] for r in rows]):.1%} over {len(rows)} levels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
