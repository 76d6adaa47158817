"""Optional numba kernels of the plug-in estimator (``PlugInEstimator``): the exact majority-vote credit,
the exact Best-of-N expected maximum of many rows, and the majority-vote response-curve fit.

Best-of-N (``expected_max_rows``): each row's outcomes with a positive count are sorted in a
compiled loop and E[max of N] = u_(M) - sum_j (u_(j+1) - u_(j)) F_j^N is summed for every N with
the powers in a row-sized buffer, instead of numpy passes over (rows x outcomes) arrays per N; the
result is that of ``iapo_gym.exact.bon_expected_max`` to rounding (about 1e-15). With ``subsets`` the same
pass also gives each row's mean max over the N-subsets of its draws (F_j^N read as C(c_j, N) / C(n, N)).
``segment_readings`` sums, per prompt, the pulled (prompt, query) rows' weighted plug-in readings and their
held gaps to the unbiased one in that pass.

Best-of-N location-scale pass (``residual_sums``, ``standardize``, ``over_spread``, ``binned_expected_max``): the
residuals under every weighting, their squared sums, their scaling, and the binned pools' expected maxima (each
row binned into a buffer and read at once), each in one pass without (weightings x entries) or (weightings x rows
x bins) temporaries; the numpy operations' values bit for bit (``tests/test_plugin.py``).

Majority vote (``credit_rows``): computes what ``iapo_gym.utility.mv_expected_credit`` computes (the tie-aware generating-function
sum of ``vote_credit_series``, 1/(1+ties) integrated by Gauss-Legendre quadrature) in compiled
loops over blocks of rows with the same number of answer buckets, the rows in vector lanes,
instead of numpy passes whose count grows with N_max^2 per call. The sums run in another order
than numpy's, so values agree with the numpy path to rounding (about 1e-15), not bit for bit;
``tests/test_plugin.py`` compares the two. Used when ``agents._jit.enabled()``.

Best-of-N readings (``clipped_readings``): each prompt's location-scale readings over its seen queries, held
within the outcomes' score range and summed with their weights, in one loop instead of a (weightings x
prompts x queries x N) work array; the sums agree with the numpy path to rounding.

Response curves (``fit_curves``): the safeguarded Newton fit of ``PlugInEstimator._fit_curves``, one
prompt at a time in a compiled loop; the fits agree with the numpy path to rounding.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np

from agents._jit import _njit, enabled, pairwise_rows, pairwise_scratch
from iapo_gym.utility import gauss_legendre_01


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


#: Outcomes per row up to which ``_sort_outcomes`` sorts by insertion alone; larger rows are bucketed first.
INSERTION_SORT_MAX = 32


@_njit
def _insertion_pass(u: np.ndarray, mass: np.ndarray, k: int) -> None:  # pragma: no cover - compiled
    """Sorts ``u[:k]`` ascending in place by insertion, ``mass[:k]`` moved with it: few moves when nearly sorted."""
    for j in range(1, k):
        value, weight = u[j], mass[j]
        i = j
        while i > 0 and u[i - 1] > value:
            u[i], mass[i] = u[i - 1], mass[i - 1]
            i -= 1
        u[i], mass[i] = value, weight


@_njit
def _sort_outcomes(u: np.ndarray, mass: np.ndarray, k: int, spare_u: np.ndarray, spare_mass: np.ndarray,
                   bucket: np.ndarray, start: np.ndarray) -> None:  # pragma: no cover - compiled
    """Sorts ``u[:k]`` ascending in place, ``mass[:k]`` moved with it. Above ``INSERTION_SORT_MAX`` outcomes, a
    bucket sort first (k equal-width buckets of the range, counted, then placed through ``spare_u`` and
    ``spare_mass``; ``bucket`` and ``start`` scratch of k + 1) leaves each outcome near its place, so the insertion
    pass moves little: a few branch-free passes instead of a comparison sort's mispredicted branches. Ties need
    no rule: their gap is 0, and running sums of integer counts are exact."""
    if k > INSERTION_SORT_MAX:
        low = high = u[0]
        for j in range(1, k):
            low, high = min(low, u[j]), max(high, u[j])
        if high == low:
            return  # one value: sorted
        per_width = k / (high - low)
        if 0.0 < per_width < math.inf:  # else a range too narrow or too wide to bucket: insertion alone
            for b in range(k + 1):
                start[b] = 0
            for j in range(k):
                bucket[j] = min(int((u[j] - low) * per_width), k - 1)
                start[bucket[j] + 1] += 1
            for b in range(1, k + 1):
                start[b] += start[b - 1]
            for j in range(k):
                place = start[bucket[j]]
                spare_u[place], spare_mass[place] = u[j], mass[j]
                start[bucket[j]] = place + 1
            for j in range(k):
                u[j], mass[j] = spare_u[j], spare_mass[j]
    _insertion_pass(u, mass, k)


@_njit
def _sorted_row(scores: np.ndarray, counts: np.ndarray, r: int, count_row: int, presorted: bool, u: np.ndarray,
                mass: np.ndarray, sort_scratch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
                ) -> int:  # pragma: no cover - compiled
    """Row r's outcomes (their counts in row ``count_row`` of ``counts``) of positive count into ``u`` and
    ``mass``, ascending (``presorted``: they already are; else ``_sort_outcomes`` with ``sort_scratch``); their
    number."""
    k = 0
    for j in range(scores.shape[1]):
        if counts[count_row, j] > 0:
            u[k], mass[k] = scores[r, j], counts[count_row, j]
            k += 1
    if not presorted:
        spare_u, spare_mass, bucket, start = sort_scratch
        _sort_outcomes(u, mass, k, spare_u, spare_mass, bucket, start)
    return k


@_njit
def _row_scratch(width: int) -> tuple[np.ndarray, ...]:  # pragma: no cover - compiled
    """The buffers of ``_sorted_row`` (outcomes, counts) and ``_row_readings`` (gap, cdf, power, below) for rows of
    ``width``."""
    return np.empty(width), np.empty(width), np.empty(width), np.empty(width), np.empty(width), np.empty(width)


@_njit
def _sort_scratch(width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """The buffers of ``_sort_outcomes`` for rows of ``width``."""
    return np.empty(width), np.empty(width), np.empty(width, np.int64), np.empty(width + 1, np.int64)


@_njit
def _four_terms(gap: float, power: float, cdf: float) -> tuple[float, float, float, float, float]:  # pragma: no cover - compiled
    """gap x cdf^N for four N in a row, from ``power`` = cdf^N, and cdf^(N + 4) for the next four."""
    t0 = gap * power
    power *= cdf
    t1 = gap * power
    power *= cdf
    t2 = gap * power
    power *= cdf
    return t0, t1, t2, gap * power, power * cdf


@_njit
def _row_readings(u: np.ndarray, mass: np.ndarray, k: int, n_max: int, subsets: bool,
                  plug_in: np.ndarray, subset_means: np.ndarray, gap: np.ndarray, cdf: np.ndarray, power: np.ndarray,
                  below: np.ndarray) -> None:  # pragma: no cover - compiled
    """One row's E[max of N draws], N = 1..n_max, into ``plug_in``, and with ``subsets`` its mean max over the
    N-subsets of its draws into ``subset_means``: the row's k outcomes ``u``, ascending, of counts ``mass``
    (``_sorted_row``); ``gap``, ``cdf``, ``power`` and ``below`` are scratch of at least k."""
    total = 0.0
    for j in range(k):
        total += mass[j]
    cumulative = 0.0
    for j in range(k - 1):  # F_j and the step to the next sorted outcome
        cumulative += mass[j]
        cdf[j] = cumulative / total
        power[j] = cdf[j]
        gap[j] = u[j + 1] - u[j]
    top = u[k - 1]
    steps = k - 1
    whole = steps - steps % 4
    n = 0
    while n + 4 <= n_max:  # four N at once: the same operations per N, one pass over the row instead of four
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = 0.0
        for j in range(0, whole, 4):
            t0, t1, t2, t3, power[j] = _four_terms(gap[j], power[j], cdf[j])
            a0, b0, c0, d0 = a0 + t0, b0 + t1, c0 + t2, d0 + t3
            t0, t1, t2, t3, power[j + 1] = _four_terms(gap[j + 1], power[j + 1], cdf[j + 1])
            a1, b1, c1, d1 = a1 + t0, b1 + t1, c1 + t2, d1 + t3
            t0, t1, t2, t3, power[j + 2] = _four_terms(gap[j + 2], power[j + 2], cdf[j + 2])
            a2, b2, c2, d2 = a2 + t0, b2 + t1, c2 + t2, d2 + t3
            t0, t1, t2, t3, power[j + 3] = _four_terms(gap[j + 3], power[j + 3], cdf[j + 3])
            a3, b3, c3, d3 = a3 + t0, b3 + t1, c3 + t2, d3 + t3
        for j in range(whole, steps):
            t0, t1, t2, t3, power[j] = _four_terms(gap[j], power[j], cdf[j])
            a0, b0, c0, d0 = a0 + t0, b0 + t1, c0 + t2, d0 + t3
        plug_in[n] = top - ((a0 + a1) + (a2 + a3))
        plug_in[n + 1] = top - ((b0 + b1) + (b2 + b3))
        plug_in[n + 2] = top - ((c0 + c1) + (c2 + c3))
        plug_in[n + 3] = top - ((d0 + d1) + (d2 + d3))
        n += 4
    for m in range(n, n_max):  # the last N one at a time; four partial sums, so the adds do not wait on each other
        acc0 = acc1 = acc2 = acc3 = 0.0
        for j in range(0, whole, 4):
            acc0 += gap[j] * power[j]
            acc1 += gap[j + 1] * power[j + 1]
            acc2 += gap[j + 2] * power[j + 2]
            acc3 += gap[j + 3] * power[j + 3]
        for j in range(whole, steps):
            acc0 += gap[j] * power[j]
        for j in range(steps):
            power[j] *= cdf[j]
        plug_in[m] = top - ((acc0 + acc1) + (acc2 + acc3))
    if not subsets:
        return
    ratio = cdf  # C(c_j, 1) / C(n, 1); the plug-in pass is done with the cdf, so it becomes the ratios in place
    cumulative = 0.0
    for j in range(steps):
        cumulative += mass[j]
        below[j] = cumulative
    # ratio_j = C(c_j, N) / C(n, N) is 0 for the j below ``first``, where c_j < N: the sums start at the multiple
    # of 4 at or below it, so each term goes to the partial sum it would in a sum over every j (the same bits)
    first = 0
    for n in range(int(total), n_max):
        subset_means[n] = 0.0  # N > the row's draws
    for n in range(min(n_max, int(total))):
        while first < steps and below[first] < n + 1:
            first += 1
        acc0 = acc1 = acc2 = acc3 = 0.0
        for j in range(first - first % 4, whole, 4):
            acc0 += gap[j] * ratio[j]
            acc1 += gap[j + 1] * ratio[j + 1]
            acc2 += gap[j + 2] * ratio[j + 2]
            acc3 += gap[j + 3] * ratio[j + 3]
        for j in range(max(whole, first), steps):
            acc0 += gap[j] * ratio[j]
        subset_means[n] = top - ((acc0 + acc1) + (acc2 + acc3))
        left = total - n - 1.0  # draws left once N are taken: C(c_j, N + 1) / C(n, N + 1) next
        if left > 0:
            for j in range(first, steps):
                ratio[j] *= max(below[j] - n - 1.0, 0.0) / left


@_njit
def _expected_max_block(scores: np.ndarray, counts: np.ndarray, n_max: int, presorted: bool,
                        subsets: bool) -> np.ndarray:  # pragma: no cover - compiled
    """(1 + subsets, R, n_max): [0] E[max of N draws], N = 1..n_max, of each row's outcomes ``scores`` (R, M)
    weighted by ``counts`` (R', M), R a multiple of R' (row r's counts are row r % R'); entries of count 0 are left
    out (each row has one of positive count). With
    ``presorted`` each row's scores already ascend and no sort is done. With ``subsets`` (integer counts, n in
    all), [1] the mean max over the N-subsets of the row's n draws from the same sort: F_j^N read as
    C(c_j, N) / C(n, N) for the c_j draws at or below the j-th outcome; 0 for N > n."""
    n_rows, width = scores.shape
    out = np.empty((2 if subsets else 1, n_rows, n_max))
    u, mass, gap, cdf, power, below = _row_scratch(width)
    sort_scratch = _sort_scratch(width)
    for r in range(n_rows):
        k = _sorted_row(scores, counts, r, r % counts.shape[0], presorted, u, mass, sort_scratch)
        _row_readings(u, mass, k, n_max, subsets, out[0, r], out[-1, r], gap, cdf, power, below)
    return out


@_njit
def _segment_readings_block(scores: np.ndarray, counts: np.ndarray, n_max: int, weight: np.ndarray,
                            bounds: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """(2, W, S, n_max): per weighting and segment of rows ``bounds[s]:bounds[s + 1]``, the sum over its rows of
    ``weight`` (R, n_max) x their E[max of N] V(N) and the sum of their held gaps U(m) - weight(m) V(m), m = min(N,
    n) for the row's n draws and U its mean max over N-subsets (``_expected_max_block``'s two readings of ``scores``
    (W, R, M) with ``counts`` (R, M)), summed as ``np.add.reduceat(values, bounds[:-1], axis=1)`` sums (the segment's
    first row plus numpy's pairwise sum of the others), without (W, R, n_max) arrays."""
    n_weightings, n_rows, width = scores.shape
    n_segments = bounds.size - 1
    out = np.empty((2, n_weightings, n_segments, n_max))
    longest = 1
    for s in range(n_segments):
        longest = max(longest, bounds[s + 1] - bounds[s])
    plug_in, subset_means = np.empty((longest, n_max)), np.empty((longest, n_max))
    held = np.empty((longest, n_max))
    pairwise, rest = pairwise_scratch(n_max), np.empty(n_max)
    u, mass, gap, cdf, power, below = _row_scratch(width)
    sort_scratch = _sort_scratch(width)
    draws = np.zeros(n_rows, np.int64)
    for r in range(n_rows):
        total = 0.0
        for j in range(width):
            total += counts[r, j]
        draws[r] = int(total)
    for w in range(n_weightings):
        row_scores = scores[w]
        for s in range(n_segments):
            first, size = bounds[s], bounds[s + 1] - bounds[s]
            for i in range(size):
                k = _sorted_row(row_scores, counts, first + i, first + i, False, u, mass, sort_scratch)
                _row_readings(u, mass, k, n_max, True, plug_in[i], subset_means[i], gap, cdf, power, below)
                last = min(draws[first + i], n_max) - 1  # the largest N the row's draws reach, as an index
                for n in range(n_max):
                    m = min(n, last)
                    held[i, n] = subset_means[i, m] - weight[first + i, m] * plug_in[i, m]
                for n in range(n_max):
                    plug_in[i, n] *= weight[first + i, n]
            for reading, rows in ((0, plug_in), (1, held)):
                if size == 1:  # reduceat gives a segment of one row that row
                    out[reading, w, s] = rows[0]
                    continue
                pairwise_rows(rows, 1, size - 1, pairwise, rest)
                for n in range(n_max):
                    out[reading, w, s, n] = rows[0, n] + rest[n]
    return out


def expected_max_rows(scores: np.ndarray, counts: np.ndarray, n_max: int, presorted: bool = False,
                      subsets: bool = False) -> np.ndarray:
    """(..., n_max) E[max of N draws] of each row of ``scores`` (..., M) weighted by ``counts`` (same shape,
    or broadcastable to it); entries of count 0 are padding. ``presorted``: each row's scores ascend.
    ``subsets``: (2, ..., n_max), [1] each row's mean max over the N-subsets of its draws (``counts``; 0 for
    N > n), from the same pass."""
    scores = np.asarray(scores, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    lead, width = scores.shape[:-1], scores.shape[-1]
    if counts.shape[-2:] != scores.shape[-2:] or any(size != 1 for size in counts.shape[:-2]):
        counts = np.broadcast_to(counts, scores.shape)  # else the rows of ``counts`` repeat over the leading axes
    flat = _expected_max_block(np.ascontiguousarray(scores.reshape(-1, width)),
                               np.ascontiguousarray(counts.reshape(-1, width)), int(n_max), bool(presorted),
                               bool(subsets))
    return flat.reshape((2,) + lead + (int(n_max),)) if subsets else flat[0].reshape(lead + (int(n_max),))


def segment_readings(scores: np.ndarray, counts: np.ndarray, n_max: int, weight: np.ndarray,
                     bounds: np.ndarray) -> np.ndarray:
    """(2, W, S, n_max) per segment ``bounds[s]:bounds[s + 1]`` of the rows of ``scores`` (W, R, M) with ``counts``
    (R, M) (integer draws; entries of count 0 are padding): [0] the segment's sum of ``weight`` (R, n_max) x
    E[max of N] V, [1] its sum of the held gaps U(m) - weight(m) V(m), U the mean max over N-subsets and m = min(N,
    the row's draws); ``np.add.reduceat`` over the rows of ``expected_max_rows(..., subsets=True)``'s readings,
    bit for bit."""
    return _segment_readings_block(np.ascontiguousarray(scores, dtype=np.float64),
                                   np.ascontiguousarray(counts, dtype=np.float64), int(n_max),
                                   np.ascontiguousarray(weight, dtype=np.float64),
                                   np.ascontiguousarray(bounds, dtype=np.int64))


@_njit
def _curve_objective(a: float, b: float, g: np.ndarray, n: np.ndarray, z: np.ndarray, lam_a: float, lam_b: float,
                     slope: float) -> float:  # pragma: no cover - compiled
    """One prompt's penalised log-likelihood at (a, b): ``objective`` of ``PlugInEstimator._fit_curves``."""
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
    """``PlugInEstimator._fit_curves`` one prompt at a time: (P, 2) curves and posterior variances from ``start``.

    The same safeguarded Newton steps (each halved until the penalised likelihood does not fall, to
    rounding; a prompt stops once its step is below 1e-9) in one compiled pass per prompt instead of
    numpy passes over (prompts x queries) arrays; the sums run in another order, so the fits agree
    with the numpy path to rounding.
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
    (P, Q) on queries of difficulty ``z`` (Q,), compiled (``PlugInEstimator._fit_curves`` says what they are)."""
    return fit_curves_kernel(np.ascontiguousarray(g, dtype=np.float64), np.ascontiguousarray(n, dtype=np.float64),
                             np.ascontiguousarray(z, dtype=np.float64), float(ridge[0]), float(ridge[1]),
                             float(slope), np.ascontiguousarray(start, dtype=np.float64), int(iterations),
                             int(halvings))


@_njit
def _bin_row(values: np.ndarray, w: int, entry: np.ndarray, counts: np.ndarray, first: int, stop: int,
             mean: np.ndarray, mass: np.ndarray) -> None:  # pragma: no cover - compiled
    """Entries ``first:stop`` (column ``entry[i]`` of row ``w`` of ``values``, count ``counts[i]``) into the
    ``mean.size`` equal-width bins of their range: each bin's mass, and its mean score where the mass is positive
    (``estimator.binned_rows``' operations in its order, so the same bits)."""
    bins = mean.size
    low = high = values[w, entry[first]]
    for i in range(first + 1, stop):
        low = min(low, values[w, entry[i]])
        high = max(high, values[w, entry[i]])
    width = high - low if high - low > 0 else 1.0
    for b in range(bins):
        mean[b] = mass[b] = 0.0
    for i in range(first, stop):
        v = values[w, entry[i]]
        cell = min(int((v - low) / width * bins), bins - 1)
        mass[cell] += counts[i]
        mean[cell] += v * counts[i]
    for b in range(bins):
        if mass[b] > 0:
            mean[b] /= mass[b]


@_njit
def _binned_expected_max_block(values: np.ndarray, counts: np.ndarray, starts: np.ndarray, sizes: np.ndarray,
                               bins: int, entry: np.ndarray, n_max: int) -> np.ndarray:  # pragma: no cover - compiled
    """(W, rows, n_max) E[max of N draws] of each row's binned entries (``_bin_row``): each row is binned into a
    buffer of ``bins`` and read at once (its bins ascend), the values of ``expected_max_rows(...,
    presorted=True)`` on ``binned_rows``' bins without (W, rows, bins) arrays."""
    n_weightings, n_rows = values.shape[0], starts.size
    out = np.empty((n_weightings, n_rows, n_max))
    bin_mean, bin_mass = np.empty(bins), np.empty(bins)
    u, mass, gap, cdf, power, below = _row_scratch(bins)
    for w in range(n_weightings):
        for r in range(n_rows):
            _bin_row(values, w, entry, counts, starts[r], starts[r] + sizes[r], bin_mean, bin_mass)
            k = 0
            for b in range(bins):
                if bin_mass[b] > 0:
                    u[k], mass[k] = bin_mean[b], bin_mass[b]
                    k += 1
            _row_readings(u, mass, k, n_max, False, out[w, r], out[w, r], gap, cdf, power, below)
    return out


def binned_expected_max(values: np.ndarray, counts: np.ndarray, starts: np.ndarray, sizes: np.ndarray, bins: int,
                        n_max: int, entry: np.ndarray | None = None) -> np.ndarray:
    """(W, rows, n_max) E[max of N draws], N = 1..n_max, of each row's entries merged into ``bins`` equal-width
    bins of its range, each at the mean score of its entries: the entries ``values`` (W, entries) with ``counts``
    (entries,) of rows starting at ``starts`` with ``sizes`` entries (each >= 1). With ``entry``, the i-th entry is
    column ``entry[i]`` of ``values`` (read in place, not gathered first)."""
    values = np.ascontiguousarray(values, dtype=np.float64)
    entry = np.arange(values.shape[1]) if entry is None else entry
    return _binned_expected_max_block(values, np.ascontiguousarray(counts, dtype=np.float64),
                                      np.ascontiguousarray(starts, dtype=np.int64),
                                      np.ascontiguousarray(sizes, dtype=np.int64), int(bins),
                                      np.ascontiguousarray(entry, dtype=np.int64), int(n_max))


@_njit
def _residual_block(projected: np.ndarray, level: np.ndarray, offsets: np.ndarray, prompt: np.ndarray,
                    query: np.ndarray, counts: np.ndarray, n_prompts: int,
                    n_queries: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """``residual_sums`` in one pass over tiles of the entries (each tile's rows of ``projected`` stay in cache
    while every weighting reads them); each sum adds its entries in entry order, as ``np.bincount`` does."""
    n_entries, n_weightings = projected.shape
    resid = np.empty((n_weightings, n_entries))
    ss_prompt = np.zeros((n_weightings, n_prompts))
    ss_query = np.zeros((n_weightings, n_queries))
    for tile in range(0, n_entries, 64):
        stop = min(tile + 64, n_entries)
        for w in range(n_weightings):
            for e in range(tile, stop):
                r = projected[e, w] - level[w, prompt[e]] - offsets[w, query[e]]
                resid[w, e] = r
                square = counts[e] * (r * r)
                ss_prompt[w, prompt[e]] += square
                ss_query[w, query[e]] += square
    return resid, ss_prompt, ss_query


def residual_sums(projected: np.ndarray, level: np.ndarray, offsets: np.ndarray, prompt: np.ndarray,
                  query: np.ndarray, counts: np.ndarray, n_prompts: int,
                  n_queries: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(W, E) residuals r = ``projected`` (E, W) - level[w, prompt] - offsets[w, query] of E entries, and (W, P),
    (W, Q) sums of ``counts`` x r^2 by prompt and by query: ``PlugInEstimator._location_scale``'s numpy
    residuals and ``np.bincount`` sums, bit for bit, without (W, E) temporaries."""
    def f64(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float64)
    return _residual_block(f64(projected), f64(level), f64(offsets), np.ascontiguousarray(prompt, dtype=np.int64),
                           np.ascontiguousarray(query, dtype=np.int64), f64(counts), int(n_prompts), int(n_queries))


@_njit
def _standardize_block(resid: np.ndarray, scale: np.ndarray, prompt: np.ndarray) -> None:  # pragma: no cover - compiled
    """``standardize`` in place."""
    n_weightings, n_entries = resid.shape
    for w in range(n_weightings):
        for e in range(n_entries):
            s = scale[w, prompt[e]]
            resid[w, e] = resid[w, e] / s if s > 0 else 0.0


def standardize(resid: np.ndarray, scale: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """``resid`` (W, E), C-contiguous float64, overwritten with resid[w, e] / scale[w, prompt[e]] (0 where that
    scale is 0) and returned: ``np.where(s > 0, resid / np.where(s > 0, s, 1.0), 0.0)`` bit for bit, in one pass."""
    _standardize_block(resid, np.ascontiguousarray(scale, dtype=np.float64), np.ascontiguousarray(prompt, dtype=np.int64))
    return resid


@_njit
def _over_spread_block(std: np.ndarray, spread: np.ndarray, query: np.ndarray,
                       entries: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """``over_spread``."""
    n_weightings = std.shape[0]
    out = np.empty((n_weightings, entries.size))
    for w in range(n_weightings):
        for i in range(entries.size):
            e = entries[i]
            out[w, i] = std[w, e] / spread[w, query[e]]
    return out


def over_spread(std: np.ndarray, spread: np.ndarray, query: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """(W, len(entries)) ``std[:, entries] / spread[:, query[entries]]`` bit for bit, C-contiguous (numpy's gather
    along the last axis is not), in one pass."""
    return _over_spread_block(np.ascontiguousarray(std, dtype=np.float64), np.ascontiguousarray(spread, dtype=np.float64),
                              np.ascontiguousarray(query, dtype=np.int64), np.ascontiguousarray(entries, dtype=np.int64))


@_njit
def _clipped_block(level: np.ndarray, offsets: np.ndarray, scale: np.ndarray, expected: np.ndarray,
                   spread: np.ndarray, shape: np.ndarray, weight: np.ndarray, held: np.ndarray, cap: np.ndarray,
                   seen: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """(W, P, N) sum over each prompt's seen queries of weight x its clipped location-scale reading at N, plus, from
    N = cap + 1 on, held x the reading at N = cap, in one pass (no (W, P, Q, N) work array)."""
    n_weightings, n_prompts = level.shape
    n_queries, n_max = expected.shape[1], expected.shape[2]
    out = np.zeros((n_weightings, n_prompts, n_max))
    for w in range(n_weightings):
        lo, hi = low[w], high[w]
        for p in range(n_prompts):
            lv, sc = level[w, p], scale[w, p]
            for q in range(n_queries):
                if not seen[p, q]:
                    continue
                base, sq, last, extra = lv + offsets[w, q], spread[w, q], cap[p, q] - 1, held[p, q]
                at_cap = 0.0
                for n in range(n_max):
                    r = min(max(base + sc * (expected[w, q, n] + sq * shape[w, p, n]), lo), hi)
                    value = weight[p, q, n] * r
                    if n == last:
                        at_cap = r
                    elif n > last:
                        value += extra * at_cap
                    out[w, p, n] += value
    return out


def clipped_readings(level: np.ndarray, offsets: np.ndarray, scale: np.ndarray, expected: np.ndarray,
                     spread: np.ndarray, shape: np.ndarray, weight: np.ndarray, held: np.ndarray, cap: np.ndarray,
                     seen: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """(W, P, N) sum over the queries ``seen`` (P, Q) marks of weight[p, q, n] R(p, q, n) + [n > c] held[p, q]
    R(p, q, c), c = cap[p, q] (>= 1), R(p, q, n) = clip(level[w, p] + offsets[w, q] + scale[w, p] (expected[w, q, n]
    + spread[w, q] shape[w, p, n]), low[w], high[w]) at N = n: the Best-of-N readings' sum of
    ``PlugInEstimator._bon_value`` (the numpy path's to rounding)."""
    def f64(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float64)
    return _clipped_block(f64(level), f64(offsets), f64(scale), f64(expected), f64(spread), f64(shape), f64(weight),
                          f64(held), np.ascontiguousarray(cap, dtype=np.int64),
                          np.ascontiguousarray(seen, dtype=np.bool_), f64(low), f64(high))


def available() -> bool:
    """Whether the compiled kernels run (numba installed, not switched off by ``IAPO_GYM_JIT=0``)."""
    return enabled()


_warm = False


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels once per process, so no training run pays for it."""
    global _warm
    if not _warm and available():
        credit_rows(np.array([0.5]), np.array([[0.3, 0.2]]), np.array([2]), 2)
        expected_max_rows(np.array([[0.0, 1.0]]), np.array([[1.0, 1.0]]), 2)  # ``presorted`` is a run-time flag
        segment_readings(np.array([[[0.0, 1.0]]]), np.array([[1.0, 1.0]]), 2, np.ones((1, 2)), np.array([0, 1]))
        binned_expected_max(np.array([[0.0, 1.0]]), np.ones(2), np.zeros(1, np.int64), np.full(1, 2), 2, 2)
        index, one_row = np.zeros(1, np.int64), np.ones((1, 1))
        residual_sums(one_row, one_row, one_row, index, index, np.ones(1), 1, 1)
        standardize(np.ones((1, 1)), one_row, index)
        over_spread(one_row, one_row, index, index)
        one = np.ones((1, 1))
        clipped_readings(one, one, one, np.ones((1, 1, 1)), one, np.ones((1, 1, 1)), np.ones((1, 1, 1)), one,
                         np.ones((1, 1), np.int64), np.ones((1, 1), dtype=bool), np.zeros(1), np.ones(1))
        fit_curves(np.ones((1, 2)), np.full((1, 2), 2.0), np.array([-1.0, 1.0]), (1.0, 1.0), np.array([[0.0, 1.0]]),
                   1.0, 2, 2)
        _warm = True


__all__: list[Any] = ["available", "binned_expected_max", "clipped_readings", "credit_rows", "expected_max_rows",
                      "fit_curves", "over_spread", "residual_sums", "segment_readings", "standardize", "warm_up"]
