"""The plug-in estimator's compiled kernels (``agents/plugin/_*_kernels.py``) against slow, obviously correct
references: each formula written per row (or per prompt and query) and per N with plain Python loops.

Where a kernel adds in the order the reference does (the residual sums, the clipped readings, the binning), the
values are compared bit for bit; where it reorders a sum for speed (the expected maxima, the credit), to 1e-12.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.optimize

from agents._vote_credit import credit_rows, mv_credit_rows
from agents.plugin._max_kernels import binned_expected_max, expected_max_rows, segment_readings
from agents.plugin._scale_kernels import clipped_readings, location_scale_readings, over_spread, residual_sums, standardize
from agents.plugin._vote_kernels import fit_curves
from iapo_gym.exact import bon_expected_max, mv_expected_credit


# ---- the references -----------------------------------------------------------------------------------------
def ref_expected_max(values: list[float], counts: list[float], n: int) -> float:
    """E[max of n draws] from outcomes ``values`` with weights ``counts``: sum_j u_j (F(u_j)^n - F(u_j-)^n)."""
    pairs = sorted((v, c) for v, c in zip(values, counts, strict=True) if c > 0)
    total = sum(c for _, c in pairs)
    expected, below = 0.0, 0.0
    for value, count in pairs:
        expected += value * (((below + count) / total) ** n - (below / total) ** n)
        below += count
    return expected


def ref_subset_mean(values: list[float], counts: list[int], n: int) -> float:
    """The mean, over every n-subset of the draws (each outcome repeated by its count), of the subset's maximum."""
    draws = [v for v, c in zip(values, counts, strict=True) for _ in range(int(c))]
    if n > len(draws):
        return 0.0
    subsets = list(itertools.combinations(draws, n))
    return sum(max(s) for s in subsets) / len(subsets)


def ref_mv_credit(probs: list[float], gold: int, n: int) -> float:
    """Majority-vote credit of n votes: over every vote vector, its multinomial probability times 1 / (the buckets
    tied at the top) where gold is among them."""
    def vectors(left: int, buckets: int) -> list[tuple[int, ...]]:
        if buckets == 1:
            return [(left,)]
        return [(k,) + rest for k in range(left + 1) for rest in vectors(left - k, buckets - 1)]

    credit = 0.0
    for votes in vectors(n, len(probs)):
        prob = float(math.factorial(n))
        for p, v in zip(probs, votes, strict=True):
            prob *= p ** v / math.factorial(v)
        top = max(votes)
        if votes[gold] == top:
            credit += prob / votes.count(top)
    return credit


def ref_curve_fit(g: list[float], n: list[float], z: list[float], lam_a: float, lam_b: float, slope: float,
                  start: tuple[float, float], iterations: int, halvings: int) -> tuple[float, float, float, float]:
    """One prompt's safeguarded Newton fit of the ridge-penalised binomial logistic curve sigmoid(a + b z): each step
    halved until the penalised log-likelihood does not fall (to 1e-12 relative), stopping below a 1e-9 step; the
    curve and the inverse Hessian's diagonal at the last step's start."""
    def objective(a: float, b: float) -> float:
        total = 0.0
        for gj, nj, zj in zip(g, n, z, strict=True):
            x = a + b * zj
            total += nj * (max(0.0, -x) + math.log1p(math.exp(-abs(x)))) + (nj - gj) * x
        return -total - 0.5 * (lam_a * a * a + lam_b * (b - slope) ** 2)

    a, b = start
    value, var_a, var_b = objective(a, b), 0.0, 0.0
    for _ in range(iterations):
        grad_a, grad_b, h00, h01, h11 = -lam_a * a, -lam_b * (b - slope), lam_a, 0.0, lam_b
        for gj, nj, zj in zip(g, n, z, strict=True):
            mu = 1.0 / (1.0 + math.exp(-min(30.0, max(-30.0, a + b * zj))))
            r, w = gj - nj * mu, nj * mu * (1.0 - mu)
            grad_a, grad_b = grad_a + r, grad_b + r * zj
            h00, h01, h11 = h00 + w, h01 + w * zj, h11 + w * zj * zj
        det = h00 * h11 - h01 * h01
        step_a, step_b = (h11 * grad_a - h01 * grad_b) / det, (h00 * grad_b - h01 * grad_a) / det
        var_a, var_b = h11 / det, h00 / det
        size = 1.0
        for _ in range(halvings):
            trial = objective(a + size * step_a, b + size * step_b)
            if trial >= value - 1e-12 * abs(value):
                value = trial
                break
            size *= 0.5
        else:
            size = 0.0
        a, b = a + size * step_a, b + size * step_b
        if max(abs(size * step_a), abs(size * step_b)) < 1e-9:
            break
    return a, b, var_a, var_b


