"""Generated task families: distributions of tables, to judge agents on levels they were never tuned on.

Each family is a documented parametric model of how outcomes arise. Level k of a family draws the
model's parameters (sizes, spreads, context set, costs) from the family's stated ranges with its
own generator (``derive_rng(GENERATED_ROOT_SEED, "generated", family, k)``) and returns the whole
outcome table, so every value is exact, as for the paper's synthetic tasks. Levels 0-9,999 are for
tuning; levels 1,000,000-1,999,999 are held out, for reports only (``TUNING_LEVELS``, ``HELD_OUT_LEVELS``).
The families, their parameters and ranges are documented in docs/tasks.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import expit

from iapo_gym.seeding import derive_rng
from iapo_gym.tables import OutcomeTable
from iapo_gym.tasks import GENERATOR_VERSION, families_bon, families_mv
from iapo_gym.tasks.contexts import mv_cost_contexts
from iapo_gym.tasks.draws import (
    BON_COST_SCALE,
    BON_GRID,
    MV_COST_SCALE,
    MV_WORK_LIMIT,
    N_MAX_RANGE,
    PROMPTS_RANGE,
    TRAIN_QUERIES_RANGE,
    Family,
    Sizes,
    bon_fits,
    draw_bon_contexts,
    draw_costs,
    draw_mv_contexts,
    draw_sizes,
    draw_split,
    mv_work,
    pinned_sizes,
    relabel_gold,
    skew_grid_pmf,
    uniform,
)

GENERATED_ROOT_SEED = 20_261_125
#: Levels for tuning agents and their hyper-parameters.
TUNING_LEVELS = range(0, 10_000)
#: Levels held out for reports: never tune on them.
HELD_OUT_LEVELS = range(1_000_000, 2_000_000)


class FamilyError(ValueError):
    """An unknown family name or a level outside the tuning and held-out ranges."""


# ---- majority vote -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MVRanges:
    """Ranges (inclusive) a majority-vote family draws its level parameters from; see docs/tasks.md."""

    answers: tuple[int, int] = (2, 10)  # most answer categories of a query (the table's buckets)
    skill_mean: tuple[float, float] = (-0.5, 1.5)  # logit of a typical prompt's accuracy on an average query
    skill_sd: tuple[float, float] = (0.2, 1.2)  # spread of prompt skill (logit)
    difficulty_sd: tuple[float, float] = (0.5, 2.5)  # spread of query difficulty (logit)
    sensitivity_sd: tuple[float, float] = (0.0, 0.6)  # spread of log difficulty-sensitivity across prompts
    deceiver_share: tuple[float, float] = (0.1, 0.5)  # share of deceiving prompts: win single-shot, lose large votes
    deceiver_boost: tuple[float, float] = (1.0, 2.5)  # their extra skill off the trap queries (logit)
    trap_share: tuple[float, float] = (0.1, 0.4)  # share of queries that trap the deceivers (at random)
    trap_depth: tuple[float, float] = (0.3, 1.5)  # a deceiver's accuracy on a trap query is expit(-depth + noise)
    interaction_sd: tuple[float, float] = (0.0, 1.0)  # prompt x query interaction (rank-2 latent factors, logit)
    noise_sd: tuple[float, float] = (0.1, 0.5)  # independent prompt x query noise (logit)
    distractor_concentration: tuple[float, float] = (0.2, 2.0)  # Dirichlet concentration of a query's wrong answers
    temper_sd: tuple[float, float] = (0.0, 0.7)  # spread of log tempering: how much a prompt favours the main distractor
    cost_scale: tuple[float, float] = MV_COST_SCALE  # per-completion cost scale (log-uniform)
    difficulty_skew: tuple[float, float] = (0.0, 0.0)  # skew-normal shape of query difficulty (> 0: a tail of hard queries)
    broken_share: tuple[float, float] = (0.0, 0.0)  # share of prompts that mostly fail (rounded to a count)
    broken_penalty: tuple[float, float] = (0.0, 0.0)  # their lost skill (logit)
    query_answers_min: int = 2  # fewest answer categories of a query
    prompts: tuple[int, int] = PROMPTS_RANGE
    train_queries: tuple[int, int] = TRAIN_QUERIES_RANGE
    n_max: tuple[int, int] = N_MAX_RANGE
    paper_contexts_only: bool = False


def mv_build(rng: np.random.Generator, ranges: MVRanges, binary: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """A majority-vote level: accuracy from a logit model, wrong answers split by each query's distractor profile.

    Returns the drawn parameters and the ``OutcomeTable`` keyword arguments; public so that a calibration
    (research/calibrate_math_like.py) can draw tables from ranges of its own (``MVRanges``).

    logit P(correct | p, q) = skill_p - sensitivity_p * difficulty_q + interaction_sd * u_p . v_q / sqrt(2)
    + noise_sd * e_pq. Deceivers (a drawn share of prompts) get extra skill, except on the trap queries (a random
    trap_share of them), where their logit is -trap_depth + noise and their wrong answers all go to the
    query's main distractor: they win single-shot, and their large votes go wrong on every trap. A query has
    2..answers categories, its gold at a random position; the wrong mass is split by the query's Dirichlet
    profile w_q raised to the prompt's tempering tau_p (tau > 1: the errors gather on the main distractor).
    """
    params: dict[str, Any] = {}
    n_answers = 2 if binary else int(rng.integers(ranges.answers[0], ranges.answers[1] + 1))
    sizes = draw_sizes(rng, lambda s: mv_work(s, n_answers) <= MV_WORK_LIMIT,
                        ranges.prompts, ranges.train_queries, ranges.n_max)
    n_p, n_q = sizes.n_prompts, sizes.n_queries
    draw = {name: uniform(rng, getattr(ranges, name)) for name in (
        "skill_mean", "skill_sd", "difficulty_sd", "sensitivity_sd", "deceiver_share", "deceiver_boost",
        "trap_share", "trap_depth", "interaction_sd", "noise_sd")}
    params.update(n_prompts=n_p, n_train=sizes.n_train, n_test=sizes.n_test, n_max=sizes.n_max, answers=n_answers, **draw)
    deceiving = rng.random(n_p) < draw["deceiver_share"]
    skill = rng.normal(draw["skill_mean"], draw["skill_sd"], n_p)
    sensitivity = np.exp(rng.normal(0.0, draw["sensitivity_sd"], n_p))
    difficulty = rng.normal(0.0, draw["difficulty_sd"], n_q)
    u, v = rng.normal(size=(n_p, 2)), rng.normal(size=(n_q, 2))
    if ranges.difficulty_skew != (0.0, 0.0):  # standardised skew-normal difficulty (extra draws only here)
        params["difficulty_skew"] = shape = uniform(rng, ranges.difficulty_skew)
        delta = shape / math.sqrt(1.0 + shape ** 2)
        skewed = delta * np.abs(rng.normal(size=n_q)) + math.sqrt(1.0 - delta ** 2) * difficulty / draw["difficulty_sd"]
        standard = (skewed - delta * math.sqrt(2.0 / math.pi)) / math.sqrt(1.0 - 2.0 * delta ** 2 / math.pi)
        difficulty = draw["difficulty_sd"] * standard
    if ranges.broken_share != (0.0, 0.0):
        params["broken_share"] = broken_share = uniform(rng, ranges.broken_share)
        params["broken_penalty"] = penalty = uniform(rng, ranges.broken_penalty)
        broken = np.zeros(n_p, dtype=bool)
        broken[rng.permutation(n_p)[: int(round(broken_share * n_p))]] = True
        skill = skill - penalty * broken
    noise = draw["noise_sd"] * rng.normal(size=(n_p, n_q))
    logit = (skill[:, None] - sensitivity[:, None] * difficulty[None, :]
             + draw["interaction_sd"] * (u @ v.T) / math.sqrt(2.0) + noise)
    trap = rng.random(n_q) < draw["trap_share"]
    trapped = deceiving[:, None] & trap[None, :]
    logit = np.where(trapped, -draw["trap_depth"] + noise, logit + draw["deceiver_boost"] * deceiving[:, None])
    p_gold = expit(logit)
    if binary:
        probs = np.stack([1.0 - p_gold, p_gold], axis=2)
        gold = np.ones(n_q, dtype=np.int64)
    else:
        concentration = uniform(rng, ranges.distractor_concentration)
        temper_sd = uniform(rng, ranges.temper_sd)
        params.update(distractor_concentration=concentration, temper_sd=temper_sd)
        categories = rng.integers(min(ranges.query_answers_min, n_answers), n_answers + 1, n_q)  # answers with mass
        gold = rng.integers(0, categories).astype(np.int64)
        slots = np.arange(n_answers - 1)
        profile = np.maximum(rng.gamma(concentration, size=(n_q, n_answers - 1)), 1e-12)
        profile = np.where(slots[None, :] < categories[:, None] - 1, profile, 0.0)
        profile /= profile.sum(axis=1, keepdims=True)
        temper = np.exp(rng.normal(0.0, temper_sd, n_p))
        shares = profile[None, :, :] ** temper[:, None, None]
        shares /= shares.sum(axis=2, keepdims=True)
        main = (slots[None, :] == profile.argmax(axis=1)[:, None]).astype(np.float64)  # (Q, answers - 1)
        shares = np.where(trapped[:, :, None], main[None, :, :], shares)
        wrong = (1.0 - p_gold)[:, :, None] * shares  # (P, Q, answers - 1)
        bucket = slots[None, :] + (slots[None, :] >= gold[:, None])  # wrong slot j -> bucket, skipping gold
        probs = np.zeros((n_p, n_q, n_answers))
        probs[:, np.arange(n_q)[:, None], bucket] = wrong
        probs[:, np.arange(n_q), gold] = p_gold
    cost = draw_costs(rng, n_p, ranges.cost_scale, params)
    if ranges.paper_contexts_only:
        params["contexts"] = "paper"
        weights, names, cprobs = mv_cost_contexts()
    else:
        weights, names, cprobs = draw_mv_contexts(rng, params)
    kinds = np.where(deceiving, "deceiving", "plain")
    return params, {
        "aggregator": "mv", "probs": probs, "cost": cost, "n_max": sizes.n_max, "context_weights": weights,
        "context_names": names, "context_probs": cprobs, "objective_names": ("correct",), "gold": gold,
        "prompts": tuple(f"p{i}-{k}" for i, k in enumerate(kinds)), "split": draw_split(rng, sizes),
    }


#: ``math_like``: majority vote calibrated to the MATH release table. ``research/calibrate_math_like.py --fit
#: --candidates 24 --seeds 3`` fitted the eight accuracy-model parameters below (its "best" line); each range is
#: the fitted value +- 15 %; the other ranges are set by hand: MATH's shape (25 prompts, 316 queries, 5 answer
#: buckets, N_max 32, the paper's three cost contexts, costs 0.005-0.01 per completion), a few broken prompts.
MATH_LIKE = MVRanges(
    answers=(5, 5), query_answers_min=5, prompts=(20, 32), train_queries=(200, 320), n_max=(32, 32),
    paper_contexts_only=True, cost_scale=(0.005, 0.008),
    skill_mean=(1.303, 1.763), skill_sd=(0.299, 0.405), difficulty_sd=(1.714, 2.318), difficulty_skew=(2.106, 2.85),
    noise_sd=(0.316, 0.428), interaction_sd=(0.683, 0.925), distractor_concentration=(0.344, 0.466), temper_sd=(0.15, 0.204),
    sensitivity_sd=(0.1, 0.3), deceiver_share=(0.0, 0.2), deceiver_boost=(0.3, 0.8), trap_share=(0.05, 0.2),
    trap_depth=(0.3, 1.0),
    broken_share=(0.04, 0.12), broken_penalty=(2.5, 3.5),
)


# ---- Best-of-N -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BoNRanges:
    """Ranges (inclusive) a Best-of-N family draws its level parameters from; see docs/tasks.md."""

    sd_low: tuple[float, float] = (0.05, 0.12)  # the least spread prompt's score sd (scores in [0, 1])
    sd_high: tuple[float, float] = (0.2, 0.4)  # the most spread prompt's score sd
    mean: tuple[float, float] = (0.35, 0.65)  # typical mean score
    tradeoff: tuple[float, float] = (0.5, 2.5)  # mean lost per unit of sd (spread prompts win at large N only)
    mean_sd: tuple[float, float] = (0.02, 0.1)  # prompt mean noise beyond the trade-off
    shift_sd: tuple[float, float] = (0.05, 0.25)  # bon_shift: sd of the query shift common to all prompts
    spread_sd: tuple[float, float] = (0.3, 0.8)  # bon_shape: sd of the log spread factor of a query
    skew_sd: tuple[float, float] = (0.0, 5.0)  # bon_shape: sd of a query's skew-normal shape
    noise_sd: tuple[float, float] = (0.0, 0.3)  # per-(prompt, query) log-noise on the probabilities (not bon_flat)
    cost_scale: tuple[float, float] = BON_COST_SCALE
    prompts: tuple[int, int] = PROMPTS_RANGE
    train_queries: tuple[int, int] = TRAIN_QUERIES_RANGE
    n_max: tuple[int, int] = N_MAX_RANGE


def _bon_build(rng: np.random.Generator, kind: str, ranges: BoNRanges,
               pin: tuple[int, int, Sizes] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Best-of-N level: per (prompt, objective) a mean and sd with a mean-spread trade-off; per query a
    common shift (``shift``), a spread factor and skew (``shape``) or nothing (``flat``); objectives independent,
    each a skew-normal on a grid in [0, 1].

    ``pin`` (objectives, grid values, sizes) fixes those draws (``redraw_table``: another draw of the model on a
    level's shapes); the generator is consumed as without it until the sizes."""
    params: dict[str, Any] = {"kind": kind}
    n_obj = int(rng.integers(1, 4))
    n_values = int(rng.integers(BON_GRID[n_obj][0], BON_GRID[n_obj][1] + 1))
    if pin is not None:
        n_obj, n_values = pin[0], pin[1]
    n_atoms = n_values ** n_obj
    weights, names, cprobs = draw_bon_contexts(rng, n_obj, params)
    n_rows = int(np.unique(weights[:, :-1], axis=0).shape[0])
    fits = bon_fits(n_rows, n_atoms, n_obj)
    sizes = draw_sizes(rng, fits, ranges.prompts, ranges.train_queries, ranges.n_max) if pin is None else pin[2]
    n_p, n_q = sizes.n_prompts, sizes.n_queries
    draw = {name: uniform(rng, getattr(ranges, name)) for name in ("sd_low", "sd_high", "mean", "tradeoff", "mean_sd")}
    params.update(n_prompts=n_p, n_train=sizes.n_train, n_test=sizes.n_test, n_max=sizes.n_max,
                  objectives=n_obj, grid_values=n_values, **draw)
    sd = rng.uniform(draw["sd_low"], draw["sd_high"], (n_p, n_obj))
    mean = draw["mean"] + draw["tradeoff"] * (sd.mean() - sd) + rng.normal(0.0, draw["mean_sd"], (n_p, n_obj))
    q_mean = np.broadcast_to(mean[:, None, :], (n_p, n_q, n_obj))
    q_sd = np.broadcast_to(sd[:, None, :], (n_p, n_q, n_obj))
    q_skew = np.zeros((n_p, n_q, n_obj))
    if kind == "shift":
        params["shift_sd"] = shift_sd = uniform(rng, ranges.shift_sd)
        q_mean = q_mean + rng.normal(0.0, shift_sd, (n_q, n_obj))[None, :, :]
    elif kind == "shape":
        params["spread_sd"] = spread_sd = uniform(rng, ranges.spread_sd)
        params["skew_sd"] = skew_sd = uniform(rng, ranges.skew_sd)
        q_sd = q_sd * np.exp(rng.normal(0.0, spread_sd, (n_q, n_obj)))[None, :, :]
        q_skew = q_skew + rng.normal(0.0, skew_sd, (n_q, n_obj))[None, :, :]
    grid = np.linspace(0.0, 1.0, n_values)
    marg = skew_grid_pmf(grid, q_mean, q_sd, q_skew)  # (P, Q, K, G)
    if kind != "flat":
        params["noise_sd"] = noise_sd = uniform(rng, ranges.noise_sd)
        marg = marg * np.exp(noise_sd * rng.normal(size=marg.shape))
        marg /= marg.sum(axis=-1, keepdims=True)
    probs = marg[:, :, 0, :]
    for k in range(1, n_obj):  # the joint of independent objectives, first objective slowest
        probs = (probs[..., :, None] * marg[:, :, k, None, :]).reshape(n_p, n_q, -1)
    atom_grid = np.stack(np.meshgrid(*(grid,) * n_obj, indexing="ij"), axis=-1).reshape(-1, n_obj)
    atoms = np.broadcast_to(atom_grid, (n_p, n_q, n_atoms, n_obj))
    cost = draw_costs(rng, n_p, ranges.cost_scale, params)
    return params, {
        "aggregator": "bon", "probs": probs, "atoms": atoms, "cost": cost, "n_max": sizes.n_max,
        "context_weights": weights, "context_names": names, "context_probs": cprobs,
        "objective_names": tuple(f"objective_{k + 1}" for k in range(n_obj)), "split": draw_split(rng, sizes),
    }


