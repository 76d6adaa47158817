"""``IAPO-Live-v0``: the IAPO bandit on a live endpoint, for every built-in agent unchanged.

``LiveEnv`` is an ``IAPOEnv`` whose pulls are concurrent requests: pull (p, N) on query q asks
for the next N sample indices of (p, q) (so a seeded rerun asks for the same ones, and the
response cache answers them without a request). Completions become atoms the way the table
builder buckets them, so ``utilities``/``block_utilities`` and the agents' estimators apply as is:

* majority vote: per pull, atom 0 is the gold answer, atoms 1..N the other answers in order of
  first appearance in the pull, atom N_max + 1 "no answer" (the table's "other" bucket);
* Best-of-N: scores rounded to the spec's ``grid`` within ``score_range``; the atoms are the grid.

The env's ``table`` is a ``TableSchema`` (prompts, queries, contexts, cost, atoms, no outcome
distributions) and its ``source`` an ``EndpointSource``, which has no exact answer: the oracle's
methods refuse, saying so, and ``evaluate_monte_carlo`` samples the endpoint. With several
endpoints in the spec the env's prompts are the arms, (endpoint, prompt) pairs: each pull goes to
its arm's endpoint (with that endpoint's key only), all under the spec's one spending cap, and
the cost is in the spec's currency when it gives prices (``iapo_gym.llm.prices.live_costs``).
"""

from __future__ import annotations

import itertools
import os
from typing import Any, SupportsFloat

import numpy as np

from iapo_gym.data.build import bon_contexts
from iapo_gym.env import IAPOEnv
from iapo_gym.llm.cache import ResponseCache
from iapo_gym.llm.client import LLMClient
from iapo_gym.llm.loop import LoopThread, gather_all
from iapo_gym.llm.prices import live_costs
from iapo_gym.llm.scoring import make_extractor, make_scorer
from iapo_gym.llm.spec import Spec, SpecError, load_spec
from iapo_gym.oracle import policy_arms
from iapo_gym.paths import cache_dir
from iapo_gym.policy import PolicyLike
from iapo_gym.tables import TEST, TRAIN, TableSchema
from iapo_gym.tasks.contexts import mv_cost_contexts

NO_ORACLE = ("a live endpoint has no exact oracle: collect a table with `iapo-gym collect SPEC --out DIR` and "
             "open DIR/TASK.h5 with iapo_gym.IAPOEnv(path=...) for exact evaluation, or call "
             "evaluate_monte_carlo on the live env (real requests, with a standard error)")


