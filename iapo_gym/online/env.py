"""The online protocol as a Gymnasium env: T requests, each served with (p, N) and judged by its exact regret.

``OnlineEnv`` is an episode of ``horizon`` requests. At step t a context c_t arrives (from the table's context
distribution) with a query of the run's split; the agent answers with (p, N), sees the N outcomes and their
costs, and ``info`` reports the step's exact pseudo-regret Q*_t(c_t) - Q_t(c_t, p, N) on the split, read from the
exact tensor of the schedule's current segment (``iapo_gym.online.schedule``), never sampled.

Draws come from three generators derived from the reset seed (contexts, queries, completions), each consumed
in request order, so the env's draws are the same whether requests are served one by one (``step``) or in
batches (``arrivals`` + ``serve``, the fast path ``run_online`` uses).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from iapo_gym.env import IAPOEnv, Pulls
from iapo_gym.online._kernels import bon_batch, bon_one, mv_batch, mv_one
from iapo_gym.online.schedule import Schedule, build_schedule
from iapo_gym.oracle import q_table
from iapo_gym.sampling import AliasSampler
from iapo_gym.seeding import derive_rng
from iapo_gym.tables import OutcomeTable, TableSchema

SPLITS = ("train", "test")


def _cumulative(probs: np.ndarray) -> np.ndarray:
    """Cumulative probabilities for inverse-CDF draws; the last is infinite (a uniform never falls past it)."""
    cum = np.cumsum(probs)
    cum[-1] = np.inf
    return cum


@dataclass(frozen=True)
class Requests:
    """A batch of arrived requests t = ``start`` .. ``start + len - 1`` (never across a schedule change).

    ``contexts`` (B,) their context indices; ``weights`` (B, K + 1) their context weight vectors;
    ``available`` (P,) bool the prompts that may be chosen for them.
    """

    start: int
    contexts: np.ndarray
    weights: np.ndarray
    available: np.ndarray

    def __len__(self) -> int:
        return int(self.contexts.size)


@dataclass(frozen=True)
class Served:
    """What serving a batch returned: the pulls (with their queries and atoms), the agent's feedback and the regret.

    ``utilities`` (C, B) is each pull's utility under every context (what the agent may learn from);
    ``rewards`` (B,) the utility under the request's own context; ``costs`` (B,) the cost per completion;
    ``q_star`` / ``q_chosen`` / ``regret`` (B,) the exact values of the segment's tensor.
    """

    pulls: Pulls
    utilities: np.ndarray
    rewards: np.ndarray
    costs: np.ndarray
    q_star: np.ndarray
    q_chosen: np.ndarray
    regret: np.ndarray


class OnlineEnv(gym.Env[dict[str, Any], tuple[int, int]]):
    """``gym.make("IAPO-Online-v0", family=..., level=..., schedule=..., horizon=T)``: one episode of T requests.

    Build from a generated ``family`` and ``level``, a registered ``task``, or an in-memory ``table``. The
    observation is ``{"context": c, "weights": w_c, "available": (P,) int8}`` of the next request; ``step((p, N))``
    serves it and returns the utility of the N outcomes under c as reward; the episode terminates after T requests.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, task: str | None = None, *, family: str | None = None, level: int | None = None,
                 table: OutcomeTable | None = None, schedule: str = "stationary", horizon: int = 10_000,
                 split: str = "test") -> None:
        """A run of ``horizon`` requests on one table under ``schedule``; queries and regret on ``split``."""
        if table is None:
            if family is not None or level is not None:
                from iapo_gym.tasks.generated import FamilyError, level_table

                if family is None or level is None:
                    raise FamilyError("IAPO-Online-v0 needs both family=NAME and level=K for a generated level")
                table = level_table(family, level)
            elif task is not None:
                from iapo_gym.data import load_task_table

                table = load_task_table(task)
            else:
                raise ValueError("OnlineEnv needs family=... and level=..., a task name, or a table")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.split = split
        self.schedule: Schedule = build_schedule(schedule, table, horizon)
        if self.schedule.grown is not None:  # the schedule adds prompts (model_arrival): the run serves the grown table
            table = self.schedule.grown
        self.table = table
        self.horizon = self.schedule.horizon
        self._queries = table.split_indices(split)
        self._cost = np.ascontiguousarray(table.cost_matrix())
        self._observations = table.context_weights.astype(np.float32)
        self._cumprobs = _cumulative(table.context_probs)
        self._segments: dict[int, tuple[np.ndarray, np.ndarray, AliasSampler]] = {}
        # the one-request path's inputs, read once (the table's arrays are contiguous float64: no copies)
        self._pool, self._pool_size = self._queries.tolist(), int(self._queries.size)
        self._weights = np.ascontiguousarray(table.context_weights, dtype=np.float64)
        self._vectors = np.ascontiguousarray(table.atoms, dtype=np.float64) if table.aggregator == "bon" else None
        self._gold = None if table.gold is None else table.gold.tolist()
        self._gold_array = None if table.gold is None else np.ascontiguousarray(table.gold, dtype=np.int64)
        self._n_prompts, self._n_max, self._n_queries = table.n_prompts, table.n_max, table.n_queries
        # the current segment (requests _seg_start .. _seg_stop - 1), entered when a request falls outside it
        self._seg_k, self._seg_start, self._seg_stop = 0, 0, 0
        self._seg_available: list[bool] = []
        self._seg_observed = np.zeros(0, dtype=np.int8)
        self._t = 0
        self._contexts = np.zeros(0, dtype=np.int64)
        self._rng_queries = self._rng_atoms = np.random.default_rng(0)
        n_obj = table.n_objectives + 1
        low = float(min(0.0, table.context_weights.min()))
        high = float(max(0.0, table.context_weights.max()))
        self.observation_space = spaces.Dict({
            "context": spaces.Discrete(table.n_contexts),
            "weights": spaces.Box(low=low, high=high, shape=(n_obj,), dtype=np.float32),
            "available": spaces.MultiBinary(table.n_prompts),
        })
        self.action_space: spaces.Tuple = spaces.Tuple(
            (spaces.Discrete(table.n_prompts), spaces.Discrete(table.n_max, start=1)))
        self.reset(seed=0)

    # ---- what an agent may know ---------------------------------------------------------------
    @property
    def schema(self) -> TableSchema:
        """The table without its outcome distributions: what an online agent may read (shapes, contexts, costs)."""
        t = self.table
        return TableSchema(task=t.task, aggregator=t.aggregator, cost=t.cost, n_max=t.n_max,
                           context_weights=t.context_weights, context_names=t.context_names,
                           context_probs=t.context_probs, objective_names=t.objective_names, shape=t.shape,
                           atoms=t.atoms, gold=t.gold, prompts=t.prompts, queries=t.queries, split=t.split)

    def offline_env(self, split: str = "train", seed: int | None = None) -> tuple[IAPOEnv, np.ndarray]:
        """(an ``IAPOEnv`` on the table of request 0 restricted to the prompts available then, their indices here).

        What an explore-then-commit agent optimizes on before serving (``optimize`` before ``serve``): the
        completions it draws there are not requests of the run and carry no regret.
        """
        keep = np.flatnonzero(self.schedule.segments[0].available)
        table = self.schedule.table_at(self.table, 0)
        if keep.size < table.n_prompts:
            table = replace(table, probs=table.probs[keep], cost=table.cost[keep],
                            atoms=None if table.atoms is None else table.atoms[keep],
                            prompts=tuple(table.prompts[i] for i in keep))
        env = IAPOEnv(table=table, split=split)
        env.reset(seed=seed)
        return env, keep

    @property
    def t(self) -> int:
        """The index of the next request (the number served so far)."""
        return self._t

    # ---- the exact oracle per segment -------------------------------------------------------------
    def segment_tensors(self, segment: int) -> tuple[np.ndarray, np.ndarray]:
        """(Q (C, P, N_max), Q* (C,)) of a schedule segment on the run's split; computed once per segment."""
        return self._segment(segment)[:2]

    def _enter(self, t: int) -> None:
        """Make the segment holding request ``t`` the current one (its bounds, its available prompts)."""
        k = self.schedule.segment_at(t)
        seg = self.schedule.segments[k]
        self._seg_k, self._seg_start, self._seg_stop = k, seg.start, seg.stop
        self._seg_available = seg.available.tolist()
        self._seg_observed = seg.available.astype(np.int8)

    def _current(self, t: int) -> int:
        """The index of the segment holding request ``t`` (entering it when ``t`` left the current one)."""
        if not self._seg_start <= t < self._seg_stop:
            self._enter(t)
        return self._seg_k

    def _segment(self, segment: int) -> tuple[np.ndarray, np.ndarray, AliasSampler]:
        if segment not in self._segments:
            seg = self.schedule.segments[segment]
            table = self.schedule.table_at(self.table, segment)
            same = next((k for k in self._segments if self.schedule.segments[k].weight == seg.weight), None)
            if same is not None:  # the same table (an arrival): share its tensor and sampler
                q, _, sampler = self._segments[same]
            else:
                q = q_table(table, self._queries)
                sampler = AliasSampler(table.probs.reshape(-1, table.n_atoms))
            masked = np.where(seg.available[None, :, None], q, -np.inf)
            q_star = masked.reshape(q.shape[0], -1).max(axis=1)
            self._segments[segment] = (q, q_star, sampler)
        return self._segments[segment]

    # ---- Gymnasium API ----------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start a run over: request 0 arrives. A seed re-derives the three generators (same seed, same draws)."""
        super().reset(seed=seed)
        root = int(self.np_random.integers(2**63 - 1)) if seed is None else int(seed)
        u = derive_rng(root, "online", "contexts").random(self.horizon)
        self._contexts = np.empty(self.horizon, dtype=np.int64)
        for seg in self.schedule.segments:  # each segment's contexts from its own mix (context_shift)
            cum = self._cumprobs if seg.context_probs is None else _cumulative(seg.context_probs)
            self._contexts[seg.start:seg.stop] = np.searchsorted(cum, u[seg.start:seg.stop], side="right")
        self._rng_queries = derive_rng(root, "online", "queries")
        self._rng_atoms = derive_rng(root, "online", "completions")
        self._t = 0
        self._enter(0)
        return self._observation(), {"t": 0, "context": int(self._contexts[0])}

    def _observation(self) -> dict[str, Any]:
        t = min(self._t, self.horizon - 1)
        if not self._seg_start <= t < self._seg_stop:
            self._enter(t)
        c = int(self._contexts[t])
        return {"context": c, "weights": self._observations[c].copy(), "available": self._seg_observed.copy()}

    def step(self, action: tuple[int, int]) -> tuple[dict[str, Any], SupportsFloat, bool, bool, dict[str, Any]]:
        """Serve the current request with (p, N); ``info`` has ``regret``, ``q_star``, ``q_chosen``, ``t``, ``context``,
        ``query``, ``atoms`` (in draw order), ``cost`` (per completion) and ``utilities`` (C,), the N outcomes'
        utility under every context (what an agent's one-request ``update`` learns from)."""
        if isinstance(action, np.ndarray):
            action = tuple(action.tolist())
        if not isinstance(action, (tuple, list)) or len(action) != 2:
            raise ValueError(f"action must be a pair (p, N), got {action!r}")
        t = self._t
        p, n = action
        if t < self.horizon and type(p) is int and type(n) is int:  # the one-request path, on scalars
            if not self._seg_start <= t < self._seg_stop:
                self._enter(t)
            if 0 <= p < self._n_prompts and 1 <= n <= self._n_max and self._seg_available[p]:
                q, q_star_c, sampler = self._segment(self._seg_k)
                c = int(self._contexts[t])
                query, atoms, u = self._draw_one(p, n, sampler)
                self._t = t + 1
                q_star, q_chosen = float(q_star_c[c]), float(q[c, p, n - 1])
                info = {"t": t, "context": c, "query": query, "regret": q_star - q_chosen, "q_star": q_star,
                        "q_chosen": q_chosen, "atoms": atoms, "cost": float(self._cost[p, query]), "utilities": u}
                return self._observation(), float(u[c]), self._t >= self.horizon, False, info
        requests = self.arrivals(1)  # anything else: the batch path's checks name what is wrong
        served = self.serve(requests, np.array([action[0]]), np.array([action[1]]))
        pulls = served.pulls
        info = {"t": t, "context": int(requests.contexts[0]), "query": int(pulls.queries[0]),
                "regret": float(served.regret[0]), "q_star": float(served.q_star[0]),
                "q_chosen": float(served.q_chosen[0]), "atoms": pulls.atoms, "cost": float(served.costs[0]),
                "utilities": served.utilities[:, 0]}
        return self._observation(), float(served.rewards[0]), self._t >= self.horizon, False, info

    def _draw_one(self, p: int, n: int, sampler: AliasSampler) -> tuple[int, np.ndarray, np.ndarray]:
        """(query, atoms (n,), utilities (C,)) of one request served with (p, n): the draws of a batch of one.

        One compiled call (``iapo_gym.online._kernels``) does the alias draw and the scoring with the batch path's
        arithmetic, so the atoms and utilities are bit-identical to ``serve``'s for a batch of one.
        """
        query = self._pool[int(self._rng_queries.random() * self._pool_size)]
        uniforms = self._rng_atoms.random(n)
        cost_n = n * float(self._cost[p, query])
        if self._vectors is not None:
            atoms, utilities = bon_one(uniforms, sampler.accept, sampler.alias, sampler.n_atoms, p, query,
                                       self._n_queries, self._vectors, self._weights, cost_n)
        else:
            assert self._gold is not None
            atoms, utilities = mv_one(uniforms, sampler.accept, sampler.alias, sampler.n_atoms, p, query,
                                      self._n_queries, self._gold[query], self._weights, cost_n)
        return query, atoms, utilities

    # ---- the batch path -----------------------------------------------------------------------------
    def arrivals(self, count: int) -> Requests:
        """The next requests, at most ``count`` and never across a schedule change (at least one)."""
        if self._t >= self.horizon:
            raise RuntimeError(f"the run is over: all {self.horizon} requests were served; reset() starts another")
        seg = self.schedule.segments[self._current(self._t)]
        stop = min(self._t + max(1, int(count)), seg.stop)
        contexts = self._contexts[self._t:stop]
        return Requests(self._t, contexts, self.table.context_weights[contexts], seg.available)

    def serve(self, requests: Requests, prompts: np.ndarray, ns: np.ndarray) -> Served:
        """Answer ``requests`` (from ``arrivals``, the next ones) with arms (prompts[i], ns[i]); advance the run.

        Every arm is checked before anything is drawn: a prompt outside the table, one not yet available
        (arrival) or N outside [1, N_max] is a ValueError naming it.
        """
        if requests.start != self._t:
            raise ValueError(f"these requests start at step {requests.start}, the next request is step {self._t}")
        b = len(requests)
        prompts = np.asarray(prompts, dtype=np.int64).reshape(-1)
        ns = np.asarray(ns, dtype=np.int64).reshape(-1)
        if prompts.size != b or ns.size != b:
            raise ValueError(f"{b} requests need {b} prompts and Ns, got {prompts.size} and {ns.size}")
        self._check(requests, prompts, ns)
        q, q_star_c, sampler = self._segment(self._current(self._t))
        pool = self._queries
        if b == 1:  # one request: the same draws as a batch, without the batch bookkeeping
            n = int(ns[0])
            query, atoms, one = self._draw_one(int(prompts[0]), n, sampler)
            queries, offsets, utilities = np.array([query]), np.array([0, n]), one[:, None]
            costs = self._cost[prompts, queries]
        else:
            queries = pool[(self._rng_queries.random(b) * pool.size).astype(np.int64)]
            costs = self._cost[prompts, queries]
            offsets = np.zeros(b + 1, dtype=np.int64)
            np.cumsum(ns, out=offsets[1:])
            uniforms = self._rng_atoms.random(int(offsets[-1]))
            cost_n = ns * costs  # N times the cost per completion, as ``step``'s
            if self._vectors is not None:  # one compiled pass: every pull's atoms and its utility per context
                atoms, utilities = bon_batch(uniforms, sampler.accept, sampler.alias, sampler.n_atoms, prompts,
                                             queries, offsets, self._n_queries, self._vectors, self._weights, cost_n)
            else:
                assert self._gold_array is not None
                atoms, utilities = mv_batch(uniforms, sampler.accept, sampler.alias, sampler.n_atoms, prompts,
                                            queries, offsets, self._n_queries, self._gold_array, self._weights,
                                            cost_n)
        pulls = Pulls(prompts, ns, queries, atoms, offsets)
        contexts = requests.contexts
        q_chosen = q[contexts, prompts, ns - 1]
        q_star = q_star_c[contexts]
        self._t += b
        return Served(pulls, utilities, utilities[contexts, np.arange(b)], costs, q_star, q_chosen, q_star - q_chosen)

    def _check(self, requests: Requests, prompts: np.ndarray, ns: np.ndarray) -> None:
        n_p, n_max = self.table.n_prompts, self.table.n_max
        bad = (prompts < 0) | (prompts >= n_p)
        if bad.any():
            raise ValueError(f"prompt p must be in [0, {n_p - 1}], got {int(prompts[bad][0])}")
        bad = (ns < 1) | (ns > n_max)
        if bad.any():
            raise ValueError(f"N must be in [1, {n_max}], got {int(ns[bad][0])}")
        late = ~requests.available[prompts]
        if late.any():
            i = int(np.flatnonzero(late)[0])
            p = int(prompts[i])
            t = requests.start + i
            retired = self.schedule.retired
            why = (f"it was retired at step {int(retired[p])}" if retired is not None and retired[p] <= t
                   else f"it arrives at step {int(self.schedule.arrival[p])}")
            raise ValueError(f"prompt {p} is not available at step {t}: {why} (schedule {self.schedule.kind!r})")
