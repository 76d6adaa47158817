"""Utilities of aggregated completions: the one place where a utility is computed.

Sampled utilities (``block_utilities``), the vote-counting kernel shared with the estimators,
and exact expectations averaged over queries (built on ``iapo_gym.exact``) live here, so the
environment, the oracle and the agents can never disagree on what a utility is.

Best-of-N (paper eq. 1):  max_i sum_k w_k o_k(y_i) + w_cost * N * cost.
Majority vote (eq. 2):    w_1 * 1[gold among the t plurality answers] / t + w_cost * N * cost.
"""

from __future__ import annotations

import numpy as np

from iapo_gym.exact import (
    bon_expected_max,
    bon_weighted_max,
    exact_reward,
    mv_expected_credit,
    objective_rows,
    stored,
    task_reward_fits,
)
from iapo_gym.tables import OutcomeTable, TableSchema


def mv_credit(counts: np.ndarray, gold: np.ndarray) -> np.ndarray:
    """Majority-vote credit 1/t when the gold bucket is among the t most-voted buckets, else 0.

    ``counts`` is (..., B) vote counts, ``gold`` (...) the gold bucket of each row.
    """
    counts = np.asarray(counts)
    top = counts.max(axis=-1)
    ties = (counts == top[..., None]).sum(axis=-1)
    gold_votes = np.take_along_axis(counts, np.asarray(gold)[..., None], axis=-1)[..., 0]
    return np.where(gold_votes == top, 1.0 / ties, 0.0)


def votes_to_decide(counts: np.ndarray, n: int) -> int:
    """Completions to draw next before a majority vote capped at ``n`` can be decided; 0 when it is.

    ``counts`` are the votes per answer so far. The vote is decided when the leader's lead over
    the runner-up exceeds the completions left: no remaining completion can then change the winner
    or make a tie, so the vote of all ``n`` would give the same answer. Otherwise the answer is the
    fewest completions that could decide it (all of them for the leader): drawing fewer could not stop
    the vote, so waves of this size stop at the first completion where the vote is decided.
    """
    counts = np.sort(np.asarray(counts, dtype=np.int64))
    left = n - int(counts.sum())
    if left <= 0:
        return 0
    lead = int(counts[-1]) - (int(counts[-2]) if counts.size > 1 else 0) if counts.size else 0
    margin = lead - left
    return 0 if margin > 0 else min(left, -margin // 2 + 1)


def vote_stop_points(atoms: np.ndarray, ns: np.ndarray) -> np.ndarray:
    """Completions drawn (M, len(ns)) by a majority vote capped at N that stops as soon as it is decided.

    ``atoms`` (M, L) are M sequences of answer buckets in draw order with L >= max(ns); the vote of
    cap N stops at the first k with (k + leader's votes - runner-up's votes) > N, else at N (the rule
    of ``votes_to_decide``: that quantity never decreases as votes arrive).
    """
    atoms = np.asarray(atoms, dtype=np.int64)
    ns = np.asarray(ns, dtype=np.int64).reshape(-1)
    m, length = atoms.shape
    if ns.size and ns.max() > length:
        raise ValueError(f"sequences of {length} votes cannot show a vote of N = {int(ns.max())}")
    if m == 0:
        return np.zeros((0, ns.size), dtype=np.int64)
    _, dense = np.unique(atoms, return_inverse=True)  # bucket ids 0..B-1
    dense = dense.reshape(m, length)
    n_buckets = int(dense.max()) + 1
    counts = np.zeros((m, length, max(n_buckets, 2)), dtype=np.int64)
    np.put_along_axis(counts, dense[:, :, None], 1, axis=2)
    np.cumsum(counts, axis=1, out=counts)
    top2 = np.partition(counts, counts.shape[2] - 2, axis=2)[:, :, -2:]
    reach = np.arange(1, length + 1)[None, :] + top2[:, :, 1] - top2[:, :, 0]  # (M, L), non-decreasing in k
    out = np.empty((m, ns.size), dtype=np.int64)
    for j, n in enumerate(ns.tolist()):
        decided = reach[:, :n] > n
        out[:, j] = np.where(decided.any(axis=1), decided.argmax(axis=1) + 1, n)
    return out


def block_utilities(table: TableSchema, prompts: np.ndarray, queries: np.ndarray,
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


_BLOCK_ELEMENTS = 1 << 22  # (prompt, query, atom) cells per block of the streamed path


def mean_task_reward(table: OutcomeTable, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact task reward (C', P, N_max) averaged over ``queries``, and the row of each context (C,).

    Uses the cached/stored tensor when the table has it or it fits ``iapo_gym.exact.TENSOR_LIMIT_BYTES``; otherwise
    streams blocks of about ``_BLOCK_ELEMENTS`` (prompt, query, atom) cells (a block of prompts, or
    a block of one prompt's queries when one prompt's queries are more) and keeps the running
    query sums only, so its memory is the (C', P, N_max) result plus one block whatever the number
    of queries, and tables with many Best-of-N contexts never build the whole tensor.
    """
    queries = np.asarray(queries, dtype=np.int64)
    if stored(table) is not None or task_reward_fits(table):
        exact = exact_reward(table)
        return exact.reward[:, :, queries, :].mean(axis=2), exact.rows(table.n_contexts)
    weights, inverse = objective_rows(table)
    n_p, _, n_m = table.probs.shape
    per_block = max(1, _BLOCK_ELEMENTS // max(1, n_m))  # (prompt, query) rows per block
    query_step = min(queries.size, per_block)
    prompt_step = max(1, per_block // max(1, query_step))
    out = np.zeros((weights.shape[0], n_p, table.n_max))
    for q0 in range(0, queries.size, query_step):
        chunk = queries[q0 : q0 + query_step]
        share = chunk.size / queries.size  # this chunk's weight in the mean over ``queries``
        for start in range(0, n_p, prompt_step):
            probs = table.probs[start : start + prompt_step][:, chunk]  # (b, q, M)
            if table.aggregator == "mv":
                assert table.gold is not None
                gold = np.broadcast_to(table.gold[chunk][None, :], probs.shape[:2]).reshape(-1)
                credit = mv_expected_credit(probs.reshape(-1, n_m), gold, table.n_max)
                mean = credit.reshape(*probs.shape[:2], table.n_max).mean(axis=1)
                out[0, start : start + prompt_step] += mean if share == 1.0 else share * mean
                continue
            assert table.atoms is not None
            atoms = table.atoms[start : start + prompt_step][:, chunk]  # (b, q, M, K)
            mean = bon_weighted_max(atoms, probs, weights, table.n_max, query_mean=True)
            out[:, start : start + prompt_step] += mean if share == 1.0 else share * mean
    return out, inverse


def expected_arm_reward(table: OutcomeTable, arms: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Exact expected task reward (C,) of context c's arm ``arms[c] = (p, N)``, averaged over ``queries``.

    The same values as ``iapo_gym.exact.expected_task_reward`` (mv: the unscaled credit; bon: weighted by the
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
