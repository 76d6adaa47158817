"""The online protocol's report: cumulative exact regret at the checkpoints, paired against a baseline agent.

For each (task, schedule, horizon) the runs of two agents pair by (level, run): both served the same requests
(common random numbers). At the reported checkpoints (``REPORTED``: T/10, T/4, T/2 and T) every agent is tested
against the baseline (default ``etc_auto``, explore-then-commit with ``plugin_anytime``) with the paper protocol's paired
test (``stats.paired_test``: Wilcoxon signed-rank or the sign test) and its multiplicity correction
(``stats.adjust_pvalues``) within each (task, schedule, horizon, checkpoint). An agent *beats* the baseline there
when the adjusted p < alpha and the test leans to fewer regret (``PairedTest.direction``: the paired differences
of cumulative regret hold the larger rank sum on the negative side; lower is better).

Files (beside the paper protocol's, which stay as they are): ``online.md``, ``online_summary.csv`` (mean ± SEM at
every checkpoint), ``online_pairwise.csv``, ``online.json`` and ``regret_curves_<task>.png`` (the mean curve with
a SEM band per agent, one panel per schedule and horizon); the HTML site gets a section per task with its curves.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from iapo_gym.leaderboard.report.files import jsonable, write_csv
from iapo_gym.leaderboard.report.model import display_path, file_stem
from iapo_gym.leaderboard.report.stats import DEFAULT_ALPHA, adjust_pvalues, mean_sem, paired_test
from iapo_gym.leaderboard.run.online import DEFAULT_BASELINE, OnlineRunResult, OnlineStore
from iapo_gym.leaderboard.run.store import TaskInfo

#: The checkpoints the report tests and tabulates, as fractions of the horizon (the CSV has all of them).
REPORTED = (0.1, 0.25, 0.5, 1.0)

Cell = tuple[str, str, int]  # (task, schedule, horizon)


@dataclass(frozen=True)
class OnlineSummaryRow:
    """Mean ± SEM over the (level, run) pairs of one agent's cumulative regret at one checkpoint."""

    task: str
    schedule: str
    horizon: int
    label: str
    checkpoint: int  # requests served
    n_runs: int
    regret_mean: float
    regret_sem: float


@dataclass(frozen=True)
class OnlinePairRow:
    """``label`` against the baseline at one checkpoint of a (task, schedule, horizon).

    ``median_diff`` is the median of the non-tied paired differences label - baseline (negative: fewer regret);
    ``mean_ratio`` the label's mean cumulative regret over the baseline's on the paired runs; ``winner`` +1 when
    the label has significantly less regret, -1 significantly more (the direction the test measured,
    ``PairedTest.direction``), 0 otherwise.
    """

    task: str
    schedule: str
    horizon: int
    checkpoint: int
    label: str
    baseline: str
    n_pairs: int
    n_effective: int
    median_diff: float
    mean_ratio: float
    p_value: float
    p_adjusted: float
    winner: int


@dataclass
class OnlineReport:
    """Everything the online report shows."""

    results: list[OnlineRunResult]
    tasks: dict[str, TaskInfo]
    summary: list[OnlineSummaryRow]
    pairs: list[OnlinePairRow]
    test: str
    correction: str
    alpha: float
    baseline: str
    meta: dict[str, Any]

    def cells(self) -> list[Cell]:
        """The (task, schedule, horizon) cells with runs, sorted."""
        return sorted({(r.task, r.schedule, r.horizon) for r in self.results})

    def curves(self, cell: Cell) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
        """Per label of a cell: (checkpoints, mean curve, SEM curve, runs), labels by mean regret at T."""
        rows: dict[str, list[OnlineSummaryRow]] = defaultdict(list)
        for s in self.summary:
            if (s.task, s.schedule, s.horizon) == cell:
                rows[s.label].append(s)
        out = {}
        for label, rs in sorted(rows.items(), key=lambda kv: (kv[1][-1].regret_mean, kv[0])):
            out[label] = (np.array([s.checkpoint for s in rs]), np.array([s.regret_mean for s in rs]),
                          np.array([s.regret_sem for s in rs]), max(s.n_runs for s in rs))
        return out


def reported_indices(points: np.ndarray) -> list[int]:
    """Indices into ``points`` (a run's checkpoints) of the first checkpoint at or past each ``REPORTED`` fraction."""
    horizon = int(points[-1])
    out: list[int] = []
    for frac in REPORTED:
        i = int(np.searchsorted(points, math.ceil(frac * horizon)))
        i = min(i, len(points) - 1)
        if i not in out:
            out.append(i)
    return out


