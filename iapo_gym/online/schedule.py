"""Schedules of the online protocol: how a level's table changes over the T requests of a run.

A schedule is a seeded part of a level (its draws come from ``derive_rng(ONLINE_ROOT_SEED, kind, task)``, never
from the run's seed) and is cut into a few segments; within a segment the outcome distributions and the set of
available prompts are fixed, so the exact tensor is computed once per segment. Kinds (docs/online.md):

- ``stationary``: one segment, the level's table throughout.
- ``drift``: a drawn share of the prompts move toward a second draw of the family's model
  (``iapo_gym.tasks.generated.redraw_table``): their outcome distributions are the mixture
  ``(1 - w) * level + w * redraw``, w stepping from 0 to a drawn strength at a change point, or ramping to it in
  ``RAMP_SEGMENTS`` steps. The distributions are mixed, not the Q-values: majority vote and Best-of-N are not
  linear in the distribution at N > 1.
- ``arrival``: a drawn share of the prompts are unavailable until their arrival step (one to three arrival
  steps); they keep their own costs.
- ``context_shift``: the context mix changes at a change point, from the table's ``context_probs`` to a
  Dirichlet(1) draw; the outcome distributions (so every Q) stay the level's.
- ``retirement``: a drawn share of the prompts are removed at their retirement step (one to three steps); at least
  one prompt stays to the end.
- ``model_arrival``: a new model arrives at a drawn step: the run's table grows by a copy of every prompt whose
  outcome distributions are a second draw of the family's model (``redraw_table(family, level, "model")``) and whose
  cost is the level's times a drawn factor; those prompts are unavailable before the arrival step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from iapo_gym.seeding import derive_rng
from iapo_gym.tables import OutcomeTable

SCHEDULES = ("stationary", "drift", "arrival", "context_shift", "retirement", "model_arrival")
ONLINE_ROOT_SEED = 20_261_128
#: Segments of a drift ramp (the mixture weight takes this many values on the way to its strength).
RAMP_SEGMENTS = 4
#: Ranges (inclusive) the schedules draw from; steps are fractions of the horizon.
DRIFT_SHARE = (0.25, 0.75)  # share of prompts that drift (at least one)
DRIFT_AT = (0.3, 0.6)  # the change point (a ramp starts here)
DRIFT_STRENGTH = (0.5, 1.0)  # the mixture weight of the redraw after the change
DRIFT_RAMP = (0.1, 0.3)  # a ramp's length; half the levels step, half ramp
ARRIVAL_SHARE = (0.2, 0.5)  # share of prompts that arrive late (at least one, never all)
ARRIVAL_AT = (0.1, 0.7)  # their arrival steps
SHIFT_AT = (0.3, 0.6)  # the context mix's change point
RETIRE_SHARE = (0.2, 0.5)  # share of prompts retired during the run (at least one, never all)
RETIRE_AT = (0.2, 0.8)  # their retirement steps
MODEL_AT = (0.2, 0.6)  # the new model's arrival step
MODEL_COST = (0.5, 2.0)  # its cost per completion: the level's times this factor


class ScheduleError(ValueError):
    """An unknown schedule, or one that cannot apply to a table (``drift`` needs a generated family)."""


@dataclass(frozen=True)
class Segment:
    """Requests ``start`` .. ``stop - 1``: the drift mixture weight, the available prompts (P,) bool and the
    context distribution (C,) the requests' contexts are drawn from (None: the table's ``context_probs``)."""

    start: int
    stop: int
    weight: float
    available: np.ndarray
    context_probs: np.ndarray | None = None


@dataclass(frozen=True)
class Schedule:
    """A schedule over ``horizon`` requests: its kind, the drawn parameters, the segments in order.

    ``drifting`` (P,) marks the prompts that mix toward ``target`` (the redraw; None unless ``drift``);
    ``arrival`` (P,) is each prompt's first available step (0 for the prompts present from the start);
    ``retired`` (P,) the step from which a prompt is no longer available (None: every prompt to the end);
    ``grown`` the table the run serves when the schedule adds prompts (``model_arrival``: the level's prompts, then
    the new model's), None when it is the level's.
    """

    kind: str
    horizon: int
    params: dict[str, float]
    segments: tuple[Segment, ...]
    drifting: np.ndarray
    arrival: np.ndarray
    target: OutcomeTable | None = None
    retired: np.ndarray | None = None
    grown: OutcomeTable | None = None

    def segment_at(self, t: int) -> int:
        """Index of the segment holding request ``t``."""
        for k in range(len(self.segments) - 1, -1, -1):
            if self.segments[k].start <= t:
                return k
        raise ValueError(f"request {t} is before the first segment")

    def table_at(self, table: OutcomeTable, segment: int) -> OutcomeTable:
        """The table of ``segment``: the level's, with the drifting prompts' distributions mixed toward ``target``."""
        weight = self.segments[segment].weight
        if weight == 0.0 or self.target is None:
            return table
        probs = table.probs.copy()
        d = self.drifting
        probs[d] = (1.0 - weight) * table.probs[d] + weight * self.target.probs[d]
        return replace(table, probs=probs, task=f"{table.task}:{self.kind}:w={weight:.6g}")


def _fraction(rng: np.random.Generator, bounds: tuple[float, float]) -> float:
    return float(rng.uniform(bounds[0], bounds[1]))


def build_schedule(kind: str, table: OutcomeTable, horizon: int) -> Schedule:
    """The ``kind`` schedule of ``table`` over ``horizon`` requests (drawn from the table's task name).

    ``drift`` needs a generated level (``attrs`` family and level) to redraw; the others apply to any table.
    """
    if kind not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {kind!r}; schedules: {', '.join(SCHEDULES)}")
    if isinstance(horizon, bool) or not isinstance(horizon, (int, np.integer)) or horizon < 1:
        raise ScheduleError(f"horizon must be an integer >= 1 (requests), got {horizon!r}")
    horizon = int(horizon)
    n_p = table.n_prompts
    rng = derive_rng(ONLINE_ROOT_SEED, kind, table.task)
    everyone = np.ones(n_p, dtype=bool)
    none = np.zeros(n_p, dtype=bool)
    arrival = np.zeros(n_p, dtype=np.int64)
    if kind == "stationary":
        return Schedule(kind, horizon, {}, (Segment(0, horizon, 0.0, everyone),), none, arrival)
    if kind == "drift":
        return _drift(table, horizon, rng)
    if kind == "retirement":
        return _retirement(table, horizon, rng)
    if kind == "model_arrival":
        return _model_arrival(table, horizon, rng)
    if kind == "context_shift":
        if table.n_contexts < 2:
            raise ScheduleError(f"context_shift needs at least 2 contexts, {table.task} has {table.n_contexts}")
        at = _fraction(rng, SHIFT_AT)
        mix = rng.dirichlet(np.ones(table.n_contexts))
        cut = int(at * horizon)
        if not 0 < cut < horizon:  # a horizon too short to cut: the table's mix throughout
            return Schedule(kind, horizon, {"at": at}, (Segment(0, horizon, 0.0, everyone),), none, arrival)
        shifted = (Segment(0, cut, 0.0, everyone), Segment(cut, horizon, 0.0, everyone, mix))
        return Schedule(kind, horizon, {"at": at}, shifted, none, arrival)
    share = _fraction(rng, ARRIVAL_SHARE)
    n_late = min(n_p - 1, max(1, round(share * n_p)))
    if n_late < 1:
        raise ScheduleError(f"arrival needs at least 2 prompts, {table.task} has {n_p}")
    late = rng.permutation(n_p)[:n_late]
    times = np.sort(np.unique((horizon * rng.uniform(*ARRIVAL_AT, int(rng.integers(1, 4)))).astype(np.int64)))
    times = times[(times > 0) & (times < horizon)]
    if times.size == 0:  # a horizon too short to cut: everyone from the start
        return Schedule(kind, horizon, {"share": share}, (Segment(0, horizon, 0.0, everyone),), none, arrival)
    arrival[late] = times[rng.integers(times.size, size=n_late)]
    bounds = [0, *np.unique(arrival[arrival > 0]).tolist(), horizon]
    segments = tuple(Segment(a, b, 0.0, arrival <= a) for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    return Schedule(kind, horizon, {"share": share}, segments, none, arrival)


def _drift(table: OutcomeTable, horizon: int, rng: np.random.Generator) -> Schedule:
    from iapo_gym.tasks.generated import redraw_table

    family, level = table.attrs.get("family"), table.attrs.get("level")
    if family is None or level is None:
        raise ScheduleError(f"the drift schedule redraws a generated family's model; {table.task} is not a "
                            "generated level (use family=..., level=...)")
    n_p = table.n_prompts
    share, at, strength = _fraction(rng, DRIFT_SHARE), _fraction(rng, DRIFT_AT), _fraction(rng, DRIFT_STRENGTH)
    ramp = _fraction(rng, DRIFT_RAMP) if rng.random() < 0.5 else 0.0
    drifting = np.zeros(n_p, dtype=bool)
    drifting[rng.permutation(n_p)[: max(1, round(share * n_p))]] = True
    everyone = np.ones(n_p, dtype=bool)
    start = int(at * horizon)
    steps = RAMP_SEGMENTS if ramp > 0 else 1
    length = int(ramp * horizon)
    cuts = sorted({min(horizon, start + (length * k) // steps) for k in range(steps)} - {0, horizon})
    weights = [strength * (k + 1) / len(cuts) for k in range(len(cuts))]
    bounds = [0, *cuts, horizon]
    ws = [0.0, *weights]
    segments = tuple(Segment(a, b, w, everyone) for a, b, w in zip(bounds[:-1], bounds[1:], ws, strict=True))
    target = redraw_table(str(family), int(level), "drift")
    params = {"share": share, "at": at, "strength": strength, "ramp": ramp}
    return Schedule("drift", horizon, params, segments, drifting, np.zeros(n_p, dtype=np.int64), target)


def _steps(rng: np.random.Generator, horizon: int, bounds: tuple[float, float]) -> np.ndarray:
    """One to three distinct steps drawn in ``bounds`` (fractions of the horizon), sorted; only those inside the run."""
    times = np.sort(np.unique((horizon * rng.uniform(*bounds, int(rng.integers(1, 4)))).astype(np.int64)))
    return times[(times > 0) & (times < horizon)]


def _segments_by_step(horizon: int, arrival: np.ndarray, retired: np.ndarray) -> tuple[Segment, ...]:
    """The segments between every arrival and retirement step; in each, the prompts arrived and not yet retired."""
    cuts = np.unique(np.concatenate([arrival[arrival > 0], retired[retired < horizon]]))
    bounds = [0, *cuts.tolist(), horizon]
    return tuple(Segment(a, b, 0.0, (arrival <= a) & (retired > a))
                 for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def _retirement(table: OutcomeTable, horizon: int, rng: np.random.Generator) -> Schedule:
    n_p = table.n_prompts
    if n_p < 2:
        raise ScheduleError(f"retirement needs at least 2 prompts, {table.task} has {n_p}")
    share = _fraction(rng, RETIRE_SHARE)
    n_gone = min(n_p - 1, max(1, round(share * n_p)))
    gone = rng.permutation(n_p)[:n_gone]
    times = _steps(rng, horizon, RETIRE_AT)
    arrival = np.zeros(n_p, dtype=np.int64)
    retired = np.full(n_p, horizon, dtype=np.int64)
    if times.size:  # else a horizon too short to cut: everyone throughout
        retired[gone] = times[rng.integers(times.size, size=n_gone)]
    none = np.zeros(n_p, dtype=bool)
    return Schedule("retirement", horizon, {"share": share}, _segments_by_step(horizon, arrival, retired), none,
                    arrival, retired=retired)


def _model_arrival(table: OutcomeTable, horizon: int, rng: np.random.Generator) -> Schedule:
    from iapo_gym.tasks.generated import redraw_table

    family, level = table.attrs.get("family"), table.attrs.get("level")
    if family is None or level is None:
        raise ScheduleError(f"the model_arrival schedule draws the new model from a generated family's model; "
                            f"{table.task} is not a generated level (use family=..., level=...)")
    at, factor = _fraction(rng, MODEL_AT), _fraction(rng, MODEL_COST)
    new = redraw_table(str(family), int(level), "model")
    n_p = table.n_prompts
    grown = replace(
        table, probs=np.concatenate([table.probs, new.probs]),
        cost=np.concatenate([table.cost, factor * table.cost]),
        atoms=None if table.atoms is None else np.concatenate([table.atoms, new.atoms]),
        prompts=(*table.prompts, *(f"{p}@model2" for p in table.prompts)), task=f"{table.task}:model_arrival")
    step = int(at * horizon)
    arrival = np.zeros(2 * n_p, dtype=np.int64)
    if 0 < step < horizon:  # else a horizon too short to cut: both models throughout
        arrival[n_p:] = step
    retired = np.full(2 * n_p, horizon, dtype=np.int64)
    none = np.zeros(2 * n_p, dtype=bool)
    return Schedule("model_arrival", horizon, {"at": at, "cost_factor": factor},
                    _segments_by_step(horizon, arrival, retired), none, arrival, retired=retired, grown=grown)
