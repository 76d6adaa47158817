"""Tuning screen of the recommended online agent (``iapo_online``, docs/online.md): mean cumulative exact regret at T
of each hyper-parameter setting on tuning levels only (level ids < 10,000, never held-out), every family, each
schedule asked for, a few runs, through the public ``make_online`` and ``run_online``.

    .venv/bin/python research/tune_online.py --grid width=0.3,0.5 memory=100,200,inf \\
        --schedules stationary,drift --levels 0 1 --horizon 10000

Every combination of the grid's values is run (the other hyper-parameters at their defaults, or ``--fixed``); each
line printed is one setting's mean over (family, level, run) per schedule, and over all of them.
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Any

import numpy as np

from agents.online import make_online
from iapo_gym.online import OnlineEnv, run_online
from iapo_gym.tasks.generated import TUNING_LEVELS, families


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """``name=v1,v2`` items as {name: [values]} (ints stay ints, the rest floats)."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        name, _, values = item.partition("=")
        if not values:
            raise SystemExit(f"a grid item is NAME=V1,V2,..., got {item!r}")
        grid[name] = [int(v) if v.lstrip("-").isdigit() else float(v) for v in values.split(",")]
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", nargs="+", default=[], help="NAME=V1,V2,... (every combination is run)")
    parser.add_argument("--fixed", nargs="*", default=[], help="NAME=V for every setting")
    parser.add_argument("--schedules", default="stationary,drift")
    parser.add_argument("--families", default=",".join(families()))
    parser.add_argument("--levels", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--horizon", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--agent", default="iapo_online", help="the make_online name to screen (a baseline: ucb, ...)")
    args = parser.parse_args()
    if any(not TUNING_LEVELS.start <= k < TUNING_LEVELS.stop for k in args.levels):
        raise SystemExit(f"tuning levels only: {TUNING_LEVELS.start}..{TUNING_LEVELS.stop - 1}")
    grid = parse_grid(args.grid)
    fixed = {k: v[0] for k, v in parse_grid(args.fixed).items()}
    settings = [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())] or [{}]
    schedules = args.schedules.split(",")
    envs = [(s, OnlineEnv(family=f, level=k, schedule=s, horizon=args.horizon))
            for s in schedules for f in args.families.split(",") for k in args.levels]
    start = time.perf_counter()
    for setting in settings:
        params = {**fixed, **setting}
        by_schedule: dict[str, list[float]] = {s: [] for s in schedules}
        for schedule, env in envs:
            for run in range(args.runs):
                result = run_online(env, make_online(args.agent, **params), seed=run, batch_size=args.batch_size)
                by_schedule[schedule].append(float(result.cumulative_regret[-1]))
        parts = " ".join(f"{s}={np.mean(v):.1f}" for s, v in by_schedule.items())
        overall = np.mean([x for v in by_schedule.values() for x in v])
        print(f"{args.agent} {params}: {parts} all={overall:.1f} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