def summarize_online(results: Sequence[OnlineRunResult]) -> list[OnlineSummaryRow]:
    """One row per (task, schedule, horizon, label, checkpoint), over the label's (level, run) pairs."""
    groups: dict[tuple[str, str, int, str], list[OnlineRunResult]] = defaultdict(list)
    for r in results:
        groups[(r.task, r.schedule, r.horizon, r.label)].append(r)
    rows = []
    for (task, schedule, horizon, label), rs in sorted(groups.items()):
        curves = np.array([r.curve_array() for r in rs])
        points = rs[0].checkpoint_array()
        for k, point in enumerate(points):
            mean, sem, n = mean_sem(curves[:, k])
            rows.append(OnlineSummaryRow(task, schedule, horizon, label, int(point), n, mean, sem))
    return rows


def pair_online(results: Sequence[OnlineRunResult], baseline: str, test: str = "wilcoxon",
                correction: str = "holm", alpha: float = DEFAULT_ALPHA) -> list[OnlinePairRow]:
    """Every agent against ``baseline`` at the reported checkpoints, runs paired by (level, run)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    cells: dict[Cell, dict[str, dict[tuple[int, int], np.ndarray]]] = defaultdict(lambda: defaultdict(dict))
    points: dict[Cell, np.ndarray] = {}
    for r in results:
        cell = (r.task, r.schedule, r.horizon)
        cells[cell][r.label][(r.level, r.run)] = r.curve_array()
        points.setdefault(cell, r.checkpoint_array())
    out: list[OnlinePairRow] = []
    for cell, by_label in sorted(cells.items()):
        if baseline not in by_label:
            continue
        base = by_label[baseline]
        others = sorted(label for label in by_label if label != baseline)
        for k in reported_indices(points[cell]):
            tests, rows = [], []
            for label in others:
                common = sorted(set(by_label[label]) & set(base))
                x = [float(by_label[label][key][k]) for key in common]
                y = [float(base[key][k]) for key in common]
                tests.append(paired_test(x, y, test))
                ratio = float(np.mean(x) / np.mean(y)) if common and np.mean(y) != 0 else math.nan
                rows.append((label, ratio))
            adjusted = adjust_pvalues([t.p_value for t in tests], correction)
            for (label, ratio), t, p_adj in zip(rows, tests, adjusted, strict=True):
                winner = -t.direction if np.isfinite(p_adj) and p_adj < alpha else 0
                out.append(OnlinePairRow(cell[0], cell[1], cell[2], int(points[cell][k]), label, baseline, t.n_pairs,
                                         t.n_effective, t.median_diff, ratio, t.p_value, float(p_adj), winner))
    return out


def online_report(out_dir: str | Path, test: str = "wilcoxon", correction: str = "holm",
                  alpha: float = DEFAULT_ALPHA, baseline: str | None = None,
                  tasks: Sequence[str] | None = None,
                  schedules: Sequence[str] | None = None,
                  agents: Sequence[str] | None = None) -> OnlineReport | None:
    """The online report of ``out_dir`` (None when it has no online runs), over the runs of ``tasks``,
    ``schedules`` and agent labels ``agents`` only when given; ``baseline`` is the label the agents are paired
    against (default ``DEFAULT_BASELINE``, ``etc_auto``). The multiple-comparison correction is per cell over the
    agents reported, so a folder that also holds other agents' runs gives a command's agents the p-values they
    have on their own when ``agents`` names them."""
    baseline = DEFAULT_BASELINE if baseline is None else baseline
    with OnlineStore(out_dir, create=False) as store:
        results = store.online_results()
        infos = {t.task: t for t in store.tasks()}
        meta: dict[str, Any] = {"root_seed": store.get_meta("root_seed"),
                                "batch_size": store.get_meta("online_batch_size"),
                                "database": display_path(store.path)}
    if tasks:
        wanted = set(tasks)
        results = [r for r in results if r.task in wanted]
    if schedules:
        wanted = set(schedules)
        results = [r for r in results if r.schedule in wanted]
    if agents:
        wanted = set(agents)
        results = [r for r in results if r.label in wanted]
    if not results:
        return None
    meta["versions"] = sorted({r.version for r in results})
    meta["n_runs"] = len(results)
    return OnlineReport(results, infos, summarize_online(results), pair_online(results, baseline, test, correction,
                                                                                 alpha),
                        test, correction, alpha, baseline, meta)


# ---- writers ---------------------------------------------------------------------------------------------------


def _pm(mean: float, sem: float) -> str:
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.2f}" if not math.isfinite(sem) else f"{mean:.2f} ± {sem:.2f}"


def _verdict(p: OnlinePairRow | None) -> str:
    if p is None:
        return "-"
    word = {1: "**less**", -1: "**more**", 0: "n.s."}[p.winner]
    ratio = f"{p.mean_ratio:.2f}x" if math.isfinite(p.mean_ratio) else "-"
    padj = f"{p.p_adjusted:.3g}" if math.isfinite(p.p_adjusted) else "-"
    return f"{ratio}, p {padj}, {word}"


def online_markdown(report: OnlineReport) -> str:
    """The online leaderboard as Markdown: per (task, schedule, horizon), agents by mean cumulative regret at T."""
    versions = ", ".join(report.meta.get("versions", []))
    lines = ["# iapo-gym online leaderboard", "",
             f"{report.meta['n_runs']} online runs from `{report.meta.get('database')}` (iapo-gym {versions}; root "
             f"seed {report.meta.get('root_seed')}, batch size {report.meta.get('batch_size')}). Cumulative exact "
             f"regret, mean ± SEM over (level, run) pairs. Each agent against `{report.baseline}` on the paired "
             f"runs: mean ratio, {report.test} test, {report.correction} correction per (task, schedule, horizon, "
             f"checkpoint), alpha {report.alpha}; **less** / **more**: significantly less / more regret."]
    pairs = {(p.task, p.schedule, p.horizon, p.checkpoint, p.label): p for p in report.pairs}
    for cell in report.cells():
        task, schedule, horizon = cell
        info = report.tasks.get(task)
        curves = report.curves(cell)
        points = next(iter(curves.values()))[0]
        shown = reported_indices(points)
        title = info.title if info else task
        n_levels = len({r.level for r in report.results if (r.task, r.schedule, r.horizon) == cell})
        lines += ["", f"## {title} (`{task}`), schedule `{schedule}`, T = {horizon}", "",
                  f"{n_levels} level(s); up to {max(c[3] for c in curves.values())} (level, run) pairs per agent.", ""]
        header = ["rank", "agent"] + [f"regret at {int(points[k])}" for k in shown]
        header += [f"vs {report.baseline} at {int(points[k])}" for k in (shown[len(shown) // 2], shown[-1])]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join(["---:", ":---"] + ["---:"] * (len(header) - 2)) + "|")
        for rank, (label, (_, mean, sem, _n)) in enumerate(curves.items(), 1):
            row = [str(rank), label] + [_pm(float(mean[k]), float(sem[k])) for k in shown]
            for k in (shown[len(shown) // 2], shown[-1]):
                row.append("baseline" if label == report.baseline else
                           _verdict(pairs.get((task, schedule, horizon, int(points[k]), label))))
            lines.append("| " + " | ".join(row) + " |")
        if report.baseline not in curves:
            lines += ["", f"The baseline `{report.baseline}` has no runs here: no paired statistics."]
    return "\n".join(lines) + "\n"


def _curve_panel(ax: Any, report: OnlineReport, cell: Cell, colors: dict[str, Any], title: str) -> None:
    """One panel: every agent's mean cumulative regret of ``cell`` against requests served, with a SEM band."""
    for label, (x, y, sem, _) in report.curves(cell).items():
        band = np.nan_to_num(sem)
        ax.plot(x, y, lw=1.4, color=colors[label], label=label)
        ax.fill_between(x, y - band, y + band, color=colors[label], alpha=0.2, lw=0)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("requests served")
    ax.set_ylabel("cumulative exact regret")
    ax.grid(alpha=0.3)


