"""Issue 7: all-subset (Rao-Blackwellized) reuse against the paper's blocks, paired per run.

Runs (or resumes) a leaderboard sweep of ``psst`` and ``psst_rb`` and prints, per (task,
budget): both agents' exact test ACR, the paired difference (rb minus blocks) with its SEM,
the two-sided Wilcoxon signed-rank p-value Holm-corrected over every (task, budget) cell, the
regret of each (train-optimal policy's test ACR minus the agent's) and the share of PSST's
regret that all-subset reuse removes.

    IAPO_GYM_DATA=../shared/iapo-release python benchmarks/bench_rb.py --out results/rb \\
        --tasks math synthetic_bernoulli synthetic_categorical --budgets 3000 5000 10000 20000 --runs 200 --jobs 2
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from iapo_gym.cli import main as cli_main
from iapo_gym.leaderboard.stats import adjust_pvalues, mean_sem, paired_test
from iapo_gym.leaderboard.store import ResultStore

AGENTS = ("psst", "psst_rb")


def analyse(out: str) -> str:
    """The Markdown table of the paired comparison stored in ``out``."""
    with ResultStore(out, create=False) as store:
        results = store.results()
    by_cell: dict[tuple[str, int], dict[str, dict[int, tuple[float, float]]]] = defaultdict(lambda: defaultdict(dict))
    for r in results:
        if r.label in AGENTS:
            by_cell[(r.task, r.budget)][r.label][r.run] = (r.acr, r.train_optimal_acr)
    cells = sorted(by_cell)
    rows, p_values = [], []
    for task, budget in cells:
        blocks, rb = by_cell[(task, budget)]["psst"], by_cell[(task, budget)]["psst_rb"]
        runs = sorted(set(blocks) & set(rb))
        a = np.array([blocks[r][0] for r in runs])
        b = np.array([rb[r][0] for r in runs])
        ceiling = np.array([blocks[r][1] for r in runs])
        diff_mean, diff_sem, n = mean_sem(b - a)
        test = paired_test(b, a)
        p_values.append(test.p_value)
        regret_a, regret_b = float(np.mean(ceiling - a)), float(np.mean(ceiling - b))
        removed = (regret_a - regret_b) / regret_a if regret_a > 0 else float("nan")
        rows.append((task, budget, n, a.mean(), b.mean(), diff_mean, diff_sem, test.p_value,
                     regret_a, regret_b, removed))
    adjusted = adjust_pvalues(p_values, "holm")
    lines = [
        "| task | T | runs | psst | psst_rb | rb - blocks | p (Wilcoxon) | p (Holm) | regret psst | regret psst_rb | regret removed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (task, budget, n, ma, mb, d, se, p, ra, rb_, rem), p_adj in zip(rows, adjusted, strict=True):
        lines.append(f"| {task} | {budget} | {n} | {ma:.4f} | {mb:.4f} | {d:+.4f} ± {se:.4f} | {p:.2g} | {p_adj:.2g} | "
                     f"{ra:.4f} | {rb_:.4f} | {100 * rem:.0f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/rb")
    parser.add_argument("--tasks", nargs="+", default=["math", "synthetic_bernoulli", "synthetic_categorical"])
    parser.add_argument("--budgets", nargs="+", default=["3000", "5000", "10000", "20000"])
    parser.add_argument("--runs", default="200")
    parser.add_argument("--jobs", default="2")
    parser.add_argument("--analyse-only", action="store_true", help="only read the results already in --out")
    args = parser.parse_args()
    if not args.analyse_only:
        status = cli_main(["leaderboard", "--tasks", *args.tasks, "--agents", *AGENTS, "--budgets", *args.budgets,
                           "--runs", args.runs, "--jobs", args.jobs, "--out", args.out, "--no-table"])
        if status != 0:
            raise SystemExit(status)
    print(analyse(args.out))


if __name__ == "__main__":
    main()
