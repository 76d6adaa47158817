"""Regret (mean ± SEM over runs) against the budget, one panel per task: the figure of bench_rb and bench_challenger."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from iapo_gym.leaderboard.report.stats import mean_sem

#: (task, budget) -> label -> (reference ACRs, ACRs, ...) per run; regret = reference - ACR.
Cells = Mapping[tuple[str, int], Mapping[str, Sequence[np.ndarray]]]


def plot_regret(cells: Cells, labels: Sequence[str], path: Path,
                styles: Mapping[str, tuple[str, str, str, str]] | None = None) -> Path:
    """Write the figure to ``path``; ``styles`` maps a label to (colour, marker, line style, legend name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = "os^vD<>"
    style: dict[str, tuple[str, str, str, str]] = {
        label: (f"C{j}", markers[j % len(markers)], "-", label) for j, label in enumerate(labels)}
    style.update(styles or {})
    tasks = sorted({task for task, _ in cells})
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.6 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        budgets = sorted(b for t, b in cells if t == task)
        for label in labels:
            stats = [mean_sem(cells[(task, b)][label][1] - cells[(task, b)][label][0]) for b in budgets]
            mean = np.array([s[0] for s in stats])
            sem = np.array([s[1] for s in stats])
            color, marker, line, name = style[label]
            kwargs: dict[str, Any] = {"marker": marker, "linestyle": line, "color": color, "label": name}
            ax.plot(budgets, mean, **kwargs)
            ax.fill_between(budgets, mean - sem, mean + sem, color=color, alpha=0.15)
        ax.set_xscale("log")
        ax.set_xticks(budgets, [f"{b // 1000}K" for b in budgets])
        ax.minorticks_off()
        ax.set_title(task)
        ax.set_xlabel("training budget T (completions)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("regret vs train-optimal (test ACR)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
