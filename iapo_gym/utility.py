"""Utilities of aggregated completions: the one place where a utility is computed.

Sampled utilities (``block_utilities``), exact expectations (``expected_task_reward``)
and the vote-counting kernel shared with the estimators all live here, so the
environment, the oracle and the agents can never disagree on what a utility is.

Best-of-N (paper eq. 1):  max_i sum_k w_k o_k(y_i) + w_cost * N * cost.
Majority vote (eq. 2):    w_1 * 1[gold among the t plurality answers] / t + w_cost * N * cost.
"""

from __future__ import annotations

from math import factorial

import numpy as np

from iapo_gym.tables import OutcomeTable


def mv_credit(counts: np.ndarray, gold: np.ndarray) -> np.ndarray:
    """Majority-vote credit 1/t when the gold bucket is among the t most-voted buckets, else 0.

    ``counts`` is (..., B) vote counts, ``gold`` (...) the gold bucket of each row.
    """
    counts = np.asarray(counts)
    top = counts.max(axis=-1)
    ties = (counts == top[..., None]).sum(axis=-1)
    gold_votes = np.take_along_axis(counts, np.asarray(gold)[..., None], axis=-1)[..., 0]
    return np.where(gold_votes == top, 1.0 / ties, 0.0)


def block_utilities(table: OutcomeTable, prompts: np.ndarray, queries: np.ndarray,
                    atom_blocks: np.ndarray) -> np.ndarray:
    """Utilities (C, n) under every context of n blocks of k completions each.

    Block i was drawn with prompt ``prompts[i]`` on query ``queries[i]`` and came out as the
    atoms ``atom_blocks[i]`` (shape (n, k)); it is aggregated as one Best-of-k or one
    majority vote of k.
    """
    atom_blocks = np.asarray(atom_blocks)
    n, k = atom_blocks.shape
    weights = table.context_weights
    cost = table.cost_matrix()[prompts, queries]  # (n,)
    cost_term = weights[:, -1:] * (k * cost)[None, :]
    if table.aggregator == "mv":
        assert table.gold is not None
        n_buckets = table.n_atoms
        flat = (np.arange(n)[:, None] * n_buckets + atom_blocks).ravel()
        counts = np.bincount(flat, minlength=n * n_buckets).reshape(n, n_buckets)
        credit = mv_credit(counts, table.gold[queries])
        return weights[:, :1] * credit[None, :] + cost_term
    assert table.atoms is not None
    vectors = table.atoms[prompts[:, None], queries[:, None], atom_blocks]  # (n, k, K)
    scores = np.einsum("nkd,cd->cnk", vectors, weights[:, :-1])
    return scores.max(axis=2) + cost_term


_CHUNK_ROWS = 2048


