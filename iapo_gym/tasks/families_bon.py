"""Best-of-N generated families beyond the first three: many correlated objectives, failure mixtures.

Each family is a documented parametric model (docs/tasks.md, "More families"); a level draws the model's
parameters from the ranges below with the level's own generator, as every family of ``tasks.generated`` does;
``tasks.generated`` registers ``FAMILIES`` after its own (``generated.families()``). ``build(rng, base)``
with ``base`` a level's table draws the model again on that level's shapes (``generated.redraw_table``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import expit, logsumexp

from iapo_gym.tables import OutcomeTable
from iapo_gym.tasks.draws import (
    BON_COST_SCALE,
    BON_GRID,
    Built,
    Family,
    Ranges,
    Sizes,
    bon_fits,
    draw_bon_contexts,
    draw_costs,
    draw_ranges,
    draw_sizes,
    draw_split,
    pinned_sizes,
    skew_grid_pmf,
)

#: ``bon_multi``: 4-6 objectives loading on one common factor with signs (correlated and anti-correlated
#: objectives), each completion's scores binned to G levels in [0, 1] (ranges inclusive, uniform per level).
MULTI: Ranges = {
    "sd_low": (0.05, 0.12),  # the least spread prompt's latent score sd
    "sd_high": (0.15, 0.3),  # the most spread prompt's
    "mean": (0.35, 0.65),  # typical latent mean score
    "tradeoff": (0.5, 2.0),  # mean lost per unit of sd (spread prompts win at large N only)
    "mean_sd": (0.02, 0.08),  # prompt x objective mean noise
    "lean_sd": (0.03, 0.12),  # a prompt's lean along the factor: + on positive objectives, - on negative ones
    "loading_low": (0.3, 0.6),  # |loading| of an objective on the common factor, low end
    "loading_high": (0.6, 0.95),  # high end (correlation of two objectives: s_k s_l loading_k loading_l)
    "anti_share": (0.2, 0.5),  # share of objectives loading negatively (at least one)
    "shift_sd": (0.03, 0.15),  # per-query shift of each objective, common to all prompts
}
MULTI_OBJECTIVES = (4, 6)
MULTI_BINS = (5, 11)  # score levels per objective (a reward model's score binned)
MULTI_SAMPLES = (8, 24)  # completions per (prompt, query): the atoms, each of probability 1 / M

#: ``bon_mixture``: a prompt's good mode mixed with a failure mode shared by all prompts, weighted per query.
MIXTURE: Ranges = {
    "good_mean": (0.45, 0.65),  # good-mode mean of the safest prompt (risk r = 0)
    "quality_gain": (0.1, 0.3),  # good-mode mean gained from r = 0 to r = 1
    "sd_low": (0.04, 0.08),  # good-mode sd at r = 0
    "sd_high": (0.1, 0.2),  # good-mode sd at r = 1
    "mean_sd": (0.01, 0.05),  # prompt x objective noise on the good-mode mean
    "fail_mean": (0.05, 0.25),  # the shared failure mode's mean
    "fail_sd": (0.04, 0.1),  # and sd
    "fail_logit": (-3.0, -1.5),  # logit of the failure weight at r = 0 on a typical query
    "risk_gain": (1.5, 4.0),  # failure logit gained from r = 0 to r = 1
    "query_fail_sd": (0.5, 1.5),  # sd of the query's failure logit (shared by every prompt)
}
MIXTURE_OBJECTIVES = (1, 2)


def _grid_shapes(rng: np.random.Generator, base: OutcomeTable | None, objectives: tuple[int, int],
                 values: dict[int, tuple[int, int]] | tuple[int, int]) -> tuple[int, int]:
    """(objectives, values per objective): ``base``'s when redrawing (atoms = values ** objectives), else drawn."""
    n_obj = int(rng.integers(objectives[0], objectives[1] + 1))
    low, high = values[n_obj] if isinstance(values, dict) else values
    n_values = int(rng.integers(low, high + 1))
    if base is not None:
        n_obj = base.n_objectives
        n_values = round(base.n_atoms ** (1.0 / n_obj))
    return n_obj, n_values


