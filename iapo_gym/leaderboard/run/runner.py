"""The sweep: every (task, agent, budget, run) of the paper's protocol, resumable and parallel.

Work is grouped into units of one (task, run): the unit loads (or reuses) the run's table,
makes the run's 80/20 split and its exact train/test Q-tables once, then trains every
pending (agent, budget) on a fresh train-split env. Seeds (``iapo_gym.seeding``):

- split seed  ``derive_seed(root, "split", task, run)``  (data-backed tasks and single generated
  levels; synthetic tasks use instance ``run`` and its stored split, generated level ranges level
  first + ``run`` and its stored split);
- env seed    ``derive_seed(root, "env", task, run)``    the same for every agent and budget
  of a run (common random numbers: paired comparisons see the same query/completion stream);
- agent seed  ``derive_seed(root, "agent", task, run, agent key)``  (name + canonical params,
  not the display label; independent of the budget).

Results therefore do not depend on the number, kind or order of workers.

With ``rules`` (``iapo-gym leaderboard --rules``) the arm set is (prompt, N, stopping rule): every env is built with
``rule_arms=True``, the Q-tables are ``q_table(..., rules=True)`` (the ceiling is the optimum over the enlarged set),
and each row records the arm set (``RunResult.arm_set``) and the policy's rules (``arms`` as (p, N, r)).
"""

from __future__ import annotations

import inspect
import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from iapo_gym._version import __version__
from iapo_gym.env import IAPOEnv
from iapo_gym.leaderboard.run.specs import (
    DEFAULT_ROOT_SEED,
    DEFAULT_TRAIN_FRACTION,
    AgentSpec,
    TaskRef,
    available_tasks,
    check_unique_labels,
    table_checksum,
)
from iapo_gym.leaderboard.run.store import ResultStore, RunResult, TaskInfo
from iapo_gym.oracle import acr_from_q, greedy_policy, policy_arms, q_table
from iapo_gym.progress import Progress
from iapo_gym.rules import default_rules, rule_label
from iapo_gym.seeding import derive_seed
from iapo_gym.tables import OutcomeTable


@dataclass(frozen=True)
class WorkUnit:
    """One (task, run) and the (agent, budget) pairs still to do for it."""

    task: TaskRef
    run: int
    jobs: tuple[tuple[AgentSpec, int], ...]
    root_seed: int = DEFAULT_ROOT_SEED
    train_fraction: float = DEFAULT_TRAIN_FRACTION
    #: The arm set: False, the paper's (p, N); True, (p, N, stopping rule) over the table's ``default_rules``.
    rules: bool = False


@dataclass(frozen=True)
class Failure:
    """A (task, agent, budget, run) that raised or broke the protocol (nothing is stored for it)."""

    task: str
    label: str
    budget: int
    run: int
    message: str


@dataclass
class UnitOutcome:
    """What a worker sends back for one unit."""

    unit: WorkUnit
    results: list[RunResult] = field(default_factory=list)
    task_info: TaskInfo | None = None
    failures: list[Failure] = field(default_factory=list)


#: The ``arm_set`` meta value of a results folder: the paper's (p, N) arms, or (p, N, stopping rule) (``--rules``).
ARM_SETS = {False: "fixed", True: "rules"}


class BudgetExceededError(RuntimeError):
    """An agent drew more completions than its budget."""


# ---- worker side ----------------------------------------------------------------------------

_TABLE_CACHE: OrderedDict[tuple[str, str | None, int], tuple[OutcomeTable, str]] = OrderedDict()
_TABLE_CACHE_SIZE = 2


def _load(task: TaskRef, run: int) -> tuple[OutcomeTable, str]:
    """The run's table and its checksum, reused across units in this worker process.

    The table's derived arrays (alias sampler, exact per-query rewards) are cached on it.
    """
    key = (task.name, task.path, run if task.synthetic else 0)
    if key in _TABLE_CACHE:
        _TABLE_CACHE.move_to_end(key)
        return _TABLE_CACHE[key]
    table = task.load(run)
    entry = (table, table_checksum(table))
    _TABLE_CACHE[key] = entry
    while len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        _TABLE_CACHE.popitem(last=False)
    return entry