# ---- the registry --------------------------------------------------------------------------------

_MV = MVRanges()
_BON = BoNRanges()
#: ``mv_many_queries``, ``mv_few_queries`` and ``bon_large_n``: the first families' models at the sizes users bring.
MANY_QUERIES = MVRanges(answers=(2, 4), prompts=(4, 32), train_queries=(1200, 1600), n_max=(8, 32))
FEW_QUERIES = MVRanges(train_queries=(10, 20))
LARGE_N = BoNRanges(n_max=(64, 128))

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("mv_categorical", "mv", "majority vote, 2-10 answers per query; query difficulty, prompt skill, "
               "prompt x query interaction, deceiving prompts", lambda rng: mv_build(rng, _MV, binary=False),
               lambda rng, base: mv_redraw(rng, base, _MV, binary=False)),
        Family("mv_binary", "mv", "majority vote over right/wrong outcomes; the same accuracy model",
               lambda rng: mv_build(rng, _MV, binary=True), lambda rng, base: mv_redraw(rng, base, _MV, binary=True)),
        Family("math_like", "mv", "majority vote calibrated to the MATH release table's statistics (5 answers, "
               "N_max 32, the paper's contexts)", lambda rng: mv_build(rng, MATH_LIKE, binary=False),
               lambda rng, base: mv_redraw(rng, base, MATH_LIKE, binary=False)),
        Family("bon_shift", "bon", "Best-of-N, 1-3 objectives; queries shift every prompt's scores alike",
               lambda rng: _bon_build(rng, "shift", _BON), lambda rng, base: bon_redraw(rng, base, "shift", _BON)),
        Family("bon_shape", "bon", "Best-of-N, 1-3 objectives; queries change the spread and skew of the scores, "
               "no common shift", lambda rng: _bon_build(rng, "shape", _BON),
               lambda rng, base: bon_redraw(rng, base, "shape", _BON)),
        Family("bon_flat", "bon", "Best-of-N, 1-3 objectives; no query structure (every query of a prompt alike)",
               lambda rng: _bon_build(rng, "flat", _BON), lambda rng, base: bon_redraw(rng, base, "flat", _BON)),
        *families_mv.FAMILIES,
        Family("mv_many_queries", "mv", "mv_categorical's model with 1,500-2,000 queries and 2-4 answers",
               lambda rng: mv_build(rng, MANY_QUERIES, binary=False),
               lambda rng, base: mv_redraw(rng, base, MANY_QUERIES, binary=False)),
        Family("mv_few_queries", "mv", "mv_categorical's model with 10-20 train queries (overfitting the split)",
               lambda rng: mv_build(rng, FEW_QUERIES, binary=False),
               lambda rng, base: mv_redraw(rng, base, FEW_QUERIES, binary=False)),
        *families_bon.FAMILIES,
        Family("bon_large_n", "bon", "bon_shape's model with N_max 64-128", lambda rng: _bon_build(rng, "shape", LARGE_N),
               lambda rng, base: bon_redraw(rng, base, "shape", LARGE_N)),
    )
}
def families() -> tuple[str, ...]:
    """The names of the generated families."""
    return tuple(FAMILIES)


