"""Time the paper's full evaluation protocol on this machine, or a fraction of it and extrapolate.

The full protocol: every task whose table is present, the paper's 10 agents, budgets 3K..40K,
200 runs. Units are (task, run), so the wall time grows linearly in the number of runs and
``--runs 10`` extrapolates (x 200 / 10); the goal is under 60 minutes on 2 cores.

    .venv/bin/python benchmarks/bench_leaderboard.py --runs 10 --jobs 2          # ~1/20th, extrapolated
    .venv/bin/python benchmarks/bench_leaderboard.py --runs 200 --jobs 2 --out results/paper   # the real thing

A fresh output directory is used unless ``--out`` names one (an existing one is resumed,
which makes the timing meaningless: the script refuses unless ``--resume``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from iapo_gym.leaderboard.run.runner import run_sweep
from iapo_gym.leaderboard.run.specs import PAPER_AGENTS, PAPER_BUDGETS, PAPER_RUNS, parse_agent_spec, resolve_task, task_available
from iapo_gym.leaderboard.run.store import ResultStore
from iapo_gym.tasks import TASKS


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, print wall time, the extrapolation to the paper's 200 runs, and where time went."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs to execute (default 10; the paper: 200)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), help="default: every task whose table is present")
    parser.add_argument("--agents", nargs="+", default=list(PAPER_AGENTS), help="default: the paper's ten agents")
    parser.add_argument("--budgets", nargs="+", type=int, default=list(PAPER_BUDGETS))
    parser.add_argument("--out", help="results directory (default: a fresh temporary one)")
    parser.add_argument("--resume", action="store_true", help="allow an --out that already holds results")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    tasks = [resolve_task(t) for t in args.tasks]
    present = [t for t in tasks if task_available(t) is None]
    for t in tasks:
        if t not in present:
            print(task_available(t), file=sys.stderr)
    agents = [parse_agent_spec(a) for a in args.agents]
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="iapo-bench-"))
    if args.out and (out / "results.sqlite").exists() and not args.resume:
        parser.error(f"{out} already holds results; pass --resume or another --out")

    start = time.perf_counter()
    summary = run_sweep(out, present, agents, args.budgets, args.runs, jobs=args.jobs)
    wall = time.perf_counter() - start
    with ResultStore(out, create=False) as store:
        rows = store.results()
    per_task: dict[str, float] = defaultdict(float)
    per_agent: dict[str, float] = defaultdict(float)
    for r in rows:
        per_task[r.task] += r.train_seconds
        per_agent[r.label] += r.train_seconds
    n_rows = len(present) * len(agents) * len(args.budgets) * args.runs
    scale = PAPER_RUNS / args.runs
    figures = {
        "tasks": [t.name for t in present], "agents": len(agents), "budgets": args.budgets, "runs": args.runs,
        "jobs": args.jobs, "rows": n_rows, "added": summary.added, "failed": len(summary.failures),
        "wall_seconds": round(wall, 1), "seconds_per_run_row": round(wall * args.jobs / max(1, n_rows), 4),
        "extrapolated_wall_minutes_200_runs": round(wall * scale / 60, 1),
        "training_seconds_by_task": {k: round(v, 1) for k, v in sorted(per_task.items())},
        "training_seconds_by_agent": {k: round(v, 1) for k, v in sorted(per_agent.items(), key=lambda kv: -kv[1])},
        "out": str(out),
    }
    print(json.dumps(figures, indent=1))
    print(f"\n{n_rows} runs in {wall:.1f} s wall on {args.jobs} worker(s); the paper's {PAPER_RUNS} runs "
          f"would take about {wall * scale / 60:.1f} min (goal: < 60 min on 2 cores).")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
