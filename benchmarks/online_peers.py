"""Peers of the online protocol (docs/online.md, "Peers"): Vowpal Wabbit and MABWiser behind the ``OnlineAgent``
interface, so ``run_online`` and ``bench_online.py`` drive them exactly as they drive the suite's agents.

Both choose among the same arms as ``ucb``: every available prompt at N on the grid 1, 2, 4, ... and N_max.

* ``VowpalWabbit``: ``vowpalwabbit.Workspace("--cb_explore_adf --epsilon 0.05 -q SA --quiet --random_seed S")``,
  one multi-line ADF example per request: a ``shared |S`` line with the context's objective weights and cost weight
  (``w0 .. wK``, ``wcost``), then one ``|A`` line per available arm with the prompt's one-hot (``p<i>``), ``n:N`` and
  ``ncost:N x the prompt's mean cost per completion``; ``-q SA`` crosses the two namespaces so the learned cost depends
  on the context. The arm is drawn from the PMF VW predicts (the adapter's seeded generator); the label on the
  chosen arm's line is ``0:cost:probability`` with cost = -(the request's sampled utility), as VW's contextual-bandit
  docs say (it minimizes cost). Every choice of a batch is predicted before any of the batch is learned.
* ``MABWiserLinUCB``: ``mabwiser.mab.MAB(arms, LearningPolicy.LinUCB(alpha=1.0, l2_lambda=1.0), seed=S)``, one
  ridge regression per arm on the context features (its objective weights, its cost weight and a constant 1); each
  request takes the available arm of highest upper bound (``predict_expectations``), and ``partial_fit`` learns the
  batch's sampled utilities. Before its first fit (the first batch) it serves the arms in turn.

Run one: ``.venv/bin/python benchmarks/bench_online.py --agents iapo_online,vw,mabwiser``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from iapo_gym.online import OnlineAgentBase, OnlineEnv, Requests, Served

#: Vowpal Wabbit's arguments, bar ``--random_seed`` (the run's agent seed).
VW_ARGS = "--cb_explore_adf --epsilon 0.05 -q SA --quiet"
#: MABWiser's LinUCB exploration weight and ridge.
LINUCB_ALPHA = 1.0
LINUCB_L2 = 1.0


def n_grid(n_max: int) -> np.ndarray:
    """N = 1, 2, 4, ... and N_max: the arms' N (as ``ucb``'s default grid)."""
    return np.unique(np.append(2 ** np.arange(int(np.log2(n_max)) + 1), n_max)).astype(np.int64)


class VowpalWabbit(OnlineAgentBase):
    """Vowpal Wabbit's ``--cb_explore_adf`` (epsilon-greedy, 0.05) over the (prompt, N) arms, as documented above.

    :param epsilon: the exploration share of ``--cb_explore_adf`` (``--epsilon``).
    """

    def __init__(self, seed: int | None = None, epsilon: float = 0.05) -> None:
        """``epsilon`` replaces the 0.05 of ``VW_ARGS``."""
        super().__init__(seed)
        if not 0.0 <= float(epsilon) <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon!r}")
        self.epsilon = float(epsilon)
        self.vw: Any = None

    def params(self) -> dict[str, Any]:
        """The hyper-parameters (the rest of the configuration is ``VW_ARGS``)."""
        return {"epsilon": self.epsilon, "args": self.arguments(0)}

    def arguments(self, seed: int) -> str:
        """The Workspace's command line for a run seeded ``seed``."""
        return VW_ARGS.replace("--epsilon 0.05", f"--epsilon {self.epsilon:g}") + f" --random_seed {seed % 2**31}"

    def start(self, env: OnlineEnv, seed: int) -> None:
        """A fresh Workspace; the feature lines of every context and arm."""
        import vowpalwabbit

        super().start(env, seed)
        if self.vw is not None:
            self.vw.finish()
        self.vw = vowpalwabbit.Workspace(self.arguments(seed))
        schema = env.schema
        self.grid = n_grid(schema.n_max)
        names = [f"w{k}" for k in range(schema.n_objectives)] + ["wcost"]
        self.shared = ["shared |S " + " ".join(f"{n}:{w:.6g}" for n, w in zip(names, row, strict=True))
                       for row in schema.context_weights]
        mean_cost = schema.cost_matrix().mean(axis=1)
        self.arm_lines = [[f"|A p{p} n:{n} ncost:{n * mean_cost[p]:.6g}" for n in self.grid]
                          for p in range(schema.n_prompts)]
        self._chosen: list[tuple[list[str], int, float]] = []  # per request of the batch: (example, line, prob)

    def _example(self, c: int, live: np.ndarray) -> tuple[list[str], list[tuple[int, int]]]:
        arms = [(int(p), g) for p in live for g in range(self.grid.size)]
        return [self.shared[c], *(self.arm_lines[p][g] for p, g in arms)], arms

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        """Per request, an arm drawn from VW's predicted PMF over the available arms."""
        live = np.flatnonzero(requests.available)
        prompts = np.empty(len(requests), dtype=np.int64)
        ns = np.empty(len(requests), dtype=np.int64)
        self._chosen = []
        for i, c in enumerate(requests.contexts.tolist()):
            lines, arms = self._example(c, live)
            pmf = np.asarray(self.vw.predict(lines), dtype=np.float64)
            pmf = pmf / pmf.sum()
            k = min(int(np.searchsorted(np.cumsum(pmf), self.rng.random(), side="right")), pmf.size - 1)
            p, g = arms[k]
            prompts[i], ns[i] = p, self.grid[g]
            self._chosen.append((lines, k, float(pmf[k])))
        return prompts, ns

    def update_batch(self, requests: Requests, served: Served) -> None:
        """Learn each request's cost, -(its sampled utility), on its chosen arm's line."""
        for (lines, k, prob), reward in zip(self._chosen, served.rewards.tolist(), strict=True):
            labelled = list(lines)
            labelled[k + 1] = f"0:{-reward:.6g}:{prob:.6g} {lines[k + 1]}"
            self.vw.learn(labelled)
        self._chosen = []


