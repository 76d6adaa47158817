"""research/reading_bias.py: the regret split adds up to the policy's regret, and the records are the live prompts'."""

from __future__ import annotations

import numpy as np
from reading_bias import reading_bias, summarize
from screen_tables import level_table

from agents.plugin.anytime import AnytimePlugIn
from iapo_gym import IAPOEnv
from iapo_gym.oracle import acr_from_q, greedy_policy, policy_arms, q_table


def test_the_split_adds_up_to_the_regret_of_the_policy_auto_trains() -> None:
    """Tuning level ``bon_mixture`` 3 at 3K: the regret the split starts from is the train-optimal policy's train ACR
    less that of the policy a fresh `auto` with the level's seeds trains (recomputed here through the oracle, and
    not 0 on this level); its three parts are each >= 0 and add up to it; each record is a distinct prompt with
    completions, and the summary counts every record once."""
    records, split = reading_bias("family:bon_mixture", 3, 90, 3000)
    table, env_seed, agent_seed = level_table("family:bon_mixture", 3, 90)
    env = IAPOEnv(table=table)
    env.reset(seed=env_seed)
    policy = AnytimePlugIn(seed=agent_seed).train(env, 3000)
    q_train = q_table(table, table.split_indices("train"))
    ceiling = acr_from_q(q_train, np.array(greedy_policy(q_train).arms, dtype=np.int64), table.context_probs)
    regret = ceiling - acr_from_q(q_train, policy_arms(policy, table), table.context_probs)
    assert regret > 0 and abs(split["regret"] - regret) < 1e-12
    parts = [split["absent"], split["among_live"], split["n"]]
    assert min(parts) >= -1e-12 and abs(sum(parts) - split["regret"]) < 1e-12
    prompts = [r["prompt"] for r in records]
    assert records and len(set(prompts)) == len(prompts) and all(r["completions"] > 0 for r in records)
    assert sum(row[1] for row in summarize(records)) == len(records)
