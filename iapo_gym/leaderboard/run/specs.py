"""What a leaderboard sweeps over: agent specs (name, parameters, label) and task references.

Agent spec syntax (one string per agent), split on ``:``; a last part containing ``=`` holds
the parameters ``key=value,key=value``:

- ``psst``                       a registered agent (``agents.available()``)
- ``psst_topk:k=4,rho=0.2``      a registered agent with parameters
- ``mypkg.module:MyAgent``       any class by import path (``module:Class``)
- ``mypkg.module:MyAgent:k=4``   an import path with parameters
- any of these + ``@label``      a display label (default ``name[k=v,...]``), e.g.
  ``psst_topk:k=4,rho=0.2@psst+K4``

Values are read as Python literals (``4``, ``0.2``, ``true``/``false``, ``none``, ``'text'``),
anything else stays a string.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from iapo_gym.tables import OutcomeTable, read_table
from iapo_gym.tasks import TASKS, get_task

#: The paper's budgets (section 5): completions per training run.
#: The protocol's root seed of every derived seed and the train share of each resplit.
DEFAULT_ROOT_SEED = 0
DEFAULT_TRAIN_FRACTION = 0.8
PAPER_BUDGETS: tuple[int, ...] = (3000, 5000, 10000, 20000, 30000, 40000)
#: The paper's number of independent runs per (task, agent, budget).
PAPER_RUNS = 200
#: The ten agents of the paper's figures, as agent specs with the paper's names as labels.
PAPER_AGENTS: tuple[str, ...] = (
    "psst",
    "psst_topk:k=1,rho=0.2@psst+K1",
    "psst_topk:k=4,rho=0.2@psst+K4",
    "psst_topk:k=8,rho=0.2@psst+K8",
    "uniform",
    "epsilon_greedy",
    "softmax",
    "ucb",
    "triple_n1",
    "triple_random_n",
)
_LITERALS = {"true": True, "false": False, "none": None, "null": None}


def _parse_value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in _LITERALS:
        return _LITERALS[lowered]
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def parse_params(text: str, where: str = "agent spec") -> dict[str, Any]:
    """``"k=4,rho=0.2"`` -> ``{"k": 4, "rho": 0.2}``; a ValueError names a malformed item."""
    params: dict[str, Any] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"{where}: parameter {item.strip()!r} must look like name=value")
        if key in params:
            raise ValueError(f"{where}: parameter {key!r} given twice")
        params[key] = _parse_value(value)
    return params


def _json_value(value: Any, where: str) -> Any:
    try:
        json.dumps(value)
    except TypeError:
        raise ValueError(f"{where}: parameter value {value!r} is not JSON-serializable") from None
    return value


@dataclass(frozen=True)
class AgentSpec:
    """One agent of a sweep: a registered name or ``module:Class`` path, its parameters and label."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    def __post_init__(self) -> None:
        """Fill the default label ``name[k=v,...]`` and check the parameters are JSON."""
        for key, value in self.params.items():
            _json_value(value, f"agent {self.name!r} parameter {key!r}")
        if not self.label:
            object.__setattr__(self, "label", default_label(self.name, self.params))

    @property
    def params_json(self) -> str:
        """Canonical JSON of the parameters (sorted keys): part of the results' unique key."""
        return json.dumps(self.params, sort_keys=True, separators=(",", ":"))

    @property
    def key(self) -> str:
        """Stable identity ``name`` + canonical params (seeds derive from it, not from the label)."""
        return f"{self.name}|{self.params_json}"

    @property
    def spec(self) -> str:
        """The spec string this agent parses from (label included)."""
        text = self.name
        if self.params:
            text += ":" + ",".join(f"{k}={v!r}" for k, v in self.params.items())
        if self.label != default_label(self.name, self.params):
            text += f"@{self.label}"
        return text


def default_label(name: str, params: dict[str, Any]) -> str:
    """Display label: ``psst_topk[k=4,rho=0.2]`` (the class name for import paths)."""
    base = name.rsplit(":", 1)[-1] if ":" in name else name
    if not params:
        return base
    return base + "[" + ",".join(f"{k}={v}" for k, v in params.items()) + "]"


def parse_agent_spec(text: str, label: str | None = None, registry: Mapping[str, Any] | None = None) -> AgentSpec:
    """Parse one agent spec string (see the module docstring); ``label`` overrides the display label.

    ``registry``: the names a plain name may take (default: the offline agents' ``agents.REGISTRY``; the online
    protocol passes ``agents.online.ONLINE_REGISTRY``)."""
    raw = text.strip()
    if "@" in raw:
        raw, _, suffix = raw.rpartition("@")
        raw = raw.strip()
        if not suffix.strip():
            raise ValueError(f"agent spec {text!r}: empty label after '@'")
        label = label or suffix.strip()
    if not raw:
        raise ValueError("empty agent spec; expected e.g. 'psst', 'psst_topk:k=4,rho=0.2' or 'pkg.mod:Class'")
    parts = raw.split(":")
    params: dict[str, Any] = {}
    if len(parts) > 1 and "=" in parts[-1]:
        params = parse_params(parts[-1], where=f"agent spec {raw!r}")
        parts = parts[:-1]
    if any(not p.strip() for p in parts) or len(parts) > 2:
        raise ValueError(f"agent spec {raw!r} must be 'name', 'name:k=v,...', 'module:Class' or 'module:Class:k=v,...'")
    name = ":".join(p.strip() for p in parts)
    if len(parts) == 1:
        from agents import REGISTRY

        names = REGISTRY if registry is None else registry
        if name not in names:
            raise ValueError(f"unknown agent {name!r} in spec {raw!r}; registered: {', '.join(sorted(names))} "
                             "(or give an import path 'module:Class')")
    else:
        from agents.base import load_class

        try:
            load_class(name)
        except ImportError as exc:
            raise ValueError(f"agent spec {raw!r}: cannot import module {parts[0]!r} ({exc})") from None
    return AgentSpec(name, params, label or "")


