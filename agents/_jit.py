"""The numba kernel of the exact sequential loop (``_Sequential._advance`` with batch_size 1).

The same algorithm as the numpy path, step for step: the same generator calls in the same
order on the agent's and the env's generators (numba's ``Generator.integers``/``random``
draw what numpy's draw), and the same floating-point operations in the same order (no
fastmath), so the pulls, the estimator's sums and counts and the generators' states end
bit-identical; ``tests/test_jit.py`` checks it. Each function below names the numpy code it
mirrors (``agents/baselines.py``, ``agents/estimator.py``, ``iapo_gym/env.py``,
``iapo_gym/sampling.py``). The environment variable ``IAPO_GYM_JIT=0`` runs the numpy path instead (the same
results; it is the reference the compiled loop is checked against). ``_njit`` compiles every kernel of the
package (numba is a dependency), the plug-in estimator's too, which have no numpy twin.
"""

from __future__ import annotations

import math
import os

import numpy as np

from iapo_gym.compiled import njit

SOFTMAX, EPSILON_GREEDY, UCB = 0, 1, 2  # the kinds of choice rule (``_Sequential.jit_rule``)


def enabled() -> bool:
    """Whether the sequential baselines run their compiled loop: unless switched off by ``IAPO_GYM_JIT=0``."""
    return os.environ.get("IAPO_GYM_JIT", "1").strip() != "0"


_njit = njit  # every kernel of the package compiles through iapo_gym.compiled.njit


# ---- the choice rules (baselines.py: _Sequential._argmax, Softmax/EpsilonGreedy/UCB.choose) ----
@_njit
def _argmax(values: np.ndarray, remaining: int, n_max: int, rng: np.random.Generator, ties: np.ndarray) -> int:
    """``_Sequential._argmax`` with the mask "N <= remaining" (every arm when remaining >= N_max)."""
    all_fit = remaining >= n_max
    top, n_ties = -np.inf, 0
    for i in range(values.size):  # one pass: the ties of the best value so far, in index order
        if all_fit or i % n_max + 1 <= remaining:
            if values[i] > top:
                top, n_ties = values[i], 0
            if values[i] == top:
                ties[n_ties] = i
                n_ties += 1
    return ties[0] if n_ties == 1 else ties[rng.integers(0, n_ties)]


@_njit
def _choose(rule: int, param: float, means: np.ndarray, counts: np.ndarray, total: float, remaining: int, n_max: int,
            rng: np.random.Generator, work: np.ndarray, ties: np.ndarray, seen_means: np.ndarray,
            seen_exp: np.ndarray, seen_top: np.ndarray) -> int:
    """The flat arm chosen by ``rule`` for one context's ``means``/``counts`` (see each ``choose``).

    ``total`` is the sum of ``counts`` (kept by the caller: exact, the counts are small integers).
    ``work``/``ties`` are scratch space; ``seen_*`` the context's softmax terms exp(mean / tau
    - top) from earlier steps, recomputed only where the mean or the top changed (the same
    values: exp is a function of its argument).
    """
    m = means.size
    all_fit = remaining >= n_max
    if rule == SOFTMAX:  # Softmax.choose: cdf of exp(logits - max), searchsorted(u * cdf[-1], "right")
        best = -np.inf
        for i in range(m):
            if (all_fit or i % n_max + 1 <= remaining) and means[i] > best:
                best = means[i]
        top = best / param  # = the largest logit: rounding x / tau is monotone in x
        if top != seen_top[0]:
            seen_means[:] = np.nan
            seen_top[0] = top
        acc = 0.0
        last_mean, last_exp = np.nan, 0.0  # runs of equal means (e.g. unsampled arms) need one exp
        for i in range(m):
            term = 0.0  # exp(-inf) of an arm that does not fit
            if all_fit or i % n_max + 1 <= remaining:
                if means[i] != seen_means[i]:
                    seen_means[i] = means[i]
                    if means[i] != last_mean:
                        last_mean, last_exp = means[i], math.exp(means[i] / param - top)
                    seen_exp[i] = last_exp
                term = seen_exp[i]
            acc = term if i == 0 else acc + term
            work[i] = acc
        u = rng.random() * work[m - 1]
        for i in range(m):
            if work[i] > u:
                return i
        return m
    if rule == EPSILON_GREEDY:  # EpsilonGreedy.choose
        if rng.random() < param:
            if all_fit:
                return int(rng.integers(0, m))
            n_options = 0
            for i in range(m):
                n_options += i % n_max + 1 <= remaining
            pick = rng.integers(0, n_options)
            for i in range(m):
                if i % n_max + 1 <= remaining:
                    if pick == 0:
                        return i
                    pick -= 1
        return _argmax(means, remaining, n_max, rng, ties)
    # UCB.choose: mu + c sqrt(ln t / n), unsampled arms first
    log_t = math.log(max(1.0, total))
    for i in range(m):
        work[i] = means[i] + param * math.sqrt(log_t / counts[i]) if counts[i] > 0 else np.inf
    return _argmax(work, remaining, n_max, rng, ties)


