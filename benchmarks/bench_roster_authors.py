"""Benchmark: the paper's ten agents on MATH, ours against the paper authors' code, side by side in one run.

For each agent of ``PAPER_AGENTS`` (psst, psst+K1/K4/K8, uniform, epsilon_greedy, softmax, ucb,
triple_n1, triple_random_n), one repeat of each side does what a user of that code does for one
run of the paper's protocol, as ``bench_psst_authors.py`` does for PSST (whose functions this uses):

- ours: fresh ``gym.make("IAPO-MATH-v0")``, seeded 80/20 resplit, the agent's training with
  budget T, exact test ACR;
- the authors': a fresh ``CategoricalMVEnv`` from the release arrays, their
  ``combine_and_resplit(0.8, seed)``, their agent's ``train(env, T)`` and their 10,000-sample
  test evaluation (``example_runner.evaluate``).

Both sides use the paper's hyper-parameters (``bench_psst_authors.AUTHORS_AGENTS``; checked
against our agents' defaults before timing). Per repeat (seeds 0..) every agent runs ours then
theirs, so load changes hit both sides alike. Reported per agent and budget: the medians and
their ratio; for the roster, the sum over the ten agents of each repeat, its median and ratio.
The machine's load average is printed at the start and the end.

The authors' code is not part of this repository; get it with
``git clone https://github.com/IAPO-AAAI25/IAPO-PSST DIR`` and pass ``--authors-code DIR``
(without it only our side is measured). Run::

    IAPO_GYM_OFFLINE=1 IAPO_GYM_DATA=../shared/iapo-release \\
        nice -n 10 .venv/bin/python benchmarks/bench_roster_authors.py --authors-code ../authors-psst
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_psst_authors import AUTHORS_AGENTS, authors_or_none, matched_params, ours  # noqa: E402
from iapo_gym.leaderboard.run.specs import PAPER_AGENTS, AgentSpec, parse_agent_spec  # noqa: E402


@dataclass(frozen=True)
class Row:
    """Medians over the repeats of one agent (or the roster total) at one budget; ``theirs`` NaN if unmeasured."""

    agent: str
    budget: int
    ours: float
    theirs: float
    acr_ours: float
    acr_theirs: float

    @property
    def ratio(self) -> float:
        """Their median seconds over ours."""
        return self.theirs / self.ours


TOTAL = "roster total"


def summarise(labels: Sequence[str], budget: int, times: dict[str, list[tuple[float, float]]],
              acrs: dict[str, list[tuple[float, float]]]) -> list[Row]:
    """Per agent the medians of (ours, theirs) seconds and mean ACRs; then the median of each repeat's sum over agents.

    ``times[label]`` and ``acrs[label]`` hold one (ours, theirs) pair per repeat, in repeat order
    (theirs NaN where not measured).
    """
    rows = []
    for label in labels:
        pairs, scores = times[label], acrs[label]
        rows.append(Row(label, budget, statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
                        statistics.fmean(s[0] for s in scores), statistics.fmean(s[1] for s in scores)))
    repeats = len(times[labels[0]])
    sums = [(sum(times[label][r][0] for label in labels), sum(times[label][r][1] for label in labels))
            for r in range(repeats)]
    rows.append(Row(TOTAL, budget, statistics.median(s[0] for s in sums), statistics.median(s[1] for s in sums),
                    statistics.fmean(row.acr_ours for row in rows), statistics.fmean(row.acr_theirs for row in rows)))
    return rows


def check_params(specs: Sequence[AgentSpec]) -> None:
    """Stop if an agent has no counterpart in the authors' code or a hyper-parameter differs from theirs."""
    for spec in specs:
        if spec.label not in AUTHORS_AGENTS:
            raise SystemExit(f"{spec.label!r} has no counterpart in the authors' code; known: {', '.join(AUTHORS_AGENTS)}")
        for name, theirs, mine in matched_params(spec):
            if theirs != mine:
                raise SystemExit(f"{spec.label}: their {name}={theirs!r}, ours {mine!r}")


def format_rows(rows: Sequence[Row], repeats: int, eval_samples: int) -> str:
    """The result table as text."""
    lines = [f"MATH, median of {repeats} (seeds 0..{repeats - 1}); ours: fresh gym.make + resplit + train + exact "
             f"evaluate; theirs: fresh env + resplit + train + {eval_samples}-sample evaluate",
             f"{'agent':<16} {'T':>6} {'ours ms':>9} {'theirs s':>9} {'ratio':>7} {'ACR ours':>9} {'ACR theirs':>10}"]
    for row in rows:
        lines.append(f"{row.agent:<16} {row.budget:>6} {row.ours * 1e3:>9.1f} {row.theirs:>9.2f} {row.ratio:>6.1f}x "
                     f"{row.acr_ours:>9.4f} {row.acr_theirs:>10.4f}")
    return "\n".join(lines)


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--authors-code", type=Path, help="checkout of github.com/IAPO-AAAI25/IAPO-PSST")
    parser.add_argument("--budgets", type=int, nargs="+", default=[10_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--eval-samples", type=int, default=10_000, help="the authors' evaluation samples")
    parser.add_argument("--agents", nargs="+", default=list(PAPER_AGENTS), help="agent specs (default: the paper's ten)")
    args = parser.parse_args(argv)
    specs = [parse_agent_spec(a) for a in args.agents]
    check_params(specs)
    labels = [s.label for s in specs]
    authors = authors_or_none(parser, args.authors_code)
    print(f"load average at start: {load()}", flush=True)
    for spec in specs:  # warm: bytecode, lazy imports, compiled loops
        ours(max(args.budgets), 99, spec.spec)
        if authors is not None:
            authors.run(100, 99, 100, spec.label)
    nan = (float("nan"), float("nan"))
    times: dict[int, dict[str, list[tuple[float, float]]]] = {b: {label: [] for label in labels} for b in args.budgets}
    acrs: dict[int, dict[str, list[tuple[float, float]]]] = {b: {label: [] for label in labels} for b in args.budgets}
    for seed in range(args.repeats):
        for budget in args.budgets:
            for spec in specs:
                mine = ours(budget, seed, spec.spec)
                theirs = authors.run(budget, seed, args.eval_samples, spec.label) if authors is not None else nan
                times[budget][spec.label].append((mine[0], theirs[0]))
                acrs[budget][spec.label].append((mine[1], theirs[1]))
        print(f"repeat {seed + 1}/{args.repeats} done, load average {load()}", flush=True)
    rows = [row for budget in args.budgets for row in summarise(labels, budget, times[budget], acrs[budget])]
    print(format_rows(rows, args.repeats, args.eval_samples))
    print(f"load average at end: {load()}")


if __name__ == "__main__":
    main()
