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
    """Pulls served (step, prompt, N, query, atoms) with each pull's utility under every context: blocks of a
    batch's arrays, and single requests as scalars (the one-request path: lists of their steps, prompts, Ns, queries,
    atom arrays and utility vectors), joined into one block when read."""

    def __init__(self) -> None:
        self.blocks: list[tuple[np.ndarray, Pulls, np.ndarray]] = []
        self._clear_singles()

    def _clear_singles(self) -> None:
        self._steps: list[int] = []
        self._prompts: list[int] = []
        self._ns: list[int] = []
        self._queries: list[int] = []
        self._atoms: list[np.ndarray] = []
        self._utilities: list[np.ndarray] = []

    def __bool__(self) -> bool:
        return bool(self.blocks or self._steps)

    def add(self, steps: np.ndarray, pulls: Pulls, utilities: np.ndarray) -> None:
        """A batch's pulls and their utilities (B, C) under every context."""
        self._flush()
        self.blocks.append((steps, pulls, utilities))

    def add_one(self, t: int, p: int, n: int, q: int, atoms: np.ndarray, utilities: np.ndarray) -> None:
        """One request's pull (``atoms`` holds its ``n`` outcomes) and its utilities (C,) under every context."""
        self._steps.append(t)
        self._prompts.append(p)
        self._ns.append(n)
        self._queries.append(q)
        self._atoms.append(atoms)
        self._utilities.append(utilities)

    def _flush(self) -> None:
        if not self._steps:
            return
        pulls = Pulls.of(np.array(self._prompts, dtype=np.int64), np.array(self._ns, dtype=np.int64),
                         np.array(self._queries, dtype=np.int64), np.concatenate(self._atoms))
        self.blocks.append((np.array(self._steps, dtype=np.int64), pulls, np.stack(self._utilities)))
        self._clear_singles()

    def _join(self) -> tuple[np.ndarray, Pulls, np.ndarray]:
        self._flush()
        if not self.blocks:
            empty = np.zeros(0, dtype=np.int64)
            return empty, Pulls(empty, empty, empty, empty, np.zeros(1, dtype=np.int64)), np.zeros((0, 0))
        if len(self.blocks) > 1:
            self.blocks = [(np.concatenate([b[0] for b in self.blocks]), concat_pulls([b[1] for b in self.blocks]),
                            np.concatenate([b[2] for b in self.blocks]))]
        return self.blocks[0]

    def read(self) -> tuple[np.ndarray, Pulls]:
        """(steps, pulls) of everything logged, as one block (kept as that one block)."""
        steps, pulls, _ = self._join()
        return steps, pulls

    def utilities(self) -> np.ndarray:
        """(B, C): the utility under every context of each pull of ``read()``'s block, in its order."""
        return self._join()[2]

    def keep(self, mask: np.ndarray) -> None:
        """Keep only the pulls where ``mask`` (over ``read()``'s block) is True."""
        steps, pulls, utilities = self._join()
        self.blocks = [(steps[mask], select_pulls(pulls, mask), utilities[mask])]

    def clear(self) -> None:
        """Forget everything."""
        self.blocks = []
        self._clear_singles()


def select_pulls(pulls: Pulls, mask: np.ndarray) -> Pulls:
    """The pulls where ``mask`` is True, their atoms in draw order."""
    return Pulls.of(pulls.prompts[mask], pulls.ns[mask], pulls.queries[mask], pulls.atoms[np.repeat(mask, pulls.ns)])


def concat_pulls(parts: list[Pulls]) -> Pulls:
    """One block of ``parts``' pulls, in order."""
    if len(parts) == 1:
        return parts[0]
    return Pulls.of(np.concatenate([p.prompts for p in parts]), np.concatenate([p.ns for p in parts]),
                    np.concatenate([p.queries for p in parts]), np.concatenate([p.atoms for p in parts]))
