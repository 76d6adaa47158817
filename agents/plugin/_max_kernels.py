"""The Best-of-N expected-maximum kernels of the plug-in estimator (numba).

``expected_max_rows``: each row's outcomes with a positive count are sorted in a compiled loop and
E[max of N] = u_(M) - sum_j (u_(j+1) - u_(j)) F_j^N is summed for every N with the powers in a row-sized buffer;
with ``subsets`` the same pass also gives each row's mean max over the N-subsets of its draws (F_j^N read as
C(c_j, N) / C(n, N)). ``segment_readings`` sums, per prompt, the pulled (prompt, query) rows' weighted plug-in
readings and their held gaps to the unbiased one in that pass. ``binned_expected_max`` bins each row of the
location-scale pools into equal-width bins and reads it at once. ``tests/test_plugin_kernels.py`` checks each
against a per-row, per-N reference written with plain loops and the oracle's ``bon_expected_max``.
"""

from __future__ import annotations

import math

import numpy as np

from agents._jit import _njit, _reduceat_sum, pairwise_scratch

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
def _gather_row(scores: np.ndarray, counts: np.ndarray, r: int, count_row: int, u: np.ndarray,
                mass: np.ndarray) -> int:  # pragma: no cover - compiled
    """Row r's outcomes (their counts in row ``count_row`` of ``counts``) of positive count into ``u`` and
    ``mass``, in the row's order (``_sort_outcomes`` sorts them); their number."""
    k = 0
    for j in range(scores.shape[1]):
        if counts[count_row, j] > 0:
            u[k], mass[k] = scores[r, j], counts[count_row, j]
            k += 1
    return k


@_njit
def _row_scratch(width: int) -> tuple[np.ndarray, ...]:  # pragma: no cover - compiled
    """The buffers of ``_gather_row`` (outcomes, counts), ``_row_readings`` (gap, cdf, power) and
    ``_row_subset_means`` (below) for rows of ``width``."""
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
def _row_readings(u: np.ndarray, mass: np.ndarray, k: int, n_max: int, plug_in: np.ndarray, gap: np.ndarray,
                  cdf: np.ndarray, power: np.ndarray) -> None:  # pragma: no cover - compiled
    """One row's E[max of N draws], N = 1..n_max, into ``plug_in``: the row's k outcomes ``u``, ascending, of counts
    ``mass``; ``gap``, ``cdf`` and ``power`` are scratch of at least k, left holding the steps between sorted outcomes
    and the cdf below each (what ``_row_subset_means`` reads next)."""
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


@_njit
def _row_subset_means(u: np.ndarray, mass: np.ndarray, k: int, n_max: int, subset_means: np.ndarray,
                      gap: np.ndarray, cdf: np.ndarray, below: np.ndarray) -> None:  # pragma: no cover - compiled
    """The row's mean max over the N-subsets of its draws (integer counts ``mass``), N = 1..n_max, into
    ``subset_means`` (0 for N past its draws), right after ``_row_readings`` of the same row (its ``gap`` and
    ``cdf``); ``below`` is scratch of at least k."""
    total = 0.0
    for j in range(k):
        total += mass[j]
    top = u[k - 1]
    steps = k - 1
    whole = steps - steps % 4
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
        k = _gather_row(scores, counts, r, r % counts.shape[0], u, mass)
        if not presorted:
            _sort_outcomes(u, mass, k, *sort_scratch)
        _row_readings(u, mass, k, n_max, out[0, r], gap, cdf, power)
        if subsets:
            _row_subset_means(u, mass, k, n_max, out[1, r], gap, cdf, below)
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
    pairwise = pairwise_scratch(n_max)
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
                k = _gather_row(row_scores, counts, first + i, first + i, u, mass)
                _sort_outcomes(u, mass, k, *sort_scratch)
                _row_readings(u, mass, k, n_max, plug_in[i], gap, cdf, power)
                _row_subset_means(u, mass, k, n_max, subset_means[i], gap, cdf, below)
                last = min(draws[first + i], n_max) - 1  # the largest N the row's draws reach, as an index
                for n in range(n_max):
                    m = min(n, last)
                    held[i, n] = subset_means[i, m] - weight[first + i, m] * plug_in[i, m]
                for n in range(n_max):
                    plug_in[i, n] *= weight[first + i, n]
            for reading, rows in ((0, plug_in), (1, held)):
                if size == 1:  # reduceat gives a segment of one row that row
                    for n in range(n_max):
                        out[reading, w, s, n] = rows[0, n]
                    continue
                _reduceat_sum(rows, size, pairwise, out[reading, w, s])
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
    the row's draws), each segment summed as ``np.add.reduceat`` sums its rows (the first row plus numpy's
    pairwise sum of the others: a fixed order)."""
    return _segment_readings_block(np.ascontiguousarray(scores, dtype=np.float64),
                                   np.ascontiguousarray(counts, dtype=np.float64), int(n_max),
                                   np.ascontiguousarray(weight, dtype=np.float64),
                                   np.ascontiguousarray(bounds, dtype=np.int64))


@_njit
def _bin_row(values: np.ndarray, w: int, entry: np.ndarray, counts: np.ndarray, first: int, stop: int,
             mean: np.ndarray, mass: np.ndarray) -> None:  # pragma: no cover - compiled
    """Entries ``first:stop`` (column ``entry[i]`` of row ``w`` of ``values``, count ``counts[i]``) into the
    ``mean.size`` equal-width bins of their range: each bin's mass, and its mean score where the mass is positive
    (entries added in their order)."""
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
    bin_mean, bin_mass = np.empty((1, bins)), np.empty((1, bins))
    u, mass, gap, cdf, power, _ = _row_scratch(bins)  # no subset means here
    for w in range(n_weightings):
        for r in range(n_rows):
            _bin_row(values, w, entry, counts, starts[r], starts[r] + sizes[r], bin_mean[0], bin_mass[0])
            k = _gather_row(bin_mean, bin_mass, 0, 0, u, mass)  # the bins of positive mass, ascending
            _row_readings(u, mass, k, n_max, out[w, r], gap, cdf, power)
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
