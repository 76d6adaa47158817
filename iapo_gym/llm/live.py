"""``IAPO-Live-v0``: the IAPO bandit on a live endpoint, for every built-in agent unchanged.

``LiveEnv`` is an ``IAPOEnv`` whose pulls are concurrent requests: pull (p, N) on query q asks
for the next N sample indices of (p, q) (so a seeded rerun asks for the same ones, and the
response cache answers them without a request). Completions become atoms the way the table
builder buckets them, so ``utilities``/``block_utilities`` and the agents' estimators apply as is:

* majority vote: per pull, atom 0 is the gold answer, atoms 1..N the other answers in order of
  first appearance in the pull, atom N_max + 1 "no answer" (the table's "other" bucket);
* Best-of-N: scores rounded to the spec's ``grid`` within ``score_range``; the atoms are the grid.

The env's ``table`` carries the schema (prompts, queries, contexts, cost, atoms); its ``probs``
are unknown, so the exact oracle is refused and ``evaluate_monte_carlo`` samples the endpoint.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, SupportsFloat

import numpy as np

from iapo_gym.data.build import bon_contexts
from iapo_gym.env import IAPOEnv, Pulls
from iapo_gym.llm.cache import ResponseCache
from iapo_gym.llm.client import LLMClient
from iapo_gym.llm.loop import LoopThread, gather_all
from iapo_gym.llm.scoring import make_extractor, make_scorer
from iapo_gym.llm.spec import Spec, SpecError, load_spec
from iapo_gym.oracle import policy_arms
from iapo_gym.paths import cache_dir
from iapo_gym.policy import Policy, PolicyLike
from iapo_gym.tables import TEST, TRAIN, OutcomeTable
from iapo_gym.tasks.contexts import mv_cost_contexts

NO_ORACLE = ("a live endpoint has no exact oracle: collect a table with `iapo-gym collect SPEC --out DIR` and "
             "open DIR/TASK.h5 with iapo_gym.IAPOEnv(path=...) for exact evaluation, or call "
             "evaluate_monte_carlo on the live env (real requests, with a standard error)")


def _schema_table(spec: Spec) -> OutcomeTable:
    """The live task's table: its shapes, contexts, cost and atoms; ``probs`` uniform (unknown, never sampled)."""
    n_p, n_q = len(spec.prompts), len(spec.queries)
    cost = np.asarray(spec.live_cost if spec.live_cost is not None else [spec.build.cost_scale] * n_p)
    split = None
    if all(q.split for q in spec.queries):
        split = np.array([TEST if q.split == "test" else TRAIN for q in spec.queries], dtype=np.uint8)
    common: dict[str, Any] = {"task": spec.task, "cost": cost, "n_max": spec.n_max, "split": split,
                              "prompts": tuple(p.id for p in spec.prompts), "queries": tuple(q.id for q in spec.queries),
                              "attrs": {"source": f"live endpoint, model {spec.endpoint.model!r}",
                                        "build": "iapo_gym.llm.live (probs unknown: live samples only)"}}
    if spec.aggregator == "mv":
        n_m = spec.n_max + 2
        weights, names, cprobs = mv_cost_contexts()
        return OutcomeTable(aggregator="mv", probs=np.full((n_p, n_q, n_m), 1.0 / n_m), context_weights=weights,
                            context_names=names, context_probs=cprobs, objective_names=("correct",),
                            gold=np.zeros(n_q, dtype=np.int64), **common)
    sc = spec.scorer
    if sc.grid is None or sc.score_range is None or not sc.objectives:
        raise SpecError(f"{spec.path}: the live Best-of-N env needs scorer.grid, scorer.score_range and "
                        "scorer.objectives (its atoms are the grid points of the score range)")
    points = np.arange(np.ceil(sc.score_range[0] / sc.grid), np.floor(sc.score_range[1] / sc.grid) + 1) * sc.grid
    k = len(sc.objectives)
    grid = np.array(list(itertools.product(points, repeat=k)))  # (G^K, K)
    atoms = np.broadcast_to(grid, (n_p, n_q, *grid.shape))
    weights, names, cprobs = bon_contexts(k)
    return OutcomeTable(aggregator="bon", probs=np.full((n_p, n_q, grid.shape[0]), 1.0 / grid.shape[0]),
                        atoms=atoms, context_weights=weights, context_names=names, context_probs=cprobs,
                        objective_names=sc.objectives, **common)


