"""Per-arm estimates kept in a policy file, so a served policy can rate any weights, and the completions majority
votes use when they stop early.

``optimize`` records every completion the agent drew in training (``RecordingSource`` wraps the
env's completion source, whatever the agent) and stores per prompt and query how often each
outcome came out (``arm_estimates``): majority vote per answer bucket, numbered per (prompt,
query) with 0 the gold answer and then the others by first appearance; Best-of-N per distinct
objective vector of the prompt. A (prompt, query)'s counts are its empirical outcome
distribution, and arm (p, N) is rated by the plug-in expected utility: the exact expected
majority-vote credit or best weighted score of N draws from each observed query's distribution
(``iapo_gym.exact``), averaged over p's observed queries, plus ``cost_weight * N * cost(p)``. That
covers every N up to ``n_max`` (the agents that extrapolate, as ``auto`` does, choose N beyond
any pull) and any weights: majority vote is linear in them, Best-of-N is recomputed per weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from iapo_gym.exact import bon_expected_max, mv_expected_credit
from iapo_gym.rules import FixedN, Rule, vote_stops
from iapo_gym.seeding import derive_rng
from iapo_gym.utility import vote_stop_points

METHOD = "plug-in"


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


def _vote_counts(pulls: list[np.ndarray], gold: int) -> list[int]:
    """A (prompt, query)'s votes per answer bucket: 0 the gold answer, then the others by first appearance."""
    atoms = np.concatenate(pulls)
    others, first = np.unique(atoms[atoms != gold], return_index=True)
    order = others[np.argsort(first, kind="stable")]
    return [int((atoms == gold).sum())] + [int((atoms == a).sum()) for a in order.tolist()]


def build_arm_estimates(table: Any, prompts: np.ndarray, queries: np.ndarray, ns: np.ndarray,
                        atoms: np.ndarray, train_queries: np.ndarray) -> dict[str, Any]:
    """The ``arm_estimates`` document of recorded pulls on ``table`` (see the module docstring).

    ``cost`` of a prompt is its mean per-completion cost over ``train_queries`` (the queries the
    agent drew from), so the estimated utility has the expected cost term of the training queries.
    Queries appear in the order the agent first drew them and are not named.
    """
    offsets = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)
    cost = np.asarray(table.cost_matrix(), dtype=np.float64)[:, np.asarray(train_queries, dtype=np.int64)].mean(axis=1)
    out = []
    for p in range(len(table.prompts)):
        mine = np.flatnonzero(prompts == p)
        if mine.size == 0:
            continue
        groups: dict[int, list[np.ndarray]] = {}
        for i in mine.tolist():
            groups.setdefault(int(queries[i]), []).append(atoms[offsets[i]:offsets[i + 1]])
        entry: dict[str, Any] = {"id": str(table.prompts[p]), "cost": float(cost[p])}
        if table.aggregator == "mv":
            entry["queries"] = [_vote_counts(pulls, int(table.gold[q])) for q, pulls in groups.items()]
        else:
            sizes = [sum(a.size for a in pulls) for pulls in groups.values()]
            vectors = np.concatenate([table.atoms[p, q, a] for q, pulls in groups.items() for a in pulls])
            distinct, index = np.unique(vectors, axis=0, return_inverse=True)
            group = np.repeat(np.arange(len(sizes)), sizes)
            counts = np.zeros((len(sizes), distinct.shape[0]), dtype=np.int64)
            np.add.at(counts, (group, index.reshape(-1)), 1)
            entry["outcomes"] = [[float(x) for x in row] for row in distinct]
            entry["queries"] = counts.tolist()
        out.append(entry)
    return {"method": METHOD, "completions": int(ns.sum()), "prompts": out}


