"""``PlugInEstimator``: Q(c, p, N) for every N read off per-(prompt, query) outcome distributions.

The oracle's exact formulas (``mv_expected_credit``, ``bon_expected_max``) are applied to smoothed
empirical distributions, one per (prompt, query) the agent pulled. A few completions per (prompt,
query) say little, so each is read together with a prior that shares what the other queries and
prompts show; the prior's weight falls as the (prompt, query)'s own completions grow, so on a
finite train split every estimate converges to the train-split Q as the budget grows.

* Majority vote: per (prompt, query), its votes plus a = min(``alpha``, a_EB) pseudo-votes of a
  prior whose gold share is the prompt's response curve over query difficulty (``curve`` > 0), or
  the query's answers pooled over every prompt (``curve`` = 0); each (prompt, query)'s credit is
  averaged over the prompt's queries. a_EB is the empirical-Bayes weight of the prior: the
  beta-binomial concentration that the spread of the updated prompts' gold votes around the
  prior's shares shows (``prior_votes``), so a prior the votes contradict loses its weight as
  the evidence grows, and one they follow keeps ``alpha``.
* Best-of-N: per (prompt, query), the expected maximum of its own outcomes, shrunk towards a
  location-scale reading: score = prompt level + query offset + prompt scale x a residual drawn from
  the query's residual distribution, which every prompt drawn on the query shares (so its expected
  max of N is read from all their draws at once), plus the prompt's own shape over its queries
  against the pool over every query, shrunk by its draws (``SHAPE_DRAWS``), held within the range the
  table's outcomes can score (a residual pooled from a prompt far from the range's top would read past
  it). The pooled reading weighs as ``bon_prior`` x N of the query's own completions at scale N (a
  maximum of N reads the top of a distribution, which few own draws cannot show). Both readings are biased (the pooled one
  by the location-scale model's misfit, the plug-in one low for N near n and beyond), and by amounts that differ
  between prompts; so each prompt's value at N is also corrected by the mean, over its s queries, of each query's
  unbiased reading (the mean max over m-subsets of its n draws) less its shrunk reading, both at m = min(N, n),
  weighted s / (s + ``CORRECTION_QUERIES``): up to a query's draws the correction removes the shrunk reading's
  bias, whatever the model's misfit; beyond them it keeps the bias measured where the draws end, so the estimate
  does not bend at a query's draws.
  Prompts read on different queries are compared on one reference's (the read prompt that saw the most):
  each moves by the reference's value on its own queries less its value on the prompt's
  (``_move_to_reference``), unmoved while all saw the same queries.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agents.estimator import Estimator
from agents.plugin import _credit_jit
from iapo_gym import Policy, Pulls
from iapo_gym.utility import bon_expected_max, mv_expected_credit

#: Newton steps of a response-curve fit at most, and halvings of one step at most.
CURVE_ITERATIONS, CURVE_HALVINGS = 25, 30
#: The ridge on the slope of the curves whose slope is held at the median (``pretest``).
RIDGE_MAX = 1e6
#: Alternating least-squares sweeps of ``PlugInEstimator.query_offsets``.
OFFSET_SWEEPS = 8
#: Elements (float64) of one block of the Best-of-N readings' work arrays (weightings x rows x outcomes or
#: N): the readings go through their rows in blocks of this size, so memory does not grow with the
#: number of weightings times rows (at 1,000 weightings and 1,000 prompts a whole pass would need tens of GiB).
BLOCK_ELEMENTS = 1 << 22
#: Best-of-N location-scale reading (``PlugInEstimator._location_scale``): a query's residual draws at which its
#: own pooled residual distribution and the one pooled over every query weigh alike in its expected max of N;
#: also the pseudo-draws, at the typical spread, of each query's spread.
LS_PRIOR_DRAWS = 4.0
#: Best-of-N: a prompt's own shape (its standardized residuals pooled over its queries, against the pool over every
#: query) weighs n / (n + SHAPE_DRAWS N) at N for the prompt's n completions.
SHAPE_DRAWS = 8.0
#: Bins of the location-scale reading's pooled residual distributions once one has more distinct outcomes
#: (``pooled_values``'s ``bins``).
POOL_BINS = 256
#: Alternating sweeps of the prompt-spread x query-spread fit (``PlugInEstimator._location_scale``).
SCALE_SWEEPS = 8
#: Best-of-N: a prompt's correction at N, the mean over its s queries of their unbiased reading less the shrunk one, both
#: at min(N, the query's draws), weighs s / (s + CORRECTION_QUERIES) (``PlugInEstimator._bon_value``).
CORRECTION_QUERIES = 256.0


def check_nonnegative(**values: Any) -> tuple[float, ...]:
    """The values as floats, in order; one below 0 (or not a number) raises ValueError naming it."""
    out = []
    for key, value in values.items():
        if isinstance(value, bool) or not float(value) >= 0.0:
            raise ValueError(f"{key} must be a number >= 0, got {value!r}")
        out.append(float(value))
    return tuple(out)


def prior_votes(gold_votes: np.ndarray, votes: np.ndarray, share: np.ndarray, cap: float) -> float:
    """Pseudo-votes of the majority-vote prior: the empirical-Bayes concentration a of the rows, at most ``cap``.

    If each row's gold share is Beta(a s, a (1 - s)) around its prior share s, its g gold votes of n
    have E[(g - n s)^2] = n s (1 - s) (1 + (n - 1) / (a + 1)); the moment estimate of 1 / (a + 1),
    sum((g - n s)^2 - n s (1 - s)) / sum(n (n - 1) s (1 - s)) over the rows, clipped to
    [1 / (cap + 1), 1], gives a in [0, cap] (``cap`` when no row has two votes).
    """
    var = votes * share * (1.0 - share)
    den = float((var * (votes - 1.0)).sum())
    if not den > 0.0:
        return cap
    rho = float(((gold_votes - votes * share) ** 2 - var).sum()) / den
    return 1.0 / min(max(rho, 1.0 / (cap + 1.0)), 1.0) - 1.0


def mv_credit_rows(probs: np.ndarray, gold: np.ndarray, n_max: int) -> np.ndarray:
    """``mv_expected_credit`` of each row, computed with only the buckets of positive probability.

    A bucket of probability 0 never receives a vote, so dropping it leaves the credit unchanged
    (up to rounding: fewer quadrature nodes); the exact kernel's cost grows with the number of
    buckets, and the plug-in rows of a query often have only a few.
    """
    n_rows = probs.shape[0]
    p_gold = probs[np.arange(n_rows), gold]
    others = probs.copy()
    others[np.arange(n_rows), gold] = -1.0
    others = -np.sort(-others, axis=1)[:, :-1]  # the other buckets, largest first
    width = (others > 0).sum(axis=1)
    if _credit_jit.available():
        return _credit_jit.credit_rows(p_gold, others, width, n_max)
    out = np.empty((n_rows, n_max))
    for w in np.unique(width):
        rows = np.flatnonzero(width == w)
        reduced = np.column_stack([p_gold[rows], others[rows, :max(int(w), 1)]])
        out[rows] = mv_expected_credit(reduced, np.zeros(rows.size, np.int64), n_max)
    return out


def bon_values(scores: np.ndarray, counts: np.ndarray, n_max: int) -> np.ndarray:
    """(..., rows, n_max) expected max of N = 1..n_max draws from each row's outcomes, ``scores`` (..., rows,
    width) weighted by ``counts`` (same shape, or broadcastable to it); entries of count 0 are padding (at least
    one count per row)."""
    if _credit_jit.available():
        return _credit_jit.expected_max_rows(scores, counts, n_max)
    padded = np.where(counts > 0, scores, np.inf)
    padded = np.where(np.isinf(padded), padded.min(axis=-1, keepdims=True), padded)  # weight 0
    return bon_expected_max(padded, np.broadcast_to(counts, padded.shape).astype(np.float64), n_max)


def bon_values_and_subset_means(scores: np.ndarray, counts: np.ndarray, n_max: int) -> tuple[np.ndarray, np.ndarray]:
    """``bon_values`` and ``bon_subset_means`` of the same rows (``counts`` the draws), in one compiled pass
    (one sort per row) when the kernels run."""
    if _credit_jit.available():
        both = _credit_jit.expected_max_rows(scores, counts, n_max, subsets=True)
        return both[0], both[1]
    return bon_values(scores, counts, n_max), bon_subset_means(scores, counts, n_max)


def bon_subset_means(scores: np.ndarray, counts: np.ndarray, n_max: int) -> np.ndarray:
    """(..., rows, n_max) each row's mean max over the N-subsets of its n draws (``counts`` of ``scores``, as
    ``bon_values`` reads them), 0 for N > n: top - sum_j gap_j C(c_j, N) / C(n, N), c_j the draws at or below the
    j-th smallest outcome. ``agents.estimator.bon_subset_weights``' U-statistic, written for counted outcomes."""
    order = np.argsort(np.where(counts > 0, scores, np.inf), axis=-1, kind="stable")
    ordered = np.take_along_axis(scores, order, axis=-1)
    below = np.cumsum(np.take_along_axis(np.broadcast_to(counts, scores.shape), order, axis=-1), axis=-1)
    n = below[..., -1:].astype(np.float64)
    distinct = (counts > 0).sum(axis=-1, keepdims=True)
    top = np.take_along_axis(ordered, distinct - 1, axis=-1)[..., 0]
    gap = np.where(np.arange(scores.shape[-1] - 1) < distinct - 1, np.diff(ordered, axis=-1), 0.0)
    ratio = np.ones(gap.shape)  # C(c_j, N) / C(n, N), one factor per N
    out = np.zeros(scores.shape[:-1] + (n_max,))
    for m in range(n_max):
        left = n - m
        ratio *= np.maximum(below[..., :-1] - m, 0.0) / np.where(left > 0, left, 1.0)
        out[..., m] = np.where(left[..., 0] > 0, top - (gap * ratio).sum(axis=-1), 0.0)
    return out


