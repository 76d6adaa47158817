"""One level's N-curves per generated family: every prompt's expected task reward against N, one panel per family.

usage: python tools/family_curves.py [--level K] [--families F ...] [--out PATH]

Each panel is level K (default 0, a tuning level) of a family: the exact expected task reward of every prompt at
N = 1..N_max on the level's train queries in its first context, costs left out (a Best-of-N level's first
objective weighting; majority vote: the vote's expected credit). Lines are coloured by the prompt's mean cost per
completion (log scale, cheapest dark), the best prompt at N = 1 is drawn red and the best at N_max blue (one line
when they are the same prompt). docs/tasks.md shows the figure this writes by default.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from iapo_gym.oracle import q_table
from iapo_gym.tasks.generated import families, get_family, level_table


def curves(family: str, level: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(reward (P, N_max) without costs, mean cost per completion (P,), a short description of the level)."""
    table = level_table(family, level)
    train = table.split_indices("train")
    q = q_table(table, train)[0]  # first context, cost included: weights (objectives..., -cost weight)
    cost = table.cost_matrix()[:, train].mean(axis=1)
    reward = q - table.context_weights[0, -1] * cost[:, None] * np.arange(1, table.n_max + 1)[None, :]
    shape = f"P {table.n_prompts}, Q {table.n_queries}, N_max {table.n_max}"
    if table.aggregator == "bon":
        shape += f", K {table.n_objectives}"
    return reward, cost, shape


def plot(fams: Sequence[str], level: int, out: Path) -> Path:
    """Write the panel grid to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    cols = 4
    rows = math.ceil(len(fams) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 2.6 * rows), squeeze=False)
    for ax, family in zip(axes.flat, fams, strict=False):
        reward, cost, shape = curves(family, level)
        n = np.arange(1, reward.shape[1] + 1)
        norm = LogNorm(vmin=cost.min(), vmax=max(cost.max(), cost.min() * 1.0001))
        colours = plt.get_cmap("viridis")(norm(cost))
        for p in range(reward.shape[0]):
            ax.plot(n, reward[p], color=colours[p], lw=0.7, alpha=0.6)
        first, last = int(np.argmax(reward[:, 0])), int(np.argmax(reward[:, -1]))
        ax.plot(n, reward[first], color="red", lw=1.8, label="best at N = 1")
        if last != first:
            ax.plot(n, reward[last], color="blue", lw=1.8, label="best at N_max")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{family} (level {level})\n{shape}", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(fams):]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=6, loc="lower right")
    fig.supxlabel("N (completions)", fontsize=9)
    fig.supylabel("expected task reward, first context, costs left out", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--level", type=int, default=0, help="the level of every family (default 0)")
    parser.add_argument("--families", nargs="+", default=list(families()), help="default: every family")
    parser.add_argument("--out", default="docs/tasks_figures/family_curves.png")
    args = parser.parse_args(argv)
    fams = [get_family(f).name for f in args.families]
    print(plot(fams, args.level, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
