"""Why `auto` chose another prompt than the train-optimal one: its readings of both against their true values.

Trains `auto` on one tuning level (``screen_tables.level_table``: the level's stored split, env and agent
seeds from the tuning root seed) at one budget and, for one context, prints for the train-optimal prompt
and the chosen one: whether each was live when the budget's tail began (after the tail's re-admission, a
prompt absent there was trimmed by a whole step for good), its completions and queries seen, and at
several N its estimate (the estimator's Best-of-N value at the end, with its cost term), its true value
on the queries it saw, its true value on the train split (what the policy is judged on) and how many of
its queries have at least N draws (where the correction reads the shrunk reading's bias at N itself; on
the others it holds the bias read where their draws end). The estimate's gap to the second column is its
error on the queries seen; the gap between the second and third, how much harder or easier those queries
are than the train split, which the estimate removes through the query offsets of the mean scores.

Usage: ``IAPO_GYM_OFFLINE=1 python research/trim_readings.py family:bon_shift 118 40000``
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from screen_tables import level_table

from agents.plugin.anytime import AnytimePlugIn
from iapo_gym import IAPOEnv
from iapo_gym.oracle import greedy_policy, q_table


def trim_readings(kind: str, level: int, seed: int, budget: int, context: int,
                  at_n: tuple[int, ...] = (1, 5, 10, 20)) -> list[dict[str, Any]]:
    """For the train-optimal and the chosen prompt of ``context`` (one record each, the optimal first):
    its index, whether it was live when the tail began, its completions and queries seen, and per N in
    ``at_n`` and N_max: the estimate, the true value on its seen queries and on the train split, and its
    queries with at least N draws."""
    table, env_seed, agent_seed = level_table(kind, level, seed)
    if not 0 <= context < table.n_contexts:
        raise SystemExit(f"--context must be in [0, {table.n_contexts}), got {context}")
    env = IAPOEnv(table=table)
    env.reset(seed=env_seed)
    agent = AnytimePlugIn(seed=agent_seed)
    policy = agent.train(env, budget)
    assert agent.last_tail is not None
    est = agent.last_tail.estimator
    q_train = q_table(table, table.split_indices("train"))
    optimal = int(greedy_policy(q_train).arms[context][0])
    chosen = int(policy.arms[context][0])
    columns = sorted({n for n in at_n if 1 <= n <= table.n_max} | {table.n_max})
    records = []
    for prompt in dict.fromkeys((optimal, chosen)):
        draws = est.draws(np.array([prompt]))[0]
        seen = np.flatnonzero(draws > 0)
        estimate = est.estimate(np.array([prompt]))[context, 0]
        on_seen = q_table(table, seen)[context, prompt]
        records.append({
            "prompt": prompt, "role": "optimal" if prompt == optimal else "chosen",
            "live_at_tail": bool(agent.last_tail.live[context, prompt]), "completions": int(draws.sum()),
            "queries_seen": int(seen.size),
            "rows": [(n, float(estimate[n - 1]), float(on_seen[n - 1]), float(q_train[context, prompt, n - 1]),
                      int((draws[seen] >= n).sum())) for n in columns],
        })
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", help="family:FAMILY, task:NAME, shape6 or shape10 (screen_tables' kinds)")
    parser.add_argument("level", type=int)
    parser.add_argument("budget", type=int)
    parser.add_argument("--context", type=int, default=0)
    parser.add_argument("--seed", type=int, default=90, help="the tuning root seed")
    args = parser.parse_args()
    for record in trim_readings(args.kind, args.level, args.seed, args.budget, args.context):
        print(f"{record['role']} prompt {record['prompt']}: live at the tail's start {record['live_at_tail']}, "
              f"{record['completions']} completions on {record['queries_seen']} queries")
        print("      N  estimate  true, seen queries  true, train  queries with >= N draws")
        for n, estimate, on_seen, on_train, reached in record["rows"]:
            print(f"   {n:4d}  {estimate:8.4f}  {on_seen:18.4f}  {on_train:11.4f}  {reached:6d}")


if __name__ == "__main__":
    main()
