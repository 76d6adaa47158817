"""Per-context UCB over the arms (p, N) of the online protocol, with cross-context and nested reuse.

Every pull's N outcomes give a utility under every context (cross-context reuse), and its first k completions
are a sample of N = k for every grid value k <= N (nested reuse), so one pull updates the statistics of
C x (grid values <= N) arms. A context's arm is the available (p, N) of highest upper confidence bound
``mean + c * sqrt(log(n_total) / n_arm)``; arms never pulled come first (optimistic entry, also for prompts
that arrive during the run). With ``discount`` < 1 the statistics fade by that factor per request, so the
agent keeps exploring after a drift.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from iapo_gym.online import OnlineAgentBase, OnlineEnv, Requests, Served
from iapo_gym.utility import block_utilities

N_GRIDS = ("pow2", "all")
_UNSEEN = 1e6  # the index of an arm never pulled (above any utility), less its choices in the current batch


class ContextUCB(OnlineAgentBase):
    """UCB per context over (prompt, N on a grid), sharing pulls across contexts and nested N.

    :param c: exploration weight of the confidence width (utility units).
    :param discount: factor the counts and sums fade by per request (1: no fading; < 1 tracks drift).
    :param n_grid: ``"pow2"`` (N = 1, 2, 4, ..., and N_max) or ``"all"`` (every N).
    :param nested: also count each pull's first k completions as a pull of N = k (k on the grid, k < N).
    """

    def __init__(self, seed: int | None = None, c: float = 0.05, discount: float = 1.0, n_grid: str = "pow2",
                 nested: bool = True) -> None:
        """Hyper-parameters as documented on the class; ``seed`` for ties."""
        super().__init__(seed)
        if not c >= 0.0:
            raise ValueError(f"c must be >= 0, got {c!r}")
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {discount!r}")
        if n_grid not in N_GRIDS:
            raise ValueError(f"n_grid must be one of {N_GRIDS}, got {n_grid!r}")
        self.c, self.discount, self.n_grid, self.nested = float(c), float(discount), n_grid, bool(nested)

    def params(self) -> dict[str, Any]:
        """The hyper-parameters."""
        return {"c": self.c, "discount": self.discount, "n_grid": self.n_grid, "nested": self.nested}

    def start(self, env: OnlineEnv, seed: int) -> None:
        """Empty statistics over the env's contexts, prompts and N grid."""
        super().start(env, seed)
        self.schema = env.schema
        n_max = self.schema.n_max
        if self.n_grid == "all":
            grid = np.arange(1, n_max + 1)
        else:
            grid = np.unique(np.append(2 ** np.arange(int(np.log2(n_max)) + 1), n_max))
        self.grid = grid.astype(np.int64)
        shape = (self.schema.n_prompts, grid.size)
        self.sums = np.zeros((self.schema.n_contexts, *shape))
        self.counts = np.zeros(shape)
        self.total = 0.0
        self._tie = self.rng.random(shape) * 1e-9  # a fixed random order among equal indices

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        """The arm of highest upper bound for each request, in arrival order.

        Within a batch each choice counts as a pull already made (its mean unchanged, its count one higher), so
        the requests of one batch spread over the arms as sequential choices would, without their outcomes.
        """
        counts = self.counts.copy()
        total = self.total
        blocked = ~requests.available
        prompts = np.empty(len(requests), dtype=np.int64)
        ns = np.empty(len(requests), dtype=np.int64)
        real = self.counts > 0
        means = self.sums / np.where(real, self.counts, 1.0)[None]
        for i, c in enumerate(requests.contexts.tolist()):
            index = np.where(real, means[c] + self._bonus(counts, total), _UNSEEN - counts) + self._tie
            index[blocked] = -np.inf
            flat = int(index.argmax())
            p, g = divmod(flat, self.grid.size)
            prompts[i], ns[i] = p, self.grid[g]
            counts[p, g] += 1.0
            total += 1.0
        return prompts, ns

    def _bonus(self, counts: np.ndarray, total: float) -> np.ndarray:
        """What is added to each arm's mean before the argmax: UCB's confidence width (``counts`` > 0 where used)."""
        return self.c * np.sqrt(np.log(max(total, 2.0)) / np.maximum(counts, 1e-12))

    def update_batch(self, requests: Requests, served: Served) -> None:
        """Fade the statistics by ``discount`` per request, then add the batch's pulls (nested and cross-context)."""
        b = len(requests)
        if self.discount < 1.0:
            fade = self.discount ** b
            self.sums *= fade
            self.counts *= fade
            self.total *= fade
        pulls = served.pulls
        slot = np.searchsorted(self.grid, pulls.ns)
        exact = slot < self.grid.size
        exact[exact] &= self.grid[slot[exact]] == pulls.ns[exact]
        prompts, slots, utilities = [pulls.prompts[exact]], [slot[exact]], [served.utilities[:, exact]]
        if self.nested:
            for g, k in enumerate(self.grid):
                idx = np.flatnonzero(pulls.ns > k)
                if idx.size == 0:
                    break
                blocks = pulls.atoms[pulls.offsets[idx][:, None] + np.arange(k)[None, :]]
                prompts.append(pulls.prompts[idx])
                slots.append(np.full(idx.size, g))
                utilities.append(block_utilities(self.schema, pulls.prompts[idx], pulls.queries[idx], blocks))
        self._add(np.concatenate(prompts), np.concatenate(slots), np.concatenate(utilities, axis=1))

    def _add(self, prompts: np.ndarray, slots: np.ndarray, utilities: np.ndarray) -> None:
        if prompts.size == 0:
            return
        cells = prompts * self.grid.size + slots
        size = self.counts.size
        self.counts += np.bincount(cells, minlength=size).reshape(self.counts.shape)
        flat = (np.arange(utilities.shape[0])[:, None] * size + cells[None, :]).ravel()
        self.sums += np.bincount(flat, weights=utilities.ravel(), minlength=self.sums.size).reshape(self.sums.shape)
        self.total += prompts.size