def _accepts_seed(cls: type) -> bool:
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "seed" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def build_agent(spec: AgentSpec, seed: int) -> Any:
    """Instantiate ``spec`` with its derived ``seed`` (passed when the class takes ``seed``)."""
    from agents import make
    from agents.base import REGISTRY, load_class

    if "seed" in spec.params:
        raise ValueError(f"agent {spec.label!r}: 'seed' is derived by the leaderboard (use --seed), not an agent parameter")
    cls = load_class(REGISTRY[spec.name][0] if spec.name in REGISTRY else spec.name)
    params = dict(spec.params)
    if _accepts_seed(cls):
        params["seed"] = seed
    return make(spec.name, **params)


@dataclass(frozen=True)
class RunSetup:
    """What every agent of one (task, run) shares: the table, the run's split of it and the seeds."""

    table: OutcomeTable
    checksum: str
    run_table: OutcomeTable
    split_seed: int | None
    env_seed: int


def run_setup(task: TaskRef, run: int, root_seed: int = DEFAULT_ROOT_SEED,
              train_fraction: float = DEFAULT_TRAIN_FRACTION) -> RunSetup:
    """The run's table and split (the seeds of the module docstring); ``iapo-gym optimize`` uses it too."""
    table, checksum = _load(task, run)
    split_seed: int | None = None
    if task.synthetic and table.split is not None:
        run_table = table
    else:
        split_seed = derive_seed(root_seed, "split", task.name, run)
        splitter = IAPOEnv(table=table)
        splitter.resplit(train_fraction, split_seed)
        assert isinstance(splitter.table, OutcomeTable)  # a table env's resplit keeps its outcome distributions
        run_table = splitter.table
    return RunSetup(table, checksum, run_table, split_seed, derive_seed(root_seed, "env", task.name, run))


def arm_set_json(aggregator: str) -> str:
    """What a run over (p, N, rule) records as its arm set: JSON of the labels of the aggregator's stopping rules
    (``iapo_gym.rules.rule_label`` of ``default_rules``, rule 0 first), the index a policy's rule refers to."""
    return json.dumps([rule_label(r) for r in default_rules(aggregator)])


def agent_seed_for(root_seed: int, task: str, run: int, spec: AgentSpec) -> int:
    """The agent's seed in one (task, run): from its name and canonical parameters, not its label."""
    return derive_seed(root_seed, "agent", task, run, spec.key)


def run_unit(unit: WorkUnit) -> UnitOutcome:
    """Run every pending (agent, budget) of one (task, run); errors become Failures, not exceptions."""
    outcome = UnitOutcome(unit)
    task = unit.task
    setup = run_setup(task, unit.run, unit.root_seed, unit.train_fraction)
    table, checksum, run_table, split_seed = setup.table, setup.checksum, setup.run_table, setup.split_seed
    outcome.task_info = TaskInfo(task.name, checksum, task.title or task.name, table.aggregator,
                                 table.n_prompts, table.n_max, tuple(table.context_names))
    probs = run_table.context_probs
    rules = unit.rules
    q_test = q_table(run_table, run_table.split_indices("test"), rules=rules)
    q_train = q_table(run_table, run_table.split_indices("train"), rules=rules)
    if rules:  # the ceiling is the optimum over the enlarged arm set (p, N, rule)
        optimal = np.array(greedy_policy(q_test).triples, dtype=np.int64)
        train_optimal = np.array(greedy_policy(q_train).triples, dtype=np.int64)
    else:
        optimal = np.array(greedy_policy(q_test).arms, dtype=np.int64)
        train_optimal = np.array(greedy_policy(q_train).arms, dtype=np.int64)
    optimal_acr = acr_from_q(q_test, optimal, probs)
    train_optimal_acr = acr_from_q(q_test, train_optimal, probs)
    optimal_json = json.dumps(optimal.tolist())
    env_seed = setup.env_seed
    context = _UnitContext(task.name, checksum, unit, split_seed, env_seed, run_table, q_test, probs,
                           optimal_acr, train_optimal_acr, optimal_json,
                           arm_set_json(run_table.aggregator) if rules else None)
    by_label: dict[str, tuple[AgentSpec, list[int]]] = {}  # labels are unique in a sweep
    for spec, budget in unit.jobs:
        by_label.setdefault(spec.label, (spec, []))[1].append(budget)
    for spec, budgets in by_label.values():
        agent_seed = agent_seed_for(unit.root_seed, task.name, unit.run, spec)
        try:
            agent = build_agent(spec, agent_seed)
        except Exception as exc:
            outcome.failures.extend(_failure(context, spec, b, exc) for b in budgets)
            continue
        if len(budgets) > 1 and _shares_trajectory(agent, context.table):
            _run_shared(context, spec, budgets, agent, agent_seed, outcome)
        else:
            for budget in budgets:
                _run_one(context, spec, budget, agent_seed, outcome)
    return outcome


