"""The sequential baselines' fast paths change speed, not results.

* ``Estimator.update`` of one pull (the per-step path) is bit-identical to the general
  batch path (forced here by passing every scale explicitly);
* softmax, epsilon-greedy and UCB reproduce policies and env generator states frozen from
  the implementation before the fast paths (per-step recomputation of every estimate).
"""

from __future__ import annotations

import numpy as np
import pytest

from agents.baselines import UCB, EpsilonGreedy, Softmax
from agents.estimator import Estimator
from iapo_gym import IAPOEnv
from tests.conftest import tiny_bon_table, tiny_mv_table

TABLES = {"mv": tiny_mv_table, "bon": tiny_bon_table}
AGENTS = {"Softmax": Softmax, "EpsilonGreedy": EpsilonGreedy, "UCB": UCB}

# (table, agent, seed) -> (policy arms, env.np_random.random() after training, 12 digits);
# produced by the pre-fast-path implementation (same code, no incremental state).
FROZEN = {
    ("mv", "Softmax", 0): (((1, 1), (1, 1), (1, 1)), 0.616172591091),
    ("mv", "Softmax", 1): (((1, 3), (1, 3), (1, 3)), 0.162768107653),
    ("mv", "EpsilonGreedy", 0): (((1, 3), (1, 3), (1, 3)), 0.749747076105),
    ("mv", "EpsilonGreedy", 1): (((1, 3), (1, 3), (1, 1)), 0.954690122618),
    ("mv", "UCB", 0): (((1, 1), (1, 1), (1, 1)), 0.152548248391),
    ("mv", "UCB", 1): (((1, 13), (1, 13), (1, 1)), 0.810208506383),
    ("bon", "Softmax", 0): (((3, 8), (3, 9), (3, 9), (3, 9)), 0.219501323679),
    ("bon", "Softmax", 1): (((3, 11), (3, 10), (3, 7), (3, 10)), 0.846593529788),
    ("bon", "EpsilonGreedy", 0): (((3, 9), (3, 7), (3, 7), (3, 7)), 0.472731548505),
    ("bon", "EpsilonGreedy", 1): (((3, 8), (3, 8), (3, 4), (3, 8)), 0.551580306752),
    ("bon", "UCB", 0): (((2, 16), (3, 16), (3, 5), (3, 6)), 0.079633403657),
    ("bon", "UCB", 1): (((3, 12), (0, 13), (0, 10), (0, 13)), 0.511507690925),
}


@pytest.mark.parametrize("aggregator", ["mv", "bon"])
def test_single_pull_update_is_bit_identical_to_the_batch_path(aggregator: str) -> None:
    env = IAPOEnv(table=TABLES[aggregator](seed=5, n_prompts=4, n_max=16))
    env.reset(seed=3)
    fast, general = Estimator(env), Estimator(env)
    every_scale = np.arange(1, env.n_max + 1)
    rng = np.random.default_rng(0)
    for _ in range(60):
        pulls = env.pull(rng.integers(env.n_prompts, size=1), rng.integers(1, env.n_max + 1, size=1))
        fast.update(pulls)
        general.update(pulls, scales=every_scale)
    assert fast.counts.sum() > 0
    assert np.array_equal(fast.counts, general.counts)
    assert np.array_equal(fast.sums, general.sums)


@pytest.mark.parametrize("key", sorted(FROZEN))
def test_sequential_baselines_match_frozen_reference(key: tuple[str, str, int]) -> None:
    table, name, seed = key
    env = IAPOEnv(table=TABLES[table](seed=3, n_prompts=4, n_max=16))
    env.reset(seed=10 + seed)
    policy = AGENTS[name](seed=seed).train(env, 500)
    assert env.budget_used == 500
    arms, next_draw = FROZEN[key]
    assert policy.arms == arms
    assert round(float(env.np_random.random()), 12) == next_draw
