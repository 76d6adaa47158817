"""The sequential baselines' fast paths change speed, not results.

* ``Estimator.update`` of one pull (the per-step path) is bit-identical to the general
  batch path (forced here by passing every scale explicitly);
* softmax, epsilon-greedy and UCB reproduce policies and env generator states frozen from
  the implementation before the fast paths (per-step recomputation of every estimate).
"""

from __future__ import annotations

import hashlib

import gymnasium as gym
import numpy as np
import pytest

import agents
from agents.baselines import UCB, EpsilonGreedy, Softmax
from agents.estimator import Estimator
from iapo_gym import IAPOEnv
from iapo_gym.sampling import AliasSampler
from tests.conftest import MATH_RELEASE, tiny_bon_table, tiny_mv_table

TABLES = {"mv": tiny_mv_table, "bon": tiny_bon_table}
pytestmark = pytest.mark.usefixtures("sequential_path")  # the compiled loop and the numpy path
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


# (task, agent, seed) -> (sha256[:16] of the policy's arms, env.np_random.random() after training);
# recorded from the code before the Pulls-free step (main at 7128145), resplit(seed), reset(100 + seed), T = 3000.
RECORDED = {
    ("math", "softmax", 0): ("12c0a42941d8f68d", 0.266942618635),
    ("math", "softmax", 1): ("43b061d8edeb68b3", 0.958691191801),
    ("math", "epsilon_greedy", 0): ("77f06841a869768d", 0.903084789892),
    ("math", "epsilon_greedy", 1): ("b8ead5a53bd01cae", 0.434734668337),
    ("math", "ucb", 0): ("207ca7b6be1b1ee0", 0.849870921451),
    ("math", "ucb", 1): ("5e3078d4b72c6489", 0.511166830997),
    ("categorical", "softmax", 0): ("550f73962d2fe2e5", 0.858084775304),
    ("categorical", "softmax", 1): ("8fc79a04cc23feef", 0.692627158897),
    ("categorical", "epsilon_greedy", 0): ("831c59fdf1b03f57", 0.867700818784),
    ("categorical", "epsilon_greedy", 1): ("04383063567aa405", 0.830378363342),
    ("categorical", "ucb", 0): ("eab2efaa129d7fbe", 0.274533684174),
    ("categorical", "ucb", 1): ("20c27c68ba171a96", 0.068870451061),
}


def _recorded_env(task: str) -> IAPOEnv:
    """The recorded task's env: Synthetic-Categorical is generated (runs everywhere); MATH is read from the release
    file, and its cases skip where ../shared is absent."""
    if task == "categorical":
        return gym.make("IAPO-SyntheticCategorical-v0", instance=0).unwrapped
    if not MATH_RELEASE.is_file():
        pytest.skip(f"official MATH release not found at {MATH_RELEASE} (../shared is absent on this machine)")
    from iapo_gym.data.release import read_release

    return IAPOEnv(table=read_release(str(MATH_RELEASE))[0])


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_sequential_baselines_match_recorded_outputs(key: tuple[str, str, int]) -> None:
    task, name, seed = key
    env = _recorded_env(task)
    env.resplit(0.8, seed=seed)
    env.reset(seed=100 + seed)
    policy = agents.make(name, seed=seed).train(env, 3000)
    assert env.budget_used == 3000
    digest, next_draw = RECORDED[key]
    assert hashlib.sha256(repr(policy.arms).encode()).hexdigest()[:16] == digest
    assert round(float(env.np_random.random()), 12) == next_draw


def test_sample_row_is_sample_of_a_repeated_row() -> None:
    probs = np.random.default_rng(0).dirichlet(np.full(7, 0.3), size=5)
    sampler = AliasSampler(probs)
    a, b = np.random.default_rng(9), np.random.default_rng(9)
    for row, n in [(0, 1), (3, 17), (4, 64), (2, 5)]:
        assert np.array_equal(sampler.sample_row(row, n, a), sampler.sample(np.full(n, row), b))
    assert a.random() == b.random()
    counts = np.bincount(sampler.sample_row(1, 200_000, a), minlength=7) / 200_000
    assert np.abs(counts - probs[1]).max() < 0.005  # and it samples row 1, not another row


@pytest.mark.parametrize("aggregator", ["mv", "bon"])
def test_pull_one_draws_what_a_batch_of_one_draws(aggregator: str) -> None:
    table = TABLES[aggregator](seed=4, n_prompts=4, n_max=16)
    one = IAPOEnv(table=table)
    one.reset(seed=7)
    rng = np.random.default_rng()
    rng.bit_generator.state = one.np_random.bit_generator.state  # a copy of the env's generator
    sampler, pool = AliasSampler(table.probs.reshape(-1, table.n_atoms)), one.queries()
    for p, n in [(0, 1), (3, 16), (1, 9), (2, 2)]:
        query, atoms = one.pull_one(p, n)
        # the general batch path of IAPOEnv.pull for one pull, spelled out
        ref_query = pool[rng.integers(pool.size, size=1)]
        ref_atoms = sampler.sample(np.repeat(p * table.n_queries + ref_query, [n]), rng)
        assert query == int(ref_query[0])
        assert np.array_equal(atoms, ref_atoms)
    assert one.budget_used == 28
    assert one.np_random.random() == rng.random()
    with pytest.raises(ValueError, match="N must be in"):
        one.pull_one(0, 17)
    with pytest.raises(ValueError, match="prompt p must be in"):
        one.pull_one(4, 1)


def test_update_one_refuses_subset_reuse() -> None:
    env = IAPOEnv(table=tiny_mv_table(n_max=8))
    env.reset(seed=0)
    query, atoms = env.pull_one(0, 4)
    with pytest.raises(ValueError, match="reuse='blocks'"):
        Estimator(env, "all_subsets").update_one(0, 4, query, atoms)


def test_the_env_counts_every_completion_and_a_seeded_reset_does_not_clear_it() -> None:
    env = IAPOEnv(table=tiny_mv_table(n_max=8))
    env.reset(seed=0)
    env.pull(np.array([1]), np.array([5]))  # a batch of one (the single-pull branch of pull)
    env.pull_one(0, 3)
    env.pull(np.array([0, 2]), np.array([2, 4]))
    env.record_draws(2)
    assert env.completions_drawn == env.budget_used == 16
    _, info = env.reset(seed=0)  # a new experiment: budget_used starts over, the counter does not
    _, _, _, _, info = env.step((0, 2))
    assert info["budget_used"] == env.budget_used == 2 and env.completions_drawn == 18
    state = env.snapshot()
    env.pull_one(1, 4)
    env.restore(state)
    assert env.budget_used == 2 and env.completions_drawn == 18
