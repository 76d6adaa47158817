"""Compiled kernels of ``OnlineEnv``: the completions of served requests and their utilities under every context.

``serve`` (a batch) and ``step`` (one request) draw with the same arithmetic as ``AliasSampler.sample`` (one
uniform per completion: its integer part a column, its fraction column or alias) and score with the same
arithmetic as ``block_utilities``: each Best-of-N score is ``w[c, 0] * v[0] + w[c, 1] * v[1] + ...`` summed left to
right, never fused (no fastmath), each maximum keeps a NaN as ``np.maximum`` does, and a majority vote's credit is
``mv_credit``'s. One pull's drawing and scoring are one function each here, called by the batch kernels for every
pull and by the one-request kernels for theirs, so both paths give the same atoms and utilities bit for bit; a
batch costs one compiled call and builds no (contexts x completions) array.
"""

from __future__ import annotations

import numpy as np

from iapo_gym.compiled import njit


@njit
def _alias_draw(uniforms: np.ndarray, accept: np.ndarray, alias: np.ndarray, row: int, n_atoms: int,
                start: int, stop: int, atoms: np.ndarray) -> None:  # pragma: no cover - compiled
    """``atoms[start:stop]``: the draws of ``uniforms[start:stop]`` from alias row ``row``."""
    base = row * n_atoms
    for i in range(start, stop):
        x = uniforms[i] * n_atoms
        column = np.int64(x)
        if column > n_atoms - 1:
            column = n_atoms - 1
        if x - column < accept[base + column]:
            atoms[i] = column
        else:
            atoms[i] = alias[base + column]


@njit
def _bon_pull(vectors: np.ndarray, p: int, query: int, atoms: np.ndarray, start: int, stop: int,
              weights: np.ndarray, cost_n: float, utilities: np.ndarray,
              column: int) -> None:  # pragma: no cover - compiled
    """``utilities[:, column]``: one Best-of-n pull's best score under every context plus its cost term."""
    n_obj, last = vectors.shape[3], weights.shape[1] - 1
    for c in range(weights.shape[0]):
        best = 0.0
        for i in range(start, stop):
            a = atoms[i]
            s = weights[c, 0] * vectors[p, query, a, 0]
            for d in range(1, n_obj):
                s += weights[c, d] * vectors[p, query, a, d]
            if i == start or s > best or s != s:
                best = s
        utilities[c, column] = best + weights[c, last] * cost_n


@njit
def _mv_pull(atoms: np.ndarray, start: int, stop: int, gold: int, counts: np.ndarray, weights: np.ndarray,
             cost_n: float, utilities: np.ndarray, column: int) -> None:  # pragma: no cover - compiled
    """``utilities[:, column]``: one majority vote's credit (``mv_credit``) times ``w[c, 0]`` plus its cost term
    under every context; ``counts`` is scratch of one slot per bucket."""
    counts[:] = 0
    for i in range(start, stop):
        counts[atoms[i]] += 1
    top = counts.max()
    ties = 0
    for b in range(counts.size):
        if counts[b] == top:
            ties += 1
    credit = 1.0 / ties if counts[gold] == top else 0.0
    last = weights.shape[1] - 1
    for c in range(weights.shape[0]):
        utilities[c, column] = weights[c, 0] * credit + weights[c, last] * cost_n


@njit
def bon_batch(uniforms: np.ndarray, accept: np.ndarray, alias: np.ndarray, n_atoms: int, prompts: np.ndarray,
              queries: np.ndarray, offsets: np.ndarray, n_queries: int, vectors: np.ndarray, weights: np.ndarray,
              cost_n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """(atoms (total,), utilities (C, B)) of B Best-of-N pulls: pull j is prompt ``prompts[j]`` on ``queries[j]``
    with completions ``offsets[j]:offsets[j + 1]`` of ``uniforms``.

    ``vectors`` (P, Q, M, K) the table's atom vectors, ``weights`` (C, K + 1) the context weights, ``cost_n`` (B,)
    each pull's N times its cost per completion.
    """
    b = prompts.size
    atoms = np.empty(uniforms.size, dtype=np.int64)
    utilities = np.empty((weights.shape[0], b))
    for j in range(b):
        _alias_draw(uniforms, accept, alias, prompts[j] * n_queries + queries[j], n_atoms, offsets[j],
                    offsets[j + 1], atoms)
        _bon_pull(vectors, prompts[j], queries[j], atoms, offsets[j], offsets[j + 1], weights, cost_n[j],
                  utilities, j)
    return atoms, utilities


@njit
def mv_batch(uniforms: np.ndarray, accept: np.ndarray, alias: np.ndarray, n_atoms: int, prompts: np.ndarray,
             queries: np.ndarray, offsets: np.ndarray, n_queries: int, gold: np.ndarray, weights: np.ndarray,
             cost_n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """(atoms (total,), utilities (C, B)) of B majority votes, laid out as ``bon_batch``'s; ``gold`` (Q,) each
    query's gold bucket."""
    b = prompts.size
    atoms = np.empty(uniforms.size, dtype=np.int64)
    utilities = np.empty((weights.shape[0], b))
    counts = np.zeros(n_atoms, dtype=np.int64)
    for j in range(b):
        _alias_draw(uniforms, accept, alias, prompts[j] * n_queries + queries[j], n_atoms, offsets[j],
                    offsets[j + 1], atoms)
        _mv_pull(atoms, offsets[j], offsets[j + 1], gold[queries[j]], counts, weights, cost_n[j], utilities, j)
    return atoms, utilities


@njit
def bon_one(uniforms: np.ndarray, accept: np.ndarray, alias: np.ndarray, n_atoms: int, p: int, query: int,
            n_queries: int, vectors: np.ndarray, weights: np.ndarray,
            cost_n: float) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """(atoms (n,), utilities (C,)) of one Best-of-n request of prompt ``p`` on ``query``: ``bon_batch``'s pull
    without the batch's arrays."""
    atoms = np.empty(uniforms.size, dtype=np.int64)
    _alias_draw(uniforms, accept, alias, p * n_queries + query, n_atoms, 0, uniforms.size, atoms)
    utilities = np.empty((weights.shape[0], 1))
    _bon_pull(vectors, p, query, atoms, 0, atoms.size, weights, cost_n, utilities, 0)
    return atoms, utilities[:, 0]


@njit
def mv_one(uniforms: np.ndarray, accept: np.ndarray, alias: np.ndarray, n_atoms: int, p: int, query: int,
           n_queries: int, gold: int, weights: np.ndarray,
           cost_n: float) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """(atoms (n,), utilities (C,)) of one majority vote of n of prompt ``p`` on ``query`` (gold bucket ``gold``):
    ``mv_batch``'s pull without the batch's arrays."""
    atoms = np.empty(uniforms.size, dtype=np.int64)
    _alias_draw(uniforms, accept, alias, p * n_queries + query, n_atoms, 0, uniforms.size, atoms)
    utilities = np.empty((weights.shape[0], 1))
    _mv_pull(atoms, 0, atoms.size, gold, np.zeros(n_atoms, dtype=np.int64), weights, cost_n, utilities, 0)
    return atoms, utilities[:, 0]
