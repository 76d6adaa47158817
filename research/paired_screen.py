"""A tuning screen with common random numbers: every spec trains on the same env runs with the same agent seed.

The leaderboard derives each agent's seed from its spec, so two variants of one agent draw
different queries from the first step on, and a cell's difference carries both agents' draws.
Here every spec of a run gets one agent seed, so variants that differ only in a budget's tail
(``restore``) share their whole steps and their difference is the
tail's alone. It prints the first spec's mean regret (train-optimal test ACR minus the agent's)
and each other spec's paired gain over it (+: better) ± SEM, also as a share of the first spec's
regret. For tuning only (its seeds are not the leaderboard's); reports run through
``bench_challenger.py``.

    IAPO_GYM_OFFLINE=1 IAPO_GYM_DATA=../shared/iapo-release python research/paired_screen.py \\
        auto "auto:restore=0.25@r025" --task math --seed 90 --runs 200 --jobs 1 --budgets 3000 5000 10000
"""

from __future__ import annotations

import argparse
from functools import partial
from multiprocessing import Pool

import numpy as np

import agents
from iapo_gym.env import IAPOEnv
from iapo_gym.leaderboard.run.runner import run_setup
from iapo_gym.leaderboard.run.specs import parse_agent_spec, resolve_task
from iapo_gym.oracle import acr_from_q, greedy_policy, policy_arms, q_table
from iapo_gym.seeding import derive_seed


def run_regrets(run: int, task: str, seed: int, budgets: list[int], specs: list[str]) -> np.ndarray:
    """(specs, budgets) regrets of one run: each spec on the run's table and env seed, all with one agent seed."""
    setup = run_setup(resolve_task(task), run, seed)
    table = setup.run_table
    q_test = q_table(table, table.split_indices("test"))
    reference = np.array(greedy_policy(q_table(table, table.split_indices("train"))).arms, dtype=np.int64)
    ceiling = acr_from_q(q_test, reference, table.context_probs)
    agent_seed = derive_seed(seed, "paired-screen", task, run)
    out = np.zeros((len(specs), len(budgets)))
    for i, text in enumerate(specs):
        spec = parse_agent_spec(text)
        env = IAPOEnv(table=table)
        env.reset(seed=setup.env_seed)
        agent = agents.make(spec.name, seed=agent_seed, **spec.params)
        if getattr(agent, "anytime", False):
            policies = [policy for _, policy in agent.train_budgets(env, budgets)]
        else:  # a fresh agent and env per budget, as the leaderboard runs it
            policies = []
            for budget in budgets:
                env.reset(seed=setup.env_seed)
                policies.append(agents.make(spec.name, seed=agent_seed, **spec.params).train(env, budget))
        for j, policy in enumerate(policies):
            out[i, j] = ceiling - acr_from_q(q_test, policy_arms(policy, table), table.context_probs)
    return out


def screen(task: str, seed: int, runs: int, budgets: list[int], specs: list[str], jobs: int = 2) -> np.ndarray:
    """(runs, specs, budgets) regrets; the same whatever ``jobs`` (each run's seeds derive from its index)."""
    work = partial(run_regrets, task=task, seed=seed, budgets=sorted(budgets), specs=specs)
    if jobs <= 1:
        return np.array([work(run) for run in range(runs)])
    with Pool(jobs) as pool:
        return np.array(pool.map(work, range(runs)))


def report(regrets: np.ndarray, budgets: list[int], specs: list[str]) -> str:
    """The first spec's mean regret per budget, then each other spec's paired gain over it ± SEM (share of its regret)."""
    labels = [parse_agent_spec(s).label for s in specs]
    base = regrets[:, 0]
    lines = [f"| spec | {' | '.join(f'T={b}' for b in sorted(budgets))} |", "|---|" + "---:|" * len(budgets),
             f"| {labels[0]} (regret) | " + " | ".join(f"{v:.5f}" for v in base.mean(axis=0)) + " |"]
    sem = np.sqrt(regrets.shape[0])
    for i, label in enumerate(labels[1:], 1):
        gain = base - regrets[:, i]
        cells = [f"{g.mean():+.5f} ± {g.std(ddof=1) / sem:.5f} ({100 * g.mean() / r:+.0f} %)"
                 for g, r in zip(gain.T, base.mean(axis=0), strict=True)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+", help="leaderboard agent specs; the first is the reference")
    parser.add_argument("--task", required=True)
    parser.add_argument("--seed", type=int, required=True, help="a tuning root seed")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--budgets", type=int, nargs="+", default=[3000, 5000, 10000])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    regrets = screen(args.task, args.seed, args.runs, args.budgets, args.specs, args.jobs)
    print(f"{args.task}, tuning seed {args.seed}, {args.runs} paired runs")
    print(report(regrets, args.budgets, args.specs))


if __name__ == "__main__":
    main()
