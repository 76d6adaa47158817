"""The majority-vote kernels of the plug-in estimator (numba): the exact credit of many rows and the
response-curve fit.

Credit (``credit_rows``): what ``iapo_gym.utility.mv_expected_credit`` computes (the tie-aware generating-function
sum of ``vote_credit_series``, 1/(1+ties) integrated by Gauss-Legendre quadrature) in compiled loops over blocks
of rows with the same number of answer buckets, the rows in vector lanes. ``tests/test_plugin_kernels.py`` checks it
against a per-row, per-N reference and the oracle's ``mv_expected_credit`` (to about 1e-15: the sums run in
another order).

Response curves (``fit_curves``): the safeguarded Newton fit of ``MajorityVoteReadings._fit_curves``, one prompt at
a time (``tests/test_plugin_kernels.py`` checks it against a plain-loop reference, step for step).
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

from agents._jit import _njit
from iapo_gym.exact import gauss_legendre_01


@_njit
def _credit_block(p_gold: np.ndarray, others: np.ndarray, n_max: int, nodes: np.ndarray,
                  weights: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """(R, n_max) credit of R rows that all have ``others.shape[1]`` other buckets of positive probability.

    The rows run in lanes: every array is (degree, row), so each innermost loop is one
    multiply-add over the block's rows, which the compiler vectorizes; each row's own sums
    are the same operations in the same order as one row at a time.
    """
    n_rows, width = others.shape
    a_gold = np.empty((n_max + 1, n_rows))  # a[s] = p^s / s!: the buckets' exponential generating functions
    a_other = np.empty((width, n_max + 1, n_rows))
    a_gold[0] = 1.0
    for s in range(1, n_max + 1):
        for r in range(n_rows):
            a_gold[s, r] = a_gold[s - 1, r] * p_gold[r] / s
    for j in range(width):
        a_other[j, 0] = 1.0
        for s in range(1, n_max + 1):
            for r in range(n_rows):
                a_other[j, s, r] = a_other[j, s - 1, r] * others[r, j] / s
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
        full[:] = new
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
                poly[:new_size] = new[:new_size]
                size = new_size
            for d in range(size):
                for r in range(n_rows):
                    series[k + d, r] += a_gold[k, r] * weights[g] * poly[d, r]
    out = np.empty((n_rows, n_max))
    fact = 1.0
    for n in range(1, n_max + 1):
        fact *= n
        for r in range(n_rows):
            out[r, n - 1] = min(1.0, max(0.0, series[n, r] * fact))
    return out


#: Rows per block of ``_credit_block``: large enough to fill the vector lanes, small enough that a
#: block's arrays stay in cache (``research/bench_plugin_shapes.py --kernel`` times the choices).
BLOCK_ROWS = 128


def credit_rows(p_gold: np.ndarray, others: np.ndarray, width: np.ndarray, n_max: int,
                block_rows: int = BLOCK_ROWS) -> np.ndarray:
    """(R, n_max) majority-vote credit of rows with gold probability ``p_gold`` (R,) and the other
    buckets' probabilities ``others`` (R, B-1), of which the first ``width`` (R,) are used; the
    rows go through the kernel ``block_rows`` (>= 1) at a time (the values do not depend on it)."""
    if isinstance(block_rows, bool) or not isinstance(block_rows, (int, np.integer)) or block_rows < 1:
        raise ValueError(f"block_rows must be an integer >= 1, got {block_rows!r}")
    nodes, weights, n_nodes = _quadrature(others.shape[1])
    p_gold = np.asarray(p_gold, dtype=np.float64)
    out = np.empty((p_gold.size, int(n_max)))
    for w in np.unique(width):
        rows = np.flatnonzero(width == w)
        x, v = nodes[w, :n_nodes[w]].copy(), weights[w, :n_nodes[w]].copy()
        for start in range(0, rows.size, block_rows):
            block = rows[start:start + block_rows]
            out[block] = _credit_block(p_gold[block], np.ascontiguousarray(others[block, :w], dtype=np.float64),
                                       int(n_max), x, v)
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


@_njit
def _curve_objective(a: float, b: float, g: np.ndarray, n: np.ndarray, z: np.ndarray, lam_a: float, lam_b: float,
                     slope: float) -> float:  # pragma: no cover - compiled
    """One prompt's penalised log-likelihood at (a, b): sum_j -(n_j log(1 + e^-x_j) + (n_j - g_j) x_j), x_j = a + b z_j,
    less 0.5 (lam_a a^2 + lam_b (b - slope)^2)."""
    total = 0.0
    for j in range(z.size):
        x = a + b * z[j]
        # logaddexp(0, -x), as numpy computes it: max(0, -x) + log1p(exp(-|x|))
        soft = (-x if x < 0.0 else 0.0) + math.log1p(math.exp(-abs(x)))
        total += n[j] * soft + (n[j] - g[j]) * x
    return -total - 0.5 * (lam_a * a * a + lam_b * (b - slope) * (b - slope))


@_njit
def fit_curves_kernel(g: np.ndarray, n: np.ndarray, z: np.ndarray, lam_a: float, lam_b: float, slope: float,
                      start: np.ndarray, iterations: int,
                      halvings: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """``MajorityVoteReadings._fit_curves`` one prompt at a time: (P, 2) curves and posterior variances from ``start``.

    Safeguarded Newton steps: each step is halved until the penalised likelihood (``_curve_objective``) does not
    fall (to rounding, 1e-12 relative), at most ``halvings`` times (then no step: at the maximum to rounding); a
    prompt stops once its step is below 1e-9, or after ``iterations`` steps.
    """
    n_prompts = g.shape[0]
    theta = start.copy()
    variance = np.zeros((n_prompts, 2))
    for p in range(n_prompts):
        a, b = theta[p, 0], theta[p, 1]
        value = _curve_objective(a, b, g[p], n[p], z, lam_a, lam_b, slope)
        for _ in range(iterations):
            grad_a, grad_b, h00, h01, h11 = -lam_a * a, -lam_b * (b - slope), lam_a, 0.0, lam_b
            for j in range(z.size):
                x = min(30.0, max(-30.0, a + b * z[j]))
                mu = 1.0 / (1.0 + math.exp(-x))
                r, w = g[p, j] - n[p, j] * mu, n[p, j] * mu * (1.0 - mu)
                grad_a += r
                grad_b += r * z[j]
                h00 += w
                h01 += w * z[j]
                h11 += w * z[j] * z[j]
            det = h00 * h11 - h01 * h01
            step_a, step_b = (h11 * grad_a - h01 * grad_b) / det, (h00 * grad_b - h01 * grad_a) / det
            variance[p, 0], variance[p, 1] = h11 / det, h00 / det
            size = 1.0
            accepted = False
            for _ in range(halvings):
                trial = _curve_objective(a + size * step_a, b + size * step_b, g[p], n[p], z, lam_a, lam_b, slope)
                if trial >= value - 1e-12 * abs(value):
                    value = trial
                    accepted = True
                    break
                size *= 0.5
            if not accepted:
                size = 0.0  # no ascent left along the step: at the maximum to rounding
            a += size * step_a
            b += size * step_b
            if max(abs(size * step_a), abs(size * step_b)) < 1e-9:
                break
        theta[p, 0], theta[p, 1] = a, b
    return theta, variance


def fit_curves(g: np.ndarray, n: np.ndarray, z: np.ndarray, ridge: tuple[float, float], start: np.ndarray,
               slope: float, iterations: int, halvings: int) -> tuple[np.ndarray, np.ndarray]:
    """(P, 2) response curves and their posterior variances of prompts with gold votes ``g`` and votes ``n``
    (P, Q) on queries of difficulty ``z`` (Q,), compiled (``MajorityVoteReadings._fit_curves`` says what they are)."""
    return fit_curves_kernel(np.ascontiguousarray(g, dtype=np.float64), np.ascontiguousarray(n, dtype=np.float64),
                             np.ascontiguousarray(z, dtype=np.float64), float(ridge[0]), float(ridge[1]),
                             float(slope), np.ascontiguousarray(start, dtype=np.float64), int(iterations),
                             int(halvings))