def _empirical(groups: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """Per query (Q, width) the empirical distribution of its completions' outcomes, from their counts."""
    counts = np.zeros((len(groups), width))
    for q, row in enumerate(groups):
        counts[q, :len(row)] = row
    return counts / counts.sum(axis=1, keepdims=True)


def simulate_votes(probs: np.ndarray, n: int, samples: int, rng: np.random.Generator,
                   rule: Rule | None = None) -> float:
    """Mean completions a majority vote capped at ``n`` draws with early stopping, each vote on a row of ``probs``
    (R, B) drawn uniformly (``iapo_gym.utility.vote_stop_points`` on simulated sequences); with a stopping
    ``rule`` (``Margin``, ``Posterior``), as ``serve`` draws: at the first completion where the vote is decided or
    the rule stops (``rule_stop_points``)."""
    rows = probs[rng.integers(probs.shape[0], size=samples)]
    cdf = np.cumsum(rows, axis=1)
    cdf /= cdf[:, -1:]
    u = rng.random((samples, n))
    atoms = np.minimum((u[:, :, None] > cdf[:, None, :]).sum(axis=2), probs.shape[1] - 1)
    points = vote_stop_points(atoms, np.array([n]))[:, 0]
    if rule is not None and not isinstance(rule, FixedN):
        points = np.minimum(points, rule_stop_points(atoms, rule))
    return float(points.mean())


def rule_stop_points(atoms: np.ndarray, rule: Rule) -> np.ndarray:
    """Completions drawn (M,) by majority-vote ``rule`` capped at L on M sequences ``atoms`` (M, L) of answer
    buckets: the first k after which ``iapo_gym.rules.vote_stops`` holds on the top two counts, else L."""
    atoms = np.asarray(atoms, dtype=np.int64)
    m, length = atoms.shape
    if m == 0 or length == 0:
        return np.full(m, length, dtype=np.int64)
    counts = np.zeros((m, length, max(int(atoms.max()) + 1, 2)), dtype=np.int64)
    np.put_along_axis(counts, atoms[:, :, None], 1, axis=2)
    np.cumsum(counts, axis=1, out=counts)
    top2 = np.partition(counts, counts.shape[2] - 2, axis=2)[:, :, -2:]
    stop = vote_stops(rule, top2[:, :, 1], top2[:, :, 0], length)
    return np.where(stop.any(axis=1), stop.argmax(axis=1) + 1, length)


class ArmRatings:
    """The estimated utility of every arm (p, N) under any weights, from a policy file's ``arm_estimates``."""

    def __init__(self, doc: Mapping[str, Any], aggregator: str, n_max: int, objectives: Sequence[str]) -> None:
        """``doc``: the policy file's ``arm_estimates``; the rest as in the policy file."""
        self.aggregator, self.n_max, self.n_objectives = aggregator, int(n_max), len(objectives)
        self.prompts = [str(e["id"]) for e in doc["prompts"]]
        self.cost = np.array([float(e["cost"]) for e in doc["prompts"]], dtype=np.float64)
        self.queries = np.array([len(e["queries"]) for e in doc["prompts"]], dtype=np.int64)  # observed per prompt
        self._probs: list[np.ndarray] = []  # per prompt (Q, B) empirical distributions
        self._outcomes: list[np.ndarray] = []  # Best-of-N: per prompt (V, K) objective vectors
        for e in doc["prompts"]:
            if aggregator == "mv":
                self._probs.append(_empirical(e["queries"], max((len(row) for row in e["queries"]), default=1)))
            else:
                outcomes = np.asarray(e["outcomes"], dtype=np.float64).reshape(-1, self.n_objectives)
                self._outcomes.append(outcomes)
                self._probs.append(_empirical(e["queries"], outcomes.shape[0]))
        self._credit = np.array([mv_expected_credit(pr, np.zeros(pr.shape[0], np.int64), self.n_max).mean(axis=0)
                                 for pr in self._probs]) if aggregator == "mv" else None

    def task_reward(self, objective_weights: Sequence[float] | np.ndarray) -> np.ndarray:
        """Estimated task reward (P, N_max) of every arm under ``objective_weights``."""
        w = np.asarray(objective_weights, dtype=np.float64)
        if self._credit is not None:
            return np.asarray(w[0] * self._credit)
        out = np.empty((len(self.prompts), self.n_max))
        for i, (outcomes, probs) in enumerate(zip(self._outcomes, self._probs, strict=True)):
            scores = np.broadcast_to(outcomes @ w, probs.shape)
            out[i] = bon_expected_max(scores, probs, self.n_max).mean(axis=0)
        return out

    def utilities(self, objective_weights: Sequence[float] | np.ndarray, cost_weight: float) -> np.ndarray:
        """Estimated utility (P, N_max) of every arm: task reward plus ``cost_weight * N * cost(p)``."""
        n = np.arange(1, self.n_max + 1, dtype=np.float64)
        return self.task_reward(objective_weights) + float(cost_weight) * n[None, :] * self.cost[:, None]

    def shown(self, prompt: str) -> int:
        """Queries behind the estimates of the prompt's arms: 0 when the prompt was never drawn."""
        return int(self.queries[self.prompts.index(prompt)]) if prompt in self.prompts else 0

    def drawn(self, prompt: str, n: int, samples: int, seed: int) -> float | None:
        """Majority vote: mean completions arm (prompt, n) draws with early stopping, simulated from the estimates."""
        if self.aggregator != "mv" or self.shown(prompt) == 0:
            return None
        rng = derive_rng(seed, "iapo_gym.deploy.early_stop", prompt, n)
        return simulate_votes(self._probs[self.prompts.index(prompt)], n, samples, rng)


#: Learned contexts whose arms compete for weights no context has.
NEIGHBOURS = 2


def direction(weights: Sequence[float] | np.ndarray) -> np.ndarray:
    """Weights scaled to objective weights of absolute sum 1: a utility scaled by c > 0 has the same best arm."""
    w = np.asarray(weights, dtype=np.float64)
    scale = float(np.abs(w[:-1]).sum())
    return w / scale if scale > 0 else w


def choose_arm(ratings: ArmRatings, contexts: Sequence[Any], weights: Sequence[float] | np.ndarray) -> dict[str, Any]:
    """The arm served for ``weights`` (objective weights, then cost weight) that no context has.

    The arms of the ``NEIGHBOURS`` learned contexts nearest in direction compete, and the policy's
    estimates choose the one with the best estimated utility under ``weights`` (ties, or a prompt the
    estimates never saw: the nearer context). Rating every arm by the plug-in alone does worse: checked
    exactly on the synthetic tasks (docs/deploy.md, "Any weights"), it underestimates what a larger N
    gains from the few completions per query an agent draws, where the agent's own choices do not.
    Returns the route: prompt, N, estimated utility, the nearest context and the candidates.
    """
    w = np.asarray(weights, dtype=np.float64)
    target = direction(w)
    order = sorted(range(len(contexts)), key=lambda i: (float(((direction(contexts[i].weights) - target) ** 2).sum()), i))
    near = [contexts[i] for i in order[:NEIGHBOURS]]
    u = ratings.utilities(w[:-1], float(w[-1]))
    rated = [(float(u[ratings.prompts.index(c.prompt), c.n - 1]) if ratings.shown(c.prompt) else -np.inf, -k, c)
             for k, c in enumerate(near)]
    best = max(rated, key=lambda r: (r[0], r[1]))[2]
    utility = rated[[r[2] for r in rated].index(best)][0]
    return {"prompt": best.prompt, "n": best.n, "estimated_utility": utility if np.isfinite(utility) else None,
            "from_context": best.name, "nearest_context": near[0].name,
            "candidates": [[c.name, c.prompt, c.n, x if np.isfinite(x) else None] for x, _, c in rated]}


def probe_weights(contexts: Sequence[Any]) -> np.ndarray:
    """Weights (K, objectives + 1) midway between consecutive contexts of a policy: weights no context has."""
    w = np.array([c.weights for c in contexts], dtype=np.float64)
    mid = (w[1:] + w[:-1]) / 2.0
    keep = ~(np.abs(mid[:, None, :] - w[None, :, :]).max(axis=2) < 1e-12).any(axis=1)
    return np.asarray(mid[keep])


def simulate_drawn(table: Any, arms: np.ndarray, queries: np.ndarray, samples: int, seed: int,
                   rules: Sequence[Rule | None] | None = None) -> np.ndarray:
    """Expected completions (C,) that each context's majority vote draws with early stopping, on ``queries``.

    Simulated from the table's outcome distributions: ``samples`` votes of each context's arm (p, N),
    the query uniform among ``queries`` for each; the vote stops at the first completion where it is
    decided (``iapo_gym.utility.vote_stop_points``) or, with ``rules`` (one per context, None: fixed N),
    where the context's stopping rule stops (``simulate_votes``).
    """
    arms = np.asarray(arms, dtype=np.int64).reshape(-1, 2)
    queries = np.asarray(queries, dtype=np.int64)
    chosen = list(rules) if rules is not None else [None] * len(arms)
    if len(chosen) != len(arms):
        raise ValueError(f"{len(chosen)} stopping rules for {len(arms)} arms; expected one per context")
    return np.array([simulate_votes(table.probs[p, queries], n, samples,
                                    derive_rng(seed, "iapo_gym.deploy.early_stop", c), chosen[c])
                     for c, (p, n) in enumerate(arms.tolist())])
