"""The compiled majority-vote credit of many rows (numba), of two kinds of row: the exact credit of N votes drawn
from an answer distribution (what the oracle's ``iapo_gym.exact.mv_expected_credit`` computes), and the mean credit
over every N-subset of an urn of drawn votes (the all-subsets reading of PSST's estimator and the unbiased reading of
the plug-in's). Both are the tie-aware generating-function sum of ``vote_credit_series`` (1/(1+ties) integrated by
Gauss-Legendre quadrature), in compiled loops over blocks of rows with the same number of answer buckets, the rows in
vector lanes. ``tests/test_plugin_kernels.py`` checks it against a per-row, per-N reference and the oracle (to about
1e-15: the sums run in another order), ``tests/test_estimator.py`` the urn's against every subset enumerated.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

from agents._jit import _njit
from iapo_gym.exact import gauss_legendre_01


@_njit
def _credit_block(p_gold: np.ndarray, others: np.ndarray, n_max: int, nodes: np.ndarray, weights: np.ndarray,
                  draws: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """(R, n_max) credit of R rows that all have ``others.shape[1]`` other buckets of positive probability (or
    count).

    A row of ``draws`` 0 holds probabilities: its credit is the exact one of N i.i.d. votes, each bucket's term
    p^s / s!. A row of ``draws`` n > 0 holds the vote counts c of an urn of n drawn votes: its credit is the mean
    over every N-subset of them, each bucket's term C(c, s) ``scale``^s and the sum divided by C(n, N) ``scale``^N
    (0 past N = n), ``scale`` the power of two 2^-floor(log2 n): a power of two scales without rounding, so the
    terms are the binomial coefficients exactly while they are below 2^53 (an urn of one answer reads 1 or 0
    exactly) and stay in float64's range however many votes it holds. The rows run in lanes: every array is
    (degree, row), so each innermost loop is one multiply-add over the block's rows, which the compiler vectorizes;
    each row's own sums are the same operations in the same order as one row at a time.
    """
    n_rows, width = others.shape
    step = np.empty(n_rows)  # 1 on an urn's row (the falling factorial), 0 on a distribution's
    scale = np.empty(n_rows)  # 2^-floor(log2 n) on an urn's row, 1 on a distribution's
    for r in range(n_rows):
        step[r] = 1.0 if draws[r] > 0.0 else 0.0
        scale[r] = 2.0 ** -math.floor(math.log2(draws[r])) if draws[r] > 0.0 else 1.0
    a_gold = np.empty((n_max + 1, n_rows))  # a[s] = p^s / s!: the buckets' exponential generating functions
    a_other = np.empty((width, n_max + 1, n_rows))
    a_gold[0] = 1.0
    for s in range(1, n_max + 1):
        for r in range(n_rows):
            a_gold[s, r] = a_gold[s - 1, r] * (p_gold[r] - (s - 1) * step[r]) / s * scale[r]
    for j in range(width):
        a_other[j, 0] = 1.0
        for s in range(1, n_max + 1):
            for r in range(n_rows):
                a_other[j, s, r] = a_other[j, s - 1, r] * (others[r, j] - (s - 1) * step[r]) / s * scale[r]
    full = np.zeros((n_max + 1, n_rows))
    new = np.empty((n_max + 1, n_rows))
    poly = np.empty((n_max + 1, n_rows))
    series = np.zeros((n_max + 1, n_rows))
    coef = np.empty(n_rows)
    # The others' whole product up to degree n_max: for k > n_max - k no other bucket can reach
    # k votes, so no tie is possible and the k-th term is a_gold[k] times its prefix.
    full[0] = 1.0
    for j in range(width):
        new[:] = 0.0
        for s in range(n_max + 1):
            for d in range(n_max + 1 - s if j else 1):
                for r in range(n_rows):
                    new[d + s, r] += a_other[j, s, r] * full[d, r]
        full, new = new, full  # the product so far; the old one's buffer is cleared and refilled next
    for k in range(1, n_max + 1):
        degree = n_max - k
        if k > degree:
            for d in range(degree + 1 if width else 1):
                for r in range(n_rows):
                    series[k + d, r] += a_gold[k, r] * full[d, r]
            continue
        # Other buckets below k votes, each one at exactly k weighted by u: integrating over u
        # in [0, 1] gives a tie of t others the share 1 / (1 + t).
        for g in range(nodes.size):
            poly[0] = 1.0
            size = 1  # coefficients 0..size-1 of the running product
            for j in range(width):
                new_size = min(degree, size - 1 + k) + 1
                new[:new_size] = 0.0
                for s in range(k):
                    for d in range(min(size, new_size - s)):
                        for r in range(n_rows):
                            new[d + s, r] += a_other[j, s, r] * poly[d, r]
                for r in range(n_rows):
                    coef[r] = a_other[j, k, r] * nodes[g]
                for d in range(min(size, new_size - k)):
                    for r in range(n_rows):
                        new[d + k, r] += coef[r] * poly[d, r]
                poly, new = new, poly  # buffers swapped, not copied: only the first ``size`` rows are read
                size = new_size
            for d in range(size):
                for r in range(n_rows):
                    series[k + d, r] += a_gold[k, r] * weights[g] * poly[d, r]
    out = np.empty((n_rows, n_max))
    subsets = np.ones(n_rows)  # C(n, N) scale^N on an urn's row (the same recurrence as its terms)
    fact = 1.0
    for n in range(1, n_max + 1):
        fact *= n
        for r in range(n_rows):
            if step[r] == 0.0:
                out[r, n - 1] = min(1.0, max(0.0, series[n, r] * fact))
            else:
                subsets[r] = subsets[r] * (draws[r] - (n - 1)) / n * scale[r]
                out[r, n - 1] = min(1.0, max(0.0, series[n, r] / subsets[r])) if subsets[r] > 0.0 else 0.0
    return out


#: Rows per block of ``_credit_block``: large enough to fill the vector lanes, small enough that a
#: block's arrays stay in cache (``research/bench_plugin_shapes.py --kernel`` times the choices).
BLOCK_ROWS = 128


def credit_rows(p_gold: np.ndarray, others: np.ndarray, width: np.ndarray, n_max: int,
                block_rows: int = BLOCK_ROWS, draws: np.ndarray | None = None) -> np.ndarray:
    """(R, n_max) majority-vote credit of rows with gold probability ``p_gold`` (R,) and the other
    buckets' probabilities ``others`` (R, B-1), of which the first ``width`` (R,) are used; the
    rows go through the kernel ``block_rows`` (>= 1) at a time (the values do not depend on it). With ``draws``
    (R,), the rows hold vote counts of that many drawn votes instead, and the credit is the mean over every N-subset
    of them (0 past N = draws)."""
    if isinstance(block_rows, bool) or not isinstance(block_rows, (int, np.integer)) or block_rows < 1:
        raise ValueError(f"block_rows must be an integer >= 1, got {block_rows!r}")
    nodes, weights, n_nodes = _quadrature(others.shape[1])
    p_gold = np.asarray(p_gold, dtype=np.float64)
    urn = np.zeros(p_gold.size) if draws is None else np.asarray(draws, dtype=np.float64)
    out = np.empty((p_gold.size, int(n_max)))
    for w in np.unique(width):
        rows = np.flatnonzero(width == w)
        x, v = nodes[w, :n_nodes[w]].copy(), weights[w, :n_nodes[w]].copy()
        for start in range(0, rows.size, block_rows):
            block = rows[start:start + block_rows]
            out[block] = _credit_block(p_gold[block], np.ascontiguousarray(others[block, :w], dtype=np.float64),
                                       int(n_max), x, v, urn[block])
    return out


@cache
def _quadrature(n_others: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gauss-Legendre nodes, weights and node counts for rows of 0..``n_others`` other buckets (read-only)."""
    nodes = np.zeros((n_others + 1, (n_others + 2) // 2 + 1))
    weights = np.zeros_like(nodes)
    n_nodes = np.zeros(n_others + 1, dtype=np.int64)
    for w in range(n_others + 1):
        x, v = gauss_legendre_01(max(1, (w + 2) // 2))
        nodes[w, :x.size], weights[w, :x.size], n_nodes[w] = x, v, x.size
    for array in (nodes, weights, n_nodes):
        array.flags.writeable = False
    return nodes, weights, n_nodes


def mv_credit_rows(probs: np.ndarray, gold: np.ndarray, n_max: int, urn: bool = False) -> np.ndarray:
    """(R, n_max) the majority-vote credit of each row of ``probs`` (R, B) with gold bucket ``gold`` (R,), computed
    with only the buckets of positive probability: ``mv_expected_credit`` of answer distributions, or with ``urn``
    the mean credit over every N-subset of the rows' vote counts (0 past N = the row's votes).

    A bucket of probability 0 never receives a vote, so dropping it leaves the credit unchanged
    (up to rounding: fewer quadrature nodes); the exact kernel's cost grows with the number of
    buckets, and the plug-in rows of a query often have only a few.
    """
    probs = np.asarray(probs, dtype=np.float64)
    n_rows = probs.shape[0]
    p_gold = probs[np.arange(n_rows), gold]
    others = probs.copy()
    others[np.arange(n_rows), gold] = -1.0
    others = -np.sort(-others, axis=1)[:, :-1]  # the other buckets, largest first
    width = (others > 0).sum(axis=1)
    return credit_rows(p_gold, others, width, n_max, draws=probs.sum(axis=1) if urn else None)
