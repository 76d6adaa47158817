"""Report figures (matplotlib, Agg backend): ACR against budget, pairwise win matrices, best policy."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

from iapo_gym.leaderboard.report.model import Report, budgets_of, cells_by_label, labels_by_rank, modal_arms, optimal_means  # noqa: E402
from iapo_gym.leaderboard.report.stats import win_matrix  # noqa: E402

_WIN_CMAP = ListedColormap(["#d7301f", "#f0f0f0", "#1a9850"])


def _colors(labels: list[str]) -> dict[str, tuple[float, ...]]:
    cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    return {label: cmap(i % cmap.N) for i, label in enumerate(sorted(labels))}


def plot_acr_vs_budget(report: Report, path: Path) -> Path:
    """Test ACR against training budget with SEM bands, one panel per task (the paper's strategy figure)."""
    tasks = sorted({s.task for s in report.summary})
    all_labels = sorted({s.label for s in report.summary})
    colors = _colors(all_labels)
    ncols = min(3, len(tasks))
    nrows = math.ceil(len(tasks) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    for ax, task in zip(axes.flat, tasks, strict=False):
        by_label = cells_by_label(report, task)
        for label in labels_by_rank(report, task):
            rows = by_label[label]
            x = np.array([r.budget for r in rows], dtype=float)
            y = np.array([r.acr_mean for r in rows])
            sem = np.nan_to_num(np.array([r.acr_sem for r in rows]))
            ax.plot(x, y, marker="o", ms=3, lw=1.4, color=colors[label], label=label)
            ax.fill_between(x, y - sem, y + sem, color=colors[label], alpha=0.2, lw=0)
        optimal = optimal_means(report, task)[0]
        ax.axhline(float(optimal), color="black", ls="--", lw=1, label="optimal (test)")
        info = report.tasks.get(task)
        ax.set_title(info.title if info else task)
        ax.set_xlabel("training budget T (completions)")
        ax.set_ylabel("test ACR")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    fig.tight_layout()
    figure_legend(fig, axes)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def figure_legend(fig: Any, axes: Any) -> None:
    """One legend below the figure for the lines of every panel in ``axes`` (each label once, in first-seen order)."""
    handles, names = [], []
    for ax in axes.flat:
        for h, n in zip(*ax.get_legend_handles_labels(), strict=True):
            if n not in names:
                handles.append(h)
                names.append(n)
    fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(5, len(names)),
               fontsize=8, frameon=False)


def plot_win_matrices(report: Report, task: str, path: Path) -> Path:
    """One win matrix per budget (row agent vs column agent: +1 win, -1 loss, 0 not significant)."""
    budgets = budgets_of(report, task)
    labels = labels_by_rank(report, task)
    ncols = min(3, len(budgets))
    nrows = math.ceil(len(budgets) / ncols)
    size = 1.2 + 0.42 * len(labels)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size * ncols + 0.6, size * nrows + 0.6), squeeze=False)
    for ax, budget in zip(axes.flat, budgets, strict=False):
        matrix = win_matrix(report.pairs, task, budget, labels)
        ax.imshow(matrix, cmap=_WIN_CMAP, vmin=-1, vmax=1)
        ax.imshow(np.where(np.eye(len(labels), dtype=bool), 1.0, np.nan), cmap="Greys", vmin=0, vmax=2.5)
        ax.set_xticks(np.arange(len(labels) + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(len(labels) + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="white", lw=1)
        ax.tick_params(which="minor", length=0)
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", rotation_mode="anchor", fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        for i in range(len(labels)):
            for j in range(len(labels)):
                if i != j and matrix[i, j]:
                    ax.text(j, i, "+" if matrix[i, j] > 0 else "−", ha="center", va="center", fontsize=8)
        ax.set_title(f"T = {budget}", fontsize=9)
    for ax in list(axes.flat)[len(budgets):]:
        ax.set_visible(False)
    info = report.tasks.get(task)
    fig.suptitle(f"{info.title if info else task}: row agent vs column agent (green +: row wins, red −: row "
                 f"loses, light grey: not significant)\n{report.test} test, {report.correction} correction, "
                 f"alpha {report.alpha}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_best_policy(report: Report, task: str, path: Path) -> Path | None:
    """For the task's best agent at its largest budget: how often each prompt and each N was chosen
    per context over the runs, with the most frequent test-optimal arm marked (white ring)."""
    labels = labels_by_rank(report, task)
    info = report.tasks.get(task)
    if not labels or info is None or task in report.meta.get("mixed_shapes", ()):
        return None  # runs on tables of different shapes (generated levels) have no common per-context view
    best, budget = labels[0], budgets_of(report, task)[-1]
    chosen, optimal = modal_arms(report.results, task, best, budget)
    n_ctx = len(chosen)
    prompt_freq = np.zeros((n_ctx, info.n_prompts))
    n_freq = np.zeros((n_ctx, info.n_max))
    for c, counter in enumerate(chosen):
        total = sum(counter.values())
        for (p, n, *_), k in counter.items():  # (p, N) or (p, N, rule): the rule is not drawn
            prompt_freq[c, p] += k / total
            n_freq[c, n - 1] += k / total
    height = 1.5 + 0.22 * n_ctx
    fig, (ax_p, ax_n) = plt.subplots(1, 2, figsize=(12, height), sharey=True)
    for ax, freq, what in ((ax_p, prompt_freq, "prompt p"), (ax_n, n_freq, "N")):
        image = ax.imshow(freq, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xlabel(what)
    for c, counter in enumerate(optimal):
        (op, on, *_), _ = counter.most_common(1)[0]
        ax_p.scatter([op], [c], s=40, facecolors="none", edgecolors="white", linewidths=1.2)
        ax_n.scatter([on - 1], [c], s=40, facecolors="none", edgecolors="white", linewidths=1.2)
    ax_n.set_xticks(range(0, info.n_max, 4), [str(n + 1) for n in range(0, info.n_max, 4)])
    names = list(info.context_names)[:n_ctx]
    ax_p.set_yticks(range(n_ctx), names, fontsize=7)
    fig.colorbar(image, ax=[ax_p, ax_n], label="share of runs", fraction=0.03)
    fig.suptitle(f"{info.title}: {best} at T={budget}, chosen prompt and N per context "
                 "(ring: test-optimal arm)", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
