"""What the plug-in agents share: train queries drawn without replacement, trimming to the top prompts, and the
correction of both aggregators' readings by their unbiased ones."""

from __future__ import annotations

from typing import Any

import numpy as np

#: A prompt's correction at N, the mean over its s queries of their unbiased reading less the prior-read one, both at
#: m = min(N, the query's draws), weighs lam = s / (s + CORRECTION_QUERIES), in Best-of-N and in majority vote alike.
#: Chosen on the generated tuning levels (research/README.md): a correction read from few queries is noisy, one from
#: hundreds is not.
CORRECTION_QUERIES = 256.0


def held_index(draws: np.ndarray, n_max: int) -> np.ndarray:
    """(..., n_max) the index of m = min(N, n) for N = 1..n_max and each count ``draws`` n (..., at least 1): where a
    (prompt, query)'s readings are taken beyond its draws."""
    return np.minimum(np.arange(n_max), np.asarray(draws, dtype=np.int64)[..., None] - 1)


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


def keep_top(alive: np.ndarray, est: Any, target: int | np.ndarray, rng: np.random.Generator) -> None:
    """Keep, in place, the top ``target`` (one count, or one per context) of each context's live prompts
    in ``alive`` (C, P) by max_N of ``est.mean``, ties broken at random by ``rng``."""
    n_contexts, n_prompts = alive.shape
    score = np.where(alive, est.mean(unseen=-np.inf).max(axis=2), -np.inf)
    order = np.lexsort((rng.random(alive.shape), -score), axis=-1)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(n_prompts)[None, :].repeat(n_contexts, 0), axis=1)
    alive &= rank < np.broadcast_to(target, (n_contexts,))[:, None]
