"""The online protocol's part of a bundle: the member ``online.jsonl`` and the manifest's ``online`` section.

A results folder with online runs (``iapo-gym leaderboard --protocol online``) bundles them as a fourth member,
``online.jsonl`` (one ``online_runs`` row per line, as stored), and the manifest gains ``online``: the protocol
(root seed, batch size, horizons, schedules, number of runs), per task its levels, schedules, horizons and table
digests, per agent its spec and source digest (the online agents' classes, ``agents.online``). Such a manifest has
``schema_version`` 2; a bundle without online runs is written exactly as before (version 1, three members).
``verify`` re-runs a sample of the online runs with ``run.online.run_online_unit`` and compares every computed
field (the curve at the 100 checkpoints bit for bit); ``merge`` keeps duplicate online runs once after the same
check.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from iapo_gym.leaderboard.run.online import (
    ONLINE_COMPUTED,
    OnlineRunResult,
    OnlineUnit,
    online_agent_class,
    run_online_unit,
    task_levels,
)
from iapo_gym.leaderboard.run.specs import AgentSpec, TaskRef, task_available
from iapo_gym.leaderboard.run.store import TaskInfo
from iapo_gym.seeding import derive_rng

ONLINE_MEMBER = "online.jsonl"
#: The manifest schema version of a bundle with online runs (one without them stays at version 1).
ONLINE_SCHEMA_VERSION = 2


def online_jsonl(rows: Sequence[OnlineRunResult]) -> bytes:
    """The member ``online.jsonl``: one row per line, keys sorted."""
    return "".join(json.dumps(asdict(r), sort_keys=True) + "\n" for r in rows).encode()


def online_run_name(r: OnlineRunResult) -> str:
    """An online run as people read it."""
    return f"{r.task}/{r.label} online level={r.level} schedule={r.schedule} T={r.horizon} run={r.run}"


def online_manifest(rows: Sequence[OnlineRunResult], tasks: Sequence[TaskInfo], meta: dict[str, str | None],
                    source_digest: Callable[[type], dict[str, Any]]) -> dict[str, Any]:
    """The manifest's ``online`` section for ``rows`` (``source_digest``: ``bundle.source_digest``)."""
    if meta.get("root_seed") is None or meta.get("online_batch_size") is None:
        raise ValueError("the results database records no root seed or online batch size")
    infos = {t.task: t for t in tasks}
    task_entries = []
    for task in sorted({r.task for r in rows}):
        mine = [r for r in rows if r.task == task]
        info = infos.get(task)
        task_entries.append({
            "name": task, "title": info.title if info else task, "table_sha256": sorted({r.table_sha256 for r in mine}),
            "levels": sorted({r.level for r in mine}), "schedules": sorted({r.schedule for r in mine}),
            "horizons": sorted({r.horizon for r in mine}), "runs": sorted({r.run for r in mine}),
            "n_results": len(mine)})
    agent_entries = []
    for name, params, label in sorted({(r.agent, r.params, r.label) for r in rows}):
        spec = AgentSpec(name, json.loads(params), label)
        try:
            source = source_digest(online_agent_class(name))
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"cannot read the source of online agent {spec.spec!r}: {exc}") from None
        agent_entries.append({"name": name, "params": spec.params, "label": label, "spec": spec.spec, "source": source})
    return {"root_seed": int(str(meta["root_seed"])), "batch_size": int(str(meta["online_batch_size"])),
            "horizons": sorted({r.horizon for r in rows}), "schedules": sorted({r.schedule for r in rows}),
            "runs": len({r.run for r in rows}), "n_results": len(rows), "tasks": task_entries,
            "agents": agent_entries}


def merge_online(inputs: Sequence[tuple[str, Sequence[OnlineRunResult]]]) -> tuple[list[OnlineRunResult], int]:
    """The union of several inputs' online runs, a run present in several kept once after checking that everything
    it computed agrees exactly: (runs, duplicates). A ValueError names a disagreeing run and its fields."""
    by_key: dict[tuple[str, int, str, int, str, str, int], tuple[OnlineRunResult, str]] = {}
    duplicates = 0
    for name, rows in inputs:
        for r in rows:
            seen = by_key.get(r.key)
            if seen is None:
                by_key[r.key] = (r, name)
                continue
            other, where = seen
            differ = [f for f in ONLINE_COMPUTED if getattr(r, f) != getattr(other, f)]
            if other.label != r.label:
                differ.append("label")
            if differ:
                detail = ", ".join(f"{f} {str(getattr(other, f))[:40]!r} vs {str(getattr(r, f))[:40]!r}" for f in differ)
                raise ValueError(f"online run {online_run_name(r)} disagrees between {where} and {name}: {detail}")
            duplicates += 1
    return [v[0] for _, v in sorted(by_key.items())], duplicates


