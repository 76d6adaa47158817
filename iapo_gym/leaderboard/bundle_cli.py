"""The ``iapo-gym bundle``, ``iapo-gym verify`` and ``iapo-gym leaderboard merge`` commands."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_commands(subparsers: Any) -> None:
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


def add_merge_command(leaderboard_parser: argparse.ArgumentParser) -> None:
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
    from iapo_gym.leaderboard.bundle import BundleError, write_bundle

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
    from iapo_gym.leaderboard.bundle import BundleError
    from iapo_gym.leaderboard.verify import verify_bundle, write_record

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
    matched = sum(c.match for c in outcome.checks)
    print(f"{outcome.status}: {matched} of {len(outcome.checks)} runs match exactly in {outcome.seconds:.1f} s")
    if not args.no_record:
        print(f"recorded in {write_record(args.bundle, outcome)}", file=sys.stderr)
    return 0 if outcome.ok else 1


def _merge(args: argparse.Namespace) -> int:
    from iapo_gym.leaderboard.merge import MergeError, merge

    try:
        counts = merge(args.inputs, args.out)
    except (MergeError, ValueError, FileNotFoundError) as exc:
        print(f"iapo-gym leaderboard merge: error: {exc}", file=sys.stderr)
        return 1
    print(f"merged {counts['inputs']} inputs: {counts['runs']} runs ({counts['duplicates']} duplicate runs "
          f"checked and dropped) into {args.out}", file=sys.stderr)
    return 0
