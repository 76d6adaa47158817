"""The leaderboard's commands: ``iapo-gym leaderboard`` (and ``leaderboard merge``), ``report``, ``bundle``, ``verify``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from iapo_gym.leaderboard.online_cli import add_online_options, leaderboard_online, paper_refuses
from iapo_gym.leaderboard.report import CORRECTIONS, DEFAULT_ALPHA, TESTS
from iapo_gym.leaderboard.run.specs import (
    DEFAULT_ROOT_SEED,
    DEFAULT_TRAIN_FRACTION,
    PAPER_AGENTS,
    PAPER_BUDGETS,
    PAPER_RUNS,
    parse_agent_spec,
    resolve_task,
)
from iapo_gym.leaderboard.sweep_cli import check_scheduler, run_sweep_command
from iapo_gym.tasks import TASKS


@dataclass(frozen=True)
class Preset:
    """Default tasks, agents, budgets and runs of a named sweep."""

    tasks: tuple[str, ...]
    agents: tuple[str, ...]
    budgets: tuple[int, ...]
    runs: int


#: ``--quick``: the README's main job (its measured time is in the README).
QUICK = Preset(
    tasks=("synthetic_bernoulli", "synthetic_categorical"),
    agents=("auto", "psst", "psst_topk:k=4,rho=0.2@psst+K4", "uniform", "ucb", "triple_n1"),
    budgets=(3000, 10000),
    runs=20,
)
PAPER = Preset(tuple(TASKS), PAPER_AGENTS, PAPER_BUDGETS, PAPER_RUNS)
DEFAULT_OUT = "results/leaderboard"


def _stats_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--test", choices=TESTS, default="wilcoxon", help="paired test (default: wilcoxon)")
    parser.add_argument("--correction", choices=CORRECTIONS, default="holm",
                        help="multiplicity correction within each (task, budget) (default: holm)")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="significance level (default: 0.05)")
    parser.add_argument("--baseline", metavar="LABEL",
                        help="online runs: the agent label every agent is paired against (default: etc_auto)")


def add_commands(subparsers: Any) -> None:
    """Add ``leaderboard``, ``report``, ``bundle`` and ``verify`` to the ``iapo-gym`` command line."""
    lb = subparsers.add_parser(
        "leaderboard", help="run the paper's evaluation protocol (resumable)",
        description="Train every agent on every task, budget and run (per run a seeded 80/20 resplit, or "
                    "instance r of a synthetic task), score the exact test ACR, and store one row per run in "
                    "OUT/results.sqlite. Rerunning the same command continues an interrupted sweep.",
        epilog="Agent specs: 'psst', 'psst_topk:k=4,rho=0.2', 'pkg.module:Class', 'pkg.module:Class:k=4'; "
               "append '@label' for a display label. Tasks: short names, titles, Gymnasium ids or their middle part "
               "(SyntheticBernoulli), release file stems (MATH_final), case-insensitive, .h5 table files, or generated "
               "levels: generated:FAMILY:A-B (one level per run, as many runs as levels) or generated:FAMILY:K "
               "(one level, resplit per run); see docs/tasks.md.")
    lb.add_argument("--tasks", nargs="+", metavar="TASK", help=f"default: all six ({', '.join(TASKS)}); "
                    "tasks whose table is missing are skipped")
    lb.add_argument("--agents", nargs="+", metavar="SPEC",
                    help="default: the paper's ten agents (online: every agents.online name). With --protocol "
                         "online a spec is an agents.online name or a module:Class[:k=v,...] implementing "
                         "iapo_gym.online.OnlineAgent, imported in every worker: a module outside an installed "
                         "package needs its folder on PYTHONPATH, e.g. the peers of docs/online.md: "
                         "PYTHONPATH=benchmarks ... --agent online_peers:VowpalWabbit@vw")
    lb.add_argument("--agent", action="append", default=[], metavar="SPEC", help="add one agent spec (repeatable)")
    lb.add_argument("--budgets", nargs="+", type=_budget_list, metavar="T",
                    help="training budgets, space- or comma-separated (`--budgets 1000 3000` or `--budgets 1000,3000`); "
                         f"default: {' '.join(map(str, PAPER_BUDGETS))}. (Commas inside one agent SPEC separate "
                         "its parameters; agent specs themselves are space-separated.)")
    lb.add_argument("--runs", type=int, help=f"independent runs per cell (default: {PAPER_RUNS})")
    lb.add_argument("--jobs", "-j", type=int, default=1, help="local worker processes (default: 1)")
    lb.add_argument("--scheduler", metavar="ADDR",
                    help="run on Dask distributed: a scheduler address tcp://host:port, or 'local' for a "
                         "LocalCluster of --jobs workers (needs `pip install \"dask[distributed]\"`)")
    lb.add_argument("--out", default=None, help=f"output directory (default: {DEFAULT_OUT}, or results/quick with --quick)")
    lb.add_argument("--seed", type=int, default=DEFAULT_ROOT_SEED,
                    help=f"root seed of every derived seed (default: {DEFAULT_ROOT_SEED})")
    lb.add_argument("--train-fraction", type=float, default=DEFAULT_TRAIN_FRACTION,
                    help=f"train share of each resplit (default: {DEFAULT_TRAIN_FRACTION})")
    lb.add_argument("--quick", action="store_true",
                    help=f"preset: tasks {' '.join(QUICK.tasks)}, agents {' '.join(QUICK.agents)}, "
                         f"budgets {' '.join(map(str, QUICK.budgets))}, {QUICK.runs} runs (explicit options win)")
    lb.add_argument("--rules", action="store_true",
                    help="the arm set is (prompt, N, stopping rule): agents train on envs with rule_arms=True and are "
                         "scored, with the optimum, over the stopping rules (docs/rules.md); one arm set per --out folder")
    add_online_options(lb)
    lb.add_argument("--no-table", action="store_true", help="do not print the leaderboard at the end")
    lb.add_argument("--report", action="store_true", help="also write the full report (iapo-gym report OUT)")
    _stats_options(lb)
    lb.set_defaults(func=_leaderboard)
    _add_merge_command(lb)

    rp = subparsers.add_parser("report", help="leaderboard tables, statistics and plots of a results directory",
                               description="Write OUT/report/{leaderboard.md, summary.csv, pairwise.csv, "
                                           "leaderboard.json, *.png} from OUT/results.sqlite.")
    rp.add_argument("dir", help="the --out directory of a leaderboard run")
    rp.add_argument("--report-dir", help="where to write (default: DIR/report)")
    rp.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    rp.add_argument("--quiet", action="store_true", help="do not print the leaderboard")
    rp.add_argument("--html", action="store_true",
                    help="also write the static site REPORT_DIR/site/index.html (opens from disk, no server)")
    _stats_options(rp)
    rp.set_defaults(func=_report)
    _add_submission_commands(subparsers)


def _budget_list(text: str) -> list[int]:
    """One --budgets token: an integer or a comma-separated list of integers."""
    try:
        return [int(part) for part in text.split(",") if part.strip()] or [int(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget {text!r} is not an integer or a comma-separated list of "
                                         "integers (e.g. 1000,3000)") from None


def _leaderboard(args: argparse.Namespace) -> int:
    from iapo_gym.leaderboard.report.model import build_report
    from iapo_gym.leaderboard.report.write import markdown, write_report
    from iapo_gym.leaderboard.run.runner import run_sweep

    if args.protocol == "online":
        return leaderboard_online(args)
    refused = paper_refuses(args)
    if refused:
        print(f"iapo-gym leaderboard: error: {refused}", file=sys.stderr)
        return 2
    preset = QUICK if args.quick else PAPER
    task_names = args.tasks or list(preset.tasks)
    agent_texts = (args.agents or ([] if args.agent else list(preset.agents))) + args.agent
    budgets = [t for group in args.budgets for t in group] if args.budgets else list(preset.budgets)
    runs = args.runs if args.runs is not None else preset.runs
    out = args.out or ("results/quick" if args.quick else DEFAULT_OUT)
    def sweep() -> tuple[Any, list[Any]]:
        tasks = [resolve_task(t) for t in task_names]
        agents = [parse_agent_spec(a) for a in agent_texts]
        check_scheduler(args.scheduler)
        return run_sweep(out, tasks, agents, budgets, runs, jobs=args.jobs, root_seed=args.seed,
                         train_fraction=args.train_fraction, scheduler=args.scheduler, rules=args.rules), tasks

    def table(tasks: Sequence[Any]) -> str | None:
        report = build_report(out, args.test, args.correction, args.alpha, tasks=[t.name for t in tasks])
        return markdown(report, policies=False) if report.results else None

    return run_sweep_command(
        out, sweep, "runs", None if args.no_table else table,
        (lambda: write_report(out, test=args.test, correction=args.correction, alpha=args.alpha)) if args.report
        else None)


def _report(args: argparse.Namespace) -> int:
    from iapo_gym.leaderboard.report.write import write_report

    try:
        written = write_report(args.dir, args.report_dir, plots=not args.no_plots, test=args.test,
                               correction=args.correction, alpha=args.alpha, html=args.html, baseline=args.baseline)
    except (FileNotFoundError, ValueError) as exc:
        print(f"iapo-gym report: error: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(written["markdown"].read_text())
        if "online_markdown" in written:
            print(written["online_markdown"].read_text())
    for kind, path in written.items():
        print(f"wrote {kind}: {path}", file=sys.stderr)
    return 0


# ---- submitting: bundle, verify, merge ------------------------------------------------------


def _add_submission_commands(subparsers: Any) -> None:
    """Add ``bundle`` and ``verify`` to the ``iapo-gym`` command line."""
    bd = subparsers.add_parser(
        "bundle", help="pack a results folder and its provenance into one file to submit",
        description="Write OUT_DIR's runs and their provenance (software versions, protocol, table digests, "
                    "agent source digests) into NAME.iapo.zip or NAME.iapo.tar.gz.")
    bd.add_argument("dir", metavar="OUT_DIR", help="the --out folder of a leaderboard run (or of a merge)")
    bd.add_argument("-o", "--output", required=True, metavar="FILE", help="the bundle to write (.zip or .tar.gz)")
    bd.set_defaults(func=_bundle)

    vf = subparsers.add_parser(
        "verify", help="re-run a random sample of a bundle's runs here and compare them exactly",
        description="Re-run K runs of BUNDLE chosen at random (seeded; the seed is printed and recorded) and "
                    "compare each exact test ACR bit for bit. Exits 1 on any mismatch, on a table whose digest "
                    "differs from the bundle's, or on an agent whose source differs. Writes BUNDLE.verify.json.")
    vf.add_argument("bundle", metavar="BUNDLE", help="a .iapo.zip or .iapo.tar.gz bundle")
    vf.add_argument("--sample", default="20", metavar="K|all", help="runs to re-run (default: 20; 'all': every run)")
    vf.add_argument("--seed", type=int, help="seed of the sample (default: drawn fresh, then printed)")
    vf.add_argument("--table", action="append", default=[], metavar="TASK=PATH",
                    help="the .h5 table file of a task that is not registered (repeatable)")
    vf.add_argument("--no-record", action="store_true", help="do not write BUNDLE.verify.json")
    vf.set_defaults(func=_verify)


def _add_merge_command(leaderboard_parser: argparse.ArgumentParser) -> None:
    """Add ``merge`` under ``iapo-gym leaderboard`` (the plain ``leaderboard`` options keep working)."""
    sub = leaderboard_parser.add_subparsers(dest="leaderboard_command", required=False, metavar="{merge}")
    mg = sub.add_parser(
        "merge", help="combine result folders and bundles into one results folder",
        description="Merge result folders and bundles (from several machines) into a new folder. Runs present "
                    "in several inputs are kept once after checking they agree exactly; disagreeing runs, "
                    "different tables or agent sources, and different protocol parameters are errors.")
    mg.add_argument("inputs", nargs="+", metavar="INPUT", help="result folders or bundle files")
    mg.add_argument("--out", required=True, help="the new results folder (must not exist or be empty)")
    mg.set_defaults(func=_merge)


def _bundle(args: argparse.Namespace) -> int:
    from iapo_gym.leaderboard.submit.bundle import BundleError, write_bundle

    try:
        path = write_bundle(args.dir, args.output)
    except (BundleError, FileNotFoundError, ValueError) as exc:
        print(f"iapo-gym bundle: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _parse_tables(items: list[str]) -> dict[str, str]:
    tables = {}
    for item in items:
        task, sep, path = item.partition("=")
        if not sep or not task or not path:
            raise ValueError(f"--table {item!r} must look like TASK=PATH.h5")
        tables[task] = path
    return tables


def _verify(args: argparse.Namespace) -> int:
    from iapo_gym.leaderboard.submit.bundle import BundleError
    from iapo_gym.leaderboard.submit.verify import verify_bundle, write_record

    try:
        sample = None if args.sample == "all" else int(args.sample)
    except ValueError:
        print(f"iapo-gym verify: error: --sample must be a positive integer or 'all', got {args.sample!r}",
              file=sys.stderr)
        return 2
    try:
        outcome = verify_bundle(args.bundle, sample, args.seed, _parse_tables(args.table))
    except (BundleError, ValueError, FileNotFoundError) as exc:
        print(f"iapo-gym verify: error: {exc}", file=sys.stderr)
        return 1
    print(f"{outcome.bundle}: re-running {outcome.sample} of {outcome.total} runs (sample seed {outcome.sample_seed})")
    for problem in outcome.agent_problems:
        print(f"AGENT SOURCE DIFFERS: {problem}")
    for problem in outcome.table_problems:
        print(f"TABLE PROBLEM: {problem}")
    for check in outcome.checks:
        acr = "-" if check.acr is None else repr(check.acr)
        mark = "match" if check.match else "MISMATCH"
        print(f"  {mark:8s} {check.run}: bundle {check.bundled_acr!r}, here {acr}" + (f" ({check.note})" if check.note else ""))
    for difference in outcome.stack_differences:
        print(f"NUMERIC STACK DIFFERS (may change the last bits): {difference}")
    matched = sum(c.match for c in outcome.checks)
    print(f"{outcome.status}: {matched} of {len(outcome.checks)} runs match exactly in {outcome.seconds:.1f} s")
    if not args.no_record:
        print(f"recorded in {write_record(args.bundle, outcome)}", file=sys.stderr)
    return 0 if outcome.ok else 1


def _merge(args: argparse.Namespace) -> int:
    from iapo_gym.leaderboard.submit.merge import MergeError, merge

    try:
        counts = merge(args.inputs, args.out)
    except (MergeError, ValueError, FileNotFoundError) as exc:
        print(f"iapo-gym leaderboard merge: error: {exc}", file=sys.stderr)
        return 1
    print(f"merged {counts['inputs']} inputs: {counts['runs']} runs ({counts['duplicates']} duplicate runs "
          f"checked and dropped) into {args.out}", file=sys.stderr)
    return 0
