"""The leaderboard: the paper's evaluation protocol (section 5, appendix D) as one resumable sweep.

``run_sweep`` trains every agent on every (task, budget, run) and stores exact test ACRs in
SQLite; ``build_report``/``write_report`` turn them into ranked tables, statistics and plots.
``run_online_sweep`` runs the online protocol (docs/online.md) the same way, ``online_report`` reports it.
This package and ``iapo_gym.cli`` are the only parts of ``iapo_gym`` that import ``agents``.
Names are imported lazily so that ``iapo-gym --help`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_report": "report.model", "markdown": "report.write", "write_report": "report.write",
    "SweepSummary": "run.runner", "WorkUnit": "run.runner", "plan_units": "run.runner", "run_sweep": "run.runner",
    "run_unit": "run.runner",
    "PAPER_AGENTS": "run.specs", "PAPER_BUDGETS": "run.specs", "PAPER_RUNS": "run.specs", "AgentSpec": "run.specs",
    "TaskRef": "run.specs", "parse_agent_spec": "run.specs", "resolve_task": "run.specs",
    "table_checksum": "run.specs",
    "adjust_pvalues": "report.stats", "mean_sem": "report.stats", "paired_test": "report.stats",
    "pairwise": "report.stats", "summarize": "report.stats", "win_matrix": "report.stats",
    "ResultStore": "run.store", "RunResult": "run.store",
    "OnlineRunResult": "run.online", "run_online_sweep": "run.online", "parse_online_spec": "run.online",
    "online_report": "report.online",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import the public names from their submodules on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'iapo_gym.leaderboard' has no attribute {name!r}")
    return getattr(importlib.import_module(f"iapo_gym.leaderboard.{module}"), name)