def _bon_table(rng: np.random.Generator, params: dict[str, Any], sizes: Sizes, probs: np.ndarray,
               atoms: np.ndarray, contexts: tuple[np.ndarray, tuple[str, ...], np.ndarray]) -> Built:
    cost = draw_costs(rng, sizes.n_prompts, BON_COST_SCALE, params)
    params.update(n_prompts=sizes.n_prompts, n_train=sizes.n_train, n_test=sizes.n_test, n_max=sizes.n_max)
    weights, names, cprobs = contexts
    return params, {
        "aggregator": "bon", "probs": probs, "atoms": atoms, "cost": cost, "n_max": sizes.n_max,
        "context_weights": weights, "context_names": names, "context_probs": cprobs,
        "objective_names": tuple(f"objective_{k + 1}" for k in range(atoms.shape[-1])), "split": draw_split(rng, sizes),
    }


def _sizes(rng: np.random.Generator, base: OutcomeTable | None, weights: np.ndarray, n_atoms: int, n_obj: int) -> Sizes:
    """``base``'s sizes when redrawing, else sizes drawn within the Best-of-N work caps for these contexts and atoms."""
    if base is not None:
        return pinned_sizes(base)
    n_rows = int(np.unique(weights[:, :-1], axis=0).shape[0])
    return draw_sizes(rng, bon_fits(n_rows, n_atoms, n_obj))


def multi_build(rng: np.random.Generator, base: OutcomeTable | None = None) -> Built:
    """``bon_multi``: K objectives with signs s_k (s_1 = +1; the others -1 with probability anti_share, at least one)
    and loadings l_k on a common factor: latent scores are normal with correlation s_k s_l l_k l_l, mean
    mean + tradeoff * (average sd - sd_p) + s_k * lean_p + N(0, mean_sd) + shift_qk and sd sd_p per prompt. Each
    (prompt, query) has M sampled completions (the atoms, probability 1 / M each) whose latent scores are clipped to
    [0, 1] and binned to G levels, as a reward model's scores are. A redraw keeps the level's atoms and gives them
    the redrawn model's normal density at their scores, normalised per (prompt, query)."""
    params: dict[str, Any] = {"model": "multi"}
    n_obj, n_bins = _grid_shapes(rng, None, MULTI_OBJECTIVES, MULTI_BINS)
    n_samples = int(rng.integers(MULTI_SAMPLES[0], MULTI_SAMPLES[1] + 1))
    if base is not None:
        n_obj, n_samples = base.n_objectives, base.n_atoms
    contexts = draw_bon_contexts(rng, n_obj, params)
    sizes = _sizes(rng, base, contexts[0], n_samples, n_obj)
    n_p, n_q = sizes.n_prompts, sizes.n_queries
    d = draw_ranges(rng, MULTI)
    sign = np.where(rng.random(n_obj) < d["anti_share"], -1.0, 1.0)
    sign[0] = 1.0
    if sign.min() > 0:
        sign[int(rng.integers(1, n_obj))] = -1.0
    loading = sign * rng.uniform(d["loading_low"], d["loading_high"], n_obj)
    corr = np.outer(loading, loading) + np.diag(1.0 - loading ** 2)
    sd = rng.uniform(d["sd_low"], d["sd_high"], n_p)
    lean = rng.normal(0.0, d["lean_sd"], n_p)
    mean = (d["mean"] + d["tradeoff"] * (sd.mean() - sd)[:, None] + lean[:, None] * sign[None, :]
            + rng.normal(0.0, d["mean_sd"], (n_p, n_obj)))
    center = mean[:, None, :] + rng.normal(0.0, d["shift_sd"], (n_q, n_obj))[None, :, :]  # (P, Q, K)
    params.update(objectives=n_obj, bins=n_bins, samples=n_samples, signs=sign.tolist(), **d)
    if base is None:
        latent = center[:, :, None, :] + sd[:, None, None, None] * (
            rng.normal(size=(n_p, n_q, n_samples, n_obj)) @ np.linalg.cholesky(corr).T)
        atoms = np.round(np.clip(latent, 0.0, 1.0) * (n_bins - 1)) / (n_bins - 1)
        probs = np.full((n_p, n_q, n_samples), 1.0 / n_samples)
        return _bon_table(rng, params, sizes, probs, atoms, contexts)
    assert base.atoms is not None
    z = (base.atoms - center[:, :, None, :]) / sd[:, None, None, None]
    log_density = -0.5 * np.einsum("pqmk,kl,pqml->pqm", z, np.linalg.inv(corr), z)
    probs = np.exp(log_density - logsumexp(log_density, axis=2, keepdims=True))
    return params, {"probs": probs}


