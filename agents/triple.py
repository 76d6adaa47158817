"""Contextual TRIPLE-SH (Shi et al. 2024) over prompts only: the paper's prompt-only baselines.

Sequential halving over the P prompts of each context, with pulls shared across contexts
(each pull is scored under every context). The inference scale is not optimized:

* ``n_mode="one"``: every pull uses N = 1 and the returned policy deploys (p*, 1);
* ``n_mode="random"``: every pull draws N uniformly from 1..N_max (agent generator), the
  prompt's estimate is the mean utility over those pulls (Q averaged over a uniform N),
  and the returned policy deploys (p*, N_c) with N_c drawn uniformly per context.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from agents.base import Agent
from agents.estimator import Estimator
from agents.psst import LEFTOVER_MODES, round_budget, rounds_to_one, trim
from iapo_gym import Policy

N_MODES = ("one", "random")


class Triple(Agent):
    """Contextual TRIPLE-SH over prompts with N fixed to 1 or drawn uniformly per query."""


    def __init__(self, seed: int | None = None, n_mode: str = "one", leftover: str = "carry") -> None:
        """``n_mode``: "one" or "random"; ``leftover``: budget rule shared with PSST."""
        super().__init__(seed)
        if n_mode not in N_MODES:
            raise ValueError(f"n_mode must be one of {N_MODES}, got {n_mode!r}")
        if leftover not in LEFTOVER_MODES:
            raise ValueError(f"leftover must be one of {LEFTOVER_MODES}, got {leftover!r}")
        self.n_mode = n_mode
        self.leftover = leftover

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"n_mode": self.n_mode, "leftover": self.leftover}

    def _round_pulls(self, live: np.ndarray, b: int, n_max: int) -> tuple[np.ndarray, np.ndarray]:
        """Round-robin pulls over ``live`` prompts costing at most ``b`` completions."""
        if b <= 0 or live.size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if self.n_mode == "one":
            per = b // live.size
            if per == 0:
                chosen = np.sort(self.rng.choice(live, size=b, replace=False))
                return chosen, np.ones(b, np.int64)
            return np.repeat(live, per), np.ones(per * live.size, np.int64)
        cycles = b // (live.size * (n_max + 1) // 2) + 1
        prompts = np.tile(live, cycles)
        ns = self.rng.integers(1, n_max + 1, size=prompts.size)
        fits = np.cumsum(ns) <= b
        return prompts[fits], ns[fits]

    def train(self, env: Any, budget: int) -> Policy:
        """Halve the prompts of every context; deploy the survivor with N = 1 or a random N."""
        base = self.base_env(env)
        budget = self.check_budget(budget)
        est = Estimator(base, "blocks")
        n_c, n_p, n_max = base.n_contexts, base.n_prompts, base.n_max
        alive = np.ones((n_c, n_p), dtype=bool)
        rounds_total = max(1, math.ceil(math.log2(n_p)))
        spent = 0
        for r in range(rounds_total):
            n_alive = alive.sum(axis=1)
            if n_alive.max() <= 1:
                break
            needed = max(rounds_to_one(int(n)) for n in n_alive)
            b = round_budget(budget, spent, rounds_total, r, needed, self.leftover)
            prompts, ns = self._round_pulls(np.flatnonzero(alive.any(axis=0)), b, n_max)
            if prompts.size:
                pulls = base.pull(prompts, ns)
                spent += pulls.completions
                est.update(pulls, scales=np.array([1]) if self.n_mode == "one" else "own")
            alive = trim(alive, self._prompt_means(est), self.rng)
        means = np.where(alive, np.nan_to_num(self._prompt_means(est), nan=-np.inf), -np.inf)
        arms = []
        for c in range(n_c):
            pool = alive[c] & (means[c] == means[c].max()) if np.isfinite(means[c].max()) else alive[c]
            options = np.flatnonzero(pool)
            p = int(options[self.rng.integers(options.size)])
            n = 1 if self.n_mode == "one" else int(self.rng.integers(1, n_max + 1))
            arms.append((p, n))
        return Policy(tuple(arms))

    @staticmethod
    def _prompt_means(est: Estimator) -> np.ndarray:
        """(C, P) mean utility of each prompt over all its samples (whatever their N)."""
        counts = est.counts.sum(axis=2)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(counts > 0, est.sums.sum(axis=2) / np.where(counts > 0, counts, 1.0), np.nan)