def _shares_trajectory(agent: Any, table: OutcomeTable) -> bool:
    """Whether ``agent`` gives every budget's policy from one trajectory on ``table``: an anytime agent, unless its
    optional ``shares_trajectory(table)`` says it trains each budget on its own there (then each budget is trained
    and timed alone, as any agent's)."""
    from agents.base import AnytimeAgent

    if not (isinstance(agent, AnytimeAgent) and agent.anytime):
        return False
    ask = getattr(agent, "shares_trajectory", None)
    return True if ask is None else bool(ask(table))


@dataclass(frozen=True)
class _UnitContext:
    """What every (agent, budget) of one (task, run) is evaluated against."""

    task: str
    checksum: str
    unit: WorkUnit
    split_seed: int | None
    env_seed: int
    table: OutcomeTable
    q_test: np.ndarray
    probs: np.ndarray
    optimal_acr: float
    train_optimal_acr: float
    optimal_json: str
    #: ``arm_set_json`` of a run over (p, N, rule) (``--rules``); None for the paper's (p, N).
    arm_set: str | None = None

    def env(self) -> IAPOEnv:
        """A fresh train-split env of the run's table and arm set, reset with the run's env seed."""
        env = IAPOEnv(table=self.table, rule_arms=self.arm_set is not None)
        env.reset(seed=self.env_seed)
        return env

    def result(self, spec: AgentSpec, budget: int, agent_seed: int, policy: Any, seconds: float,
               spent: int, effective_params: str | None) -> RunResult:
        """The stored row of one trained policy (the budget is checked against the meter first)."""
        if spent > budget:
            raise BudgetExceededError(f"drew {spent} completions with a budget of {budget}")
        arms = policy_arms(policy, self.table)
        if self.arm_set is not None and arms.shape[1] == 2:  # a run over rules records each context's rule
            arms = np.column_stack([arms, np.zeros(len(arms), dtype=np.int64)])
        if self.arm_set is None and arms.shape[1] == 3:
            raise ValueError(f"the policy stops by rules {[int(r) for r in arms[:, 2]]} in a run over the paper's "
                             "(p, N) arms; stopping rules are arms only with --rules")
        acr = acr_from_q(self.q_test, arms, self.probs)
        return RunResult(
            task=self.task, table_sha256=self.checksum, agent=spec.name, params=spec.params_json, label=spec.label,
            budget=budget, run=self.unit.run, root_seed=self.unit.root_seed, split_seed=self.split_seed,
            env_seed=self.env_seed, agent_seed=agent_seed, acr=acr, optimal_acr=self.optimal_acr,
            train_optimal_acr=self.train_optimal_acr, regret=self.optimal_acr - acr, arms=json.dumps(arms.tolist()),
            optimal_arms=self.optimal_json, train_seconds=seconds, budget_spent=spent, version=__version__,
            effective_params=effective_params, arm_set=self.arm_set,
        )


def effective_params_json(agent: Any) -> str | None:
    """Canonical JSON of ``agent.params()`` (its effective parameters, defaults included); None without ``params``.

    NumPy scalars and arrays become numbers and lists; any other value that JSON cannot hold, its ``repr``.
    """
    params = getattr(agent, "params", None)
    if not callable(params):
        return None

    def plain(value: Any) -> Any:
        if isinstance(value, (np.generic, np.ndarray)):
            return value.tolist()
        return repr(value)

    return json.dumps(params(), sort_keys=True, default=plain)


def _failure(context: _UnitContext, spec: AgentSpec, budget: int, exc: BaseException) -> Failure:
    detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return Failure(context.task, spec.label, budget, context.unit.run, detail)


def _run_one(context: _UnitContext, spec: AgentSpec, budget: int, agent_seed: int, outcome: UnitOutcome) -> None:
    """A fresh agent on a freshly seeded env, trained for one budget."""
    try:
        env = context.env()
        agent = build_agent(spec, agent_seed)
        effective = effective_params_json(agent)
        start = time.perf_counter()
        policy = agent.train(env, budget)
        seconds = time.perf_counter() - start
        outcome.results.append(context.result(spec, budget, agent_seed, policy, seconds, env.completions_drawn,
                                              effective))
    except Exception as exc:  # one broken agent must not stop the sweep
        outcome.failures.append(_failure(context, spec, budget, exc))


