"""``PlugInEstimator``'s majority-vote value: per (prompt, query), its votes plus a prior's pseudo-votes read
through the oracle's exact credit (docs/agents.md, "auto", item 2). The prior's gold share is the prompt's response
curve over the query's difficulty (``curve`` > 0), or the query's answers pooled over every prompt (``curve`` = 0);
its weight is the empirical-Bayes one (``prior_votes``), at most ``alpha``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agents._vote_credit import mv_credit_rows
from agents.plugin._vote_kernels import fit_curves
from agents.plugin.common import CORRECTION_QUERIES, held_index
from iapo_gym import Pulls

#: Newton steps of a response-curve fit at most, and halvings of one step at most. A fit starts from the prompt's last
#: one and stops once its step is below 1e-9 (``_vote_kernels.fit_curves_kernel``), so the caps bound only a fit far
#: from its start (the objective is strictly concave, so the steps converge).
CURVE_ITERATIONS, CURVE_HALVINGS = 25, 30
#: The ridge on the slope of the curves whose slope is held at the median (``pretest``): large against what the votes
#: tell of a slope, so it stays at the median, and finite, so the same Newton fit serves (docs/agents.md).
RIDGE_MAX = 1e6
#: Pseudo-votes added to a query's pooled gold and wrong votes before its difficulty z_q, the logit of its gold
#: rate, is taken: the usual 0.5 (Haldane-Anscombe) correction, which keeps z_q finite on a query every prompt
#: answers right (or wrong) and is nearly unbiased for the logit.
LOGIT_SMOOTHING = 0.5
#: The sigmoid's argument is clipped to +-SIGMOID_CLIP: exp stays finite, and sigmoid(30) is 1 to 1e-13.
SIGMOID_CLIP = 30.0


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


class MajorityVoteReadings:
    """The majority-vote value of the read prompts (a part of ``PlugInEstimator``)."""

    env: Any
    n_max: int
    alpha: float
    curve: float
    slope: float
    pretest: float
    empirical_bayes: bool
    mv_correction: bool
    atom_counts: np.ndarray
    _seen: np.ndarray
    _credit: np.ndarray
    _unbiased: np.ndarray
    _probs: np.ndarray
    _votes: np.ndarray
    _gold_votes: np.ndarray
    _pooled: np.ndarray
    _curves: np.ndarray
    _offsets: np.ndarray

    def _mv_credit_pooled(self, pulls: Pulls, prompts: np.ndarray) -> np.ndarray:
        """(len(prompts), N_max) mean credit over each prompt's queries with the query's pooled answers as
        prior (``curve`` = 0), refreshing every seen row of ``prompts`` with ``empirical_bayes`` (the prior's
        weight moves with every pull), else the pulled queries' rows."""
        queries = np.unique(pulls.queries) if not self.empirical_bayes else np.flatnonzero(self._seen[prompts].any(axis=0))
        p_pos, q_pos = np.nonzero(self._seen[prompts][:, queries])
        pooled = self._pooled[queries].astype(np.float64)
        self._mv_rows(prompts[p_pos], queries[q_pos], (pooled / pooled.sum(axis=1, keepdims=True))[q_pos])
        return self._corrected_credit(prompts)

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
        self._probs[rows_p, q_idx] = probs
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
        z[cols] = np.log((g_all + LOGIT_SMOOTHING) / (n_all - g_all + LOGIT_SMOOTHING))
        theta, variance = self._fit_curves(prompts, cols, z[cols], (self.curve, self.slope), self._curves[prompts])
        self._curves[prompts] = theta
        if self.pretest > 0:
            theta = self._pretest_slopes(prompts, cols, z[cols], theta, variance)
        share = 1.0 / (1.0 + np.exp(-np.clip(theta[p_idx, 0] + theta[p_idx, 1] * z[q_idx], -SIGMOID_CLIP, SIGMOID_CLIP)))
        rows = np.arange(q_idx.size)
        wrong = self._pooled[q_idx].astype(np.float64)
        wrong[rows, gold[q_idx]] = 0.0
        unseen = wrong.sum(axis=1) == 0  # no wrong answer yet: one wrong bucket takes the rest
        wrong[rows[unseen], (gold[q_idx[unseen]] + 1) % wrong.shape[1]] = 1.0
        prior = wrong / wrong.sum(axis=1, keepdims=True) * (1.0 - share)[:, None]
        prior[rows, gold[q_idx]] = share
        self._mv_rows(prompts[p_idx], q_idx, prior)
        return self._corrected_credit(prompts)

    def _corrected_credit(self, prompts: np.ndarray) -> np.ndarray:
        """(len(prompts), N_max) each prompt's majority-vote credit: the mean over its s seen queries of
        C(q, N) + lam (U(q, m) - C(q, m)), C the prior-read credit (``_credit``), U the unbiased one (``_unbiased``:
        the mean credit over every m-subset of the query's n votes), m = min(N, n) and lam = s / (s +
        ``CORRECTION_QUERIES``).

        The prior-read credit is biased where the prior misreads a prompt (its response curve reads the queries
        where voting helps it, not those where a wrong answer outvotes the gold one) and where a few votes are read
        through the credit's bend near a tie; up to a query's votes the correction takes lam of that bias out, and
        beyond them it keeps the bias measured where they end, so the estimate does not bend at n. As the votes grow
        the prior's weight and the bias go to 0 together, so the estimate still converges to the train-split Q.
        """
        seen = self._seen[prompts]
        if not self.mv_correction:  # the mean over the columns any of them saw (unseen rows hold 0)
            cols = np.flatnonzero(seen.any(axis=0))
            return self._credit[prompts[:, None], cols[None, :]].sum(axis=1) / seen.sum(axis=1)[:, None]
        p_idx, q_idx = np.nonzero(seen)  # by prompt, then query
        rows_p = prompts[p_idx]
        m = held_index(self._votes[rows_p, q_idx], self.n_max)  # (rows, N)
        credit = self._credit[rows_p, q_idx]
        gap = np.take_along_axis(self._unbiased[rows_p, q_idx] - credit, m, axis=1)
        per_prompt = seen.sum(axis=1)
        n_queries = per_prompt.astype(np.float64)
        lam = n_queries / (n_queries + CORRECTION_QUERIES)
        starts = np.r_[0, np.cumsum(per_prompt)[:-1]]  # every prompt read here has a seen query
        return (np.add.reduceat(credit, starts, axis=0) + lam[:, None] * np.add.reduceat(gap, starts, axis=0)) \
            / n_queries[:, None]

    def _fit_curves(self, prompts: np.ndarray, cols: np.ndarray, z: np.ndarray, ridge: tuple[float, float],
                    start: np.ndarray, slope: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """(len(prompts), 2) response curves (a_p, b_p) and their posterior variances: the maximum of
        the binomial log-likelihood of each prompt's gold votes on the queries ``cols`` of difficulty
        ``z``, ridge-penalised by ``ridge`` = (on a_p towards 0, on b_p towards ``slope``).

        Newton steps from ``start`` (the prompt's last fit; at first (0, 1)), each halved until the
        penalised likelihood does not fall (to rounding); a prompt's fit ends once its step is below
        1e-9. The objective is strictly concave, so this converges whatever the votes (full steps
        alone can overshoot without end on a prompt far from the pool). The variances are the
        inverse Hessian's diagonal at each prompt's last step's start (``_vote_kernels.fit_curves``, one prompt
        at a time).
        """
        g = self._gold_votes[prompts][:, cols].astype(np.float64)
        n = self._votes[prompts][:, cols].astype(np.float64)
        return fit_curves(g, n, z, ridge, start, slope, CURVE_ITERATIONS, CURVE_HALVINGS)

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
