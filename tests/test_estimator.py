"""The shared estimator: block and all-subset reuse against brute force and the exact oracle."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from agents.estimator import Estimator
from agents.scoring import bon_subset_weights, mv_subset_credit
from iapo_gym import IAPOEnv
from iapo_gym.utility import block_utilities, mv_credit
from tests.conftest import tiny_bon_table, tiny_mv_table

TABLES = {"mv": tiny_mv_table, "bon": tiny_bon_table}


def _env(kind: str, seed: int = 0, n_max: int = 7) -> IAPOEnv:
    env = IAPOEnv(table=TABLES[kind](seed=seed, n_max=n_max))
    env.reset(seed=seed)
    return env


def _brute_force(env: IAPOEnv, pulls, i: int, k: int, reuse: str) -> np.ndarray:
    """Summed utilities (C,) of pull i at scale k by explicit enumeration."""
    atoms = pulls.atoms[pulls.offsets[i]:pulls.offsets[i + 1]]
    if reuse == "blocks":
        groups = np.array([atoms[j * k:(j + 1) * k] for j in range(atoms.size // k)])
        weight = 1.0
    else:
        groups = np.array(list(itertools.combinations(atoms.tolist(), k)))
        weight = (atoms.size // k) / len(groups)
    p, q = np.full(len(groups), pulls.prompts[i]), np.full(len(groups), pulls.queries[i])
    return block_utilities(env.table, p, q, groups).sum(axis=1) * weight


@pytest.mark.parametrize("kind", ["mv", "bon"])
@pytest.mark.parametrize("reuse", ["blocks", "all_subsets"])
def test_pair_samples_match_enumeration(kind: str, reuse: str) -> None:
    env = _env(kind, seed=3)
    pulls = env.pull(np.array([0, 1, 2, 1, 0]), np.array([7, 5, 3, 1, 6]))
    pull_idx, ks, n_samples, values = Estimator(env, reuse).pair_samples(pulls)
    assert pull_idx.size == sum(pulls.ns)  # every k <= N of every pull
    np.testing.assert_array_equal(n_samples, pulls.ns[pull_idx] // ks)
    for e in range(pull_idx.size):
        np.testing.assert_allclose(values[:, e], _brute_force(env, pulls, int(pull_idx[e]), int(ks[e]), reuse),
                                   rtol=1e-10, atol=1e-12)


def test_bon_subset_weights_with_ties() -> None:
    values = np.array([3.0, 1.0, 3.0, 2.0, 1.0, 3.0])
    w = bon_subset_weights(values.size)
    ordered = np.sort(values)
    for k in range(1, values.size + 1):
        expected = np.mean([max(s) for s in itertools.combinations(values.tolist(), k)])
        assert ordered @ w[:, k - 1] == pytest.approx(expected, rel=1e-12)


def test_mv_subset_credit_with_ties() -> None:
    counts = np.array([[2, 2, 1], [3, 0, 3], [1, 1, 1], [4, 0, 0], [0, 2, 3]])
    gold = np.array([0, 2, 1, 1, 1])
    credit = mv_subset_credit(counts, gold, k_max=6)
    for r in range(counts.shape[0]):
        votes = np.repeat(np.arange(3), counts[r])
        for k in range(1, votes.size + 1):
            subsets = np.array(list(itertools.combinations(votes.tolist(), k)))
            sub_counts = np.stack([(subsets == b).sum(axis=1) for b in range(3)], axis=1)
            expected = mv_credit(sub_counts, np.full(len(subsets), gold[r])).mean()
            assert credit[r, k - 1] == pytest.approx(expected, abs=1e-12), (r, k)


def test_mv_subset_credit_of_a_large_pull_is_exact() -> None:
    """Many completions and a large k: the urn's exact credit, summed over vote vectors with integer binomials
    (Python's unbounded ints, C(20,000, 128) being past float64's range), is what ``mv_subset_credit`` gives."""
    counts = np.array([[9_000, 8_700, 2_300], [6_000, 6_000, 8_000]])
    gold = np.array([0, 1])
    k_max = 128
    credit = mv_subset_credit(counts, gold, k_max)
    assert np.isfinite(credit).all()
    for r in range(2):
        n = int(counts[r].sum())
        for k in (1, 2, 3, 64, 127, 128):
            total = Fraction(0)
            for g in range(k + 1):
                for a in range(k - g + 1):
                    b = k - g - a
                    others = [a, b]
                    top = max(others)
                    if g < top:
                        continue
                    tally = [0, 0, 0]
                    tally[gold[r]] = g
                    rest = [i for i in range(3) if i != gold[r]]
                    tally[rest[0]], tally[rest[1]] = a, b
                    weight = math.prod(math.comb(int(c), t) for c, t in zip(counts[r], tally, strict=True))
                    total += Fraction(weight, 1 + others.count(g))
            assert credit[r, k - 1] == pytest.approx(float(total / math.comb(n, k)), rel=1e-12, abs=1e-15), (r, k)


@pytest.mark.parametrize("kind", ["mv", "bon"])
@pytest.mark.parametrize("reuse", ["blocks", "all_subsets"])
def test_estimates_are_unbiased_against_exact_oracle(kind: str, reuse: str) -> None:
    env = _env(kind, seed=5, n_max=6)
    est = Estimator(env, reuse)
    n_pulls = 6000
    for _ in range(2):
        est.update(env.pull(np.repeat(np.arange(env.n_prompts), n_pulls), np.full(env.n_prompts * n_pulls, 6)))
    exact = env.q_table("train")
    # 12,000 pulls per prompt: standard errors are below 0.006 even at scale 6.
    np.testing.assert_allclose(est.mean(), exact, atol=0.02)
    assert np.all(est.counts[:, :, 0] == 12_000 * 6) and np.all(est.counts[:, :, 3] == 12_000)


def test_all_subsets_has_lower_variance_than_blocks() -> None:
    env = _env("mv", seed=2, n_max=6)
    pulls = env.pull(np.zeros(4000, np.int64), np.full(4000, 6))
    spread = {}
    for reuse in ("blocks", "all_subsets"):
        pull_idx, ks, n_samples, values = Estimator(env, reuse).pair_samples(pulls)
        at_3 = ks == 3
        spread[reuse] = (values[0, at_3] / n_samples[at_3]).var()
    assert spread["all_subsets"] < spread["blocks"]


def test_scale_and_context_restrictions() -> None:
    env = _env("bon", seed=1)
    pulls = env.pull(np.array([0, 1, 2]), np.array([6, 4, 2]))
    own = Estimator(env)
    own.update(pulls, scales="own")
    assert set(zip(*np.nonzero(own.counts[0]), strict=True)) == {(0, 5), (1, 3), (2, 1)}
    chosen = Estimator(env)
    chosen.update(pulls, scales=np.array([1, 4]))
    assert set(np.nonzero(chosen.counts[0])[1] + 1) == {1, 4}
    mask = np.zeros((env.n_prompts, env.n_max), dtype=bool)
    mask[1, :2] = True
    masked = Estimator(env)
    masked.update(pulls, arm_mask=mask)
    assert set(zip(*np.nonzero(masked.counts[0]), strict=True)) == {(1, 0), (1, 1)}
    per_context = Estimator(env)
    per_context.update(pulls, contexts=np.array([2, 0, 2]))
    assert per_context.counts[1].sum() == 0 and per_context.counts[3].sum() == 0
    assert per_context.counts[2, 0, 0] == 6 and per_context.counts[0, 1, 0] == 4 and per_context.counts[0, 0, 0] == 0
    full = Estimator(env)
    full.update(pulls)
    np.testing.assert_allclose(per_context.sums[2, 0], full.sums[2, 0])


def test_best_arms_and_reset() -> None:
    env = _env("mv")
    est = Estimator(env)
    rng = np.random.default_rng(0)
    mask = np.zeros(est.sums.shape, dtype=bool)
    mask[:, 1, :3] = True
    blind = est.best_arms(rng, mask)  # nothing seen: a random arm of the mask
    assert all(p == 1 and 1 <= n <= 3 for p, n in blind.arms)
    est.sums[:, 2, 4] = 5.0
    est.counts[:, 2, 4] = 1.0
    assert est.best_arms(rng).arms == ((2, 5),) * env.n_contexts
    est.reset()
    assert not est.counts.any() and not est.sums.any()


def test_bad_arguments_are_named() -> None:
    env = _env("mv")
    with pytest.raises(ValueError, match="reuse"):
        Estimator(env, "pairs")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="IAPOEnv"):
        Estimator(object())
    with pytest.raises(ValueError, match="scales"):
        Estimator(env).update(env.pull(np.array([0]), np.array([2])), scales="mine")