def check_unique_labels(specs: list[AgentSpec]) -> None:
    """Labels name the agents in reports, so two different specs may not share one."""
    seen: dict[str, AgentSpec] = {}
    for spec in specs:
        other = seen.get(spec.label)
        if other is not None and other.key != spec.key:
            raise ValueError(f"agents {other.spec!r} and {spec.spec!r} share the label {spec.label!r}")
        seen[spec.label] = spec


# ---- tasks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskRef:
    """A task of the sweep: a registered task name, an explicit table file (resplit per run) or generated levels.

    Generated levels (``family`` and ``levels``, first and last included): a range gives one level per run index
    (run r is level first + r, with its stored split); a single level is one table, resplit per run.
    """

    name: str
    synthetic: bool = False
    path: str | None = None
    title: str = ""
    family: str | None = None
    levels: tuple[int, int] | None = None

    def load(self, run: int) -> OutcomeTable:
        """The table of run ``run``: instance ``run`` of a synthetic family, level first + ``run`` of a generated
        range, else the task's one table."""
        if self.path is not None:
            return read_table(self.path)
        if self.family is not None and self.levels is not None:
            from iapo_gym.tasks.generated import level_table

            first, last = self.levels
            if self.synthetic and not 0 <= run <= last - first:
                raise ValueError(f"task {self.name!r} has {last - first + 1} levels: run {run} does not exist")
            return level_table(self.family, first + run if self.synthetic else first)
        from iapo_gym.data import load_task_table

        return load_task_table(self.name, instance=run if self.synthetic else 0)

    def run_count(self, runs: int) -> int:
        """Run indices of this task in a sweep of ``runs``: one per level of a generated range, else ``runs``."""
        if self.synthetic and self.levels is not None:
            return self.levels[1] - self.levels[0] + 1
        return runs


GENERATED_PREFIX = "generated:"


def resolve_generated(text: str) -> TaskRef:
    """``generated:FAMILY:LEVELS``: LEVELS ``A-B`` (or ``A:B``, both included) gives one level per run index;
    a single level ``A`` is one table resplit per run. A FamilyError lists the families or the level ranges."""
    from iapo_gym.tasks.generated import FamilyError, get_family, parse_levels

    family_text, sep, levels_text = text[len(GENERATED_PREFIX):].partition(":")
    if not sep or not levels_text.strip():
        raise FamilyError(f"task {text!r} must look like generated:FAMILY:LEVELS, e.g. "
                          "generated:bon_shape:1000000-1000099 (one level per run) or generated:bon_shape:5 "
                          "(one level, resplit per run)")
    family = get_family(family_text).name
    levels = parse_levels(levels_text)
    first, last = levels[0], levels[-1]
    is_range = any(mark in levels_text.strip().lstrip("-") for mark in ":-")
    if not is_range:
        return TaskRef(name=f"{GENERATED_PREFIX}{family}:{first}", title=f"{family} level {first}",
                       family=family, levels=(first, first))
    return TaskRef(name=f"{GENERATED_PREFIX}{family}:{first}-{last}", synthetic=True,
                   title=f"{family} levels {first}-{last}", family=family, levels=(first, last))


def resolve_task(text: str) -> TaskRef:
    """A TaskRef from a task short name / title / Gymnasium id, ``generated:FAMILY:LEVELS``, or a path to an
    ``.h5`` table file."""
    if text.strip().lower().startswith(GENERATED_PREFIX):
        return resolve_generated(text.strip())
    candidate = Path(os.path.expanduser(text))
    if candidate.suffix in (".h5", ".hdf5") or candidate.is_file():
        if not candidate.is_file():
            raise ValueError(f"table file {text!r} does not exist")
        return TaskRef(name=candidate.stem, path=str(candidate.resolve()), title=candidate.stem)
    spec = get_task(text)
    return TaskRef(name=spec.name, synthetic=spec.synthetic, title=spec.title)


def task_available(ref: TaskRef) -> str | None:
    """None if the task's table can be had here (found, or fetched now when downloads are allowed),
    else the data layer's message saying why not and how to get it."""
    if ref.path is not None or ref.synthetic or ref.family is not None:
        return None
    from iapo_gym.data import MissingTableError, resolve_table
    from iapo_gym.data.download import DownloadError

    try:
        resolve_table(TASKS[ref.name])
    except (MissingTableError, DownloadError, OSError, ValueError) as exc:
        return f"skipping task {ref.name!r}: {exc}"
    return None


def available_tasks(tasks: Sequence[TaskRef], log: TextIO, skipped: list[str]) -> list[TaskRef]:
    """The ``tasks`` whose tables can be had here (``task_available``); each other one's reason goes to ``log`` and its
    name to ``skipped`` (a sweep runs what it can and says what it could not)."""
    ready = []
    for task in tasks:
        why = task_available(task)
        if why is None:
            ready.append(task)
        else:
            print(why, file=log, flush=True)
            skipped.append(task.name)
    return ready


def table_checksum(table: OutcomeTable) -> str:
    """sha256 over the arrays that define the task (probabilities, outcomes, costs, contexts, split)."""
    h = hashlib.sha256()
    h.update(f"{table.task}|{table.aggregator}|{table.n_max}".encode())
    for array in (table.probs, table.cost, table.context_weights, table.context_probs,
                  table.atoms, table.gold, table.split):
        if array is None:
            h.update(b"-")
            continue
        a = np.ascontiguousarray(array)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()