def ref_reading(base: float, scale: float, expected: float, spread: float, shape: float, low: float,
                high: float) -> float:
    """The location-scale reading R = clip(level_p + o_q + scale_p (M_q(N) + s_q D_p(N)), low, high)."""
    return min(max(base + scale * (expected + spread * shape), low), high)


# ---- the tests ----------------------------------------------------------------------------------------------
def test_majority_vote_credit_matches_the_vote_by_vote_reference_and_the_oracle() -> None:
    """``mv_credit_rows`` (only the buckets of positive probability, through the compiled ``credit_rows``) equals the
    enumeration of every vote vector on small rows, and the oracle's ``mv_expected_credit`` on 300 rows with 0-4
    other buckets; the block size of the kernel's lanes does not change a bit."""
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(4, 0.6), size=12)
    probs[probs < 0.1] = 0.0
    probs[0] = np.eye(4)[1]  # one bucket takes every vote
    probs /= probs.sum(axis=1, keepdims=True)
    gold = rng.integers(4, size=12)
    got = mv_credit_rows(probs, gold, 7)
    for r in range(12):
        for n in range(1, 8):
            assert got[r, n - 1] == pytest.approx(ref_mv_credit(list(probs[r]), int(gold[r]), n), abs=1e-12)
    probs = rng.dirichlet(np.full(5, 0.5), size=300)
    probs[probs < 0.08] = 0.0
    probs /= probs.sum(axis=1, keepdims=True)
    gold = rng.integers(5, size=300)
    compiled = mv_credit_rows(probs, gold, 16)
    assert np.abs(compiled - mv_expected_credit(probs, gold, 16)).max() < 1e-12
    others = np.sort(np.where(np.eye(5, dtype=bool)[gold], -1.0, probs), axis=1)[:, ::-1][:, :4]
    width = (others > 0).sum(axis=1)
    for block_rows in (1, 7):  # a row's lane never reads another row's
        assert np.array_equal(credit_rows(probs[np.arange(300), gold], others, width, 16, block_rows), compiled)
    with pytest.raises(ValueError, match="block_rows"):
        credit_rows(probs[np.arange(300), gold], others, width, 16, 0)


@pytest.mark.parametrize("width", [5, 40, 200])  # insertion sort, and the bucket sort past 32 outcomes
def test_expected_max_rows_match_the_per_row_reference(width: int) -> None:
    """``expected_max_rows`` equals the reference on rows with ties, padding (count 0) and one outcome, and the
    oracle's ``bon_expected_max`` on all of them; ``presorted`` reads ascending rows as the sorting path does."""
    rng = np.random.default_rng(width)
    scores = np.round(rng.normal(size=(2, 30, width)), 1)  # rounded: many ties
    counts = rng.integers(0, 3, scores.shape).astype(np.float64)
    counts[..., 0] = 1.0
    counts[:, :5, 1:] = 0.0  # rows with one outcome
    got = expected_max_rows(scores, counts, 20)
    for w, r in itertools.product(range(2), range(0, 30, 3)):
        for n in (1, 2, 7, 20):
            assert got[w, r, n - 1] == pytest.approx(ref_expected_max(list(scores[w, r]), list(counts[w, r]), n),
                                                     abs=1e-12)
    padded = np.where(counts > 0, scores, scores.min(axis=-1, keepdims=True) - 1.0)
    assert np.abs(got - bon_expected_max(padded, counts, 20)).max() < 1e-12
    ascending = np.sort(scores, axis=-1)
    assert np.array_equal(expected_max_rows(ascending, counts, 20, presorted=True),
                          expected_max_rows(ascending, counts, 20))


