"""The grouped Best-of-N kernel (``iapo_gym.exact.bon_weighted_max``) against the per-weighting formula,
enumeration and Monte Carlo, and the streamed Q-table's memory bound."""

from __future__ import annotations

import itertools
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import iapo_gym.exact as exact
import iapo_gym.utility as utility
from iapo_gym.exact import atom_sets, bon_expected_max, bon_weighted_max, stored
from iapo_gym.oracle import q_table
from iapo_gym.tables import OutcomeTable


def per_weighting(atoms: np.ndarray, probs: np.ndarray, weights: np.ndarray, n_max: int) -> np.ndarray:
    """The reference: ``bon_expected_max`` of every weighting's scores, one weighting at a time."""
    return np.stack([bon_expected_max(atoms @ w, probs, n_max) for w in weights])


def grid_atoms(n_prompts: int, n_queries: int, side: int, n_objectives: int, rng: np.random.Generator) -> np.ndarray:
    """(P, Q, M, K) atoms: one integer grid for every row (ties under many weightings), a few rows with their own."""
    points = np.stack(np.meshgrid(*[np.arange(side)] * n_objectives, indexing="ij"), -1).reshape(-1, n_objectives)
    atoms = np.broadcast_to(points.astype(float), (n_prompts, n_queries) + points.shape).copy()
    atoms[0, :2] = rng.integers(-2, 3, size=(2,) + points.shape)  # two rows with atoms of their own
    return atoms


def tie_weights(n_objectives: int, rng: np.random.Generator, n: int) -> np.ndarray:
    """Distinct weightings on a coarse lattice (equal and rational weights: ties between grid atoms)."""
    lattice = rng.integers(0, 4, size=(n, n_objectives)) / 3.0
    lattice[0] = 1.0  # equal weights: every anti-diagonal of the grid ties
    return np.unique(lattice, axis=0)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_objectives=st.integers(1, 3), zero_mass=st.booleans())
