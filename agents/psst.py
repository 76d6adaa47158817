"""PSST (paper Algorithm 1, structure-aware allocation) and PSST with Top-K screening.

The halving helpers here (``trim``, ``round_budget``, ``partial_allocation``) are shared
with the TRIPLE and sequential-halving baselines, so every halving agent trims and
spends its budget by the same documented rules (see ``docs/agents.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from agents.base import Agent
from agents.estimator import REUSE_MODES, SMALL_CELLS, Estimator, Reuse, draws_at, skip_doubles
from agents.rule_readings import RuleEstimator
from iapo_gym import Policy

LEFTOVER_MODES = ("carry", "drop")


def rounds_to_one(n: int) -> int:
    """Rounds of 'remove the bottom ceil(n/2), keep at least one' that take n arms to one: floor(log2 n)."""
    return max(0, int(n).bit_length() - 1)


def trim(alive: np.ndarray, means: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Remove the bottom ceil(n_c / 2) of each row's n_c alive arms (keeping at least one).

    ``alive`` and ``means`` are (C, A); arms without samples (nan or -inf) rank below every
    sampled arm, ties are broken at random. Up to ``SORT_CELLS`` cells: one lexsort of every
    (row, arm) by (sampled or not, mean, a uniform draw); above, ``trim_by`` (the same result).
    """
    if alive.size > SORT_CELLS:
        return trim_by(alive, lambda rows, cols: means[rows, cols], rng)
    n_alive = alive.sum(axis=1)
    keep = np.where(n_alive > 1, np.maximum(1, n_alive // 2), n_alive)
    seen = np.isfinite(means)
    group = np.where(alive, np.where(seen, 0, 1), 2)
    value = np.where(alive & seen, -np.nan_to_num(means, neginf=0.0, posinf=0.0), 0.0)
    order = np.lexsort((rng.random(alive.shape), value, group), axis=-1)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(alive.shape[1])[None, :].repeat(alive.shape[0], 0), axis=1)
    return alive & (rank < keep[:, None])


#: Arrays of at most this many (context, arm) cells are trimmed and read out whole (a few numpy
#: calls); larger ones by the paths that touch only the alive arms (``trim_by``, ``Estimator.best_arms``).
SORT_CELLS = SMALL_CELLS

#: (row, arm) cells per block of ``trim_by``: its work arrays stay small whatever C x A.
_TRIM_BLOCK = 1 << 18


def trim_by(alive: np.ndarray, values_at: Callable[[np.ndarray, np.ndarray], np.ndarray],
            rng: np.random.Generator) -> np.ndarray:
    """``trim`` reading the means of the alive arms only, ``values_at(rows, cols)`` (nan or inf: no samples).

    The ranking is ``trim``'s rule: sampled arms by mean (highest first), then unsampled ones, ties
    by a uniform draw per (row, arm) (the whole (C, A) draw, row by row, as one
    ``rng.random(alive.shape)``), then by arm index. Only the keep-th key of each row is found
    (a partition, not a sort), and the draws are read only in rows that have a tie to break at
    that key (``draws_at``), so ``rng`` ends where the full draw leaves it and the result is the
    same, bit for bit.
    """
    n_rows, width = alive.shape
    out = np.zeros_like(alive, dtype=bool)
    step = max(1, _TRIM_BLOCK // max(1, width))
    for r0 in range(0, n_rows, step):
        block = alive[r0 : r0 + step]
        out[r0 : r0 + step] = _trim_block(block, r0, values_at, rng)
    return out


def _trim_block(block: np.ndarray, r0: int, values_at: Callable[[np.ndarray, np.ndarray], np.ndarray],
                rng: np.random.Generator) -> np.ndarray:
    """``trim_by`` of the rows ``block`` (the rows r0.. of the whole array), drawing their share of the noise.

    Works on the list of alive (row, arm) entries. Where a row keeps fewer arms than it has sampled
    ones, its keep-th key is found by a partition of its sampled means; otherwise every sampled arm
    stays and the unsampled ones tie. Ties at the cut are broken by the draws (smallest first),
    then by arm index, as the lexsort does.
    """
    n_rows, width = block.shape
    n_alive = block.sum(axis=1)
    keep = np.where(n_alive > 1, np.maximum(1, n_alive // 2), n_alive)
    rows, cols = np.nonzero(block)  # row-major: each row's arms in index order
    result = np.zeros_like(block, dtype=bool)
    if rows.size == 0:
        skip_doubles(rng, n_rows * width)
        return result
    values = np.asarray(values_at(rows + r0, cols), dtype=np.float64)
    seen = np.isfinite(values)  # nan or +-inf: no samples
    n_seen = np.bincount(rows, weights=seen, minlength=n_rows).astype(np.int64)
    trimmed = n_alive > 1
    by_mean = trimmed & (n_seen >= keep)  # the cut falls among the sampled arms
    among_unseen = trimmed & ~by_mean  # every sampled arm stays; the unsampled ones tie at the cut
    chosen = ~trimmed[rows] | (among_unseen[rows] & seen)
    tie = among_unseen[rows] & ~seen
    if by_mean.any():
        ranked = by_mean[rows] & seen
        key = -values[ranked]
        key_rows = rows[ranked]
        padded, pos = _padded(key_rows, key, n_rows, np.nan)  # nan: no arm (last in a partition)
        threshold = np.full(n_rows, np.inf)
        for k in np.unique(keep[by_mean]):
            sel = np.flatnonzero(by_mean & (keep == k))
            threshold[sel] = np.partition(padded[sel], k - 1, axis=1)[:, k - 1]
        chosen[ranked] = key < threshold[key_rows]
        tie[ranked] = key == threshold[key_rows]
    need = keep - np.bincount(rows, weights=chosen, minlength=n_rows).astype(np.int64)
    n_tie = np.bincount(rows, weights=tie, minlength=n_rows).astype(np.int64)
    drawn = n_tie > need  # rows whose ties the draw decides
    at_tie = tie & drawn[rows]
    chosen |= tie & ~at_tie
    if at_tie.any():
        tie_rows = rows[at_tie]
        noise, pos = _padded(tie_rows, draws_at(rng, n_rows, width, tie_rows, cols[at_tie]), n_rows, 2.0)
        picked = np.zeros(noise.shape, dtype=bool)
        for m in np.unique(need[drawn]):
            sel = np.flatnonzero(drawn & (need == m))
            sub = noise[sel]
            cut = np.partition(sub, m - 1, axis=1)[:, m - 1]
            below = sub < cut[:, None]
            at = sub == cut[:, None]  # equal draws: lowest index first (lexsort is stable)
            room = m - below.sum(axis=1)
            picked[sel] = below | (at & (np.cumsum(at, axis=1) <= room[:, None]))
        chosen[at_tie] = picked[tie_rows, pos]
    else:
        skip_doubles(rng, n_rows * width)  # no tie to break: the block's draws are not needed
    result[rows, cols] = chosen
    return result


def _padded(rows: np.ndarray, values: np.ndarray, n_rows: int, fill: float) -> tuple[np.ndarray, np.ndarray]:
    """(n_rows, longest row) matrix of ``values`` by row (``rows`` non-decreasing), ``fill`` elsewhere,
    and each value's position in its row."""
    counts = np.bincount(rows, minlength=n_rows)
    starts = np.cumsum(counts) - counts
    pos = np.arange(rows.size) - starts[rows]
    out = np.full((n_rows, int(counts.max(initial=0))), fill)
    out[rows, pos] = values
    return out, pos


def round_budget(budget: int, spent: int, rounds_total: int, round_index: int, rounds_needed: int,
                 leftover: str) -> int:
    """Completions a halving round may spend.

    ``"drop"`` (the paper): floor(T / R) every round, unspent completions are lost.
    ``"carry"``: floor(remaining / rounds still to run), where the rounds still to run
    are the fewer of the paper's remaining rounds and the rounds the trimming still
    needs; leftovers roll forward.
    """
    remaining = budget - spent
    if leftover == "drop":
        return min(budget // rounds_total, remaining)
    to_run = max(1, min(rounds_total - round_index, rounds_needed))
    return remaining // to_run


def partial_allocation(top: np.ndarray, budget: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Pulls for a round that cannot afford one pull of every prompt's largest scale ``top``.

    Each live prompt (top > 0) gets one pull at min(top, floor(budget / live prompts));
    if that is 0, ``budget`` live prompts drawn at random get one pull at N = 1.
    """
    live = np.flatnonzero(top > 0)
    if live.size == 0 or budget <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    each = budget // live.size
    if each >= 1:
        return live, np.minimum(top[live], each)
    chosen = np.sort(rng.choice(live, size=budget, replace=False))
    return chosen, np.ones(chosen.size, np.int64)


def largest_scales(union: np.ndarray) -> np.ndarray:
    """(P,) largest N with a live arm (p, N) in the (P, N_max) mask, 0 for dead prompts."""
    n_max = union.shape[1]
    has = union.any(axis=1)
    return np.where(has, n_max - np.argmax(union[:, ::-1], axis=1), 0)


#: What one round pulls: (prompts, ns, queries); queries None lets the env draw them.
Allocation = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]


def trimming_rounds(env: Any, est: Estimator, alive: np.ndarray, budget: int, rng: np.random.Generator,
                    allocate: Callable[[np.ndarray, int, int], Allocation], *,
                    leftover: str = "carry") -> tuple[np.ndarray, int]:
    """PSST's schedule of trimming rounds on the (C, P, N_max) ``alive`` flags; returns (alive, spent).

    R = ceil(log2 max_c |A_c|). Each round gets its share b of the budget, M = the sum of every
    prompt's largest live scale (``top``) and per_arm = floor(b / M); ``allocate(top, b, per_arm)``
    says what the round pulls. The pulls are scored under every context and every live scale,
    and the bottom ceil(|A_c| / 2) arms of each context are trimmed.
    """
    n_contexts, n_prompts, n_max = alive.shape
    flat_alive = alive.reshape(n_contexts, -1).copy()
    n_arms = int(flat_alive.sum(axis=1).max())
    rounds_total = max(1, math.ceil(math.log2(max(n_arms, 1))))
    spent = 0
    for r in range(rounds_total):
        n_alive = flat_alive.sum(axis=1)
        if n_alive.max() <= 1:
            break
        union = flat_alive.any(axis=0).reshape(n_prompts, n_max)
        top = largest_scales(union)
        cost = int(top.sum())
        needed = max(rounds_to_one(int(n)) for n in n_alive)
        b = round_budget(budget, spent, rounds_total, r, needed, leftover)
        per_arm = b // cost
        if per_arm == 0 and leftover == "carry" and budget - spent >= cost:
            per_arm = 1  # borrow from later rounds rather than skip the round
        prompts, ns, queries = allocate(top, b, per_arm)
        if prompts.size:
            pulls = env.pull(prompts, ns) if queries is None else env.pull(prompts, ns, queries=queries)
            spent += pulls.completions
            est.update(pulls, arm_mask=union)
        if type(est).mean is Estimator.mean and flat_alive.size > SORT_CELLS:  # read the alive arms' means only
            flat_alive = trim_by(flat_alive, est.mean_at, rng)
        else:
            flat_alive = trim(flat_alive, est.mean().reshape(n_contexts, -1), rng)
    return flat_alive.reshape(alive.shape), spent


def psst_rounds(env: Any, est: Estimator, alive: np.ndarray, budget: int, rng: np.random.Generator, *,
                stockpile: bool = True, leftover: str = "carry") -> tuple[np.ndarray, int]:
    """PSST's rounds (``trimming_rounds``): each pulls every prompt's largest live scale per_arm times
    on queries the env draws (or ``partial_allocation`` of b when per_arm is 0)."""
    def allocate(top: np.ndarray, b: int, per_arm: int) -> Allocation:
        if per_arm >= 1:
            live = np.flatnonzero(top)
            prompts, ns = np.repeat(live, per_arm), np.repeat(top[live], per_arm)
        else:
            prompts, ns = partial_allocation(top, b, rng)
        if not stockpile:
            est.reset()
        return prompts, ns, None

    return trimming_rounds(env, est, alive, budget, rng, allocate, leftover=leftover)


def _check_choice(name: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")


class PSST(Agent):
    """Prompt Scaling via Sequential Trimming (paper Algorithm 1) with the shared estimator.

    ``reuse``: "blocks" (paper) or "all_subsets" (all-subset reuse, docs/estimator.md); ``stockpile`` keeps earlier
    rounds' samples (default, as the paper recommends); ``leftover``: "carry" or "drop".
    """


    def __init__(self, seed: int | None = None, reuse: Reuse = "blocks", stockpile: bool = True,
                 leftover: str = "carry") -> None:
        """Set the seed and the estimator/budget options (see the class docstring)."""
        super().__init__(seed)
        _check_choice("reuse", reuse, REUSE_MODES)
        _check_choice("leftover", leftover, LEFTOVER_MODES)
        self.reuse: Reuse = reuse
        self.stockpile = bool(stockpile)
        self.leftover = leftover

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"reuse": self.reuse, "stockpile": self.stockpile, "leftover": self.leftover}

    def make_estimator(self, env: Any) -> Estimator:
        """The estimator PSST learns through (override to try another way of reading pulls); with the env's
        ``rule_arms`` a ``RuleEstimator`` (the stopping rules read on the same pulls)."""
        if self.base_env(env).rule_arms:
            return RuleEstimator(env, self.reuse)
        return Estimator(env, self.reuse)

    def _initial_arms(self, env: Any, est: Estimator, budget: int) -> tuple[np.ndarray, int]:
        """The (C, P, N_max) arm sets PSST starts from, and the budget spent choosing them."""
        return np.ones(est.sums.shape, dtype=bool), 0

    def train(self, env: Any, budget: int) -> Policy:
        """Spend at most ``budget`` completions of ``env``; one surviving arm per context."""
        base = self.base_env(env)
        budget = self.check_budget(budget)
        est = self.make_estimator(base)
        alive, spent = self._initial_arms(base, est, budget)
        alive, _ = psst_rounds(base, est, alive, budget - spent, self.rng,
                               stockpile=self.stockpile, leftover=self.leftover)
        return est.best_arms(self.rng, alive)


class PSSTTopK(PSST):
    """PSST after Top-K screening: floor(rho T) completions at N = 1 spread evenly over the
    prompts, the K best prompts kept per context, PSST on those with the rest."""


    def __init__(self, seed: int | None = None, k: int = 4, rho: float = 0.2, reuse: Reuse = "blocks",
                 stockpile: bool = True, leftover: str = "carry", K: int | None = None) -> None:  # noqa: N803
        """``k`` prompts kept per context after screening with a ``rho`` fraction of the budget.

        One spelling per parameter, so one agent has one result key: the paper's ``K`` is refused
        with a ValueError saying to write ``k``.
        """
        if K is not None:
            raise ValueError(f"psst_topk takes k (prompts kept per context), not K: write k={K!r}")
        super().__init__(seed, reuse=reuse, stockpile=stockpile, leftover=leftover)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        if not 0.0 <= float(rho) < 1.0:
            raise ValueError(f"rho must be in [0, 1), got {rho!r}")
        self.k = int(k)
        self.rho = float(rho)

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"k": self.k, "rho": self.rho, **super().params()}

    def _initial_arms(self, env: Any, est: Estimator, budget: int) -> tuple[np.ndarray, int]:
        """Screen at N = 1 and keep the top K prompts of each context (all if unaffordable)."""
        n_contexts, n_prompts, _ = est.sums.shape
        alive = np.ones(est.sums.shape, dtype=bool)
        per_prompt = int(math.floor(self.rho * budget)) // n_prompts
        if per_prompt == 0 or self.k >= n_prompts:
            return alive, 0
        pulls = env.pull(np.repeat(np.arange(n_prompts), per_prompt), np.ones(per_prompt * n_prompts, np.int64))
        est.update(pulls, scales=np.array([1]))
        q1 = est.mean()[:, :, 0]
        order = np.lexsort((self.rng.random(q1.shape), -q1), axis=-1)
        keep = np.zeros((n_contexts, n_prompts), dtype=bool)
        np.put_along_axis(keep, order[:, : self.k], True, axis=1)
        alive &= keep[:, :, None]
        if not self.stockpile:
            est.reset()
        return alive, pulls.completions
