"""Explore-then-commit: optimize offline with an existing agent, then serve its frozen policy (``optimize`` + ``serve``).

Before request 0 the agent spends ``budget`` completions training an offline agent (``plugin_anytime`` by default,
``auto``'s majority-vote path and the warm start of ``iapo_online``; ``psst``, ``auto``, any registered name)
through its public ``train`` API on ``OnlineEnv.offline_env``: the table of request 0, the prompts available then,
the train split. Those completions are not requests of the run and carry no regret.
It then serves the trained policy's arm for each context and never learns again: after a drift or an
arrival its regret keeps growing (what the online agents are measured against). When a committed prompt is
retired, the context is served a prompt drawn uniformly (the agent's generator, once per retirement) among those
available, at its committed N: it still learns nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agents.base import make
from iapo_gym.online import OnlineAgentBase, OnlineEnv, Requests
from iapo_gym.policy import Policy
from iapo_gym.seeding import derive_seed


class ExploreThenCommit(OnlineAgentBase):
    """Train an offline agent on the train split before the run, serve its policy frozen.

    :param agent: the registered offline agent that explores (e.g. ``plugin_anytime``, ``auto``, ``psst``).
    :param budget: completions it may spend before the run (not requests; no regret).
    """

    def __init__(self, seed: int | None = None, agent: str = "plugin_anytime", budget: int = 5_000,
                 agent_params: dict[str, Any] | None = None) -> None:
        """Hyper-parameters as documented on the class; ``agent_params`` go to the offline agent."""
        super().__init__(seed)
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
            raise ValueError(f"budget must be an integer >= 1 (completions), got {budget!r}")
        self.agent, self.budget, self.agent_params = agent, int(budget), dict(agent_params or {})
        self.arms = np.zeros((0, 2), dtype=np.int64)

    def params(self) -> dict[str, Any]:
        """The hyper-parameters."""
        return {"agent": self.agent, "budget": self.budget, "agent_params": self.agent_params}

    def start(self, env: OnlineEnv, seed: int) -> None:
        """Train the offline agent on ``env.offline_env`` and keep its arms (prompt indices of the run's table)."""
        super().start(env, seed)
        offline, keep = env.offline_env("train", seed=derive_seed(seed, "offline env"))
        learner = make(self.agent, seed=derive_seed(seed, "offline agent"), **self.agent_params)
        policy = Policy.coerce(learner.train(offline, self.budget), offline.n_contexts)
        arms = np.array(policy.arms, dtype=np.int64)
        arms[:, 0] = keep[arms[:, 0]]
        self.arms = arms
        self.serving = arms.copy()  # the committed arms, with a drawn stand-in for each retired prompt

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        """The committed arm of each request's context (a drawn available prompt at its N once it is retired)."""
        gone = ~requests.available[self.serving[:, 0]]
        if gone.any():  # at a schedule change only (a batch never crosses one): the same draws for any batch size
            live = np.flatnonzero(requests.available)
            self.serving[gone, 0] = live[self.rng.integers(live.size, size=int(gone.sum()))]
        arms = self.serving[requests.contexts]
        return arms[:, 0], arms[:, 1]
