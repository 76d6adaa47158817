"""Which phase of ``plugin_anytime`` loses the train-optimal prompt, and how a task's votes vary.

``regret_parts.py`` splits a store's regret into the prompt and the N part; this traces the
prompt part. Both read-outs use the leaderboard's own runs (tables, splits, env and agent seeds
of ``--seed``):

* ``plugin_anytime`` (``auto`` unless ``--spec``) is retrained on runs 0..R-1 with its trims
  recorded, and each context's loss (train-optimal arm minus chosen arm, test Q, weighted by the
  context's probability) is booked to the phase in which its train-optimal prompt left the live
  set: the whole steps, tail round k, or never (kept); the phases add up to the runs' mean
  regret as the leaderboard stores it for the same spec and seed;
* ``--votes``: per majority-vote task, the variance of one vote's gold indicator split into the
  within-(prompt, query) binomial part E[c (1 - c)], the queries' part and the prompt x query part.

    IAPO_GYM_OFFLINE=1 IAPO_GYM_DATA=../shared/iapo-release python benchmarks/where_lost.py \\
        --seed 77 --tasks math synthetic_bernoulli --budget 3000 --runs 200 --votes
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any

import numpy as np

import agents
from agents.challenger import AnytimePlugIn
from iapo_gym.env import IAPOEnv
from iapo_gym.leaderboard.run.runner import agent_seed_for, run_setup
from iapo_gym.leaderboard.run.specs import parse_agent_spec, resolve_task
from iapo_gym.oracle import greedy_policy, q_table


def _record_trims(agent: AnytimePlugIn) -> tuple[list[np.ndarray], list[int]]:
    """Wrap ``agent``'s trims and whole steps: each context's live set after every trim, and how many
    trims the whole steps made (the rest are the budget's tail)."""
    alive_after: list[np.ndarray] = []
    steps_end = [0]
    trim, advance = agent._trim, agent._advance

    def recording_trim(run: Any, target: Any) -> None:
        trim(run, target)
        alive_after.append(run.alive.copy())

    def recording_advance(run: Any, budget: int) -> None:
        advance(run, budget)
        steps_end[0] = len(alive_after)

    agent._trim = recording_trim  # type: ignore[method-assign]
    agent._advance = recording_advance  # type: ignore[method-assign]
    return alive_after, steps_end


def where_lost(task: str, seed: int, budget: int, runs: int, spec: str) -> str:
    """Each context's loss (train-optimal minus chosen, test Q) booked to the phase that trimmed its train-optimal prompt."""
    parsed = parse_agent_spec(spec)
    if not isinstance(agents.make(parsed.name, **parsed.params), AnytimePlugIn):
        raise ValueError(f"--spec must be a plugin_anytime spec, got {spec!r}")
    loss: dict[str, float] = defaultdict(float)
    for run in range(runs):
        setup = run_setup(resolve_task(task), run, seed)
        table = setup.run_table
        q_test = q_table(table, table.split_indices("test"))
        ref = np.array(greedy_policy(q_table(table, table.split_indices("train"))).arms)
        env = IAPOEnv(table=table)
        env.reset(seed=setup.env_seed)
        agent = agents.make(parsed.name, seed=agent_seed_for(seed, task, run, parsed), **parsed.params)
        assert isinstance(agent, AnytimePlugIn)
        alive_after, steps_end = _record_trims(agent)
        arms = np.array(agent.train(env, budget).arms)
        for c in range(q_test.shape[0]):
            lost = table.context_probs[c] * (q_test[c, ref[c, 0], ref[c, 1] - 1] - q_test[c, arms[c, 0], arms[c, 1] - 1])
            trim = next((i for i, alive in enumerate(alive_after) if not alive[c, ref[c, 0]]), None)
            phase = ("kept" if trim is None else "whole steps" if trim < steps_end[0]
                     else f"tail round {trim - steps_end[0] + 1}")
            loss[phase] += lost / runs
    total = sum(loss.values())
    cells = " | ".join(f"{phase} {value:.4f}" + (f" ({100 * value / total:.0f} %)" if total > 0 else "")
                       for phase, value in sorted(loss.items()))
    return f"| {task} | {budget} | {runs} | {total:.4f} | {cells} |"


def vote_variance(task: str, seed: int) -> str:
    """One vote's gold-indicator variance split into within-pair, query and prompt x query parts (run 0's table)."""
    table = run_setup(resolve_task(task), 0, seed).run_table
    if table.aggregator != "mv" or table.gold is None:
        return f"| {task} | (not majority vote) | | | |"
    gold_share = np.take_along_axis(table.probs, table.gold[None, :, None].repeat(table.n_prompts, 0), 2)[..., 0]
    per_query = gold_share.mean(axis=0)
    total = gold_share.mean() * (1.0 - gold_share.mean())
    within = float((gold_share * (1.0 - gold_share)).mean())
    return (f"| {task} | {total:.3f} | {within:.3f} ({100 * within / total:.0f} %) | {per_query.var():.3f} "
            f"| {(gold_share - per_query).var():.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True, help="the leaderboard root seed whose runs to retrain")
    parser.add_argument("--tasks", nargs="+", default=["math", "synthetic_bernoulli"])
    parser.add_argument("--spec", default="auto", help="a plugin_anytime leaderboard spec")
    parser.add_argument("--budget", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--votes", action="store_true", help="the vote-variance split of each task's table")
    args = parser.parse_args()
    print("| task | T | runs | loss | by phase |\n|---|---:|---:|---:|---|")
    for task in args.tasks:
        print(where_lost(task, args.seed, args.budget, args.runs, args.spec))
    if args.votes:
        print("\n| task | one vote's variance | within (prompt, query) | queries | prompt x query |\n|---|---:|---:|---:|---:|")
        for task in args.tasks:
            print(vote_variance(task, args.seed))


if __name__ == "__main__":
    main()