def mixture_build(rng: np.random.Generator, base: OutcomeTable | None = None) -> Built:
    """``bon_mixture``: prompt p has a risk r_p uniform in [0, 1]. Its good mode per objective is normal with mean
    good_mean + quality_gain * r_p + N(0, mean_sd) and sd sd_low + (sd_high - sd_low) * r_p; the failure mode
    (mean fail_mean, sd fail_sd) is every prompt's. On query q a completion fails (on every objective at once)
    with probability expit(fail_logit + risk_gain * r_p + query_fail_sd * g_q), g_q standard normal: safe prompts
    (low spread) win at small N, risky ones (a better good mode, more failures: high spread) at large N, where
    one of N completions escapes the failure mode. Scores on a grid of G values in [0, 1] per objective."""
    params: dict[str, Any] = {"model": "mixture"}
    n_obj, n_values = _grid_shapes(rng, base, MIXTURE_OBJECTIVES, BON_GRID)
    n_atoms = n_values ** n_obj
    contexts = draw_bon_contexts(rng, n_obj, params)
    sizes = _sizes(rng, base, contexts[0], n_atoms, n_obj)
    n_p, n_q = sizes.n_prompts, sizes.n_queries
    d = draw_ranges(rng, MIXTURE)
    risk = rng.uniform(0.0, 1.0, n_p)
    grid = np.linspace(0.0, 1.0, n_values)
    good_mean = d["good_mean"] + d["quality_gain"] * risk[:, None] + rng.normal(0.0, d["mean_sd"], (n_p, n_obj))
    good_sd = np.broadcast_to((d["sd_low"] + (d["sd_high"] - d["sd_low"]) * risk)[:, None], (n_p, n_obj))
    good = skew_grid_pmf(grid, good_mean, good_sd, np.zeros((n_p, n_obj)))  # (P, K, G)
    fail = skew_grid_pmf(grid, np.full(1, d["fail_mean"]), np.full(1, d["fail_sd"]), np.zeros(1))[0]  # (G,)
    good_joint, fail_joint = good[:, 0, :], fail
    for k in range(1, n_obj):  # independent objectives within a mode, first objective slowest
        good_joint = (good_joint[:, :, None] * good[:, k, None, :]).reshape(n_p, -1)
        fail_joint = (fail_joint[:, None] * fail[None, :]).reshape(-1)
    weight = expit(d["fail_logit"] + d["risk_gain"] * risk[:, None] + d["query_fail_sd"] * rng.normal(size=n_q)[None, :])
    probs = weight[:, :, None] * fail_joint[None, None, :] + (1.0 - weight[:, :, None]) * good_joint[:, None, :]
    params.update(objectives=n_obj, grid_values=n_values, **d)
    atom_grid = np.stack(np.meshgrid(*(grid,) * n_obj, indexing="ij"), axis=-1).reshape(-1, n_obj)
    atoms = np.broadcast_to(atom_grid, (n_p, n_q, n_atoms, n_obj))
    return _bon_table(rng, params, sizes, probs, atoms, contexts)


def _redraw(build: Any) -> Any:
    def redraw(rng: np.random.Generator, base: OutcomeTable) -> np.ndarray:
        return np.asarray(build(rng, base)[1]["probs"])
    return redraw


FAMILIES: tuple[Family, ...] = (
    Family("bon_multi", "bon", "Best-of-N, 4-6 correlated and anti-correlated objectives; M sampled completions "
           "per (prompt, query) with binned scores", lambda rng: multi_build(rng), _redraw(multi_build)),
    Family("bon_mixture", "bon", "Best-of-N, 1-2 objectives; a prompt's good mode mixed with a shared failure mode "
           "weighted per query (safe prompts win at small N, risky ones at large N)",
           lambda rng: mixture_build(rng), _redraw(mixture_build)),
)
