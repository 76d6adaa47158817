"""The online agent interface: choose arms for arrived requests, learn from what they returned.

Anything with these four methods plugs into ``run_online`` and the Gymnasium loop; ``OnlineAgentBase`` gives
the one-request forms ``choose(observation)`` / ``update(observation, action, info)`` on top of the batch
forms, for a plain Gymnasium loop. Agents live in ``agents/online/``; the core only defines the protocol.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from iapo_gym.env import Pulls
from iapo_gym.online.env import OnlineEnv, Requests, Served


@runtime_checkable
class OnlineAgent(Protocol):
    """An agent of the online protocol (docs/online.md)."""

    def start(self, env: OnlineEnv, seed: int) -> None:
        """Begin a run on ``env`` (read ``env.schema``, ``env.horizon``; never its outcome distributions)."""
        ...

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        """(prompts (B,), ns (B,)) for a batch of arrived requests, chosen before any of them is answered."""
        ...

    def update_batch(self, requests: Requests, served: Served) -> None:
        """Learn from the batch's outcomes (``served.pulls``, ``served.utilities``; not its regret)."""
        ...


class OnlineAgentBase:
    """Base of the built-in online agents: the one-request forms over the batch forms, and a seeded generator."""

    def __init__(self, seed: int | None = None) -> None:
        """``seed`` seeds the agent's generator when ``start`` is not given one."""
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def start(self, env: OnlineEnv, seed: int) -> None:
        """Begin a run: re-seed the generator (subclasses add their own state)."""
        self.rng = np.random.default_rng(seed)

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        """(prompts, ns) for a batch of requests."""
        raise NotImplementedError

    def update_batch(self, requests: Requests, served: Served) -> None:
        """Learn from a served batch (default: nothing, a frozen policy)."""

    def choose(self, observation: dict[str, Any]) -> tuple[int, int]:
        """(p, N) for one request, from the env's observation (``OnlineEnv.step``'s loop)."""
        prompts, ns = self.choose_batch(_one(observation))
        return int(prompts[0]), int(ns[0])

    def update(self, observation: dict[str, Any], action: tuple[int, int], info: dict[str, Any]) -> None:
        """Learn from one served request: ``observation`` is what ``choose`` saw, ``info`` what ``OnlineEnv.step``
        returned for ``action`` (its outcomes and their utilities; its regret is not passed on)."""
        p, n = int(action[0]), int(action[1])
        atoms = np.asarray(info["atoms"], dtype=np.int64)
        if atoms.size != n:
            raise ValueError(f"info holds {atoms.size} outcomes, not the N = {n} of the action {action!r}")
        requests = _one(observation, int(info["t"]))
        pulls = Pulls(np.array([p]), np.array([n]), np.array([int(info["query"])]), atoms, np.array([0, n]))
        utilities = np.asarray(info["utilities"], dtype=np.float64)[:, None]
        nan = np.full(1, np.nan)
        served = Served(pulls, utilities, utilities[int(observation["context"])], np.array([float(info["cost"])]),
                        nan, nan, nan)
        self.update_batch(requests, served)

    def params(self) -> dict[str, Any]:
        """The agent's effective hyper-parameters."""
        return {}


def _one(observation: dict[str, Any], t: int = -1) -> Requests:
    """The request of a Gymnasium observation as a batch of one (``t``: its step, when known)."""
    c = int(observation["context"])
    return Requests(t, np.array([c]), np.asarray(observation["weights"], dtype=np.float64)[None, :],
                    np.asarray(observation["available"], dtype=bool))
