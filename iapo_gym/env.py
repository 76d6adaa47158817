"""The IAPO contextual-bandit environment (paper section 3) and its vectorized batch path."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from iapo_gym.oracle import exact_acr, expected_cost, expected_drawn, monte_carlo_acr, optimal_policy, q_table
from iapo_gym.policy import Policy, PolicyLike
from iapo_gym.rules import Rule, default_rules, sampled_stop
from iapo_gym.sampling import AliasSampler
from iapo_gym.source import CompletionSource, TableSource
from iapo_gym.tables import TEST, TRAIN, OutcomeTable, TableSchema, read_table
from iapo_gym.utility import block_utilities

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Pulls:
    """A batch of n pulls: pull i drew ``ns[i]`` completions of ``prompts[i]`` on ``queries[i]``.

    The completions' atoms lie in ``atoms[offsets[i]:offsets[i + 1]]`` in draw order.
    """

    prompts: np.ndarray  # (n,) int64
    ns: np.ndarray  # (n,) int64
    queries: np.ndarray  # (n,) int64
    atoms: np.ndarray  # (sum ns,) int64
    offsets: np.ndarray  # (n + 1,) int64

    @classmethod
    def of(cls, prompts: np.ndarray, ns: np.ndarray, queries: np.ndarray, atoms: np.ndarray) -> Pulls:
        """The batch of these pulls, its offsets the running sum of ``ns``."""
        offsets = np.zeros(ns.size + 1, dtype=np.int64)
        np.cumsum(ns, out=offsets[1:])
        return cls(prompts, ns, queries, atoms, offsets)

    def __len__(self) -> int:
        return int(self.prompts.size)

    @property
    def completions(self) -> int:
        """Completions drawn by the batch (the budget it spent)."""
        return int(self.offsets[-1])

    def blocks(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Disjoint blocks of k completions: (pull index (b,), atoms (b, k)).

        A pull of N gives floor(N / k) blocks, its first completions in draw order (the
        paper's nested reuse across inference scales).
        """
        per_pull = self.ns // k
        pull = np.repeat(np.arange(len(self)), per_pull)
        first = np.arange(pull.size) - np.repeat(np.cumsum(per_pull) - per_pull, per_pull)
        start = self.offsets[pull] + first * k
        return pull, self.atoms[start[:, None] + np.arange(k)[None, :]]

    def counts(self, n_atoms: int) -> np.ndarray:
        """(n, n_atoms) how often each atom came out in each pull."""
        pull = np.repeat(np.arange(len(self)), self.ns)
        return np.bincount(pull * n_atoms + self.atoms, minlength=len(self) * n_atoms).reshape(len(self), n_atoms)