def _levels_text() -> str:
    return (f"{TUNING_LEVELS.start}-{TUNING_LEVELS.stop - 1} (tuning) and "
            f"{HELD_OUT_LEVELS.start}-{HELD_OUT_LEVELS.stop - 1} (held out)")


def get_family(name: str) -> Family:
    """The family called ``name``; a FamilyError lists the families."""
    family = FAMILIES.get(str(name).strip().lower())
    if family is None:
        raise FamilyError(f"unknown generated family {name!r}; families: {', '.join(FAMILIES)}")
    return family


def check_level(level: Any) -> int:
    """``level`` as an int if it is a tuning or held-out level; else a FamilyError naming the ranges."""
    if isinstance(level, np.integer):
        level = int(level)
    if isinstance(level, bool) or not isinstance(level, int):
        raise FamilyError(f"a level must be an integer, got {level!r}; levels are {_levels_text()}")
    if level not in TUNING_LEVELS and level not in HELD_OUT_LEVELS:
        raise FamilyError(f"level {level} does not exist; levels are {_levels_text()}")
    return level


def parse_levels(text: str) -> range:
    """``"A"``, ``"A:B"`` or ``"A-B"`` (both ends included) as a range of checked levels."""
    raw = str(text).strip()
    sep = ":" if ":" in raw else "-" if "-" in raw.lstrip("-") else None
    try:
        first, last = (int(raw), int(raw)) if sep is None else (int(p) for p in raw.split(sep, 1))
    except ValueError:
        raise FamilyError(f"levels {text!r} must be 'A', 'A:B' or 'A-B' (both ends included); "
                          f"levels are {_levels_text()}") from None
    if last < first:
        raise FamilyError(f"levels {text!r}: the last level {last} is below the first {first}")
    check_level(first)
    check_level(last)
    if (first in TUNING_LEVELS) != (last in TUNING_LEVELS):
        raise FamilyError(f"levels {text!r} mix tuning and held-out levels ({_levels_text()})")
    return range(first, last + 1)


