"""Agents that compare prompts on common queries: ``plugin_anytime`` (``auto``), ``plugin_halving``, ``psst_cq``.

PSST draws an independent query for every pull, so two prompts' estimates differ by the
difficulty of the queries each happened to see as well as by their quality; on MATH and the
synthetic tasks query difficulty varies far more than prompt quality. The agents here give
every live prompt the *same* train queries in a round, drawn without replacement (a fresh
shuffle once the split is used up), through the public ``env.pull(prompts, ns, queries=...)``:

* ``AnytimePlugIn`` (``plugin_anytime``, the recommended ``auto``): elimination over prompts at
  a pace set by the completions spent, so one trajectory serves every budget
  (``train_budgets``), each budget ending in successive halving of the prompts still live,
  with the prompts' response curves over query difficulty as the majority-vote prior.
* ``PlugInHalving`` (``plugin_halving``): successive halving over prompts for a known budget,
  many common queries per round at a small N, read through ``PlugInEstimator`` (``auto`` of
  issue 14; on held-out seeds the anytime agent removes more regret, docs/agents.md).
* ``CommonQueryPSST`` (``psst_cq``): PSST's rounds unchanged on common queries; a measured
  negative result kept for the record (docs/agents.md).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from agents import _plugin_jit
from agents.base import Agent
from agents.estimator import Estimator
from agents.psst import PSST, Allocation, rounds_to_one, trimming_rounds
from iapo_gym import Policy, Pulls
from iapo_gym.utility import bon_expected_max, mv_expected_credit


class QueryStream:
    """Train queries without replacement: a shuffled pass over the split, then a fresh shuffle."""

    def __init__(self, pool: np.ndarray, rng: np.random.Generator) -> None:
        """Draw from ``pool`` (the env's train query indices) with the agent's ``rng``."""
        if pool.size == 0:
            raise ValueError("the env's split has no queries to draw from")
        self.pool = np.asarray(pool, dtype=np.int64)
        self.rng = rng
        self._order = self.rng.permutation(self.pool)
        self._next = 0

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` queries (distinct while n <= the pool size)."""
        out = []
        while n > 0:
            if self._next == self._order.size:
                self._order, self._next = self.rng.permutation(self.pool), 0
            step = min(n, self._order.size - self._next)
            out.append(self._order[self._next:self._next + step])
            self._next += step
            n -= step
        return np.concatenate(out) if out else np.zeros(0, np.int64)


def common_query_rounds(env: Any, est: Estimator, alive: np.ndarray, budget: int, rng: np.random.Generator,
                        stream: QueryStream) -> tuple[np.ndarray, int]:
    """PSST's trimming rounds (``trimming_rounds`` with carried leftovers) on common queries.

    Each round draws ``per_arm`` queries from ``stream`` and pulls every live prompt at its
    largest live scale once on each of them. A round that cannot afford one pull per live
    prompt gives min(top, floor(b / live)) completions to each live prompt on one common
    query, or, if even that is 0, one completion to b random live prompts on one query.
    """
    def allocate(top: np.ndarray, b: int, per_arm: int) -> Allocation:
        live = np.flatnonzero(top)
        if per_arm >= 1:
            queries = stream.take(per_arm)
            return np.repeat(live, per_arm), np.repeat(top[live], per_arm), np.tile(queries, live.size)
        if b < 1 or not live.size:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), None
        each = b // live.size
        if each >= 1:
            prompts, ns = live, np.minimum(top[live], each)
        else:
            prompts = np.sort(rng.choice(live, size=b, replace=False))
            ns = np.ones(prompts.size, np.int64)
        return prompts, ns, np.repeat(stream.take(1), prompts.size)

    return trimming_rounds(env, est, alive, budget, rng, allocate, leftover="carry")


class CommonQueryPSST(PSST):
    """PSST whose rounds pull every live prompt on the same train queries (without replacement)."""


    def __init__(self, seed: int | None = None, reuse: str = "blocks") -> None:
        """``reuse``: the shared estimator's scale reuse ("blocks" or "all_subsets")."""
        super().__init__(seed, reuse=reuse)  # type: ignore[arg-type]

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"reuse": self.reuse}

    def train(self, env: Any, budget: int) -> Any:
        """Spend at most ``budget`` completions of ``env``; one surviving arm per context."""
        base = self.base_env(env)
        budget = self.check_budget(budget)
        est = self.make_estimator(base)
        stream = QueryStream(base.queries(), self.rng)
        alive = np.ones(est.sums.shape, dtype=bool)
        alive, _ = common_query_rounds(base, est, alive, budget, self.rng, stream)
        return est.best_arms(self.rng, alive)


def mv_credit_rows(probs: np.ndarray, gold: np.ndarray, n_max: int) -> np.ndarray:
    """``mv_expected_credit`` of each row, computed with only the buckets of positive probability.

    A bucket of probability 0 never receives a vote, so dropping it leaves the credit unchanged
    (up to rounding: fewer quadrature nodes); the exact kernel's cost grows with the number of
    buckets, and the plug-in rows of a query often have only a few.
    """
    n_rows = probs.shape[0]
    out = np.empty((n_rows, n_max))
    p_gold = probs[np.arange(n_rows), gold]
    others = probs.copy()
    others[np.arange(n_rows), gold] = -1.0
    others = -np.sort(-others, axis=1)[:, :-1]  # the other buckets, largest first
    width = (others > 0).sum(axis=1)
    if _plugin_jit.available():
        return _plugin_jit.credit_rows(p_gold, others, width, n_max)
    for w in np.unique(width):
        rows = np.flatnonzero(width == w)
        reduced = np.column_stack([p_gold[rows], others[rows, :max(int(w), 1)]])
        out[rows] = mv_expected_credit(reduced, np.zeros(rows.size, np.int64), n_max)
    return out


