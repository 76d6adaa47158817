"""The exact expected task reward of every arm: its kernels, the (C', P, Q, N_max) tensor, its digest.

The tensor is computed once per table and kept on it (``stored``/``attach`` are the only way to it), or
read with the table from the file's ``exact`` group (``iapo_gym.tables`` checks it against ``exact_digest``).
This module imports nothing else of the package: a table is anything with the arrays of ``TableArrays``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from math import factorial
from typing import Any, Protocol

import numpy as np

#: Version of the exact expected-task-reward computation stored in a table file; bump it when
#: ``expected_task_reward`` changes its values, so stored tensors are recomputed.
EXACT_VERSION = 1


class TableArrays(Protocol):
    """What the exact computation reads of an ``iapo_gym.tables.OutcomeTable`` (read-only)."""

    @property
    def aggregator(self) -> str: ...
    @property
    def probs(self) -> np.ndarray: ...
    @property
    def n_max(self) -> int: ...
    @property
    def context_weights(self) -> np.ndarray: ...
    @property
    def atoms(self) -> np.ndarray | None: ...
    @property
    def gold(self) -> np.ndarray | None: ...
    @property
    def _cache(self) -> dict[str, Any]: ...
    @property
    def n_contexts(self) -> int: ...


@dataclass(frozen=True)
class ExactReward:
    """The exact task-reward tensor (C', P, Q, N_max), read-only, and the row of each context (bon: (C,))."""

    reward: np.ndarray
    context_index: np.ndarray | None = None

    def rows(self, n_contexts: int) -> np.ndarray:
        """The tensor row of each of ``n_contexts`` contexts (mv: all row 0)."""
        return context_rows(self.context_index, n_contexts)


def context_rows(context_index: np.ndarray | None, n_contexts: int) -> np.ndarray:
    """The tensor row of each of ``n_contexts`` contexts: ``context_index``, or row 0 for all where it is None
    (majority vote: the task reward does not depend on the context's weights)."""
    if context_index is None:
        return np.zeros(n_contexts, dtype=np.int64)
    return context_index


_KEY = "exact"  # the one entry of the table's derived-array cache this module owns


def stored(table: TableArrays) -> ExactReward | None:
    """The table's exact tensor if it was computed or read with the table, else None."""
    found: ExactReward | None = table._cache.get(_KEY)
    return found


def attach(table: TableArrays, exact: ExactReward) -> None:
    """Keep ``exact`` on ``table`` (shared by every view of it, e.g. ``with_split``)."""
    exact.reward.setflags(write=False)
    table._cache[_KEY] = exact


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


#: The grouped Best-of-N kernel is used when the (prompt, query) rows share their atom arrays at least
#: this many times on average (else the per-weighting kernel ``bon_expected_max`` is used).
_MIN_SHARE = 8
#: Rows per chunk of the grouped kernel: its powers (atoms x rows) stay in a core's cache.
_CHUNK_ORDER_ROWS = 1024
_HASH = np.sqrt(np.arange(2.0, 2.0 + 4096.0))  # a fixed projection for spotting equal atom rows


def atom_sets(atoms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct atom arrays (U, M, K) among the rows of ``atoms`` (..., M, K), and the set of each row (...).

    Rows are matched by a fixed linear projection, then checked element by element; rows that
    only collide in the projection get sets of their own.
    """
    lead, (n_m, n_k) = atoms.shape[:-2], atoms.shape[-2:]
    flat = np.ascontiguousarray(atoms).reshape(-1, n_m * n_k)
    if flat.shape[0] == 0:
        return np.zeros((0, n_m, n_k)), np.zeros(lead, dtype=np.int64)
    width = flat.shape[1]
    weights = np.resize(_HASH, width) if width > _HASH.size else _HASH[:width]
    _, first, inverse = np.unique(flat @ weights, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    clash = np.flatnonzero((flat != flat[first[inverse]]).any(axis=1))
    if clash.size:  # equal projections of different rows: exact matching for those rows
        extra, extra_inverse = np.unique(flat[clash], axis=0, return_inverse=True)
        inverse[clash] = first.size + extra_inverse.reshape(-1)
        sets = np.concatenate([flat[first], extra])
    else:
        sets = flat[first]
    return sets.reshape(-1, n_m, n_k), inverse.reshape(lead).astype(np.int64)


def _order_basis(cdf_t: np.ndarray, steps: np.ndarray, top: np.ndarray, n_max: int) -> np.ndarray:
    """(n_max, K, rows) vectors V with E[max_N] = w . V[N-1] for every weighting that sorts the atoms this way.

    ``cdf_t`` (M-1, rows) is the cumulative mass F_j of the first j sorted atoms, ``steps`` (M-1, K)
    the differences a_(j+1) - a_(j) of consecutive sorted atoms and ``top`` (K,) the last one:
    V[N] = a_(M) - sum_j (a_(j+1) - a_(j)) F_j^N (summation by parts, linear in the weights).
    """
    out = np.empty((n_max, steps.shape[1], cdf_t.shape[1]))
    power = cdf_t.copy()
    steps_t = np.ascontiguousarray(steps.T)
    for n in range(n_max):
        if n:
            power *= cdf_t
        np.matmul(steps_t, power, out=out[n])
    np.subtract(top[None, :, None], out, out=out)
    return out


def bon_weighted_max(atoms: np.ndarray, probs: np.ndarray, weights: np.ndarray, n_max: int, *,
                     query_mean: bool = False) -> np.ndarray:
    """Exact E[max of N i.i.d. draws of w . a] (C', P, Q, n_max) under every weighting w, N = 1..n_max.

    ``atoms`` (P, Q, M, K) are objective vectors, ``probs`` (P, Q, M) their probabilities and
    ``weights`` (C', K) the objective weightings; with ``query_mean`` the mean over Q (C', P, n_max).

    E[max_N] depends on w only through the order w puts the atoms in and their scores, and the
    scores are linear in w: for one order, E[max_N] = w . V_N with V_N = a_(M) - sum_j
    (a_(j+1) - a_(j)) F_j^N. So where (prompt, query) rows share their atom array (a grid of
    outcomes), the powers F_j^N are computed once per distinct order of each atom array and every
    weighting with that order reads them with a K-vector product. Ties need no rule: inside a
    tie w . (a_(j+1) - a_(j)) = 0, so any order that sorts w's scores gives the same value (the
    stable argsort is used). Rows that share too little (fewer than ``_MIN_SHARE`` rows per atom
    array on average) take the per-weighting kernel ``bon_expected_max``.
    """
    weights = np.asarray(weights, dtype=np.float64)
    n_p, n_q, n_m = probs.shape
    sets, row_set = atom_sets(atoms)
    n_rows = n_p * n_q
    if sets.shape[0] * _MIN_SHARE > n_rows or n_m < 2:
        return _per_weighting(atoms, probs, weights, n_max, query_mean)
    probs_t = np.ascontiguousarray(probs.reshape(n_rows, n_m).T)  # (M, rows): sums along the atom axis run row-parallel
    flat_set = row_set.reshape(n_rows)
    by_set = np.argsort(flat_set, kind="stable")  # rows of each set, in row (prompt-major) order
    bounds = np.searchsorted(flat_set[by_set], np.arange(sets.shape[0] + 1))
    out = np.zeros((weights.shape[0], n_p, n_max)) if query_mean else np.empty((weights.shape[0], n_rows, n_max))
    for u in range(sets.shape[0]):
        rows = by_set[bounds[u] : bounds[u + 1]]
        if rows.size == 0:
            continue
        set_atoms = sets[u]
        orders = np.argsort(set_atoms @ weights.T, axis=0, kind="stable").T  # (C', M)
        distinct, which = np.unique(orders, axis=0, return_inverse=True)
        which = which.reshape(-1)
        for s, order in enumerate(distinct):
            ctx = np.flatnonzero(which == s)
            sorted_atoms = set_atoms[order]
            steps, top = np.diff(sorted_atoms, axis=0), sorted_atoms[-1]
            if query_mean:
                prompts = rows // n_q
                sums = np.zeros((n_max, set_atoms.shape[1], n_p))
            for start in range(0, rows.size, _CHUNK_ORDER_ROWS):
                chunk = rows[start : start + _CHUNK_ORDER_ROWS]
                cdf = np.cumsum(probs_t[np.ix_(order, chunk)], axis=0)
                cdf_t = cdf[:-1] / cdf[-1:]
                basis = _order_basis(cdf_t, steps, top, n_max)  # (N, K, rows)
                if query_mean:
                    chunk_prompts = prompts[start : start + _CHUNK_ORDER_ROWS]
                    heads = np.flatnonzero(np.r_[True, chunk_prompts[1:] != chunk_prompts[:-1]])
                    sums[:, :, chunk_prompts[heads]] += np.add.reduceat(basis, heads, axis=2)
                else:
                    out[np.ix_(ctx, chunk)] = np.einsum("nkr,ck->crn", basis, weights[ctx])
            if query_mean:
                used = np.unique(prompts)
                out[np.ix_(ctx, used)] += np.einsum("nkp,ck->cpn", sums[:, :, used], weights[ctx]) / n_q
    return out if query_mean else out.reshape(weights.shape[0], n_p, n_q, n_max)


def _per_weighting(atoms: np.ndarray, probs: np.ndarray, weights: np.ndarray, n_max: int,
                   query_mean: bool) -> np.ndarray:
    """``bon_weighted_max`` one weighting at a time with ``bon_expected_max`` (rows with their own atoms)."""
    n_p, n_q, _ = probs.shape
    out = np.empty((weights.shape[0], n_p) + (() if query_mean else (n_q,)) + (n_max,))
    for i, w in enumerate(weights):
        best = bon_expected_max(atoms @ w, probs, n_max)
        out[i] = best.mean(axis=1) if query_mean else best
    return out


#: Largest (C', P, Q, N_max) task-reward tensor (bytes) that is built, cached and stored whole;
#: above it ``iapo_gym.utility.mean_task_reward`` evaluates one objective weighting and a block of prompts at a time.
TENSOR_LIMIT_BYTES = 1 << 30


def objective_rows(table: TableArrays) -> tuple[np.ndarray, np.ndarray]:
    """Distinct objective weightings (C', K) and the row of each context (C,); mv: one row (the credit)."""
    if table.aggregator == "mv":
        return np.ones((1, 1)), np.zeros(table.n_contexts, dtype=np.int64)
    weights, inverse = np.unique(table.context_weights[:, :-1], axis=0, return_inverse=True)
    return weights, inverse.reshape(-1).astype(np.int64)


def task_reward_fits(table: TableArrays) -> bool:
    """True when the whole (C', P, Q, N_max) tensor is at most ``TENSOR_LIMIT_BYTES``."""
    n_rows = objective_rows(table)[0].shape[0]
    return n_rows * table.probs.shape[0] * table.probs.shape[1] * table.n_max * 8 <= TENSOR_LIMIT_BYTES


def expected_task_reward(table: TableArrays) -> np.ndarray:
    """Exact expected weighted task reward (C', P, Q, N_max) of every arm on every query.

    For majority vote C' = 1 and the value is the credit (scale it by w_1); for Best-of-N
    C' is the number of distinct objective-weight vectors (contexts differing only in the cost
    weight share one row; ``stored(table).rows`` maps context -> row) and the value already
    includes the objective weights. The cost term is deterministic and added by the caller.
    Kept on the table (``stored``).
    """
    return exact_reward(table).reward


def exact_reward(table: TableArrays) -> ExactReward:
    """The table's ``ExactReward``: the stored one, else computed now and attached."""
    found = stored(table)
    if found is not None:
        return found
    n_p, n_q, n_m = table.probs.shape
    index = None
    if table.aggregator == "mv":
        assert table.gold is not None
        gold = np.broadcast_to(table.gold[None, :], (n_p, n_q)).reshape(-1)
        credit = mv_expected_credit(table.probs.reshape(-1, n_m), gold, table.n_max)
        result = credit.reshape(1, n_p, n_q, table.n_max)
    else:
        assert table.atoms is not None
        # Contexts that differ only in their cost weight share the task reward.
        objective_weights, index = objective_rows(table)
        result = bon_weighted_max(table.atoms, table.probs, objective_weights, table.n_max)
    exact = ExactReward(result, index)
    attach(table, exact)
    return exact


def exact_digest(table: TableArrays) -> str:
    """sha256 of every array the exact task-reward tensor is computed from (probs, atoms/gold, objective weights)."""
    h = hashlib.sha256()
    h.update(f"{table.aggregator};{table.n_max};{EXACT_VERSION};{table.probs.shape}".encode())
    arrays = [table.probs]
    if table.aggregator == "bon":
        assert table.atoms is not None
        arrays += [table.atoms, np.ascontiguousarray(table.context_weights[:, :-1])]
    else:
        assert table.gold is not None
        arrays.append(table.gold)
    for a in arrays:
        h.update(str(a.shape).encode())
        h.update(np.ascontiguousarray(a).data)
    return h.hexdigest()
