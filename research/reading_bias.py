"""How far `auto`'s Best-of-N estimates lie from the truth, by the prompt's score spread and its queries.

Trains `auto` on tuning levels of a family (``screen_tables.level_table``: the level's stored split, env and agent
seeds from the tuning root seed) at one budget and, for every prompt live in context 0 when the budget's tail began
(after the tail's re-admission), reads its estimate at N = 1 and N = N_max (the estimator's value with its cost
term, read with every live prompt, as the halving and the read-out read it) against its true value on the train
split (what the policy is judged on). The prompts are grouped by whether they saw the reference's queries (the
most-read prompt's: the prompts the whole steps kept) or fewer (re-admitted or trimmed early), and by their score
spread, Q(N_max) - Q(1) on the train split (a risky prompt gains much from its best of N completions). A bias that
differs between the groups is what makes `auto` pick one kind of prompt over the better other kind. It also splits
the policy's train-split regret (weighted by the contexts' probabilities) into the train-optimal prompt's being
absent when the tail began, the choice among the prompts live then and the choice of N, and prints how far the
train-optimal and the chosen arm are read from their values.

Usage: ``IAPO_GYM_OFFLINE=1 python research/reading_bias.py family:bon_mixture 10000 --levels 0:9``
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from screen_tables import level_table

from agents.plugin.anytime import AnytimePlugIn
from iapo_gym import IAPOEnv
from iapo_gym.oracle import greedy_policy, q_table

#: The spread classes' bounds, in utility units: low, middle, high.
SPREAD_BOUNDS = (0.2, 0.4)


def reading_bias(kind: str, level: int, seed: int, budget: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One record per prompt live in context 0 when the tail began (its index, whether it saw as many queries as the
    most-read prompt, its spread on the train split, its completions, its estimate less its train-split value at
    N = 1 and at N_max, and ``sample_gap``: the mean score of its completions less their expected score on the
    queries they were drawn on, context 0's objective weights; below 0 where the draws it kept were unlucky), and
    the level's regret split: ``absent``, ``among_live`` and ``n`` add up to ``regret``; ``read_optimal`` and
    ``read_chosen`` are the train-optimal and the chosen arm's estimates less their values (all weighted by the
    contexts' probabilities)."""
    table, env_seed, agent_seed = level_table(kind, level, seed)
    env = IAPOEnv(table=table)
    env.reset(seed=env_seed)
    agent = AnytimePlugIn(seed=agent_seed)
    policy = agent.train(env, budget)
    assert agent.last_tail is not None
    est, live = agent.last_tail.estimator, agent.last_tail.live
    q_train = q_table(table, table.split_indices("train"))
    prompts = np.arange(table.n_prompts)
    draws = est.draws(prompts)
    seen = (draws > 0).sum(axis=1)
    read = np.flatnonzero(seen > 0)
    estimate = est.estimate(read)  # (C, len(read), N_max), read with every prompt that has draws
    assert table.atoms is not None, "reading_bias reads Best-of-N tables"
    counts = est.atom_counts  # (P, Q, M) the completions' outcomes
    objectives = table.context_weights[0, :-1]
    records = []
    for i, p in enumerate(read.tolist()):
        if not live[0, p]:
            continue
        queries = np.flatnonzero(draws[p] > 0)
        scores = table.atoms[p, queries] @ objectives  # (q, M)
        drawn_mean = (counts[p, queries] * scores).sum(axis=1) / draws[p, queries]
        true_mean = (table.probs[p, queries] * scores).sum(axis=1)
        records.append({
            "prompt": p, "reference_queries": bool(seen[p] == seen.max()),
            "spread": float(q_train[0, p, -1] - q_train[0, p, 0]), "completions": int(draws[p].sum()),
            "bias_1": float(estimate[0, i, 0] - q_train[0, p, 0]),
            "bias_max": float(estimate[0, i, -1] - q_train[0, p, -1]),
            "sample_gap": float(np.average(drawn_mean - true_mean, weights=draws[p, queries])),
        })
    contexts = np.arange(table.n_contexts)
    chosen_p = np.array([arm[0] for arm in policy.arms])
    chosen_n = np.array([arm[1] for arm in policy.arms]) - 1
    optimal = np.array(greedy_policy(q_train).arms, dtype=np.int64)  # (C, 2): each context's train-optimal (p, N)
    optimal_p, optimal_n = optimal[:, 0], optimal[:, 1] - 1
    best = q_train[contexts, optimal_p, optimal_n]
    live_best = np.where(live[:, :, None], q_train, -np.inf).max(axis=(1, 2))
    prompt_best = q_train[contexts, chosen_p].max(axis=1)
    got = q_train[contexts, chosen_p, chosen_n]
    place = np.searchsorted(read, np.stack([optimal_p, chosen_p]))
    probs = table.context_probs
    split = {
        "regret": float(probs @ (best - got)), "absent": float(probs @ (best - live_best)),
        "among_live": float(probs @ (live_best - prompt_best)), "n": float(probs @ (prompt_best - got)),
        "read_optimal": float(probs @ (estimate[contexts, place[0], optimal_n] - best)),
        "read_chosen": float(probs @ (estimate[contexts, place[1], chosen_n] - got)),
    }
    return records, split


def summarize(records: list[dict[str, Any]]) -> list[tuple[str, int, float, float, float, float]]:
    """(group, prompts, mean bias at N = 1, mean bias at N_max, SD of the bias at N_max, mean sample gap) per
    non-empty group of (reference queries or fewer) x spread class."""
    rows = []
    edges = (-np.inf, *SPREAD_BOUNDS, np.inf)
    for reference in (True, False):
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            group = [r for r in records if r["reference_queries"] == reference and lo <= r["spread"] < hi]
            if not group:
                continue
            at_max = np.array([r["bias_max"] for r in group])
            name = f"{'reference' if reference else 'fewer'} queries, spread [{lo:g}, {hi:g})"
            rows.append((name, len(group), float(np.mean([r["bias_1"] for r in group])), float(at_max.mean()),
                         float(at_max.std()), float(np.mean([r["sample_gap"] for r in group]))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", help="family:FAMILY or task:NAME (screen_tables' kinds)")
    parser.add_argument("budget", type=int)
    parser.add_argument("--levels", default="0:9", help="first:last tuning level (inclusive)")
    parser.add_argument("--seed", type=int, default=90, help="the tuning root seed")
    args = parser.parse_args()
    first, last = (int(x) for x in args.levels.split(":"))
    levels = [reading_bias(args.kind, level, args.seed, args.budget) for level in range(first, last + 1)]
    records = [r for level_records, _ in levels for r in level_records]
    means = {key: float(np.mean([split[key] for _, split in levels])) for key in levels[0][1]}
    print(f"train regret {means['regret']:.4f}: prompt absent at the tail's start {means['absent']:.4f}, "
          f"choice among the live prompts {means['among_live']:.4f}, choice of N {means['n']:.4f}; "
          f"read minus value: train-optimal arm {means['read_optimal']:+.4f}, chosen arm {means['read_chosen']:+.4f}")
    print("| prompts live at the tail's start | n | bias at N = 1 | bias at N_max | SD at N_max | sample gap |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, n, bias_1, bias_max, sd, gap in summarize(records):
        print(f"| {name} | {n} | {bias_1:+.4f} | {bias_max:+.4f} | {sd:.4f} | {gap:+.4f} |")


if __name__ == "__main__":
    main()
