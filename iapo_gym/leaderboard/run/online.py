"""The online protocol's sweep (``iapo-gym leaderboard --protocol online``): every (task level, schedule, horizon,
run, agent) served through ``iapo_gym.online.run_online`` and scored by its exact cumulative regret curve.

Work is grouped into units of one (task, level, schedule, horizon, run): the unit builds (or reuses) the level's
``OnlineEnv`` (its exact tensor per schedule segment is computed once per worker) and serves the run's requests
to every pending agent. Seeds (``iapo_gym.seeding``):

- env seed    ``derive_seed(root, "online", task, level, run)``: the seed ``run_online`` resets the env with, the
  same for every agent, schedule and horizon of a (level, run) (common random numbers: the contexts, queries and
  completions are the same stream, so agents pair);
- agent seed  ``derive_seed(env seed, "agent")``: what ``run_online`` starts the agent with.

Rows go to the table ``online_runs`` of the same ``results.sqlite`` as the paper protocol's (created on first
use, so a paper-only database is unchanged), one transaction per unit, so a sweep killed at any instant leaves
whole units only and a rerun plans just the missing cells. Results do not depend on the number, kind or order of
workers (the executors are the paper protocol's, ``runner.execute``).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TextIO

import numpy as np

from iapo_gym._version import __version__
from iapo_gym.leaderboard.run.runner import effective_params_json, execute
from iapo_gym.leaderboard.run.specs import (
    DEFAULT_ROOT_SEED,
    AgentSpec,
    TaskRef,
    available_tasks,
    check_unique_labels,
    parse_agent_spec,
    table_checksum,
)
from iapo_gym.leaderboard.run.store import ResultStore, TaskInfo
from iapo_gym.online import SCHEDULES, OnlineEnv, run_online
from iapo_gym.online import checkpoints as checkpoint_counts
from iapo_gym.progress import Progress
from iapo_gym.seeding import derive_seed

PROTOCOLS = ("paper", "online")
#: Defaults of ``--protocol online``: requests per run, runs per level, requests chosen for before their outcomes
#: are seen (``run_online``'s ``batch_size``), schedules, and the explore-then-commit baseline of the statistics.
DEFAULT_HORIZON = 10_000
DEFAULT_ONLINE_RUNS = 4
DEFAULT_BATCH_SIZE = 16
DEFAULT_SCHEDULES: tuple[str, ...] = ("stationary",)
DEFAULT_BASELINE = "etc_auto"
ONLINE_TABLE = "online_runs"

_ONLINE_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {ONLINE_TABLE} (
    task TEXT NOT NULL,
    table_sha256 TEXT NOT NULL,
    level INTEGER NOT NULL,
    schedule TEXT NOT NULL,
    horizon INTEGER NOT NULL,
    agent TEXT NOT NULL,
    params TEXT NOT NULL,
    label TEXT NOT NULL,
    run INTEGER NOT NULL,
    root_seed INTEGER NOT NULL,
    env_seed INTEGER NOT NULL,
    agent_seed INTEGER NOT NULL,
    batch_size INTEGER NOT NULL,
    regret REAL NOT NULL,
    checkpoints TEXT NOT NULL,
    curve TEXT NOT NULL,
    completions INTEGER NOT NULL,
    seconds REAL NOT NULL,
    version TEXT NOT NULL,
    effective_params TEXT,
    created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (task, level, schedule, horizon, agent, params, run)
)
"""


@dataclass(frozen=True)
class OnlineRunResult:
    """One finished (task, level, schedule, horizon, agent, run): its exact cumulative regret curve.

    ``checkpoints`` (JSON) are the request counts T/100 .. T (``iapo_gym.online.checkpoints``), ``curve`` (JSON)
    the cumulative exact regret at each, ``regret`` its last value (at T); ``completions`` the completions drawn.
    """

    task: str
    table_sha256: str
    level: int  # the generated level; 0 for a task with one table
    schedule: str
    horizon: int
    agent: str
    params: str  # canonical JSON
    label: str
    run: int
    root_seed: int
    env_seed: int
    agent_seed: int
    batch_size: int
    regret: float
    checkpoints: str
    curve: str
    completions: int
    seconds: float
    version: str
    effective_params: str | None = None

    @property
    def key(self) -> tuple[str, int, str, int, str, str, int]:
        """The unique key (task, level, schedule, horizon, agent, params, run)."""
        return (self.task, self.level, self.schedule, self.horizon, self.agent, self.params, self.run)

    def curve_array(self) -> np.ndarray:
        """The cumulative regret at the checkpoints, as floats."""
        return np.asarray(json.loads(self.curve), dtype=np.float64)

    def checkpoint_array(self) -> np.ndarray:
        """The checkpoints (request counts)."""
        return np.asarray(json.loads(self.checkpoints), dtype=np.int64)