# ---- one pull (env.py: IAPOEnv._draw_one; sampling.py: AliasSampler.sample_row) ------------
@_njit
def _draw(prompt: int, n: int, pool: np.ndarray, accept: np.ndarray, alias: np.ndarray, n_atoms: int,
          n_queries: int, rng: np.random.Generator, atoms: np.ndarray) -> int:
    """Draw one pull's query (returned) and its ``n`` atoms (into ``atoms[:n]``)."""
    query = pool[rng.integers(0, pool.size)]
    start = (prompt * n_queries + query) * n_atoms
    for i in range(n):
        x = rng.random() * n_atoms  # rng.random(n): the same doubles, one at a time
        column = int(x)
        if column > n_atoms - 1:
            column = n_atoms - 1
        atoms[i] = column if x - column < accept[start + column] else alias[start + column]
    return query


#: numpy's ``PW_BLOCKSIZE``: ``pairwise_sum`` adds up to this many terms in one unrolled pass, more by halves.
PAIRWISE_BLOCK = 128
#: Halvings ``pairwise_rows`` can hold at most: halving a count below 2^63 reaches ``PAIRWISE_BLOCK`` in fewer.
PAIRWISE_DEPTH = 64


@_njit
def _pairwise_leaf(values: np.ndarray, start: int, count: int, acc: np.ndarray, out: np.ndarray) -> None:
    """``out[c]`` = numpy's ``pairwise_sum`` of ``values[start:start + count, c]`` for count <= ``PAIRWISE_BLOCK``,
    every column at once: sequential from 0.0 below 8 terms, else 8 interleaved partial sums (``acc`` (8, C))
    combined as a tree, then the remainder."""
    n_columns = values.shape[1]
    if count < 8:
        for c in range(n_columns):
            out[c] = 0.0
        for i in range(start, start + count):
            for c in range(n_columns):
                out[c] += values[i, c]
        return
    for j in range(8):
        for c in range(n_columns):
            acc[j, c] = values[start + j, c]
    i = 8
    while i < count - count % 8:
        for j in range(8):
            for c in range(n_columns):
                acc[j, c] += values[start + i + j, c]
        i += 8
    for c in range(n_columns):
        res = ((acc[0, c] + acc[1, c]) + (acc[2, c] + acc[3, c])) + ((acc[4, c] + acc[5, c]) + (acc[6, c] + acc[7, c]))
        for t in range(start + i, start + count):
            res += values[t, c]
        out[c] = res


