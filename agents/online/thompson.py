"""Gaussian Thompson sampling over the arms (p, N) of the online protocol, on UCB's shared statistics.

Each request draws, for every arm of its context, a value from the Gaussian posterior of the arm's mean
(mean of its utilities, sd ``sigma / sqrt(n_arm)``) and takes the best available one. The statistics, the
cross-context and nested reuse, the optimistic entry of arms never pulled, the batch rule and the discount are
``ContextUCB``'s (``agents/online/ucb.py``); only the bonus differs: a random draw instead of a width.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agents.online.ucb import ContextUCB


class ContextThompson(ContextUCB):
    """Thompson sampling per context over (prompt, N on a grid) with a Gaussian posterior of known spread.

    :param sigma: assumed sd of one utility (utility units); the posterior sd of an arm is sigma / sqrt(n).
    :param discount: factor the counts and sums fade by per request (1: no fading; < 1 tracks drift).
    :param n_grid: ``"pow2"`` (N = 1, 2, 4, ..., and N_max) or ``"all"`` (every N).
    :param nested: also count each pull's first k completions as a pull of N = k (k on the grid, k < N).
    """

    def __init__(self, seed: int | None = None, sigma: float = 0.1, discount: float = 1.0, n_grid: str = "pow2",
                 nested: bool = True) -> None:
        """Hyper-parameters as documented on the class; ``seed`` for the posterior draws."""
        super().__init__(seed, c=0.0, discount=discount, n_grid=n_grid, nested=nested)
        if not sigma > 0.0:
            raise ValueError(f"sigma must be > 0, got {sigma!r}")
        self.sigma = float(sigma)

    def params(self) -> dict[str, Any]:
        """The hyper-parameters."""
        return {"sigma": self.sigma, "discount": self.discount, "n_grid": self.n_grid, "nested": self.nested}

    def _bonus(self, counts: np.ndarray, total: float) -> np.ndarray:
        """A draw of the posterior's deviation from the mean: sigma / sqrt(n) times a standard normal per arm."""
        return self.sigma * self.rng.standard_normal(counts.shape) / np.sqrt(np.maximum(counts, 1e-12))
