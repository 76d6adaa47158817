"""Peers of the online protocol (docs/online.md, "Peers"): Vowpal Wabbit and MABWiser behind the ``OnlineAgent``
interface, so ``run_online`` and ``bench_online.py`` drive them exactly as they drive the suite's agents.

Both choose among the same arms as ``ucb``: every available prompt at N on the grid 1, 2, 4, ... and N_max.

* ``VowpalWabbit``: ``vowpalwabbit.Workspace("--cb_explore_adf --epsilon 0.05 -q SA --quiet --random_seed S")``,
  one multi-line ADF example per request: a ``shared |S`` line with the context's objective weights and cost weight
  (``w0 .. wK``, ``wcost``), then one ``|A`` line per available arm with the prompt's one-hot (``p<i>``), ``n:N`` and
  ``ncost:N x the prompt's mean cost per completion``; ``-q SA`` crosses the two namespaces so the learned cost depends
  on the context. The arm is drawn from the PMF VW predicts (the adapter's seeded generator); the label on the
  chosen arm's line is ``0:cost:probability`` with cost = -(the request's sampled utility), as VW's contextual-bandit
  docs say (it minimizes cost). Every choice of a batch is predicted before any of the batch is learned. Speed: VW
  parses each context's shared line and each available set's arm lines once (``Workspace._parse``), and every
  request is ``predict_multi`` / ``learn_multi`` on those examples, the chosen arm's replaced by its labelled line
  (parsed and finished per request), without pyvw's per-line Python ``Example`` wrappers; the runs are bit-identical
  to passing each request's lines to ``Workspace.predict`` / ``learn`` (``tests/test_online_peers.py``). The
  Workspace is finished after the run's last request.
* ``MABWiserLinUCB``: ``mabwiser.mab.MAB(arms, LearningPolicy.LinUCB(alpha=1.0, l2_lambda=1.0), seed=S)``, one
  ridge regression per arm on the context features (its objective weights, its cost weight and a constant 1); each
  request takes the available arm of highest upper bound (``predict_expectations``), and ``partial_fit`` learns the
  batch's sampled utilities (shown, for speed, only the arms the batch pulled: its fit of any other arm is a copy
  it throws away). Before its first fit (the first batch) it serves the arms in turn.

Run one: ``.venv/bin/python benchmarks/bench_online.py --agents iapo_online,vw,mabwiser`` (``--out DIR``: through the
leaderboard's runner). The leaderboard runs them as ``module:Class`` agent specs with this folder on the path:
``PYTHONPATH=benchmarks iapo-gym leaderboard --protocol online --agent online_peers:VowpalWabbit@vw ...``.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from iapo_gym.online import OnlineAgentBase, OnlineEnv, Requests, Served

#: Vowpal Wabbit's arguments, bar ``--random_seed`` (the run's agent seed).
VW_ARGS = "--cb_explore_adf --epsilon 0.05 -q SA --quiet"
#: MABWiser's LinUCB exploration weight and ridge.
LINUCB_ALPHA = 1.0
LINUCB_L2 = 1.0


def _version(distribution: str) -> str | None:
    """The installed version of a library (None when it is not installed)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


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
        """The hyper-parameters, the Workspace's arguments (seed 0 shown) and the library's version (stored with
        each leaderboard run as its effective parameters)."""
        return {"epsilon": self.epsilon, "args": self.arguments(0), "vowpalwabbit": _version("vowpalwabbit")}

    def arguments(self, seed: int) -> str:
        """The Workspace's command line for a run seeded ``seed``."""
        return VW_ARGS.replace("--epsilon 0.05", f"--epsilon {self.epsilon:g}") + f" --random_seed {seed % 2**31}"

    def start(self, env: OnlineEnv, seed: int) -> None:
        """A fresh Workspace; the feature lines of every context and arm."""
        import vowpalwabbit

        super().start(env, seed)
        self.close()
        self.vw = vowpalwabbit.Workspace(self.arguments(seed))
        self.horizon = env.horizon
        self._served = 0
        schema = env.schema
        self.grid = n_grid(schema.n_max)
        names = [f"w{k}" for k in range(schema.n_objectives)] + ["wcost"]
        self.shared = ["shared |S " + " ".join(f"{n}:{w:.6g}" for n, w in zip(names, row, strict=True))
                       for row in schema.context_weights]
        mean_cost = schema.cost_matrix().mean(axis=1)
        self.arm_lines = [[f"|A p{p} n:{n} ncost:{n * mean_cost[p]:.6g}" for n in self.grid]
                          for p in range(schema.n_prompts)]
        self._blocks: dict[bytes, _ArmBlock] = {}
        self._shared_examples: dict[int, Any] = {}
        self._chosen: list[tuple[int, int, float]] = []  # per request of the batch: (context, arm, probability)
        self._block: _ArmBlock | None = None

    def close(self) -> None:
        """Hand the parsed examples back to VW and finish its Workspace (done after the run's last request, and by
        ``start``): an unfinished Workspace keeps its memory."""
        if self.vw is None:
            return
        parsed = [e for block in self._blocks.values() for e in block.examples] + list(self._shared_examples.values())
        if parsed:  # one list, arms first (VW crashes finishing a lone shared example)
            self.vw._finish_example_multi_ex(parsed)
        self._blocks, self._shared_examples = {}, {}
        self.vw.finish()
        self.vw = None

    def arm_block(self, available: np.ndarray) -> _ArmBlock:
        """The ``|A`` lines of the available arms (prompt-major, N ascending) and each arm's (prompt, N): they depend
        only on the available set, so they are built (and parsed by VW) once per set."""
        key = np.asarray(available, dtype=bool).tobytes()
        block = self._blocks.get(key)
        if block is None:
            live = np.flatnonzero(available)
            block = _ArmBlock([self.arm_lines[int(p)][g] for p in live for g in range(self.grid.size)],
                              np.repeat(live, self.grid.size).astype(np.int64), np.tile(self.grid, live.size))
            self._blocks[key] = block
        return block

    def example_text(self, context: int, block: _ArmBlock, label: tuple[int, str] | None = None) -> str:
        """The multi-line ADF example of a request as VW's text format: the context's ``shared`` line, then the
        arms' lines; ``label`` (arm index, ``0:cost:probability``) prefixes that arm's line."""
        lines = list(block.lines)
        if label is not None:
            lines[label[0]] = f"{label[1]} {lines[label[0]]}"
        return "\n".join([self.shared[context], *lines])

    def _examples(self, context: int, block: _ArmBlock) -> tuple[Any, list[Any]]:
        """VW's parsed (unlabelled) shared example of ``context`` and arm examples of ``block``, parsed once."""
        shared = self._shared_examples.get(context)
        if shared is None:
            shared = self._shared_examples[context] = self.vw._parse(self.shared[context])[0]
        if not block.examples:
            block.examples.extend(self.vw._parse("\n".join(block.lines)))
        return shared, block.examples

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        """Per request, an arm drawn from VW's predicted PMF over the available arms (``predict_multi`` on the
        parsed shared and arm examples)."""
        block = self._block = self.arm_block(requests.available)
        ks = np.empty(len(requests), dtype=np.int64)
        self._chosen = []
        draws = self.rng.random(len(requests))
        for i, c in enumerate(requests.contexts.tolist()):
            shared, arms = self._examples(c, block)
            multi = [shared, *arms]
            self.vw.predict_multi(multi)
            pmf = np.asarray(shared.get_action_scores(), dtype=np.float64)
            pmf = pmf / pmf.sum()
            k = min(int(np.searchsorted(np.cumsum(pmf), draws[i], side="right")), pmf.size - 1)
            ks[i] = k
            self._chosen.append((c, k, float(pmf[k])))
        return block.prompts[ks], block.ns[ks]

    def update_batch(self, requests: Requests, served: Served) -> None:
        """Learn each request's cost, -(its sampled utility), on its chosen arm's line: ``learn_multi`` on the
        parsed examples with that arm's replaced by the labelled line, parsed (and finished) for this request."""
        block = self._block
        assert block is not None, "update_batch before choose_batch"
        for (c, k, prob), reward in zip(self._chosen, served.rewards.tolist(), strict=True):
            shared, arms = self._examples(c, block)
            labelled = self.vw._parse(f"0:{-reward:.6g}:{prob:.6g} {block.lines[k]}")[0]
            self.vw.learn_multi([shared, *arms[:k], labelled, *arms[k + 1:]])
            self.vw._finish_example_multi_ex([labelled])
        self._served += len(self._chosen)
        self._chosen = []
        if self._served >= self.horizon:
            self.close()


