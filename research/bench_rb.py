"""All-subset (Rao-Blackwellized) reuse against the paper's blocks, paired per run.

Runs (or resumes) a leaderboard sweep of ``psst`` (blocks), ``psst_rb`` (all subsets) and
``psst_query_oracle`` (``rb_ceiling.py``: every sample is the exact conditional mean given the
query, the limit of any reuse within a pull) and prints, per (task, budget): each agent's
regret (the train-optimal policy's test ACR minus the agent's), the paired gain over ``psst``
with its SEM, the two-sided Wilcoxon signed-rank p-value Holm-corrected over every (task,
budget) cell of that comparison, and the share of PSST's regret removed. ``--plot`` draws the
regret against the budget, one panel per task.

    IAPO_GYM_OFFLINE=1 IAPO_GYM_DATA=../shared/iapo-release python research/bench_rb.py --out results/rb \\
        --tasks math synthetic_bernoulli synthetic_categorical --budgets 3000 5000 10000 20000 --runs 200 --jobs 2 \\
        --plot docs/estimator_figures/regret_vs_budget.png
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np
from regret_plot import plot_regret

from iapo_gym.cli import main as cli_main
from iapo_gym.leaderboard.report.stats import adjust_pvalues, mean_sem, paired_test
from iapo_gym.leaderboard.run.store import ResultStore

BLOCKS, RB, CEILING = "psst", "psst_rb", "psst_query_oracle"
#: PSST (blocks), PSST with all-subset reuse, and the no-completion-noise ceiling (rb_ceiling.py).
AGENTS = (BLOCKS, RB, f"rb_ceiling:QueryOraclePSST@{CEILING}")
LABELS = (BLOCKS, RB, CEILING)

#: (task, budget) -> label -> (per-run test ACR, per-run train-optimal test ACR), runs paired by index.
Cells = dict[tuple[str, int], dict[str, tuple[np.ndarray, np.ndarray]]]


def load_cells(out: str) -> Cells:
    """Every (task, budget) cell with the runs that all three agents completed."""
    with ResultStore(out, create=False) as store:
        results = store.results()
    raw: dict[tuple[str, int], dict[str, dict[int, tuple[float, float]]]] = defaultdict(lambda: defaultdict(dict))
    for r in results:
        if r.label in LABELS:
            raw[(r.task, r.budget)][r.label][r.run] = (r.acr, r.train_optimal_acr)
    cells: Cells = {}
    for key in sorted(raw):
        by_label = raw[key]
        runs = sorted(set.intersection(*(set(by_label[label]) for label in LABELS)))
        if runs:
            cells[key] = {label: (np.array([by_label[label][r][0] for r in runs]),
                                  np.array([by_label[label][r][1] for r in runs])) for label in LABELS}
    return cells


def analyse(cells: Cells) -> str:
    """The Markdown table: regret of each agent and the paired gain of RB and the ceiling over blocks."""
    rows = []
    p_values: dict[str, list[float]] = {RB: [], CEILING: []}
    for key in cells:
        acr = {label: cells[key][label][0] for label in LABELS}
        ceiling_acr = cells[key][BLOCKS][1]
        regret = {label: float(np.mean(ceiling_acr - acr[label])) for label in LABELS}
        gains = {}
        for label in (RB, CEILING):
            gain, sem, n = mean_sem(acr[label] - acr[BLOCKS])
            p_values[label].append(paired_test(acr[label], acr[BLOCKS]).p_value)
            removed = gain / regret[BLOCKS] if regret[BLOCKS] > 0 else float("nan")
            gains[label] = (gain, sem, removed)
        rows.append((key, n, regret, gains))
    adjusted = {label: adjust_pvalues(p_values[label], "holm") for label in (RB, CEILING)}
    lines = [
        "| task | T | runs | regret psst | regret psst_rb | regret ceiling | psst_rb - psst | p (Holm) | removed "
        "| ceiling - psst | p (Holm) | removed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, ((task, budget), n, regret, gains) in enumerate(rows):
        line = f"| {task} | {budget} | {n} | {regret[BLOCKS]:.4f} | {regret[RB]:.4f} | {regret[CEILING]:.4f}"
        for label in (RB, CEILING):
            gain, sem, removed = gains[label]
            line += f" | {gain:+.4f} ± {sem:.4f} | {adjusted[label][i]:.2g} | {100 * removed:.0f}%"
        lines.append(line + " |")
    return "\n".join(lines)


def plot(cells: Cells, path: Path) -> Path:
    """Regret (mean +- SEM over runs) against the budget for the three agents, one panel per task."""
    names = {BLOCKS: "psst (blocks)", RB: "psst_rb (all subsets)", CEILING: "ceiling (exact per query)"}
    styles = {BLOCKS: ("C0", "o", "-"), RB: ("C1", "s", "-"), CEILING: ("0.4", "^", "--")}
    return plot_regret(cells, list(LABELS), path, {label: (*styles[label], names[label]) for label in LABELS})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/rb")
    parser.add_argument("--tasks", nargs="+", default=["math", "synthetic_bernoulli", "synthetic_categorical"])
    parser.add_argument("--budgets", nargs="+", default=["3000", "5000", "10000", "20000"])
    parser.add_argument("--runs", default="200")
    parser.add_argument("--jobs", default="2")
    parser.add_argument("--plot", type=Path, help="also draw the regret against the budget into this PNG")
    parser.add_argument("--analyse-only", action="store_true", help="only read the results already in --out")
    args = parser.parse_args()
    if not args.analyse_only:
        status = cli_main(["leaderboard", "--tasks", *args.tasks, "--agents", *AGENTS, "--budgets", *args.budgets,
                           "--runs", args.runs, "--jobs", args.jobs, "--out", args.out, "--no-table"])
        if status != 0:
            raise SystemExit(status)
    cells = load_cells(args.out)
    print(analyse(cells))
    if args.plot:
        print(f"plot: {plot(cells, args.plot)}")


if __name__ == "__main__":
    main()