def test_expected_max_kernel_sorts_rows_of_any_spread_as_presorted_rows_read() -> None:
    """The kernel's sort (insertion up to 32 outcomes, buckets then insertion past it) gives, on shuffled rows, the
    presorted path's bits on the same rows sorted: normal scores, one score, ties, one outlier far above the rest,
    a range of a few ulps and a range of subnormals too narrow to bucket (the insertion pass alone)."""
    rng = np.random.default_rng(5)
    width = 200
    ramp = np.arange(width, dtype=np.float64)
    rows = np.stack([rng.normal(size=width), np.full(width, 0.25), np.round(rng.normal(size=width), 1),
                     np.r_[rng.normal(size=width - 1), 1e6], 1.0 + ramp * np.spacing(1.0), ramp * 5e-324,
                     rng.normal(size=width)[:40].repeat(5)])
    counts = rng.integers(0, 4, rows.shape).astype(np.float64)
    for k in (5, 33, width):  # outcomes per row: insertion alone, just past it, the whole row
        shuffled = rng.permuted(np.argsort(rng.random(rows.shape), axis=1)[:, :k], axis=1)
        scores, mass = np.take_along_axis(rows, shuffled, axis=1), np.take_along_axis(counts, shuffled, axis=1)
        mass[:, 0] = 1.0
        order = np.argsort(scores, axis=1, kind="stable")
        ascending = np.take_along_axis(scores, order, axis=1)
        assert np.array_equal(expected_max_rows(scores, mass, 24),
                              expected_max_rows(ascending, np.take_along_axis(mass, order, axis=1), 24, presorted=True))


def test_subset_means_and_segment_sums_match_the_per_row_references() -> None:
    """``expected_max_rows(..., subsets=True)``'s second part is, per row and N, the mean of the maximum over every
    N-subset of the row's draws (0 for N > n); ``segment_readings`` sums, per segment of rows (1 to 300 rows: past
    numpy's 128-term pairwise blocks) and N, weight x V(N) and the held gap U(m) - weight(m) V(m), m = min(N, n)."""
    rng = np.random.default_rng(4)
    scores = np.round(rng.normal(size=(2, 40, 5)), 1)  # many ties
    counts = rng.integers(0, 3, (40, 5)).astype(np.float64)
    counts[:, 0] = np.maximum(counts[:, 0], 1.0)
    counts[:3, 1:] = 0.0
    counts[3] = [1, 0, 0, 0, 0]  # one draw
    plug_in, unbiased = expected_max_rows(scores, np.broadcast_to(counts, scores.shape), 12, subsets=True)
    for w, r in itertools.product(range(2), range(40)):
        for n in range(1, 13):
            want = ref_subset_mean(list(scores[w, r]), list(counts[r]), n)
            assert unbiased[w, r, n - 1] == pytest.approx(want, abs=1e-12)
            assert plug_in[w, r, n - 1] == pytest.approx(ref_expected_max(list(scores[w, r]), list(counts[r]), n),
                                                         abs=1e-12)
    n_rows, n_max = 700, 12
    counts = rng.integers(0, 3, (n_rows, 5)).astype(np.float64)
    counts[:, 0] = np.maximum(counts[:, 0], 1.0)
    counts[::7] += 2.0  # every 7th row has N_max draws or more
    scores = np.round(rng.normal(size=(2, n_rows, 5)), 2)
    weight = rng.random((n_rows, n_max))
    bounds = np.array([0, 1, 3, 10, 138, 139, 439, 600, 700])
    plug_in, unbiased = expected_max_rows(scores, np.broadcast_to(counts, scores.shape), n_max, subsets=True)
    sums = segment_readings(scores, counts, n_max, weight, bounds)
    draws = counts.sum(axis=1).astype(int)
    assert (draws >= n_max).any() and (draws < n_max).any()
    for w, s in itertools.product(range(2), range(bounds.size - 1)):
        for n in range(n_max):
            own = held = 0.0
            for r in range(bounds[s], bounds[s + 1]):
                m = min(n, draws[r] - 1)
                own += weight[r, n] * plug_in[w, r, n]
                held += unbiased[w, r, m] - weight[r, m] * plug_in[w, r, m]
            assert sums[0, w, s, n] == pytest.approx(own, abs=1e-12)
            assert sums[1, w, s, n] == pytest.approx(held, abs=1e-12)


