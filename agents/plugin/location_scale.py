"""The location-scale fit of ``PlugInEstimator``'s Best-of-N reading (docs/agents.md, "auto", item 2).

score(p, q) = level_p + o_q + scale_p s_q e: the level and query offset a weighted least-squares fit of the
(prompt, query) mean scores (``query_offsets``), the prompt and query spreads a maximum-likelihood fit of the
squared residuals, and e drawn from the query's standardized residuals pooled over every prompt drawn on it
(``LocationScaleFit._location_scale``). The expected maxima of the pools are read by ``pooled_values``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agents.plugin._max_kernels import binned_expected_max, expected_max_rows
from agents.plugin._scale_kernels import over_spread, residual_sums, standardize

#: Alternating least-squares sweeps of ``LocationScaleFit.query_offsets``: exact in one sweep when every prompt saw
#: the same queries equally often (every whole step); with re-admitted prompts, 8 leave the offsets within 0.4 % of
#: the largest offset of their fixed point on the Best-of-N tuning levels (docs/agents.md, "Fixed constants").
OFFSET_SWEEPS = 8
#: Alternating sweeps of the prompt-spread x query-spread fit (``LocationScaleFit._location_scale``): 8 leave the
#: scales and spreads within 0.05 % of their fixed point on the Best-of-N tuning levels (docs/agents.md).
SCALE_SWEEPS = 8
#: A query's residual draws at which its own pooled residual distribution and the one pooled over every query weigh
#: alike in its expected max of N; also the pseudo-draws, at the typical spread, of each query's spread. A few
#: draws: a query seen 2-3 times (the first whole steps) leans on the pool, one seen on every live prompt on its own.
LS_PRIOR_DRAWS = 4.0
#: Bins of the pooled residual distributions once one has more distinct outcomes (``pooled_values``' ``bins``):
#: each expected maximum moves by less than a bin width, 1/256 of the pool's range, and the sort costs 256 a row.
POOL_BINS = 256
#: Elements (float64) of one block of the Best-of-N readings' work arrays (weightings x rows x outcomes or
#: N): the readings go through their rows in blocks of this size, so memory does not grow with the
#: number of weightings times rows (at 1,000 weightings and 1,000 prompts a whole pass would need tens of GiB).
#: The estimates agree to 1e-12 whatever it is (``tests/test_plugin.py``).
BLOCK_ELEMENTS = 1 << 22


def blocks(cost: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) ranges of rows, a new one starting each time the summed ``cost`` (elements per
    row) before a row passes a multiple of ``BLOCK_ELEMENTS``: each range costs under twice that (or is
    one row costlier than that)."""
    before = np.cumsum(cost) - cost
    starts = np.flatnonzero(np.diff(before // BLOCK_ELEMENTS, prepend=-1) > 0)
    return list(zip(starts.tolist(), np.r_[starts[1:], cost.size].tolist(), strict=True))


def padded_rows(values: np.ndarray, counts: np.ndarray, row: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``values`` (W, entries) and ``counts`` (entries,) of entries in rows ``row`` (sorted, every row has
    one) laid out as (W, n_rows, width) scores and (n_rows, width) counts, each row's entries first and
    count-0 padding after them (``width`` the largest row's entries), as ``expected_max_rows`` reads them."""
    sizes = np.bincount(row, minlength=n_rows)
    place = np.arange(row.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    weight = np.zeros((n_rows, int(sizes.max())))
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
    column's count: the binning reads them in place, without gathering a (W, entries) copy first.

    With ``bins``, once some row has more than ``bins`` entries, every row is first merged into ``bins``
    equal-width bins of its score range, each at the mean score of its outcomes: the sort and the N
    passes then cost ``bins`` per row instead of the entries, and each expected maximum moves by less
    than one bin width. ``whole_width``, the entries of the largest row of a whole set these rows are part of,
    makes that choice the whole set's, so that the rows read bit for bit as among all of them.
    """
    if entries is not None:
        counts = counts[entries]
    sizes = np.bincount(row, minlength=n_rows)
    if bins is not None and (int(sizes.max()) if whole_width is None else whole_width) > bins:
        return binned_expected_max(values, counts, np.cumsum(sizes) - sizes, sizes, bins, n_max, entries)
    scores, weight = padded_rows(values if entries is None else values[:, entries], counts, row, n_rows)
    return expected_max_rows(scores, weight, n_max)  # the same counts for every weighting


class LocationScaleFit:
    """The location-scale fit over every completion so far (a part of ``PlugInEstimator``)."""

    env: Any
    n_max: int
    atom_counts: np.ndarray
    _seen: np.ndarray
    _objectives: np.ndarray
    _completions: np.ndarray
    _reward_sum: np.ndarray

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
        for lo, hi in blocks(np.full(n_rows, max(c.size, 1))):
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
