"""The leaderboard: the paper's evaluation protocol (section 5, appendix D) as one resumable sweep.

``run_sweep`` trains every agent on every (task, budget, run) and stores exact test ACRs in
SQLite; ``build_report``/``write_report`` turn them into ranked tables, statistics and plots.
This package and ``iapo_gym.cli`` are the only parts of ``iapo_gym`` that import ``agents``.
Names are imported lazily so that ``iapo-gym --help`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_report": "report", "markdown": "report", "write_report": "report",
    "SweepSummary": "runner", "WorkUnit": "runner", "plan_units": "runner", "run_sweep": "runner",
    "run_unit": "runner",
    "PAPER_AGENTS": "specs", "PAPER_BUDGETS": "specs", "PAPER_RUNS": "specs", "AgentSpec": "specs",
    "TaskRef": "specs", "parse_agent_spec": "specs", "resolve_task": "specs", "table_checksum": "specs",
    "adjust_pvalues": "stats", "mean_sem": "stats", "paired_test": "stats", "pairwise": "stats",
    "summarize": "stats", "win_matrix": "stats",
    "ResultStore": "store", "RunResult": "store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import the public names from their submodules on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'iapo_gym.leaderboard' has no attribute {name!r}")
    return getattr(importlib.import_module(f"iapo_gym.leaderboard.{module}"), name)