def test_binned_expected_max_matches_a_bin_by_bin_reference() -> None:
    """``binned_expected_max``: each row's entries into equal-width bins of its range (a row of one score: one bin),
    each bin at the mean of its entries, then the expected max of N of the bins; entries read in place (``entry``)
    or gathered first give the same bits."""
    rng = np.random.default_rng(3)
    sizes = np.array([1, 7, 300, 40])
    starts = np.cumsum(sizes) - sizes
    values = rng.normal(size=(2, sizes.sum()))
    values[:, starts[3]:] = 0.5  # a row of one score: zero width
    counts = rng.integers(1, 4, sizes.sum()).astype(np.float64)
    bins, n_max = 16, 10
    got = binned_expected_max(values, counts, starts, sizes, bins, n_max)
    for w, r in itertools.product(range(2), range(sizes.size)):
        entries = range(starts[r], starts[r] + sizes[r])
        low, high = min(values[w, i] for i in entries), max(values[w, i] for i in entries)
        width = high - low if high - low > 0 else 1.0
        mass, total = [0.0] * bins, [0.0] * bins
        for i in entries:
            cell = min(int((values[w, i] - low) / width * bins), bins - 1)
            mass[cell] += counts[i]
            total[cell] += values[w, i] * counts[i]
        means = [t / m if m > 0 else 0.0 for t, m in zip(total, mass, strict=True)]
        for n in range(1, n_max + 1):
            assert got[w, r, n - 1] == pytest.approx(ref_expected_max(means, mass, n), abs=1e-12)
    picked = rng.permutation(values.shape[1])
    wide = np.zeros((2, values.shape[1]))
    wide[:, picked] = values
    assert np.array_equal(binned_expected_max(wide, counts, starts, sizes, bins, n_max, picked), got)


def test_residual_kernels_equal_the_entry_by_entry_reference_bit_for_bit() -> None:
    """The residuals r = score - level_p - o_q, their sums of count x r^2 by prompt and by query (added in entry
    order), the residuals over their prompt's scale (0 where it is 0) and over their query's spread."""
    rng = np.random.default_rng(11)
    n_entries, n_prompts, n_queries = 400, 6, 9
    prompt, query = rng.integers(0, n_prompts, n_entries), np.sort(rng.integers(0, n_queries, n_entries))
    draws = rng.integers(1, 6, n_entries).astype(np.float64)
    projected = rng.normal(size=(n_entries, 2))
    level, offsets = rng.normal(size=(2, n_prompts)), rng.normal(size=(2, n_queries))
    resid, ss_prompt, ss_query = residual_sums(projected, level, offsets, prompt, query, draws, n_prompts, n_queries)
    scale = np.abs(rng.normal(size=(2, n_prompts)))
    scale[:, 3] = 0.0  # a prompt without spread
    spread = np.abs(rng.normal(size=(2, n_queries))) + 0.1
    std = standardize(resid.copy(), scale, prompt)
    entries = np.sort(rng.choice(n_entries, 150, replace=False))
    unit = over_spread(std, spread, query, entries)
    assert unit.flags.c_contiguous
    for w in range(2):
        want_p, want_q = [0.0] * n_prompts, [0.0] * n_queries
        for e in range(n_entries):
            r = projected[e, w] - level[w, prompt[e]] - offsets[w, query[e]]
            assert resid[w, e] == r
            want_p[prompt[e]] += draws[e] * (r * r)
            want_q[query[e]] += draws[e] * (r * r)
            s = scale[w, prompt[e]]
            assert std[w, e] == (r / s if s > 0 else 0.0)
        assert ss_prompt[w].tolist() == want_p and ss_query[w].tolist() == want_q
        for i, e in enumerate(entries):
            assert unit[w, i] == std[w, e] / spread[w, query[e]]


