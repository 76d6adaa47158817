"""Deploy what you learn: the policy file, the ``Router`` that applies it per request, and ``iapo-gym serve``.

``load_policy``/``PolicyFile`` read and write policy files (``iapo_gym.policyfile``, in the core
because ``Policy.save``/``load`` use it; its names are re-exported here); ``Router(policy, spec)``
routes queries to an OpenAI-compatible upstream; ``server`` puts a Router behind an OpenAI-compatible
HTTP API. See docs/deploy.md.
"""

from __future__ import annotations

from typing import Any

from iapo_gym.policyfile import (
    PolicyContext,
    PolicyFile,
    PolicyFileError,
    PolicyPrompt,
    PolicyRule,
    describe,
    load_policy,
)

__all__ = ["ContextError", "PolicyContext", "PolicyFile", "PolicyFileError", "PolicyPrompt", "PolicyRule", "Routed",
           "Router", "describe", "load_policy"]


def __getattr__(name: str) -> Any:
    """``Router``, ``Routed`` and ``ContextError`` load the LLM client only when asked for."""
    if name in ("Router", "Routed", "ContextError"):
        from iapo_gym.deploy import router

        return getattr(router, name)
    raise AttributeError(f"module 'iapo_gym.deploy' has no attribute {name!r}")
