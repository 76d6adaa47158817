"""The issue-7 ceiling (research/rb_ceiling.py): PSST reading every pull as exact per-query means."""

from __future__ import annotations

import numpy as np
import pytest
from rb_ceiling import QueryOracleEstimator, QueryOraclePSST

from agents.estimator import Estimator
from iapo_gym import IAPOEnv
from iapo_gym.oracle import q_table
from tests.conftest import tiny_bon_table, tiny_mv_table

TABLES = {"mv": tiny_mv_table, "bon": tiny_bon_table}


def _env(kind: str, seed: int) -> IAPOEnv:
    env = IAPOEnv(table=TABLES[kind](seed=seed, n_max=6))
    env.reset(seed=seed)
    return env


def _exact_utility(env: IAPOEnv, prompt: int, query: int, k: int) -> np.ndarray:
    """(C,) exact expected utility of k completions of ``prompt`` on ``query``, cost included: Q on that one query."""
    return q_table(env.table, np.array([query]))[:, prompt, k - 1]


@pytest.mark.parametrize("kind", ["mv", "bon"])
@pytest.mark.parametrize("batch", [1, 5])
def test_ceiling_samples_are_exact_per_query_means(kind: str, batch: int) -> None:
    # batch = 1 is the single-pull update, which must not fall back to reading the blocks.
    env = _env(kind, seed=4)
    pulls = env.pull(np.arange(batch) % env.n_prompts, np.full(batch, 6))
    est = QueryOracleEstimator(env)
    est.update(pulls)
    blocks = Estimator(env, "blocks")
    blocks.update(pulls)
    np.testing.assert_array_equal(est.counts, blocks.counts)  # the paper's bookkeeping, floor(N / k) per scale
    expected = np.zeros(est.sums.shape)
    ks = np.arange(1, 7)
    for i in range(batch):
        p, q = int(pulls.prompts[i]), int(pulls.queries[i])
        expected[:, p, :] += np.stack([_exact_utility(env, p, q, k) for k in ks], axis=1) * (6 // ks)
    np.testing.assert_allclose(est.sums, expected, rtol=1e-12, atol=1e-12)
    # No completion noise: a pull's value depends on its query only, not on the completions drawn.
    redrawn = env.pull(pulls.prompts, pulls.ns, pulls.queries)
    again = QueryOracleEstimator(env)
    again.update(redrawn)
    np.testing.assert_array_equal(again.sums, est.sums)


def test_ceiling_is_unbiased_against_exact_oracle() -> None:
    env = _env("mv", seed=5)
    est = QueryOracleEstimator(env)
    est.update(env.pull(np.repeat(np.arange(env.n_prompts), 20_000), np.full(env.n_prompts * 20_000, 6)))
    np.testing.assert_allclose(est.mean(), env.q_table("train"), atol=0.01)


def test_query_oracle_psst_trains_within_budget() -> None:
    env = _env("bon", seed=2)
    policy = QueryOraclePSST(seed=0).train(env, 600)
    assert env.budget_used <= 600
    assert len(policy.arms) == env.n_contexts
