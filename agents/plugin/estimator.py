"""``PlugInEstimator``: Q(c, p, N) for every N read off per-(prompt, query) outcome distributions.

The oracle's exact formulas (``mv_expected_credit``, ``bon_expected_max``) are applied to smoothed
empirical distributions, one per (prompt, query) the agent pulled. A few completions per (prompt,
query) say little, so each is read together with a prior that shares what the other queries and
prompts show; the prior's weight falls as the (prompt, query)'s own completions grow, so on a
finite train split every estimate converges to the train-split Q as the budget grows
(docs/agents.md, "auto", item 2, states every formula).

One module per concept, as the class combines them:

* ``majority_vote.MajorityVoteReadings``: per (prompt, query), its votes plus the prior's pseudo-votes
  (the response curve or the pooled answers, weighed by ``prior_votes``), through the exact credit;
* ``best_of_n.BestOfNReadings``: each query's own expected max of N shrunk towards the location-scale
  reading (``location_scale.LocationScaleFit``), corrected by the unbiased reading, on a reference's queries;
* the compiled kernels (numba, a dependency): ``_vote_kernels`` (credit, curve fits), ``_max_kernels``
  (expected maxima, subset means, binned pools), ``_scale_kernels`` (residuals, clipped readings). Each sums in
  a fixed order; the few matrix products left in numpy run on one BLAS thread (``one_blas_thread``), so an
  estimate does not depend on the machine's thread count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from agents._vote_credit import credit_rows
from agents.estimator import Estimator
from agents.plugin._logit_kernels import threshold_fit, threshold_readings
from agents.plugin._max_kernels import binned_expected_max, expected_max_rows, segment_readings
from agents.plugin._scale_kernels import clipped_readings, location_scale_readings, over_spread, residual_sums, standardize
from agents.plugin._vote_kernels import fit_curves
from agents.plugin.best_of_n import BON_READINGS, BestOfNReadings, check_bon_reading, score_range
from agents.plugin.majority_vote import MajorityVoteReadings
from agents.scoring import mv_subset_credit
from iapo_gym import Policy, Pulls


def check_nonnegative(**values: Any) -> tuple[float, ...]:
    """The values as floats, in order; one below 0 (or not a number) raises ValueError naming it."""
    out = []
    for key, value in values.items():
        if isinstance(value, bool) or not float(value) >= 0.0:
            raise ValueError(f"{key} must be a number >= 0, got {value!r}")
        out.append(float(value))
    return tuple(out)


@cache
def _blas() -> ThreadpoolController:
    """The process's BLAS thread pools (read once: loading a library later is not expected in a run)."""
    return ThreadpoolController()


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run the block with every BLAS pool on one thread: a threaded BLAS may split a matrix product's sums by the
    thread count, so the estimator's few numpy matrix products (the query offsets, the spread fit, the objective
    scores) would otherwise round by the machine's cores."""
    with _blas().limit(limits=1, user_api="blas"):
        yield


