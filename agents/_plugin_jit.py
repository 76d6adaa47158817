"""Optional numba kernel of the exact majority-vote credit of many plug-in rows (``PlugInEstimator``).

Computes what ``iapo_gym.utility.mv_expected_credit`` computes (the tie-aware generating-function
sum of ``vote_credit_series``, 1/(1+ties) integrated by Gauss-Legendre quadrature) one row at a
time in compiled loops, instead of numpy passes whose count grows with N_max^2 per call. The
sums run in another order, so values agree with the numpy path to rounding (about 1e-15), not
bit for bit; ``tests/test_challenger.py`` compares the two. Used when ``agents._jit.enabled()``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from agents._jit import _njit, enabled
from iapo_gym.utility import gauss_legendre_01


@_njit
def _credit_rows(p_gold: np.ndarray, others: np.ndarray, width: np.ndarray, n_max: int, nodes: np.ndarray,
                 weights: np.ndarray, n_nodes: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    n_rows, n_others = others.shape
    out = np.zeros((n_rows, n_max))
    a_gold = np.empty(n_max + 1)
    a_other = np.empty((n_others, n_max + 1))
    series = np.empty(n_max + 1)
    poly = np.empty(n_max + 1)
    new = np.empty(n_max + 1)
    full = np.empty(n_max + 1)
    for r in range(n_rows):
        w = width[r]
        a_gold[0] = 1.0
        for s in range(1, n_max + 1):
            a_gold[s] = a_gold[s - 1] * p_gold[r] / s
        for j in range(w):
            a_other[j, 0] = 1.0
            for s in range(1, n_max + 1):
                a_other[j, s] = a_other[j, s - 1] * others[r, j] / s
        # The others' whole product up to degree n_max: for k > n_max - k no other bucket can reach
        # k votes, so no tie is possible and the k-th term is a_gold[k] times its prefix.
        full[0] = 1.0
        full_size = 1
        for j in range(w):
            for d in range(n_max + 1):
                new[d] = 0.0
            for s in range(n_max + 1):
                c = a_other[j, s]
                if c == 0.0:
                    continue
                for d in range(min(full_size, n_max + 1 - s)):
                    new[d + s] += c * full[d]
            full_size = n_max + 1
            for d in range(full_size):
                full[d] = new[d]
        series[:] = 0.0
        for k in range(1, n_max + 1):
            if a_gold[k] == 0.0:
                break
            degree = n_max - k
            if k > degree:
                for d in range(min(full_size, degree + 1)):
                    series[k + d] += a_gold[k] * full[d]
                continue
            top = k
            for g in range(n_nodes[w]):
                u = nodes[w, g]
                poly[0] = 1.0
                size = 1  # coefficients 0..size-1 of the running product
                for j in range(w):
                    new_size = min(degree, size - 1 + top) + 1
                    for d in range(new_size):
                        new[d] = 0.0
                    for s in range(top + 1):
                        c = a_other[j, s] * u if s == k else a_other[j, s]
                        if c == 0.0:
                            continue
                        for d in range(min(size, new_size - s)):
                            new[d + s] += c * poly[d]
                    for d in range(new_size):
                        poly[d] = new[d]
                    size = new_size
                scale = a_gold[k] * weights[w, g]
                for d in range(size):
                    series[k + d] += scale * poly[d]
        fact = 1.0
        for n in range(1, n_max + 1):
            fact *= n
            out[r, n - 1] = min(1.0, max(0.0, series[n] * fact))
    return out


def credit_rows(p_gold: np.ndarray, others: np.ndarray, width: np.ndarray, n_max: int) -> np.ndarray:
    """(R, n_max) majority-vote credit of rows with gold probability ``p_gold`` (R,) and the other
    buckets' probabilities ``others`` (R, B-1), of which the first ``width`` (R,) are used."""
    nodes, weights, n_nodes = _quadrature(others.shape[1])
    return _credit_rows(np.ascontiguousarray(p_gold, dtype=np.float64), np.ascontiguousarray(others, dtype=np.float64),
                        np.ascontiguousarray(width, dtype=np.int64), int(n_max), nodes, weights, n_nodes)


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


def available() -> bool:
    """Whether the compiled kernel runs (numba installed, not switched off by ``IAPO_GYM_JIT=0``)."""
    return enabled()


_warm = False


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel once per process, so no training run pays for it."""
    global _warm
    if not _warm and available():
        credit_rows(np.array([0.5]), np.array([[0.3, 0.2]]), np.array([2]), 2)
        _warm = True


__all__: list[Any] = ["available", "credit_rows", "warm_up"]
