"""The recommended agent (``auto``) against the paper's best, PSST and PSST+K4, paired per run.

Runs (or resumes) a leaderboard sweep of ``psst``, ``psst_topk:k=4,rho=0.2`` and the challengers
(default: ``auto``), then prints per (task, budget): each agent's regret against the
train-optimal policy (its test ACR minus the agent's), and for each challenger its paired gain
over PSST, over PSST+K4 and over the better of the two in that cell (the one of higher mean
test ACR), each with the two-sided Wilcoxon signed-rank p-value Holm-corrected over every
(task, budget) cell of that comparison, the share of the better agent's regret removed and the
ratio of mean training time to PSST's. ``--markdown`` writes the table, ``--plot`` the regret
against the budget (one panel per task).

    IAPO_GYM_OFFLINE=1 IAPO_GYM_DATA=../shared/iapo-release nice -n 10 python benchmarks/bench_challenger.py \\
        --out results/challenger --runs 200 --jobs 2 \\
        --markdown docs/challenger_figures/table.md --plot docs/challenger_figures/regret_vs_budget.png
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np
from regret_plot import plot_regret

from iapo_gym.cli import main as cli_main
from iapo_gym.leaderboard.report.stats import adjust_pvalues, mean_sem, paired_test
from iapo_gym.leaderboard.run.specs import PAPER_BUDGETS
from iapo_gym.leaderboard.run.store import ResultStore

PSST, TOPK = "psst", "psst+K4"
BASELINES = (PSST, f"psst_topk:k=4,rho=0.2@{TOPK}")
BETTER = "better"

#: (task, budget) -> label -> (per-run test ACR, train-optimal test ACR, train seconds), paired by run index.
Cells = dict[tuple[str, int], dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]]


def label_of(spec: str) -> str:
    """The display label a leaderboard spec gets (``...@label``, else the spec itself)."""
    return spec.rsplit("@", 1)[1] if "@" in spec else spec


def load_cells(out: str, labels: list[str]) -> Cells:
    """Every (task, budget) cell with the runs that all ``labels`` completed."""
    with ResultStore(out, create=False) as store:
        results = store.results()
    raw: dict[tuple[str, int], dict[str, dict[int, tuple[float, float, float]]]] = defaultdict(lambda: defaultdict(dict))
    for r in results:
        if r.label in labels:
            raw[(r.task, r.budget)][r.label][r.run] = (r.acr, r.train_optimal_acr, r.train_seconds)
    cells: Cells = {}
    for key in sorted(raw):
        by_label = raw[key]
        if any(label not in by_label for label in labels):
            continue
        runs = sorted(set.intersection(*(set(by_label[label]) for label in labels)))
        if runs:
            cells[key] = {label: tuple(np.array([by_label[label][r][i] for r in runs]) for i in range(3))  # type: ignore[misc]
                          for label in labels}
    return cells


def analyse(cells: Cells, challengers: list[str]) -> str:
    """The Markdown table: regrets, and each challenger's paired gains with Holm-corrected p-values."""
    keys = list(cells)
    refs = (PSST, TOPK, BETTER)
    gains: dict[tuple[str, str], list[tuple[float, float, float]]] = defaultdict(list)
    pvals: dict[tuple[str, str], list[float]] = defaultdict(list)
    for key in keys:
        cell = cells[key]
        better = PSST if cell[PSST][0].mean() >= cell[TOPK][0].mean() else TOPK
        for ch in challengers:
            for ref in refs:
                base = cell[better if ref == BETTER else ref]
                acr, ref_acr, ceiling = cell[ch][0], base[0], base[1]
                gain = mean_sem(acr - ref_acr)
                regret = float(np.mean(ceiling - ref_acr))
                removed = gain[0] / regret if regret > 0 else float("nan")
                gains[(ch, ref)].append((gain[0], gain[1], removed))
                pvals[(ch, ref)].append(paired_test(acr, ref_acr).p_value)
    adjusted = {k: adjust_pvalues(v, "holm") for k, v in pvals.items()}
    lines = []
    for ch in challengers:
        lines += [f"**{ch}** against PSST, PSST+K4 and the better of the two per cell (regret = train-optimal "
                  "test ACR minus the agent's; gain = paired mean difference of test ACR ± SEM; p: two-sided "
                  "Wilcoxon signed-rank, Holm-corrected over the cells of each comparison; removed = gain / "
                  "regret of the reference; time = mean training time / PSST's)", "",
                  "| task | T | runs | regret psst | regret psst+K4 | regret " + ch + " | better | gain vs better "
                  "| p (Holm) | removed | gain vs psst | p (Holm) | gain vs psst+K4 | p (Holm) | time / psst |",
                  "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for i, key in enumerate(keys):
            cell = cells[key]
            regret = {label: float(np.mean(cell[label][1] - cell[label][0])) for label in (PSST, TOPK, ch)}
            better = PSST if cell[PSST][0].mean() >= cell[TOPK][0].mean() else TOPK
            row = (f"| {key[0]} | {key[1]} | {cell[ch][0].size} | {regret[PSST]:.4f} | {regret[TOPK]:.4f} "
                   f"| {regret[ch]:.4f} | {better}")
            g, s, removed = gains[(ch, BETTER)][i]
            row += f" | {g:+.4f} ± {s:.4f} | {adjusted[(ch, BETTER)][i]:.2g} | {100 * removed:.0f}%"
            for ref in (PSST, TOPK):
                g, s, _ = gains[(ch, ref)][i]
                row += f" | {g:+.4f} ± {s:.4f} | {adjusted[(ch, ref)][i]:.2g}"
            ratio = float(np.mean(cell[ch][2]) / np.mean(cell[PSST][2]))
            lines.append(row + f" | {ratio:.1f}x |")
        lines.append("")
    return "\n".join(lines)


def plot(cells: Cells, labels: list[str], path: Path) -> Path:
    """Regret (mean ± SEM over runs) against the budget, one panel per task."""
    return plot_regret(cells, labels, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/challenger")
    parser.add_argument("--tasks", nargs="+", default=["math", "synthetic_bernoulli", "synthetic_categorical"])
    parser.add_argument("--budgets", nargs="+", default=[str(b) for b in PAPER_BUDGETS])
    parser.add_argument("--challengers", nargs="+", default=["auto"], help="leaderboard agent specs")
    parser.add_argument("--runs", default="200")
    parser.add_argument("--jobs", default="2")
    parser.add_argument("--seed", default="0", help="the leaderboard's root seed (screen on another than the table's)")
    parser.add_argument("--markdown", type=Path, help="also write the table into this Markdown file")
    parser.add_argument("--plot", type=Path, help="also draw the regret against the budget into this PNG")
    parser.add_argument("--analyse-only", action="store_true", help="only read the results already in --out")
    args = parser.parse_args()
    if not args.analyse_only:
        status = cli_main(["leaderboard", "--tasks", *args.tasks, "--agents", *BASELINES, *args.challengers,
                           "--budgets", *args.budgets, "--runs", args.runs, "--jobs", args.jobs,
                           "--seed", args.seed, "--out", args.out, "--no-table"])
        if status != 0:
            raise SystemExit(status)
    challengers = [label_of(s) for s in args.challengers]
    labels = [PSST, TOPK, *challengers]
    cells = load_cells(args.out, labels)
    text = analyse(cells, challengers)
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.markdown.with_suffix(".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.markdown)
    if args.plot:
        print(f"plot: {plot(cells, labels, args.plot)}")


if __name__ == "__main__":
    main()
