"""How the shared ``Estimator`` scores a pull: the objective scores under every context's weights, and the
all-subsets readings (``reuse="all_subsets"``, docs/estimator.md): the mean over every k-subset of a pull's
completions of its Best-of-N maximum (``bon_subset_weights``) or majority-vote credit (``mv_subset_credit``).
"""

from __future__ import annotations

import numpy as np

from iapo_gym.exact import vote_credit_series


def binomial_table(n_max: int) -> np.ndarray:
    """C(n, s) as float64 for 0 <= n, s <= n_max (zero for s > n), by Pascal's rule."""
    table = np.zeros((n_max + 1, n_max + 1))
    table[:, 0] = 1.0
    for n in range(1, n_max + 1):
        table[n, 1:] = table[n - 1, 1:] + table[n - 1, :-1]
    return table


def bon_subset_weights(n: int, binom: np.ndarray | None = None) -> np.ndarray:
    """(n, n) matrix W with W[i-1, k-1] = C(i-1, k-1) / C(n, k): the weight of the i-th
    smallest of n values in the mean of max over all k-subsets."""
    binom = binomial_table(n) if binom is None else binom
    i = np.arange(1, n + 1)
    k = np.arange(1, n + 1)
    return binom[i[:, None] - 1, k[None, :] - 1] / binom[n, k][None, :]


def mv_subset_credit(counts: np.ndarray, gold: np.ndarray, k_max: int,
                     binom: np.ndarray | None = None) -> np.ndarray:
    """Mean majority-vote credit (R, k_max) over all k-subsets (k = 1..k_max) of R pulls.

    ``counts`` (R, B) are each pull's votes per bucket, ``gold`` (R,) the gold buckets.
    Column k-1 is valid for k <= the pull's size (the series of the exact oracle's kernel
    with C(n_j, s) in place of p_j^s / s!, divided by C(n, k)).
    """
    counts = np.asarray(counts, dtype=np.int64)
    n_rows, n_buckets = counts.shape
    binom = binomial_table(max(k_max, int(counts.sum(axis=1).max(initial=0)))) if binom is None else binom
    gold_counts = counts[np.arange(n_rows), gold]
    others = np.ones((n_rows, n_buckets), dtype=bool)
    others[np.arange(n_rows), gold] = False
    other_counts = counts[others].reshape(n_rows, n_buckets - 1)
    s = np.arange(k_max + 1)
    series = vote_credit_series(binom[gold_counts][:, s], binom[other_counts][:, :, s], k_max)
    totals = counts.sum(axis=1)
    denom = binom[totals][:, 1:k_max + 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denom > 0, series[:, 1:] / np.where(denom > 0, denom, 1.0), 0.0)


def objective_scores(weights: np.ndarray, vectors: np.ndarray, transposed: bool = False) -> np.ndarray:
    """(C, n) weighted objective score sum_k w[c, k] v[i, k] of ``vectors`` (n, K) under ``weights`` (C, K + 1).

    Summed objective by objective in order (not a BLAS matmul, whose rounding depends on
    the shape and the CPU), so the compiled loop of ``agents._jit`` gets the same bits.
    ``transposed``: the same values laid out (n, C).
    """
    if transposed:
        out = vectors[:, :1] * weights[None, :, 0]
        for k in range(1, vectors.shape[1]):
            out += vectors[:, k:k + 1] * weights[None, :, k]
        return out
    out = weights[:, :1] * vectors[None, :, 0]
    for k in range(1, vectors.shape[1]):
        out += weights[:, k:k + 1] * vectors[None, :, k]
    return out
