"""The regret a Best-of-N plug-in keeps with unlimited data: pooled raw or query-centred.

Q(c, p, N) of Best-of-N is a mean over queries of each query's expected maximum of N draws.
``PlugInEstimator`` reads it off one distribution per prompt, its outcomes pooled over its
queries; pooled raw, that distribution also carries the spread *between* queries, so even with
every outcome probability known exactly its maximum of N is another quantity than Q. This
script gives the estimator the exact train-split distributions (counts of ``SCALE`` times each
probability, so the estimator's own code reads them) and reports, per run of the leaderboard's
protocol, the test regret of the greedy policy of each reading against the train-optimal
policy: the floor no budget removes. ``center=True`` reads each score relative to its query's
fitted offset (``PlugInEstimator.query_offsets``).

Usage (any Best-of-N task the leaderboard knows; a synthetic task's run r is instance r):

    python benchmarks/bon_pooling_floor.py --task synthetic_categorical --runs 200
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from agents.challenger import PlugInEstimator
from iapo_gym import IAPOEnv
from iapo_gym.leaderboard.report.stats import mean_sem
from iapo_gym.leaderboard.run.runner import DEFAULT_ROOT_SEED, run_setup
from iapo_gym.leaderboard.run.specs import resolve_task
from iapo_gym.oracle import exact_acr, greedy_policy, q_table

#: Pseudo-completions per unit of probability: large enough that rounding moves no estimate visibly.
SCALE = 1_000_000


def limit_q(env: IAPOEnv, center: bool) -> np.ndarray:
    """(C, P, N_max) the plug-in's Q on the train split when every outcome probability is known."""
    table = env.table
    train = table.split_indices("train")
    est = PlugInEstimator(env, center=center)
    counts = np.rint(table.probs[:, train] * SCALE).astype(np.int64)
    # the tallies update() keeps as completions arrive, set at once
    est.atom_counts[:, train] = counts
    est._completions[:, train] = counts.sum(axis=2)
    est._reward_sum[:, train] = np.einsum("pqa,pqak->pqk", counts, table.atoms[:, train])
    prompts = np.arange(table.n_prompts)
    task = est._bon_value(prompts)
    n = np.arange(1, table.n_max + 1)
    mean_cost = table.cost_matrix()[:, train].mean(axis=1)
    return task + table.context_weights[:, -1, None, None] * mean_cost[None, :, None] * n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="synthetic_categorical", help="a Best-of-N task of the leaderboard")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=DEFAULT_ROOT_SEED,
                        help="root seed of the runs' resplits (data-backed tasks)")
    args = parser.parse_args()
    task = resolve_task(args.task)
    start = time.perf_counter()
    regrets: dict[bool, list[float]] = {False: [], True: []}
    for run in range(args.runs):
        table = run_setup(task, run, args.seed).run_table
        if table.aggregator != "bon":
            raise SystemExit(f"task {args.task!r} aggregates by {table.aggregator!r}; this script needs Best-of-N ('bon')")
        test = table.split_indices("test")
        ceiling = exact_acr(table, greedy_policy(q_table(table, table.split_indices("train"))), test)
        env = IAPOEnv(table=table)
        for center in (False, True):
            regrets[center].append(ceiling - exact_acr(table, greedy_policy(limit_q(env, center)), test))
    print(f"{args.task}, runs 0-{args.runs - 1} (root seed {args.seed}): test regret of the plug-in's greedy "
          f"policy with every train probability known ({time.perf_counter() - start:.0f} s)")
    print("| reading | mean regret ± SEM | runs with regret > 0.001 |")
    print("|---|---:|---:|")
    for center, label in ((False, "pooled raw"), (True, "query-centred (center=True)")):
        values = np.array(regrets[center])
        mean, sem, _ = mean_sem(values)
        print(f"| {label} | {mean:.4f} ± {sem:.4f} | {int((values > 0.001).sum())} / {values.size} |")


if __name__ == "__main__":
    main()