_warm = False


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels once per process, so no training run pays for it."""
    global _warm
    if _warm:
        return
    credit_rows(np.array([0.5]), np.array([[0.3, 0.2]]), np.array([2]), 2)
    expected_max_rows(np.array([[0.0, 1.0]]), np.array([[1.0, 1.0]]), 2)  # ``presorted`` is a run-time flag
    segment_readings(np.array([[[0.0, 1.0]]]), np.array([[1.0, 1.0]]), 2, np.ones((1, 2)), np.array([0, 1]))
    binned_expected_max(np.array([[0.0, 1.0]]), np.ones(2), np.zeros(1, np.int64), np.full(1, 2), 2, 2)
    index, one = np.zeros(1, np.int64), np.ones((1, 1))
    residual_sums(one, one, one, index, index, np.ones(1), 1, 1)
    standardize(np.ones((1, 1)), one, index)
    over_spread(one, one, index, index)
    cube = np.ones((1, 1, 1))
    clipped_readings(one, one, one, cube, one, cube, cube[None], one[None], np.ones((1, 1), np.int64),
                     np.ones((1, 1), dtype=bool), np.zeros(1), np.ones(1), np.ones((1, 1, 1, 1)), np.ones(1))
    location_scale_readings(cube, one, cube, one, one, one, np.zeros(1), np.ones(1))
    fit = threshold_fit(np.array([[0.0, 1.0]]), np.ones(2), np.zeros(2, np.int64), index, index, 1, 1, 1, 1, 1.0, 1.0, 1.0,
                        0.0)
    threshold_readings(fit, index, index, np.ones((1, 1), dtype=bool), 2)
    fit_curves(np.ones((1, 2)), np.full((1, 2), 2.0), np.array([-1.0, 1.0]), (1.0, 1.0), np.array([[0.0, 1.0]]), 1.0,
               2, 2)
    _warm = True


class PlugInEstimator(MajorityVoteReadings, BestOfNReadings):
    """Q(c, p, N) of every context, prompt and N, recomputed for the pulled prompts at each ``update``.

    The estimates live in an ``Estimator`` (``self.table``: its sums hold them, its counts mark the
    prompts read), so ``mean`` and ``best_arms`` are the shared estimator's.
    """

    def __init__(self, env: Any, alpha: float = 32.0, curve: float = 3.0, slope: float = 1.0,
                 pretest: float = 2.0, bon_prior: float = 1.0, empirical_bayes: bool = True,
                 bon_reading: str = BON_READINGS[0], mv_correction: bool = True) -> None:
        """Bind to ``env``; the prior's strength (see the module docstring): ``alpha`` the majority-vote
        prior's pseudo-votes (at most, with ``empirical_bayes``; else exactly), ``curve`` and ``slope`` the
        response curves' ridges, ``pretest`` the sparse-slope test, ``bon_prior`` the pooled Best-of-N
        reading's weight in completions per N, ``bon_reading`` which pooled Best-of-N reading (``BON_READINGS``),
        ``mv_correction`` whether majority vote's credit takes the unbiased reading's correction (``_corrected_credit``;
        the online agent's estimator, fed one request's votes at a time, reads without it: docs/online.md)."""
        self.alpha, self.curve, self.slope, self.pretest, self.bon_prior = check_nonnegative(
            alpha=alpha, curve=curve, slope=slope, pretest=pretest, bon_prior=bon_prior)
        self.bon_reading = check_bon_reading(bon_reading)
        self.empirical_bayes = bool(empirical_bayes)
        if not isinstance(mv_correction, bool):
            raise ValueError(f"mv_correction must be True or False, got {mv_correction!r}")
        self.mv_correction = mv_correction
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
            # per (p, q) the mean credit over every m-subset of its votes, m = 1..min(N_max, its votes); none is read
            # without the correction
            shape = (self.n_prompts, table.n_queries, self.n_max) if self.mv_correction else (0, 0, 0)
            self._unbiased = np.zeros(shape)
            # per (p, q) the smoothed answer distribution its credit was last read from (the stopping rules read it)
            self._probs = np.zeros((self.n_prompts, table.n_queries, table.n_atoms))
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
            #: (W,) per objective row the threshold-logit reading's weight in the last Best-of-N reading (0 with the
            #: location-scale reading alone)
            self.blend_weight = np.zeros(n_rows)

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
        with one_blas_thread():
            self._update(pulls)

    def _update(self, pulls: Pulls) -> None:
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
            if self.mv_correction:
                pairs = np.unique(pulls.prompts * self._votes.shape[1] + pulls.queries)
                pp, qq = np.divmod(pairs, self._votes.shape[1])
                self._unbiased[pp, qq] = mv_subset_credit(self.atom_counts[pp, qq], gold[qq], self.n_max)
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

    # ---- for reports ------------------------------------------------------------------
    def draws(self, prompts: np.ndarray) -> np.ndarray:
        """(len(prompts), Q) the completions of each prompt on each query so far."""
        return self.atom_counts[prompts].sum(axis=2)

    def estimate(self, prompts: np.ndarray) -> np.ndarray:
        """(C, len(prompts), N_max) the prompts' Best-of-N estimates recomputed now from every completion so far, the
        cost term included: what ``update`` would store for them if they were pulled again with nothing new.
        ``mean`` holds each prompt's estimate from its own last update, which the fits over every prompt (the query
        offsets, the pooled shapes, the reference) have moved since. Best-of-N only (a majority-vote estimate
        cannot be recomputed without refitting the response curves, which moves their warm starts)."""
        if self.aggregator != "bon":
            raise ValueError(f"estimate() reads Best-of-N estimates; this table's aggregator is {self.aggregator!r}")
        prompts = np.asarray(prompts, dtype=np.int64)
        with one_blas_thread():
            return self._bon_value(prompts) + self._cost_term(prompts)

    @contextmanager
    def read_together(self, prompts: np.ndarray) -> Iterator[None]:
        """Within it, ``mean`` of the pulled ``prompts`` is their Best-of-N estimate recomputed together now
        (``estimate``), the pooled correction taken over them alone; their stored estimates are back after. A
        read-out compares its candidates under one fit, not each as of its last update (a trim after the last pull
        leaves the survivors' stored values pooled with the trimmed prompts' gaps)."""
        prompts = np.unique(np.asarray(prompts, dtype=np.int64))
        prompts = prompts[self.table.counts[0, prompts, 0] > 0]
        stored = self.table.sums[:, prompts, :].copy()
        if prompts.size:
            self.table.sums[:, prompts, :] = self.estimate(prompts)
        try:
            yield
        finally:
            self.table.sums[:, prompts, :] = stored

    def _cost_term(self, prompts: np.ndarray) -> np.ndarray:
        """(C, len(prompts), N_max) each context's cost weight x N x the prompt's mean cost over its seen queries."""
        n_queries = self._seen[prompts].sum(axis=1).astype(np.float64)
        scale = np.arange(1, self.n_max + 1, dtype=np.float64)
        cost: np.ndarray = self._weights[:, -1:, None] * (self._cost_sum[prompts] / n_queries)[None, :, None] * scale
        return cost

    # ---- majority vote ----------------------------------------------------------------
