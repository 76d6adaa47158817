"""Per-arm estimates kept in a policy file, so a served policy can rate any weights, and the completions majority
votes use when they stop early.

``optimize`` records every completion the agent drew in training (``RecordingSource`` wraps the
env's completion source, whatever the agent) and stores them per prompt as pulls in draw order
(``arm_estimates``): majority vote as answer buckets relabelled per pull (0 the gold answer, then
the others by first appearance), Best-of-N as indices into the prompt's distinct objective vectors.
Arm (p, N) is estimated from the disjoint N-blocks of p's pulls (the first completions of each
pull of at least N, as the agents' block estimator reuses them): the mean majority-vote credit or
the mean best weighted score of its blocks, plus ``cost_weight * N * cost(p)``. This is linear in
the weights for majority vote and exact for any weights for Best-of-N (each block's objective
vectors are kept), so ``ArmRatings.best`` rates every arm for weights no context of the policy has.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from iapo_gym.seeding import derive_rng
from iapo_gym.utility import mv_credit, vote_stop_points

METHOD = "blocks"


class RecordingSource:
    """A completion source passing every draw through to ``inner`` and keeping it: (prompt, query, atoms) per pull.

    Not a ``TableSource``, so compiled agent loops (which draw from the table's sampler outside the
    env) take their Python path, which draws the same completions.
    """

    def __init__(self, inner: Any) -> None:
        """``inner``: the env's completion source."""
        self.inner = inner
        self.exact = inner.exact
        self.no_exact = inner.no_exact
        self.prompts: list[np.ndarray] = []
        self.queries: list[np.ndarray] = []
        self.ns: list[np.ndarray] = []
        self.atoms: list[np.ndarray] = []

    def draw(self, prompts: np.ndarray, queries: np.ndarray, ns: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The inner source's draws, recorded."""
        atoms = self.inner.draw(prompts, queries, ns, rng)
        self._keep(prompts, queries, ns, atoms)
        return atoms

    def draw_one(self, prompt: int, query: int, n: int, rng: np.random.Generator) -> np.ndarray:
        """The inner source's draws of one pull, recorded."""
        atoms = self.inner.draw_one(prompt, query, n, rng)
        self._keep(np.array([prompt]), np.array([query]), np.array([n]), atoms)
        return atoms

    def restart(self) -> None:
        """Restart the inner source (a seeded env reset)."""
        self.inner.restart()

    def __getattr__(self, name: str) -> Any:
        """Anything else is the inner source's (a live source's texts and token counts)."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _keep(self, prompts: Any, queries: Any, ns: Any, atoms: Any) -> None:
        self.prompts.append(np.asarray(prompts, dtype=np.int64).reshape(-1).copy())
        self.queries.append(np.asarray(queries, dtype=np.int64).reshape(-1).copy())
        self.ns.append(np.asarray(ns, dtype=np.int64).reshape(-1).copy())
        self.atoms.append(np.asarray(atoms, dtype=np.int64).reshape(-1).copy())

    def pulls(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every recorded pull: prompts (n,), queries (n,), ns (n,), atoms (sum ns,) in draw order."""
        def cat(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        return cat(self.prompts), cat(self.queries), cat(self.ns), cat(self.atoms)


def _relabel_votes(atoms: np.ndarray, gold: int) -> list[int]:
    """A pull's buckets as 0 for the gold answer, then 1, 2, ... by first appearance."""
    labels: dict[int, int] = {gold: 0}
    out = []
    for a in atoms.tolist():
        if a not in labels:
            labels[a] = len(labels)
        out.append(labels[a])
    return out


def build_arm_estimates(table: Any, prompts: np.ndarray, queries: np.ndarray, ns: np.ndarray,
                        atoms: np.ndarray, train_queries: np.ndarray) -> dict[str, Any]:
    """The ``arm_estimates`` document of recorded pulls on ``table`` (see the module docstring).

    ``cost`` of a prompt is its mean per-completion cost over ``train_queries`` (the queries the
    agent drew from), so the estimated utility has the expected cost term of the training queries.
    """
    offsets = np.concatenate([[0], np.cumsum(ns)])
    cost = np.asarray(table.cost_matrix(), dtype=np.float64)[:, np.asarray(train_queries, dtype=np.int64)].mean(axis=1)
    out = []
    for p in range(len(table.prompts)):
        mine = np.flatnonzero(prompts == p)
        if mine.size == 0:
            continue
        entry: dict[str, Any] = {"id": str(table.prompts[p]), "cost": float(cost[p])}
        pulls = [atoms[offsets[i]:offsets[i + 1]] for i in mine.tolist()]
        if table.aggregator == "mv":
            entry["pulls"] = [_relabel_votes(a, int(table.gold[q])) for a, q in zip(pulls, queries[mine].tolist(),
                                                                                   strict=True)]
        else:
            vectors = np.concatenate([table.atoms[p, q, a] for a, q in zip(pulls, queries[mine].tolist(), strict=True)])
            distinct, index = np.unique(vectors, axis=0, return_inverse=True)
            index = index.reshape(-1)
            cuts = np.cumsum([a.size for a in pulls])[:-1]
            entry["outcomes"] = [[float(x) for x in row] for row in distinct]
            entry["pulls"] = [part.tolist() for part in np.split(index, cuts)]
        out.append(entry)
    return {"method": METHOD, "completions": int(ns.sum()), "prompts": out}


def _blocks(pulls: Sequence[Sequence[int]], k: int) -> np.ndarray:
    """The disjoint k-blocks (b, k) of the pulls: the first k * floor(n / k) completions of each pull of n."""
    parts = [np.asarray(p[: len(p) // k * k], dtype=np.int64).reshape(-1, k) for p in pulls if len(p) >= k]
    return np.concatenate(parts) if parts else np.zeros((0, k), dtype=np.int64)


class ArmRatings:
    """The estimated utility of every arm (p, N) under any weights, from a policy file's ``arm_estimates``."""

    def __init__(self, doc: Mapping[str, Any], aggregator: str, n_max: int, objectives: Sequence[str]) -> None:
        """``doc``: the policy file's ``arm_estimates``; the rest as in the policy file."""
        self.aggregator, self.n_objectives = aggregator, len(objectives)
        self.prompts = [str(e["id"]) for e in doc["prompts"]]
        self.cost = np.array([float(e["cost"]) for e in doc["prompts"]], dtype=np.float64)
        n_p = len(self.prompts)
        # arms beyond the longest pull have no block: only N up to it are rated (at most the policy's n_max)
        self.n_max = max(1, min(int(n_max), max((len(p) for e in doc["prompts"] for p in e["pulls"]), default=1)))
        self.blocks = np.zeros((n_p, self.n_max), dtype=np.int64)  # blocks behind each arm's estimate
        self._credit = np.full((n_p, self.n_max), np.nan)
        self._bon: list[list[np.ndarray]] = []  # per prompt, per N: the blocks' objective vectors (b, N, K)
        self._drawn = np.full((n_p, self.n_max), np.nan)
        for i, e in enumerate(doc["prompts"]):
            pulls = e["pulls"]
            per_n: list[np.ndarray] = []
            outcomes = np.asarray(e.get("outcomes", []), dtype=np.float64).reshape(-1, self.n_objectives)
            for k in range(1, self.n_max + 1):
                blocks = _blocks(pulls, k)
                self.blocks[i, k - 1] = blocks.shape[0]
                if aggregator == "mv":
                    if blocks.shape[0]:
                        width = int(blocks.max()) + 1
                        counts = np.zeros((blocks.shape[0], width), dtype=np.int64)
                        np.add.at(counts, (np.repeat(np.arange(blocks.shape[0]), k), blocks.reshape(-1)), 1)
                        self._credit[i, k - 1] = float(mv_credit(counts, np.zeros(blocks.shape[0], np.int64)).mean())
                        self._drawn[i, k - 1] = float(vote_stop_points(blocks, np.array([k]))[:, 0].mean())
                else:
                    per_n.append(outcomes[blocks])
            self._bon.append(per_n)

    def task_reward(self, objective_weights: Sequence[float]) -> np.ndarray:
        """Estimated task reward (P, N_max) of every arm under ``objective_weights``; NaN where no block shows it."""
        w = np.asarray(objective_weights, dtype=np.float64)
        if self.aggregator == "mv":
            return w[0] * self._credit
        out = np.full((len(self.prompts), self.n_max), np.nan)
        for i, per_n in enumerate(self._bon):
            for k, vectors in enumerate(per_n):
                if vectors.shape[0]:
                    out[i, k] = float((vectors @ w).max(axis=1).mean())
        return out

    def utilities(self, objective_weights: Sequence[float], cost_weight: float) -> np.ndarray:
        """Estimated utility (P, N_max) of every arm: task reward plus ``cost_weight * N * cost(p)``; NaN: no estimate."""
        n = np.arange(1, self.n_max + 1, dtype=np.float64)
        return self.task_reward(objective_weights) + float(cost_weight) * n[None, :] * self.cost[:, None]

    def shown(self, prompt: str, n: int) -> int:
        """Blocks behind the estimate of arm (prompt, n): 0 when none shows it."""
        if prompt not in self.prompts or not 1 <= n <= self.n_max:
            return 0
        return int(self.blocks[self.prompts.index(prompt), n - 1])

    def drawn(self, prompt: str, n: int) -> float | None:
        """Mean completions a majority vote of arm (prompt, n) drew with early stopping over its blocks; None if unseen."""
        if self.aggregator != "mv" or self.shown(prompt, n) == 0:
            return None
        value = self._drawn[self.prompts.index(prompt), n - 1]
        return None if math.isnan(value) else float(value)

    def best(self, objective_weights: Sequence[float], cost_weight: float,
             min_blocks: int = 1) -> tuple[str, int, float, int]:
        """(prompt id, N, estimated utility, blocks) of the best arm among those shown by at least ``min_blocks`` blocks.

        Ties go to the first prompt of the file, then the smallest N.
        """
        u = self.utilities(objective_weights, cost_weight)
        u = np.where(self.blocks >= max(1, min_blocks), u, np.nan)
        if np.isnan(u).all():
            raise ValueError(f"no arm has an estimate from at least {min_blocks} blocks")
        flat = int(np.nanargmax(u))
        p, k = divmod(flat, self.n_max)
        return self.prompts[p], k + 1, float(u[p, k]), int(self.blocks[p, k])


def simulate_drawn(table: Any, arms: np.ndarray, queries: np.ndarray, samples: int, seed: int) -> np.ndarray:
    """Expected completions (C,) that each context's majority vote draws with early stopping, on ``queries``.

    Simulated from the table's outcome distributions: ``samples`` votes of each context's arm (p, N),
    the query uniform among ``queries`` for each; the vote stops at the first completion where it is
    decided (``iapo_gym.utility.vote_stop_points``).
    """
    rng = derive_rng(seed, "iapo_gym.deploy.early_stop")
    arms = np.asarray(arms, dtype=np.int64).reshape(-1, 2)
    queries = np.asarray(queries, dtype=np.int64)
    out = np.empty(arms.shape[0])
    for c, (p, n) in enumerate(arms.tolist()):
        q = queries[rng.integers(queries.size, size=samples)]
        cdf = np.cumsum(table.probs[p, q], axis=1)  # (samples, M)
        u = rng.random((samples, n))
        atoms = np.minimum((u[:, :, None] > cdf[:, None, :]).sum(axis=2), cdf.shape[1] - 1)
        out[c] = float(vote_stop_points(atoms, np.array([n]))[:, 0].mean())
    return out
