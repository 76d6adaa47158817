"""Majority-vote generated families beyond the first three: shared distractors, specialists, models as arms.

Each family is a documented parametric model (docs/tasks.md, "More families"); a level draws the model's
parameters from the ranges below with the level's own generator, as every family of ``tasks.generated`` does;
``tasks.generated`` registers ``FAMILIES`` after its own (``generated.families()``). ``build(rng, base)``
with ``base`` a level's table draws the model again on that level's sizes and answers (``generated.redraw_table``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import expit

from iapo_gym.tables import OutcomeTable
from iapo_gym.tasks.draws import (
    MV_COST_SCALE,
    MV_WORK_LIMIT,
    Built,
    Family,
    Ranges,
    Sizes,
    draw_costs,
    draw_mv_contexts,
    draw_ranges,
    draw_sizes,
    draw_split,
    mv_work,
    pinned_sizes,
    relabel_gold,
)

#: ``mv_distractor``: conformist prompts send their errors to a distractor shared on some queries; spread prompts'
#: errors scatter over the wrong answers (ranges inclusive, drawn uniformly per level).
DISTRACTOR: Ranges = {
    "skill_mean": (0.0, 1.5),  # logit of a typical prompt's accuracy
    "skill_sd": (0.2, 0.8),
    "difficulty_sd": (0.5, 2.0),
    "noise_sd": (0.1, 0.5),  # prompt x query noise (logit)
    "conformist_share": (0.3, 0.7),  # share of prompts whose errors follow the shared distractor
    "conformist_boost": (0.0, 1.0),  # their extra skill (logit): confident prompts, better single-shot
    "shared_share": (0.15, 0.5),  # share of queries with a shared distractor
    "shared_penalty": (1.0, 3.0),  # logit every prompt loses on those queries (the distractor attracts everyone)
    "pull": (0.7, 1.0),  # share of a conformist's wrong mass on the shared distractor
    "spread_pull": (0.0, 0.2),  # the same for the spread prompts
    "concentration": (2.0, 10.0),  # Dirichlet concentration of a query's wrong answers (high: spread errors)
}
DISTRACTOR_ANSWERS = (3, 10)

#: ``mv_specialist``: queries in topic groups; specialists are strong on their home group only.
SPECIALIST: Ranges = {
    "skill_mean": (0.0, 1.5),
    "skill_sd": (0.1, 0.5),
    "difficulty_sd": (0.5, 2.0),
    "noise_sd": (0.1, 0.5),
    "specialist_share": (0.5, 1.0),  # share of prompts that are specialists (the rest: generalists)
    "boost": (1.0, 3.0),  # a specialist's extra skill on its home group (logit)
    "penalty": (0.3, 1.5),  # its lost skill on the other groups (logit)
    "concentration": (0.3, 2.0),
}
SPECIALIST_ANSWERS = (2, 6)
SPECIALIST_GROUPS = (2, 6)

#: ``mv_models``: the arms are models x prompt templates; price spread 10-100x, quality rising with the price.
MODELS: Ranges = {
    "price_ratio": (10.0, 100.0),  # dearest / cheapest model price (log-uniform)
    "cheapest_cost": (0.0005, 0.003),  # the cheapest model's mean cost per completion (log-uniform)
    "skill_mean": (-1.0, 0.5),  # the cheapest model's skill (logit)
    "quality_slope": (1.0, 3.0),  # skill gained from the cheapest to the dearest price (logit, linear in log price)
    "quality_noise": (0.1, 0.5),  # model skill beyond the price
    "sensitivity_slope": (0.0, 0.5),  # dearer models lose less on hard queries: sensitivity exp(-slope * u)
    "template_sd": (0.0, 0.4),  # skill spread of the prompt templates (logit)
    "length_sd": (0.2, 0.6),  # sd of log query length (cost per completion scales with it)
    "difficulty_sd": (0.5, 2.0),
    "noise_sd": (0.1, 0.4),
    "concentration": (0.3, 2.0),
}
MODELS_COUNT = (4, 12)
MODELS_TEMPLATES = (1, 3)
MODELS_ANSWERS = (2, 6)


def _answers_and_sizes(rng: np.random.Generator, base: OutcomeTable | None, answers: tuple[int, int],
                       prompts: tuple[int, int] | None = None) -> tuple[int, Sizes]:
    """The level's answer count and sizes (``base``'s when redrawing), within the majority-vote work cap."""
    if base is not None:
        return base.n_atoms, pinned_sizes(base)
    n_answers = int(rng.integers(answers[0], answers[1] + 1))
    extra = {} if prompts is None else {"prompts": prompts}
    return n_answers, draw_sizes(rng, lambda s: mv_work(s, n_answers) <= MV_WORK_LIMIT, **extra)


def answer_probs(rng: np.random.Generator, p_gold: np.ndarray, n_answers: int, answers_min: int,
                 concentration: float, pull: np.ndarray | float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(probs (P, Q, A), gold (Q,)): each query has answers_min..A answers, its gold at a random position.

    A prompt's wrong mass 1 - p_gold goes to the query's wrong answers by the query's Dirichlet(concentration)
    profile, except a share ``pull`` (P, Q) of it, which goes to the query's main distractor (the profile's
    largest). Two answers: gold is bucket 1."""
    n_p, n_q = p_gold.shape
    if n_answers == 2:
        return np.stack([1.0 - p_gold, p_gold], axis=2), np.ones(n_q, dtype=np.int64)
    categories = np.asarray(rng.integers(min(answers_min, n_answers), n_answers + 1, size=n_q))
    gold = rng.integers(0, categories).astype(np.int64)
    slots = np.arange(n_answers - 1)
    profile = np.maximum(rng.gamma(concentration, size=(n_q, n_answers - 1)), 1e-12)
    profile = np.where(slots[None, :] < categories[:, None] - 1, profile, 0.0)
    profile /= profile.sum(axis=1, keepdims=True)
    main = (slots[None, :] == profile.argmax(axis=1)[:, None]).astype(np.float64)
    pull = np.broadcast_to(np.asarray(pull, dtype=np.float64), (n_p, n_q))[:, :, None]
    wrong = (1.0 - p_gold)[:, :, None] * ((1.0 - pull) * profile[None] + pull * main[None])
    bucket = slots[None, :] + (slots[None, :] >= gold[:, None])  # wrong slot j -> bucket, skipping gold
    probs = np.zeros((n_p, n_q, n_answers))
    probs[:, np.arange(n_q)[:, None], bucket] = wrong
    probs[:, np.arange(n_q), gold] = p_gold
    return probs, gold