@dataclass
class _ArmBlock:
    """The ``|A`` lines of one available set, each arm's prompt and N, and (once parsed) VW's examples of the lines."""

    lines: list[str]
    prompts: np.ndarray
    ns: np.ndarray
    examples: list[Any] = field(default_factory=list)


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
        """The hyper-parameters and the library's version (stored with each leaderboard run)."""
        return {"alpha": self.alpha, "l2_lambda": LINUCB_L2, "mabwiser": _version("mabwiser")}

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
        """Fit (the first batch) or ``partial_fit`` the batch's sampled utilities.

        Speed: MABWiser's ``partial_fit`` deep-copies every arm's model, and keeps the copy only for the arms the
        batch pulled; the adapter shows it only those arms for that call (its implementation's ``arms``), so it
        skips the discarded copies. The runs are bit-identical (``tests/test_online_peers.py``)."""
        slot = np.searchsorted(self.grid, served.pulls.ns)
        decisions = served.pulls.prompts * self.grid.size + slot
        contexts = self.features[requests.contexts]
        if self.fitted:
            implementation = self.mab._imp
            every = implementation.arms
            pulled = set(decisions.tolist())
            implementation.arms = [arm for arm in every if arm in pulled]
            try:
                self.mab.partial_fit(decisions, served.rewards, contexts)
            finally:
                implementation.arms = every
        else:
            self.mab.fit(decisions, served.rewards, contexts)
            self.fitted = True


#: name -> class of the peers (``bench_online.py --agents`` takes these names next to ``make_online``'s).
PEERS: dict[str, type[OnlineAgentBase]] = {"vw": VowpalWabbit, "mabwiser": MABWiserLinUCB}
