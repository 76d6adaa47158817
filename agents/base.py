"""The agent interface: ``train(env, budget) -> Policy``, and the registry of built-in agents."""

from __future__ import annotations

import importlib
import importlib.metadata
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from iapo_gym import IAPOEnv, Policy, base_env
from iapo_gym.policy import PolicyLike


@runtime_checkable
class AgentLike(Protocol):
    """Anything that spends at most ``budget`` completions of ``env`` and returns a policy."""

    def train(self, env: Any, budget: int) -> PolicyLike:
        """Learn a policy from at most ``budget`` completions (the sum of N over pulls)."""
        ...


@runtime_checkable
class AnytimeAgent(AgentLike, Protocol):
    """An agent that can give every budget's policy from one trajectory (the leaderboard then trains it once).

    ``anytime`` says whether this instance can (e.g. only with ``batch_size=1``); ``train_budgets`` yields
    (budget, policy) in increasing budget order, each policy bit-identical to a fresh ``train`` at that budget. An
    agent that shares one trajectory on some tables only may also define ``shares_trajectory(table) -> bool``: where
    it is False the leaderboard trains (and times) each budget on its own.
    """

    @property
    def anytime(self) -> bool:
        """True when ``train_budgets`` works for this instance."""
        ...

    def train_budgets(self, env: Any, budgets: Sequence[int]) -> Iterator[tuple[int, PolicyLike]]:
        """(budget, policy) for each of ``budgets`` in increasing order, from one trajectory."""
        ...


class Agent(ABC):
    """Base class of the built-in agents: a seed for the agent's own draws and ``train``.

    The environment's own draws (queries, completions) come from the env's generator,
    seeded with ``env.reset(seed=...)``; the agent's choices come from ``self.rng``.
    """

    def __init__(self, seed: int | None = None) -> None:
        """``seed`` seeds the agent's generator (None: fresh entropy)."""
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    @abstractmethod
    def train(self, env: Any, budget: int) -> Policy:
        """Spend at most ``budget`` completions of ``env`` and return the deployment policy."""

    def params(self) -> dict[str, Any]:
        """The agent's effective hyper-parameters, defaults included."""
        return {}

    @staticmethod
    def base_env(env: Any) -> IAPOEnv:
        """The IAPOEnv under any wrappers (its vectorized path lives there)."""
        return base_env(env, "agents train on")

    @staticmethod
    def check_budget(budget: Any) -> int:
        """The budget as an int >= 0, or a ValueError naming the bad value."""
        if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, (int, np.integer)) or budget < 0:
            raise ValueError(f"budget must be an integer >= 0 (completions), got {budget!r}")
        return int(budget)


#: name -> ("module:Class", default parameters) of the registered agents, imported when made.
REGISTRY: dict[str, tuple[str, dict[str, Any]]] = {}


#: The package entry-point group through which other distributions register agents (as Gymnasium's
#: ``gymnasium.envs``): ``[options.entry_points] iapo_gym.agents = my_agent = mypkg.module:MyAgent``.
ENTRY_POINT_GROUP = "iapo_gym.agents"


def register(name: str, entry_point: str, **defaults: Any) -> None:
    """Register an agent under ``name``: a class path plus default parameters (variants by kwargs).

    A name is registered once: registering a taken name is a ValueError naming what holds it.
    """
    if name in REGISTRY:
        raise ValueError(f"agent name {name!r} is already registered (to {REGISTRY[name][0]!r}); choose another name")
    REGISTRY[name] = (entry_point, dict(defaults))


def register_entry_points() -> None:
    """Register the agents other installed distributions declare in the ``iapo_gym.agents`` entry-point group.

    Called when ``agents`` is imported, so every process (also spawned and Dask workers) sees them. One that
    would take a name already registered is skipped with a warning naming its distribution.
    """
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            register(ep.name, ep.value)
        except ValueError as exc:
            dist = getattr(getattr(ep, "dist", None), "name", "an installed distribution")
            warnings.warn(f"{dist}: entry point {ep.name} = {ep.value} not registered: {exc}", stacklevel=2)


def load_class(entry_point: str) -> type:
    """Import ``"package.module:Class"``."""
    if ":" not in entry_point:
        raise ValueError(f"agent entry point must look like 'package.module:Class', got {entry_point!r}")
    module_name, attr = entry_point.split(":", 1)
    module = importlib.import_module(module_name)
    try:
        cls: type = getattr(module, attr)
        return cls
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None


def make(name: str, **params: Any) -> AgentLike:
    """Build a registered agent by name, or any agent class by ``"module:Class"`` path."""
    if name in REGISTRY:
        entry_point, defaults = REGISTRY[name]
        cls = load_class(entry_point)
        params = {**defaults, **params}
    elif ":" in name:
        cls = load_class(name)
    else:
        raise ValueError(f"unknown agent {name!r}; available: {', '.join(available())} (or 'module:Class')")
    agent = cls(**params)
    if not isinstance(agent, AgentLike):
        raise TypeError(f"{name!r} built a {type(agent).__name__}, which has no train(env, budget)")
    return agent


def available() -> list[str]:
    """Names of the registered agents."""
    return sorted(REGISTRY)