def check_online_sources(section: dict[str, Any], source_digest: Callable[[type], dict[str, Any]]) -> list[str]:
    """One message per online agent whose source here differs from the manifest's ``online`` section."""
    problems = []
    for agent in section["agents"]:
        try:
            here = source_digest(online_agent_class(agent["name"]))
        except (ImportError, AttributeError, ValueError) as exc:
            problems.append(f"online agent {agent['spec']!r}: cannot import it here ({exc})")
            continue
        if here["sha256"] != agent["source"]["sha256"]:
            old, new = agent["source"]["modules"], here["modules"]
            changed = sorted(m for m in set(old) | set(new) if old.get(m) != new.get(m))
            problems.append(f"online agent {agent['spec']!r}: source differs from the bundle's "
                            f"(module(s) {', '.join(changed)})")
    return problems


def choose_online_sample(rows: Sequence[OnlineRunResult], k: int | None, seed: int) -> list[OnlineRunResult]:
    """``k`` online runs (all if None or k >= len) drawn without replacement by a generator of ``seed`` (its own
    stream: the paper runs' sample of the same seed is unchanged)."""
    ordered = sorted(rows, key=lambda r: r.key)
    if k is None or k >= len(ordered):
        return ordered
    if k < 1:
        raise ValueError(f"--sample must be >= 1 or 'all', got {k}")
    picked = np.sort(derive_rng(seed, "verify-sample-online").choice(len(ordered), size=k, replace=False))
    return [ordered[i] for i in picked]


#: One re-run's outcome: (run name, bundled regret at T, regret here or None, whether all matches, note).
OnlineCheck = tuple[str, float, float | None, bool, str]


def rerun_online_sample(chosen: Sequence[OnlineRunResult], section: dict[str, Any],
                        tasks: dict[str, TaskRef]) -> tuple[list[OnlineCheck], list[str]]:
    """Re-run ``chosen`` online runs here (``run_online_unit``, grouped by (task, level, schedule, horizon, run))
    and compare every computed field exactly: (checks, table problems). ``tasks`` maps a task name to its ref."""
    groups: dict[tuple[str, int, str, int, int], list[OnlineRunResult]] = defaultdict(list)
    for r in chosen:
        groups[(r.task, r.level, r.schedule, r.horizon, r.run)].append(r)
    checks: list[OnlineCheck] = []
    problems: list[str] = []
    for (task, level, schedule, horizon, run), rows in sorted(groups.items()):
        ref = tasks[task]
        indices = {lv: i for i, lv in task_levels(ref)}
        missing = task_available(ref) if level in indices else f"level {level} is not one of task {task!r}"
        if missing is not None:
            problems.append(f"task {task!r} level {level}: no table here to re-run it ({missing})")
            checks += [(online_run_name(r), r.regret, None, False, "no table") for r in rows]
            continue
        agents = tuple(AgentSpec(r.agent, json.loads(r.params), r.label) for r in rows)
        unit = OnlineUnit(ref, indices[level], level, schedule, horizon, run, agents, int(section["root_seed"]),
                          int(section["batch_size"]))
        outcome = run_online_unit(unit)
        digest = outcome.task_info.table_sha256 if outcome.task_info else None
        bundled = {r.table_sha256 for r in rows}
        if digest not in bundled:
            problems.append(f"task {task!r} level {level}: table digest here {digest}, the bundle's "
                            f"{', '.join(sorted(bundled))}")
            checks += [(online_run_name(r), r.regret, None, False, "table differs") for r in rows]
            continue
        fresh = {(x.agent, x.params): x for x in outcome.results}
        failed = {f.label: f.message for f in outcome.failures}
        for r in rows:
            x = fresh.get((r.agent, r.params))
            if x is None:
                checks.append((online_run_name(r), r.regret, None, False,
                               f"re-run failed: {failed.get(r.label, 'no result')}"))
                continue
            differ = [f for f in ONLINE_COMPUTED if getattr(x, f) != getattr(r, f)]
            note = f"differs: {', '.join(differ)}" if differ else ""
            checks.append((online_run_name(r), r.regret, x.regret, not differ, note))
    return checks, problems
