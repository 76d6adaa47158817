"""Compiled kernels of ``OnlineEnv``'s one-request path: one request's completions and their utilities in one call.

A request served alone costs a dozen numpy calls on 1-element arrays through the batch code (the alias draw, the
scoring, the maximum); these kernels do the same arithmetic in the same order on scalars, so their atoms and
utilities are bit-identical to the batch path's (``AliasSampler.sample``, ``OnlineEnv._bon_utilities``,
``block_utilities``): each score is ``w[c, 0] * v[0] + w[c, 1] * v[1] + ...`` summed left to right, never fused (no
fastmath), and each maximum keeps a NaN as ``np.maximum`` does.
"""

from __future__ import annotations

import numpy as np

from iapo_gym.compiled import njit


@njit
def _alias_draw(uniforms: np.ndarray, accept: np.ndarray, alias: np.ndarray, row: int,
                n_atoms: int) -> np.ndarray:  # pragma: no cover - compiled
    """The atoms of ``uniforms.size`` draws from alias row ``row``: ``AliasSampler.sample_row``'s arithmetic."""
    start = row * n_atoms
    atoms = np.empty(uniforms.size, dtype=np.int64)
    for i in range(uniforms.size):
        x = uniforms[i] * n_atoms
        column = np.int64(x)
        if column > n_atoms - 1:
            column = n_atoms - 1
        if x - column < accept[start + column]:
            atoms[i] = column
        else:
            atoms[i] = alias[start + column]
    return atoms


@njit
def bon_one(uniforms: np.ndarray, accept: np.ndarray, alias: np.ndarray, n_atoms: int, p: int, query: int,
            n_queries: int, vectors: np.ndarray, weights: np.ndarray,
            cost_n: float) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """(atoms (n,), utilities (C,)) of one Best-of-n request of prompt ``p`` on ``query``.

    ``vectors`` (P, Q, M, K) the table's atom vectors, ``weights`` (C, K + 1) the context weights, ``cost_n`` the
    request's n times its cost per completion; a utility is the best completion's score plus the cost term.
    """
    atoms = _alias_draw(uniforms, accept, alias, p * n_queries + query, n_atoms)
    n_contexts, n_obj, last = weights.shape[0], vectors.shape[3], weights.shape[1] - 1
    utilities = np.empty(n_contexts)
    for c in range(n_contexts):
        best = 0.0
        for i in range(atoms.size):
            a = atoms[i]
            s = weights[c, 0] * vectors[p, query, a, 0]
            for d in range(1, n_obj):
                s += weights[c, d] * vectors[p, query, a, d]
            if i == 0 or s > best or s != s:
                best = s
        utilities[c] = best + weights[c, last] * cost_n
    return atoms, utilities


@njit
def mv_one(uniforms: np.ndarray, accept: np.ndarray, alias: np.ndarray, n_atoms: int, p: int, query: int,
           n_queries: int, gold: int, weights: np.ndarray,
           cost_n: float) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """(atoms (n,), utilities (C,)) of one majority vote of n of prompt ``p`` on ``query`` (gold bucket ``gold``).

    The vote's credit is 1/t when the gold bucket is among the t most-voted buckets, else 0 (``mv_credit``); a
    utility is ``weights[c, 0]`` times the credit plus the cost term.
    """
    atoms = _alias_draw(uniforms, accept, alias, p * n_queries + query, n_atoms)
    counts = np.zeros(n_atoms, dtype=np.int64)
    for i in range(atoms.size):
        counts[atoms[i]] += 1
    top = counts.max()
    ties = 0
    for b in range(n_atoms):
        if counts[b] == top:
            ties += 1
    credit = 1.0 / ties if counts[gold] == top else 0.0
    n_contexts, last = weights.shape[0], weights.shape[1] - 1
    utilities = np.empty(n_contexts)
    for c in range(n_contexts):
        utilities[c] = weights[c, 0] * credit + weights[c, last] * cost_n
    return atoms, utilities