def test_location_scale_readings_equal_the_query_by_query_reference_bit_for_bit() -> None:
    """``location_scale_readings`` is R for every (prompt, query, N), held within [low, high]; ``clipped_readings``
    is, per set of weights, prompt and N, the sum over its seen queries (in query order) of weight x R(N), plus,
    past the pair's draws d, weight_at_draws x R(d)."""
    rng = np.random.default_rng(8)
    n_w, n_p, n_q, n_max = 2, 4, 6, 7
    expected, spread = rng.normal(size=(n_w, n_q, n_max)), np.abs(rng.normal(size=(n_w, n_q)))
    shape, scale = rng.normal(size=(n_w, n_p, n_max)), np.abs(rng.normal(size=(n_w, n_p)))
    level, offsets = rng.normal(size=(n_w, n_p)), rng.normal(size=(n_w, n_q))
    low, high = np.array([-1.5, -2.0]), np.array([1.0, 1.5])  # some readings are clipped
    weight, weight_at_draws = rng.random((2, n_p, n_q, n_max)), rng.normal(size=(2, n_p, n_q))
    draws, seen = rng.integers(1, n_max + 2, (n_p, n_q)), rng.random((n_p, n_q)) < 0.7
    readings = location_scale_readings(expected, spread, shape, scale, level, offsets, low, high)
    summed = clipped_readings(level, offsets, scale, expected, spread, shape, weight, weight_at_draws, draws, seen,
                              low, high)
    clipped = 0
    for k, w, p in itertools.product(range(2), range(n_w), range(n_p)):
        total = [0.0] * n_max
        for q in range(n_q):
            base = level[w, p] + offsets[w, q]
            r = [ref_reading(base, scale[w, p], expected[w, q, n], spread[w, q], shape[w, p, n], low[w], high[w])
                 for n in range(n_max)]
            assert readings[w, p, q].tolist() == r
            clipped += sum(x in (low[w], high[w]) for x in r)
            if seen[p, q]:
                for n in range(n_max):
                    value = weight[k, p, q, n] * r[n]
                    if n > draws[p, q] - 1:
                        value += weight_at_draws[k, p, q] * r[draws[p, q] - 1]
                    total[n] += value
        assert summed[k, w, p].tolist() == total
    assert clipped > 0


def test_curve_fit_takes_the_reference_newton_steps() -> None:
    """``fit_curves``: the same curves and posterior variances as the plain-loop Newton fit, from the pooled start
    and from a start far off (where the step halving does the work), with the slope free and held near a value."""
    rng = np.random.default_rng(7)
    n_prompts, n_queries = 5, 30
    z = rng.normal(0.0, 1.5, n_queries)
    n = rng.integers(1, 6, (n_prompts, n_queries)).astype(np.float64)
    a_true, b_true = rng.normal(0.0, 1.0, n_prompts), rng.normal(1.0, 0.5, n_prompts)
    a_true[0], b_true[0] = -4.0, 0.1  # a prompt far from the pool
    g = rng.binomial(n.astype(np.int64), 1.0 / (1.0 + np.exp(-(a_true[:, None] + b_true[:, None] * z)))).astype(float)
    for start in (np.column_stack([np.zeros(n_prompts), np.ones(n_prompts)]), np.full((n_prompts, 2), [8.0, -5.0])):
        for ridge, slope in (((3.0, 1.0), 1.0), ((3.0, 1e6), 1.3)):
            theta, variance = fit_curves(g, n, z, ridge, start, slope, 25, 30)
            for p in range(n_prompts):
                want = ref_curve_fit(list(g[p]), list(n[p]), list(z), ridge[0], ridge[1], slope, tuple(start[p]), 25, 30)
                np.testing.assert_allclose([*theta[p], *variance[p]], want, rtol=1e-9, atol=1e-12)


