"""How the shared ``Estimator`` scores a pull: the objective scores under every context's weights, and the
all-subsets readings (``reuse="all_subsets"``, docs/estimator.md): the mean over every k-subset of a pull's
completions of its Best-of-N maximum (``bon_subset_weights``) or majority-vote credit (``mv_subset_credit``).
"""

from __future__ import annotations

import numpy as np

from agents._vote_credit import mv_credit_rows


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


def mv_subset_credit(counts: np.ndarray, gold: np.ndarray, k_max: int) -> np.ndarray:
    """Mean majority-vote credit (R, k_max) over all k-subsets (k = 1..k_max) of R pulls.

    ``counts`` (R, B) are each pull's votes per bucket, ``gold`` (R,) the gold buckets. Column k-1 is valid for
    k <= the pull's size n (0 beyond it): the compiled urn credit of ``agents._vote_credit``, the sum over vote
    vectors of prod_j C(c_j, s_j) / C(n, k) times their credit (the series of the exact oracle's kernel with
    C(c_j, s) in place of p_j^s / s!), every coefficient scaled by a power of two so that it stays exact while
    below 2^53 and in float64's range however many votes a pull holds.
    """
    return mv_credit_rows(np.asarray(counts, dtype=np.int64), np.asarray(gold), k_max, urn=True)


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