def check_curve_prior(curve: float, slope: float | None, eb: int, pretest: float = 0.0,
                      zprior: float = 0.0) -> tuple[float, float | None, int, float, float]:
    """``curve``, ``slope``, ``eb``, ``pretest`` and ``zprior`` of the response-curve prior as float, float or
    None, int, float, float; a bad one raises ValueError naming it (``curve``, ``slope``, ``pretest``,
    ``zprior`` >= 0, ``eb`` an integer >= 0)."""
    if not float(curve) >= 0.0:
        raise ValueError(f"curve must be >= 0, got {curve!r}")
    if slope is not None and not float(slope) >= 0.0:
        raise ValueError(f"slope must be >= 0 or None, got {slope!r}")
    if isinstance(eb, bool) or not isinstance(eb, (int, np.integer)) or eb < 0:
        raise ValueError(f"eb must be an integer >= 0, got {eb!r}")
    if not float(pretest) >= 0.0:
        raise ValueError(f"pretest must be >= 0, got {pretest!r}")
    if not float(zprior) >= 0.0:
        raise ValueError(f"zprior must be >= 0, got {zprior!r}")
    return float(curve), None if slope is None else float(slope), int(eb), float(pretest), float(zprior)


def check_center(center: Any) -> bool:
    """``center`` as a bool (the estimator's and the agent's one check); anything but True or False raises
    ValueError naming it."""
    if not isinstance(center, (bool, np.bool_)):
        raise ValueError(f"center must be True or False, got {center!r}")
    return bool(center)


#: Newton steps of a response-curve fit at most, and halvings of one step at most.
CURVE_ITERATIONS, CURVE_HALVINGS = 25, 30
#: The largest ridge the empirical-Bayes fit sets (a spread of the curves' parameters of 0.001).
RIDGE_MAX = 1e6


