"""Tiny agents for the leaderboard tests, reachable as ``tests.leaderboard_toy_agents:Class``.

They use only the core's fast path (``pull``/``utilities``), so the tests do not depend on
the real agents.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from iapo_gym import IAPOEnv, Policy


def _base(env: Any) -> IAPOEnv:
    base = getattr(env, "unwrapped", env)
    assert isinstance(base, IAPOEnv)
    return base


class Greedy:
    """Random arms from its own generator until ``budget`` is spent, then the best seen per context."""

    def __init__(self, seed: int | None = None, pulls: int = 40) -> None:
        """``pulls`` caps the number of pulls (keeps tests fast)."""
        self.rng = np.random.default_rng(seed)
        self.pulls = pulls

    def train(self, env: Any, budget: int) -> Policy:
        """Spend at most ``budget`` completions on random arms; return the best mean arm per context."""
        base = _base(env)
        prompts = self.rng.integers(base.n_prompts, size=self.pulls)
        ns = self.rng.integers(1, base.n_max + 1, size=self.pulls)
        keep = np.cumsum(ns) <= budget
        prompts, ns = prompts[keep], ns[keep]
        if prompts.size == 0:
            return Policy(tuple((0, 1) for _ in range(base.n_contexts)))
        utils = base.utilities(base.pull(prompts, ns))  # (C, n)
        arm_ids = prompts * base.n_max + (ns - 1)
        uniq, inverse = np.unique(arm_ids, return_inverse=True)
        sums = np.zeros((base.n_contexts, uniq.size))
        np.add.at(sums.T, inverse, utils.T)
        means = sums / np.bincount(inverse)[None, :]
        best = uniq[means.argmax(axis=1)]
        return Policy(tuple((int(a // base.n_max), int(a % base.n_max) + 1) for a in best))


class Sleepy(Greedy):
    """Greedy that also sleeps ``delay`` seconds per training (gives a kill -9 test time to strike)."""

    def __init__(self, seed: int | None = None, delay: float = 0.05) -> None:
        """``delay`` seconds of sleep per ``train``."""
        super().__init__(seed)
        self.delay = delay

    def train(self, env: Any, budget: int) -> Policy:
        """Sleep, then train like Greedy."""
        time.sleep(self.delay)
        return super().train(env, budget)


class Fixed:
    """Always (prompt, N) in every context; takes no seed (the leaderboard must cope)."""

    def __init__(self, prompt: int = 0, n: int = 1) -> None:
        """The arm to return."""
        self.arm = (prompt, n)

    def train(self, env: Any, budget: int) -> Policy:
        """Spend nothing; return the fixed arm everywhere."""
        return Policy(tuple(self.arm for _ in range(_base(env).n_contexts)))


class Overspender(Greedy):
    """Draws one completion more than its budget (the leaderboard must reject the run)."""

    def train(self, env: Any, budget: int) -> Policy:
        """Hide the overspend behind a seeded reset, which clears ``budget_used``."""
        base = _base(env)
        base.pull(np.zeros(budget + 1, dtype=np.int64), np.ones(budget + 1, dtype=np.int64))
        base.reset(seed=0)
        return Policy(tuple((0, 1) for _ in range(base.n_contexts)))


class SleepyOnline:
    """An online agent (``iapo_gym.online.OnlineAgent``) that sleeps ``delay`` s at the start of a run, then
    serves random available arms from its own generator (the online protocol's interruption test)."""

    def __init__(self, delay: float = 0.05) -> None:
        """``delay``: seconds slept in ``start``."""
        self.delay = delay
        self.rng = np.random.default_rng(0)
        self.n_max = 1

    def start(self, env: Any, seed: int) -> None:
        """Sleep, then seed the generator."""
        time.sleep(self.delay)
        self.rng = np.random.default_rng(seed)
        self.n_max = env.schema.n_max

    def choose_batch(self, requests: Any) -> tuple[np.ndarray, np.ndarray]:
        """A random available prompt and N per request."""
        prompts = np.flatnonzero(requests.available)
        b = len(requests)
        return self.rng.choice(prompts, size=b), self.rng.integers(1, self.n_max + 1, size=b)

    def update_batch(self, requests: Any, served: Any) -> None:
        """Learns nothing."""
