"""Optional numba kernel of the exact sequential loop (``_Sequential._advance`` with batch_size 1).

The same algorithm as the numpy path, step for step: the same generator calls in the same
order on the agent's and the env's generators (numba's ``Generator.integers``/``random``
draw what numpy's draw), and the same floating-point operations in the same order (no
fastmath), so the pulls, the estimator's sums and counts and the generators' states end
bit-identical; ``tests/test_jit.py`` checks it. Each function below names the numpy code it
mirrors (``agents/baselines.py``, ``agents/estimator.py``, ``iapo_gym/env.py``,
``iapo_gym/sampling.py``). Install the ``fast`` extra (numba) to use it; without numba, or
with the environment variable ``IAPO_GYM_JIT=0``, the numpy path runs.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

try:  # the optional extra
    import numba
except ImportError:  # pragma: no cover - depends on the install
    numba = None

SOFTMAX, EPSILON_GREEDY, UCB = 0, 1, 2  # the kinds of choice rule (``_Sequential.jit_rule``)


def enabled() -> bool:
    """Whether the compiled loop is available (numba installed) and not switched off by ``IAPO_GYM_JIT=0``."""
    return numba is not None and os.environ.get("IAPO_GYM_JIT", "1").strip() != "0"


def _njit(fn: Any) -> Any:
    return numba.njit(cache=True)(fn) if numba is not None else fn


# ---- the choice rules (baselines.py: _Sequential._argmax, Softmax/EpsilonGreedy/UCB.choose) ----
@_njit
def _argmax(values: np.ndarray, remaining: int, n_max: int, rng: np.random.Generator) -> int:
    """``_Sequential._argmax`` with the mask "N <= remaining" (every arm when remaining >= N_max)."""
    m = values.size
    top = -np.inf
    score = np.empty(m)
    for i in range(m):
        score[i] = values[i] if remaining >= n_max or i % n_max + 1 <= remaining else -np.inf
        if score[i] > top:
            top = score[i]
    ties = np.empty(m, dtype=np.int64)
    n_ties = 0
    for i in range(m):
        if score[i] == top:
            ties[n_ties] = i
            n_ties += 1
    return ties[0] if n_ties == 1 else ties[rng.integers(0, n_ties)]


@_njit
def _choose(rule: int, param: float, means: np.ndarray, counts: np.ndarray, remaining: int, n_max: int,
            rng: np.random.Generator) -> int:
    """The flat arm chosen by ``rule`` for one context's ``means``/``counts`` (see each ``choose``)."""
    m = means.size
    if rule == SOFTMAX:  # Softmax.choose: cdf of exp(logits - max), searchsorted(u * cdf[-1], "right")
        logits = np.empty(m)
        top = -np.inf
        for i in range(m):
            logits[i] = means[i] / param if remaining >= n_max or i % n_max + 1 <= remaining else -np.inf
            if logits[i] > top:
                top = logits[i]
        cdf = np.empty(m)
        acc = 0.0
        for i in range(m):
            acc = math.exp(logits[i] - top) if i == 0 else acc + math.exp(logits[i] - top)
            cdf[i] = acc
        u = rng.random() * cdf[m - 1]
        for i in range(m):
            if cdf[i] > u:
                return i
        return m
    if rule == EPSILON_GREEDY:  # EpsilonGreedy.choose
        if rng.random() < param:
            if remaining >= n_max:
                return rng.integers(0, m)
            n_options = 0
            for i in range(m):
                n_options += i % n_max + 1 <= remaining
            pick = rng.integers(0, n_options)
            for i in range(m):
                if i % n_max + 1 <= remaining:
                    if pick == 0:
                        return i
                    pick -= 1
        return _argmax(means, remaining, n_max, rng)
    # UCB.choose: mu + c sqrt(ln t / n), unsampled arms first
    t = 0.0
    for i in range(m):
        t += counts[i]  # exact: small integers, so the order of summation does not matter
    log_t = math.log(max(1.0, t))
    index = np.empty(m)
    for i in range(m):
        index[i] = means[i] + param * math.sqrt(log_t / counts[i]) if counts[i] > 0 else np.inf
    return _argmax(index, remaining, n_max, rng)