class PlugInEstimator(Estimator):
    """Q(c, p, N) for every N from empirical outcome distributions, through the oracle's formulas.

    ``update`` adds a batch's completions to per-(prompt, query) atom counts and recomputes
    the estimates of the pulled prompts: the exact formulas of ``iapo_gym.utility``
    (``mv_expected_credit``, ``bon_expected_max``) applied to a smoothed empirical distribution,
    written into ``sums``/``counts`` so ``mean`` and ``best_arms`` read them like any estimate.

    * Majority vote: per (prompt, query), the counts plus ``alpha`` pseudo-votes of the query's
      answers pooled over every prompt (answers are query-specific); the credit of each
      (prompt, query) is averaged over the prompt's queries (one sample per query).
    * Best-of-N: per prompt, its outcomes pooled over its queries (``alpha`` is not used: a
      few completions per query would make the maximum of many draws look far too small).
      Q is a mean over queries of each query's expected maximum, so the spread *between*
      queries must not enter the pooled distribution; with ``center`` each outcome's score is
      read relative to its query's offset, fitted to every prompt's scores on that query as
      score ~ prompt level + query offset (``query_offsets``). Pooled raw, the shared query
      difficulty widens every prompt's distribution alike in absolute terms, which inflates a
      narrow prompt's large-N maximum far more than a wide one's. The offsets move with every
      update but only the pulled prompts are recomputed, so read the prompts pulled last (the
      common-query agents pull every live prompt in every step).
    """

    def __init__(self, env: Any, alpha: float = 4.0, curve: float = 0.0, slope: float | None = None,
                 eb: int = 0, pretest: float = 0.0, zprior: float = 0.0, center: bool = False) -> None:
        """Bind to ``env``; ``alpha`` >= 0 pseudo-votes of the prior (majority vote); ``center``: Best-of-N
        scores pooled relative to their query's offset (above); ``curve`` > 0 uses the
        prompt's response curve over query difficulty as the prior's gold share (ridge strength ``curve``
        on its offset, ``slope`` on its slope; ``slope`` None: ``curve``; ``eb`` > 0: both re-estimated
        from the data, ``eb`` EM steps per update, starting there; ``pretest`` > 0: a prompt keeps its
        own slope only where it lies ``pretest`` posterior SDs or more from the updated prompts' median
        slope, the others' slopes are held at that median; ``zprior`` > 0: a query's difficulty z_q is
        read from its pooled votes plus ``zprior`` pseudo-votes at the gold rate of every query, so a
        query few prompts have answered sits near the typical difficulty instead of at the logit of a
        handful of votes)."""
        super().__init__(env, "blocks")
        if not float(alpha) >= 0.0:
            raise ValueError(f"alpha must be >= 0, got {alpha!r}")
        self.alpha = float(alpha)
        self.center = check_center(center)
        self.curve, slope, self.eb, self.pretest, self.zprior = check_curve_prior(curve, slope, eb, pretest, zprior)
        self.slope = self.curve if slope is None else slope
        self._ridge = (self.curve, self.slope)
        self._curves = np.column_stack([np.zeros(self.n_prompts), np.ones(self.n_prompts)])  # (a_p, b_p) last fitted
        self._offsets = np.zeros(self.n_prompts)  # a_p last fitted with b_p held at the median slope (``pretest``)
        table = self.env.table
        self.atom_counts = np.zeros((self.n_prompts, table.n_queries, self.n_atoms), dtype=np.int64)
        self._cost_sum = np.zeros((self.n_prompts,))  # sum over the prompt's pulled queries of cost[p, q]
        self._seen = np.zeros((self.n_prompts, table.n_queries), dtype=bool)
        if self.aggregator == "mv":
            self._credit = np.zeros((self.n_prompts, table.n_queries, self.n_max))  # per (p, q), cached
            self._votes = np.zeros((self.n_prompts, table.n_queries), dtype=np.int64)  # atom_counts summed over atoms
            self._gold_votes = np.zeros((self.n_prompts, table.n_queries), dtype=np.int64)  # ... on the gold atom
            self._pooled = np.zeros((table.n_queries, self.n_atoms), dtype=np.int64)  # ... summed over prompts
        else:
            self._objectives, row = np.unique(self._weights[:, :-1], axis=0, return_inverse=True)
            self._objective_row = row.reshape(-1)
            assert table.atoms is not None
            self._reward_sum = np.zeros((self.n_prompts, table.n_queries, table.atoms.shape[-1]))  # per (p, q)
            self._completions = np.zeros((self.n_prompts, table.n_queries))  # atom_counts summed over atoms

    def reset(self) -> None:
        """Forget every sample."""
        super().reset()
        self.atom_counts[...] = 0
        self._cost_sum[...] = 0.0
        self._seen[...] = False
        self._ridge = (self.curve, self.slope)
        self._curves[:, 0], self._curves[:, 1] = 0.0, 1.0
        self._offsets[...] = 0.0
        if self.aggregator == "mv":
            for array in (self._credit, self._votes, self._gold_votes, self._pooled):
                array[...] = 0
        else:
            self._reward_sum[...] = 0.0
            self._completions[...] = 0.0

    def update(self, pulls: Pulls, *, scales: str | np.ndarray | None = None, arm_mask: np.ndarray | None = None,
               contexts: np.ndarray | None = None) -> None:
        """Add the pulls' completions and recompute every pulled prompt's estimates at every scale and context.

        ``scales``, ``arm_mask`` and ``contexts`` are accepted for the interface and ignored.
        """
        rep = np.repeat(np.arange(len(pulls)), pulls.ns)
        np.add.at(self.atom_counts, (pulls.prompts[rep], pulls.queries[rep], pulls.atoms), 1)
        if self.aggregator == "mv":
            gold = self.env.table.gold
            assert gold is not None
            np.add.at(self._votes, (pulls.prompts, pulls.queries), pulls.ns)
            np.add.at(self._gold_votes, (pulls.prompts[rep], pulls.queries[rep]),
                      pulls.atoms == gold[pulls.queries[rep]])
            np.add.at(self._pooled, (pulls.queries[rep], pulls.atoms), 1)
        elif self.center:  # the sums behind query_offsets
            atoms = self.env.table.atoms
            assert atoms is not None
            cell = pulls.prompts[rep] * self._completions.shape[1] + pulls.queries[rep]  # flat (p, q)
            vectors = atoms[pulls.prompts[rep], pulls.queries[rep], pulls.atoms]  # (completions, K)
            flat = self._reward_sum.reshape(-1, vectors.shape[1])
            for k in range(vectors.shape[1]):
                flat[:, k] += np.bincount(cell, weights=vectors[:, k], minlength=flat.shape[0])
            self._completions += np.bincount(cell, minlength=flat.shape[0]).reshape(self._completions.shape)
        fresh = ~self._seen[pulls.prompts, pulls.queries]
        pairs = np.unique(np.column_stack([pulls.prompts[fresh], pulls.queries[fresh]]), axis=0)
        self._seen[pairs[:, 0], pairs[:, 1]] = True
        self._cost_sum += np.bincount(pairs[:, 0], weights=self._cost[pairs[:, 0], pairs[:, 1]],
                                      minlength=self.n_prompts)
        prompts = np.unique(pulls.prompts)
        n_queries = self._seen[prompts].sum(axis=1).astype(np.float64)
        if self.aggregator == "mv" and self.curve > 0:
            task = self._weights[:, :1, None] * self._mv_credit_curve(prompts)[None]
        elif self.aggregator == "mv":
            task = self._weights[:, :1, None] * self._mv_credit(np.unique(pulls.queries), prompts)[None]
        else:
            task = self._bon_value(prompts)
        scale = np.arange(1, self.n_max + 1, dtype=np.float64)
        cost = self._weights[:, -1:, None] * (self._cost_sum[prompts] / n_queries)[None, :, None] * scale
        self.counts[:, prompts, :] = n_queries[None, :, None]
        self.sums[:, prompts, :] = (task + cost) * n_queries[None, :, None]

    def close_calls(self, prompts: np.ndarray, queries: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """(len(queries),) how undecided the majority votes of ``prompts`` on each query are: the sum
        over the prompts and ``scales`` of c (1 - c), c the cached expected credit at that N (the
        response-curve prior's, majority vote only). A query every prompt surely wins or surely
        loses at those N scores near 0; more votes there would not move any estimate that ranks."""
        credit = self._credit[prompts[:, None], queries[None, :]][:, :, scales - 1]  # (p, q, scales)
        return (credit * (1.0 - credit)).sum(axis=(0, 2))

    def disagreements(self, prompts: np.ndarray, queries: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """(len(queries),) how much more votes on each query could reorder ``prompts``: the sum over
        ``scales`` of the variance of the prompts' cached expected credits on the query times their
        mean c (1 - c) (majority vote only). A query every prompt finds equally undecided scores 0
        (its votes move every prompt alike), and so does one the prompts surely split on."""
        credit = self._credit[prompts[:, None], queries[None, :]][:, :, scales - 1]  # (p, q, scales)
        return (credit.var(axis=0) * (credit * (1.0 - credit)).mean(axis=0)).sum(axis=1)

    def _mv_credit(self, queries: np.ndarray, prompts: np.ndarray) -> np.ndarray:
        """(len(prompts), N_max) mean credit over each prompt's queries, refreshing its rows of ``queries``.

        Only the pulled prompts' rows are refreshed (the query's pooled prior moved for every
        prompt, but the others' estimates are not read until they are pulled again).
        """
        gold = self.env.table.gold
        assert gold is not None
        pooled = self._pooled[queries].astype(np.float64)  # (q, atoms) over all prompts
        prior = pooled / pooled.sum(axis=1, keepdims=True)
        p_pos, q_pos = np.nonzero(self._seen[prompts][:, queries])
        p_idx = prompts[p_pos]
        counts = self.atom_counts[p_idx, queries[q_pos]].astype(np.float64)
        probs = (counts + self.alpha * prior[q_pos]) / (counts.sum(axis=1, keepdims=True) + self.alpha)
        self._credit[p_idx, queries[q_pos]] = mv_credit_rows(probs, gold[queries[q_pos]], self.n_max)
        return self._credit[prompts].sum(axis=1) / self._seen[prompts].sum(axis=1)[:, None]

    def _mv_credit_curve(self, prompts: np.ndarray) -> np.ndarray:
        """(len(prompts), N_max) mean credit over each prompt's queries, every row of ``prompts`` refreshed.

        The prior of (p, q) gives gold the share sigmoid(a_p + b_p z_q), z_q the logit of q's gold
        rate pooled over every prompt (the query's difficulty) and (a_p, b_p) the prompt's
        response curve: a binomial logistic fit to its own gold votes, ridge-penalised by
        ``curve`` towards (0, 1), the pooled curve. The other buckets share the rest as q's pooled
        wrong answers do (one wrong bucket takes all of it while q has no wrong answer). A
        prompt's few votes on one query are thus read together with how it does on queries of
        the same difficulty, not only with how other prompts do on that query. With ``pretest``,
        only the slopes far from the others' stay the prompts' own (``_pretest_slopes``). The
        curves move with every pull, so every row of ``prompts`` is recomputed.
        """
        gold = self.env.table.gold
        assert gold is not None
        votes, gold_votes = self._votes, self._gold_votes  # (P, Q)
        pooled = self._pooled.astype(np.float64)  # (Q, atoms)
        seen = self._seen[prompts]
        p_idx, q_idx = np.nonzero(seen)
        cols = np.flatnonzero(seen.any(axis=0))  # the queries any of ``prompts`` has seen
        seen_cols = np.flatnonzero(self._seen.any(axis=0)) if self.eb else cols  # the ridges' fit reads them all
        g_all, n_all = gold_votes[:, seen_cols].sum(axis=0), votes[:, seen_cols].sum(axis=0)
        z = np.zeros(votes.shape[1])
        rate = g_all.sum() / max(n_all.sum(), 1)
        z[seen_cols] = np.log((g_all + self.zprior * rate + 0.5) / (n_all - g_all + self.zprior * (1.0 - rate) + 0.5))
        ridge = self._fit_ridge(z) if self.eb else (self.curve, self.slope)
        theta, variance = self._fit_curves(prompts, cols, z[cols], ridge, self._curves[prompts])
        self._curves[prompts] = theta
        if self.pretest > 0:
            theta = self._pretest_slopes(prompts, cols, z[cols], ridge[0], theta, variance)
        share = 1.0 / (1.0 + np.exp(-np.clip(theta[p_idx, 0] + theta[p_idx, 1] * z[q_idx], -30.0, 30.0)))
        rows = np.arange(q_idx.size)
        wrong = pooled[q_idx].copy()
        wrong[rows, gold[q_idx]] = 0.0
        unseen = wrong.sum(axis=1) == 0  # no wrong answer yet: one wrong bucket takes the rest
        wrong[rows[unseen], (gold[q_idx[unseen]] + 1) % wrong.shape[1]] = 1.0
        prior = wrong / wrong.sum(axis=1, keepdims=True) * (1.0 - share)[:, None]
        prior[rows, gold[q_idx]] = share
        rows_p = prompts[p_idx]
        counts = self.atom_counts[rows_p, q_idx].astype(np.float64)
        probs = (counts + self.alpha * prior) / (counts.sum(axis=1, keepdims=True) + self.alpha)
        self._credit[rows_p, q_idx] = mv_credit_rows(probs, gold[q_idx], self.n_max)
        # unseen rows hold 0: sum only the columns any of them has seen
        return self._credit[prompts[:, None], cols[None, :]].sum(axis=1) / seen.sum(axis=1)[:, None]

    def _fit_curves(self, prompts: np.ndarray, cols: np.ndarray, z: np.ndarray, ridge: tuple[float, float],
                    start: np.ndarray, slope: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """(len(prompts), 2) response curves (a_p, b_p) and their posterior variances: the maximum of
        the binomial log-likelihood of each prompt's gold votes on the queries ``cols`` of difficulty
        ``z``, ridge-penalised by ``ridge`` = (on a_p towards 0, on b_p towards ``slope``).

        Newton steps from ``start`` (the prompt's last fit; at first the pooled curve (0, 1)), each
        halved until the penalised likelihood does not fall (to rounding); a prompt's fit ends once
        its step is below 1e-9. The objective is strictly concave, so this converges whatever the
        votes; full steps alone can overshoot without end on a prompt far from the pool (a prompt
        nearly always wrong on mostly easy queries), whose curve would then call it nearly always
        right. The variances are the inverse Hessian's diagonal at each prompt's last step's start.
        """
        g = self._gold_votes[prompts][:, cols].astype(np.float64)
        n = self._votes[prompts][:, cols].astype(np.float64)
        lam_a, lam_b = ridge

        def objective(theta: np.ndarray, rows: np.ndarray) -> np.ndarray:
            """The penalised log-likelihood of the curves ``theta`` of the prompts ``rows``."""
            x = theta[:, :1] + theta[:, 1:] * z[None, :]
            loglik = -(n[rows] * np.logaddexp(0.0, -x) + (n[rows] - g[rows]) * x).sum(axis=1)  # softplus(x) = softplus(-x) + x
            return loglik - 0.5 * (lam_a * theta[:, 0] ** 2 + lam_b * (theta[:, 1] - slope) ** 2)

        def newton(theta: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """The Newton step and the posterior variances (diagonal of the inverse Hessian) of ``rows`` at ``theta``."""
            mu = 1.0 / (1.0 + np.exp(-np.clip(theta[:, :1] + theta[:, 1:] * z[None, :], -30.0, 30.0)))
            r, w = g[rows] - n[rows] * mu, n[rows] * mu * (1.0 - mu)
            grad_a = r.sum(axis=1) - lam_a * theta[:, 0]
            grad_b = (r * z).sum(axis=1) - lam_b * (theta[:, 1] - slope)
            h00, h01, h11 = w.sum(axis=1) + lam_a, (w * z).sum(axis=1), (w * z * z).sum(axis=1) + lam_b
            det = h00 * h11 - h01 * h01
            step = np.column_stack([h11 * grad_a - h01 * grad_b, h00 * grad_b - h01 * grad_a]) / det[:, None]
            return step, np.column_stack([h11 / det, h00 / det])

        theta = start.copy()  # the last fit: the curves move little between updates
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

    def _pretest_slopes(self, prompts: np.ndarray, cols: np.ndarray, z: np.ndarray, ridge_a: float,
                        theta: np.ndarray, variance: np.ndarray) -> np.ndarray:
        """``theta`` with the curve of every prompt whose slope is within ``pretest`` posterior SDs of the
        median slope of ``prompts`` replaced by its fit with the slope held at that median: a sparse
        prior on the slopes, so the prompts far from the others keep theirs while small, noisy
        departures do not move the ranking. (The median, not the pooled curve's 1: z_q is the logit
        of the pooled gold *rate*, so a typical prompt's slope on it is not 1; on MATH about 1.25.)"""
        centre = float(np.median(theta[:, 1]))
        free = np.abs(theta[:, 1] - centre) >= self.pretest * np.sqrt(variance[:, 1])
        if free.all():
            return theta
        held = prompts[~free]
        start = np.column_stack([self._offsets[held], np.full(held.size, centre)])
        fixed, _ = self._fit_curves(held, cols, z, (ridge_a, RIDGE_MAX), start, centre)
        self._offsets[held] = fixed[:, 0]
        out = theta.copy()
        out[~free] = fixed
        return out

    def _fit_ridge(self, z: np.ndarray) -> tuple[float, float]:
        """The curves' ridges by empirical Bayes: EM steps for the spread of (a_p, b_p - 1) over every
        prompt with votes, each curve's posterior variance included, started from the last ridges."""
        prompts = np.flatnonzero(self._seen.any(axis=1))
        cols = np.flatnonzero(self._seen.any(axis=0))
        ridge = self._ridge
        for _ in range(self.eb):
            theta, variance = self._fit_curves(prompts, cols, z[cols], ridge, self._curves[prompts])
            self._curves[prompts] = theta
            spread_a = float(np.mean(theta[:, 0] ** 2 + variance[:, 0]))
            spread_b = float(np.mean((theta[:, 1] - 1.0) ** 2 + variance[:, 1]))
            ridge = (min(1.0 / max(spread_a, 1e-12), RIDGE_MAX), min(1.0 / max(spread_b, 1e-12), RIDGE_MAX))
        self._ridge = ridge
        return ridge

    def _bon_value(self, prompts: np.ndarray) -> np.ndarray:
        """(C, len(prompts), N_max) expected best-of-N task value of each prompt's pooled outcomes.

        Every distinct outcome a prompt produced (over all its queries) is one atom of its pooled
        distribution, weighted by how often it came out.
        """
        atoms = self.env.table.atoms
        assert atoms is not None
        counts = self.atom_counts[prompts]
        row, q, a = np.nonzero(counts)
        weight = counts[row, q, a].astype(np.float64)
        sizes = np.bincount(row, minlength=prompts.size)
        width = int(sizes.max())
        slot = np.arange(row.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        probs = np.zeros((prompts.size, width))
        probs[row, slot] = weight
        probs /= probs.sum(axis=1, keepdims=True)
        vectors = atoms[prompts[row], q, a]  # (entries, K)
        offsets = self.query_offsets() if self.center else None
        out = np.empty((self._objectives.shape[0], prompts.size, self.n_max))
        for i, w in enumerate(self._objectives):
            value = vectors @ w if offsets is None else vectors @ w - offsets[i, q]
            scores = np.full((prompts.size, width), np.inf)
            scores[row, slot] = value
            scores = np.where(np.isinf(scores), scores.min(axis=1, keepdims=True), scores)  # padding: weight 0
            out[i] = bon_expected_max(scores, probs, self.n_max)
        result: np.ndarray = out[self._objective_row]
        return result

    def query_offsets(self) -> np.ndarray:
        """(objective rows, Q) each query's offset in the Best-of-N score, 0 where unseen (and everywhere
        without ``center``, whose updates alone keep the sums it reads): the least-squares fit of every
        seen (prompt, query) mean score to prompt level + query offset, weighted by the completions behind it
        (``OFFSET_SWEEPS`` alternating sweeps from zero offsets; exact in one sweep when every prompt saw the
        same queries equally often), the offsets centred to mean 0 over the seen queries."""
        n = self._completions  # (P, Q)
        score_sum = np.einsum("pqk,wk->wpq", self._reward_sum, self._objectives)  # (W, P, Q) summed scores
        seen_q = n.sum(axis=0) > 0
        per_prompt = np.maximum(n.sum(axis=1), 1.0)  # (P,)
        per_query = np.maximum(n.sum(axis=0), 1.0)  # (Q,)
        offsets = np.zeros((self._objectives.shape[0], n.shape[1]))
        for _ in range(OFFSET_SWEEPS):
            level = (score_sum - n * offsets[:, None, :]).sum(axis=2) / per_prompt  # (W, P)
            offsets = (score_sum - n * level[:, :, None]).sum(axis=1) / per_query
            offsets[:, ~seen_q] = 0.0
            if seen_q.any():
                offsets[:, seen_q] -= offsets[:, seen_q].mean(axis=1, keepdims=True)
        return offsets


#: Alternating least-squares sweeps of ``PlugInEstimator.query_offsets``.
OFFSET_SWEEPS = 8


def keep_top(alive: np.ndarray, est: Estimator, target: int | np.ndarray, rng: np.random.Generator) -> None:
    """Keep, in place, the top ``target`` (one count, or one per context) of each context's live prompts
    in ``alive`` (C, P) by max_N of ``est``'s estimate, ties broken at random by ``rng``."""
    n_contexts, n_prompts = alive.shape
    score = np.where(alive, est.mean(unseen=-np.inf).max(axis=2), -np.inf)
    order = np.lexsort((rng.random(alive.shape), -score), axis=-1)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(n_prompts)[None, :].repeat(n_contexts, 0), axis=1)
    alive &= rank < np.broadcast_to(target, (n_contexts,))[:, None]


class PlugInHalving(Agent):
    """Successive halving over prompts on common queries, read through ``PlugInEstimator``.

    floor(log2 (P / keep_last)) trimming rounds and a last one; round r spends floor(remaining /
    rounds left) completions: every prompt live in some context gets the same ``m`` new train
    queries (without replacement), n completions each, n = min(N_max, floor(b / (m_min * live)))
    and m = floor(b / (n * live)). After each round but the last, each context keeps the top
    max(keep_last, floor(|L_c| / 2)) of its live prompts by max_N of the estimate; the policy
    takes, per context, the best (p, N) of its survivors. ``common=False`` (an ablation) lets
    the env draw every pull's query independently instead.
    """


    def __init__(self, seed: int | None = None, m_min: int = 8, alpha: float = 4.0, keep_last: int = 1,
                 common: bool = True) -> None:
        """``m_min`` queries per live prompt and round at least; ``alpha`` the estimator's smoothing."""
        super().__init__(seed)
        if isinstance(m_min, bool) or not isinstance(m_min, (int, np.integer)) or m_min < 1:
            raise ValueError(f"m_min must be an integer >= 1, got {m_min!r}")
        if isinstance(keep_last, bool) or not isinstance(keep_last, (int, np.integer)) or keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        self.m_min = int(m_min)
        self.alpha = float(alpha)
        _plugin_jit.warm_up()
        self.keep_last = int(keep_last)
        self.common = bool(common)

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"m_min": self.m_min, "alpha": self.alpha, "keep_last": self.keep_last, "common": self.common}

    def train(self, env: Any, budget: int) -> Policy:
        """Spend at most ``budget`` completions of ``env``; the best surviving arm per context."""
        base = self.base_env(env)
        budget = self.check_budget(budget)
        est = PlugInEstimator(base, self.alpha)
        stream = QueryStream(base.queries(), self.rng)
        n_contexts, n_prompts, n_max = est.sums.shape
        alive = np.ones((n_contexts, n_prompts), dtype=bool)
        rounds_total = rounds_to_one(max(1, n_prompts // self.keep_last)) + 1  # the trims, then a last round
        spent = 0
        for r in range(rounds_total):
            live = np.flatnonzero(alive.any(axis=0))
            b = (budget - spent) // (rounds_total - r)
            if b < live.size:
                break
            n = int(min(n_max, max(1, b // (live.size * self.m_min))))
            m = b // (live.size * n)
            queries = np.tile(stream.take(m), live.size) if self.common else None
            pulls = base.pull(np.repeat(live, m), np.full(live.size * m, n), queries=queries)
            spent += pulls.completions
            est.update(pulls)
            if r < rounds_total - 1:
                keep_top(alive, est, np.maximum(self.keep_last, alive.sum(axis=1) // 2), self.rng)
        return est.best_arms(self.rng, np.repeat(alive[:, :, None], n_max, axis=2))


class _PlugInRun:
    """The state of one anytime plug-in trajectory: estimator, query stream, live prompts, spend."""

    def __init__(self, base: Any, est: PlugInEstimator, rng: np.random.Generator) -> None:
        self.base = base
        self.est = est
        self.stream = QueryStream(base.queries(), rng)
        n_contexts, n_prompts, _ = self.est.sums.shape
        self.alive = np.ones((n_contexts, n_prompts), dtype=bool)
        self.spent = 0

    def branch(self) -> _PlugInRun:
        """A copy to run a budget's tail on: its own estimator, stream and generator (a copy of the
        agent's, so the tail never advances the agent's own); the same env."""
        memo = {id(self.base): self.base, id(self.est.env): self.est.env}
        return copy.deepcopy(self, memo)


class AnytimePlugIn(Agent):
    """Plug-in elimination over prompts on common queries, paced by the completions spent (anytime).

    A trajectory of steps that do not depend on the budget T: the first spends s0 = P * q0 *
    n_min completions, each later one ``growth`` times what was spent before it (at least one
    completion per live prompt). A step of b completions gives every prompt live in some
    context the same m train queries (without replacement; a fresh shuffle once the split is
    used up), n completions each: n = min(N_max, max(n_min, ceil(sqrt(b / (live * kappa))),
    ceil(b / (live * |train|)), ceil(votes / live))) (kappa = 0 drops the square-root term; the
    last term keeps ``votes`` completions per query over the live prompts, so a query's
    difficulty stays measured when few are live), m = floor(b / (live * n));
    it is read through ``PlugInEstimator`` (majority vote: with the prompts' response curves over
    query difficulty, ``curve``, as the prior of ``alpha`` pseudo-votes). After each step, with
    s completions spent in all, each context keeps the top max(keep_last, ceil(P (s0 / s)^rate))
    of its live prompts by max_N of the estimate.
    A budget T stops the steps where the next one no longer fits in (1 - ``reserve``) T (default:
    all of T); what is left (the budget's
    tail; in ``train_budgets`` on a branch of the trajectory) goes into one last step by the same rule
    (``tail="step"``) or into successive halving of the live prompts (``tail="halving"``: the
    rounds of ``PlugInHalving`` on what is left, each context halving its own live set;
    ``tail="halving_trim"``: the same trims without the last round on the survivors, so what
    that round would spend goes to the rounds that still choose between prompts), and
    the policy is, per context, the best (p, N) of its live prompts. So ``train_budgets`` reads
    every budget off one trajectory. By default (majority vote) a quarter of each tail round's
    common queries are seen queries taken again, those where the live prompts' expected credits
    differ most while they are unsure (``revisit_by="disagree"``); on Best-of-N each outcome's
    score is read relative to its query's fitted offset (``center``), so the pooled distribution
    keeps the spread within queries that a per-query maximum sees and not the spread between them.
    """

    anytime = True

    def __init__(self, seed: int | None = None, n_min: int = 2, q0: int = 8, growth: float = 1.0,
                 rate: float = 0.5, alpha: float = 32.0, keep_last: int = 1, kappa: float = 12.0,
                 curve: float = 3.0, tail: str = "halving_trim", votes: int = 0, slope: float | None = 1.0,
                 eb: int = 0, pretest: float = 2.0, reserve: float = 0.0, tail_growth: float = 1.0,
                 zprior: float = 0.0, revisit: float = 0.25, revisit_in: str = "tail",
                 revisit_by: str = "disagree", center: bool = True) -> None:
        """``n_min``, ``kappa``, ``votes``: completions per (prompt, query); ``q0``, ``growth``, ``rate``: the pace;
        ``alpha``, ``curve``, ``slope``, ``eb``, ``pretest``, ``zprior``: the estimator's prior; ``center``: its
        Best-of-N scores read relative to their query's offset (``PlugInEstimator``); ``tail``: how a
        budget spends what the whole steps leave ("step" or "halving"); ``reserve``: the least share of a budget its tail gets;
        ``tail_growth``: each halving round's share over the one before; ``revisit``: the share of a
        step's common queries taken again from those every live prompt has seen (majority vote),
        in every step (``revisit_in="all"``) or only in a budget's tail (``"tail"``), ranked by
        ``revisit_by``: "close" (the sum of the live prompts' c (1 - c)) or "disagree"
        (``PlugInEstimator.disagreements``) (defaults: chosen on tuning seeds, docs/agents.md)."""
        super().__init__(seed)
        for key, value in (("n_min", n_min), ("q0", q0), ("keep_last", keep_last)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        if not float(growth) > 0.0:
            raise ValueError(f"growth must be > 0, got {growth!r}")
        if not float(rate) >= 0.0:
            raise ValueError(f"rate must be >= 0, got {rate!r}")
        if not float(alpha) >= 0.0:
            raise ValueError(f"alpha must be >= 0, got {alpha!r}")
        self.n_min, self.q0, self.keep_last = int(n_min), int(q0), int(keep_last)
        self.growth, self.rate, self.alpha = float(growth), float(rate), float(alpha)
        if not float(kappa) >= 0.0:
            raise ValueError(f"kappa must be >= 0, got {kappa!r}")
        self.kappa = float(kappa)
        self.curve, self.slope, self.eb, self.pretest, self.zprior = check_curve_prior(curve, slope, eb, pretest,
                                                                                     zprior)
        if tail not in ("step", "halving", "halving_trim"):
            raise ValueError(f"tail must be 'step', 'halving' or 'halving_trim', got {tail!r}")
        self.tail = tail
        if isinstance(votes, bool) or not isinstance(votes, (int, np.integer)) or votes < 0:
            raise ValueError(f"votes must be an integer >= 0, got {votes!r}")
        self.votes = int(votes)
        if not 0.0 <= float(reserve) < 1.0:
            raise ValueError(f"reserve must be in [0, 1), got {reserve!r}")
        if not float(tail_growth) > 0.0:
            raise ValueError(f"tail_growth must be > 0, got {tail_growth!r}")
        self.reserve, self.tail_growth = float(reserve), float(tail_growth)
        if not 0.0 <= float(revisit) < 1.0:
            raise ValueError(f"revisit must be in [0, 1), got {revisit!r}")
        self.revisit = float(revisit)
        if revisit_in not in ("all", "tail"):
            raise ValueError(f"revisit_in must be 'all' or 'tail', got {revisit_in!r}")
        self.revisit_in = revisit_in
        if revisit_by not in ("close", "disagree"):
            raise ValueError(f"revisit_by must be 'close' or 'disagree', got {revisit_by!r}")
        self.revisit_by = revisit_by
        self.center = check_center(center)
        _plugin_jit.warm_up()

    def params(self) -> dict[str, Any]:
        """Hyper-parameters recorded with results."""
        return {"n_min": self.n_min, "q0": self.q0, "growth": self.growth, "rate": self.rate,
                "alpha": self.alpha, "keep_last": self.keep_last, "kappa": self.kappa,
                "curve": self.curve, "tail": self.tail, "votes": self.votes, "slope": self.slope,
                "eb": self.eb, "pretest": self.pretest, "reserve": self.reserve,
                "tail_growth": self.tail_growth, "zprior": self.zprior, "revisit": self.revisit,
                "revisit_in": self.revisit_in, "revisit_by": self.revisit_by, "center": self.center}

    def train(self, env: Any, budget: int) -> Policy:
        """Spend at most ``budget`` completions of ``env``; the best live arm per context.

        The tail runs on the trajectory itself (no branch to copy: nothing follows it), so the
        policy is ``train_budgets``' for this budget.
        """
        budget = self.check_budget(budget)
        run = self._new_run(self.base_env(env))
        self._advance(run, budget)
        return self._finish(run, budget)

    def train_budgets(self, env: Any, budgets: Any) -> Iterator[tuple[int, Policy]]:
        """(budget, policy) for each budget in increasing order, from one trajectory.

        Each policy is bit-identical to ``train(env, budget)`` by a fresh agent with the same
        seed on an env reset with the same seed: the whole steps are the same for every
        budget; each budget's last step and read-out branch off on a copy of the trajectory (with
        its own copy of the agent's generator; the env's state is saved and restored around it).
        """
        checked = sorted({self.check_budget(b) for b in budgets})
        base = self.base_env(env)
        run = self._new_run(base)
        for i, budget in enumerate(checked):
            self._advance(run, budget)
            last = i == len(checked) - 1
            env_state = None if last else base.snapshot()
            policy = self._finish(run.branch(), budget)
            yield budget, policy
            if env_state is not None:
                base.restore(env_state)

    def _new_run(self, base: Any) -> _PlugInRun:
        """A fresh trajectory on ``base``: an empty estimator with the agent's prior, the agent's generator."""
        return _PlugInRun(base, PlugInEstimator(base, self.alpha, self.curve, self.slope, self.eb,
                                                   self.pretest, self.zprior, self.center), self.rng)

    def _s0(self, run: _PlugInRun) -> int:
        return run.alive.shape[1] * self.q0 * self.n_min

    def _next_step(self, run: _PlugInRun) -> int:
        """Completions of the trajectory's next whole step."""
        live = int(run.alive.any(axis=0).sum())
        if run.spent == 0:
            return self._s0(run)
        return max(self.n_min * live, math.ceil(self.growth * run.spent))

    def _advance(self, run: _PlugInRun, budget: int) -> None:
        """Take whole steps while the next one fits in ``budget`` less its tail's reserve."""
        n_prompts = run.alive.shape[1]
        s0 = self._s0(run)
        steps_end = math.floor((1.0 - self.reserve) * budget)
        while (step := self._next_step(run)) <= steps_end - run.spent:
            self._pull(run, step)
            if run.spent > s0:
                target = max(self.keep_last, math.ceil(n_prompts * (s0 / run.spent) ** self.rate))
                self._trim(run, target)
            elif run.spent == s0 and self.rate > 0:
                self._trim(run, n_prompts)

    def _pull(self, run: _PlugInRun, b: int, tail: bool = False) -> None:
        """One step of at most ``b`` completions on common queries (nothing if not one per live prompt);
        ``tail``: a step of a budget's tail (where ``revisit_in="tail"`` takes queries again)."""
        live = np.flatnonzero(run.alive.any(axis=0))
        if not live.size or b < live.size:
            return
        n_max = run.est.sums.shape[2]
        pool = run.stream.pool.size
        n = max(self.n_min, math.ceil(b / (live.size * pool)))
        if self.kappa > 0:
            n = max(n, math.ceil(math.sqrt(b / (live.size * self.kappa))))
        n = min(n_max, max(n, math.ceil(self.votes / live.size)))
        m = b // (live.size * n)
        if m == 0:
            n, m = b // live.size, 1
        again = self._revisits(run, live, m) if tail or self.revisit_in == "all" else np.zeros(0, np.int64)
        common = np.concatenate([again, run.stream.take(m - again.size)])
        queries = np.tile(common, live.size)
        pulls = run.base.pull(np.repeat(live, m), np.full(live.size * m, n), queries=queries)
        run.spent += pulls.completions
        run.est.update(pulls)

    def _revisits(self, run: _PlugInRun, live: np.ndarray, m: int) -> np.ndarray:
        """The ``revisit`` share of ``m`` common queries taken again: of the queries every live prompt
        has seen, the top by ``revisit_by``'s score at the contexts' best N (majority vote with the
        response-curve prior only; none otherwise)."""
        est = run.est
        count = math.floor(self.revisit * m)
        if count == 0 or est.aggregator != "mv" or est.curve <= 0:
            return np.zeros(0, dtype=np.int64)
        pool = run.stream.pool
        seen = pool[est._seen[np.ix_(live, pool)].all(axis=0)]
        if not seen.size:
            return np.zeros(0, dtype=np.int64)
        means = np.where(run.alive[:, :, None], est.mean(unseen=-np.inf), -np.inf)
        scales = np.unique(means.reshape(means.shape[0], -1).argmax(axis=1) % means.shape[2]) + 1
        score = (est.close_calls if self.revisit_by == "close" else est.disagreements)(live, seen, scales)
        return seen[np.argsort(-score, kind="stable")[:count]]

    def _trim(self, run: _PlugInRun, target: int | np.ndarray) -> None:
        """Keep the top ``target`` (one count, or one per context) live prompts of each context by max_N of the estimate."""
        keep_top(run.alive, run.est, target, run.stream.rng)

    def _halve(self, run: _PlugInRun, budget: int) -> None:
        """Successive halving of each context's live prompts on what is left of ``budget``.

        K = floor(log2(largest live set / keep_last)) trims; K + 1 rounds (``tail="halving"``: the
        last on the survivors) or max(1, K) (``"halving_trim"``: the last ends with the last trim);
        round r spends floor(left * g^r / sum of g^j over the rounds left), g = ``tail_growth`` (1:
        equal shares), by the step rule; after each of the first K rounds
        every context keeps the top max(keep_last, floor(|L_c| / 2)) of its live prompts. Stops
        early if a round cannot give one completion to every live prompt.
        """
        trims = rounds_to_one(max(1, int(run.alive.sum(axis=1).max()) // self.keep_last))
        rounds = max(1, trims) if self.tail == "halving_trim" else trims + 1
        weights = self.tail_growth ** np.arange(rounds)
        for r in range(rounds):
            b = math.floor((budget - run.spent) * weights[r] / weights[r:].sum())
            if b < int(run.alive.any(axis=0).sum()):
                break
            self._pull(run, b, tail=True)
            if r < trims:
                self._trim(run, np.maximum(self.keep_last, run.alive.sum(axis=1) // 2))

    def _finish(self, run: _PlugInRun, budget: int) -> Policy:
        """The budget's tail (one last step, or halving) with what is left of ``budget``, then the read-out."""
        if self.tail in ("halving", "halving_trim"):
            self._halve(run, budget)
        else:
            self._pull(run, budget - run.spent, tail=True)
        n_max = run.est.sums.shape[2]
        return run.est.best_arms(run.stream.rng, np.repeat(run.alive[:, :, None], n_max, axis=2))
