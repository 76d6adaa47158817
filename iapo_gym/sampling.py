"""Vectorized categorical sampling of completions (Walker/Vose alias tables).

One uniform per completion: its integer part picks a column, its fractional part decides
between the column and its alias, so a draw is O(1) whatever the number of atoms.
"""

from __future__ import annotations

import numpy as np


class AliasSampler:
    """Alias tables for R categorical rows of M atoms each."""

    def __init__(self, probs: np.ndarray) -> None:
        """Build the tables for ``probs`` of shape (R, M) (rows sum to 1)."""
        probs = np.asarray(probs, dtype=np.float64)
        n_rows, n_atoms = probs.shape
        self.n_atoms = n_atoms
        scaled = probs * n_atoms
        accept = np.ones((n_rows, n_atoms))
        alias = np.tile(np.arange(n_atoms, dtype=np.int64), (n_rows, 1))
        done = np.zeros((n_rows, n_atoms), dtype=bool)
        rows = np.arange(n_rows)
        for _ in range(n_atoms - 1):
            small_mask = (~done) & (scaled < 1.0 - 1e-12)
            active = small_mask.any(axis=1)
            if not active.any():
                break
            r = rows[active]
            small = np.argmax(small_mask[r], axis=1)
            large = np.argmax(np.where(done[r], -np.inf, scaled[r]), axis=1)
            accept[r, small] = scaled[r, small]
            alias[r, small] = large
            scaled[r, large] -= 1.0 - scaled[r, small]
            done[r, small] = True
        self.accept = accept.ravel()
        self.alias = alias.ravel().astype(np.int32 if n_atoms < 2**31 else np.int64)

    def sample(self, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One atom index per entry of ``rows`` (flat row indices), drawn with ``rng``."""
        x = rng.random(rows.size) * self.n_atoms
        column = x.astype(np.int64)
        np.minimum(column, self.n_atoms - 1, out=column)
        flat = rows * self.n_atoms + column
        keep = (x - column) < self.accept[flat]
        return np.where(keep, column, self.alias[flat])
