"""The paper's two synthetic task families (appendix B), generated offline and exactly.

Each family is indexed by an instance number; instance i is built deterministically from
its own seed (``iapo_gym.seeding``), in well under a second. Like OBP's synthetic
datasets, the generator returns the full distribution table, so every value is exact.
"""

from __future__ import annotations

import numpy as np

from iapo_gym.seeding import derive_rng
from iapo_gym.tables import TEST, TRAIN, OutcomeTable
from iapo_gym.tasks import GENERATOR_VERSION
from iapo_gym.tasks.contexts import bon_grid_contexts, mv_cost_contexts

GENERATOR_ROOT_SEED = 20_251_122



def _stored_split(rng: np.random.Generator, n_queries: int, train_fraction: float = 0.8) -> np.ndarray:
    split = np.full(n_queries, TEST, dtype=np.uint8)
    split[rng.permutation(n_queries)[: int(round(train_fraction * n_queries))]] = TRAIN
    return split


def synthetic_bernoulli(instance: int = 0, n_prompts: int = 32, n_queries: int = 520, n_max: int = 32) -> OutcomeTable:
    """Synthetic-Bernoulli: deceiving prompts vs all-rounders over easy/medium/hard tiers (6:4:3).

    Deceiving prompts are accurate on easy and medium queries but below 1/2 on hard ones, so
    they win single-shot and lose under large-N majority votes; all-rounders stay moderately
    above 1/2 everywhere. The paper's cost "variance 0.005" would make a third of the costs
    negative, so 0.005 is read as the standard deviation (costs clipped at 0.005).
    """
    rng = derive_rng(GENERATOR_ROOT_SEED, "synthetic_bernoulli", instance)
    tiers = np.repeat(np.arange(3), np.round(np.array([6, 4, 3]) / 13 * n_queries).astype(int))
    tiers = np.resize(tiers, n_queries)
    rng.shuffle(tiers)
    deceiving = np.zeros(n_prompts, dtype=bool)
    deceiving[rng.permutation(n_prompts)[: n_prompts // 2]] = True
    low_d, high_d = np.array([0.85, 0.70, 0.15]), np.array([0.95, 0.85, 0.40])
    low_a, high_a = np.array([0.60, 0.55, 0.50]), np.array([0.75, 0.70, 0.65])
    tier_means = np.where(deceiving[:, None], rng.uniform(low_d, high_d, (n_prompts, 3)),
                          rng.uniform(low_a, high_a, (n_prompts, 3)))
    query_shift = rng.normal(0.0, 0.05, n_queries)
    noise = rng.normal(0.0, 0.05, (n_prompts, n_queries))
    success = np.clip(tier_means[:, tiers] + query_shift[None, :] + noise, 0.01, 0.99)
    cost = np.clip(rng.normal(0.02, 0.005, n_prompts), 0.005, None)
    weights, names, cprobs = mv_cost_contexts()
    kinds = np.where(deceiving, "deceiving", "all-rounder")
    tier_names = np.array(["easy", "medium", "hard"])
    return OutcomeTable(
        task="synthetic_bernoulli",
        aggregator="mv",
        probs=np.stack([1.0 - success, success], axis=2),
        cost=cost,
        n_max=n_max,
        context_weights=weights,
        context_names=names,
        context_probs=cprobs,
        objective_names=("correct",),
        gold=np.ones(n_queries, dtype=np.int64),
        prompts=tuple(f"p{i}-{k}" for i, k in enumerate(kinds)),
        queries=tuple(f"q{i}-{tier_names[t]}" for i, t in enumerate(tiers)),
        split=_stored_split(rng, n_queries),
        attrs={"source": "iapo-gym synthetic generator", "instance": instance,
               "generator_version": GENERATOR_VERSION, "license": "MIT",
               "build": "iapo_gym.tasks.synthetic.synthetic_bernoulli"},
    )


def _grid_pmf(grid: np.ndarray, mean: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """Discretised normal on ``grid`` for every (mean, sd) pair (broadcast), normalised."""
    logits = -0.5 * ((grid - mean[..., None]) / sd[..., None]) ** 2
    pmf = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return pmf / pmf.sum(axis=-1, keepdims=True)


def synthetic_categorical(instance: int = 0, n_prompts: int = 32, n_queries: int = 512, n_max: int = 32) -> OutcomeTable:
    """Synthetic-Categorical: HMLV vs LMHV prompts on a {-4..4}^2 outcome grid, Best-of-N.

    HMLV (high mean, low variance) prompts win at N = 1; LMHV (lower mean, high variance)
    prompts win at large N. Each specialises in one of the two objectives. Per-query noise
    perturbs the probabilities, and test queries get a further mild perturbation (the
    train-to-test shift). Costs are uniform in [0.02, 0.1].
    """
    rng = derive_rng(GENERATOR_ROOT_SEED, "synthetic_categorical", instance)
    grid = np.arange(-4.0, 5.0)
    hmlv = np.zeros(n_prompts, dtype=bool)
    hmlv[rng.permutation(n_prompts)[: n_prompts // 2]] = True
    specialty = rng.permutation(np.arange(n_prompts) % 2)
    spec_mean = np.where(hmlv, rng.uniform(1.5, 2.5, n_prompts), rng.uniform(0.0, 1.0, n_prompts))
    spec_sd = np.where(hmlv, rng.uniform(0.5, 0.8, n_prompts), rng.uniform(2.0, 2.6, n_prompts))
    other_mean = rng.uniform(-0.5, 0.5, n_prompts)
    means = np.where(specialty[:, None] == np.arange(2)[None, :], spec_mean[:, None], other_mean[:, None])
    sds = np.where(specialty[:, None] == np.arange(2)[None, :], spec_sd[:, None], 1.0)
    query_shift = rng.normal(0.0, 0.3, n_queries)
    marg_mean = means[:, None, :] + query_shift[None, :, None]  # (P, Q, 2)
    marg = _grid_pmf(grid, marg_mean, np.broadcast_to(sds[:, None, :], marg_mean.shape))  # (P, Q, 2, 9)
    marg = marg * np.exp(0.25 * rng.normal(size=marg.shape))
    split = _stored_split(rng, n_queries)
    test_noise = np.exp(0.15 * rng.normal(size=marg.shape))
    marg = np.where((split == TEST)[None, :, None, None], marg * test_noise, marg)
    marg /= marg.sum(axis=-1, keepdims=True)
    probs = (marg[:, :, 0, :, None] * marg[:, :, 1, None, :]).reshape(n_prompts, n_queries, grid.size ** 2)
    probs /= probs.sum(axis=-1, keepdims=True)
    atom_grid = np.stack(np.meshgrid(grid, grid, indexing="ij"), axis=-1).reshape(-1, 2)
    atoms = np.broadcast_to(atom_grid, (n_prompts, n_queries) + atom_grid.shape)
    weights, names, cprobs = bon_grid_contexts()
    kinds = np.where(hmlv, "HMLV", "LMHV")
    return OutcomeTable(
        task="synthetic_categorical",
        aggregator="bon",
        probs=probs,
        atoms=atoms,
        cost=rng.uniform(0.02, 0.1, n_prompts),
        n_max=n_max,
        context_weights=weights,
        context_names=names,
        context_probs=cprobs,
        objective_names=("objective_1", "objective_2"),
        prompts=tuple(f"p{i}-{k}-o{s + 1}" for i, (k, s) in enumerate(zip(kinds, specialty, strict=True))),
        split=split,
        attrs={"source": "iapo-gym synthetic generator", "instance": instance,
               "generator_version": GENERATOR_VERSION, "license": "MIT",
               "build": "iapo_gym.tasks.synthetic.synthetic_categorical"},
    )


GENERATORS = {"synthetic_bernoulli": synthetic_bernoulli, "synthetic_categorical": synthetic_categorical}


def random_mv_table(seed: int = 0, n_prompts: int = 3, n_queries: int = 10, n_answers: int = 3, n_max: int = 6,
                    cost_range: tuple[float, float] = (0.01, 0.05), task: str = "random_mv") -> OutcomeTable:
    """A random majority-vote table of any shape, for tests and benchmarks on shapes no shipped task has.

    Every (prompt, query) draws its answer probabilities from Dirichlet(1, ..., 1) (every answer
    possible: the costliest case for the exact majority-vote credit), every query a uniform gold
    answer, every prompt a cost uniform in ``cost_range``; the MV tasks' three cost contexts; the
    first fifth of the queries (at least one) is the stored test split.
    """
    if min(n_prompts, n_queries, n_max) < 1 or n_answers < 2:
        raise ValueError(f"random_mv_table needs n_prompts, n_queries, n_max >= 1 and n_answers >= 2, got "
                         f"{n_prompts}, {n_queries}, {n_max} and {n_answers}")
    rng = np.random.default_rng(seed)
    split = np.full(n_queries, TRAIN, dtype=np.uint8)
    split[: max(1, n_queries // 5)] = TEST
    weights, names, cprobs = mv_cost_contexts()
    return OutcomeTable(
        task=task, aggregator="mv",
        probs=rng.dirichlet(np.ones(n_answers), size=(n_prompts, n_queries)),
        cost=rng.uniform(cost_range[0], cost_range[1], n_prompts), n_max=n_max,
        context_weights=weights, context_names=names, context_probs=cprobs,
        objective_names=("correct",), gold=rng.integers(0, n_answers, n_queries), split=split,
    )
