"""Shared draws of the generated task families (``tasks.generated``, ``tasks.families_mv``, ``tasks.families_bon``).

Sizes within the work caps, costs, context sets, the stored split, a skew-normal on a grid, and the record of a
family (``Family``): what every family's builder draws alike, kept in one place below the modules that build
and register the families (docs/tasks.md, "What a level is built from").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import log_ndtr

from iapo_gym.tables import TEST, TRAIN, OutcomeTable
from iapo_gym.tasks.contexts import bon_grid_contexts, mv_cost_contexts

TRAIN_FRACTION = 0.8

#: Size ranges every family but ``math_like`` draws from (log-uniform integers, inclusive).
PROMPTS_RANGE = (4, 64)
TRAIN_QUERIES_RANGE = (20, 1000)
N_MAX_RANGE = (8, 64)
#: Work caps that keep a level's exact computation near a second (sizes are redrawn until they hold).
#: Majority vote: rows x Gauss nodes x other answers x (N_max^3 + 16 N_max^2) (the exact vote kernel's work).
MV_WORK_LIMIT = 1.0e10
#: Best-of-N: objective weightings x P x Q x atoms x N_max (the exact max-of-N kernel's work),
#: the exact tensor's entries (objective weightings x P x Q x N_max) and the atoms' entries (P x Q x M x K).
BON_WORK_LIMIT = 1.0e9
BON_TENSOR_LIMIT = 1.6e7
BON_ATOMS_LIMIT = 4.0e6
_MAX_DRAWS = 10_000
#: Per-completion cost scale ranges (log-uniform) of majority-vote and Best-of-N families (scores in [0, 1]).
MV_COST_SCALE = (0.001, 0.03)
BON_COST_SCALE = (0.001, 0.02)

#: Named parameter ranges of a family (inclusive), drawn in order by ``draw_ranges``.
Ranges = dict[str, tuple[float, float]]
#: What a family's builder returns: the level's drawn parameters and the ``OutcomeTable`` keyword arguments.
Built = tuple[dict[str, Any], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    """A generated family: its name, aggregator, one-line summary, the builder of a level's table and its redraw.

    ``build(rng)`` returns the level's drawn parameters and the ``OutcomeTable`` keyword arguments;
    ``redraw(rng, table)`` returns new ``probs`` drawn from the family's model on the level's shapes (the shape of
    ``table.probs``; ``redraw_table``)."""

    name: str
    aggregator: str
    summary: str
    build: Callable[[np.random.Generator], tuple[dict[str, Any], dict[str, Any]]]
    redraw: Callable[[np.random.Generator, OutcomeTable], np.ndarray]

def log_int(rng: np.random.Generator, low: int, high: int) -> int:
    """An integer in [low, high], log-uniform (floor of exp of a uniform on [log low, log(high + 1)))."""
    return int(min(high, math.floor(math.exp(rng.uniform(math.log(low), math.log(high + 1))))))


@dataclass(frozen=True)
class Sizes:
    n_prompts: int
    n_train: int
    n_test: int
    n_max: int

    @property
    def n_queries(self) -> int:
        return self.n_train + self.n_test


def draw_sizes(rng: np.random.Generator, fits: Callable[[Sizes], bool],
                prompts: tuple[int, int] = PROMPTS_RANGE, train: tuple[int, int] = TRAIN_QUERIES_RANGE,
                n_max: tuple[int, int] = N_MAX_RANGE) -> Sizes:
    """P, train queries and N_max log-uniform in their ranges (test queries: a quarter of train, at least 5),
    redrawn until ``fits`` (the family's work caps) holds."""
    for _ in range(_MAX_DRAWS):
        n_p, n_tr, n_n = log_int(rng, *prompts), log_int(rng, *train), log_int(rng, *n_max)
        sizes = Sizes(n_p, n_tr, max(5, round(n_tr * (1 - TRAIN_FRACTION) / TRAIN_FRACTION)), n_n)
        if fits(sizes):
            return sizes
    raise RuntimeError("no sizes within the work caps after many draws")  # unreachable for the shipped ranges


def draw_split(rng: np.random.Generator, sizes: Sizes) -> np.ndarray:
    split = np.full(sizes.n_queries, TRAIN, dtype=np.uint8)
    split[rng.permutation(sizes.n_queries)[: sizes.n_test]] = TEST
    return split


def draw_costs(rng: np.random.Generator, n_prompts: int, scale_range: tuple[float, float],
           params: dict[str, Any]) -> np.ndarray:
    """Per-completion cost per prompt: the same for every prompt, or proportional to a drawn prompt length."""
    scale = float(math.exp(rng.uniform(math.log(scale_range[0]), math.log(scale_range[1]))))
    mode = "equal" if rng.random() < 0.5 else "length"
    params.update(cost_mode=mode, cost_scale=scale)
    if mode == "equal":
        return np.full(n_prompts, scale)
    length_sd = float(rng.uniform(0.3, 1.0))
    params["length_sd"] = length_sd
    length = np.exp(rng.normal(0.0, length_sd, n_prompts))
    return scale * length / length.mean()


def draw_mv_contexts(rng: np.random.Generator, params: dict[str, Any]) -> tuple[np.ndarray, tuple[str, ...], np.ndarray]:
    """The paper's three cost contexts, or 2-8 random ones: weights (1, -c), c uniform in [0, 1.5], Dirichlet(1) probabilities."""
    if rng.random() < 0.5:
        params["contexts"] = "paper"
        return mv_cost_contexts()
    n_c = int(rng.integers(2, 9))
    params["contexts"] = f"random({n_c})"
    cost_w = np.sort(rng.uniform(0.0, 1.5, n_c))
    weights = np.column_stack([np.ones(n_c), -cost_w])
    return weights, tuple(f"cost={c:.3f}" for c in cost_w), rng.dirichlet(np.ones(n_c))


def simplex_grid(n_objectives: int, steps: int) -> np.ndarray:
    """Objective weight vectors with positive entries in multiples of 1 / steps summing to 1."""
    if n_objectives == 1:
        return np.ones((1, 1))
    rows = [w for w in np.ndindex(*(steps,) * n_objectives) if sum(w) == steps and min(w) > 0]
    return np.array(rows, dtype=np.float64) / steps


def draw_bon_contexts(rng: np.random.Generator, n_objectives: int,
                  params: dict[str, Any]) -> tuple[np.ndarray, tuple[str, ...], np.ndarray]:
    """Paper-style contexts or a random set.

    Paper-style: for 2 objectives the paper's 27 (w1 in 0.1..0.9, cost weight 0.1 / 0.5 / 1.0); for 1
    objective the 3 cost weights; for 3 the 10 positive weightings in sixths times the 3 cost weights;
    uniform. Random: 2-27 contexts, objective weights Dirichlet(1), cost weights uniform in [0.05, 1],
    probabilities Dirichlet(1).
    """
    if rng.random() < 0.5:
        params["contexts"] = "paper"
        if n_objectives == 2:
            return bon_grid_contexts()
        objective = simplex_grid(n_objectives, 6)
        rows = [np.append(w, -c) for c in (0.1, 0.5, 1.0) for w in objective]
        weights = np.array(rows)
    else:
        n_c = int(rng.integers(2, 28))
        params["contexts"] = f"random({n_c})"
        objective = rng.dirichlet(np.ones(n_objectives), n_c) if n_objectives > 1 else np.ones((n_c, 1))
        weights = np.column_stack([objective, -rng.uniform(0.05, 1.0, n_c)])
    names = tuple("w=" + ",".join(f"{x:.3f}" for x in w[:-1]) + f",cost={-w[-1]:.3f}" for w in weights)
    probs = np.full(len(weights), 1.0 / len(weights)) if params["contexts"] == "paper" else rng.dirichlet(np.ones(len(weights)))
    return weights, names, probs

def mv_work(sizes: Sizes, n_answers: int) -> float:
    """The exact majority-vote kernel's work: rows x Gauss nodes x other answers x (N_max^3 + 16 N_max^2)."""
    others, n = n_answers - 1, float(sizes.n_max)
    return sizes.n_prompts * sizes.n_queries * ((others + 2) // 2) * others * (n ** 3 + 16.0 * n ** 2)

def uniform(rng: np.random.Generator, bounds: tuple[float, float]) -> float:
    return float(rng.uniform(bounds[0], bounds[1])) if bounds[1] > bounds[0] else float(bounds[0])

#: Grid values per objective by number of objectives (inclusive ranges); atoms = values ** objectives.
BON_GRID = {1: (6, 16), 2: (4, 9), 3: (3, 5)}

def skew_grid_pmf(grid: np.ndarray, mean: np.ndarray, sd: np.ndarray, skew: np.ndarray) -> np.ndarray:
    """A skew-normal with this mean, sd and shape, evaluated on ``grid`` and normalised (broadcast)."""
    delta = skew / np.sqrt(1.0 + skew ** 2)
    omega = sd / np.sqrt(1.0 - 2.0 * delta ** 2 / np.pi)
    xi = mean - omega * delta * math.sqrt(2.0 / math.pi)
    z = (grid - xi[..., None]) / omega[..., None]
    log_pdf = -0.5 * z ** 2 + log_ndtr(skew[..., None] * z)
    pmf = np.exp(log_pdf - log_pdf.max(axis=-1, keepdims=True))
    return pmf / pmf.sum(axis=-1, keepdims=True)


def bon_fits(n_rows: int, n_atoms: int, n_obj: int) -> Callable[[Sizes], bool]:
    """The Best-of-N work caps for ``n_rows`` objective weightings, ``n_atoms`` atoms of ``n_obj`` objectives."""
    def fits(s: Sizes) -> bool:
        cells = n_rows * s.n_prompts * s.n_queries * s.n_max
        return (cells * n_atoms <= BON_WORK_LIMIT and cells <= BON_TENSOR_LIMIT
                and s.n_prompts * s.n_queries * n_atoms * n_obj <= BON_ATOMS_LIMIT)
    return fits

def pinned_sizes(base: OutcomeTable) -> Sizes:
    """A level's sizes (prompts, train and test queries, N_max), to draw its model again on them."""
    assert base.split is not None
    n_train = int((base.split == TRAIN).sum())
    return Sizes(base.n_prompts, n_train, base.n_queries - n_train, base.n_max)


def relabel_gold(probs: np.ndarray, drawn_gold: np.ndarray, gold: np.ndarray) -> np.ndarray:
    """``probs`` (P, Q, A) with each query's bucket ``drawn_gold`` swapped with its bucket ``gold``."""
    probs = np.array(probs)
    rows = np.arange(probs.shape[1])
    swapped = probs[:, rows, drawn_gold].copy()
    probs[:, rows, drawn_gold] = probs[:, rows, gold]
    probs[:, rows, gold] = swapped
    return probs


def draw_ranges(rng: np.random.Generator, ranges: Ranges, log: tuple[str, ...] = ()) -> dict[str, float]:
    """One uniform draw per range (log-uniform for the names in ``log``), in the ranges' order."""
    out = {}
    for name, (low, high) in ranges.items():
        out[name] = (float(math.exp(rng.uniform(math.log(low), math.log(high)))) if name in log
                     else uniform(rng, (low, high)))
    return out