def _run_shared(context: _UnitContext, spec: AgentSpec, budgets: list[int], agent: Any, agent_seed: int,
                outcome: UnitOutcome) -> None:
    """A freshly built anytime agent's budgets from one trajectory (``train_budgets``): the rows of fresh runs.

    Each row's ``train_seconds`` is the trajectory's time up to that budget's policy; the
    meter is restored with the env around each branch, so ``budget_spent`` is the branch's own.
    """
    env = context.env()
    pending = sorted(budgets)
    seconds = 0.0
    try:
        effective = effective_params_json(agent)
        policies = iter(agent.train_budgets(env, pending))
        while pending:
            start = time.perf_counter()
            budget, policy = next(policies)
            seconds += time.perf_counter() - start
            if budget != pending[0]:
                raise RuntimeError(f"train_budgets returned budget {budget}, expected {pending[0]}")
            pending.pop(0)
            try:
                outcome.results.append(context.result(spec, budget, agent_seed, policy, seconds, env.completions_drawn,
                                                      effective))
            except Exception as exc:
                outcome.failures.append(_failure(context, spec, budget, exc))
    except Exception as exc:  # the budgets not reached fail with the trajectory's error
        outcome.failures.extend(_failure(context, spec, b, exc) for b in pending)


def _run_unit_safely(unit: WorkUnit) -> UnitOutcome:
    """``run_unit``, with a failure of the unit itself (e.g. an unreadable table) reported per job."""
    try:
        return run_unit(unit)
    except Exception as exc:
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return UnitOutcome(unit, failures=[Failure(unit.task.name, s.label, b, unit.run, detail) for s, b in unit.jobs])


# ---- planning --------------------------------------------------------------------------------


def plan_units(tasks: Sequence[TaskRef], agents: Sequence[AgentSpec], budgets: Sequence[int], runs: int,
               done: set[tuple[str, str, str, int, int]], root_seed: int = DEFAULT_ROOT_SEED,
               train_fraction: float = DEFAULT_TRAIN_FRACTION, rules: bool = False) -> list[WorkUnit]:
    """Units of the (task, agent, budget, run) grid not in ``done``, in (task, run) order."""
    units = []
    for task in tasks:
        for run in range(task.run_count(runs)):
            jobs = tuple((spec, int(b)) for spec in agents for b in budgets
                         if (task.name, spec.name, spec.params_json, int(b), run) not in done)
            if jobs:
                units.append(WorkUnit(task, run, jobs, root_seed, train_fraction, rules))
    return units


# ---- executors -------------------------------------------------------------------------------


def _serial(units: Sequence[Any], fn: Callable[[Any], Any] = _run_unit_safely) -> Generator[Any, None, None]:
    for unit in units:
        yield fn(unit)


def _ignore_sigint() -> None:
    """Pool workers leave Ctrl-C to the parent, which terminates them at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _local_pool(units: Sequence[Any], jobs: int,
                fn: Callable[[Any], Any] = _run_unit_safely) -> Generator[Any, None, None]:
    pool = multiprocessing.get_context().Pool(processes=jobs, initializer=_ignore_sigint)
    try:
        yield from pool.imap_unordered(fn, units, chunksize=1)
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()


def _dask(units: Sequence[Any], scheduler: str, jobs: int,
          fn: Callable[[Any], Any] = _run_unit_safely) -> Generator[Any, None, None]:
    try:
        from distributed import Client, LocalCluster
        from distributed import as_completed as dask_as_completed
    except ImportError:
        raise RuntimeError('the Dask backend needs `pip install "dask[distributed]"`') from None
    cluster = None
    if scheduler == "local":
        cluster = LocalCluster(n_workers=jobs, threads_per_worker=1, processes=True, dashboard_address=None)
        client = Client(cluster)
    else:
        client = Client(scheduler)
    try:
        futures = [client.submit(fn, u, pure=False) for u in units]
        try:
            for future in dask_as_completed(futures):
                yield future.result()
        except BaseException:
            client.cancel(futures)
            raise
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def execute(units: Sequence[Any], fn: Callable[[Any], Any], jobs: int = 1,
            scheduler: str | None = None) -> Generator[Any, None, None]:
    """``fn`` over ``units`` on a Dask ``scheduler``, ``jobs`` local processes, or in this process (jobs 1), as the
    outcomes finish; the online protocol's sweep (``online.py``) runs its units through it."""
    if scheduler:
        return _dask(units, scheduler, jobs, fn)
    if jobs > 1:
        return _local_pool(units, jobs, fn)
    return _serial(units, fn)


