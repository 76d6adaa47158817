"""Fuzz every parser of outside input and print, per parser, examples tried, accepted, refused cleanly, failed.

    nice -n 5 python tools/fuzz.py                 # 10,000 examples per parser
    python tools/fuzz.py --examples 500 --targets bundle_zip,policy_json
    python tools/fuzz.py --targets hdf5_table_bytes --random-range 2780:3580

The targets, their seeds, mutators and error classes are in ``tests/fuzz_targets.py`` (the test
suite runs the same targets for a short while: ``tests/test_fuzz_parsers.py``). Examples are drawn by
hypothesis (``st.randoms``, generation only, seeded by ``--seed``), so a run is reproducible. The goal
is 0 failed; each failure's reason is printed below the table (up to 5 per parser). With
``--random-range A:B`` the examples are ``random.Random(i)`` for i in A..B-1 instead, so one
example found once can be replayed by its number.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz_targets import TARGETS, Target, mutate, run_isolated, run_one  # noqa: E402


def fuzz(target: Target, examples: int, root_seed: int) -> tuple[collections.Counter[str], list[str], float]:
    """Outcome counts, failure reasons and seconds of ``examples`` hypothesis examples against ``target``."""
    counts: collections.Counter[str] = collections.Counter()
    failures: list[str] = []

    @seed(root_seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.randoms(use_true_random=False))
    def one(rnd: object) -> None:
        data = mutate(target, rnd)  # type: ignore[arg-type]
        outcome = run_isolated(target, data) if target.isolate else run_one(target, data)
        counts[outcome.kind] += 1
        if outcome.kind == "failed":
            failures.append(outcome.detail)

    start = time.perf_counter()
    one()
    return counts, failures, time.perf_counter() - start


def replay(target: Target, first: int, stop: int) -> tuple[collections.Counter[str], list[str], float]:
    """Like ``fuzz``, on the examples ``random.Random(i)`` for ``first <= i < stop``."""
    counts: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    start = time.perf_counter()
    for i in range(first, stop):
        data = mutate(target, random.Random(i))
        outcome = run_isolated(target, data) if target.isolate else run_one(target, data)
        counts[outcome.kind] += 1
        if outcome.kind == "failed":
            failures.append(f"example {i}: {outcome.detail}")
    return counts, failures, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=10_000, help="examples per parser (default 10,000)")
    parser.add_argument("--targets", default="", help="comma-separated target names (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--random-range", metavar="A:B", help="replay the examples random.Random(i), A <= i < B")
    args = parser.parse_args(argv)
    span: tuple[int, int] | None = None
    if args.random_range:
        try:
            first, stop = (int(x) for x in args.random_range.split(":"))
        except ValueError:
            parser.error(f"--random-range must be A:B with integers A < B, got {args.random_range!r}")
        if not 0 <= first < stop:
            parser.error(f"--random-range must be A:B with 0 <= A < B, got {args.random_range!r}")
        span = (first, stop)
    names = [n for n in args.targets.split(",") if n] or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; known: {', '.join(TARGETS)}")
    header = f"{'parser':<18} {'tried':>7} {'accepted':>9} {'refused':>8} {'failed':>7} {'ms/example':>11}"
    what = (f"examples random.Random({span[0]}..{span[1] - 1})" if span
            else f"{args.examples} examples per parser, seed {args.seed}")
    print(f"fuzz: {what}\n{header}\n{'-' * len(header)}", flush=True)
    reasons: dict[str, list[str]] = {}
    total_failed = 0
    for name in names:
        counts, failures, seconds = (replay(TARGETS[name], *span) if span
                                     else fuzz(TARGETS[name], args.examples, args.seed))
        tried = sum(counts.values())
        total_failed += counts["failed"]
        reasons[name] = failures
        print(f"{name:<18} {tried:>7} {counts['accepted']:>9} {counts['refused']:>8} {counts['failed']:>7} "
              f"{1000 * seconds / max(tried, 1):>11.1f}", flush=True)
    for name, failures in reasons.items():
        for reason in collections.Counter(failures).most_common(5):
            print(f"  {name}: {reason[1]} x {reason[0]}")
    return 1 if total_failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
