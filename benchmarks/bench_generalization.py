"""Generalization benchmark: agents on many levels of the generated families (docs/tasks.md), paired per level.

Every (family, level) is one leaderboard task ``generated:FAMILY:LEVEL`` run ``--resplits`` times (run r: a
seeded 80/20 resplit of the level's queries, the same env stream for every agent), through the leaderboard's
own runner into ``OUT/results.sqlite`` (resumable; the same results whatever ``--jobs``). Regret is the
train-optimal policy's test ACR minus the agent's. Per family and budget it reports, for each agent:

- the median over levels of the share of the baseline's regret the agent removes, where the baseline is the
  better (lower mean regret) of PSST and PSST+K4 on that level, with a percentile bootstrap interval over
  levels (levels where the baseline's regret is 0 are left out of the median and counted);
- the share of levels where the agent is significantly worse than PSST: a paired Wilcoxon test over the
  level's resplits (the leaderboard's ``paired_test``), Holm's correction over the family's levels.

Writes OUT/generalization.md, OUT/generalization.csv, OUT/levels.csv and OUT/generalization.png (a heatmap of
the median share, families x budgets, one panel per agent). Held-out levels are for reports only::

    nice -n 10 python benchmarks/bench_generalization.py --levels 1000000:1000049 --budgets 3000 10000 40000 100000 \\
        --agents psst "psst_topk:k=4,rho=0.2@psst+K4" plugin_halving auto --resplits 20 --jobs 1 \\
        --out results/generalization
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from iapo_gym.leaderboard.report.stats import adjust_pvalues, paired_test
from iapo_gym.leaderboard.run.runner import run_sweep
from iapo_gym.leaderboard.run.specs import AgentSpec, parse_agent_spec, resolve_task
from iapo_gym.leaderboard.run.store import ResultStore, RunResult
from iapo_gym.seeding import derive_rng
from iapo_gym.tasks.generated import families, get_family, parse_levels

PSST = "psst"
PSST_K4 = "psst_topk:k=4,rho=0.2@psst+K4"
DEFAULT_AGENTS = (PSST, PSST_K4, "plugin_halving", "auto")
DEFAULT_BUDGETS = (3000, 10000, 40000, 100000)
BOOTSTRAP = 2000
ALPHA = 0.05


@dataclass(frozen=True)
class Cell:
    """One agent on one (family, budget), summarised over levels."""

    family: str
    budget: int
    agent: str
    n_levels: int
    n_levels_used: int  # levels with a positive baseline regret (the median's sample)
    median_share_removed: float
    ci_low: float
    ci_high: float
    n_worse_than_psst: int
    share_worse_than_psst: float
    mean_regret: float
    baseline_mean_regret: float
    mean_train_seconds: float


@dataclass(frozen=True)
class LevelRow:
    """One agent on one (family, level, budget): mean regret over resplits and its paired test against PSST."""

    family: str
    level: int
    budget: int
    agent: str
    resplits: int
    mean_regret: float
    baseline_regret: float
    share_removed: float
    p_vs_psst: float
    p_vs_psst_holm: float
    median_diff_vs_psst: float
    worse_than_psst: bool


def task_name(family: str, level: int) -> str:
    """The leaderboard task of one level, resplit per run."""
    return f"generated:{family}:{level}"


def regret(row: RunResult) -> float:
    """Regret to the train-optimal policy on the test split."""
    return row.train_optimal_acr - row.acr


def bootstrap_median(values: np.ndarray, rng: np.random.Generator, n: int = BOOTSTRAP) -> tuple[float, float]:
    """Percentile 95 % interval of the median, resampling levels."""
    if values.size == 0:
        return math.nan, math.nan
    picks = rng.integers(0, values.size, size=(n, values.size))
    medians = np.median(values[picks], axis=1)
    return float(np.quantile(medians, 0.025)), float(np.quantile(medians, 0.975))


def analyse(rows: Sequence[RunResult], agents: Sequence[AgentSpec], fams: Sequence[str], levels: Sequence[int],
            budgets: Sequence[int], seed: int = 0, alpha: float = ALPHA) -> tuple[list[Cell], list[LevelRow]]:
    """Per (family, budget, agent) cells and per-level rows from the stored runs (see the module docstring)."""
    psst, psst_k4 = parse_agent_spec(PSST), parse_agent_spec(PSST_K4)
    by_key: dict[tuple[str, str, int], dict[int, RunResult]] = defaultdict(dict)
    for r in rows:
        by_key[(r.task, f"{r.agent}|{r.params}", r.budget)][r.run] = r
    cells: list[Cell] = []
    level_rows: list[LevelRow] = []
    for family in fams:
        for budget in budgets:
            def series(spec: AgentSpec, level: int, family: str = family, budget: int = budget) -> dict[int, float]:
                runs = by_key.get((task_name(family, level), spec.key, budget), {})
                return {run: regret(r) for run, r in runs.items()}

            for spec in agents:
                per_level: list[tuple[int, float, float, float, float, int, int]] = []
                seconds: list[float] = []
                for level in levels:
                    mine, ref = series(spec, level), series(psst, level)
                    if not mine:
                        continue
                    k4 = series(psst_k4, level)
                    baseline = min(float(np.mean(list(ref.values()))) if ref else math.inf,
                                   float(np.mean(list(k4.values()))) if k4 else math.inf)
                    common = sorted(set(mine) & set(ref))
                    test = paired_test([mine[r] for r in common], [ref[r] for r in common], "wilcoxon")
                    per_level.append((level, float(np.mean(list(mine.values()))), baseline, test.p_value,
                                      test.median_diff, len(mine), test.direction))
                    seconds += [r.train_seconds for r in by_key[(task_name(family, level), spec.key, budget)].values()]
                if not per_level:
                    continue
                adjusted = adjust_pvalues([p for _, _, _, p, _, _, _ in per_level], "holm")
                shares = []
                worse = 0
                for (level, mean, baseline, p, diff, n, direction), p_adj in zip(per_level, adjusted, strict=True):
                    share = (baseline - mean) / baseline if math.isfinite(baseline) and baseline > 0 else math.nan
                    is_worse = bool(np.isfinite(p_adj) and p_adj < alpha and direction > 0)
                    worse += is_worse
                    if math.isfinite(share):
                        shares.append(share)
                    level_rows.append(LevelRow(family, level, budget, spec.label, n, mean, baseline, share, p,
                                               float(p_adj), diff, is_worse))
                values = np.array(shares)
                low, high = bootstrap_median(values, derive_rng(seed, "bootstrap", family, budget, spec.key))
                cells.append(Cell(
                    family, budget, spec.label, len(per_level), int(values.size),
                    float(np.median(values)) if values.size else math.nan, low, high, worse, worse / len(per_level),
                    float(np.mean([m for _, m, _, _, _, _, _ in per_level])),
                    float(np.mean([b for _, _, b, _, _, _, _ in per_level if math.isfinite(b)] or [math.nan])),
                    float(np.mean(seconds)) if seconds else math.nan,
                ))
    return cells, level_rows


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{100 * x:+.0f}%"


def markdown(cells: Sequence[Cell], agents: Sequence[AgentSpec], fams: Sequence[str], budgets: Sequence[int],
             header: str) -> str:
    """One table per budget: families x agents, 'median share removed [interval]; levels worse than PSST'."""
    by = {(c.family, c.budget, c.agent): c for c in cells}
    labels = [a.label for a in agents]
    lines = ["# Generalization over generated levels", "", header, "",
             "Cell: median over levels of the share of the better of PSST / PSST+K4's regret the agent removes "
             "[95 % bootstrap interval over levels]; then the levels where it is significantly worse than PSST "
             "(paired Wilcoxon over resplits, Holm over levels) out of all levels.", ""]
    for budget in budgets:
        lines += [f"## T = {budget}", "", "| family | " + " | ".join(labels) + " |",
                  "|---|" + "---:|" * len(labels)]
        for family in fams:
            row = [family]
            for label in labels:
                c = by.get((family, budget, label))
                row.append("-" if c is None else f"{_pct(c.median_share_removed)} [{_pct(c.ci_low)}, "
                           f"{_pct(c.ci_high)}]; {c.n_worse_than_psst}/{c.n_levels} worse")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def write_csv(path: Path, rows: Sequence[object], cls: type) -> None:
    """Rows of a dataclass as CSV."""
    names = [f.name for f in fields(cls)]
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(names)
        for row in rows:
            values = asdict(row)  # type: ignore[call-overload]
            writer.writerow([values[n] for n in names])


def heatmap(cells: Sequence[Cell], agents: Sequence[AgentSpec], fams: Sequence[str], budgets: Sequence[int],
            path: Path) -> Path:
    """Families x budgets, one panel per agent: colour = median share removed, text = share and levels worse."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(c.family, c.budget, c.agent): c for c in cells}
    fig, axes = plt.subplots(1, len(agents), figsize=(2.2 + 1.2 * len(budgets) * len(agents), 0.9 + 0.5 * len(fams)),
                             squeeze=False, sharey=True)
    image = None
    for ax, spec in zip(axes[0], agents, strict=True):
        grid = np.full((len(fams), len(budgets)), np.nan)
        for i, family in enumerate(fams):
            for j, budget in enumerate(budgets):
                c = by.get((family, budget, spec.label))
                if c is None:
                    continue
                grid[i, j] = c.median_share_removed
                dark = math.isfinite(c.median_share_removed) and abs(c.median_share_removed) > 0.6
                ax.text(j, i, f"{_pct(c.median_share_removed)}\n{c.n_worse_than_psst}/{c.n_levels} worse",
                        ha="center", va="center", fontsize=7, color="white" if dark else "black")
        image = ax.imshow(np.clip(grid, -1, 1), cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
        ax.set_xticks(range(len(budgets)), [f"{b // 1000}K" if b % 1000 == 0 else str(b) for b in budgets])
        ax.set_yticks(range(len(fams)), list(fams))
        ax.set_title(spec.label, fontsize=9)
        ax.set_xlabel("budget")
    assert image is not None
    fig.colorbar(image, ax=list(axes[0]), label="median share of best-of-PSST/PSST+K4 regret removed", fraction=0.03)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or continue) the sweep, then write the Markdown, CSV and heatmap."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--agents", nargs="+", default=list(DEFAULT_AGENTS),
                        help="agent specs (PSST and PSST+K4 are added when absent: they are the baselines)")
    parser.add_argument("--families", nargs="+", default=["all"], help=f"default: all ({', '.join(families())})")
    parser.add_argument("--levels", default="1000000:1000049", help="A:B, both included (default: 50 held-out levels)")
    parser.add_argument("--budgets", nargs="+", type=int, default=list(DEFAULT_BUDGETS))
    parser.add_argument("--resplits", type=int, default=20,
                        help="paired resplits per level (default 20; Holm over L levels needs about log2(40 L) to "
                             "declare any level worse)")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="worker processes (results do not depend on it)")
    parser.add_argument("--seed", type=int, default=0, help="root seed of the splits, env streams and agents")
    parser.add_argument("--out", default="results/generalization")
    parser.add_argument("--report-only", action="store_true", help="only analyse what OUT/results.sqlite holds")
    args = parser.parse_args(argv)
    fams = list(families()) if args.families == ["all"] else [get_family(f).name for f in args.families]
    levels = list(parse_levels(args.levels))
    specs = [parse_agent_spec(a) for a in args.agents]
    keys = {s.key for s in specs}
    for base in (PSST_K4, PSST):
        spec = parse_agent_spec(base)
        if spec.key not in keys:
            specs.insert(0, spec)
    smallest_p = 2.0 ** (1 - args.resplits)  # the two-sided Wilcoxon's smallest p-value with that many pairs
    if smallest_p * len(levels) >= ALPHA:
        print(f"note: with {args.resplits} resplits and Holm over {len(levels)} levels no level can be significantly "
              f"worse than PSST (smallest adjusted p {smallest_p * len(levels):.3g} >= {ALPHA})", file=sys.stderr)
    out = Path(args.out)
    start = time.monotonic()
    if not args.report_only:
        tasks = [resolve_task(task_name(f, lv)) for f in fams for lv in levels]
        summary = run_sweep(out, tasks, specs, args.budgets, args.resplits, jobs=args.jobs, root_seed=args.seed)
        if summary.failures:
            print(f"{len(summary.failures)} runs failed (see above)", file=sys.stderr)
    seconds = time.monotonic() - start
    with ResultStore(out, create=False) as store:
        rows = store.results()
    cells, level_rows = analyse(rows, specs, fams, levels, args.budgets, args.seed)
    command = "python benchmarks/bench_generalization.py " + " ".join(
        f"'{a}'" if any(ch in a for ch in " @,=") else a for a in (sys.argv[1:] if argv is None else argv))
    header = (f"`{command}`\n\nFamilies {', '.join(fams)}; levels {levels[0]}-{levels[-1]} ({len(levels)}); "
              f"{args.resplits} resplits per level; root seed {args.seed}. This invocation: {seconds:.0f} s.")
    (out / "generalization.md").write_text(markdown(cells, specs, fams, args.budgets, header) + "\n")
    write_csv(out / "generalization.csv", cells, Cell)
    write_csv(out / "levels.csv", level_rows, LevelRow)
    heatmap(cells, [s for s in specs if s.label not in ("psst",)], fams, args.budgets, out / "generalization.png")
    print((out / "generalization.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