def level_name(family: str, level: int) -> str:
    """The table's task name ``generated:FAMILY:LEVEL``."""
    return f"generated:{family}:{level}"


def level_table(family: str, level: int) -> OutcomeTable:
    """Level ``level`` of ``family``: built deterministically from its own seed, exact, with an 80/20 stored split."""
    spec = get_family(family)
    level = check_level(level)
    rng = derive_rng(GENERATED_ROOT_SEED, "generated", spec.name, level)
    params, kwargs = spec.build(rng)
    return OutcomeTable(
        task=level_name(spec.name, level), **kwargs,
        attrs={"source": "iapo-gym generated family", "family": spec.name, "level": level,
               "generator_version": GENERATOR_VERSION, "license": "MIT",
               "params": json.dumps(params, sort_keys=True), "build": "iapo_gym.tasks.generated.level_table"},
    )


def redraw_table(family: str, level: int, *keys: int | str) -> OutcomeTable:
    """Level ``level``'s table with every outcome distribution drawn again from the family's model.

    The family's ``redraw`` runs on its own generator (``derive_rng(GENERATED_ROOT_SEED, "redraw", family, level,
    *keys)``) with the level's sizes (prompts, train and test queries, N_max, answers; objectives and grid values
    for Best-of-N) pinned; everything but ``probs`` (contexts, costs, atoms, gold, split) is the level's. A
    majority-vote redraw's answer buckets are relabelled so that each query's gold bucket is the level's. The
    online ``drift`` schedule (docs/online.md) moves prompts toward this table.
    """
    from dataclasses import replace

    base = level_table(family, level)
    spec = get_family(family)
    rng = derive_rng(GENERATED_ROOT_SEED, "redraw", spec.name, level, *keys)
    probs = spec.redraw(rng, base)
    if probs.shape != base.probs.shape:  # unreachable: the sizes are pinned
        raise RuntimeError(f"redraw of {base.task} has shape {probs.shape}, the level {base.probs.shape}")
    return replace(base, probs=probs, task=f"{base.task}:redraw:{':'.join(str(k) for k in keys)}",
                   attrs={**base.attrs, "redraw": json.dumps(list(keys))})