def ref_threshold_fit(scores: list[float], counts: list[float], entry_pair: list[int], pair_prompt: list[int],
                      pair_query: list[int], n_prompts: int, n_queries: int, max_thresholds: int,
                      ridges: tuple[float, float]) -> tuple[list[float], list[float], np.ndarray, np.ndarray]:
    """One weighting's threshold-logit fit written out: the thresholds (every distinct score but the largest, or
    the weighted quantiles j / (max_thresholds + 1) without repeats and without the largest score), the bins'
    mean scores, and scipy's minimum of the binomial negative log-likelihood of each pair's draws above each
    threshold under logit = a_pk + b_qk plus the ridges ridges[0] / 2 (a_pk - pooled_k)^2 and ridges[1] / 2 b_qk^2."""
    distinct = sorted(set(scores))
    if len(distinct) - 1 <= max_thresholds:
        thresholds = distinct[:-1]
    else:
        ordered = sorted(zip(scores, counts, strict=True))
        total, thresholds = sum(counts), []
        running = list(itertools.accumulate(count for _, count in ordered))
        for j in range(1, max_thresholds + 1):  # the first score whose running count reaches the quantile
            value = next(v for (v, _), below in zip(ordered, running, strict=True)
                         if below >= j * total / (max_thresholds + 1))
            if value < distinct[-1] and (not thresholds or value > thresholds[-1]):
                thresholds.append(value)
    k = len(thresholds)
    bins = [sum(1 for t in thresholds if s > t) for s in scores]
    values = [sum(c * s for s, c, b in zip(scores, counts, bins, strict=True) if b == j)
              / sum(c for c, b in zip(counts, bins, strict=True) if b == j) for j in range(k + 1)]
    n_pairs = len(pair_prompt)
    above = np.array([[sum(c for c, b, e in zip(counts, bins, entry_pair, strict=True) if e == i and b > j)
                       for j in range(k)] for i in range(n_pairs)])
    drawn = np.array([sum(c for c, e in zip(counts, entry_pair, strict=True) if e == i) for i in range(n_pairs)])
    pooled = np.log(above.sum(axis=0) / (drawn.sum() - above.sum(axis=0)))

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        a, b = theta[:n_prompts * k].reshape(n_prompts, k), theta[n_prompts * k:].reshape(n_queries, k)
        logit = a[pair_prompt] + b[pair_query]
        value = (drawn[:, None] * np.logaddexp(0.0, logit) - above * logit).sum()
        value += ridges[0] / 2 * ((a - pooled) ** 2).sum() + ridges[1] / 2 * (b ** 2).sum()
        resid = drawn[:, None] / (1 + np.exp(-logit)) - above
        grad_a, grad_b = ridges[0] * (a - pooled), ridges[1] * b
        np.add.at(grad_a, pair_prompt, resid)
        np.add.at(grad_b, pair_query, resid)
        return float(value), np.concatenate([grad_a.ravel(), grad_b.ravel()])
    start = np.concatenate([np.tile(pooled, n_prompts), np.zeros(n_queries * k)])
    found = scipy.optimize.minimize(loss, start, jac=True, method="L-BFGS-B", options={"gtol": 1e-11, "ftol": 0,
                                                                                       "maxiter": 10_000})
    return thresholds, values, found.x[:n_prompts * k].reshape(n_prompts, k), found.x[n_prompts * k:].reshape(n_queries, k)


@pytest.mark.parametrize("n_levels", [5, 60])  # every distinct score a threshold, and weighted quantiles
def test_threshold_fit_is_the_penalized_likelihoods_maximum(n_levels: int) -> None:
    """``threshold_fit`` finds the reference's thresholds and bins, and its logits are scipy's minimum of the
    penalized binomial loss (to 1e-5; the fit stops at 1e-9 in probability): the alternating Newton sweeps and the
    step along the direction the data do not see converge there, on an unbalanced design with an unseen prompt."""
    from agents.plugin._logit_kernels import threshold_fit

    rng = np.random.default_rng(11)
    n_prompts, n_queries, n_w = 5, 6, 2
    seen = (rng.random((n_prompts, n_queries)) < 0.7) & (np.arange(n_prompts) < n_prompts - 1)[:, None]
    pair_prompt, pair_query = np.nonzero(seen)
    entry_pair = np.repeat(np.arange(pair_prompt.size), 3)
    scores = rng.integers(0, n_levels, (n_w, entry_pair.size)) / n_levels
    counts = rng.integers(1, 6, entry_pair.size).astype(float)
    a, b, values, k = threshold_fit(scores, counts, entry_pair, pair_prompt, pair_query, n_prompts, n_queries, 8, 20,
                                    0.01, 1.0, 2.0, 1e-9)  # 20 sweeps: without the step along it, far from there
    for w in range(n_w):
        thresholds, ref_values, ref_a, ref_b = ref_threshold_fit(
            scores[w].tolist(), counts.tolist(), entry_pair.tolist(), pair_prompt, pair_query, n_prompts, n_queries,
            8, (0.01, 1.0))
        assert k[w] == len(thresholds) and (k[w] == 8) == (n_levels == 60)
        np.testing.assert_allclose(values[w, :k[w] + 1], ref_values, rtol=0, atol=1e-12)
        np.testing.assert_allclose(a[w, :, :k[w]], ref_a, rtol=0, atol=1e-5)
        np.testing.assert_allclose(b[w, :, :k[w]], ref_b, rtol=0, atol=1e-5)


