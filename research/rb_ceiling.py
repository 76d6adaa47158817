"""A measuring stick for all-subset reuse: PSST whose samples carry no completion noise at all.

``QueryOraclePSST`` is PSST unchanged except for how a pull is read: a pull of (p, N) on query
x counts, at every scale k <= N, as floor(N / k) samples of value R_x(p, k), the *exact*
expected aggregated utility of k completions given the query (read from the outcome table).
That is the limit of every estimator computed from a pull's completions, blocks and all
subsets alike, as the completions per query grow: its only noise is which queries were drawn.
All-subset reuse sits between the two (it is the conditional expectation of the blocks given
the pull's multiset; this is the conditional expectation given the query). Its variance is
the floor of every within-pull estimator's, so it measures how much of PSST's regret is
completion noise at all; it is not a bound on the regret itself (on Synthetic-Bernoulli it does
worse than blocks, docs/estimator.md). It peeks at the table: a diagnostic for benchmarks,
never an agent for the leaderboard's rankings.

Leaderboard spec (with ``benchmarks/`` on ``sys.path``, as ``bench_rb.py`` has it):
``rb_ceiling:QueryOraclePSST@psst_query_oracle``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agents.estimator import Estimator
from agents.psst import PSST
from iapo_gym import Pulls
from iapo_gym.exact import exact_reward


class QueryOracleEstimator(Estimator):
    """Block bookkeeping (floor(N / k) samples per pull and scale) with the exact R_x(p, k) as every sample's value."""

    def __init__(self, env: Any) -> None:
        """Bind to ``env`` and to its table's exact per-query expected task utilities."""
        super().__init__(env, reuse="blocks")
        table = self.env.table
        exact = exact_reward(table)
        self._exact = exact.reward  # (C', P, Q, N_max), kept on the table
        if table.aggregator == "mv":  # one row, scaled by each context's w_1
            self._row, self._scale = np.zeros(self.n_contexts, np.int64), self._weights[:, :1]
        else:  # one row per distinct objective weighting, weights included
            self._row, self._scale = exact.rows(self.n_contexts), np.ones((self.n_contexts, 1))

    def task_sums(self, pulls: Pulls, pull_idx: np.ndarray, ks: np.ndarray, n_blocks: np.ndarray) -> np.ndarray:
        """(C, pairs): n_blocks * R_x(p, k) for every context, whatever completions the pull drew."""
        prompts, queries = pulls.prompts[pull_idx], pulls.queries[pull_idx]
        exact = self._exact[self._row[:, None], prompts[None, :], queries[None, :], ks[None, :] - 1]
        return self._scale * exact * n_blocks[None, :]


class QueryOraclePSST(PSST):
    """PSST on ``QueryOracleEstimator``: the no-completion-noise ceiling of within-pull reuse."""

    name = "psst_query_oracle"

    def __init__(self, seed: int | None = None) -> None:
        """PSST with the paper's defaults (stockpiling, leftovers carried)."""
        super().__init__(seed)

    def params(self) -> dict[str, Any]:
        """No parameters: the estimator is fixed."""
        return {}

    def make_estimator(self, env: Any) -> Estimator:
        """The exact-per-query estimator."""
        return QueryOracleEstimator(env)