def mv_redraw(rng: np.random.Generator, base: OutcomeTable, ranges: MVRanges, binary: bool) -> np.ndarray:
    """``mv_build`` again on ``base``'s sizes and answers, its gold buckets relabelled to ``base``'s."""
    from dataclasses import replace

    assert base.gold is not None
    sizes = pinned_sizes(base)
    pinned = replace(ranges, answers=(base.n_atoms, base.n_atoms), prompts=(sizes.n_prompts,) * 2,
                     train_queries=(sizes.n_train,) * 2, n_max=(sizes.n_max,) * 2)
    _, kwargs = mv_build(rng, pinned, binary=binary)
    return relabel_gold(kwargs["probs"], np.asarray(kwargs["gold"]), base.gold)


def bon_redraw(rng: np.random.Generator, base: OutcomeTable, kind: str, ranges: BoNRanges) -> np.ndarray:
    """``_bon_build`` again on ``base``'s sizes, objectives and grid values."""
    n_obj = base.n_objectives
    n_values = round(base.n_atoms ** (1.0 / n_obj))
    _, kwargs = _bon_build(rng, kind, ranges, pin=(n_obj, n_values, pinned_sizes(base)))
    return np.asarray(kwargs["probs"])


def level_params(family: str, level: int) -> dict[str, Any]:
    """The parameters level ``level`` of ``family`` drew (what its table's ``params`` attribute records)."""
    return dict(json.loads(level_table(family, level).attrs["params"]))


