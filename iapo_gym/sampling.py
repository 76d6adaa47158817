"""Vectorized categorical sampling of completions (Walker/Vose alias tables).

One uniform per completion: its integer part picks a column, its fractional part decides
between the column and its alias, so a draw is O(1) whatever the number of atoms.
"""

from __future__ import annotations

import numpy as np


class AliasSampler:
    """Alias tables for R categorical rows of M atoms each."""

    def __init__(self, probs: np.ndarray) -> None:
        """Build the tables for ``probs`` of shape (R, M) (rows sum to 1).

        Vose's pairing, vectorized over rows with two pointers into each row's sorted
        masses: the next small atom (or the large one just demoted below 1) is paired with
        the largest unfinished atom, so the build takes M steps of O(R) work.
        """
        probs = np.asarray(probs, dtype=np.float64)
        n_rows, n_atoms = probs.shape
        self.n_atoms = n_atoms
        mass = probs * n_atoms
        order = np.argsort(mass, axis=1, kind="stable")
        accept = np.ones((n_rows, n_atoms))
        alias = np.tile(np.arange(n_atoms, dtype=np.int64), (n_rows, 1))
        rows = np.arange(n_rows)
        small_ptr = np.zeros(n_rows, dtype=np.int64)
        large_ptr = np.full(n_rows, n_atoms - 1, dtype=np.int64)
        carry = np.full(n_rows, -1, dtype=np.int64)  # a large atom demoted below 1, to pair next
        for _ in range(n_atoms):
            has_carry = carry >= 0
            small = np.where(has_carry, carry, order[rows, np.minimum(small_ptr, n_atoms - 1)])
            large = order[rows, large_ptr]
            live = (has_carry | (small_ptr < large_ptr)) & (small != large) & (mass[rows, small] < 1.0)
            if not live.any():
                break
            r, sm, lg = rows[live], small[live], large[live]
            accept[r, sm] = mass[r, sm]
            alias[r, sm] = lg
            mass[r, lg] -= 1.0 - mass[r, sm]
            small_ptr[r] += ~has_carry[live]
            demoted = mass[r, lg] < 1.0
            carry[r] = np.where(demoted, lg, -1)
            large_ptr[r] -= demoted
        self.accept = accept.ravel()
        self.alias = alias.ravel().astype(np.int32 if n_atoms < 2**31 else np.int64)

    def implied_probs(self) -> np.ndarray:
        """The distribution (R, M) the tables sample from (equals the input up to rounding)."""
        accept = self.accept.reshape(-1, self.n_atoms)
        alias = self.alias.reshape(-1, self.n_atoms)
        out = accept.copy()
        rows = np.repeat(np.arange(accept.shape[0]), self.n_atoms)
        np.add.at(out, (rows, alias.ravel().astype(np.int64)), (1.0 - accept).ravel())
        return out / self.n_atoms

    def sample(self, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One atom index per entry of ``rows`` (flat row indices), drawn with ``rng``."""
        x = rng.random(rows.size) * self.n_atoms
        column = x.astype(np.int64)
        np.minimum(column, self.n_atoms - 1, out=column)
        flat = rows * self.n_atoms + column
        keep = (x - column) < self.accept[flat]
        return np.where(keep, column, self.alias[flat])

    def sample_row(self, row: int, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` atoms of one row: ``sample(np.full(n, row), rng)`` (the same draws and result), cheaper."""
        x = rng.random(n) * self.n_atoms
        column = x.astype(np.int64)
        np.minimum(column, self.n_atoms - 1, out=column)
        start = row * self.n_atoms
        keep = (x - column) < self.accept[start:start + self.n_atoms].take(column)
        return np.where(keep, column, self.alias[start:start + self.n_atoms].take(column))
