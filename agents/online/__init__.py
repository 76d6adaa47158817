"""Agents of the online protocol (docs/online.md), one module per family; the interface is
``iapo_gym.online.OnlineAgent``. ``make_online(name, **params)`` builds one by name."""

from __future__ import annotations

from typing import Any

from agents.base import load_class
from iapo_gym.online import OnlineAgent

#: name -> ("module:Class", default parameters) of the online agents.
ONLINE_REGISTRY: dict[str, tuple[str, dict[str, Any]]] = {
    "iapo_online": ("agents.online.iapo_online:IAPOOnline", {}),
    "ucb": ("agents.online.ucb:ContextUCB", {}),
    "ucb_discounted": ("agents.online.ucb:ContextUCB", {"discount": 0.9999}),
    "thompson": ("agents.online.thompson:ContextThompson", {}),
    "etc_auto": ("agents.online.explore_commit:ExploreThenCommit", {}),  # with ExploreThenCommit's default agent
    "etc_psst": ("agents.online.explore_commit:ExploreThenCommit", {"agent": "psst"}),
}


def make_online(name: str, **params: Any) -> OnlineAgent:
    """Build the online agent registered as ``name`` (its defaults overridden by ``params``)."""
    if name not in ONLINE_REGISTRY:
        raise ValueError(f"unknown online agent {name!r}; available: {', '.join(sorted(ONLINE_REGISTRY))}")
    entry_point, defaults = ONLINE_REGISTRY[name]
    agent: OnlineAgent = load_class(entry_point)(**{**defaults, **params})
    return agent


__all__ = ["ONLINE_REGISTRY", "make_online"]
