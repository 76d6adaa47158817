"""What ``IAPOOnline`` keeps of the requests it served: the log of its pulls with their utilities under every context,
and the completion source of its estimator's env, which draws nothing (the online env serves every completion)."""

from __future__ import annotations

import numpy as np

from iapo_gym import Pulls


class ServedElsewhere:
    """The completion source of the estimator's env: the online env serves every completion, this one draws none."""

    exact = False
    no_exact = "the online agent's estimator env holds the schema only; the online env serves the completions"

    def draw(self, prompts: np.ndarray, queries: np.ndarray, ns: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Never called by the estimator; a RuntimeError if anything tries."""
        raise RuntimeError("the online agent's estimator env draws no completions; the online env serves them")

    def draw_one(self, prompt: int, query: int, n: int, rng: np.random.Generator) -> np.ndarray:
        """As ``draw``: a RuntimeError."""
        return self.draw(np.array([prompt]), np.array([query]), np.array([n]), rng)

    def restart(self) -> None:
        """Nothing to restart."""


class ServedLog:
    """Pulls served (step, prompt, N, query, atoms) with each pull's utility under every context, in arrays that
    grow by doubling: a batch or a single request is written after the rows already there (amortized O(1) per pull,
    where joining blocks on each read copied the whole log), and a read is a view of the rows so far. A view read
    earlier never changes: appends write past it, and ``keep`` and ``clear`` start new arrays."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget everything (new arrays: views read before stay as they were)."""
        self._n = 0  # pulls
        self._m = 0  # completions
        self._steps = np.zeros(0, dtype=np.int64)
        self._prompts = np.zeros(0, dtype=np.int64)
        self._ns = np.zeros(0, dtype=np.int64)
        self._queries = np.zeros(0, dtype=np.int64)
        self._offsets = np.zeros(1, dtype=np.int64)
        self._atoms = np.zeros(0, dtype=np.int64)
        self._utilities = np.zeros((0, 0))

    def __bool__(self) -> bool:
        return self._n > 0

    def _reserve(self, pulls: int, completions: int, contexts: int) -> None:
        """Room for ``pulls`` more pulls of ``completions`` more completions, utilities over ``contexts``."""
        need = self._n + pulls
        if need > self._prompts.size or self._utilities.shape[1] != contexts:
            cap = max(need, 2 * self._prompts.size, 64)
            self._steps, self._prompts, self._ns, self._queries = (
                _grown(a, self._n, cap) for a in (self._steps, self._prompts, self._ns, self._queries))
            self._offsets = _grown(self._offsets, self._n + 1, cap + 1)
            utilities = np.zeros((cap, contexts))
            if self._n:
                utilities[:self._n] = self._utilities[:self._n]
            self._utilities = utilities
        if self._m + completions > self._atoms.size:
            self._atoms = _grown(self._atoms, self._m, max(self._m + completions, 2 * self._atoms.size, 256))

    def add(self, steps: np.ndarray, pulls: Pulls, utilities: np.ndarray) -> None:
        """A batch's pulls and their utilities (B, C) under every context."""
        k, done = len(pulls), pulls.completions
        self._reserve(k, done, utilities.shape[1])
        n, m = self._n, self._m
        self._steps[n:n + k] = steps
        self._prompts[n:n + k] = pulls.prompts
        self._ns[n:n + k] = pulls.ns
        self._queries[n:n + k] = pulls.queries
        self._offsets[n + 1:n + k + 1] = m + pulls.offsets[1:]
        self._atoms[m:m + done] = pulls.atoms
        self._utilities[n:n + k] = utilities
        self._n, self._m = n + k, m + done

    def add_one(self, t: int, p: int, n: int, q: int, atoms: np.ndarray, utilities: np.ndarray) -> None:
        """One request's pull (``atoms`` holds its ``n`` outcomes) and its utilities (C,) under every context."""
        self._reserve(1, n, utilities.shape[0])
        i, m = self._n, self._m
        self._steps[i], self._prompts[i], self._ns[i], self._queries[i] = t, p, n, q
        self._offsets[i + 1] = m + n
        self._atoms[m:m + n] = atoms
        self._utilities[i] = utilities
        self._n, self._m = i + 1, m + n

    def read(self) -> tuple[np.ndarray, Pulls]:
        """(steps, pulls) of everything logged, in the order served (views of the log's arrays)."""
        n = self._n
        return self._steps[:n], Pulls(self._prompts[:n], self._ns[:n], self._queries[:n], self._atoms[:self._m],
                                      self._offsets[:n + 1])

    def utilities(self) -> np.ndarray:
        """(B, C): the utility under every context of each pull of ``read()``, in its order."""
        return self._utilities[:self._n]

    def keep(self, mask: np.ndarray) -> None:
        """Keep only the pulls where ``mask`` (over ``read()``) is True, in new arrays."""
        steps, pulls = self.read()
        utilities = self.utilities()
        kept, kept_utilities = select_pulls(pulls, mask), utilities[mask]
        kept_steps = steps[mask]
        self.clear()
        if kept_steps.size:
            self.add(kept_steps, kept, kept_utilities)


def _grown(a: np.ndarray, used: int, size: int) -> np.ndarray:
    """A new array of ``size`` entries (``a``'s dtype) holding ``a``'s first ``used``."""
    out = np.zeros(size, dtype=a.dtype)
    out[:used] = a[:used]
    return out


def select_pulls(pulls: Pulls, mask: np.ndarray) -> Pulls:
    """The pulls where ``mask`` is True, their atoms in draw order."""
    return Pulls.of(pulls.prompts[mask], pulls.ns[mask], pulls.queries[mask], pulls.atoms[np.repeat(mask, pulls.ns)])
