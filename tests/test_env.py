"""IAPOEnv: Gymnasium conformance, determinism, invalid actions, the batch path, splits."""

from __future__ import annotations

import pickle

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import iapo_gym
from iapo_gym.data import MissingTableError
from iapo_gym.env import IAPOEnv
from iapo_gym.tasks import TASKS
from tests.conftest import tiny_bon_table, tiny_mv_table

SYNTHETIC_IDS = ["IAPO-SyntheticBernoulli-v0", "IAPO-SyntheticCategorical-v0"]


def test_all_six_ids_are_registered() -> None:
    assert {spec.env_id for spec in TASKS.values()} <= set(gym.registry)
    assert len(TASKS) == 6


@pytest.mark.parametrize("env_id", SYNTHETIC_IDS)
def test_check_env_passes(env_id: str) -> None:
    env = gym.make(env_id, instance=1)
    check_env(env.unwrapped)
    env.close()


@pytest.mark.parametrize("env_id", [s.env_id for s in TASKS.values() if not s.synthetic])
def test_data_backed_ids_without_a_table_say_how_to_get_one(env_id: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("iapo_gym.paths.repo_data_dir", lambda: tmp_path / "nothing")
    with pytest.raises(MissingTableError, match="iapo-gym data"):
        gym.make(env_id)


@pytest.mark.parametrize("make_table", [tiny_mv_table, tiny_bon_table])
def test_same_seed_gives_bit_identical_reward_streams(make_table) -> None:
    def stream(seed: int) -> list[float]:
        env = IAPOEnv(table=make_table())
        env.reset(seed=seed)
        rewards = []
        for i in range(200):
            env.reset()
            rewards.append(float(env.step((i % 3, 1 + i % 6))[1]))
        return rewards

    assert stream(7) == stream(7)
    assert stream(7) != stream(8)


def test_step_returns_the_documented_info() -> None:
    env = IAPOEnv(table=tiny_bon_table())
    obs, info = env.reset(seed=0, options={"context": 2})
    np.testing.assert_array_equal(obs, np.float32(env.table.context_weights[2]))
    _, reward, terminated, truncated, info = env.step((1, 4))
    assert terminated and not truncated
    assert info["outcomes"].shape == (4, 2) and info["cost"].shape == (4,)
    w = env.table.context_weights[2]
    expected = (info["outcomes"] @ w[:-1]).max() + w[-1] * info["cost"].sum()
    assert reward == pytest.approx(expected)
    assert info["budget_used"] == env.budget_used == 4


def test_mv_step_outcomes_mark_correct_answers() -> None:
    env = IAPOEnv(table=tiny_mv_table())
    env.reset(seed=1)
    _, _, _, _, info = env.step((0, 5))
    buckets, correct = info["outcomes"][:, 0], info["outcomes"][:, 1]
    np.testing.assert_array_equal(correct, buckets == env.table.gold[info["query"]])


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ((3, 1), r"prompt p must be in \[0, 2\], got 3"),
        ((-1, 1), r"prompt p must be in \[0, 2\], got -1"),
        ((0, 0), r"N must be in \[1, 6\], got 0"),
        ((0, 7), r"N must be in \[1, 6\], got 7"),
        ((0, 2.5), r"N must be an integer in \[1, 6\], got 2.5"),
        ((True, 2), "prompt p must be an integer"),
        ((0, 1, 2, 3), "pair"),
        (np.zeros((2, 2), dtype=int), "shape"),
        ("ab", "pair"),
        # a stopping rule's index (tests/test_env_rules.py), the third part of an action
        ((0, 2, 6), r"rule r must be in \[0, 5\], got 6"),
        ((0, 2, -1), r"rule r must be in \[0, 5\], got -1"),
        ((0, 2, 1.5), r"rule r must be an integer in \[0, 5\], got 1.5"),
        ((0, 2, 1, 0), r"a pair \(p, N\) or a triple \(p, N, r\)"),
        (np.zeros(4, dtype=int), r"\(p, N\) or \(p, N, r\), got an array of shape \(4,\)"),
    ],
)
def test_invalid_actions_raise_and_change_nothing(action, message: str) -> None:
    env = IAPOEnv(table=tiny_mv_table())
    env.reset(seed=3)
    state = env.np_random.bit_generator.state
    with pytest.raises(ValueError, match=message):
        env.step(action)
    assert env.np_random.bit_generator.state == state and env.budget_used == 0


def test_batch_path_shares_generator_and_budget() -> None:
    env = IAPOEnv(table=tiny_bon_table())
    env.reset(seed=0)
    pulls = env.pull(np.array([0, 1, 2, 0]), np.array([1, 6, 3, 2]))
    assert env.budget_used == 12 == pulls.completions
    env.step((0, 2))
    assert env.budget_used == 14
    with pytest.raises(ValueError, match=r"N must be in \[1, 6\], got 9"):
        env.pull(np.array([0]), np.array([9]))
    assert env.budget_used == 14


