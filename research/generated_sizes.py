"""The size distribution of the generated families and the time to build a level with its exact tensor.

    python research/generated_sizes.py --levels 0:199            # sizes (fast)
    python research/generated_sizes.py --levels 0:49 --timing    # also build + exact seconds per level
    python research/generated_sizes.py --levels 0:49 --reversals # also how often the best prompt changes with N
    python research/generated_sizes.py --levels 0:11 --votes     # also where majority votes go wrong (MV only)

Prints one Markdown row per family: median [10th - 90th percentile] of prompts, train queries, N_max, atoms,
objectives and contexts over the levels (with --reversals, the share of levels whose best prompt at N = 1 is not
the best at N_max in the first context, costs left out; with --timing, the median and largest seconds per level, also as
ratios to building the paper's Synthetic-Categorical instance 0 with its exact tensor, timed in the same run; with
--votes, for majority-vote families, the medians over levels of ``vote_falls``: the share of queries where the vote
of N_max is right less often than one completion for at least half of the prompts, and the share of (prompt, query)
pairs where it is; with --math PATH the same for the MATH release table first).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from iapo_gym.exact import exact_reward
from iapo_gym.oracle import q_table
from iapo_gym.tables import OutcomeTable
from iapo_gym.tasks.generated import families, level_table, parse_levels


def _q(values: list[float]) -> str:
    a = np.asarray(values, dtype=float)
    lo, mid, hi = np.quantile(a, [0.1, 0.5, 0.9], method="nearest")
    return f"{mid:g} [{lo:g} - {hi:g}]"


def vote_falls(table: OutcomeTable) -> tuple[float, float]:
    """(share of queries where the N_max vote is right less often than one completion for at least half of the
    prompts, share of (prompt, query) pairs where it is), from the exact expected vote credit."""
    credit = exact_reward(table).reward[0]  # (P, Q, N_max)
    falls = credit[:, :, -1] < credit[:, :, 0]
    return float((falls.mean(axis=0) >= 0.5).mean()), float(falls.mean())


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="0:199", help="A:B, both included")
    parser.add_argument("--timing", action="store_true", help="also time building each level and its exact tensor")
    parser.add_argument("--reversals", action="store_true", help="also the share of levels where the best prompt "
                        "at N = 1 is not the best at N_max (first context, costs left out)")
    parser.add_argument("--votes", action="store_true", help="also where majority votes go wrong (see above)")
    parser.add_argument("--math", help="with --votes: the MATH release file (MATH_final.pkl), for a reference row")
    parser.add_argument("--families", nargs="+", default=list(families()))
    args = parser.parse_args()
    if args.votes and args.math:
        from iapo_gym.data.release import read_release

        queries, pairs = vote_falls(read_release(args.math, task="math")[0])
        print(f"MATH release table: votes worse on {queries:.0%} of queries (for >= half the prompts), "
              f"{pairs:.0%} of (prompt, query) pairs")
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
    if args.votes:
        head += " votes worse: queries / pairs |"
    if args.timing:
        head += " seconds (median / max) | x baseline (median / max) |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for family in args.families:
        stats: dict[str, list[float]] = {k: [] for k in ("P", "Q", "N", "M", "K", "C", "paper", "length", "s", "rev",
                                                          "vq", "vp")}
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
            if args.votes and table.aggregator == "mv":
                falls = vote_falls(table)
                stats["vq"].append(falls[0])
                stats["vp"].append(falls[1])
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
        if args.votes:
            row += (f" {np.median(stats['vq']):.0%} / {np.median(stats['vp']):.0%} |" if stats["vq"] else " - |")
        if args.timing:
            row += (f" {np.median(stats['s']):.2f} / {np.max(stats['s']):.2f} | "
                    f"{np.median(stats['s']) / baseline:.2f} / {np.max(stats['s']) / baseline:.2f} |")
        print(row, flush=True)


if __name__ == "__main__":
    main()
