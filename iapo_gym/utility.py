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
        objective_weights, inverse = np.unique(table.context_weights[:, :-1], axis=0, return_inverse=True)
        distinct = np.empty((objective_weights.shape[0], n_p, n_q, table.n_max))
        for i, w in enumerate(objective_weights):
            distinct[i] = bon_expected_max(table.atoms @ w, table.probs, table.n_max)
        result = distinct
        cache["task_reward_context_index"] = inverse.reshape(-1)
    result.setflags(write=False)
    cache["task_reward"] = result
    return result