def plot_regret_curves(report: OnlineReport, task: str, path: Path) -> Path:
    """Mean cumulative regret against requests served with SEM bands, one panel per (schedule, horizon) of
    ``task``, one line per agent (colours as in the paper protocol's plots)."""
    from iapo_gym.leaderboard.report.plots import _colors, figure_legend, plt

    cells = [c for c in report.cells() if c[0] == task]
    colors = _colors(sorted({r.label for r in report.results}))
    ncols = min(3, len(cells))
    nrows = math.ceil(len(cells) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    for ax, cell in zip(axes.flat, cells, strict=False):
        _curve_panel(ax, report, cell, colors, f"{cell[1]}, T = {cell[2]}")
    for ax in list(axes.flat)[len(cells):]:
        ax.set_visible(False)
    info = report.tasks.get(task)
    fig.suptitle(info.title if info else task, fontsize=10)
    fig.tight_layout()
    figure_legend(fig, axes)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_regret_grid(report: OnlineReport, path: Path, horizon: int | None = None) -> Path:
    """Every task's regret curves in one figure: a row per task, a column per schedule (at ``horizon``, default
    the largest of the report), one line per agent, on a log scale (agents' regrets differ by orders of
    magnitude); a cell without runs is left blank. For a benchmark's overview, where ``plot_regret_curves`` draws
    one task per file."""
    from iapo_gym.leaderboard.report.plots import _colors, figure_legend, plt

    horizon = max(c[2] for c in report.cells()) if horizon is None else horizon
    cells = {c for c in report.cells() if c[2] == horizon}
    if not cells:
        raise ValueError(f"the report has no runs at horizon {horizon}; it has "
                         f"{sorted({c[2] for c in report.cells()})}")
    tasks = sorted({c[0] for c in cells})
    schedules = list(dict.fromkeys(c[1] for c in report.cells() if c[2] == horizon))
    colors = _colors(sorted({r.label for r in report.results}))
    fig, axes = plt.subplots(len(tasks), len(schedules), figsize=(3.6 * len(schedules), 2.5 * len(tasks)),
                             squeeze=False)
    for i, task in enumerate(tasks):
        info = report.tasks.get(task)
        for j, schedule in enumerate(schedules):
            ax = axes[i, j]
            if (task, schedule, horizon) not in cells:
                ax.set_visible(False)
                continue
            _curve_panel(ax, report, (task, schedule, horizon), colors,
                         f"{info.title if info else task}: {schedule}")
            ax.set_xlabel("requests served" if i == len(tasks) - 1 else "")
            ax.set_ylabel("regret" if j == 0 else "")
            ax.set_yscale("log")
            ax.tick_params(labelsize=7)
    fig.tight_layout()
    figure_legend(fig, axes)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def curve_plot_name(task: str) -> str:
    """The file name of a task's regret-curve figure."""
    return f"regret_curves_{file_stem(task)}.png"


def write_online(report: OnlineReport, target: Path, plots: bool = True) -> dict[str, Path]:
    """Write online.md, online_summary.csv, online_pairwise.csv, online.json and (``plots``) the regret curves."""
    written: dict[str, Path] = {}
    written["online_markdown"] = target / "online.md"
    written["online_markdown"].write_text(online_markdown(report))
    written["online_summary_csv"] = target / "online_summary.csv"
    write_csv(written["online_summary_csv"], report.summary, OnlineSummaryRow)
    written["online_pairwise_csv"] = target / "online_pairwise.csv"
    write_csv(written["online_pairwise_csv"], report.pairs, OnlinePairRow)
    written["online_json"] = target / "online.json"
    payload = {"meta": report.meta, "test": report.test, "correction": report.correction, "alpha": report.alpha,
               "baseline": report.baseline, "tasks": {k: asdict(v) for k, v in report.tasks.items()
                                                      if k in {r.task for r in report.results}},
               "summary": [asdict(s) for s in report.summary], "pairwise": [asdict(p) for p in report.pairs]}
    written["online_json"].write_text(json.dumps(jsonable(payload), indent=1))
    if plots:
        for task in sorted({r.task for r in report.results}):
            written[f"regret_curves_{task}"] = plot_regret_curves(report, task, target / curve_plot_name(task))
    return written


def online_site_views(report: OnlineReport, assets: Path) -> list[dict[str, Any]]:
    """Draw each task's regret curves into ``assets`` and return what the site's online sections show."""
    views = []
    pairs = {(p.task, p.schedule, p.horizon, p.checkpoint, p.label): p for p in report.pairs}
    for task in sorted({r.task for r in report.results}):
        plot_regret_curves(report, task, assets / curve_plot_name(task))
        info = report.tasks.get(task)
        tables = []
        for cell in [c for c in report.cells() if c[0] == task]:
            curves = report.curves(cell)
            points = next(iter(curves.values()))[0]
            shown = reported_indices(points)
            rows = []
            for rank, (label, (_, mean, sem, n)) in enumerate(curves.items(), 1):
                regrets = [{"text": _pm(float(mean[k]), float(sem[k])), "sort": repr(float(mean[k]))} for k in shown]
                p = pairs.get((task, cell[1], cell[2], int(points[shown[-1]]), label))
                rows.append({"rank": rank, "label": label, "regrets": regrets, "n": n,
                             "verdict": "baseline" if label == report.baseline else _verdict(p).replace("**", ""),
                             "tone": "even" if p is None else {1: "win", -1: "loss", 0: "even"}[p.winner]})
            tables.append({"id": f"online-{file_stem(task)}-{cell[1]}-{cell[2]}", "schedule": cell[1],
                           "horizon": cell[2], "checkpoints": [int(points[k]) for k in shown], "rows": rows})
        title = info.title if info else task
        panels = ", ".join(f"{t['schedule']} T={t['horizon']}" for t in tables)
        alt = (f"Cumulative exact regret against requests served on {title}, one panel per schedule and horizon "
               f"({panels}), one line per agent with a band of one standard error.")
        views.append({"name": task, "anchor": f"online-{file_stem(task)}", "title": title, "tables": tables,
                      "plot": f"assets/{curve_plot_name(task)}", "plot_alt": alt})
    return views