# ---- the sweep -------------------------------------------------------------------------------


@dataclass
class SweepSummary:
    """What a sweep did: rows added now, rows that were already there, failures."""

    planned: int = 0
    skipped: int = 0
    added: int = 0
    failures: list[Failure] = field(default_factory=list)
    skipped_tasks: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_sweep(out_dir: str | os.PathLike[str], tasks: Sequence[TaskRef], agents: Sequence[AgentSpec],
              budgets: Sequence[int], runs: int, *, jobs: int = 1, root_seed: int = DEFAULT_ROOT_SEED,
              train_fraction: float = DEFAULT_TRAIN_FRACTION, scheduler: str | None = None,
              log: TextIO | None = None, bar: bool | None = None,
              on_outcome: Callable[[UnitOutcome], None] | None = None, rules: bool = False) -> SweepSummary:
    """Run (or continue) the sweep into ``out_dir/results.sqlite``; finished rows are skipped.

    ``jobs`` local worker processes (1: in this process), or ``scheduler`` = a Dask scheduler
    address (``tcp://host:port``) or ``"local"`` (a Dask LocalCluster of ``jobs`` workers).
    ``rules``: the arm set is (p, N, stopping rule) (``--rules``): the agents train on envs with
    ``rule_arms=True`` and are scored, with the optimum, by ``q_table(rules=True)``. A results folder holds one
    arm set (its meta ``arm_set``, ``fixed`` or ``rules``); the other is refused there.
    """
    log = log if log is not None else sys.stderr
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    bad = [b for b in budgets if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1]
    if bad or not budgets:
        raise ValueError(f"budgets must be integers >= 1 (completions), got {list(budgets)}")
    if not agents:
        raise ValueError("no agents to run")
    check_unique_labels(list(agents))
    summary = SweepSummary()
    ready = available_tasks(tasks, log, summary.skipped_tasks)
    start = time.monotonic()
    with ResultStore(out_dir) as store:
        store.claim_meta("root_seed", str(root_seed))
        store.claim_meta("train_fraction", repr(float(train_fraction)))
        if store.get_meta("arm_set") is None and store.count():
            store.claim_meta("arm_set", ARM_SETS[False])  # written before arm sets were recorded: (p, N) runs
        store.claim_meta("arm_set", ARM_SETS[bool(rules)])
        done = store.done_keys()
        units = plan_units(ready, agents, budgets, runs, done, root_seed, train_fraction, rules)
        pending = sum(len(u.jobs) for u in units)
        summary.planned = sum(task.run_count(runs) for task in ready) * len(agents) * len(budgets)
        summary.skipped = summary.planned - pending
        if summary.skipped:
            print(f"{summary.skipped} of {summary.planned} runs already in {store.path}; skipping them", file=log)
        if not units:
            return summary
        where = f"Dask scheduler {scheduler}" if scheduler else f"{jobs} worker process(es)" if jobs > 1 else "this process"
        print(f"running {pending} runs ({len(units)} task-run units) on {where}", file=log, flush=True)
        if scheduler:
            stream = _dask(units, scheduler, jobs)
        elif jobs > 1:
            stream = _local_pool(units, jobs)
        else:
            stream = _serial(units)
        progress = Progress(pending, log, bar)
        try:
            for outcome in stream:
                summary.added += store.add(outcome.results, [outcome.task_info] if outcome.task_info else [])
                summary.failures.extend(outcome.failures)
                for failure in outcome.failures:
                    print(f"FAILED {failure.task} {failure.label} budget={failure.budget} run={failure.run}: "
                          f"{failure.message}", file=log, flush=True)
                if on_outcome is not None:
                    on_outcome(outcome)
                progress.update(len(outcome.unit.jobs), f"{outcome.unit.task.name} run {outcome.unit.run}")
        finally:
            stream.close()
            progress.close()
            summary.seconds = time.monotonic() - start
    return summary