def gauss_legendre_01(n_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights of Gauss-Legendre quadrature on [0, 1], exact to degree 2n-1."""
    nodes, weights = np.polynomial.legendre.leggauss(n_nodes)
    return (nodes + 1.0) / 2.0, weights / 2.0


def vote_credit_series(gold_terms: np.ndarray, other_terms: np.ndarray, n_max: int) -> np.ndarray:
    """Tie-aware vote credit as a generating-function sum, for every total vote count.

    With a_g[s] = ``gold_terms[:, s]`` and a_j[s] = ``other_terms[:, j, s]`` (s = 0..n_max),
    returns S (R, n_max + 1) with

        S[N] = sum_{k>=1} a_g[k] * sum over (s_j) with sum s_j = N - k, all s_j <= k,
               of prod_j a_j[s_j] / (1 + #{j : s_j = k}).

    With a[s] = p^s / s!, N! S[N] is the expected credit of an N-vote majority vote
    (exact oracle); with a[s] = C(n_j, s), S[N] / C(n, N) is the mean credit over all
    N-subsets of a pull with counts n_j (the all-subset estimator). 1/(1+m) is integrated
    exactly as int_0^1 u^m du by Gauss-Legendre quadrature over u.
    """
    n_rows, n_others, _ = other_terms.shape
    if n_rows > _CHUNK_ROWS:  # cache-sized chunks: the kernel is memory-bound
        return np.concatenate([
            vote_credit_series(gold_terms[i : i + _CHUNK_ROWS], other_terms[i : i + _CHUNK_ROWS], n_max)
            for i in range(0, n_rows, _CHUNK_ROWS)
        ])
    nodes, qweights = gauss_legendre_01(max(1, (n_others + 2) // 2))
    n_nodes = nodes.size
    series = np.zeros((n_rows, n_max + 1))
    for k in range(1, n_max + 1):
        degree = n_max - k  # highest power of x still needed: N - k with N <= n_max
        poly = np.ones((n_rows, n_nodes, 1))
        top = min(k, degree)
        for j in range(n_others):
            coeffs = np.repeat(other_terms[:, j, None, : top + 1], n_nodes, axis=1)
            if top == k:  # the term where bucket j ties the gold bucket carries u
                coeffs[:, :, k] *= nodes[None, :]
            width = poly.shape[2]
            new = np.zeros((n_rows, n_nodes, min(degree, width - 1 + top) + 1))
            for s in range(top + 1):
                span = min(width, new.shape[2] - s)
                new[:, :, s : s + span] += coeffs[:, :, s, None] * poly[:, :, :span]
            poly = new
        inner = np.zeros((n_rows, degree + 1))
        inner[:, : poly.shape[2]] = np.einsum("rgd,g->rd", poly, qweights)  # zero-padded to degree + 1
        series[:, k:] += gold_terms[:, k, None] * inner
    return series


def _power_series(p: np.ndarray, n_max: int) -> np.ndarray:
    """p^s / s! for s = 0..n_max along a new last axis."""
    out = np.empty(p.shape + (n_max + 1,))
    out[..., 0] = 1.0
    for s in range(1, n_max + 1):
        out[..., s] = out[..., s - 1] * p / s
    return out


def mv_expected_credit(probs: np.ndarray, gold: np.ndarray, n_max: int) -> np.ndarray:
    """Exact expected majority-vote credit (R, n_max) of N = 1..n_max votes.

    ``probs`` (R, B) are per-row bucket probabilities, ``gold`` (R,) the gold buckets.
    Rows equal up to the order of the non-gold buckets are computed once (real tables
    repeat many rows, e.g. every completion giving the same answer).
    """
    probs = np.asarray(probs, dtype=np.float64)
    n_rows, n_buckets = probs.shape
    gold = np.asarray(gold)
    p_gold = probs[np.arange(n_rows), gold]
    others_mask = np.ones((n_rows, n_buckets), dtype=bool)
    others_mask[np.arange(n_rows), gold] = False
    p_others = np.sort(probs[others_mask].reshape(n_rows, n_buckets - 1), axis=1)
    keys, inverse = np.unique(np.column_stack([p_gold, p_others]), axis=0, return_inverse=True)
    series = vote_credit_series(_power_series(keys[:, 0], n_max), _power_series(keys[:, 1:], n_max), n_max)
    fact = np.array([float(factorial(n)) for n in range(n_max + 1)])
    return np.clip(series[:, 1:] * fact[1:], 0.0, 1.0)[inverse.reshape(-1)]


def bon_expected_max(scores: np.ndarray, probs: np.ndarray, n_max: int) -> np.ndarray:
    """Exact E[max of N i.i.d. draws] (R, n_max) for N = 1..n_max of categorical atoms.

    Sorted ascending with cumulative mass F, E[max] = sum_j u_(j) (F_j^N - F_(j-1)^N)
    = u_(M) - sum_(j<M) (u_(j+1) - u_(j)) F_j^N (summation by parts: one pass per N).
    """
    order = np.argsort(scores, axis=-1, kind="stable")
    u = np.take_along_axis(scores, order, axis=-1)
    cdf = np.cumsum(np.take_along_axis(probs, order, axis=-1), axis=-1)
    cdf = cdf[..., :-1] / cdf[..., -1:]
    gaps = np.diff(u, axis=-1)
    top = u[..., -1]
    out = np.empty(scores.shape[:-1] + (n_max,))
    power = np.ones_like(cdf)
    for n in range(n_max):
        power *= cdf
        out[..., n] = top - np.einsum("...m,...m->...", gaps, power)
    return out


#: Largest (C', P, Q, N_max) task-reward tensor (bytes) that is built, cached and stored whole;
#: above it ``mean_task_reward`` evaluates one objective weighting and a block of prompts at a time.
TENSOR_LIMIT_BYTES = 1 << 30
_BLOCK_ELEMENTS = 1 << 22  # prompts per block in the streamed path: about this many (query, atom) cells


def objective_rows(table: OutcomeTable) -> tuple[np.ndarray, np.ndarray]:
    """Distinct objective weightings (C', K) and the row of each context (C,); mv: one row (the credit)."""
    if table.aggregator == "mv":
        return np.ones((1, 1)), np.zeros(table.n_contexts, dtype=np.int64)
    weights, inverse = np.unique(table.context_weights[:, :-1], axis=0, return_inverse=True)
    return weights, inverse.reshape(-1).astype(np.int64)


def task_reward_fits(table: OutcomeTable) -> bool:
    """True when the whole (C', P, Q, N_max) tensor is at most ``TENSOR_LIMIT_BYTES``."""
    n_rows = objective_rows(table)[0].shape[0]
    return n_rows * table.probs.shape[0] * table.probs.shape[1] * table.n_max * 8 <= TENSOR_LIMIT_BYTES


def expected_task_reward(table: OutcomeTable) -> np.ndarray:
    """Exact expected weighted task reward (C', P, Q, N_max) of every arm on every query.

    For majority vote C' = 1 and the value is the credit (scale it by w_1); for Best-of-N
    C' is the number of distinct objective-weight vectors (contexts differing only in the cost
    weight share one row; ``table._cache["task_reward_context_index"]`` maps context -> row) and
    the value already includes the objective weights. The cost term
    is deterministic and added by the caller. Cached on the table.
    """
    cache = table._cache
    if "task_reward" in cache:
        return cache["task_reward"]
    n_p, n_q, n_m = table.probs.shape
    if table.aggregator == "mv":
        assert table.gold is not None
        gold = np.broadcast_to(table.gold[None, :], (n_p, n_q)).reshape(-1)
        credit = mv_expected_credit(table.probs.reshape(-1, n_m), gold, table.n_max)
        result = credit.reshape(1, n_p, n_q, table.n_max)
    else:
        assert table.atoms is not None
        # Contexts that differ only in their cost weight share the task reward.
        objective_weights, inverse = objective_rows(table)
        distinct = np.empty((objective_weights.shape[0], n_p, n_q, table.n_max))
        for i, w in enumerate(objective_weights):
            distinct[i] = bon_expected_max(table.atoms @ w, table.probs, table.n_max)
        result = distinct
        cache["task_reward_context_index"] = inverse
    result.setflags(write=False)
    cache["task_reward"] = result
    return result


def mean_task_reward(table: OutcomeTable, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact task reward (C', P, N_max) averaged over ``queries``, and the row of each context (C,).

    Uses the cached/stored tensor when the table has it or it fits ``TENSOR_LIMIT_BYTES``; otherwise
    streams one objective weighting and one block of prompts at a time (memory independent of C',
    time linear in C'), so tables with many Best-of-N contexts never build the whole tensor.
    """
    queries = np.asarray(queries, dtype=np.int64)
    if "task_reward" in table._cache or task_reward_fits(table):
        reward = expected_task_reward(table)[:, :, queries, :].mean(axis=2)
        return reward, table._cache.get("task_reward_context_index", np.zeros(table.n_contexts, dtype=np.int64))
    weights, inverse = objective_rows(table)
    n_p, _, n_m = table.probs.shape
    block = max(1, _BLOCK_ELEMENTS // max(1, queries.size * n_m))
    out = np.empty((weights.shape[0], n_p, table.n_max))
    for start in range(0, n_p, block):
        probs = table.probs[start : start + block][:, queries]  # (b, Q', M)
        if table.aggregator == "mv":
            assert table.gold is not None
            gold = np.broadcast_to(table.gold[queries][None, :], probs.shape[:2]).reshape(-1)
            credit = mv_expected_credit(probs.reshape(-1, n_m), gold, table.n_max)
            out[0, start : start + block] = credit.reshape(*probs.shape[:2], table.n_max).mean(axis=1)
            continue
        assert table.atoms is not None
        atoms = table.atoms[start : start + block][:, queries]  # (b, Q', M, K)
        for i, w in enumerate(weights):
            out[i, start : start + block] = bon_expected_max(atoms @ w, probs, table.n_max).mean(axis=1)
    return out, inverse


def expected_arm_reward(table: OutcomeTable, arms: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Exact expected task reward (C,) of context c's arm ``arms[c] = (p, N)``, averaged over ``queries``.

    The same values as ``expected_task_reward`` (mv: the unscaled credit; bon: weighted by the
    context's objectives) but only for the C asked arms, so a policy is evaluated without building
    the (C', P, Q, N_max) tensor. Not cached: use ``expected_task_reward`` when many arms are needed.
    """
    arms = np.asarray(arms, dtype=np.int64)
    queries = np.asarray(queries, dtype=np.int64)
    prompts, ns = arms[:, 0], arms[:, 1]
    n_top = int(ns.max())
    if table.aggregator == "mv":
        assert table.gold is not None
        used, row_of = np.unique(prompts, return_inverse=True)
        probs = table.probs[used][:, queries]  # (P_used, Q', M)
        gold = np.broadcast_to(table.gold[queries][None, :], probs.shape[:2]).reshape(-1)
        credit = mv_expected_credit(probs.reshape(-1, table.n_atoms), gold, n_top)
        credit = credit.reshape(used.size, queries.size, n_top).mean(axis=1)  # (P_used, n_top)
        return credit[row_of.reshape(-1), ns - 1]
    assert table.atoms is not None
    # one row per distinct (objective weighting, prompt) pair among the contexts
    keys = np.column_stack([table.context_weights[:, :-1], prompts])
    distinct, inverse = np.unique(keys, axis=0, return_inverse=True)
    d_prompts = distinct[:, -1].astype(np.int64)
    scores = np.einsum("dqmk,dk->dqm", table.atoms[d_prompts][:, queries], distinct[:, :-1])
    best = bon_expected_max(scores, table.probs[d_prompts][:, queries], n_top).mean(axis=1)  # (D, n_top)
    return best[inverse.reshape(-1), ns - 1]