def _as_index(value: Any, name: str, low: int, high: int) -> int:
    """An integer in [low, high] or a ValueError naming the value and the range."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    if not low <= int(value) <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {int(value)}")
    return int(value)


class IAPOEnv(gym.Env[np.ndarray, tuple[int, int]]):
    """One-step contextual bandit over arms (prompt p, number of completions N) and, optionally, stopping rules.

    ``reset`` draws a context (its weight vector is the observation); ``step((p, N))`` draws
    a query of the current split and N completions, and returns their aggregated utility;
    ``step((p, N, r))`` draws them one at a time under stopping rule ``rules[r]`` with cap N (r = 0: fixed N).
    ``pull``/``utilities`` are the vectorized path for agents; ``q_table`` the exact oracle.
    The completions come from ``source``: a table's sampler, or a live endpoint (``LiveEnv``).
    With ``rule_arms`` the env's arm set is (p, N, r): ``action_space`` is ``rule_action_space`` and agents choose
    a rule per context (``Policy.rules``); without it the arms are the paper's (p, N) and ``step`` still takes a rule.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, task: str | None = None, *, table: TableSchema | None = None,
                 path: str | None = None, instance: int = 0, split: str = "train",
                 source: CompletionSource | None = None, rule_arms: bool = False) -> None:
        """Build from an in-memory ``table``, a table file ``path`` or a registered ``task``.

        ``source`` draws the completions (default: the table's sampler); a ``TableSchema`` without
        outcome distributions needs one. ``rule_arms``: the arm set includes the stopping rules ``rules``
        (agents choose (p, N, r)); the paper's (p, N) arms by default.
        """
        if not isinstance(rule_arms, (bool, np.bool_)):
            raise ValueError(f"rule_arms must be True or False, got {rule_arms!r}")
        if table is None:
            if task is None and path is None:
                raise ValueError("IAPOEnv needs a task name, a table or a path")
            if task is None:
                table = read_table(str(path))
            else:
                from iapo_gym.data import load_task_table

                table = load_task_table(task, instance=instance, path=path)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if source is None:
            if not isinstance(table, OutcomeTable):
                raise ValueError(f"a {type(table).__name__} without outcome distributions needs a completion source "
                                 "(source=...); an OutcomeTable defaults to sampling its own")
            source = TableSource(table)
        self.table = table
        self.source: CompletionSource = source
        self.split = split
        self.task = table.task
        self.completions_drawn = 0  # every completion this env has drawn; no reset clears it
        self._drawn_at_seed = 0  # completions_drawn at the last seeded reset
        n_obj = table.n_objectives + 1
        low = float(min(0.0, table.context_weights.min()))
        high = float(max(0.0, table.context_weights.max()))
        self.observation_space = spaces.Box(low=low, high=high, shape=(n_obj,), dtype=np.float32)
        self.action_space: spaces.Tuple = spaces.Tuple(
            (spaces.Discrete(table.n_prompts), spaces.Discrete(table.n_max, start=1))
        )
        self.rule_arms = bool(rule_arms)
        if self.rule_arms:
            self.action_space = self.rule_action_space
        self._observations = table.context_weights.astype(np.float32)
        self._context = 0
        self._split_queries = {s: table.split_indices(s) for s in SPLITS}

    # ---- properties -----------------------------------------------------------------
    @property
    def n_prompts(self) -> int:
        """Number of prompts P."""
        return self.table.n_prompts

    @property
    def n_max(self) -> int:
        """Largest number of completions per pull."""
        return self.table.n_max

    @property
    def n_contexts(self) -> int:
        """Number of contexts C."""
        return self.table.n_contexts

    @property
    def draws_from_table(self) -> bool:
        """True when completions are drawn from ``table`` by ``sampler`` (so a compiled agent loop may replicate
        ``pull_one``'s draws and account for them with ``record_draws``); False for a live endpoint."""
        return isinstance(self.source, TableSource)

    @property
    def budget_used(self) -> int:
        """Completions drawn since the last seeded reset (``info["budget_used"]``; ``completions_drawn`` counts all)."""
        return self.completions_drawn - self._drawn_at_seed

    @property
    def context(self) -> int:
        """Index of the context drawn by the last ``reset``."""
        return self._context

    def queries(self, split: str | None = None) -> np.ndarray:
        """Query indices of ``split`` (default: the split this env draws from)."""
        split = self.split if split is None else split
        if split not in self._split_queries:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self._split_queries[split]

    # ---- Gymnasium API ----------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """Draw a context from the context distribution (``options={"context": c}`` fixes it).

        A seeded reset starts the experiment over: the generator is re-seeded and
        ``budget_used`` returns to 0 (so a seeded rerun is identical, info included);
        ``completions_drawn``, the env's one completion counter, keeps counting.
        """
        super().reset(seed=seed)
        if seed is not None:
            self._drawn_at_seed = self.completions_drawn
            self.source.restart()
        if options and "context" in options:
            self._context = _as_index(options["context"], "options['context']", 0, self.n_contexts - 1)
        else:
            self._context = int(self.np_random.choice(self.n_contexts, p=self.table.context_probs))
        return self._observations[self._context].copy(), self._context_info()

    def _context_info(self) -> dict[str, Any]:
        return {"context": self._context, "context_name": self.table.context_names[self._context]}

    def validate_action(self, action: Any) -> tuple[int, int]:
        """(p, N) as ints, or a ValueError naming the bad value and the allowed range."""
        if isinstance(action, np.ndarray):
            if action.shape != (2,):
                raise ValueError(f"action must be (p, N), got an array of shape {action.shape}")
            action = tuple(action.tolist())
        if not isinstance(action, (tuple, list)) or len(action) != 2:
            raise ValueError(f"action must be a pair (p, N), got {action!r}")
        p = _as_index(action[0], "prompt p", 0, self.n_prompts - 1)
        n = _as_index(action[1], "N", 1, self.n_max)
        return p, n

    def validate_rule_action(self, action: Any) -> tuple[int, int, int]:
        """(p, N, r) as ints from (p, N) (r = 0, fixed N) or (p, N, r), or a ValueError naming the bad value and
        the allowed range (r in [0, len(rules) - 1])."""
        if isinstance(action, np.ndarray):
            if action.shape not in ((2,), (3,)):
                raise ValueError(f"action must be (p, N) or (p, N, r), got an array of shape {action.shape}")
            action = tuple(action.tolist())
        if not isinstance(action, (tuple, list)) or len(action) not in (2, 3):
            raise ValueError(f"action must be a pair (p, N) or a triple (p, N, r), got {action!r}"[:300])
        p, n = self.validate_action(tuple(action[:2]))
        r = _as_index(action[2], "rule r", 0, len(self.rules) - 1) if len(action) == 3 else 0
        return p, n, r

    @property
    def rule_action_space(self) -> spaces.Tuple:
        """``Tuple(Discrete(P), Discrete(N_max, start=1), Discrete(R))``: the actions (p, N, r) ``step`` takes
        (``action_space`` is this with ``rule_arms``, else the pair (p, N), rule 0, so wrappers and RL libraries see
        the paper's space)."""
        return spaces.Tuple((spaces.Discrete(self.table.n_prompts), spaces.Discrete(self.table.n_max, start=1),
                             spaces.Discrete(len(self.rules))))

    def step(self, action: tuple[int, int] | tuple[int, int, int]) -> tuple[np.ndarray, SupportsFloat, bool, bool,
                                                                             dict[str, Any]]:
        """Pull arm (p, N) once in the current context, or (p, N, r) under stopping rule ``rules[r]`` with cap N;
        one-step episodes end at once. ``info["drawn"]`` is the completions drawn (N for fixed N)."""
        p, n, r = self.validate_rule_action(action)
        pulls = self.pull(np.array([p]), np.array([n])) if r == 0 else self._rule_pull(p, n, r)
        query, n = int(pulls.queries[0]), int(pulls.ns[0])
        reward = float(self.utilities(pulls)[self._context, 0])
        atoms = pulls.atoms
        table = self.table
        if table.aggregator == "mv":
            assert table.gold is not None
            outcomes = np.stack([atoms, (atoms == table.gold[query]).astype(np.int64)], axis=1)
        else:
            assert table.atoms is not None
            outcomes = table.atoms[p, query, atoms]
        info = {
            **self._context_info(),
            "query": query,
            "outcomes": outcomes,
            "cost": np.full(n, table.cost_matrix()[p, query]),
            "budget_used": self.budget_used,
            "drawn": n,
            "rule": r,
        }
        return self._observations[self._context].copy(), reward, True, False, info

    def _rule_pull(self, prompt: int, cap: int, rule: int) -> Pulls:
        """One pull of ``prompt`` under stopping rule ``rules[rule]`` with cap ``cap`` in the current context.

        The cap's completions come from the env's generator at once (as a fixed-N pull's); the rule, checked after
        every completion, keeps those up to its stop (``iapo_gym.rules.sampled_stop``), and only those are drawn:
        they alone count in ``completions_drawn`` and ``budget_used``. Needs a table source.
        """
        if not self.draws_from_table or not isinstance(self.table, OutcomeTable):
            raise NotImplementedError(f"stopping rules (r > 0) are sampled from a table's outcome distributions; "
                                      f"{type(self.source).__name__} draws fixed N only (use r = 0)")
        pool = self._split_queries[self.split]
        rng = self.np_random
        query = int(pool[rng.integers(pool.size)])
        atoms = self.source.draw_one(prompt, query, cap, rng)
        drawn = sampled_stop(self.table, self.rules, rule, self._context, prompt, query, atoms)
        self.completions_drawn += drawn
        return Pulls(np.array([prompt]), np.array([drawn]), np.array([query]), atoms[:drawn], np.array([0, drawn]))

    # ---- vectorized path --------------------------------------------------------------
    def _get_sampler(self) -> AliasSampler:
        """The table's alias sampler (built on first use, shared by every env on the table); refused for another source."""
        if not isinstance(self.source, TableSource):
            raise NotImplementedError(f"{type(self).__name__} draws its completions from {type(self.source).__name__}; "
                                      "it has no outcome distribution to sample")
        return self.source.sampler

    def pull(self, prompts: np.ndarray, ns: np.ndarray, queries: np.ndarray | None = None) -> Pulls:
        """Draw many pulls in one vectorized call, from this env's generator and budget.

        Queries are drawn uniformly from the current split unless given.
        """
        prompts = np.asarray(prompts, dtype=np.int64).reshape(-1)
        ns = np.asarray(ns, dtype=np.int64).reshape(-1)
        if prompts.size == 1 and ns.size == 1 and queries is None:
            return self._pull_one(int(prompts[0]), int(ns[0]))
        queries = self._pull_queries(prompts, ns, queries)
        atoms = self.source.draw(prompts, queries, ns, self.np_random)
        pulls = Pulls.of(prompts, ns, queries, atoms)
        self.completions_drawn += pulls.completions
        return pulls

    def _pull_queries(self, prompts: np.ndarray, ns: np.ndarray, queries: np.ndarray | None) -> np.ndarray:
        """Check a batch's prompts and Ns, then its given queries or draw them from the split (one rule for every
        completion source)."""
        if prompts.shape != ns.shape:
            raise ValueError(f"prompts and ns must have the same length, got {prompts.size} and {ns.size}")
        if prompts.size and (prompts.min() < 0 or prompts.max() >= self.n_prompts):
            bad = prompts[(prompts < 0) | (prompts >= self.n_prompts)][0]
            raise ValueError(f"prompt p must be in [0, {self.n_prompts - 1}], got {int(bad)}")
        if ns.size and (ns.min() < 1 or ns.max() > self.n_max):
            bad = ns[(ns < 1) | (ns > self.n_max)][0]
            raise ValueError(f"N must be in [1, {self.n_max}], got {int(bad)}")
        if queries is None:
            pool = self.queries()
            return pool[self.np_random.integers(pool.size, size=prompts.size)]
        queries = np.asarray(queries, dtype=np.int64).reshape(-1)
        if queries.shape != prompts.shape:
            raise ValueError(f"queries must have one entry per pull ({prompts.size}), got {queries.size}")
        if queries.size and (queries.min() < 0 or queries.max() >= self.table.n_queries):
            raise ValueError(f"query indices must be in [0, {self.table.n_queries - 1}]")
        return queries

    def _pull_one(self, prompt: int, n: int) -> Pulls:
        """``pull`` for a single pull without the batch bookkeeping (draws as ``pull_one``)."""
        query, atoms = self._draw_one(prompt, n)
        return Pulls(np.array([prompt]), np.array([n]), np.array([query]), atoms, np.array([0, n]))

    def pull_one(self, prompt: int, n: int) -> tuple[int, np.ndarray]:
        """One pull of ``n`` completions of ``prompt``: (query, atoms), without building a ``Pulls``.

        The sequential agents' hot path. Draws exactly what ``pull`` draws for a batch of one
        (the same generator calls in the same order) and spends ``n`` of the budget.
        """
        return self._draw_one(prompt, n)

    def _draw_one(self, prompt: int, n: int) -> tuple[int, np.ndarray]:
        """The draws of one pull, shared by ``pull`` and ``pull_one`` (a subclass may wrap either)."""
        if not 0 <= prompt < self.n_prompts:
            raise ValueError(f"prompt p must be in [0, {self.n_prompts - 1}], got {prompt}")
        if not 1 <= n <= self.n_max:
            raise ValueError(f"N must be in [1, {self.n_max}], got {n}")
        pool = self._split_queries[self.split]
        rng = self.np_random
        query = int(pool[rng.integers(pool.size)])
        atoms = self.source.draw_one(prompt, query, n, rng)
        self.completions_drawn += n
        return query, atoms

    @property
    def sampler(self) -> AliasSampler:
        """The alias tables ``pull`` draws completions from (row p * n_queries + q), read-only."""
        return self._get_sampler()

    def record_draws(self, completions: int) -> None:
        """Spend ``completions`` drawn from ``np_random`` by a loop that replicates ``pull_one`` outside it.

        Used by the compiled sequential agents (``agents/_jit.py``), which draw exactly what
        ``pull_one`` draws from the table (only where ``draws_from_table``).
        """
        self.completions_drawn += int(completions)

    def snapshot(self) -> dict[str, Any]:
        """The env's mutable sampling state (generator state, ``budget_used``, ``completions_drawn``), for ``restore``.

        Lets an anytime agent branch one trajectory into several budgets: restoring a
        snapshot replays exactly the draws that followed it. The current context is not included.
        """
        return {"rng": self.np_random.bit_generator.state, "budget_used": self.budget_used,
                "completions_drawn": self.completions_drawn}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Return to a state taken by ``snapshot`` (the same draws follow)."""
        if not isinstance(snapshot, dict) or not {"rng", "budget_used"} <= snapshot.keys():
            raise ValueError(f"restore takes a dict from snapshot() with keys 'rng' and 'budget_used', got {snapshot!r}"[:300])
        self.np_random.bit_generator.state = snapshot["rng"]
        drawn = snapshot.get("completions_drawn", self._drawn_at_seed + int(snapshot["budget_used"]))
        self.completions_drawn = int(drawn)
        self._drawn_at_seed = self.completions_drawn - int(snapshot["budget_used"])

    def utilities(self, pulls: Pulls) -> np.ndarray:
        """Utilities (C, n) of every pull under every context (the paper's cross-context reuse)."""
        out = np.empty((self.n_contexts, len(pulls)))
        for n in np.unique(pulls.ns):
            idx = np.flatnonzero(pulls.ns == n)
            blocks = pulls.atoms[pulls.offsets[idx][:, None] + np.arange(n)[None, :]]
            out[:, idx] = block_utilities(self.table, pulls.prompts[idx], pulls.queries[idx], blocks)
        return out

    def block_utilities(self, pulls: Pulls, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Nested reuse: (pull index (b,), utilities (C, b)) of every disjoint k-block of the pulls."""
        pull, blocks = pulls.blocks(k)
        return pull, block_utilities(self.table, pulls.prompts[pull], pulls.queries[pull], blocks)

    # ---- splits and the exact oracle ---------------------------------------------------
    def resplit(self, train_fraction: float = 0.8, seed: int | None = None) -> None:
        """Reshuffle the union of all queries into a new train/test split (the paper's protocol)."""
        if not 0.0 < train_fraction < 1.0:
            raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
        n_q = self.table.n_queries
        n_train = int(round(train_fraction * n_q))
        if not 0 < n_train < n_q:
            raise ValueError(f"train_fraction {train_fraction} leaves an empty split of {n_q} queries")
        order = np.random.default_rng(seed).permutation(n_q)
        split = np.full(n_q, TEST, dtype=np.uint8)
        split[order[:n_train]] = TRAIN
        if isinstance(self.source, TableSource):  # the source samples the resplit table
            self.source = TableSource(self.source.table.with_split(split))
            self.table = self.source.table
        else:
            self.table = self.table.with_split(split)
        self._split_queries = {s: self.table.split_indices(s) for s in SPLITS}

    def _known_table(self) -> OutcomeTable:
        """The table whose outcome distributions the completions come from, or NotImplementedError saying
        that this source has no exact answer (a live endpoint)."""
        if not self.source.exact or not isinstance(self.table, OutcomeTable):
            raise NotImplementedError(self.source.no_exact or f"{type(self.source).__name__} has no exact oracle")
        return self.table

    def q_table(self, split: str = "test", rules: bool = False) -> np.ndarray:
        """Exact expected utilities (C, P, N_max) on ``split``; entry [c, p, N-1] (refused without an exact oracle).

        With ``rules``, (C, P, N_max, R) over the stopping rules ``self.rules``; entry [c, p, N-1, r].
        """
        return q_table(self._known_table(), self.queries(split), rules=rules)

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The stopping rules of the env's aggregator (``iapo_gym.rules``); index 0 is fixed N."""
        return default_rules(self.table.aggregator)

    def expected_drawn(self, split: str = "test") -> np.ndarray:
        """Exact expected completions drawn (C, P, N_max, R) under each stopping rule on ``split``."""
        return expected_drawn(self._known_table(), self.queries(split))

    def expected_cost(self, split: str = "test") -> np.ndarray:
        """Exact expected cost (C, P, N_max, R) of the completions drawn under each stopping rule on ``split`` (the
        term of Q the cost weight multiplies; ``iapo_gym.oracle.expected_cost``)."""
        return expected_cost(self._known_table(), self.queries(split))

    def optimal_policy(self, split: str = "test") -> Policy:
        """The exact optimal policy on ``split`` (refused without an exact oracle)."""
        return optimal_policy(self._known_table(), self.queries(split))

    def evaluate(self, policy: PolicyLike, split: str = "test") -> float:
        """Exact ACR of ``policy`` on ``split`` (refused without an exact oracle)."""
        return exact_acr(self._known_table(), policy, self.queries(split))

    def evaluate_monte_carlo(self, policy: PolicyLike, split: str = "test", n_samples: int = 10_000,
                             seed: int | None = None) -> tuple[float, float]:
        """The paper's n-sample ACR estimate (mean, standard error), from its own seeded generator."""
        return monte_carlo_acr(self._known_table(), policy, self.queries(split), n_samples,
                               np.random.default_rng(seed))


def generated_env(family: str | None = None, level: int | None = None, split: str = "train",
                  rule_arms: bool = False) -> IAPOEnv:
    """Level ``level`` of a generated family as an env (``gym.make("IAPO-Generated-v0", family=..., level=...)``)."""
    from iapo_gym.tasks.generated import FamilyError, families, level_table

    if family is None or level is None:
        raise FamilyError(f"IAPO-Generated-v0 needs family=NAME and level=K; families: {', '.join(families())}")
    return IAPOEnv(table=level_table(family, level), split=split, rule_arms=rule_arms)


def base_env(env: Any, needs: str = "expected") -> IAPOEnv:
    """The IAPOEnv under any wrappers; else a TypeError: "``needs`` an IAPOEnv (or a wrapper of one), got ..."."""
    base = getattr(env, "unwrapped", env)
    if not isinstance(base, IAPOEnv):
        raise TypeError(f"{needs} an IAPOEnv (or a wrapper of one), got {type(base).__name__}")
    return base