def test_batch_utilities_equal_step_rewards() -> None:
    """A pull's utility under the step's context is exactly what step returns."""
    env_a, env_b = IAPOEnv(table=tiny_bon_table()), IAPOEnv(table=tiny_bon_table())
    env_a.reset(seed=5, options={"context": 1})
    env_b.reset(seed=5, options={"context": 1})
    reward = env_a.step((2, 5))[1]
    utilities = env_b.utilities(env_b.pull(np.array([2]), np.array([5])))
    assert utilities.shape == (4, 1) and utilities[1, 0] == reward


def test_block_utilities_cut_pulls_into_disjoint_blocks() -> None:
    env = IAPOEnv(table=tiny_mv_table())
    env.reset(seed=0)
    pulls = env.pull(np.array([0, 1, 2]), np.array([6, 5, 2]))
    pull_index, utilities = env.block_utilities(pulls, 2)
    np.testing.assert_array_equal(pull_index, [0, 0, 0, 1, 1, 2])
    _, blocks = pulls.blocks(2)
    np.testing.assert_array_equal(blocks[3], pulls.atoms[6:8])
    assert utilities.shape == (3, 6)
    np.testing.assert_array_equal(pulls.counts(3).sum(axis=1), [6, 5, 2])


def test_batch_draws_follow_the_table() -> None:
    table = tiny_bon_table()
    env = IAPOEnv(table=table)
    env.reset(seed=0)
    pulls = env.pull(np.zeros(2000, dtype=int), np.full(2000, 6), queries=np.full(2000, 4))
    freq = np.bincount(pulls.atoms, minlength=table.n_atoms) / pulls.completions
    np.testing.assert_allclose(freq, table.probs[0, 4], atol=0.01)


def test_splits_and_resplit() -> None:
    env = IAPOEnv(table=tiny_mv_table(n_queries=50), split="test")
    test_queries = set(env.queries("test").tolist())
    env.reset(seed=0)
    assert set(env.pull(np.zeros(300, int), np.ones(300, int)).queries.tolist()) <= test_queries
    env.resplit(0.8, seed=1)
    train, test = env.queries("train"), env.queries("test")
    assert (train.size, test.size) == (40, 10) and not set(train) & set(test)
    q_before = env.q_table("test")
    env.resplit(0.8, seed=1)
    np.testing.assert_array_equal(env.q_table("test"), q_before)
    env.resplit(0.8, seed=2)
    assert not np.array_equal(env.q_table("test"), q_before)
    with pytest.raises(ValueError, match="train_fraction must be in"):
        env.resplit(1.5)


def test_env_pickles() -> None:
    env = gym.make("IAPO-SyntheticBernoulli-v0")
    env.reset(seed=0)
    clone = pickle.loads(pickle.dumps(env))
    assert clone.step((1, 3))[1] == env.step((1, 3))[1]


def test_evaluate_accepts_policy_forms() -> None:
    env = gym.make("IAPO-SyntheticBernoulli-v0")
    arms = [(0, 1), (1, 3), (2, 5)]
    exact = iapo_gym.evaluate(arms, env)
    assert iapo_gym.evaluate(dict(enumerate(arms)), env) == exact
    assert iapo_gym.evaluate(iapo_gym.Policy(tuple(arms)), env) == exact
    assert iapo_gym.evaluate(lambda c: arms[c], env) == exact
    assert abs(iapo_gym.evaluate(arms, env, method="monte_carlo", n_samples=20_000, seed=0) - exact) < 0.03


def test_single_pull_path_draws_what_the_batch_path_draws() -> None:
    """The one-pull fast path consumes the generator exactly as the batch path's calls would."""
    ref, one = IAPOEnv(table=tiny_bon_table()), IAPOEnv(table=tiny_bon_table())
    ref.reset(seed=3)
    one.reset(seed=3)
    for i in range(30):
        p, n = i % 3, 1 + i % 6
        got = one.pull(np.array([p]), np.array([n]))
        pool = ref.queries()
        q = pool[ref.np_random.integers(pool.size, size=1)]  # the batch path's calls, spelled out
        atoms = ref._get_sampler().sample(np.repeat(p * ref.table.n_queries + q, n), ref.np_random)
        assert got.queries[0] == q[0] and np.array_equal(got.atoms, atoms)
        np.testing.assert_array_equal(got.offsets, [0, n])
    assert one.np_random.bit_generator.state == ref.np_random.bit_generator.state
    assert one.budget_used == sum(1 + i % 6 for i in range(30))
