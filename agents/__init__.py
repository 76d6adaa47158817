"""Agents for IAPO: PSST, Top-K screening and the paper's baselines behind one interface.

``agents.make(name, **params)`` builds one; ``agents.available()`` names them. Any object
with ``train(env, budget) -> policy`` is an agent too (see ``examples/custom_agent.py``).
"""

from agents.base import REGISTRY, Agent, AgentLike, available, make, register

__all__ = ["REGISTRY", "Agent", "AgentLike", "available", "make", "register"]