def _table(rng: np.random.Generator, params: dict[str, Any], sizes: Sizes, probs: np.ndarray, gold: np.ndarray,
           cost: np.ndarray, prompts: tuple[str, ...], queries: tuple[str, ...]) -> Built:
    params.update(n_prompts=sizes.n_prompts, n_train=sizes.n_train, n_test=sizes.n_test, n_max=sizes.n_max,
                  answers=int(probs.shape[2]))
    weights, names, cprobs = draw_mv_contexts(rng, params)
    return params, {
        "aggregator": "mv", "probs": probs, "cost": cost, "n_max": sizes.n_max, "context_weights": weights,
        "context_names": names, "context_probs": cprobs, "objective_names": ("correct",), "gold": gold,
        "prompts": prompts, "queries": queries, "split": draw_split(rng, sizes),
    }


def distractor_build(rng: np.random.Generator, base: OutcomeTable | None = None) -> Built:
    """``mv_distractor``: logit P(correct) = skill_p + boost * conformist_p - difficulty_q - penalty * shared_q
    + noise; on shared queries a conformist puts a share ``pull`` of its wrong mass on the query's main distractor
    (its large votes go there whenever that share beats its accuracy), a spread prompt ``spread_pull``; elsewhere
    errors follow the query's profile, so a plurality vote of a spread prompt finds the gold even below 50 %."""
    n_answers, sizes = _answers_and_sizes(rng, base, DISTRACTOR_ANSWERS)
    n_p, n_q = sizes.n_prompts, sizes.n_queries
    d = draw_ranges(rng, DISTRACTOR)
    conformist = rng.random(n_p) < d["conformist_share"]
    shared = rng.random(n_q) < d["shared_share"]
    logit = (rng.normal(d["skill_mean"], d["skill_sd"], n_p)[:, None] + d["conformist_boost"] * conformist[:, None]
             - rng.normal(0.0, d["difficulty_sd"], n_q)[None, :] - d["shared_penalty"] * shared[None, :]
             + d["noise_sd"] * rng.normal(size=(n_p, n_q)))
    pull = shared[None, :] * np.where(conformist, d["pull"], d["spread_pull"])[:, None]
    probs, gold = answer_probs(rng, expit(logit), n_answers, 3, d["concentration"], pull)
    cost = draw_costs(rng, n_p, MV_COST_SCALE, d)
    return _table(rng, {"model": "distractor", **d}, sizes, probs, gold, cost,
                  tuple(f"p{i}-{'conformist' if c else 'spread'}" for i, c in enumerate(conformist)),
                  tuple(f"q{i}{'-shared' if s else ''}" for i, s in enumerate(shared)))