class MABWiserLinUCB(OnlineAgentBase):
    """MABWiser's LinUCB over the (prompt, N) arms on the context's weights, as documented above.

    :param alpha: LinUCB's exploration weight.
    """

    def __init__(self, seed: int | None = None, alpha: float = LINUCB_ALPHA) -> None:
        """``alpha`` replaces ``LINUCB_ALPHA``."""
        super().__init__(seed)
        if not float(alpha) >= 0.0:
            raise ValueError(f"alpha must be >= 0, got {alpha!r}")
        self.alpha = float(alpha)

    def params(self) -> dict[str, Any]:
        """The hyper-parameters."""
        return {"alpha": self.alpha, "l2_lambda": LINUCB_L2}

    def start(self, env: OnlineEnv, seed: int) -> None:
        """A fresh MAB over every arm of the table (arms not yet available are never chosen)."""
        from mabwiser.mab import MAB, LearningPolicy

        super().start(env, seed)
        schema = env.schema
        self.grid = n_grid(schema.n_max)
        self.arms = [p * self.grid.size + g for p in range(schema.n_prompts) for g in range(self.grid.size)]
        self.mab = MAB(self.arms, LearningPolicy.LinUCB(alpha=self.alpha, l2_lambda=LINUCB_L2), seed=seed % 2**31)
        self.features = np.column_stack([schema.context_weights, np.ones(schema.n_contexts)])
        self.fitted = False
        self._turn = 0

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        """Per request the available arm of highest upper bound (before the first fit: the arms in turn)."""
        live = np.repeat(requests.available, self.grid.size)
        b = len(requests)
        if not self.fitted:
            pool = np.flatnonzero(live)
            arms = pool[(self._turn + np.arange(b)) % pool.size]
            self._turn += b
        else:
            expectations = self.mab.predict_expectations(self.features[requests.contexts])
            if isinstance(expectations, dict):
                expectations = [expectations]
            scores = np.array([[e[a] for a in self.arms] for e in expectations])
            scores[:, ~live] = -np.inf
            arms = scores.argmax(axis=1)
        prompts, g = np.divmod(arms, self.grid.size)
        return prompts.astype(np.int64), self.grid[g]

    def update_batch(self, requests: Requests, served: Served) -> None:
        """Fit (the first batch) or ``partial_fit`` the batch's sampled utilities."""
        slot = np.searchsorted(self.grid, served.pulls.ns)
        decisions = served.pulls.prompts * self.grid.size + slot
        contexts = self.features[requests.contexts]
        if self.fitted:
            self.mab.partial_fit(decisions, served.rewards, contexts)
        else:
            self.mab.fit(decisions, served.rewards, contexts)
            self.fitted = True


#: name -> class of the peers (``bench_online.py --agents`` takes these names next to ``make_online``'s).
PEERS: dict[str, type[OnlineAgentBase]] = {"vw": VowpalWabbit, "mabwiser": MABWiserLinUCB}