# ---- statistics of a majority-vote table (the calibration of ``math_like``) ----------------------------


def mv_statistics(table: OutcomeTable) -> dict[str, float]:
    """What ``math_like`` is calibrated on, for any majority-vote table (all queries).

    Per-query accuracy (mean over prompts of P(gold)) at its 10th / 50th / 90th percentile; per-prompt
    accuracy (mean over queries) at its minimum / median / maximum; answers per (prompt, query) with
    probability >= 1 %; and how often the majority answer is wrong at N = 1 and at N_max (one minus the
    exact mean vote credit, ties shared).
    """
    from iapo_gym.exact import exact_reward

    if table.aggregator != "mv" or table.gold is None:
        raise ValueError(f"mv_statistics needs a majority-vote table, got aggregator {table.aggregator!r}")
    p_gold = table.probs[:, np.arange(table.n_queries), table.gold]
    by_query, by_prompt = p_gold.mean(axis=0), p_gold.mean(axis=1)
    credit = exact_reward(table).reward[0]  # (P, Q, N_max)
    q10, q50, q90 = np.quantile(by_query, [0.1, 0.5, 0.9])
    return {
        "query_acc_p10": float(q10), "query_acc_median": float(q50), "query_acc_p90": float(q90),
        "prompt_acc_min": float(by_prompt.min()), "prompt_acc_median": float(np.median(by_prompt)),
        "prompt_acc_max": float(by_prompt.max()),
        "answers": float((table.probs >= 0.01).sum(axis=2).mean()),
        "majority_wrong_n1": float(1.0 - credit[:, :, 0].mean()),
        "majority_wrong_nmax": float(1.0 - credit[:, :, -1].mean()),
    }