ONLINE_FIELDS = [f.name for f in fields(OnlineRunResult)]
#: Fields a re-run reproduces exactly (everything but wall time, label and bookkeeping).
ONLINE_COMPUTED = ("table_sha256", "root_seed", "env_seed", "agent_seed", "batch_size", "regret", "checkpoints",
                   "curve", "completions")


class OnlineStore(ResultStore):
    """``results.sqlite`` with the online protocol's table ``online_runs`` (created when the first rows come)."""

    def __enter__(self) -> OnlineStore:
        return self

    def has_online(self) -> bool:
        """Whether the database has the online table."""
        row = self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?",
                                 (ONLINE_TABLE,)).fetchone()
        return row is not None

    def add_online(self, results: Sequence[OnlineRunResult], tasks: Sequence[TaskInfo] = ()) -> int:
        """Insert online rows (duplicates ignored) and task infos in one transaction; returns rows added."""
        with self._transaction() as cur:
            cur.execute(_ONLINE_SCHEMA)
            for info in tasks:
                row = asdict(info)
                row["context_names"] = json.dumps(list(info.context_names))
                names = list(row)
                cur.execute(f"INSERT OR IGNORE INTO tasks ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                            [row[k] for k in names])
            before = self._conn.total_changes
            cur.executemany(f"INSERT OR IGNORE INTO {ONLINE_TABLE} ({', '.join(ONLINE_FIELDS)}) "
                            f"VALUES ({', '.join('?' * len(ONLINE_FIELDS))})",
                            [[getattr(r, k) for k in ONLINE_FIELDS] for r in results])
            added = self._conn.total_changes - before
        return added

    def online_done_keys(self) -> set[tuple[str, int, str, int, str, str, int]]:
        """Keys of every stored online run."""
        if not self.has_online():
            return set()
        rows = self._conn.execute(f"SELECT task, level, schedule, horizon, agent, params, run FROM {ONLINE_TABLE}")
        return {(str(t), int(lv), str(s), int(h), str(a), str(p), int(r)) for t, lv, s, h, a, p, r in rows}

    def online_results(self) -> list[OnlineRunResult]:
        """Every stored online run, ordered by its key (empty without the table)."""
        if not self.has_online():
            return []
        sql = (f"SELECT {', '.join(ONLINE_FIELDS)} FROM {ONLINE_TABLE} "
               "ORDER BY task, level, schedule, horizon, agent, params, run")
        return [OnlineRunResult(*row) for row in self._conn.execute(sql).fetchall()]


def read_online(out_dir: str | os.PathLike[str]) -> list[OnlineRunResult]:
    """The online runs of a results folder (empty when it has none); FileNotFoundError without a database."""
    with OnlineStore(out_dir, create=False) as store:
        return store.online_results()


# ---- specs -----------------------------------------------------------------------------------------------------


#: What a ``module:Class`` online agent must have (``iapo_gym.online.OnlineAgent``).
ONLINE_AGENT_METHODS = ("start", "choose_batch", "update_batch")


def parse_online_spec(text: str) -> AgentSpec:
    """An online agent spec: a name of ``agents.online.make_online`` (``ucb``, ``etc_auto:budget=2000``, ...)
    or a ``module:Class`` implementing ``iapo_gym.online.OnlineAgent``, with ``@label`` as for the paper's.

    ``module`` is imported as Python imports it, here and in every worker process (local workers inherit this
    process's ``sys.path``; Dask workers need the module installed or on their ``PYTHONPATH``): an agent outside
    an installed package runs with its folder on ``PYTHONPATH``, e.g. ``PYTHONPATH=benchmarks`` for the peers
    ``online_peers:VowpalWabbit`` and ``online_peers:MABWiserLinUCB`` (docs/online.md, "Peers"). The class is
    resolved now, so a spec that cannot build an online agent is refused before any run."""
    from agents.online import ONLINE_REGISTRY

    try:
        spec = parse_agent_spec(text, registry=ONLINE_REGISTRY)
    except ValueError as exc:
        message = str(exc)
        if "cannot import module" in message:
            raise ValueError(f"{message}; a module outside an installed package needs its folder on PYTHONPATH "
                             "(e.g. PYTHONPATH=benchmarks for online_peers:VowpalWabbit)") from None
        if message.startswith("module "):  # load_class's "module ... has no attribute ...": name the spec
            raise ValueError(f"agent spec {text.strip()!r}: {message}") from None
        raise
    if spec.name not in ONLINE_REGISTRY:
        cls = online_agent_class(spec.name)  # imported by parse_agent_spec already
        missing = [m for m in ONLINE_AGENT_METHODS if not callable(getattr(cls, m, None))]
        if not isinstance(cls, type) or missing:
            what = "not a class" if not isinstance(cls, type) else f"a class without {', '.join(missing)}"
            raise ValueError(f"agent spec {text.strip()!r}: {spec.name!r} is {what}; an online agent spec names a "
                             "class implementing iapo_gym.online.OnlineAgent (start, choose_batch, update_batch)")
    if "seed" in spec.params:
        raise ValueError(f"agent spec {text.strip()!r}: 'seed' is derived by the leaderboard (use --seed), not an "
                         "agent parameter")
    try:
        inspect.signature(online_agent_class(spec.name)).bind(**spec.params)
    except TypeError as exc:
        raise ValueError(f"agent spec {text.strip()!r}: its class does not take these parameters ({exc})") from None
    return spec


def online_agent_class(name: str) -> type:
    """The class of an online agent name or ``module:Class`` path."""
    from agents.base import load_class
    from agents.online import ONLINE_REGISTRY

    return load_class(ONLINE_REGISTRY[name][0] if name in ONLINE_REGISTRY else name)


def build_online_agent(spec: AgentSpec) -> Any:
    """A fresh online agent of ``spec`` (``run_online`` seeds it through ``start``)."""
    from agents.online import ONLINE_REGISTRY, make_online

    if "seed" in spec.params:
        raise ValueError(f"agent {spec.label!r}: 'seed' is derived by the leaderboard (use --seed), not an agent parameter")
    if spec.name in ONLINE_REGISTRY:
        return make_online(spec.name, **spec.params)
    return online_agent_class(spec.name)(**spec.params)


def task_levels(task: TaskRef) -> list[tuple[int, int]]:
    """(index for ``TaskRef.load``, level) of each table of a task: each level of a generated range, else the one
    table (level 0; a synthetic task's instance 0)."""
    if task.family is not None and task.levels is not None:
        first, last = task.levels
        if task.synthetic:
            return [(i, first + i) for i in range(last - first + 1)]
        return [(0, first)]
    return [(0, 0)]


def check_schedules(schedules: Sequence[str], tasks: Sequence[TaskRef]) -> None:
    """Refuse an unknown schedule, and ``drift`` on a task that is not a generated family (it redraws its model)."""
    if not schedules:
        raise ValueError("no schedules to run")
    for s in schedules:
        if s not in SCHEDULES:
            raise ValueError(f"unknown schedule {s!r}; schedules: {', '.join(SCHEDULES)}")
    if "drift" in schedules:
        plain = [t.name for t in tasks if t.family is None]
        if plain:
            raise ValueError(f"the drift schedule redraws a generated family's model; task(s) {', '.join(plain)} "
                             "are not generated levels (use generated:FAMILY:LEVELS, or drop --schedule drift)")


# ---- worker side -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OnlineUnit:
    """One (task, level, schedule, horizon, run) and the agents still to do for it."""

    task: TaskRef
    index: int  # for TaskRef.load
    level: int
    schedule: str
    horizon: int
    run: int
    agents: tuple[AgentSpec, ...]
    root_seed: int = DEFAULT_ROOT_SEED
    batch_size: int = DEFAULT_BATCH_SIZE


@dataclass(frozen=True)
class OnlineFailure:
    """An online run that raised (nothing is stored for it)."""

    task: str
    level: int
    schedule: str
    horizon: int
    label: str
    run: int
    message: str


@dataclass
class OnlineOutcome:
    """What a worker sends back for one unit."""

    unit: OnlineUnit
    results: list[OnlineRunResult] = field(default_factory=list)
    task_info: TaskInfo | None = None
    failures: list[OnlineFailure] = field(default_factory=list)


_ENV_CACHE: OrderedDict[tuple[str, str | None, int, str, int], tuple[OnlineEnv, str]] = OrderedDict()
_ENV_CACHE_SIZE = 2


def online_env(task: TaskRef, index: int, schedule: str, horizon: int) -> tuple[OnlineEnv, str]:
    """The level's env under ``schedule`` and the level table's checksum, reused across units in this worker
    (its exact tensor per segment is computed once)."""
    key = (task.name, task.path, index, schedule, horizon)
    if key in _ENV_CACHE:
        _ENV_CACHE.move_to_end(key)
        return _ENV_CACHE[key]
    table = task.load(index)
    env = OnlineEnv(table=table, schedule=schedule, horizon=horizon)
    entry = (env, table_checksum(table))
    _ENV_CACHE[key] = entry
    while len(_ENV_CACHE) > _ENV_CACHE_SIZE:
        _ENV_CACHE.popitem(last=False)
    return entry


def online_env_seed(root_seed: int, task: str, level: int, run: int) -> int:
    """The seed a (task, level, run) resets its env with, for every agent, schedule and horizon."""
    return derive_seed(root_seed, "online", task, level, run)


def _detail(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def run_online_unit(unit: OnlineUnit) -> OnlineOutcome:
    """Serve one (task, level, schedule, horizon, run) to every pending agent; errors become failures."""
    outcome = OnlineOutcome(unit)

    def fail(spec: AgentSpec, exc: BaseException) -> OnlineFailure:
        return OnlineFailure(unit.task.name, unit.level, unit.schedule, unit.horizon, spec.label, unit.run,
                             _detail(exc))

    try:
        env, checksum = online_env(unit.task, unit.index, unit.schedule, unit.horizon)
    except Exception as exc:  # an unreadable table, a schedule that cannot apply
        outcome.failures = [fail(spec, exc) for spec in unit.agents]
        return outcome
    table = env.table
    outcome.task_info = TaskInfo(unit.task.name, checksum, unit.task.title or unit.task.name, table.aggregator,
                                 table.n_prompts, table.n_max, tuple(table.context_names))
    env_seed = online_env_seed(unit.root_seed, unit.task.name, unit.level, unit.run)
    agent_seed = derive_seed(env_seed, "agent")  # what run_online starts the agent with
    points = json.dumps(checkpoint_counts(unit.horizon).tolist())
    for spec in unit.agents:
        try:
            agent = build_online_agent(spec)
            effective = effective_params_json(agent)
            start = time.perf_counter()
            result = run_online(env, agent, seed=env_seed, batch_size=unit.batch_size)
            seconds = time.perf_counter() - start
            outcome.results.append(OnlineRunResult(
                task=unit.task.name, table_sha256=checksum, level=unit.level, schedule=unit.schedule,
                horizon=unit.horizon, agent=spec.name, params=spec.params_json, label=spec.label, run=unit.run,
                root_seed=unit.root_seed, env_seed=env_seed, agent_seed=agent_seed, batch_size=unit.batch_size,
                regret=float(result.cumulative_regret[-1]), checkpoints=points,
                curve=json.dumps([float(v) for v in result.cumulative_regret]), completions=int(result.completions),
                seconds=seconds, version=__version__, effective_params=effective))
        except Exception as exc:  # one broken agent must not stop the sweep
            outcome.failures.append(fail(spec, exc))
    return outcome


def _run_online_unit_safely(unit: OnlineUnit) -> OnlineOutcome:
    """``run_online_unit``, with anything it did not catch reported per agent."""
    try:
        return run_online_unit(unit)
    except Exception as exc:
        return OnlineOutcome(unit, failures=[OnlineFailure(unit.task.name, unit.level, unit.schedule, unit.horizon,
                                                           s.label, unit.run, _detail(exc)) for s in unit.agents])


# ---- planning and the sweep ------------------------------------------------------------------------------------


def plan_online_units(tasks: Sequence[TaskRef], agents: Sequence[AgentSpec], schedules: Sequence[str],
                      horizons: Sequence[int], runs: int, done: set[tuple[str, int, str, int, str, str, int]],
                      root_seed: int = DEFAULT_ROOT_SEED, batch_size: int = DEFAULT_BATCH_SIZE) -> list[OnlineUnit]:
    """Units of the grid not in ``done``, in (task, level, schedule, horizon, run) order (so a worker's cached env
    serves consecutive units)."""
    units = []
    for task in tasks:
        for index, level in task_levels(task):
            for schedule in schedules:
                for horizon in horizons:
                    for run in range(runs):
                        todo = tuple(spec for spec in agents if (task.name, level, schedule, int(horizon), spec.name,
                                                                 spec.params_json, run) not in done)
                        if todo:
                            units.append(OnlineUnit(task, index, level, schedule, int(horizon), run, todo, root_seed,
                                                    batch_size))
    return units


@dataclass
class OnlineSweepSummary:
    """What an online sweep did: rows added now, rows already there, failures."""

    planned: int = 0
    skipped: int = 0
    added: int = 0
    failures: list[OnlineFailure] = field(default_factory=list)
    skipped_tasks: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return int(value)


def run_online_sweep(out_dir: str | os.PathLike[str], tasks: Sequence[TaskRef], agents: Sequence[AgentSpec],
                     schedules: Sequence[str] = DEFAULT_SCHEDULES, horizons: Sequence[int] = (DEFAULT_HORIZON,),
                     runs: int = DEFAULT_ONLINE_RUNS, *, jobs: int = 1, root_seed: int = DEFAULT_ROOT_SEED,
                     batch_size: int = DEFAULT_BATCH_SIZE, scheduler: str | None = None, log: TextIO | None = None,
                     bar: bool | None = None,
                     on_outcome: Callable[[OnlineOutcome], None] | None = None) -> OnlineSweepSummary:
    """Run (or continue) the online sweep into ``out_dir/results.sqlite`` (table ``online_runs``).

    ``jobs`` local worker processes, or a Dask ``scheduler`` (as ``run_sweep``). The batch size is a protocol
    parameter of the folder (stored in its meta table; continuing with another is refused, as a root seed).
    """
    log = log if log is not None else sys.stderr
    runs = _positive_int(runs, "runs")
    jobs = _positive_int(jobs, "jobs")
    batch_size = _positive_int(batch_size, "the batch size")
    horizons = [_positive_int(h, "the horizon (requests)") for h in horizons]
    if not horizons:
        raise ValueError("no horizon to run")
    if not agents:
        raise ValueError("no agents to run")
    check_unique_labels(list(agents))
    check_schedules(schedules, tasks)
    summary = OnlineSweepSummary()
    ready = available_tasks(tasks, log, summary.skipped_tasks)
    start = time.monotonic()
    with OnlineStore(out_dir) as store:
        store.claim_meta("root_seed", str(root_seed))
        store.claim_meta("online_batch_size", str(batch_size))
        units = plan_online_units(ready, agents, schedules, horizons, runs, store.online_done_keys(), root_seed,
                                  batch_size)
        pending = sum(len(u.agents) for u in units)
        summary.planned = (sum(len(task_levels(t)) for t in ready) * len(schedules) * len(horizons) * runs
                           * len(agents))
        summary.skipped = summary.planned - pending
        if summary.skipped:
            print(f"{summary.skipped} of {summary.planned} online runs already in {store.path}; skipping them",
                  file=log)
        if not units:
            return summary
        where = f"Dask scheduler {scheduler}" if scheduler else f"{jobs} worker process(es)" if jobs > 1 else "this process"
        print(f"running {pending} online runs ({len(units)} level-schedule-run units) on {where}", file=log, flush=True)
        stream = execute(units, _run_online_unit_safely, jobs, scheduler)
        progress = Progress(pending, log, bar)
        try:
            for outcome in stream:
                summary.added += store.add_online(outcome.results, [outcome.task_info] if outcome.task_info else [])
                summary.failures.extend(outcome.failures)
                for f in outcome.failures:
                    print(f"FAILED {f.task} level={f.level} schedule={f.schedule} T={f.horizon} {f.label} "
                          f"run={f.run}: {f.message}", file=log, flush=True)
                if on_outcome is not None:
                    on_outcome(outcome)
                u = outcome.unit
                progress.update(len(u.agents), f"{u.task.name} level {u.level} {u.schedule} run {u.run}")
        finally:
            stream.close()
            progress.close()
            summary.seconds = time.monotonic() - start
    return summary