def specialist_build(rng: np.random.Generator, base: OutcomeTable | None = None) -> Built:
    """``mv_specialist``: queries fall in G topic groups (proportions Dirichlet(2)); logit P(correct) = skill_p
    - difficulty_q + noise, plus ``boost`` on a specialist's home group and minus ``penalty`` on the others
    (specialists' homes go round the groups from a random start); generalists have no group effect."""
    n_answers, sizes = _answers_and_sizes(rng, base, SPECIALIST_ANSWERS)
    n_p, n_q = sizes.n_prompts, sizes.n_queries
    n_groups = int(rng.integers(SPECIALIST_GROUPS[0], SPECIALIST_GROUPS[1] + 1))
    d = draw_ranges(rng, SPECIALIST)
    group = rng.choice(n_groups, size=n_q, p=rng.dirichlet(np.full(n_groups, 2.0)))
    specialist = rng.random(n_p) < d["specialist_share"]
    home = (int(rng.integers(n_groups)) + np.cumsum(specialist) - 1) % n_groups
    at_home = specialist[:, None] & (home[:, None] == group[None, :])
    away = specialist[:, None] & ~at_home
    logit = (rng.normal(d["skill_mean"], d["skill_sd"], n_p)[:, None] - rng.normal(0.0, d["difficulty_sd"], n_q)[None, :]
             + d["boost"] * at_home - d["penalty"] * away + d["noise_sd"] * rng.normal(size=(n_p, n_q)))
    probs, gold = answer_probs(rng, expit(logit), n_answers, 2, d["concentration"])
    cost = draw_costs(rng, n_p, MV_COST_SCALE, d)
    kinds = np.where(specialist, np.char.add("specialist", home.astype(str)), "generalist")
    return _table(rng, {"model": "specialist", "groups": n_groups, **d}, sizes, probs, gold, cost,
                  tuple(f"p{i}-{k}" for i, k in enumerate(kinds)),
                  tuple(f"q{i}-g{g}" for i, g in enumerate(group)))


def models_build(rng: np.random.Generator, base: OutcomeTable | None = None) -> Built:
    """``mv_models``: prompts are models x templates. Model m has a position u_m in [0, 1] (the cheapest 0, the
    dearest 1, the rest uniform), price cheapest_cost * price_ratio ** u_m and skill skill_mean + quality_slope * u_m
    + N(0, quality_noise); logit P(correct) = skill_m + template_t - exp(-sensitivity_slope * u_m) * difficulty_q
    + noise. Cost per completion (P, Q): the model's price times the query's length (log-normal, mean 1 over
    the level's queries), so the dearest arm costs price_ratio times the cheapest on every query. A redraw keeps
    each model's position u_m (read from the level's costs), so quality still rises with the price."""
    if base is not None:
        n_models = len({name.split("-")[0] for name in base.prompts})
        n_templates = base.n_prompts // n_models
    else:
        n_models = int(rng.integers(MODELS_COUNT[0], MODELS_COUNT[1] + 1))
        n_templates = int(rng.integers(MODELS_TEMPLATES[0], MODELS_TEMPLATES[1] + 1))
    n_p = n_models * n_templates
    n_answers, sizes = _answers_and_sizes(rng, base, MODELS_ANSWERS, prompts=(n_p, n_p))
    n_q = sizes.n_queries
    d = draw_ranges(rng, MODELS, log=("price_ratio", "cheapest_cost"))
    u = np.concatenate([[0.0, 1.0], rng.uniform(0.0, 1.0, n_models - 2)])[rng.permutation(n_models)]
    if base is not None:  # a redraw keeps each model's place on the price scale (its costs are the level's)
        price = np.log(base.cost_matrix()[::n_templates].mean(axis=1))
        u = (price - price.min()) / (price.max() - price.min())
    skill = d["skill_mean"] + d["quality_slope"] * u + rng.normal(0.0, d["quality_noise"], n_models)
    model, template = np.divmod(np.arange(n_p), n_templates)
    logit = ((skill[model] + rng.normal(0.0, d["template_sd"], n_templates)[template])[:, None]
             - np.exp(-d["sensitivity_slope"] * u[model])[:, None] * rng.normal(0.0, d["difficulty_sd"], n_q)[None, :]
             + d["noise_sd"] * rng.normal(size=(n_p, n_q)))
    probs, gold = answer_probs(rng, expit(logit), n_answers, 2, d["concentration"])
    length = np.exp(rng.normal(0.0, d["length_sd"], n_q))
    cost = (d["cheapest_cost"] * d["price_ratio"] ** u[model])[:, None] * (length / length.mean())[None, :]
    params = {"model": "models", "models": n_models, "templates": n_templates, "cost_mode": "price", **d}
    return _table(rng, params, sizes, probs, gold, cost,
                  tuple(f"m{m}-t{t}" for m, t in zip(model, template, strict=True)), tuple(f"q{i}" for i in range(n_q)))


def _redraw(build: Any) -> Any:
    def redraw(rng: np.random.Generator, base: OutcomeTable) -> np.ndarray:
        assert base.gold is not None
        _, kwargs = build(rng, base)
        return relabel_gold(kwargs["probs"], np.asarray(kwargs["gold"]), base.gold)
    return redraw


FAMILIES: tuple[Family, ...] = (
    Family("mv_distractor", "mv", "majority vote; distractors shared by conformist prompts on some queries "
           "(voting amplifies their errors), spread errors elsewhere (voting helps)",
           lambda rng: distractor_build(rng), _redraw(distractor_build)),
    Family("mv_specialist", "mv", "majority vote; queries in 2-6 topic groups, specialist prompts best on one group",
           lambda rng: specialist_build(rng), _redraw(specialist_build)),
    Family("mv_models", "mv", "majority vote; arms are models x templates, price 10-100x from cheapest to dearest, "
           "quality rising with price, cost per query", lambda rng: models_build(rng), _redraw(models_build)),
)