class LiveEnv(IAPOEnv):
    """The IAPO contextual bandit on a live OpenAI-compatible endpoint (``gym.make("IAPO-Live-v0", spec=...)``)."""

    draws_from_table = False

    def __init__(self, spec: str | os.PathLike[str] | Spec, *, split: str = "train",
                 cache: str | os.PathLike[str] | None = None) -> None:
        """``spec``: a spec file or ``Spec``; ``cache``: the response cache file (default: the spec's, else the user cache)."""
        self.llm_spec = spec if isinstance(spec, Spec) else load_spec(spec)
        super().__init__(table=_schema_table(self.llm_spec), split=split)
        path = cache or self.llm_spec.cache or cache_dir() / "llm" / f"{self.llm_spec.task}.sqlite"
        self.response_cache = ResponseCache(path)
        self._extract = make_extractor(self.llm_spec.scorer) if self.llm_spec.aggregator == "mv" else None
        bon = self.llm_spec.aggregator == "bon"
        self._score = make_scorer(self.llm_spec) if bon else None
        self._drawn = np.zeros((self.n_prompts, self.table.n_queries), dtype=np.int64)  # samples used per pair
        # the client's loop runs on its own thread, so the env also works inside a running loop (a notebook)
        self._loop = LoopThread("iapo-gym-live")
        self.client = LLMClient(self.llm_spec, self.response_cache)
        self._loop.run(self.client.__aenter__())
        self._last_tokens = np.zeros(0, dtype=np.int64)
        self._last_texts: list[str] = []
        if self.llm_spec.aggregator == "bon":
            sc = self.llm_spec.scorer
            assert sc.grid is not None and sc.score_range is not None
            self._grid_lo = int(np.ceil(sc.score_range[0] / sc.grid))
            self._grid_n = int(np.floor(sc.score_range[1] / sc.grid)) - self._grid_lo + 1

    @property
    def requests(self) -> int:
        """HTTP requests this env has sent (cache hits send none)."""
        return self.client.cap.requests

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """As ``IAPOEnv.reset``; a seeded reset also restarts the sample indices (a rerun hits the cache)."""
        if seed is not None:
            self._drawn[...] = 0
        return super().reset(seed=seed, options=options)

    def pull(self, prompts: np.ndarray, ns: np.ndarray, queries: np.ndarray | None = None) -> Pulls:
        """Draw queries as the table env does, then request every pull's completions concurrently."""
        prompts = np.asarray(prompts, dtype=np.int64).reshape(-1)
        ns = np.asarray(ns, dtype=np.int64).reshape(-1)
        queries = self._pull_queries(prompts, ns, queries)
        drawn = self._drawn.copy()
        starts = np.empty(prompts.size, dtype=np.int64)
        for i, (p, q, n) in enumerate(zip(prompts.tolist(), queries.tolist(), ns.tolist(), strict=True)):
            starts[i] = drawn[p, q]
            drawn[p, q] += n
        results = self._loop.run(self._fetch(prompts, queries, ns, starts))
        atoms = np.concatenate([a for a, _, _ in results]) if results else np.zeros(0, dtype=np.int64)
        self._last_tokens = np.concatenate([t for _, t, _ in results]) if results else np.zeros(0, dtype=np.int64)
        self._last_texts = [text for _, _, texts in results for text in texts]
        self._drawn = drawn  # only a pull that completed uses up its sample indices
        offsets = np.zeros(prompts.size + 1, dtype=np.int64)
        np.cumsum(ns, out=offsets[1:])
        self.completions_drawn += int(offsets[-1])
        return Pulls(prompts, ns, queries, atoms.astype(np.int64), offsets)

    def pull_one(self, prompt: int, n: int) -> tuple[int, np.ndarray]:
        """One live pull: (query, atoms), through ``pull`` (the table's draws are never used here)."""
        pulls = self.pull(np.array([prompt]), np.array([n]))
        return int(pulls.queries[0]), pulls.atoms

    def _get_sampler(self) -> Any:
        """Refused: the schema table's ``probs`` are not the model's, so nothing may sample them."""
        raise NotImplementedError("LiveEnv draws completions from the endpoint; its table has no outcome "
                                  "distribution to sample")

    async def _fetch(self, prompts: np.ndarray, queries: np.ndarray, ns: np.ndarray,
                     starts: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, list[str]]]:
        async def one(p: int, q: int, n: int, start: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
            query = self.llm_spec.queries[q]
            comps = await self.client.complete(self.llm_spec.prompts[p].render(query.text), list(range(start, start + n)))
            tokens = np.array([c.tokens for c in comps], dtype=np.int64)
            texts = [c.text for c in comps]
            if self._extract is not None:
                return self._mv_atoms([self._extract(t) for t in texts], query.gold), tokens, texts
            assert self._score is not None
            scores = await gather_all(*(self._score(c.text, query.text) for c in comps))
            return self._bon_atoms(scores), tokens, texts
        # every pull ends before a failure is raised: the loop outlives this call
        return await gather_all(*(one(int(p), int(q), int(n), int(s))
                                  for p, q, n, s in zip(prompts, queries, ns, starts, strict=True)))

    def _mv_atoms(self, answers: list[str | None], gold: str | None) -> np.ndarray:
        """Gold -> 0, other answers -> 1.. by first appearance in the pull, no answer -> N_max + 1."""
        local: dict[str, int] = {}
        out = np.empty(len(answers), dtype=np.int64)
        for i, a in enumerate(answers):
            a = a.strip() if a is not None else None
            if not a:
                out[i] = self.n_max + 1
            elif a == gold:
                out[i] = 0
            else:
                out[i] = local.setdefault(a, len(local) + 1)
        return out

    def _bon_atoms(self, scores: list[dict[str, float]]) -> np.ndarray:
        """Grid index of each completion's rounded score vector (scores outside ``score_range`` are an error)."""
        sc = self.llm_spec.scorer
        assert sc.grid is not None
        vec = np.array([[s[name] for name in sc.objectives] for s in scores])
        steps = np.round(vec / sc.grid).astype(np.int64) - self._grid_lo
        if np.any((steps < 0) | (steps >= self._grid_n)):
            raise ValueError(f"a score {vec[np.any((steps < 0) | (steps >= self._grid_n), axis=1)][0].tolist()} lies "
                             f"outside scorer.score_range {sc.score_range}")
        return np.ravel_multi_index(tuple(steps.T), (self._grid_n,) * len(sc.objectives)).astype(np.int64)

    def step(self, action: tuple[int, int]) -> tuple[np.ndarray, SupportsFloat, bool, bool, dict[str, Any]]:
        """As ``IAPOEnv.step``; ``info`` adds the completions' ``texts`` and real token counts (``tokens``)."""
        obs, reward, terminated, truncated, info = super().step(action)
        info["tokens"] = self._last_tokens.copy()
        info["texts"] = list(self._last_texts)
        return obs, reward, terminated, truncated, info

    # ---- no exact oracle -----------------------------------------------------------------
    def q_table(self, split: str = "test") -> np.ndarray:
        """Refused: the live model's outcome distribution is unknown."""
        raise NotImplementedError(NO_ORACLE)

    def optimal_policy(self, split: str = "test") -> Policy:
        """Refused: the live model's outcome distribution is unknown."""
        raise NotImplementedError(NO_ORACLE)

    def evaluate(self, policy: PolicyLike, split: str = "test") -> float:
        """Refused: use ``evaluate_monte_carlo`` (real requests) or collect a table."""
        raise NotImplementedError(NO_ORACLE)

    def evaluate_monte_carlo(self, policy: PolicyLike, split: str = "test", n_samples: int = 100,
                             seed: int | None = None) -> tuple[float, float]:
        """Monte Carlo ACR from real requests: (mean, standard error) over ``n_samples`` (context, query, pull) draws.

        Contexts and queries come from a generator seeded with ``seed``; the pulls spend this env's
        requests, budget and sample indices (a rerun after a seeded reset is answered by the cache).
        """
        rng = np.random.default_rng(seed)
        arms = policy_arms(policy, self.table)
        contexts = rng.choice(self.n_contexts, size=n_samples, p=self.table.context_probs)
        pool = self.queries(split)
        q = pool[rng.integers(pool.size, size=n_samples)]
        pulls = self.pull(arms[contexts, 0], arms[contexts, 1], q)
        values = self.utilities(pulls)[contexts, np.arange(n_samples)]
        return float(values.mean()), float(values.std(ddof=1) / np.sqrt(n_samples))

    def close(self) -> None:
        """Close the client, its event loop and the cache."""
        if not self._loop.closed:
            self._loop.run(self.client.__aexit__(None, None, None))
            if self._score is not None:
                self._loop.run(self._score.aclose())
            self._loop.close()
            self.response_cache.close()
        super().close()
