"""``iapo-gym verify BUNDLE``: re-run a seeded random sample of a bundle's runs here and compare exactly.

Every run is seeded and scored exactly, so a re-run on any machine must give the bundled ACR bit
for bit. Before re-running, each agent's source digest is compared with the bundle's (a change
names the agent and module). Runs are re-run by the runner's own ``run_unit``, grouped by
(task, run); a table whose digest differs from the bundle's fails that (task, run) without
comparing ACRs. The sample seed is drawn fresh unless given, and recorded with the outcome in
``BUNDLE.verify.json`` (read by ``merge`` and the HTML report).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from iapo_gym.atomic import atomic_write_text
from iapo_gym.leaderboard.run.runner import WorkUnit, run_unit
from iapo_gym.leaderboard.run.specs import AgentSpec, TaskRef, resolve_task, task_available
from iapo_gym.leaderboard.run.store import RunResult
from iapo_gym.leaderboard.submit.bundle import Bundle, agent_source_digest, numeric_stack, read_bundle, source_digest
from iapo_gym.leaderboard.submit.merge import run_name
from iapo_gym.leaderboard.submit.online import check_online_sources, choose_online_sample, rerun_online_sample
from iapo_gym.leaderboard.submit.provenance import verify_record_path
from iapo_gym.seeding import derive_rng


@dataclass
class RunCheck:
    """One re-run: the bundled and the re-computed ACR, and whether they match exactly."""

    run: str
    bundled_acr: float
    acr: float | None
    match: bool
    note: str = ""


@dataclass
class VerifyOutcome:
    """What verify found: agent source changes, table digest changes, per-run checks."""

    bundle: str
    bundle_sha256: str
    sample_seed: int
    sample: int
    total: int
    seconds: float = 0.0
    agent_problems: list[str] = field(default_factory=list)
    table_problems: list[str] = field(default_factory=list)
    checks: list[RunCheck] = field(default_factory=list)
    #: Where a run does not match: each way this machine's numeric stack differs from the bundle's (numpy, numba,
    #: BLAS, Python), which can change the last bits of a result without anyone's fault.
    stack_differences: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing differs."""
        return not self.agent_problems and not self.table_problems and all(c.match for c in self.checks)

    @property
    def status(self) -> str:
        """``verified`` or ``FAILED``."""
        return "verified" if self.ok else "FAILED"

    def record(self) -> dict[str, Any]:
        """The JSON record written beside the bundle."""
        out = asdict(self)
        out["status"] = self.status
        out["matched"] = sum(c.match for c in self.checks)
        out["verified_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return out


def check_agent_sources(bundle: Bundle) -> list[str]:
    """One message per agent whose source here differs from the bundle's (naming agent and modules)."""
    problems = []
    for agent in bundle.manifest["agents"]:
        try:
            here = agent_source_digest(agent["name"])
        except (ImportError, AttributeError, ValueError) as exc:
            problems.append(f"agent {agent['spec']!r}: cannot import it here ({exc})")
            continue
        if here["sha256"] != agent["source"]["sha256"]:
            old, new = agent["source"]["modules"], here["modules"]
            changed = sorted(m for m in set(old) | set(new) if old.get(m) != new.get(m))
            problems.append(f"agent {agent['spec']!r}: source differs from the bundle's "
                            f"(module(s) {', '.join(changed)})")
    return problems


def stack_differences(software: dict[str, Any]) -> list[str]:
    """One line per part of the numeric stack (``bundle.numeric_stack``, numpy, Python) that differs between the
    bundle's ``software`` and this machine; a part the bundle did not record (an older iapo-gym) is named as such."""
    here = {"python": platform.python_version(), "numpy": np.__version__, **numeric_stack()}
    out = []
    for key, value in here.items():
        theirs = software.get(key)
        if theirs is None:
            out.append(f"{key}: not recorded in the bundle; here {_stack_text(value)}")
        elif theirs != value:
            out.append(f"{key}: bundle {_stack_text(theirs)}, here {_stack_text(value)}")
    return out


def _stack_text(value: Any) -> str:
    if isinstance(value, list):  # BLAS libraries
        return ", ".join(f"{b.get('vendor')} {b.get('version')} ({b.get('architecture')})" for b in value) or "none"
    return str(value)


def choose_sample(results: list[RunResult], k: int | None, seed: int) -> list[RunResult]:
    """``k`` runs (all if None or k >= len) drawn without replacement by a generator from ``seed``."""
    ordered = sorted(results, key=lambda r: r.key)
    if k is None or k >= len(ordered):
        return ordered
    if k < 1:
        raise ValueError(f"--sample must be >= 1 or 'all', got {k}")
    rng = derive_rng(seed, "verify-sample")
    picked = np.sort(rng.choice(len(ordered), size=k, replace=False))
    return [ordered[i] for i in picked]


def _task_refs(bundle: Bundle, tables: dict[str, str],
               entries: list[dict[str, Any]] | None = None) -> dict[str, TaskRef]:
    refs = {}
    for task in bundle.manifest["tasks"] if entries is None else entries:
        name = task["name"]
        if name in tables:
            ref = resolve_task(tables[name])
            refs[name] = TaskRef(name=name, path=ref.path, title=task["title"])
            continue
        try:
            refs[name] = resolve_task(name)
        except ValueError:
            raise ValueError(f"task {name!r} is not a registered task here; give its table file with "
                             f"--table {name}=PATH.h5") from None
    return refs


def verify_bundle(path: str | os.PathLike[str], sample: int | None = None, seed: int | None = None,
                  tables: dict[str, str] | None = None) -> VerifyOutcome:
    """Re-run ``sample`` runs (None: all) of the bundle at ``path`` and compare them exactly."""
    start = time.monotonic()
    bundle = read_bundle(path)
    if seed is None:
        entropy = np.random.SeedSequence().entropy
        assert isinstance(entropy, int)
        seed = entropy % (1 << 63)  # fresh, so submitters cannot predict it
    chosen = choose_sample(bundle.results, sample, seed)
    online = bundle.extra.get("online") or []  # the online protocol's runs (submit.online): their own sample
    chosen_online = choose_online_sample(online, sample, seed)
    outcome = VerifyOutcome(bundle.name, str(bundle.sha256), seed, len(chosen) + len(chosen_online),
                            len(bundle.results) + len(online))
    outcome.agent_problems = check_agent_sources(bundle)
    refs = _task_refs(bundle, tables or {})
    protocol = bundle.manifest["protocol"]
    rules = protocol.get("arm_set") == "rules"  # the runs' arms are (p, N, stopping rule): re-run over those
    groups: dict[tuple[str, int], list[RunResult]] = defaultdict(list)
    for r in chosen:
        groups[(r.task, r.run)].append(r)
    for (task, run), rows in sorted(groups.items()):
        missing = task_available(refs[task])
        if missing is not None:
            outcome.table_problems.append(f"task {task!r} run {run}: no table here to re-run it ({missing})")
            outcome.checks += [RunCheck(run_name(r), r.acr, None, False, "no table") for r in rows]
            continue
        jobs = tuple((AgentSpec(r.agent, json.loads(r.params), r.label), r.budget) for r in rows)
        unit = WorkUnit(refs[task], run, jobs, int(protocol["root_seed"]), float(protocol["train_fraction"]), rules)
        result = run_unit(unit)
        digest = result.task_info.table_sha256 if result.task_info else None
        bundled = {r.table_sha256 for r in rows}
        if digest not in bundled:
            outcome.table_problems.append(f"task {task!r} run {run}: table digest here {digest}, "
                                          f"the bundle's {', '.join(sorted(bundled))}")
            outcome.checks += [RunCheck(run_name(r), r.acr, None, False, "table differs") for r in rows]
            continue
        fresh = {(x.agent, x.params, x.budget): x for x in result.results}
        failed = {(f.label, f.budget): f.message for f in result.failures}
        for r in rows:
            x = fresh.get((r.agent, r.params, r.budget))
            if x is None:
                note = failed.get((r.label, r.budget), "no result")
                outcome.checks.append(RunCheck(run_name(r), r.acr, None, False, f"re-run failed: {note}"))
                continue
            notes = [] if x.acr == r.acr else [f"differs by {x.acr - r.acr:+.3g}"]
            if x.arms != r.arms:
                notes.append("policy differs")
            if x.arm_set != r.arm_set:
                notes.append(f"arm set differs: bundle {r.arm_set or 'fixed N'}, here {x.arm_set or 'fixed N'}")
            if (x.optimal_acr, x.regret) != (r.optimal_acr, r.regret):
                notes.append(f"optimal ACR or regret differs (bundle {r.optimal_acr!r}, {r.regret!r}; "
                             f"here {x.optimal_acr!r}, {x.regret!r})")
            outcome.checks.append(RunCheck(run_name(r), r.acr, x.acr, not notes, "; ".join(notes)))
    if online:
        section = bundle.manifest["online"]
        outcome.agent_problems += check_online_sources(section, source_digest)
        checks, problems = rerun_online_sample(chosen_online, section, _task_refs(bundle, tables or {},
                                                                                  section["tasks"]))
        outcome.table_problems += problems
        outcome.checks += [RunCheck(*check) for check in checks]
    if not all(c.match for c in outcome.checks):
        outcome.stack_differences = stack_differences(bundle.manifest["software"])
    outcome.seconds = time.monotonic() - start
    return outcome


def write_record(path: str | os.PathLike[str], outcome: VerifyOutcome) -> Path:
    """Write the outcome to ``BUNDLE.verify.json`` (atomically) and return its path."""
    return atomic_write_text(verify_record_path(path), json.dumps(outcome.record(), indent=1) + "\n")