def _schema_table(spec: Spec) -> TableSchema:
    """The live task's schema: its shapes, contexts, cost and atoms (its outcome distributions are unknown)."""
    n_p, n_q = len(spec.prompts), len(spec.queries)
    cost, unit = live_costs(spec)
    models = ", ".join(f"{e.id}: {e.model!r}" for e in spec.endpoints) if len(spec.endpoints) > 1 else \
        repr(spec.endpoint.model)
    split = None
    if all(q.split for q in spec.queries):
        split = np.array([TEST if q.split == "test" else TRAIN for q in spec.queries], dtype=np.uint8)
    common: dict[str, Any] = {"task": spec.task, "cost": cost, "cost_unit": unit, "n_max": spec.n_max, "split": split,
                              "prompts": tuple(p.id for p in spec.prompts), "queries": tuple(q.id for q in spec.queries),
                              "attrs": {"source": f"live endpoint{'s' if len(spec.endpoints) > 1 else ''}, "
                                                  f"model{'s' if len(spec.endpoints) > 1 else ''} {models}",
                                        "build": "iapo_gym.llm.live (outcome distributions unknown: live samples only)"}}
    if spec.aggregator == "mv":
        n_m = spec.n_max + 2
        weights, names, cprobs = spec.context_arrays() or mv_cost_contexts()
        return TableSchema(aggregator="mv", shape=(n_p, n_q, n_m), context_weights=weights,
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
    weights, names, cprobs = spec.context_arrays() or bon_contexts(k)
    return TableSchema(aggregator="bon", shape=(n_p, n_q, grid.shape[0]),
                       atoms=atoms, context_weights=weights, context_names=names, context_probs=cprobs,
                        objective_names=sc.objectives, **common)


class EndpointSource:
    """Completions requested from a live endpoint through the response cache (no exact oracle).

    Pull (p, N) on query q asks for the next N sample indices of (p, q); a seeded reset of the env
    restarts them, so a rerun is answered by the cache. Only a pull that completed uses up its indices.
    """

    exact = False
    no_exact = NO_ORACLE

    def __init__(self, spec: Spec, schema: TableSchema, cache: str | os.PathLike[str]) -> None:
        """Open the response cache ``cache`` and a client per endpoint of ``spec`` on a loop of its own."""
        self.spec = spec
        self.n_max = schema.n_max
        self.response_cache = ResponseCache(cache)
        self._extract = make_extractor(spec.scorer) if spec.aggregator == "mv" else None
        self._score = make_scorer(spec) if spec.aggregator == "bon" else None
        self._drawn = np.zeros((schema.n_prompts, schema.n_queries), dtype=np.int64)  # samples used per pair
        # the client's loop runs on its own thread, so the env also works inside a running loop (a notebook)
        self._loop = LoopThread("iapo-gym-live")
        # one client per endpoint (each sends only its own key to its own host), all under one spending cap
        self.clients = [LLMClient(spec.for_endpoint(e), self.response_cache) for e in range(len(spec.endpoints))]
        for client in self.clients[1:]:
            client.cap = self.clients[0].cap
        self.client = self.clients[0]  # its cap is every endpoint's
        for client in self.clients:
            self._loop.run(client.__aenter__())
        self.last_tokens = np.zeros(0, dtype=np.int64)  # real token counts of the last pull's completions
        self.last_prompt_tokens = np.zeros(0, dtype=np.int64)  # and their shares of the prompt tokens
        self.last_spend = 0.0  # the last pull's price in the spec's currency (0 without prices; cache hits included)
        self.last_texts: list[str] = []  # and their texts
        if spec.aggregator == "bon":
            sc = spec.scorer
            assert sc.grid is not None and sc.score_range is not None
            self._grid_lo = int(np.ceil(sc.score_range[0] / sc.grid))
            self._grid_n = int(np.floor(sc.score_range[1] / sc.grid)) - self._grid_lo + 1

    def restart(self) -> None:
        """Sample indices start over (a seeded rerun asks for the same completions, answered by the cache)."""
        self._drawn[...] = 0

    def draw(self, prompts: np.ndarray, queries: np.ndarray, ns: np.ndarray,
             rng: np.random.Generator) -> np.ndarray:
        """Request every pull's completions concurrently (``rng`` is not used: the endpoint samples)."""
        drawn = self._drawn.copy()
        starts = np.empty(prompts.size, dtype=np.int64)
        for i, (p, q, n) in enumerate(zip(prompts.tolist(), queries.tolist(), ns.tolist(), strict=True)):
            starts[i] = drawn[p, q]
            drawn[p, q] += n
        results = self._loop.run(self._fetch(prompts, queries, ns, starts))
        empty = np.zeros(0, dtype=np.int64)
        atoms = np.concatenate([a for a, _, _, _ in results]) if results else empty
        self.last_tokens = np.concatenate([t for _, t, _, _ in results]) if results else empty
        self.last_prompt_tokens = np.concatenate([pt for _, _, pt, _ in results]) if results else empty
        self.last_texts = [text for _, _, _, texts in results for text in texts]
        self.last_spend = 0.0
        if self.spec.priced and results:
            arm = np.repeat(np.asarray(prompts, dtype=np.int64), np.asarray(ns, dtype=np.int64))
            price_in = np.array([self.spec.endpoint_of(p).input_price_per_million for p in self.spec.prompts])
            price_out = np.array([self.spec.endpoint_of(p).output_price_per_million for p in self.spec.prompts])
            self.last_spend = float(((self.last_prompt_tokens * price_in[arm]
                                      + self.last_tokens * price_out[arm]) / 1e6).sum())
        self._drawn = drawn  # only a pull that completed uses up its sample indices
        return atoms.astype(np.int64)

    def draw_one(self, prompt: int, query: int, n: int, rng: np.random.Generator) -> np.ndarray:
        """One pull's completions, as ``draw`` of a batch of one."""
        return self.draw(np.array([prompt]), np.array([query]), np.array([n]), rng)

    async def _fetch(self, prompts: np.ndarray, queries: np.ndarray, ns: np.ndarray,
                     starts: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]]:
        async def one(p: int, q: int, n: int, start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
            query, prompt = self.spec.queries[q], self.spec.prompts[p]
            comps = await self.clients[prompt.endpoint].complete(prompt.render(query.text),
                                                                 list(range(start, start + n)))
            tokens = np.array([c.tokens for c in comps], dtype=np.int64)
            prompt_tokens = np.array([c.prompt_tokens for c in comps], dtype=np.int64)
            texts = [c.text for c in comps]
            if self._extract is not None:
                return self._mv_atoms([self._extract(t) for t in texts], query.gold), tokens, prompt_tokens, texts
            assert self._score is not None
            scores = await gather_all(*(self._score(c.text, query.text) for c in comps))
            return self._bon_atoms(scores), tokens, prompt_tokens, texts
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
        sc = self.spec.scorer
        assert sc.grid is not None
        vec = np.array([[s[name] for name in sc.objectives] for s in scores])
        steps = np.round(vec / sc.grid).astype(np.int64) - self._grid_lo
        if np.any((steps < 0) | (steps >= self._grid_n)):
            raise ValueError(f"a score {vec[np.any((steps < 0) | (steps >= self._grid_n), axis=1)][0].tolist()} lies "
                             f"outside scorer.score_range {sc.score_range}")
        return np.ravel_multi_index(tuple(steps.T), (self._grid_n,) * len(sc.objectives)).astype(np.int64)

    def close(self) -> None:
        """Close the client, its event loop and the cache."""
        if not self._loop.closed:
            for client in self.clients:
                self._loop.run(client.__aexit__(None, None, None))
            if self._score is not None:
                self._loop.run(self._score.aclose())
            self._loop.close()
            self.response_cache.close()


class LiveEnv(IAPOEnv):
    """The IAPO contextual bandit on a live OpenAI-compatible endpoint (``gym.make("IAPO-Live-v0", spec=...)``).

    ``source`` (an ``EndpointSource``) requests the completions; the oracle's methods refuse (no exact answer).
    """

    source: EndpointSource

    def __init__(self, spec: str | os.PathLike[str] | Spec, *, split: str = "train",
                 cache: str | os.PathLike[str] | None = None) -> None:
        """``spec``: a spec file or ``Spec``; ``cache``: the response cache file (default: the spec's, else the user cache)."""
        self.llm_spec = spec if isinstance(spec, Spec) else load_spec(spec)
        schema = _schema_table(self.llm_spec)
        path = cache or self.llm_spec.cache or cache_dir() / "llm" / f"{self.llm_spec.task}.sqlite"
        super().__init__(table=schema, split=split, source=EndpointSource(self.llm_spec, schema, path))
        self.response_cache = self.source.response_cache
        self.client = self.source.client  # the first endpoint's; its spending cap counts every endpoint's requests
        self.clients = self.source.clients

    @property
    def requests(self) -> int:
        """HTTP requests this env has sent (cache hits send none)."""
        return self.client.cap.requests

    def step(self, action: tuple[int, int] | tuple[int, int, int]) -> tuple[np.ndarray, SupportsFloat, bool, bool,
                                                                             dict[str, Any]]:
        """As ``IAPOEnv.step``; ``info`` adds the completions' ``texts``, real token counts (``tokens``), their
        shares of the prompt tokens (``prompt_tokens``) and, with prices in the spec, the pull's price (``spend``)."""
        obs, reward, terminated, truncated, info = super().step(action)
        info["tokens"] = self.source.last_tokens.copy()
        info["prompt_tokens"] = self.source.last_prompt_tokens.copy()
        info["texts"] = list(self.source.last_texts)
        if self.llm_spec.priced:
            info["spend"] = self.source.last_spend
        return obs, reward, terminated, truncated, info

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
        """Close the endpoint source (client, event loop, cache)."""
        self.source.close()
        super().close()
