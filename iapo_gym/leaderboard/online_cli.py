"""``iapo-gym leaderboard --protocol online``: the options of the online protocol and its command.

The paper's protocol stays the default; ``leaderboard.cli`` calls ``leaderboard_online`` when ``--protocol online``
is given, and ``paper_refuses`` refuses the online options without it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iapo_gym.leaderboard.run.online import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_HORIZON,
    DEFAULT_ONLINE_RUNS,
    DEFAULT_SCHEDULES,
    PROTOCOLS,
)
from iapo_gym.leaderboard.run.specs import DEFAULT_TRAIN_FRACTION
from iapo_gym.leaderboard.sweep_cli import check_scheduler, run_sweep_command
from iapo_gym.online.schedule import SCHEDULES
from iapo_gym.tasks import TASKS

DEFAULT_ONLINE_OUT = "results/online"


def add_online_options(parser: argparse.ArgumentParser) -> None:
    """``--protocol``, ``--horizon``, ``--schedule`` and ``--batch-size`` on ``iapo-gym leaderboard``."""
    parser.add_argument("--protocol", choices=PROTOCOLS, default="paper",
                        help="paper (default): train with a budget, score the frozen policy's exact test ACR; online: "
                             "serve T requests while learning, score the exact cumulative regret (docs/online.md)")
    parser.add_argument("--horizon", nargs="+", type=int, metavar="T",
                        help=f"online: requests per run (default: {DEFAULT_HORIZON}); the regret curve is stored at "
                             "T/100, 2T/100, ..., T")
    parser.add_argument("--schedule", nargs="+", action="extend", choices=SCHEDULES, metavar="NAME",
                        help=f"online: schedules to run ({', '.join(SCHEDULES)}; default: "
                             f"{' '.join(DEFAULT_SCHEDULES)}); several allowed")
    parser.add_argument("--batch-size", type=int, metavar="B",
                        help=f"online: requests an agent chooses for before it sees their outcomes (default: "
                             f"{DEFAULT_BATCH_SIZE}); one per --out folder")


def paper_refuses(args: argparse.Namespace) -> str | None:
    """Why the paper protocol cannot take these options (an online option given without --protocol online)."""
    given = [name for name, value in (("--horizon", args.horizon), ("--schedule", args.schedule),
                                      ("--batch-size", args.batch_size)) if value is not None]
    if given:
        return f"{', '.join(given)} belong(s) to the online protocol; add --protocol online"
    return None


def _online_refuses(args: argparse.Namespace) -> str | None:
    given = [name for name, value in (("--budgets", args.budgets), ("--quick", args.quick or None),
                                      ("--rules", getattr(args, "rules", False) or None)) if value is not None]
    if args.train_fraction != DEFAULT_TRAIN_FRACTION:
        given.append("--train-fraction")
    if given:
        return (f"{', '.join(given)} belong(s) to the paper protocol; the online protocol takes --horizon, "
                "--schedule and --batch-size (docs/online.md)")
    return None


def leaderboard_online(args: argparse.Namespace) -> int:
    """Run (or continue) the online sweep of ``args``; print its table, write the report with ``--report``."""
    from agents.online import ONLINE_REGISTRY
    from iapo_gym.leaderboard.report.online import online_markdown, online_report
    from iapo_gym.leaderboard.report.write import write_report
    from iapo_gym.leaderboard.run.online import parse_online_spec, run_online_sweep
    from iapo_gym.leaderboard.run.specs import resolve_task

    refused = _online_refuses(args)
    if refused:
        print(f"iapo-gym leaderboard: error: {refused}", file=sys.stderr)
        return 2
    task_names = args.tasks or list(TASKS)
    agent_texts = (args.agents or ([] if args.agent else sorted(ONLINE_REGISTRY))) + args.agent
    runs = args.runs if args.runs is not None else DEFAULT_ONLINE_RUNS
    out = args.out or DEFAULT_ONLINE_OUT
    schedules = list(dict.fromkeys(args.schedule or DEFAULT_SCHEDULES))
    horizons = list(dict.fromkeys(args.horizon or [DEFAULT_HORIZON]))
    batch_size = args.batch_size if args.batch_size is not None else DEFAULT_BATCH_SIZE
    def sweep() -> tuple[Any, list[Any]]:
        tasks = [resolve_task(t) for t in task_names]
        agents = [parse_online_spec(a) for a in agent_texts]
        check_scheduler(args.scheduler)
        return run_online_sweep(out, tasks, agents, schedules, horizons, runs, jobs=args.jobs, root_seed=args.seed,
                                batch_size=batch_size, scheduler=args.scheduler), tasks

    def table(tasks: Sequence[Any]) -> str | None:
        report = online_report(out, args.test, args.correction, args.alpha, args.baseline,
                               tasks=[t.name for t in tasks])
        return online_markdown(report) if report is not None else None

    def write() -> dict[str, Path]:
        written: dict[str, Path] = write_report(out, test=args.test, correction=args.correction, alpha=args.alpha,
                                                baseline=args.baseline)
        return written

    return run_sweep_command(out, sweep, "online runs", None if args.no_table else table,
                             write if args.report else None)
