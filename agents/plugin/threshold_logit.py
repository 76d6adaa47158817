"""The threshold-logit fit of ``PlugInEstimator``'s Best-of-N reading and its blend with the location-scale one
(docs/agents.md, "auto", item 2, ``bon_reading="blend"``).

At K thresholds t_k of the pooled scores, each (prompt, query)'s share of completions scoring above t_k is read as
logit P(score > t_k | p, q) = a_pk + b_qk: a prompt's and a query's failure rates combine on the logit scale, which
a location-scale model cannot hold (a risky prompt on a hard query fails far more often than the pool's standardized
residuals say). Where queries move every prompt's location instead, the additive logit per threshold does not hold;
so the two readings are blended per objective row by the weight that best predicts how the unbiased readings rise
with N (``ThresholdLogitFit._blend_weight``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agents.plugin._logit_kernels import threshold_fit, threshold_readings
from agents.plugin._max_kernels import expected_max_rows
from agents.plugin._scale_kernels import location_scale_readings
from agents.plugin.location_scale import blocks, padded_rows

#: Thresholds of the pooled scores at most: every distinct score but the largest while there are at most this many
#: more, else this many weighted quantiles. A bin then holds 1/25 of the pooled draws, and the fit's cost grows with it.
MAX_THRESHOLDS = 24
#: The fit stops once a sweep moved no (prompt, query)'s fitted probability at any threshold by this much or more:
#: the sweeps' changes shrink faster than geometrically near the maximum, so the probabilities are then about this
#: close to it.
LOGIT_TOL = 1e-6
#: Alternating Newton sweeps of the fit over the prompts' and the queries' logits at most, from the pooled logits:
#: with the exact step along the direction the data do not see, 8-33 sweeps reach ``LOGIT_TOL`` (tests/test_plugin.py).
LOGIT_SWEEPS = 40
#: The ridge on a prompt's logit at a threshold, towards the pooled logit there: small, so a prompt seen on a few
#: queries keeps its own failure rate, and finite, so one never seen above (or below) a threshold stays finite.
PROMPT_RIDGE = 0.01
#: The ridge on a query's logit offset, towards 0: one pseudo-draw's curvature, so a query seen on few prompts
#: leans on the prompts' logits.
QUERY_RIDGE = 1.0
#: A Newton step of the fit moves a logit by at most this much: a one-dimensional step from far off (a prompt
#: that never scores above a threshold) would otherwise overshoot and swing; 15 sweeps still move 30 logits.
LOGIT_STEP_MAX = 2.0

Fit = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class ThresholdLogitFit:
    """The threshold-logit reading over every completion so far (a part of ``PlugInEstimator``)."""

    env: Any
    n_max: int
    atom_counts: np.ndarray
    _objectives: np.ndarray
    _completions: np.ndarray
    _score_range: np.ndarray

    def _pair_scores(self, pp: np.ndarray, qq: np.ndarray, objectives: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(W, pairs, width) the outcomes' scores under ``objectives`` (W, K) and (pairs, width) their counts of the
        (prompt, query) pairs ``pp``, ``qq`` (each drawn), count-0 padding after each pair's outcomes."""
        atoms = self.env.table.atoms
        assert atoms is not None
        counts = self.atom_counts[pp, qq]
        row, a = np.nonzero(counts)
        projected = (atoms[pp[row], qq[row], a] @ objectives.T).T  # (W, entries)
        return padded_rows(projected, counts[row, a], row, pp.size)

    def _threshold_fit(self) -> Fit:
        """``threshold_fit`` of every seen (prompt, query)'s completions under each objective row, in blocks of rows
        (``BLOCK_ELEMENTS``): a (W, P, K), b (W, Q, K), the bins' scores (W, K + 1) and the thresholds (W,)."""
        atoms = self.env.table.atoms
        assert atoms is not None
        pp, qq = np.nonzero(self._completions > 0)
        counts = self.atom_counts[pp, qq]
        pair, a = np.nonzero(counts)
        outcomes = atoms[pp[pair], qq[pair], a]  # (entries, objectives)
        n_prompts, n_queries = self._completions.shape
        parts = []
        per_row = max(pair.size, (n_prompts + n_queries) * MAX_THRESHOLDS)
        for lo, hi in blocks(np.full(self._objectives.shape[0], per_row)):
            parts.append(threshold_fit((outcomes @ self._objectives[lo:hi].T).T, counts[pair, a], pair, pp, qq,
                                       n_prompts, n_queries, MAX_THRESHOLDS, LOGIT_SWEEPS, PROMPT_RIDGE, QUERY_RIDGE,
                                       LOGIT_STEP_MAX, LOGIT_TOL))
        fit: Fit = tuple(np.concatenate(part) for part in zip(*parts, strict=True))  # type: ignore[assignment]
        return fit

    def _blend_weight(self, fit: Fit, prompts: np.ndarray, cols: np.ndarray, ls_fit: tuple[np.ndarray, ...]
                      ) -> np.ndarray:
        """(W,) per objective row the weight alpha in [0, 1] of the threshold-logit reading R_l against the
        location-scale one R_s: the least-squares alpha for which alpha R_l + (1 - alpha) R_s best predicts the
        unbiased readings' rise U(m) - U(1) from its own rise, over every (prompt, query) of ``prompts`` on the
        queries ``cols`` with at least 2 draws and m = 2..min(N_max, its draws): which model predicts how a prompt's
        best of m grows, on the draws that show it. 0 where the readings do not differ there.
        ``ls_fit`` is ``_bon_value``'s (level, offsets, scale, expected, spread, shape), ``shape`` over ``prompts``."""
        level, offsets, scale, expected, spread, d_p = ls_fit
        low, high = self._score_range
        n_rows = offsets.shape[0]
        num, den = np.zeros(n_rows), np.zeros(n_rows)
        draws_all = self._completions[prompts][:, cols]
        for lo, hi in blocks(np.full(prompts.size, n_rows * cols.size * self.n_max * 4)):
            block, draws = prompts[lo:hi], draws_all[lo:hi]
            read = draws >= 2
            if not read.any():
                continue
            logit = threshold_readings(fit, block, cols, read, self.n_max)
            ls = location_scale_readings(expected[:, cols], spread[:, cols], d_p[:, lo:hi], scale[:, block],
                                         level[:, block], offsets[:, cols], low, high)
            i, c = np.nonzero(read)
            unbiased = np.zeros_like(logit)
            unbiased[:, i, c] = expected_max_rows(*self._pair_scores(block[i], cols[c], self._objectives),
                                                  self.n_max, subsets=True)[1]
            reach = np.arange(self.n_max) < np.minimum(draws, self.n_max)[..., None]  # m <= the pair's draws
            reach[..., 0] = False
            reach &= read[..., None]

            def rise(x: np.ndarray) -> np.ndarray:
                return x - x[..., :1]
            gap = np.where(reach, rise(logit) - rise(ls), 0.0)
            num += (gap * np.where(reach, rise(unbiased) - rise(ls), 0.0)).sum(axis=(1, 2, 3))
            den += (gap * gap).sum(axis=(1, 2, 3))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, np.clip(num / np.where(den > 0, den, 1.0), 0.0, 1.0), 0.0)