def padded_rows(values: np.ndarray, counts: np.ndarray, row: np.ndarray, n_rows: int,
                width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``values`` (W, entries) and ``counts`` (entries,) of entries in rows ``row`` (sorted, every row has
    one) laid out as (W, n_rows, width) scores and (n_rows, width) counts, each row's entries first and
    count-0 padding after them, as ``bon_values`` reads them; ``width`` the largest row's entries or more."""
    sizes = np.bincount(row, minlength=n_rows)
    place = np.arange(row.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    weight = np.zeros((n_rows, max(int(sizes.max()), width)))
    weight[row, place] = counts
    scores = np.zeros((values.shape[0],) + weight.shape)
    scores[:, row, place] = values
    return scores, weight


def pooled_values(values: np.ndarray, counts: np.ndarray, row: np.ndarray, n_rows: int, n_max: int,
                  bins: int | None = None, whole_width: int | None = None,
                  entries: np.ndarray | None = None) -> np.ndarray:
    """(W, n_rows, n_max) expected max of N of each row's pooled outcomes: ``values`` (W, entries) scored
    outcomes, ``counts`` (entries,) their counts, ``row`` (entries,) their rows, sorted (every row has one).
    With ``entries``, the outcomes are the columns ``entries`` of ``values`` (W, E) and ``counts`` (E,) holds every
    column's count: the compiled binning reads them in place, without gathering a (W, entries) copy first.

    With ``bins``, once some row has more than ``bins`` entries, every row is first merged into ``bins``
    equal-width bins of its score range, each at the mean score of its outcomes: the sort and the N
    passes then cost ``bins`` per row instead of the entries, and each expected maximum moves by less
    than one bin width. ``whole_width``, the entries of the largest row of a whole set these rows are part of,
    makes that choice and the unbinned rows' padded width (which orders the numpy reading's sums; the compiled
    one skips padding) the whole set's, so that the rows read bit for bit as among all of them.
    """
    if entries is not None:
        counts = counts[entries]
    sizes = np.bincount(row, minlength=n_rows)
    if bins is not None and (int(sizes.max()) if whole_width is None else whole_width) > bins:
        if _credit_jit.available():
            return _credit_jit.binned_expected_max(values, counts, np.cumsum(sizes) - sizes, sizes, bins, n_max,
                                                   entries)
        mean, mass = binned_rows(values if entries is None else values[:, entries], counts, row, sizes, bins)
        return bon_values(mean, mass, n_max)
    width = 0 if whole_width is None or _credit_jit.available() else whole_width
    scores, weight = padded_rows(values if entries is None else values[:, entries], counts, row, n_rows, width)
    return bon_values(scores, weight, n_max)  # the same counts for every weighting


def binned_rows(values: np.ndarray, counts: np.ndarray, row: np.ndarray, sizes: np.ndarray,
                bins: int) -> tuple[np.ndarray, np.ndarray]:
    """(W, rows, bins) mean score and mass of each row's entries (``pooled_values``' arguments; ``sizes`` the
    entries per row) in ``bins`` equal-width bins of the row's score range; bins without entries hold 0.
    The numpy path's binning: the compiled ``_credit_jit.binned_expected_max`` bins each row with the same
    operations in the same order (the same bits) and reads it at once."""
    n_rows = sizes.size
    starts = np.cumsum(sizes) - sizes
    low = np.minimum.reduceat(values, starts, axis=1)  # (W, n_rows)
    width = np.maximum.reduceat(values, starts, axis=1) - low
    scaled = (values - low[:, row]) / np.where(width > 0, width, 1.0)[:, row]
    cell = np.minimum((scaled * bins).astype(np.int64), bins - 1)  # (W, entries)
    flat = ((np.arange(values.shape[0])[:, None] * n_rows + row[None, :]) * bins + cell).ravel()
    size = values.shape[0] * n_rows * bins
    weights = np.broadcast_to(counts.astype(np.float64), values.shape)
    mass = np.bincount(flat, weights=weights.ravel(), minlength=size)
    total = np.bincount(flat, weights=(values * weights).ravel(), minlength=size)
    mean = np.where(mass > 0, total / np.where(mass > 0, mass, 1.0), 0.0)
    shape = (values.shape[0], n_rows, bins)
    return mean.reshape(shape), mass.reshape(shape)


def score_range(atoms: np.ndarray, objectives: np.ndarray) -> np.ndarray:
    """(2, W) the lowest and highest score ``objectives`` (W, K) can give any outcome of ``atoms`` (..., K): per
    weighting, the corner of the objectives' box of ranges it scores lowest and highest (a min and a max pass over
    each objective's column of the atoms)."""
    k = range(atoms.shape[-1])  # one objective at a time: numpy reduces a strided column faster than an axis-0 (.., K)
    low = np.array([atoms[..., i].min() for i in k]) * objectives
    high = np.array([atoms[..., i].max() for i in k]) * objectives
    return np.stack([np.minimum(low, high).sum(axis=1), np.maximum(low, high).sum(axis=1)])


def _row_sums(values: np.ndarray, index: np.ndarray, size: int) -> np.ndarray:
    """(W, size) sums of each row of ``values`` (W, entries) by ``index`` (entries,): one ``np.bincount`` over
    all rows at once (each sum adds its entries in the same order as a bincount per row), not a Python
    loop over the weightings."""
    flat = (np.arange(values.shape[0])[:, None] * size + index[None, :]).ravel()
    return np.bincount(flat, weights=values.ravel(), minlength=values.shape[0] * size).reshape(values.shape[0], size)


def segment_readings(scores: np.ndarray, counts: np.ndarray, n_max: int, weight: np.ndarray,
                     bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W, S, n_max) twice: per segment ``bounds[s]:bounds[s + 1]`` of the rows of ``scores`` (W, R, M) with the
    integer draws ``counts`` (R, M), the sum of ``weight`` (R, n_max) x their E[max of N] V(N), and the sum of their
    held gaps U(m) - weight(m) V(m) at m = min(N, the row's draws), U the mean max over N-subsets
    (``bon_values_and_subset_means``), summed as ``np.add.reduceat`` sums; the compiled kernel in one pass, without
    (W, R, n_max) arrays."""
    if _credit_jit.available():
        both = _credit_jit.segment_readings(scores, counts, n_max, weight, bounds)
        return both[0], both[1]
    plug_in, unbiased = bon_values_and_subset_means(scores, np.broadcast_to(counts, scores.shape), n_max)
    at = np.broadcast_to(held_index(counts.sum(axis=-1), n_max), plug_in.shape)
    held = (np.take_along_axis(unbiased, at, axis=-1)
            - np.take_along_axis(weight, at[0], axis=-1)[None] * np.take_along_axis(plug_in, at, axis=-1))
    plug_in *= weight[None]
    return np.add.reduceat(plug_in, bounds[:-1], axis=1), np.add.reduceat(held, bounds[:-1], axis=1)


def held_index(draws: np.ndarray, n_max: int) -> np.ndarray:
    """(..., n_max) the index of m = min(N, n) for N = 1..n_max and each count ``draws`` n (..., at least 1): where a
    (prompt, query)'s readings are taken beyond its draws."""
    return np.minimum(np.arange(n_max), np.asarray(draws, dtype=np.int64)[..., None] - 1)


def location_scale_readings(expected: np.ndarray, spread: np.ndarray, shape: np.ndarray, scale: np.ndarray,
                            level: np.ndarray, offsets: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """(W, p, q, N) the pooled reading R = clip(level_p + o_q + scale_p (M_q(N) + s_q D_p(N)), low, high) of p prompts
    on q queries: ``expected`` M (W, q, N), ``spread`` s (W, q), ``shape`` D (W, p, N), ``scale``, ``level`` (W, p),
    ``offsets`` (W, q), ``low`` and ``high`` (W,) (``PlugInEstimator._bon_value``; numpy, the kernel path sums it
    in place)."""
    reading = expected[:, None] + spread[:, None, :, None] * shape[:, :, None, :]
    reading *= scale[:, :, None, None]
    reading += level[:, :, None, None] + offsets[:, None, :, None]
    np.clip(reading, low[:, None, None, None], high[:, None, None, None], out=reading)
    return reading


def residual_sums(projected: np.ndarray, level: np.ndarray, offsets: np.ndarray, prompt: np.ndarray,
                  query: np.ndarray, counts: np.ndarray, n_prompts: int,
                  n_queries: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(W, E) residuals ``projected`` (E, W) - level[w, prompt] - offsets[w, query] of E entries, and their sums of
    ``counts`` x r^2 by prompt (W, P) and by query (W, Q); the compiled kernel in one pass, the same bits."""
    if _credit_jit.available():
        return _credit_jit.residual_sums(projected, level, offsets, prompt, query, counts, n_prompts, n_queries)
    resid = projected.T - level[:, prompt] - offsets[:, query]
    square = counts * resid ** 2
    return resid, _row_sums(square, prompt, n_prompts), _row_sums(square, query, n_queries)


def standardize(resid: np.ndarray, scale: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """(W, E) each residual over its prompt's scale, scale[w, prompt] (0 where that scale is 0); the compiled kernel
    overwrites ``resid`` in one pass, the same bits."""
    if _credit_jit.available():
        return _credit_jit.standardize(resid, scale, prompt)
    by_entry = scale[:, prompt]
    return np.where(by_entry > 0, resid / np.where(by_entry > 0, by_entry, 1.0), 0.0)


def over_spread(std: np.ndarray, spread: np.ndarray, query: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """(W, len(entries)) the columns ``entries`` of ``std`` over their queries' spread[w, query]; the compiled kernel
    in one pass, C-contiguous, the same bits."""
    if _credit_jit.available():
        return _credit_jit.over_spread(std, spread, query, entries)
    return std[:, entries] / spread[:, query[entries]]


def _blocks(cost: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) ranges of rows, a new one starting each time the summed ``cost`` (elements per
    row) before a row passes a multiple of ``BLOCK_ELEMENTS``: each range costs under twice that (or is
    one row costlier than that)."""
    before = np.cumsum(cost) - cost
    starts = np.flatnonzero(np.diff(before // BLOCK_ELEMENTS, prepend=-1) > 0)
    return list(zip(starts.tolist(), np.r_[starts[1:], cost.size].tolist(), strict=True))


class PlugInEstimator:
    """Q(c, p, N) of every context, prompt and N, recomputed for the pulled prompts at each ``update``.

    The estimates live in an ``Estimator`` (``self.table``: its sums hold them, its counts mark the
    prompts read), so ``mean`` and ``best_arms`` are the shared estimator's.
    """

    def __init__(self, env: Any, alpha: float = 32.0, curve: float = 3.0, slope: float = 1.0,
                 pretest: float = 2.0, bon_prior: float = 1.0, empirical_bayes: bool = True) -> None:
        """Bind to ``env``; the prior's strength (see the module docstring): ``alpha`` the majority-vote
        prior's pseudo-votes (at most, with ``empirical_bayes``; else exactly), ``curve`` and ``slope`` the
        response curves' ridges, ``pretest`` the sparse-slope test, ``bon_prior`` the pooled Best-of-N
        reading's weight in completions per N."""
        self.alpha, self.curve, self.slope, self.pretest, self.bon_prior = check_nonnegative(
            alpha=alpha, curve=curve, slope=slope, pretest=pretest, bon_prior=bon_prior)
        self.empirical_bayes = bool(empirical_bayes)
        self.table = Estimator(env)
        self.env = self.table.env
        table = self.env.table
        self.aggregator = table.aggregator
        self.n_contexts, self.n_prompts, self.n_max = self.table.sums.shape
        self.shape = self.table.sums.shape
        self._weights = table.context_weights  # (C, K + 1), the last the cost's
        self._cost = table.cost_matrix()  # (P, Q)
        self._cost_sum = np.zeros(self.n_prompts)  # sum over the prompt's seen queries of cost[p, q]
        self.atom_counts = np.zeros((self.n_prompts, table.n_queries, table.n_atoms), dtype=np.int64)
        self._seen = np.zeros((self.n_prompts, table.n_queries), dtype=bool)
        if self.aggregator == "mv":
            self._credit = np.zeros((self.n_prompts, table.n_queries, self.n_max))  # per (p, q), cached
            self._votes = np.zeros((self.n_prompts, table.n_queries), dtype=np.int64)
            self._gold_votes = np.zeros((self.n_prompts, table.n_queries), dtype=np.int64)
            self._pooled = np.zeros((table.n_queries, table.n_atoms), dtype=np.int64)  # votes over prompts
            self._curves = np.column_stack([np.zeros(self.n_prompts), np.ones(self.n_prompts)])  # (a_p, b_p)
            self._offsets = np.zeros(self.n_prompts)  # a_p last fitted with b_p held at the median slope
        else:
            self._objectives, row = np.unique(self._weights[:, :-1], axis=0, return_inverse=True)
            self._objective_row = row.reshape(-1)
            assert table.atoms is not None
            self._reward_sum = np.zeros((self.n_prompts, table.n_queries, table.atoms.shape[-1]))
            self._completions = np.zeros((self.n_prompts, table.n_queries))
            n_rows = self._objectives.shape[0]
            self._own = np.zeros((n_rows, self.n_prompts, self.n_max))  # sum_q w_pqN V_own(p, q, N)
            self._own_held = np.zeros((n_rows, self.n_prompts, self.n_max))  # sum_q U(p, q, m) - w_pqm V_own(p, q, m)
            self._score_range = score_range(table.atoms, self._objectives)  # (2, W): no outcome scores beyond

    # ---- reading ----------------------------------------------------------------------
    def mean(self, unseen: float = np.nan) -> np.ndarray:
        """Estimated Q (C, P, N_max); prompts never pulled get ``unseen``."""
        return self.table.mean(unseen)

    def best_arms(self, rng: np.random.Generator, mask: np.ndarray | None = None) -> Policy:
        """Per context, the arm of highest estimate among ``mask`` (``Estimator.best_arms``)."""
        return self.table.best_arms(rng, mask)

    def seen(self, prompts: np.ndarray) -> np.ndarray:
        """(len(prompts), Q) whether each prompt has been pulled on each query."""
        return self._seen[prompts]

    # ---- updates ----------------------------------------------------------------------
    def update(self, pulls: Pulls) -> None:
        """Add the pulls' completions and recompute every pulled prompt's estimates at every N and context."""
        if len(pulls) == 0:
            return
        rep = np.repeat(np.arange(len(pulls)), pulls.ns)
        prompts_c, queries_c = pulls.prompts[rep], pulls.queries[rep]  # per completion
        if self.aggregator == "bon":
            cell = prompts_c * self._completions.shape[1] + queries_c
            pp, qq = np.divmod(np.unique(cell), self._completions.shape[1])
            self._add_own(pp, qq, sign=-1.0)  # take back the pairs' readings of their old counts
        np.add.at(self.atom_counts, (prompts_c, queries_c, pulls.atoms), 1)
        if self.aggregator == "mv":
            gold = self.env.table.gold
            assert gold is not None
            np.add.at(self._votes, (pulls.prompts, pulls.queries), pulls.ns)
            np.add.at(self._gold_votes, (prompts_c, queries_c), pulls.atoms == gold[queries_c])
            np.add.at(self._pooled, (queries_c, pulls.atoms), 1)
        else:
            atoms = self.env.table.atoms
            assert atoms is not None
            vectors = atoms[prompts_c, queries_c, pulls.atoms]  # (completions, K)
            flat = self._reward_sum.reshape(-1, vectors.shape[1])
            for k in range(vectors.shape[1]):
                flat[:, k] += np.bincount(cell, weights=vectors[:, k], minlength=flat.shape[0])
            self._completions += np.bincount(cell, minlength=flat.shape[0]).reshape(self._completions.shape)
            self._add_own(pp, qq, sign=1.0)
        fresh = ~self._seen[pulls.prompts, pulls.queries]
        new = np.unique(np.column_stack([pulls.prompts[fresh], pulls.queries[fresh]]), axis=0)
        self._seen[new[:, 0], new[:, 1]] = True
        self._cost_sum += np.bincount(new[:, 0], weights=self._cost[new[:, 0], new[:, 1]], minlength=self.n_prompts)
        prompts = np.unique(pulls.prompts)
        if self.aggregator == "mv":
            credit = self._mv_credit_curve(prompts) if self.curve > 0 else self._mv_credit_pooled(pulls, prompts)
            task = self._weights[:, :1, None] * credit[None]
        else:
            task = self._bon_value(prompts)
        self.table.sums[:, prompts, :] = task + self._cost_term(prompts)
        self.table.counts[:, prompts, :] = 1.0

    def _cost_term(self, prompts: np.ndarray) -> np.ndarray:
        """(C, len(prompts), N_max) each context's cost weight x N x the prompt's mean cost over its seen queries."""
        n_queries = self._seen[prompts].sum(axis=1).astype(np.float64)
        scale = np.arange(1, self.n_max + 1, dtype=np.float64)
        cost: np.ndarray = self._weights[:, -1:, None] * (self._cost_sum[prompts] / n_queries)[None, :, None] * scale
        return cost

    # ---- majority vote ----------------------------------------------------------------
    def _mv_credit_pooled(self, pulls: Pulls, prompts: np.ndarray) -> np.ndarray:
        """(len(prompts), N_max) mean credit over each prompt's queries with the query's pooled answers as
        prior (``curve`` = 0), refreshing every seen row of ``prompts`` with ``empirical_bayes`` (the prior's
        weight moves with every pull), else the pulled queries' rows."""
        queries = np.unique(pulls.queries) if not self.empirical_bayes else np.flatnonzero(self._seen[prompts].any(axis=0))
        p_pos, q_pos = np.nonzero(self._seen[prompts][:, queries])
        pooled = self._pooled[queries].astype(np.float64)
        self._mv_rows(prompts[p_pos], queries[q_pos], (pooled / pooled.sum(axis=1, keepdims=True))[q_pos])
        return self._credit[prompts].sum(axis=1) / self._seen[prompts].sum(axis=1)[:, None]

    def _mv_rows(self, rows_p: np.ndarray, q_idx: np.ndarray, prior: np.ndarray) -> None:
        """Refresh the credit of the (prompt, query) rows ``rows_p``, ``q_idx`` from their votes plus
        min(``alpha``, a_EB) pseudo-votes of ``prior`` (rows, buckets), a_EB from these rows (``prior_votes``;
        ``alpha`` itself without ``empirical_bayes``)."""
        gold = self.env.table.gold
        assert gold is not None
        counts = self.atom_counts[rows_p, q_idx].astype(np.float64)
        votes = counts.sum(axis=1)
        share = prior[np.arange(q_idx.size), gold[q_idx]]
        alpha = self.alpha
        if self.empirical_bayes:
            alpha = prior_votes(self._gold_votes[rows_p, q_idx].astype(np.float64), votes, share, self.alpha)
        probs = (counts + alpha * prior) / (votes[:, None] + alpha)
        self._credit[rows_p, q_idx] = mv_credit_rows(probs, gold[q_idx], self.n_max)

    def _mv_credit_curve(self, prompts: np.ndarray) -> np.ndarray:
        """(len(prompts), N_max) mean credit over each prompt's queries, every row of ``prompts`` refreshed.

        The prior of (p, q) gives gold the share sigmoid(a_p + b_p z_q), z_q the logit of q's gold
        rate pooled over every prompt (the query's difficulty) and (a_p, b_p) the prompt's
        response curve: a binomial logistic fit to its own gold votes, ridge-penalised by
        ``curve`` (offset) and ``slope`` towards (0, 1), the pooled curve; with ``pretest``, only
        the slopes far from the others' stay the prompts' own (``_pretest_slopes``). The other
        buckets share the rest as q's pooled wrong answers do (one wrong bucket takes all of it
        while q has no wrong answer). The curves move with every pull, so every row is recomputed.
        """
        gold = self.env.table.gold
        assert gold is not None
        seen = self._seen[prompts]
        p_idx, q_idx = np.nonzero(seen)
        cols = np.flatnonzero(seen.any(axis=0))  # the queries any of ``prompts`` has seen
        g_all, n_all = self._gold_votes[:, cols].sum(axis=0), self._votes[:, cols].sum(axis=0)
        z = np.zeros(self._votes.shape[1])
        z[cols] = np.log((g_all + 0.5) / (n_all - g_all + 0.5))
        theta, variance = self._fit_curves(prompts, cols, z[cols], (self.curve, self.slope), self._curves[prompts])
        self._curves[prompts] = theta
        if self.pretest > 0:
            theta = self._pretest_slopes(prompts, cols, z[cols], theta, variance)
        share = 1.0 / (1.0 + np.exp(-np.clip(theta[p_idx, 0] + theta[p_idx, 1] * z[q_idx], -30.0, 30.0)))
        rows = np.arange(q_idx.size)
        wrong = self._pooled[q_idx].astype(np.float64)
        wrong[rows, gold[q_idx]] = 0.0
        unseen = wrong.sum(axis=1) == 0  # no wrong answer yet: one wrong bucket takes the rest
        wrong[rows[unseen], (gold[q_idx[unseen]] + 1) % wrong.shape[1]] = 1.0
        prior = wrong / wrong.sum(axis=1, keepdims=True) * (1.0 - share)[:, None]
        prior[rows, gold[q_idx]] = share
        self._mv_rows(prompts[p_idx], q_idx, prior)
        # unseen rows hold 0: sum only the columns any of them has seen
        return self._credit[prompts[:, None], cols[None, :]].sum(axis=1) / seen.sum(axis=1)[:, None]

    def _fit_curves(self, prompts: np.ndarray, cols: np.ndarray, z: np.ndarray, ridge: tuple[float, float],
                    start: np.ndarray, slope: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """(len(prompts), 2) response curves (a_p, b_p) and their posterior variances: the maximum of
        the binomial log-likelihood of each prompt's gold votes on the queries ``cols`` of difficulty
        ``z``, ridge-penalised by ``ridge`` = (on a_p towards 0, on b_p towards ``slope``).

        Newton steps from ``start`` (the prompt's last fit; at first (0, 1)), each halved until the
        penalised likelihood does not fall (to rounding); a prompt's fit ends once its step is below
        1e-9. The objective is strictly concave, so this converges whatever the votes (full steps
        alone can overshoot without end on a prompt far from the pool). The variances are the
        inverse Hessian's diagonal at each prompt's last step's start. With numba, the compiled
        ``_credit_jit.fit_curves`` takes the same steps (the fits agree to rounding).
        """
        g = self._gold_votes[prompts][:, cols].astype(np.float64)
        n = self._votes[prompts][:, cols].astype(np.float64)
        if _credit_jit.available():
            return _credit_jit.fit_curves(g, n, z, ridge, start, slope, CURVE_ITERATIONS, CURVE_HALVINGS)
        lam_a, lam_b = ridge

        def objective(theta: np.ndarray, rows: np.ndarray) -> np.ndarray:
            x = theta[:, :1] + theta[:, 1:] * z[None, :]
            loglik = -(n[rows] * np.logaddexp(0.0, -x) + (n[rows] - g[rows]) * x).sum(axis=1)
            return loglik - 0.5 * (lam_a * theta[:, 0] ** 2 + lam_b * (theta[:, 1] - slope) ** 2)

        def newton(theta: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            mu = 1.0 / (1.0 + np.exp(-np.clip(theta[:, :1] + theta[:, 1:] * z[None, :], -30.0, 30.0)))
            r, w = g[rows] - n[rows] * mu, n[rows] * mu * (1.0 - mu)
            grad_a = r.sum(axis=1) - lam_a * theta[:, 0]
            grad_b = (r * z).sum(axis=1) - lam_b * (theta[:, 1] - slope)
            h00, h01, h11 = w.sum(axis=1) + lam_a, (w * z).sum(axis=1), (w * z * z).sum(axis=1) + lam_b
            det = h00 * h11 - h01 * h01
            step = np.column_stack([h11 * grad_a - h01 * grad_b, h00 * grad_b - h01 * grad_a]) / det[:, None]
            return step, np.column_stack([h11 / det, h00 / det])

        theta = start.copy()
        value = objective(theta, np.arange(prompts.size))
        variance = np.zeros_like(theta)
        active = np.arange(prompts.size)  # the prompts whose fit has not converged
        for _ in range(CURVE_ITERATIONS):
            step, variance[active] = newton(theta[active], active)
            size = np.ones(active.size)
            pending = np.arange(active.size)  # steps not yet accepted, each halved until it ascends
            for _ in range(CURVE_HALVINGS):
                rows = active[pending]
                trial = objective(theta[rows] + size[pending, None] * step[pending], rows)
                ascends = trial >= value[rows] - 1e-12 * np.abs(value[rows])  # to rounding
                value[rows[ascends]] = trial[ascends]
                pending = pending[~ascends]
                if not pending.size:
                    break
                size[pending] *= 0.5
            size[pending] = 0.0  # no ascent left along the step: at the maximum to rounding
            moved = size[:, None] * step
            theta[active] += moved
            active = active[np.abs(moved).max(axis=1) >= 1e-9]
            if not active.size:
                break
        return theta, variance

    def _pretest_slopes(self, prompts: np.ndarray, cols: np.ndarray, z: np.ndarray, theta: np.ndarray,
                        variance: np.ndarray) -> np.ndarray:
        """``theta`` with the curve of every prompt whose slope is within ``pretest`` posterior SDs of the
        median slope of ``prompts`` replaced by its fit with the slope held at that median: a sparse
        prior on the slopes, so the prompts far from the others keep theirs while small, noisy
        departures do not move the ranking (the median, not 1: z_q is the logit of the pooled gold
        rate, so a typical prompt's slope on it is not 1; on MATH about 1.25)."""
        centre = float(np.median(theta[:, 1]))
        free = np.abs(theta[:, 1] - centre) >= self.pretest * np.sqrt(variance[:, 1])
        if free.all():
            return theta
        held = prompts[~free]
        start = np.column_stack([self._offsets[held], np.full(held.size, centre)])
        fixed, _ = self._fit_curves(held, cols, z, (self.curve, RIDGE_MAX), start, centre)
        self._offsets[held] = fixed[:, 0]
        out = theta.copy()
        out[~free] = fixed
        return out

    # ---- Best-of-N --------------------------------------------------------------------
    def _own_weight_of(self, completions: np.ndarray) -> np.ndarray:
        """(..., N_max) the weight n / (n + bon_prior N) of a query's own reading at each N, for n completions."""
        n = completions[..., None]
        scale = np.arange(1, self.n_max + 1, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            return np.where(n > 0, n / (n + self.bon_prior * scale), 0.0)

    def _has_draws(self, completions: np.ndarray) -> np.ndarray:
        """(..., N_max) whether n completions of a (prompt, query) reach N (its unbiased reading exists)."""
        return completions[..., None] >= np.arange(1, self.n_max + 1)

    def _add_own(self, pp: np.ndarray, qq: np.ndarray, sign: float) -> None:
        """Add ``sign`` x the own readings of the (prompt, query) pairs ``pp``, ``qq`` (sorted by prompt) at the
        counts they have now to the per-prompt sums: w V_own (the plug-in) and the held gap U(m) - w(m) V_own(m),
        m = min(N, n) (U the unbiased mean max over m-subsets of the n draws). ``update`` takes back each pulled
        pair's readings (sign -1) before adding its completions and adds the new ones (sign +1) after: they are
        recomputed rather than stored, as a store would hold (pairs, weightings, N_max), too much at a thousand
        weightings."""
        completions = self._completions[pp, qq]
        had = completions > 0
        pp, qq, completions = pp[had], qq[had], completions[had]
        if pp.size == 0:
            return
        weight = self._own_weight_of(completions)
        counts = self.atom_counts[pp, qq]  # (pairs, atoms)
        width = max(int((counts > 0).sum(axis=1).max()), self.n_max)
        n_weightings = self._objectives.shape[0]
        for lo, hi in _blocks(np.full(pp.size, n_weightings * width)):
            first = lo + np.flatnonzero(np.r_[True, pp[lo + 1:hi] != pp[lo:hi - 1]])
            plug_in_sum, held_sum = self._own_readings(pp[lo:hi], qq[lo:hi], counts[lo:hi], self._objectives,
                                                       weight[lo:hi], np.r_[first - lo, hi - lo])
            self._own[:, pp[first]] += sign * plug_in_sum
            self._own_held[:, pp[first]] += sign * held_sum

    def _own_readings(self, pp: np.ndarray, qq: np.ndarray, counts: np.ndarray, objectives: np.ndarray,
                      weight: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``segment_readings`` of the (prompt, query) pairs ``pp``, ``qq`` with atom ``counts`` (pairs, atoms),
        scored by ``objectives`` (W, K): per segment ``bounds[s]:bounds[s + 1]`` of the pairs, the sum of ``weight``
        (pairs, N_max) x their plug-in E[max of N] V and the sum of their held gaps U(m) - weight(m) V(m), m = min(N,
        the pair's draws), U the unbiased mean max over m-subsets."""
        atoms = self.env.table.atoms
        assert atoms is not None
        row, a = np.nonzero(counts)
        projected = (atoms[pp[row], qq[row], a] @ objectives.T).T  # (W, entries)
        scores, mass = padded_rows(projected, counts[row, a], row, pp.size)
        return segment_readings(scores, mass, self.n_max, weight, bounds)

    def _bon_value(self, prompts: np.ndarray) -> np.ndarray:
        """(C, len(prompts), N_max) the prompts' Best-of-N task value: per query, the shrunk own reading.

        A location-scale reading: score(p, q) = level_p + o_q + scale_p e, e drawn from query q's residual
        distribution, shared by the prompts (``_location_scale``), so the pooled reading of (p, q, N) is
        R = level_p + o_q + scale_p (M_q(N) + s_q D_p(N)), held within the outcomes' score range: M_q(N) the
        expected max of N of q's residuals pooled over every prompt seen on q (scaled by scale_p), s_q q's
        spread, D_p(N) = G_p(N) - G(N) the prompt's own shape against the pool over every query, times
        n / (n + ``SHAPE_DRAWS`` N) for its n. D_p does not depend on which prompts are read with p, so a prompt
        read alone (the tail's last survivor) keeps its own shape; and where a query's pool mixes the prompts as
        the pool over every query does, the excess of the mixture's maximum over its components' cancels between
        M_q and G. With the shrunk reading S(q, N) = R + w_pqN (V_own(p, q, N) - R), w_pqN = n / (n + ``bon_prior``
        N), the value is the mean over the prompt's s seen queries of S(q, N) + lam (U(q, m) - S(q, m)), m = min(N,
        n_pq), U the unbiased mean max over m-subsets (the sample maximum at m = n_pq) and lam = s / (s +
        ``CORRECTION_QUERIES``), less their mean offset. Up to a query's draws the correction takes lam of the shrunk
        reading's bias out; beyond them it keeps the bias measured where they end, so the estimate does not bend at
        n_pq (without it, the plug-in's low bias past n reads the large N too low). As a query's draws grow, w -> 1
        and m -> N, so the value tends to the mean over the queries of their own readings less the mean offset,
        which is 0 once every prompt has seen every train query (as the common-query agents' prompts do at large
        budgets). The fit-free parts (w V_own, and U(m) - w(m) V_own(m)) are per-prompt sums kept by ``_add_own``;
        the readings enter as one weighted sum of R per prompt and N, with weight (1 - w) - lam (1 - w) up to n_pq
        and, beyond it, 1 - w at N and - lam (1 - w(n_pq)) on R at n_pq. A prompt that saw other queries than the
        reference (``_move_to_reference``) then moves onto the reference's queries.
        """
        level, offsets = self._additive_fit()
        scale, expected, spread, shape = self._location_scale(level, offsets, prompts)  # (W, P), (W, Q, N), (W, Q), (W, P, N)
        n_weightings, scale_n = offsets.shape[0], np.arange(1, self.n_max + 1, dtype=np.float64)
        drawn = self._completions[prompts].sum(axis=1)
        sh = shape[:, prompts] * (drawn[:, None] / (drawn[:, None] + SHAPE_DRAWS * scale_n))[None]
        out = np.empty((n_weightings, prompts.size, self.n_max))
        seen_all = self._seen[prompts]
        cols = np.flatnonzero(seen_all.any(axis=0))  # w is 0 on the other queries
        expected_cols = expected[:, cols]
        low, high = self._score_range  # (W,) each
        offsets_cols, spread_cols = offsets[:, cols], spread[:, cols]
        for lo, hi in _blocks(np.full(prompts.size, max(n_weightings, 1) * cols.size * self.n_max)):
            block = prompts[lo:hi]
            seen = seen_all[lo:hi, cols]
            n_q = seen.sum(axis=1)[:, None].astype(np.float64)
            lam = n_q / (n_q + CORRECTION_QUERIES)  # (p, 1) the correction's weight
            completions = self._completions[block][:, cols]
            cap = np.maximum(completions, 1.0).astype(np.int64)  # (p, q) the draws; R(m) = R(N) up to them
            own_weight = self._own_weight_of(completions)
            reached = self._has_draws(completions)  # (p, q, N): N <= n
            weight = (seen[:, :, None] - own_weight - lam[:, :, None] * reached * (1.0 - own_weight)) / n_q[:, :, None]
            at_draws_weight = np.take_along_axis(own_weight, np.minimum(cap, self.n_max)[..., None] - 1, axis=-1)[..., 0]
            held = np.where(seen & (cap < self.n_max), -lam * (1.0 - at_draws_weight) / n_q, 0.0)  # times R(n), N > n
            if _credit_jit.available():
                shrunk = _credit_jit.clipped_readings(level[:, block], offsets_cols, scale[:, block], expected_cols,
                                                      spread_cols, sh[:, lo:hi], weight, held, cap, seen, low, high)
            else:
                reading = location_scale_readings(expected_cols, spread_cols, sh[:, lo:hi], scale[:, block],
                                                  level[:, block], offsets_cols, low, high)
                at_draws = np.take_along_axis(reading, np.broadcast_to(held_index(cap, self.n_max), reading.shape), -1)
                shrunk = (np.einsum("pqn,wpqn->wpn", weight, reading, optimize=True)
                          + np.einsum("pq,wpqn->wpn", held, at_draws * ~reached, optimize=True))
            own = (self._own[:, block] + lam[None] * self._own_held[:, block]) / n_q
            out[:, lo:hi] = shrunk + own - (seen @ offsets_cols.T).T[:, :, None] / n_q
        self._move_to_reference(out, prompts, seen_all, drawn, (level, offsets, scale, expected, spread, sh))
        result: np.ndarray = out[self._objective_row]
        return result

    def _move_to_reference(self, out: np.ndarray, prompts: np.ndarray, seen: np.ndarray, drawn: np.ndarray,
                           fit: tuple[np.ndarray, ...]) -> None:
        """Move, in place, each value in ``out`` (W, len(prompts), N_max) from its prompt's queries to the reference's:
        add the reference's value on every query it saw less its value on the queries the prompt saw too. A prompt
        that saw exactly the reference's queries is left as it is (every prompt, while all read prompts saw the same
        queries).

        The reference is the read prompt that saw the most queries (then the most completions, then the lowest
        index). A prompt read on fewer queries (one a context trimmed and the tail re-admitted) is then compared
        with the others on the queries they share: how much harder its queries are at each N, beyond what the
        query offsets of the mean scores say, is read from the reference's own draws on them, not counted against
        the prompt. The reference's value on a query subset is ``_bon_value``'s formula on that subset (its own
        readings recomputed query by query), one set of sums per distinct subset, in blocks of objective rows.
        ``seen`` (len(prompts), Q) and ``drawn`` (len(prompts),) are the prompts' seen queries and completions;
        ``fit`` is ``_bon_value``'s (level, offsets, scale, expected, spread, shape) of the read prompts.
        """
        ref = int(np.lexsort((np.arange(prompts.size), -drawn, -seen.sum(axis=1)))[0])
        differs = np.flatnonzero((seen != seen[ref]).any(axis=1))
        if not differs.size:
            return
        level, offsets, scale, expected, spread, sh = fit
        ref_prompt = int(prompts[ref])
        cols = np.flatnonzero(seen[ref])
        subsets, which = np.unique(seen[differs][:, cols], axis=0, return_inverse=True)
        which = which.reshape(-1)  # the subset of each moved prompt, flat
        subsets = np.vstack([np.ones(cols.size, dtype=bool), subsets]).astype(np.float64)  # (1 + distinct, q)
        completions = self._completions[ref_prompt, cols]
        own_weight = self._own_weight_of(completions)  # (q, N)
        at = held_index(np.maximum(completions, 1.0), self.n_max)  # (q, N) the index of m = min(N, n)
        n_q = subsets.sum(axis=1)[:, None]
        lam = n_q / (n_q + CORRECTION_QUERIES)
        beyond = 1.0 - np.take_along_axis(own_weight, at, axis=-1)  # (q, N) 1 - w(m)
        counts = self.atom_counts[ref_prompt, cols]  # (q, atoms)
        pp = np.full(cols.size, ref_prompt)
        low, high = self._score_range
        for lo, hi in _blocks(np.full(offsets.shape[0], cols.size * max(self.n_max, counts.shape[1]))):
            ws, one = slice(lo, hi), slice(ref, ref + 1)
            reading = location_scale_readings(expected[ws, cols], spread[ws, cols], sh[ws, one],
                                              scale[ws, ref_prompt, None], level[ws, ref_prompt, None],
                                              offsets[ws, cols], low[ws], high[ws])[:, 0]  # (w, q, N)
            plug_in, held = self._own_readings(pp, cols, counts, self._objectives[ws], own_weight,
                                               np.arange(cols.size + 1))
            at_draws = np.take_along_axis(reading, np.broadcast_to(at, reading.shape), axis=-1)
            shrunk = subsets @ ((1.0 - own_weight) * reading) - lam * (subsets @ (beyond * at_draws))
            value = (shrunk + subsets @ plug_in + lam * (subsets @ held)
                     - (offsets[ws, cols] @ subsets.T)[:, :, None]) / n_q  # (w, subsets, N)
            out[lo:hi, differs] += (value[:, :1] - value[:, 1:])[:, which]

    def _location_scale(self, level: np.ndarray, offsets: np.ndarray, prompts: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per objective row: (W, P) prompt scales, (W, Q, N_max) queries' expected max of N of the scaled
        residuals, (W, Q) query spreads and (W, P, N_max) prompts' own shapes; 0 where unseen.

        The residuals r = score - level_p - o_q of every completion have variance scale_p^2 s_q^2: the
        normal maximum-likelihood fit of the two factors from the summed squares (``SCALE_SWEEPS``
        alternating sweeps), s_q^2 with ``LS_PRIOR_DRAWS`` pseudo-draws at 1. Query q's residual
        distribution is r / scale_p pooled over every prompt seen on it; its expected max of N, M_q(N), is
        shrunk towards s_q G(N), G that of u = r / (scale_p s_q) pooled over every query, with weight
        d / (d + ``LS_PRIOR_DRAWS``), d the query's draws less one (a query drawn once shows no spread and
        stays out of G). A prompt's own shape is G_p(N) - G(N), G_p that of its own u pooled over its queries.
        M_q is computed only for the queries ``prompts`` have seen and the shapes only for ``prompts`` (the
        rest stay 0; each row reads as among all of them). Computed in blocks of objective rows
        (``BLOCK_ELEMENTS``)."""
        atoms = self.env.table.atoms
        assert atoms is not None
        n_rows = self._objectives.shape[0]
        n_pairs = self._completions  # (P, Q)
        n_prompts, n_queries = n_pairs.shape
        qq, pp = np.nonzero(n_pairs.T > 0)  # seen pairs, sorted by query
        counts = self.atom_counts[pp, qq]  # (pairs, atoms)
        pair, a = np.nonzero(counts)
        c = counts[pair, a].astype(np.float64)
        p, q = pp[pair], qq[pair]
        queries, row = np.unique(q, return_inverse=True)
        draws = n_pairs[:, queries].sum(axis=0)
        spread_ok = draws[row] > 1  # a query drawn once shows no spread
        read = np.zeros(n_prompts, dtype=bool)
        read[prompts] = True
        mine = spread_ok & read[p]  # the read prompts' entries of their shapes
        order = np.argsort(p[mine], kind="stable")
        users, prow = np.unique(p[mine][order], return_inverse=True)
        shape_width = int(np.bincount(p[spread_ok]).max()) if spread_ok.any() else 0  # the largest prompt pool
        needed = self._seen[prompts].any(axis=0)[queries]  # the queries the read prompts have seen
        wanted = needed[row]
        wanted_queries, wanted_row = np.unique(row[wanted], return_inverse=True)
        query_width = int(np.bincount(row).max())  # the largest query pool
        lam = ((draws - 1.0) / (draws - 1.0 + LS_PRIOR_DRAWS))[None, wanted_queries, None]
        scale = np.zeros((n_rows, n_prompts))
        spread = np.zeros((n_rows, n_queries))
        expected = np.zeros((n_rows, n_queries, self.n_max))
        shape = np.zeros((n_rows, n_prompts, self.n_max))
        outcomes = atoms[p, q, a]  # (entries, objectives), gathered once for every block
        wanted_entries, spread_entries = np.flatnonzero(wanted), np.flatnonzero(spread_ok)
        mine_in_unit = np.flatnonzero(mine[spread_ok])[order]  # the shapes' entries among the spread ones, by prompt
        for lo, hi in _blocks(np.full(n_rows, max(c.size, 1))):
            ws = slice(lo, hi)
            resid, ss_p, ss_q = residual_sums(outcomes @ self._objectives[ws].T, level[ws], offsets[ws], p, q, c,
                                              n_prompts, n_queries)  # (W, entries), (W, P), (W, Q)
            var_q = np.ones((hi - lo, n_queries))
            with np.errstate(invalid="ignore", divide="ignore"):
                for _ in range(SCALE_SWEEPS):
                    den = var_q @ n_pairs.T
                    var_p = np.where(den > 0, ss_p / np.where(den > 0, den, 1.0), 0.0)
                    var_q = (ss_q + LS_PRIOR_DRAWS) / (var_p @ n_pairs + LS_PRIOR_DRAWS)  # towards 1
            scale[ws], spread[ws] = np.sqrt(var_p), np.sqrt(var_q)
            std = standardize(resid, scale[ws], p)  # r / scale_p, in place of r
            own = pooled_values(std, c, wanted_row, wanted_queries.size, self.n_max, POOL_BINS, query_width,
                                wanted_entries)
            glob = np.zeros((hi - lo, self.n_max))
            if spread_entries.size:
                unit = over_spread(std, spread[ws], q, spread_entries)  # r / (scale_p s_q)
                glob = pooled_values(unit, c[spread_entries], np.zeros(unit.shape[1], np.int64), 1, self.n_max,
                                     POOL_BINS)[:, 0]
                if users.size:
                    shape[ws, users] = pooled_values(unit, c[spread_entries], prow, users.size, self.n_max, POOL_BINS,
                                                     shape_width, mine_in_unit) - glob[:, None]
            at = queries[wanted_queries]
            expected[ws, at] = lam * own + (1.0 - lam) * spread[ws][:, at, None] * glob[:, None]
        return scale, expected, spread, shape

    def _additive_fit(self) -> tuple[np.ndarray, np.ndarray]:
        """(objective rows, P) prompt levels and (objective rows, Q) query offsets (``query_offsets``)."""
        n = self._completions  # (P, Q)
        by_prompt = self._reward_sum.sum(axis=1) @ self._objectives.T  # (P, W) summed scores
        by_query = self._reward_sum.sum(axis=0) @ self._objectives.T  # (Q, W)
        seen_q = n.sum(axis=0) > 0
        per_prompt = np.maximum(n.sum(axis=1), 1.0)
        per_query = np.maximum(n.sum(axis=0), 1.0)
        offsets = np.zeros((self._objectives.shape[0], n.shape[1]))
        for _ in range(OFFSET_SWEEPS):
            level = (by_prompt.T - offsets @ n.T) / per_prompt  # (W, P)
            offsets = (by_query.T - level @ n) / per_query
            offsets[:, ~seen_q] = 0.0
            if seen_q.any():
                offsets[:, seen_q] -= offsets[:, seen_q].mean(axis=1, keepdims=True)
        level = (by_prompt.T - offsets @ n.T) / per_prompt
        return level, offsets

    def query_offsets(self) -> np.ndarray:
        """(objective rows, Q) each query's offset in the Best-of-N score, 0 where unseen: the least-squares
        fit of every seen (prompt, query) mean score to prompt level + query offset, weighted by the
        completions behind it (``OFFSET_SWEEPS`` alternating sweeps from zero offsets; exact in one sweep
        when every prompt saw the same queries equally often), centred to mean 0 over the seen queries."""
        return self._additive_fit()[1]