def test_grouped_kernel_equals_the_per_weighting_formula(seed: int, n_objectives: int, zero_mass: bool) -> None:
    rng = np.random.default_rng(seed)
    side = {1: 7, 2: 4, 3: 3}[n_objectives]
    atoms = grid_atoms(4, 6, side, n_objectives, rng)
    probs = rng.dirichlet(np.full(atoms.shape[2], 0.5), size=atoms.shape[:2])
    if zero_mass:
        probs[rng.random(probs.shape) < 0.3] = 0.0
        probs[..., -1] += 1e-3
        probs /= probs.sum(axis=-1, keepdims=True)
    weights = tie_weights(n_objectives, rng, 12)
    n_max = int(rng.integers(1, 20))
    assert atom_sets(atoms)[0].shape[0] * exact._MIN_SHARE <= 24  # the grouped path runs
    expected = per_weighting(atoms, probs, weights, n_max)
    np.testing.assert_allclose(bon_weighted_max(atoms, probs, weights, n_max), expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(bon_weighted_max(atoms, probs, weights, n_max, query_mean=True), expected.mean(axis=2),
                               rtol=0, atol=1e-12)


def test_rows_with_their_own_atoms_take_the_per_weighting_kernel_unchanged() -> None:
    rng = np.random.default_rng(5)
    atoms = rng.normal(size=(3, 5, 6, 2))
    probs = rng.dirichlet(np.ones(6), size=(3, 5))
    weights = rng.random((4, 2))
    assert np.array_equal(bon_weighted_max(atoms, probs, weights, 7), per_weighting(atoms, probs, weights, 7))


@pytest.mark.parametrize("n_objectives", [1, 2, 3])
def test_grouped_kernel_matches_enumeration(n_objectives: int) -> None:
    rng = np.random.default_rng(n_objectives)
    side = {1: 4, 2: 2, 3: 2}[n_objectives]
    atoms = grid_atoms(2, 8, side, n_objectives, rng)
    probs = rng.dirichlet(np.ones(atoms.shape[2]), size=atoms.shape[:2])
    weights = tie_weights(n_objectives, rng, 6)
    got = bon_weighted_max(atoms, probs, weights, 4)
    n_atoms = atoms.shape[2]
    for n in range(1, 5):
        total = np.zeros(got.shape[:3])
        for seq in itertools.product(range(n_atoms), repeat=n):
            chance = np.prod(probs[:, :, list(seq)], axis=-1)  # (P, Q)
            best = (atoms[:, :, list(seq)] @ weights.T).max(axis=2)  # (P, Q, C')
            total += chance[None] * np.moveaxis(best, -1, 0)
        np.testing.assert_allclose(got[..., n - 1], total, rtol=0, atol=1e-12)


def test_grouped_kernel_agrees_with_monte_carlo() -> None:
    rng = np.random.default_rng(11)
    atoms = grid_atoms(2, 3, 5, 2, rng)
    probs = rng.dirichlet(np.full(25, 0.4), size=(2, 3))
    weights = np.array([[0.5, 0.5], [0.2, 0.8], [0.9, 0.1], [1 / 3, 2 / 3]])
    exact_values = bon_weighted_max(atoms, probs, weights, 8)
    draws = 40_000
    for p, q, n in [(0, 2, 1), (1, 0, 3), (1, 2, 8)]:
        picks = rng.choice(25, size=(draws, n), p=probs[p, q])
        best = (atoms[p, q][picks] @ weights.T).max(axis=1)  # (draws, C')
        mean, se = best.mean(axis=0), best.std(axis=0, ddof=1) / np.sqrt(draws)
        assert np.all(np.abs(mean - exact_values[:, p, q, n - 1]) < 5 * se + 1e-12)


def test_atom_sets_separate_rows_that_only_collide_in_the_projection(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    atoms = grid_atoms(3, 4, 3, 2, rng)
    sets, row_set = atom_sets(atoms)
    assert sets.shape[0] == 3 and np.array_equal(sets[row_set], atoms)
    monkeypatch.setattr(exact, "_HASH", np.zeros(4096))  # every row projects to 0
    sets, row_set = atom_sets(atoms)
    assert sets.shape[0] == 3 and np.array_equal(sets[row_set], atoms)
    probs = rng.dirichlet(np.ones(9), size=(3, 4))
    weights = tie_weights(2, rng, 8)
    np.testing.assert_allclose(bon_weighted_max(atoms, probs, weights, 6), per_weighting(atoms, probs, weights, 6),
                               rtol=0, atol=1e-12)


def grid_table(n_prompts: int, n_queries: int, n_contexts: int, n_max: int) -> OutcomeTable:
    """A Best-of-N table on the 9 x 9 grid with ``n_contexts`` distinct weightings (the scale benchmark's kind)."""
    rng = np.random.default_rng(0)
    grid = np.arange(-4.0, 5.0)
    points = np.stack(np.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2)
    w1 = np.linspace(0.05, 0.95, n_contexts)
    split = np.zeros(n_queries, dtype=np.uint8)
    split[: n_queries // 5] = 1
    return OutcomeTable(
        task="grid_bon", aggregator="bon",
        probs=rng.dirichlet(np.full(81, 0.3), size=(n_prompts, n_queries)),
        atoms=np.broadcast_to(points, (n_prompts, n_queries, 81, 2)), cost=rng.uniform(0.01, 0.1, n_prompts),
        n_max=n_max, context_weights=np.column_stack([w1, 1.0 - w1, np.full(n_contexts, -0.5)]),
        context_names=tuple(f"c{i}" for i in range(n_contexts)), context_probs=np.full(n_contexts, 1.0 / n_contexts),
        objective_names=("a", "b"), split=split,
    )


def test_streamed_q_table_equals_the_tensor_path_on_a_grid_table(monkeypatch: pytest.MonkeyPatch) -> None:
    table = grid_table(6, 20, 40, 12)
    queries = np.arange(3, 17)
    expected = q_table(table, queries)  # the whole (C', P, Q, N) tensor, grouped kernel
    reference = per_weighting(table.atoms[:, queries], table.probs[:, queries], table.context_weights[:, :-1], 12)
    cost = table.context_weights[:, -1, None, None] * table.cost_matrix()[:, queries].mean(1)[None, :, None] \
        * np.arange(1, 13)[None, None, :]
    np.testing.assert_allclose(expected, reference.mean(axis=2) + cost, rtol=0, atol=1e-12)
    monkeypatch.setattr(exact, "TENSOR_LIMIT_BYTES", 0)
    monkeypatch.setattr(utility, "_BLOCK_ELEMENTS", 4 * queries.size * 81)  # four prompts per block: two blocks
    big = replace(table)
    np.testing.assert_allclose(q_table(big, queries), expected, rtol=0, atol=1e-12)
    assert stored(big) is None


def streamed_peak(n_queries: int, block_cells: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """tracemalloc peak of a streamed ``mean_task_reward`` over every query, and its output's bytes."""
    table = grid_table(8, n_queries, 64, 16)
    monkeypatch.setattr(exact, "TENSOR_LIMIT_BYTES", 0)
    monkeypatch.setattr(utility, "_BLOCK_ELEMENTS", block_cells)
    queries = np.arange(n_queries)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        reward, _ = utility.mean_task_reward(table, queries)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return peak, reward.nbytes


def test_streamed_memory_is_bounded_by_the_block_not_the_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shape argument: the streamed path holds the (C', P, N_max) result, one block of about
    ``_BLOCK_ELEMENTS`` (prompt, query, atom) cells (its probabilities, atoms and a few work arrays
    of that size), arrays of C' x M (each atom array's orders) and N_max x K x P (one order's sums);
    nothing grows with the number of queries, even when one prompt's queries fill many blocks."""
    block_cells = 2 * 81 * 80  # 160 (prompt, query) rows of 81 atoms
    small, out_bytes = streamed_peak(40, block_cells, monkeypatch)  # blocks of 4 prompts x 40 queries
    large, _ = streamed_peak(800, block_cells, monkeypatch)  # blocks of 160 queries of one prompt
    bound = out_bytes + 16 * block_cells * 8 + 2 * 64 * 81 * 8 + 16 * 2 * 8 * 8 + (1 << 20)
    assert small <= bound and large <= bound, (small, large, bound)
    assert large <= 1.5 * small, (small, large)
    table_bytes = 8 * 800 * 81 * 8 * 3  # probs and atoms of the 800-query table: far above the bound
    assert table_bytes > 4 * bound