def test_threshold_fit_stops_once_its_probabilities_settle() -> None:
    """With the tolerance the fit stops early, its probabilities within about the tolerance of the converged fit's;
    without it (0) it runs every sweep. A stop on the wrong quantity, or none, fails one of the two."""
    from agents.plugin._logit_kernels import threshold_fit

    rng = np.random.default_rng(13)
    n_prompts, n_queries = 6, 40
    pair_prompt, pair_query = np.nonzero(rng.random((n_prompts, n_queries)) < 0.5)
    entry_pair = np.repeat(np.arange(pair_prompt.size), 4)
    scores = rng.normal(size=(1, entry_pair.size)) + rng.normal(size=n_prompts)[pair_prompt[entry_pair]]
    counts = rng.integers(1, 4, entry_pair.size).astype(float)

    def probs(sweeps: int, tol: float) -> np.ndarray:
        a, b, _, k = threshold_fit(scores, counts, entry_pair, pair_prompt, pair_query, n_prompts, n_queries, 24,
                                   sweeps, 0.01, 1.0, 2.0, tol)
        return 1 / (1 + np.exp(-(a[0, pair_prompt, :k[0]] + b[0, pair_query, :k[0]])))
    converged, stopped = probs(500, 0.0), probs(500, 1e-6)
    assert np.abs(stopped - converged).max() < 1e-5
    taken = next(s for s in range(1, 500) if np.array_equal(probs(s, 0.0), stopped))
    assert 3 < taken <= 30  # it stopped after a few sweeps, not at the cap
    assert np.abs(probs(taken - 1, 0.0) - probs(taken - 2, 0.0)).max() < 1e-6  # once they moved less than tol
    assert np.abs(probs(taken - 2, 0.0) - probs(taken - 3, 0.0)).max() >= 1e-6  # and not before


def test_threshold_readings_are_the_exact_expected_max_of_the_bins() -> None:
    """``threshold_readings`` of a (prompt, query) is the oracle's E[max of N] of the K + 1 bins whose masses are the
    fitted P(score > t_k) = sigmoid(a_pk + b_qk), made non-increasing in k, differenced; 0 where not asked."""
    from agents.plugin._logit_kernels import threshold_readings

    rng = np.random.default_rng(12)
    n_w, n_p, n_q, k_max, n_max = 2, 3, 4, 6, 9
    a, b = rng.normal(0, 2, (n_w, n_p, k_max)), rng.normal(0, 1, (n_w, n_q, k_max))
    values = np.sort(rng.normal(size=(n_w, k_max + 1)), axis=1)
    k = np.array([6, 3])
    prompts, queries = np.array([2, 0]), np.array([3, 1, 2])
    seen = np.array([[True, False, True], [True, True, False]])
    out = threshold_readings((a, b, values, k), prompts, queries, seen, n_max)
    for w, (i, p), (c, q) in itertools.product(range(n_w), enumerate(prompts), enumerate(queries)):
        if not seen[i, c]:
            assert not out[w, i, c].any()
            continue
        above = np.minimum.accumulate(1 / (1 + np.exp(-(a[w, p, :k[w]] + b[w, q, :k[w]]))))
        mass = -np.diff(np.r_[1.0, above, 0.0])
        exact = bon_expected_max(values[w, :k[w] + 1][None], mass[None], n_max)[0]
        np.testing.assert_allclose(out[w, i, c], exact, rtol=0, atol=1e-12)
