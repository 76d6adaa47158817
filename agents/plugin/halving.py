"""``PlugInHalving`` (``plugin_halving``): successive halving over prompts for a known budget, on common queries."""

from __future__ import annotations

from typing import Any

import numpy as np

from agents.base import Agent
from agents.plugin.anytime import read_policy
from agents.plugin.common import QueryStream, keep_top
from agents.plugin.estimator import PlugInEstimator, check_nonnegative, warm_up
from agents.psst import rounds_to_one
from iapo_gym import Policy


class PlugInHalving(Agent):
    """Successive halving over prompts on common queries, read through ``PlugInEstimator``.

    floor(log2 P) trimming rounds and a last one; round r spends floor(remaining / rounds left)
    completions: every prompt live in some context gets the same m new train queries (without
    replacement), n completions each, n = min(N_max, floor(b / (m_min L))) and m = floor(b / (n L)),
    L the live prompts. After each round but the last, each context keeps the top max(1,
    floor(|L_c| / 2)) of its live prompts by max_N of the estimate; the policy takes, per context,
    the best (p, N) of the prompts surviving in some context (``read_policy``). The majority-vote prior is
    the query's pooled answers.

    :param seed: the agent's generator (query order, ties).
    :param m_min: common queries per live prompt and round at least.
    :param alpha: pseudo-votes of the majority-vote prior per (prompt, query).
    """

    def __init__(self, seed: int | None = None, m_min: int = 8, alpha: float = 4.0) -> None:
        """Check and keep the hyper-parameters."""
        super().__init__(seed)
        if isinstance(m_min, bool) or not isinstance(m_min, (int, np.integer)) or m_min < 1:
            raise ValueError(f"m_min must be an integer >= 1, got {m_min!r}")
        self.m_min = int(m_min)
        (self.alpha,) = check_nonnegative(alpha=alpha)
        warm_up()

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"m_min": self.m_min, "alpha": self.alpha}

    def train(self, env: Any, budget: int) -> Policy:
        """Spend at most ``budget`` completions of ``env``; the best surviving arm per context."""
        base = self.base_env(env)
        budget = self.check_budget(budget)
        est = PlugInEstimator(base, alpha=self.alpha, curve=0.0, empirical_bayes=False)
        return halve(base, est, budget, self.m_min, self.rng)[0]


def halve(base: Any, est: PlugInEstimator, budget: int, m_min: int,
          rng: np.random.Generator) -> tuple[Policy, np.ndarray]:
    """``PlugInHalving``'s rounds on ``base`` read through ``est`` (empty), drawing from ``rng``: the policy
    (``read_policy``) and the live prompts (C, P) when the last round began. ``auto`` runs them on Best-of-N too."""
    stream = QueryStream(base.queries(), rng)
    n_contexts, n_prompts, n_max = est.shape
    alive = np.ones((n_contexts, n_prompts), dtype=bool)
    last = alive.copy()
    rounds_total = rounds_to_one(n_prompts) + 1  # the trims, then a last round
    spent = 0
    for r in range(rounds_total):
        live = np.flatnonzero(alive.any(axis=0))
        b = (budget - spent) // (rounds_total - r)
        if b < live.size:
            break
        last = alive.copy()
        n = int(min(n_max, max(1, b // (live.size * m_min))))
        m = b // (live.size * n)
        pulls = base.pull(np.repeat(live, m), np.full(live.size * m, n), queries=np.tile(stream.take(m), live.size))
        spent += pulls.completions
        est.update(pulls)
        if r < rounds_total - 1:
            keep_top(alive, est, np.maximum(1, alive.sum(axis=1) // 2), rng)
    return read_policy(base, est, alive, rng), last