# ---- one pull (env.py: IAPOEnv._draw_one; sampling.py: AliasSampler.sample_row) ------------
@_njit
def _draw(prompt: int, n: int, pool: np.ndarray, accept: np.ndarray, alias: np.ndarray, n_atoms: int,
          n_queries: int, rng: np.random.Generator, atoms: np.ndarray) -> int:
    """Draw one pull's query (returned) and its ``n`` atoms (into ``atoms[:n]``)."""
    query = pool[rng.integers(0, pool.size)]
    start = (prompt * n_queries + query) * n_atoms
    for i in range(n):
        x = rng.random() * n_atoms  # rng.random(n): the same doubles, one at a time
        column = min(np.int64(x), n_atoms - 1)
        atoms[i] = column if x - column < accept[start + column] else alias[start + column]
    return query


# ---- the estimator's update (estimator.py: Estimator.update_one, blocks reuse) --------------
@_njit
def _update(p: int, n: int, q: int, atoms: np.ndarray, n_atoms: int, mv: bool, gold: np.ndarray, table_atoms: np.ndarray,
            weights: np.ndarray, cost: np.ndarray, sums: np.ndarray, counts: np.ndarray) -> None:
    """Add the samples of one pull at every scale k <= n (floor(n / k) blocks of k, in draw order)."""
    n_contexts, n_obj = weights.shape[0], weights.shape[1] - 1
    votes = np.zeros(n_atoms, np.int64)  # per bucket (atom) of one block: buckets without votes never tie
    scores = np.empty((0, 0))
    if not mv:
        scores = np.empty((n, n_contexts))  # objective_scores, objective by objective
        for i in range(n):
            for c in range(n_contexts):
                acc = weights[c, 0] * table_atoms[p, q, atoms[i], 0]
                for k in range(1, n_obj):
                    acc += weights[c, k] * table_atoms[p, q, atoms[i], k]
                scores[i, c] = acc
    task = np.empty(n_contexts)
    for k in range(1, n + 1):
        n_blocks = n // k
        cost_k = cost[p, q] * k * n_blocks
        if mv:  # majority vote: credit 1 / ties when the gold bucket is among the most voted
            credit_sum = 0.0
            for b in range(n_blocks):
                votes[:] = 0
                for i in range(b * k, (b + 1) * k):
                    votes[atoms[i]] += 1
                top = votes.max()
                ties = 0
                for v in votes:
                    ties += v == top
                credit_sum += (1.0 if votes[gold[q]] == top else 0.0) / ties
            for c in range(n_contexts):
                sums[c, p, k - 1] += weights[c, 0] * credit_sum + weights[c, n_obj] * cost_k
        else:  # Best-of-N: the best score of each block, summed over the blocks in order
            for b in range(n_blocks):
                for c in range(n_contexts):
                    best = scores[b * k, c]
                    for i in range(b * k + 1, (b + 1) * k):
                        best = max(best, scores[i, c])
                    task[c] = best if b == 0 else task[c] + best
            for c in range(n_contexts):
                sums[c, p, k - 1] += task[c] + cost_k * weights[c, n_obj]
        for c in range(n_contexts):
            counts[c, p, k - 1] += n_blocks


# ---- the loop (baselines.py: _Sequential._advance, batch_size == 1) -------------------------
@_njit
def advance(rule: int, param: float, rng: np.random.Generator, env_rng: np.random.Generator, budget: int,
            stop: int, spent: int, means: np.ndarray, sums: np.ndarray, counts: np.ndarray, pool: np.ndarray,
            accept: np.ndarray, alias: np.ndarray, n_queries: int, mv: bool, gold: np.ndarray,
            table_atoms: np.ndarray, weights: np.ndarray, cost: np.ndarray) -> int:
    """Take the steps while spent < budget and spent <= stop; returns the completions spent afterwards."""
    n_contexts, n_prompts, n_max = sums.shape
    n_atoms = accept.size // (n_prompts * n_queries)
    atoms = np.empty(n_max, np.int64)
    while spent < budget and spent <= stop:
        remaining = budget - spent
        c = rng.integers(0, n_contexts)
        arm = _choose(rule, param, means[c], counts[c].ravel(), remaining, n_max, rng)
        p, n = arm // n_max, arm % n_max + 1
        q = _draw(p, n, pool, accept, alias, n_atoms, n_queries, env_rng, atoms)
        _update(p, n, q, atoms, n_atoms, mv, gold, table_atoms, weights, cost, sums, counts)
        spent += n
        for ctx in range(n_contexts):
            for k in range(n):
                means[ctx, p * n_max + k] = sums[ctx, p, k] / counts[ctx, p, k]
    return spent