@_njit
def pairwise_scratch(n_columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The buffers of ``pairwise_rows`` for rows of ``n_columns``: the 8 partial sums (8, C), the finished left
    halves (``PAIRWISE_DEPTH``, C) and the stack of halves (3, ``PAIRWISE_DEPTH``: first row, rows, right half
    pending)."""
    return (np.empty((8, n_columns)), np.empty((PAIRWISE_DEPTH, n_columns)),
            np.zeros((3, PAIRWISE_DEPTH), np.int64))


@_njit
def pairwise_rows(values: np.ndarray, start: int, count: int, scratch: tuple[np.ndarray, np.ndarray, np.ndarray],
                  out: np.ndarray) -> None:
    """``out[c]`` = numpy's ``pairwise_sum`` of ``values[start:start + count, c]`` for every column c, bit for bit
    (the sum ``np.add.reduceat`` gives a segment past its first row). Above ``PAIRWISE_BLOCK`` terms
    numpy adds the sums of two halves (the first a multiple of 8), recursively: the same tree here, walked with an
    explicit stack (numba cannot load a recursive function from its cache), in ``scratch``
    (``pairwise_scratch``), so no call allocates."""
    acc, partial, stack = scratch
    n_columns = values.shape[1]
    first, size, right_pending = stack[0], stack[1], stack[2]
    depth = 0
    first[0], size[0] = start, count
    while True:
        while size[depth] > PAIRWISE_BLOCK:  # down the left halves
            half = size[depth] // 2
            half -= half % 8
            first[depth + 1], size[depth + 1] = first[depth], half
            right_pending[depth] = 1
            depth += 1
        _pairwise_leaf(values, first[depth], size[depth], acc, out)
        while True:  # up: add each finished right half to its left one, or go down the next right half
            depth -= 1
            if depth < 0:
                return
            if right_pending[depth]:
                right_pending[depth] = 0
                for c in range(n_columns):
                    partial[depth, c] = out[c]
                half = size[depth] // 2
                half -= half % 8
                first[depth + 1], size[depth + 1] = first[depth] + half, size[depth] - half
                depth += 1
                break
            for c in range(n_columns):
                out[c] = partial[depth, c] + out[c]


@_njit
def _reduceat_sum(values: np.ndarray, count: int, scratch: tuple[np.ndarray, np.ndarray, np.ndarray],
                  out: np.ndarray) -> None:
    """``out[c] = np.add.reduceat(values[:count], [0], axis=0)[0, c]`` bit for bit (``update_one``'s block sums, the
    plug-in's segment sums; at count 1 a -0.0 comes out +0.0): numpy's reduceat starts from the first row and adds
    the pairwise sum of the others (``pairwise_rows``)."""
    pairwise_rows(values, 1, count - 1, scratch, out)
    for c in range(values.shape[1]):
        out[c] = values[0, c] + out[c]


# ---- the estimator's update (estimator.py: Estimator.update_one, blocks reuse) --------------
@_njit
def _update(p: int, n: int, q: int, atoms: np.ndarray, n_atoms: int, mv: bool, gold: np.ndarray,
            table_atoms: np.ndarray, weights: np.ndarray, cost: np.ndarray, sums: np.ndarray, counts: np.ndarray,
            scores: np.ndarray, votes: np.ndarray, per_k: np.ndarray, task: np.ndarray, block_max: np.ndarray,
            pairwise: tuple[np.ndarray, np.ndarray, np.ndarray], weights_t: np.ndarray) -> None:
    """Add the samples of one pull at every scale k <= n (floor(n / k) blocks of k, in draw order).

    Scratch space (reused across steps, no allocation per step): ``scores`` (levels, N_max, C) for
    the Best-of-N scores and their sparse table of range maxima (level l: the maxima of 2^l
    consecutive completions, as in ``update_one``), ``votes`` (atoms,) zeros, ``per_k`` (2,
    N_max), ``task`` and ``block_max`` (N_max, C), ``pairwise`` (``pairwise_scratch(C)``); ``weights_t`` is
    ``weights.T`` contiguous.
    """
    n_contexts, n_obj = weights.shape[0], weights.shape[1] - 1
    cost_k, credit = per_k[0], per_k[1]  # per scale k = 1..n
    if not mv:  # scoring.objective_scores, objective by objective; then range maxima over 2^l completions
        for i in range(n):
            a = atoms[i]
            value = table_atoms[p, q, a, 0]
            for c in range(n_contexts):  # along contexts (contiguous, vectorizes); weights_t is weights.T
                scores[0, i, c] = weights_t[0, c] * value
            for j in range(1, n_obj):
                value = table_atoms[p, q, a, j]
                for c in range(n_contexts):
                    scores[0, i, c] += weights_t[j, c] * value
        half, level = 1, 1
        while 2 * half <= n:
            for i in range(n - 2 * half + 1):
                for c in range(n_contexts):  # (indexing, not views: a view costs reference counting)
                    low, high = scores[level - 1, i, c], scores[level - 1, i + half, c]
                    scores[level, i, c] = low if low >= high else high
            half, level = 2 * half, level + 1
    for k in range(1, n + 1):
        n_blocks = n // k
        cost_k[k - 1] = cost[p, q] * k * n_blocks
        if mv:  # majority vote: credit 1 / ties when the gold bucket is among the most voted
            credit_sum = 0.0
            for b in range(n_blocks):
                top = 0
                for i in range(b * k, (b + 1) * k):
                    votes[atoms[i]] += 1
                    top = max(top, votes[atoms[i]])
                won = votes[gold[q]] == top
                n_ties = 0
                for i in range(b * k, (b + 1) * k):  # each most-voted bucket once (then back to 0 votes)
                    n_ties += votes[atoms[i]] == top
                    votes[atoms[i]] = 0
                credit_sum += (1.0 if won else 0.0) / n_ties
            credit[k - 1] = credit_sum
        else:  # Best-of-N: the best score of each block (from the sparse table), summed as np.add.reduceat sums
            level = 0
            while 2 << level <= k:
                level += 1
            width = 1 << level
            for b in range(n_blocks):
                first, last = b * k, (b + 1) * k - width
                for c in range(n_contexts):
                    low, high = scores[level, first, c], scores[level, last, c]
                    block_max[b, c] = low if low >= high else high
            _reduceat_sum(block_max, n_blocks, pairwise, task[k - 1])
    for c in range(n_contexts):  # row by row: rows are P * N_max apart, a column walk would thrash the cache
        w_task, w_cost = weights[c, 0], weights[c, n_obj]
        for k in range(n):
            if mv:
                sums[c, p, k] += w_task * credit[k] + w_cost * cost_k[k]
            else:
                sums[c, p, k] += task[k, c] + cost_k[k] * w_cost
            counts[c, p, k] += n // (k + 1)


# ---- the loop (baselines.py: _Sequential._advance, batch_size == 1) -------------------------
@_njit
def advance(rule: int, param: float, rng: np.random.Generator, env_rng: np.random.Generator, budget: int,
            stop: int, spent: int, means: np.ndarray, sums: np.ndarray, counts: np.ndarray, pool: np.ndarray,
            accept: np.ndarray, alias: np.ndarray, n_queries: int, mv: bool, gold: np.ndarray,
            table_atoms: np.ndarray, weights: np.ndarray, cost: np.ndarray) -> int:
    """Take the steps while spent < budget and spent <= stop; returns the completions spent afterwards."""
    n_contexts, n_prompts, n_max = sums.shape
    n_atoms = accept.size // (n_prompts * n_queries)
    flat_counts = counts.reshape(n_contexts, n_prompts * n_max)
    atoms = np.empty(n_max, np.int64)
    work, ties = np.empty(n_prompts * n_max), np.empty(n_prompts * n_max, np.int64)
    seen_means, seen_exp = np.full((n_contexts, n_prompts * n_max), np.nan), np.empty((n_contexts, n_prompts * n_max))
    seen_top = np.full((n_contexts, 1), np.nan)
    n_levels = 1
    while 1 << n_levels <= n_max:
        n_levels += 1
    scores = np.empty((n_levels, n_max, n_contexts))
    votes, per_k, task = np.zeros(n_atoms, np.int64), np.empty((2, n_max)), np.empty((n_max, n_contexts))
    block_max, pairwise = np.empty((n_max, n_contexts)), pairwise_scratch(n_contexts)
    weights_t = weights.T.copy()
    totals = np.zeros(n_contexts)  # per context, the sum of its counts (what UCB.choose sums)
    for ctx in range(n_contexts):
        for i in range(n_prompts * n_max):
            totals[ctx] += flat_counts[ctx, i]
    while spent < budget and spent <= stop:
        remaining = budget - spent
        c = rng.integers(0, n_contexts)
        arm = _choose(rule, param, means[c], flat_counts[c], totals[c], remaining, n_max, rng, work, ties, seen_means[c],
                      seen_exp[c], seen_top[c])
        p, n = arm // n_max, arm % n_max + 1
        q = _draw(p, n, pool, accept, alias, n_atoms, n_queries, env_rng, atoms)
        _update(p, n, q, atoms, n_atoms, mv, gold, table_atoms, weights, cost, sums, counts, scores, votes, per_k,
                task, block_max, pairwise, weights_t)
        spent += n
        for k in range(1, n + 1):
            totals += n // k
        for ctx in range(n_contexts):
            for k in range(n):
                means[ctx, p * n_max + k] = sums[ctx, p, k] / counts[ctx, p, k]
    return spent
