"""The exact oracle against brute force and Monte Carlo, and the paper's worked example."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iapo_gym.exact import bon_expected_max, mv_expected_credit, stored
from iapo_gym.oracle import exact_acr, monte_carlo_acr, optimal_policy, q_table
from iapo_gym.sampling import AliasSampler
from iapo_gym.utility import mv_credit
from tests.conftest import tiny_bon_table, tiny_mv_table


def test_paper_worked_example() -> None:
    # Prompt 1: 40% / 90% on two queries; prompt 2: 62% on both; MV with N = 10 (section 3.3).
    probs = np.array([[0.6, 0.4], [0.1, 0.9], [0.38, 0.62]])
    credit = mv_expected_credit(probs, np.ones(3, dtype=int), 10)[:, 9]
    assert (credit[0] + credit[1]) / 2 == pytest.approx(0.63, abs=0.005)
    assert credit[2] == pytest.approx(0.77, abs=0.005)


def test_two_buckets_match_the_binomial_with_half_credit_ties() -> None:
    from scipy.stats import binom

    p = 0.37
    credit = mv_expected_credit(np.array([[1 - p, p]]), np.array([1]), 12)[0]
    for n in range(1, 13):
        k = np.arange(n + 1)
        expected = np.sum(binom.pmf(k, n, p) * np.where(2 * k > n, 1.0, np.where(2 * k == n, 0.5, 0.0)))
        assert credit[n - 1] == pytest.approx(expected, abs=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_buckets=st.integers(2, 4), n_max=st.integers(1, 6))
def test_majority_vote_matches_enumeration(seed: int, n_buckets: int, n_max: int) -> None:
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(n_buckets, 0.7), size=3)
    probs[0, 0] = 0.0  # a bucket that never comes out
    probs[0] /= probs[0].sum()
    gold = rng.integers(0, n_buckets, 3)
    exact = mv_expected_credit(probs, gold, n_max)
    for n in range(1, n_max + 1):
        total = np.zeros(3)
        for seq in itertools.product(range(n_buckets), repeat=n):
            counts = np.bincount(seq, minlength=n_buckets)
            total += np.prod(probs[:, list(seq)], axis=1) * mv_credit(np.broadcast_to(counts, (3, n_buckets)), gold)
        np.testing.assert_allclose(exact[:, n - 1], total, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_atoms=st.integers(1, 5), n_max=st.integers(1, 5))
def test_best_of_n_matches_enumeration(seed: int, n_atoms: int, n_max: int) -> None:
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(n_atoms), size=2)
    scores = rng.integers(-3, 4, size=(2, n_atoms)).astype(float)  # ties on purpose
    exact = bon_expected_max(scores, probs, n_max)
    for n in range(1, n_max + 1):
        total = np.zeros(2)
        for seq in itertools.product(range(n_atoms), repeat=n):
            total += np.prod(probs[:, list(seq)], axis=1) * scores[:, list(seq)].max(axis=1)
        np.testing.assert_allclose(exact[:, n - 1], total, atol=1e-12)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["mv", "bon"]))
def test_exact_acr_agrees_with_monte_carlo(seed: int, kind: str) -> None:
    table = (tiny_mv_table if kind == "mv" else tiny_bon_table)(seed=seed % 1000)
    rng = np.random.default_rng(seed)
    policy = [(int(rng.integers(table.n_prompts)), int(rng.integers(1, table.n_max + 1))) for _ in range(table.n_contexts)]
    exact = exact_acr(table, policy)
    estimate, se = monte_carlo_acr(table, policy, None, 40_000, rng)
    assert abs(estimate - exact) < 5 * se + 1e-9


def test_q_table_matches_monte_carlo_per_arm() -> None:
    table = tiny_bon_table(seed=3)
    q = q_table(table)
    rng = np.random.default_rng(0)
    for p, n in [(0, 1), (1, 4), (2, 6)]:
        for c in range(table.n_contexts):
            est, se = monte_carlo_acr(table.__class__(**{**_fields(table), "context_probs": np.eye(table.n_contexts)[c]}),
                                      [(p, n)] * table.n_contexts, None, 20_000, rng)
            assert abs(est - q[c, p, n - 1]) < 5 * se


def _fields(table):
    return {f: getattr(table, f) for f in ("task", "aggregator", "probs", "cost", "n_max", "context_weights", "context_names",
                                           "context_probs", "objective_names", "atoms", "gold", "prompts", "queries", "split")}


def test_optimal_policy_attains_the_maximum() -> None:
    table = tiny_mv_table(seed=5)
    q = q_table(table)
    policy = optimal_policy(table)
    assert exact_acr(table, policy) == pytest.approx(float(np.dot(table.context_probs, q.reshape(table.n_contexts, -1).max(1))))


def test_alias_sampler_frequencies() -> None:
    probs = np.array([[0.5, 0.25, 0.25, 0.0], [0.01, 0.01, 0.01, 0.97]])
    sampler = AliasSampler(probs)
    rng = np.random.default_rng(0)
    for row in range(2):
        draws = sampler.sample(np.full(200_000, row), rng)
        freq = np.bincount(draws, minlength=4) / draws.size
        np.testing.assert_allclose(freq, probs[row], atol=0.005)
        assert not np.any(draws[probs[row, draws] == 0])


def test_policy_outside_the_arm_range_is_rejected() -> None:
    table = tiny_mv_table()
    with pytest.raises(ValueError, match=r"outside prompts \[0, 3\) x N \[1, 6\]"):
        exact_acr(table, [(0, 7)] * 3)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_atoms=st.integers(1, 30), sparse=st.booleans())
def test_alias_tables_sample_exactly_the_table(seed: int, n_atoms: int, sparse: bool) -> None:
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(n_atoms, 0.3), size=50)
    if sparse:
        probs[rng.random(probs.shape) < 0.5] = 0.0
        probs[:, 0] += 1e-3
        probs /= probs.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(AliasSampler(probs).implied_probs(), probs, atol=1e-12)


@pytest.mark.parametrize("kind", ["mv", "bon"])
@pytest.mark.parametrize("seed", range(4))
def test_exact_acr_of_only_the_policys_arms_equals_the_full_q_table(seed: int, kind: str) -> None:
    from dataclasses import replace

    make = tiny_mv_table if kind == "mv" else tiny_bon_table
    table = make(seed=seed, n_prompts=4, n_queries=12)
    rng = np.random.default_rng(seed)
    queries = np.sort(rng.choice(table.n_queries, size=7, replace=False))
    for _ in range(5):
        arms = [(int(rng.integers(table.n_prompts)), int(rng.integers(1, table.n_max + 1))) for _ in range(table.n_contexts)]
        fresh = replace(table)  # empty cache: only the arms are computed
        lazy = exact_acr(fresh, arms, queries)
        assert stored(fresh) is None  # the full tensor was never built
        q = q_table(table, queries)
        full = float(np.dot(table.context_probs, [q[c, p, n - 1] for c, (p, n) in enumerate(arms)]))
        assert lazy == pytest.approx(full, abs=1e-12)
        assert exact_acr(table, arms, queries) == pytest.approx(full, abs=1e-12)  # cached path


@pytest.mark.parametrize("make", [tiny_mv_table, tiny_bon_table])
def test_streamed_q_table_of_tables_too_large_to_hold_equals_the_tensor_path(make, monkeypatch, tmp_path) -> None:
    from dataclasses import replace

    import iapo_gym.exact as exact
    import iapo_gym.utility as utility
    from iapo_gym.tables import read_metadata, write_table

    table = make(seed=3, n_prompts=5, n_queries=12)
    queries = np.array([0, 2, 3, 7, 11])
    expected = q_table(table, queries)  # whole tensor, cached
    monkeypatch.setattr(exact, "TENSOR_LIMIT_BYTES", 0)
    monkeypatch.setattr(utility, "_BLOCK_ELEMENTS", 2 * 5 * table.n_atoms)  # two prompts per block: three blocks
    big = replace(table)
    np.testing.assert_allclose(q_table(big, queries), expected, rtol=0, atol=1e-12)
    assert stored(big) is None  # never built whole
    assert not read_metadata(write_table(big, tmp_path / "t.h5"))["has_exact"]  # nor stored
