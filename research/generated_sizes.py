"""The size distribution of the generated families and the time to build a level with its exact tensor.

    python research/generated_sizes.py --levels 0:199            # sizes (fast)
    python research/generated_sizes.py --levels 0:49 --timing    # also build + exact seconds per level
    python research/generated_sizes.py --levels 0:49 --reversals # also how often the best prompt changes with N

Prints one Markdown row per family: median [10th - 90th percentile] of prompts, train queries, N_max, atoms,
objectives and contexts over the levels (with --reversals, the share of levels whose best prompt at N = 1 is not
the best at N_max in the first context, costs left out; with --timing, the median and largest seconds per level, also as
ratios to building the paper's Synthetic-Categorical instance 0 with its exact tensor, timed in the same run).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from iapo_gym.exact import exact_reward
from iapo_gym.oracle import q_table
from iapo_gym.tasks.generated import families, level_table, parse_levels


def _q(values: list[float]) -> str:
    a = np.asarray(values, dtype=float)
    lo, mid, hi = np.quantile(a, [0.1, 0.5, 0.9], method="nearest")
    return f"{mid:g} [{lo:g} - {hi:g}]"


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="0:199", help="A:B, both included")
    parser.add_argument("--timing", action="store_true", help="also time building each level and its exact tensor")
    parser.add_argument("--reversals", action="store_true", help="also the share of levels where the best prompt "
                        "at N = 1 is not the best at N_max (first context, costs left out)")
    parser.add_argument("--families", nargs="+", default=list(families()))
    args = parser.parse_args()
    levels = parse_levels(args.levels)
    baseline = math.nan
    if args.timing:
        from iapo_gym.tasks.synthetic import synthetic_categorical

        runs = []
        for _ in range(3):
            start = time.perf_counter()
            exact_reward(synthetic_categorical(0))
            runs.append(time.perf_counter() - start)
        baseline = float(np.median(runs))
        print(f"baseline: Synthetic-Categorical instance 0 built with its exact tensor in {baseline:.2f} s (median of 3)")
    head = "| family | prompts | train queries | N_max | atoms | objectives | contexts | paper contexts | length costs |"
    if args.reversals:
        head += " best prompt changes with N |"
    if args.timing:
        head += " seconds (median / max) | x baseline (median / max) |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for family in args.families:
        stats: dict[str, list[float]] = {k: [] for k in ("P", "Q", "N", "M", "K", "C", "paper", "length", "s", "rev")}
        for level in levels:
            start = time.perf_counter()
            table = level_table(family, level)
            if args.timing:
                exact_reward(table)
                stats["s"].append(time.perf_counter() - start)
            params = json.loads(table.attrs["params"])
            if args.reversals:
                train = table.split_indices("train")
                reward = q_table(table, train)[0] - table.context_weights[0, -1] * np.outer(
                    table.cost_matrix()[:, train].mean(axis=1), np.arange(1, table.n_max + 1))
                stats["rev"].append(int(np.argmax(reward[:, 0])) != int(np.argmax(reward[:, -1])))
            stats["P"].append(table.n_prompts)
            stats["Q"].append(table.split_indices("train").size)
            stats["N"].append(table.n_max)
            stats["M"].append(table.n_atoms)
            stats["K"].append(table.n_objectives)
            stats["C"].append(table.n_contexts)
            stats["paper"].append(params["contexts"] == "paper")
            stats["length"].append(params["cost_mode"] == "length")
        row = (f"| {family} | {_q(stats['P'])} | {_q(stats['Q'])} | {_q(stats['N'])} | {_q(stats['M'])} | "
               f"{_q(stats['K'])} | {_q(stats['C'])} | {np.mean(stats['paper']):.0%} | {np.mean(stats['length']):.0%} |")
        if args.reversals:
            row += f" {np.mean(stats['rev']):.0%} |"
        if args.timing:
            row += (f" {np.median(stats['s']):.2f} / {np.max(stats['s']):.2f} | "
                    f"{np.median(stats['s']) / baseline:.2f} / {np.max(stats['s']) / baseline:.2f} |")
        print(row, flush=True)


if __name__ == "__main__":
    main()
