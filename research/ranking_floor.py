"""How well each majority-vote estimator ranks (prompt, N) from a uniform design, against the exact floor.

For each run of a task (the leaderboard's resplits and seeds), every prompt gets the same ``m``
random train queries with ``n`` completions each (P * m * n completions in all); each context
then takes the (p, N) of largest estimate, and its regret is the train-optimal policy's test ACR
minus the pick's, as on the leaderboard. The estimators are ``PlugInEstimator`` settings
(``alpha``, ``curve``, ``slope``, ``pretest``); ``exact`` reads the true outcome
distributions of the same m queries, so it is what the design's query sample alone costs, and
the gap to it is what estimating each (prompt, query) distribution from n votes costs. A
diagnosis of where an agent's regret comes from (docs/agents.md, rounds 4 and 5), not a speed
figure:

    IAPO_GYM_OFFLINE=1 IAPO_GYM_DATA=../shared/iapo-release python research/ranking_floor.py \\
        --task math --seed 77 --runs 100 --designs 1x120 2x60 4x30
"""

from __future__ import annotations

import argparse

import numpy as np

from agents.plugin import PlugInEstimator
from iapo_gym import IAPOEnv
from iapo_gym.leaderboard.run.runner import run_setup
from iapo_gym.leaderboard.run.specs import resolve_task
from iapo_gym.oracle import acr_from_q, greedy_policy, optimal_policy, policy_arms, q_table
from iapo_gym.policy import Policy
from iapo_gym.seeding import derive_seed
from iapo_gym.tables import OutcomeTable

ESTIMATORS = {
    "pooled prior (alpha 4)": {"alpha": 4.0, "curve": 0.0},
    "response curves, free slopes (alpha 32, curve 3, slope 3)": {"alpha": 32.0, "curve": 3.0, "slope": 3.0,
                                                                  "pretest": 0.0},
    "curves, slopes fixed (slope 1e6)": {"alpha": 32.0, "curve": 3.0, "slope": 1e6, "pretest": 0.0},
    "curves, slopes pretested (auto: pretest 2, slope 1)": {"alpha": 32.0, "curve": 3.0, "slope": 1.0, "pretest": 2.0},
}


def test_acr(table: OutcomeTable, q_test: np.ndarray, policy: Policy) -> float:
    """The exact test ACR of ``policy`` read off the table's test Q-table ``q_test``."""
    return acr_from_q(q_test, policy_arms(policy, table), table.context_probs)


def regrets(task_name: str, seed: int, runs: int, designs: list[tuple[int, int]]) -> dict[tuple[str, int, int], np.ndarray]:
    """(estimator, n, m) -> per-run regret of the greedy pick from that design's estimate."""
    task = resolve_task(task_name)
    out: dict[tuple[str, int, int], list[float]] = {}
    for run in range(runs):
        table = run_setup(task, run, seed).run_table
        q_test = q_table(table, table.split_indices("test"))
        reference = test_acr(table, q_test, optimal_policy(table, table.split_indices("train")))
        env = IAPOEnv(table=table)
        train = env.queries("train")
        for n, m in designs:
            rng = np.random.default_rng(derive_seed(seed, "ranking_floor", task_name, run, n, m))
            queries = rng.choice(train, min(m, train.size), replace=False)
            out.setdefault(("exact distributions", n, m), []).append(
                reference - test_acr(table, q_test, optimal_policy(table, queries)))
            env.reset(seed=int(rng.integers(2**32)))
            prompts = np.repeat(np.arange(env.n_prompts), queries.size)
            pulls = env.pull(prompts, np.full(prompts.size, n), queries=np.tile(queries, env.n_prompts))
            for name, params in ESTIMATORS.items():
                est = PlugInEstimator(env, **params)
                est.update(pulls)
                out.setdefault((name, n, m), []).append(reference - test_acr(table, q_test, greedy_policy(est.mean())))
    return {key: np.array(values) for key, values in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="math")
    parser.add_argument("--seed", type=int, default=77, help="the leaderboard root seed of the resplits")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--designs", nargs="+", default=["1x120", "2x60", "4x30"], metavar="NxM",
                        help="n completions on m common queries per prompt")
    args = parser.parse_args()
    designs = []
    for text in args.designs:
        n, _, m = text.partition("x")
        if not (n.isdigit() and m.isdigit() and int(n) > 0 and int(m) > 0):
            parser.error(f"a design is NxM with positive integers, got {text!r}")
        designs.append((int(n), int(m)))
    result = regrets(args.task, args.seed, args.runs, designs)
    names = ["exact distributions", *ESTIMATORS]
    print(f"{args.task}, seed {args.seed}, {args.runs} runs: mean regret ± SEM of the greedy pick")
    print("| estimator | " + " | ".join(f"n {n}, m {m}" for n, m in designs) + " |")
    print("|---|" + "---:|" * len(designs))
    for name in names:
        cells = [result[(name, n, m)] for n, m in designs]
        print(f"| {name} | " + " | ".join(f"{v.mean():.4f} ± {v.std(ddof=1) / np.sqrt(v.size):.4f}" for v in cells) + " |")


if __name__ == "__main__":
    main()
