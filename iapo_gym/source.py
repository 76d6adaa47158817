"""Where an env's completions come from: one small interface for a table's sampler and a live endpoint.

``IAPOEnv`` checks a batch, draws its queries from its own generator and then asks its
``CompletionSource`` for the outcome atoms of every pull. A ``TableSource`` samples a table's
known outcome distributions (so an exact oracle exists); ``iapo_gym.llm.live`` asks an endpoint.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from iapo_gym.sampling import AliasSampler
from iapo_gym.tables import OutcomeTable


@runtime_checkable
class CompletionSource(Protocol):
    """Draws the outcome atoms of pulls whose prompts, queries and Ns the env has chosen and checked."""

    #: True when the outcome distributions are known, so the exact oracle (Q-tables, optimal policies,
    #: exact ACR) can answer; ``no_exact`` says why not otherwise.
    exact: bool
    no_exact: str

    def draw(self, prompts: np.ndarray, queries: np.ndarray, ns: np.ndarray,
             rng: np.random.Generator) -> np.ndarray:
        """Atoms (sum ns,) of every pull, pull after pull in draw order; ``rng`` is the env's generator."""
        ...

    def draw_one(self, prompt: int, query: int, n: int, rng: np.random.Generator) -> np.ndarray:
        """Atoms (n,) of one pull (the sequential agents' path); draws what ``draw`` draws for a batch of one."""
        ...

    def restart(self) -> None:
        """A seeded reset of the env: the source starts over (a live source its sample indices)."""
        ...


class TableSource:
    """Completions sampled from a table's outcome distributions by its alias sampler (an exact oracle exists)."""

    exact = True
    no_exact = ""

    def __init__(self, table: OutcomeTable) -> None:
        """Sample ``table``; its alias sampler is built on first use and shared by every source on the table."""
        self.table = table

    @property
    def sampler(self) -> AliasSampler:
        """The alias tables of every (prompt, query) row p * n_queries + q."""
        cache = self.table._cache
        if "sampler" not in cache:
            cache["sampler"] = AliasSampler(self.table.probs.reshape(-1, self.table.n_atoms))
        sampler: AliasSampler = cache["sampler"]
        return sampler

    def draw(self, prompts: np.ndarray, queries: np.ndarray, ns: np.ndarray,
             rng: np.random.Generator) -> np.ndarray:
        """Atoms of every pull: one vectorized draw over the pulls' rows, repeated N times each."""
        rows = np.repeat(prompts * self.table.n_queries + queries, ns)
        return self.sampler.sample(rows, rng)

    def draw_one(self, prompt: int, query: int, n: int, rng: np.random.Generator) -> np.ndarray:
        """Atoms of one pull from its row (the same generator calls as ``draw`` of one pull)."""
        return self.sampler.sample_row(prompt * self.table.n_queries + query, n, rng)

    def restart(self) -> None:
        """Nothing to restart: the env's generator is the table source's only state."""
