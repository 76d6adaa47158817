"""iapo-gym: inference-aware prompt optimization (IAPO) as Gymnasium contextual bandits.

``import iapo_gym`` registers the six tasks of the paper (``IAPO-MATH-v0`` ...); the exact
oracle and the ACR evaluation work on any ``IAPOEnv``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from iapo_gym._version import __version__
from iapo_gym.data import load_task_table
from iapo_gym.env import IAPOEnv, Pulls, base_env
from iapo_gym.policy import Policy, PolicyError, PolicyLike
from iapo_gym.source import CompletionSource, TableSource
from iapo_gym.tables import (
    OutcomeTable,
    TableError,
    TableSchema,
    check_table_file,
    read_metadata,
    read_table,
    validate,
    write_table,
)
from iapo_gym.tasks import TASKS, get_task

__all__ = [
    "CompletionSource", "IAPOEnv", "OutcomeTable", "Policy", "PolicyError", "Pulls", "TASKS", "TableError",
    "TableSchema", "TableSource", "__version__", "base_env", "check_table_file", "evaluate",
    "get_task", "load_table", "read_metadata", "read_table", "register_envs", "validate", "write_table",
]


def load_table(task: str, *, instance: int = 0, path: str | None = None) -> OutcomeTable:
    """The outcome table of ``task`` (explicit ``path`` first, then the data lookup)."""
    return load_task_table(task, instance=instance, path=path)


def evaluate(policy: PolicyLike, env: Any, split: str = "test", *, method: str = "exact",
             n_samples: int = 10_000, seed: int | None = None) -> float:
    """Average Contextual Return of ``policy`` on ``env``'s ``split``.

    ``method="exact"`` (default) uses the exact oracle; ``"monte_carlo"`` is the paper's
    n-sample estimate (returns only the mean; the env method also gives the standard error).
    """
    base = base_env(env)
    if method == "exact":
        return base.evaluate(policy, split)
    if method == "monte_carlo":
        return base.evaluate_monte_carlo(policy, split, n_samples=n_samples, seed=seed)[0]
    raise ValueError(f"method must be 'exact' or 'monte_carlo', got {method!r}")


def register_envs() -> None:
    """Register every task id with Gymnasium (idempotent; runs on import)."""
    for spec in TASKS.values():
        if spec.env_id not in gym.registry:
            gym.register(id=spec.env_id, entry_point="iapo_gym.env:IAPOEnv", kwargs={"task": spec.name})
    if "IAPO-Generated-v0" not in gym.registry:  # a level of a generated family (docs/tasks.md)
        gym.register(id="IAPO-Generated-v0", entry_point="iapo_gym.env:generated_env")
    if "IAPO-Online-v0" not in gym.registry:  # the online protocol (docs/online.md)
        gym.register(id="IAPO-Online-v0", entry_point="iapo_gym.online.env:OnlineEnv")
    if "IAPO-Live-v0" not in gym.registry:  # a live endpoint (docs/collect.md); needs the [llm] extra when stepped
        gym.register(id="IAPO-Live-v0", entry_point="iapo_gym.llm.live:LiveEnv")


register_envs()
