"""Agents that compare prompts on common queries (``plugin_halving``/``auto``, ``psst_cq``).

PSST draws an independent query for every pull, so two prompts' estimates differ by the
difficulty of the queries each happened to see as well as by their quality; on MATH and the
synthetic tasks query difficulty varies far more than prompt quality. Both agents here give
every live prompt the *same* train queries in a round, drawn without replacement (a fresh
shuffle once the split is used up), through the public ``env.pull(prompts, ns, queries=...)``:

* ``PlugInHalving`` (``plugin_halving``, the recommended ``auto``): successive halving over
  prompts, many common queries per round at a small N, and ``PlugInEstimator``, which reads
  Q(c, p, N) for every N from empirical outcome distributions through the oracle's exact
  formulas. It beats PSST and PSST+K4 at small budgets (docs/agents.md).
* ``CommonQueryPSST`` (``psst_cq``): PSST's rounds unchanged on common queries; a measured
  negative result kept for the record (docs/agents.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
      query shifts a prompt's outcome distribution only a little, and a few completions per
      query would make the maximum of many draws look far too small).
    """

    def __init__(self, env: Any, alpha: float = 4.0) -> None:
        """Bind to ``env``; ``alpha`` >= 0 pseudo-votes of the query prior (majority vote)."""
        super().__init__(env, "blocks")
        if not float(alpha) >= 0.0:
            raise ValueError(f"alpha must be >= 0, got {alpha!r}")
        self.alpha = float(alpha)
        table = self.env.table
        self.atom_counts = np.zeros((self.n_prompts, table.n_queries, self.n_atoms), dtype=np.int64)
        self._cost_sum = np.zeros((self.n_prompts,))  # sum over the prompt's pulled queries of cost[p, q]
        self._seen = np.zeros((self.n_prompts, table.n_queries), dtype=bool)
        if self.aggregator == "mv":
            self._credit = np.zeros((self.n_prompts, table.n_queries, self.n_max))  # per (p, q), cached
        else:
            self._objectives, row = np.unique(self._weights[:, :-1], axis=0, return_inverse=True)
            self._objective_row = row.reshape(-1)

    def reset(self) -> None:
        """Forget every sample."""
        super().reset()
        self.atom_counts[...] = 0
        self._cost_sum[...] = 0.0
        self._seen[...] = False
        if self.aggregator == "mv":
            self._credit[...] = 0.0

    def update(self, pulls: Pulls, *, scales: str | np.ndarray | None = None, arm_mask: np.ndarray | None = None,
               contexts: np.ndarray | None = None) -> None:
        """Add the pulls' completions and recompute every pulled prompt's estimates at every scale and context.

        ``scales``, ``arm_mask`` and ``contexts`` are accepted for the interface and ignored.
        """
        rep = np.repeat(np.arange(len(pulls)), pulls.ns)
        np.add.at(self.atom_counts, (pulls.prompts[rep], pulls.queries[rep], pulls.atoms), 1)
        fresh = ~self._seen[pulls.prompts, pulls.queries]
        pairs = np.unique(np.column_stack([pulls.prompts[fresh], pulls.queries[fresh]]), axis=0)
        self._seen[pairs[:, 0], pairs[:, 1]] = True
        self._cost_sum += np.bincount(pairs[:, 0], weights=self._cost[pairs[:, 0], pairs[:, 1]],
                                      minlength=self.n_prompts)
        prompts = np.unique(pulls.prompts)
        n_queries = self._seen[prompts].sum(axis=1).astype(np.float64)
        if self.aggregator == "mv":
            task = self._weights[:, :1, None] * self._mv_credit(np.unique(pulls.queries), prompts)[None]
        else:
            task = self._bon_value(prompts)
        scale = np.arange(1, self.n_max + 1, dtype=np.float64)
        cost = self._weights[:, -1:, None] * (self._cost_sum[prompts] / n_queries)[None, :, None] * scale
        self.counts[:, prompts, :] = n_queries[None, :, None]
        self.sums[:, prompts, :] = (task + cost) * n_queries[None, :, None]

    def _mv_credit(self, queries: np.ndarray, prompts: np.ndarray) -> np.ndarray:
        """(len(prompts), N_max) mean credit over each prompt's queries, refreshing the rows of ``queries``."""
        gold = self.env.table.gold
        assert gold is not None
        pooled = self.atom_counts[:, queries].sum(axis=0).astype(np.float64)  # (q, atoms) over all prompts
        prior = pooled / pooled.sum(axis=1, keepdims=True)
        p_idx, q_pos = np.nonzero(self._seen[:, queries])
        counts = self.atom_counts[p_idx, queries[q_pos]].astype(np.float64)
        probs = (counts + self.alpha * prior[q_pos]) / (counts.sum(axis=1, keepdims=True) + self.alpha)
        self._credit[p_idx, queries[q_pos]] = mv_expected_credit(probs, gold[queries[q_pos]], self.n_max)
        return self._credit[prompts].sum(axis=1) / self._seen[prompts].sum(axis=1)[:, None]

    def _bon_value(self, prompts: np.ndarray) -> np.ndarray:
        """(C, len(prompts), N_max) expected best-of-N task value of each prompt's pooled outcomes.

        Every distinct outcome a prompt produced (over all its queries) is one atom of its pooled
        distribution, weighted by how often it came out.
        """
        atoms = self.env.table.atoms
        assert atoms is not None
        row, q, a = np.nonzero(self.atom_counts[prompts])
        weight = self.atom_counts[prompts][row, q, a].astype(np.float64)
        sizes = np.bincount(row, minlength=prompts.size)
        width = int(sizes.max())
        slot = np.arange(row.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        probs = np.zeros((prompts.size, width))
        probs[row, slot] = weight
        probs /= probs.sum(axis=1, keepdims=True)
        vectors = atoms[prompts[row], q, a]  # (entries, K)
        out = np.empty((self._objectives.shape[0], prompts.size, self.n_max))
        for i, w in enumerate(self._objectives):
            value = vectors @ w
            scores = np.full((prompts.size, width), np.inf)
            scores[row, slot] = value
            scores = np.where(np.isinf(scores), scores.min(axis=1, keepdims=True), scores)  # padding: weight 0
            out[i] = bon_expected_max(scores, probs, self.n_max)
        result: np.ndarray = out[self._objective_row]
        return result


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
                score = np.where(alive, est.mean(unseen=-np.inf).max(axis=2), -np.inf)
                n_alive = alive.sum(axis=1)
                keep = np.maximum(self.keep_last, n_alive // 2)
                order = np.lexsort((self.rng.random(alive.shape), -score), axis=-1)
                rank = np.empty_like(order)
                np.put_along_axis(rank, order, np.arange(n_prompts)[None, :].repeat(n_contexts, 0), axis=1)
                alive &= rank < keep[:, None]
        return est.best_arms(self.rng, np.repeat(alive[:, :, None], n_max, axis=2))
