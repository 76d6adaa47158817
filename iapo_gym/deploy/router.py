"""Apply a learned policy per request: render the context's prompt, ask for N completions, aggregate as the tables do.

``Router(policy, spec)`` takes a policy file and a collection spec naming the upstream endpoint
(its model, sampling, retries and spending cap), or several: then the policy's prompts are the
spec's arms (``<endpoint id>/<prompt id>``) and each request goes to its arm's endpoint, with that
endpoint's key only. ``await router.acomplete(query, context)`` (or the
blocking ``router.complete``) picks the context's (prompt, N), asks the upstream for N completions
through ``iapo_gym.llm.client.LLMClient`` (one request with ``n`` where the upstream honours it,
else N concurrent requests; no response cache; a majority vote draws them in waves and stops once
decided, so N is its cap) and returns the aggregated completion. A context's stopping rule (the policy file's
``rule``, docs/rules.md) draws in waves too and stops where the rule says (``rule_wave``; a Best-of-N threshold
after the wave holding a completion whose utility reaches the context's tau), N being its cap:

* majority vote: answers are extracted with the policy's extractor and bucketed as the tables
  bucket them (no answer is one bucket); the most-voted bucket wins; a tie between t buckets is
  broken uniformly at random, which is exactly the oracle's tie credit 1/t. The generator is
  seeded from the router's seed and the request (context, prompt, query and completions), so the
  same request gives the same answer. The returned completion is the first one in the winning bucket;
* Best-of-N: each completion's objective scores from the policy's scorer, rounded to the scorer's
  grid as in the tables, weighted by the context's objective weights; the first best one is returned.

``astream`` is ``acomplete`` with the text passed on as the upstream sends it where the context's N
is 1. ``rules`` (``CallerRules``) say how a chat's system text and earlier turns ride along with the
policy's prompt (``render``), and a caller's stop sequences go upstream only where N is 1 (``sends_stop``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from iapo_gym.deploy.estimates import ArmRatings, choose_arm
from iapo_gym.deploy.params import CallerRules
from iapo_gym.llm.client import (
    BudgetExhausted,
    ClientOptions,
    Completion,
    EndpointError,
    LLMClient,
    RequestOptions,
    SpendingCap,
    upstream_stop,
)
from iapo_gym.llm.loop import LoopThread, gather_all
from iapo_gym.llm.scoring import RewardScorer, make_extractor, make_scorer
from iapo_gym.llm.spec import Prompt, Scorer, Spec, load_spec
from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyFileError, PolicyRule, load_policy
from iapo_gym.rules import FixedN, Rule, Threshold, vote_stops
from iapo_gym.seeding import derive_rng
from iapo_gym.utility import votes_to_decide

TIE_KEY = "iapo_gym.deploy.tie"
RATED_CACHE = 1024  # weights whose best arm is remembered (a Best-of-N rating scores every block)
ContextRef = str | int | Sequence[float] | None
#: How an earlier turn of a chat is written into a completions-API prompt (``--history keep``).
TURN_LABELS = {"user": "User", "assistant": "Assistant"}

__all__ = ["BudgetExhausted", "ContextError", "EndpointError", "RatedContext", "Routed", "Router", "rule_wave"]
#: A context without a rule: fixed N (as a response's ``iapo`` object shows it).
FIXED = PolicyRule("fixed")


def rule_wave(rule: Rule, counts: np.ndarray, left: int, n_max: int) -> int:
    """Completions to draw next before majority-vote ``rule`` could stop, at most ``left``; 0 when it stops now.

    ``counts`` are the votes per answer so far; the rule is checked after every completion (never before the
    first), by ``iapo_gym.rules.vote_stops``, the stopping test of the exact expectations and of the env's steps.
    The fewest further completions that could make it stop give all their votes to the leader: the top two counts
    become (v1 + k, v2), and a margin or a posterior level can be reached no sooner (v1 grows by at most one a
    completion and v2 never falls; both rules stop more readily as v1 grows and v2 falls). For ``Margin(m)`` this
    is m - (v1 - v2). No k <= ``left`` stops it: ``left`` (the cap). ``n_max`` bounds v1 + v2 (the policy's n_max).
    """
    if left <= 0:
        return 0
    top = np.sort(np.asarray(counts, dtype=np.int64))[::-1]
    v1 = int(top[0]) if top.size else 0
    v2 = int(top[1]) if top.size > 1 else 0
    if top.size and bool(vote_stops(rule, np.array([v1]), np.array([v2]), n_max)[0]):
        return 0
    k = np.arange(1, left + 1)
    hit = vote_stops(rule, v1 + k, np.full(left, v2), n_max)
    return int(k[hit.argmax()]) if hit.any() else left


@dataclass(frozen=True)
class RatedContext(PolicyContext):
    """Weights no context of the policy has, with the arm its estimates rate best; ``route`` says how it was chosen."""

    route: dict[str, Any] = field(default_factory=dict)


class ContextError(ValueError):
    """A request names no context of the policy (or an ambiguous one); the message lists the contexts."""

    def __init__(self, message: str, contexts: Sequence[PolicyContext]) -> None:
        """``contexts``: the policy's contexts, listed in the message."""
        listing = "; ".join(f"{c.name} (weights {list(c.weights)})" for c in contexts)
        super().__init__(f"{message}; the policy's contexts: {listing}")
        self.contexts = [{"name": c.name, "objective_weights": list(c.objective_weights), "cost_weight": c.cost_weight}
                         for c in contexts]


@dataclass
class Routed:
    """One routed request: the aggregated completion, and how it was chosen."""

    text: str
    finish: str | None
    chosen: int  # index of the returned completion among those drawn
    context: PolicyContext
    prompt_id: str
    completions: list[Completion]
    answers: list[str | None] | None = None  # mv: extracted answers
    votes: list[tuple[str | None, int]] = field(default_factory=list)  # mv: (answer, votes), first appearance order
    tied: list[str | None] = field(default_factory=list)  # mv: the answers tied for the most votes
    scores: list[float] | None = None  # bon: weighted (rounded) scores
    objective_scores: list[dict[str, float]] | None = None  # bon: the scorer's raw scores
    streamed: bool = False  # the text went to ``astream``'s on_text as the upstream sent it
    propensity: float = 1.0  # the probability the arm was chosen with (``serve --learn`` explores; else 1)
    learn: dict[str, Any] | None = None  # serve --learn / --shadow: how the arm was chosen, the candidate's arm

    @property
    def n(self) -> int:
        """Completions drawn from the upstream (N, or fewer for a majority vote decided early or a stopping rule's
        stop)."""
        return len(self.completions)

    @property
    def completion_tokens(self) -> int:
        """Completion tokens of the completions drawn, as the upstream reported them."""
        return sum(c.tokens for c in self.completions)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the upstream reported for the request(s)."""
        return sum(c.prompt_tokens for c in self.completions)

    def info(self) -> dict[str, Any]:
        """The ``iapo`` object of a response: context, how its arm was chosen, prompt id, N, the stopping rule
        (name and params, and a threshold's tau) and the completions drawn, and the votes or scores."""
        route = getattr(self.context, "route", None) or {"by": "context"}
        out: dict[str, Any] = {"context": self.context.name, "route": route, "prompt": self.prompt_id,
                               "n": self.context.n, "rule": (self.context.rule or FIXED).to_dict(), "drawn": self.n,
                               "chosen": self.chosen}
        if self.answers is not None:
            out.update(aggregator="mv", answers=self.answers, votes=[[a, v] for a, v in self.votes],
                       winner=self.answers[self.chosen] if self.answers[self.chosen] else None, tied=self.tied)
        else:
            out.update(aggregator="bon", scores=self.scores, objective_scores=self.objective_scores)
        if self.learn is not None and "explored" in self.learn:
            out["learn"] = {k: self.learn[k] for k in ("explored", "propensity", "greedy", "contender", "share")
                            if k in self.learn}
        return out


class Router:
    """A policy file applied to an upstream endpoint: ``acomplete``/``complete`` per request (module docstring)."""

    def __init__(self, policy: PolicyFile | str | os.PathLike[str], spec: Spec | str | os.PathLike[str], *,
                 seed: int = 0, early_stop: bool = True, rules: CallerRules | None = None, bon_wave: int = 1) -> None:
        """``policy``: a ``PolicyFile`` or its path; ``spec``: the upstream's collection spec or its path;
        ``seed``: the root of the tie-breaking generators; ``early_stop``: a majority vote stops drawing
        once decided (N is then a cap; ``_vote_in_waves`` says how the answer relates to the vote of all N);
        False draws all N (a context's stopping rule still applies: it is the policy's choice); ``rules``: what
        callers may send beyond the policy's prompt and sampling (a chat's system text and earlier turns, sampling
        ranges; ``CallerRules``, default none); ``bon_wave``: completions per wave of a Best-of-N threshold rule
        (1: it stops exactly at the first completion that reaches tau; more: fewer round trips, up to
        ``bon_wave`` - 1 completions drawn past that one)."""
        if isinstance(bon_wave, bool) or not isinstance(bon_wave, int) or bon_wave < 1:
            raise ValueError(f"bon_wave must be an integer >= 1 (completions per wave), got {bon_wave!r}")
        self.bon_wave = bon_wave
        self.policy = policy if isinstance(policy, PolicyFile) else load_policy(policy)
        self.spec = spec if isinstance(spec, Spec) else load_spec(spec)
        self.seed = int(seed)
        self.early_stop = bool(early_stop)
        self.rules = rules or CallerRules()
        pf, sp = self.policy, self.spec
        unservable = sorted({c.prompt for c in pf.contexts if not pf.prompt(c.prompt).servable})
        if unservable:
            raise PolicyFileError(f"the policy has no template or messages for prompt(s) {unservable}: it was learned "
                                  "on a table without its collection spec; rerun `iapo-gym optimize` with --spec")
        if pf.scorer is None:
            raise PolicyFileError("the policy names no answer extractor or scorer (learned on a table without its "
                                  "collection spec); rerun `iapo-gym optimize` with --spec")
        if sp.endpoint.api != pf.api:
            raise ValueError(f"the policy's prompts are written for the {pf.api} API, the upstream spec {sp.path} "
                             f"uses endpoint.api = {sp.endpoint.api!r}")
        if pf.sampling is not None and pf.sampling != sp.sampling.as_dict():
            warnings.warn(f"the upstream spec's sampling {sp.sampling.as_dict()} differs from the sampling the "
                          f"policy was learned with {pf.sampling}: the policy's choices may not be optimal there",
                          stacklevel=2)
        self._prompts = {p.id: Prompt(p.id, p.template, p.messages) for p in pf.prompts if p.servable}
        # the upstream spec's prompts of the policy's API that the policy file has none of: ``serve --learn`` may
        # serve them (a new prompt, explored first; docs/deploy.md "Learning while serving"), no context does
        self.new_prompts = tuple(sorted(p.id for p in sp.prompts if p.id not in self._prompts and
                                        (p.text is not None) == (pf.api == "completions")))
        self._prompts.update({p.id: p for p in sp.prompts if p.id in self.new_prompts})
        # each prompt's endpoint: with several endpoints in the spec, every policy prompt must be one of its arms
        arms = {p.id: p.endpoint for p in sp.prompts}
        if len(sp.endpoints) > 1:
            foreign = sorted(set(self._prompts) - set(arms))
            if foreign:
                raise PolicyFileError(f"the policy's prompt(s) {foreign} are not arms of the upstream spec {sp.path} "
                                      f"(its arms: {sorted(arms)}): give the spec the policy was learned with")
        self._endpoint_of = {pid: arms.get(pid, 0) for pid in self._prompts}
        scorer = Scorer(**cast(dict[str, Any], {k: (tuple(v) if isinstance(v, list) else v)
                                                for k, v in pf.scorer.items()}))
        self._extract = make_extractor(scorer) if pf.aggregator == "mv" else None
        # the policy's scorer, reached through the upstream spec's routes and retry settings
        self._score = make_scorer(dataclasses.replace(sp, scorer=scorer)) if pf.aggregator == "bon" else None
        self._grid = scorer.grid if pf.aggregator == "bon" else None
        self._by_name = {c.name: i for i, c in enumerate(pf.contexts)}
        for c in pf.contexts:  # a posterior rule's stopping table is computed once, here, not in a request
            rule = self._stopping_rule(c)
            if rule is not None and not isinstance(rule, Threshold):
                vote_stops(rule, np.zeros(1, np.int64), np.zeros(1, np.int64), pf.n_max)
        self._ratings = (ArmRatings(pf.arm_estimates, pf.aggregator, pf.n_max, pf.objectives)
                         if pf.arm_estimates is not None else None)
        self._rated: dict[tuple[float, ...], dict[str, Any]] = {}  # weights -> the chosen arm's route, oldest first
        self._client: LLMClient | None = None  # the first endpoint's client (its cap is every endpoint's)
        self._clients: list[LLMClient] = []  # one per endpoint of the spec
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: LoopThread | None = None
        self._options: ClientOptions | None = None  # what start() opened the clients with

    # ---- contexts --------------------------------------------------------------------------------------
    @property
    def contexts(self) -> tuple[PolicyContext, ...]:
        """The policy's contexts."""
        return self.policy.contexts

    def resolve(self, context: ContextRef) -> PolicyContext:
        """The context named by ``context``: its name, its index, or its weights.

        Weights are the objective weights followed by the cost weight, or the objective weights
        alone when exactly one context has them; ``None`` is allowed for a one-context policy.
        Weights no context has get the arm the policy's per-arm estimates rate best for them
        (``route`` says so); they are refused when the policy cannot rate them (no estimates,
        wrong length, a weight of another sign than the policy's contexts).
        """
        ctxs = self.policy.contexts
        if context is None:
            if len(ctxs) == 1:
                return ctxs[0]
            raise ContextError("the request names no context (give iapo_context, or the model 'iapo/<context>')", ctxs)
        if isinstance(context, str):
            if context in self._by_name:
                return ctxs[self._by_name[context]]
            raise ContextError(f"unknown context {context!r}", ctxs)
        if isinstance(context, bool):
            raise ContextError(f"a context is a name, an index or a list of weights, got {context!r}", ctxs)
        if isinstance(context, (int, np.integer)):
            if 0 <= int(context) < len(ctxs):
                return ctxs[int(context)]
            raise ContextError(f"context index {int(context)} is out of range 0..{len(ctxs) - 1}", ctxs)
        try:
            weights = [float(w) for w in context]
        except (TypeError, ValueError):
            raise ContextError(f"a context is a name or a list of weights, got {context!r}", ctxs) from None
        if not all(math.isfinite(w) for w in weights):
            raise ContextError(f"context weights must be finite numbers, got {weights}", ctxs)
        k = len(self.policy.objectives)
        if len(weights) == k + 1:
            found = [c for c in ctxs if _same(c.weights, weights)]
        elif len(weights) == k:
            found = [c for c in ctxs if _same(c.objective_weights, weights)]
            if len(found) > 1:
                raise ContextError(f"objective weights {weights} match {len(found)} contexts (they differ in the cost "
                                   "weight): give the cost weight too", ctxs)
            if not found:
                raise ContextError(f"no context has the objective weights {weights}: give the cost weight too "
                                   f"({k} objective weight(s) {list(self.policy.objectives)}, then the cost weight)",
                                   ctxs)
        else:
            raise ContextError(f"context weights {weights} must list {k} objective weight(s) "
                               f"{list(self.policy.objectives)}, optionally followed by the cost weight", ctxs)
        if found:
            return found[0]
        return self._rate(weights)

    def _rate(self, weights: list[float]) -> RatedContext:
        """The arm the policy's estimates rate best for weights no context has (objective weights, then cost)."""
        ctxs = self.policy.contexts
        if self._ratings is None:
            raise ContextError(f"no context has the weights {weights}, and this policy file carries no per-arm "
                               "estimates (arm_estimates) to rate other weights: it answers its contexts' weights "
                               "only (a policy written by iapo-gym optimize has them)", ctxs)
        objective, cost = weights[:-1], weights[-1]
        names = self.policy.objectives
        for i, name in enumerate(names):
            signs = {math.copysign(1.0, c.objective_weights[i]) for c in ctxs if c.objective_weights[i] != 0}
            if objective[i] < 0 and signs == {1.0}:
                raise ContextError(f"objective weight {objective[i]} for {name!r} is negative; the policy's contexts "
                                   "weigh every objective by >= 0, which is what its estimates cover", ctxs)
            if objective[i] > 0 and signs == {-1.0}:
                raise ContextError(f"objective weight {objective[i]} for {name!r} is positive; the policy's contexts "
                                   "weigh it by <= 0, which is what its estimates cover", ctxs)
        if cost > 0 and all(c.cost_weight <= 0 for c in ctxs):
            raise ContextError(f"cost weight {cost} is positive: a cost weight is <= 0 (it penalises N times the "
                               "prompt's cost), as in every context of the policy", ctxs)
        key = tuple(weights)
        if key not in self._rated:
            if len(self._rated) >= RATED_CACHE:
                self._rated.pop(next(iter(self._rated)))
            self._rated[key] = choose_arm(self._ratings, ctxs, weights)
        chosen = self._rated[key]
        route = {"by": "estimated_utility", **{k: v for k, v in chosen.items() if k not in ("prompt", "n")}}
        return RatedContext(name=json.dumps(weights), objective_weights=tuple(objective), cost_weight=cost,
                            probability=0.0, prompt=chosen["prompt"], n=chosen["n"], route=route)

    # ---- the client ------------------------------------------------------------------------------------
    async def start(self, options: ClientOptions | None = None) -> Router:
        """Open the upstream clients (one per endpoint) on the running event loop (``acomplete`` does it on first use).

        ``options``: a server's cap, retry limit and concurrency instead of the spec's (``ClientOptions``);
        every endpoint's client counts against one cap.
        """
        loop = asyncio.get_running_loop()
        if self._client is not None:
            if self._loop is not loop:
                raise RuntimeError("this Router's client runs on another event loop: use one Router per loop "
                                   "(or only the blocking complete())")
            return self
        sp = self.spec
        options = options or ClientOptions()
        if options.cap is None:
            options = dataclasses.replace(options, cap=SpendingCap(sp.budget.max_requests, sp.budget.max_tokens_total))
        clients = [LLMClient(sp.for_endpoint(e), cache=None, options=options) for e in range(len(sp.endpoints))]
        self._ready_scorer(options)
        for client in clients:
            client.stop_on_failure = False  # one caller's failed request must not stop the others
            await client.__aenter__()
        self._clients, self._client, self._loop, self._options = clients, clients[0], loop, options
        return self

    def _ready_scorer(self, options: ClientOptions) -> None:
        """The reward endpoint's scorer with a server's retry limit and concurrency: one failed call ends only its
        request."""
        if isinstance(self._score, RewardScorer):
            self._score.stop_on_failure = False
            self._score.policy = self._score.policy.capped(options.max_retries)
            self._score.concurrency = options.concurrency or self._score.concurrency

    def with_policy(self, policy: PolicyFile | str | os.PathLike[str]) -> Router:
        """A Router of ``policy`` on this Router's spec and settings, checked as any new Router is, that serves through
        this Router's open upstream clients (a policy swap, ``iapo_gym.deploy.swap``): no connection is opened or
        closed, and the spending cap counts on. The scorer is this Router's where the policies' scorers are the same;
        ``retire`` closes what the successor does not share."""
        new = Router(policy, self.spec, seed=self.seed, early_stop=self.early_stop, rules=self.rules,
                     bon_wave=self.bon_wave)
        if new.policy.scorer == self.policy.scorer:
            new._score = self._score
        elif self._options is not None:
            new._ready_scorer(self._options)
        new._clients, new._client, new._loop, new._options = self._clients, self._client, self._loop, self._options
        return new

    async def retire(self, successor: Router) -> None:
        """Close what this Router holds that ``successor`` (made by ``with_policy``) does not share: a scorer of its
        own. Call it once no request is routed by this Router any more."""
        if self._score is not None and self._score is not successor._score:
            await self._score.aclose()

    async def aclose(self) -> None:
        """Close the upstream client and the reward endpoint's client."""
        if self._score is not None:
            await self._score.aclose()
        if self._client is not None:
            clients, self._clients, self._client = self._clients, [], None
            for client in clients:
                await client.__aexit__(None, None, None)

    async def __aenter__(self) -> Router:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the client and the blocking runner's loop (when ``complete`` was used)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            runner.run(self.aclose())
            runner.close()

    @property
    def spent(self) -> dict[str, int]:
        """Upstream requests sent and completion tokens settled so far (the spec's spending cap counts them)."""
        cap = self._client.cap if self._client is not None else None
        return {"requests": cap.requests if cap else 0, "tokens": cap.tokens if cap else 0}

    async def probe(self, timeout: float) -> int | None:
        """The upstream's HTTP status for ``GET /models`` (None when nothing answered): is it reachable now?

        With several endpoints: None if one of them did not answer, else the first status that is not 200.
        """
        if self._client is None:
            await self.start()
        statuses = await gather_all(*(client.probe(timeout) for client in self._clients))
        if any(status is None for status in statuses):
            return None
        return next((status for status in statuses if status != 200), 200)

    def client_for(self, ctx: PolicyContext) -> LLMClient:
        """The client of the endpoint of the context's arm (started)."""
        assert self._clients, "start the router first"
        return self._clients[self._endpoint_of[ctx.prompt]]

    # ---- routing ---------------------------------------------------------------------------------------
    async def acomplete(self, query: str, context: PolicyContext | ContextRef = None,
                        options: RequestOptions | None = None, *, system: str | None = None,
                        history: Sequence[tuple[str, str]] = ()) -> Routed:
        """Route one query: the context's prompt around ``query``, N upstream completions, aggregated.

        A majority vote decided early, or a context whose stopping rule stops, draws fewer (``Routed.n``; the
        context's N is its cap).

        ``context``: a ``PolicyContext`` already resolved, or what ``resolve`` takes; ``options``: a
        server's per-request ``max_tokens`` bound, seed, sampling, stop sequences (sent upstream only
        where the context's N is 1, ``sends_stop``) and spend tally (``RequestOptions``); ``system``,
        ``history``: a chat's system text and earlier turns, rendered as ``rules`` say (``render``).
        """
        ctx, rendered, options = await self._prepare(query, context, options, system, history)
        if self._extract is not None:
            return await self._vote_in_waves(ctx, query, rendered, options)
        rule = self._stopping_rule(ctx)
        if isinstance(rule, Threshold):
            return await self._best_in_waves(ctx, query, rendered, options)
        completions = await self.client_for(ctx).complete(rendered, list(range(ctx.n)), options)
        return await self._best(ctx, query, completions)

    @staticmethod
    def _stopping_rule(ctx: PolicyContext) -> Rule | None:
        """The context's stopping rule (``iapo_gym.rules``), None for fixed N."""
        rule = ctx.rule.make() if ctx.rule is not None else None
        return None if rule is None or isinstance(rule, FixedN) else rule

    async def astream(self, query: str, context: PolicyContext | ContextRef, options: RequestOptions | None,
                      on_text: Callable[[str], Awaitable[None]], *, system: str | None = None,
                      history: Sequence[tuple[str, str]] = ()) -> Routed:
        """``acomplete``, with the answer's text passed to ``on_text`` as the upstream sends it where the context's
        N is 1 (``Routed.streamed``): one completion, nothing to wait for. With N > 1 nothing goes to
        ``on_text``: the answer is known once the vote is decided (a majority vote stops drawing then) or the
        completions are scored, and is returned as ``acomplete`` returns it.
        """
        ctx = context if isinstance(context, PolicyContext) else self.resolve(context)
        if ctx.n != 1:
            return await self.acomplete(query, ctx, options, system=system, history=history)
        ctx, rendered, options = await self._prepare(query, ctx, options, system, history)
        completion = await self.client_for(ctx).stream(rendered, 0, options, on_text)
        routed = self._vote(ctx, query, [completion]) if self._extract is not None else \
            await self._best(ctx, query, [completion])
        routed.streamed = True
        return routed

    async def _prepare(self, query: str, context: PolicyContext | ContextRef, options: RequestOptions | None,
                       system: str | None, history: Sequence[tuple[str, str]]
                       ) -> tuple[PolicyContext, str | list[dict[str, str]], RequestOptions | None]:
        """The resolved context, the rendered prompt and the options as sent (stop sequences only at N = 1)."""
        if not isinstance(query, str):
            raise TypeError(f"query must be a string, got {type(query).__name__}")
        ctx = context if isinstance(context, PolicyContext) else self.resolve(context)
        if self._client is None or self._loop is not asyncio.get_running_loop():
            await self.start()
        assert self._client is not None
        if options is not None and options.stop and not self.sends_stop(ctx, options.stop):
            options = dataclasses.replace(options, stop=())
        return ctx, self.render(ctx, query, system, history), options

    def sends_stop(self, ctx: PolicyContext, stop: Sequence[str]) -> bool:
        """Whether a caller's ``stop`` sequences go upstream in context ``ctx``: only where its N is 1 (a vote or
        scores over cut completions could differ from those the policy was learned with; the returned text is
        cut either way) and where they fit beside the spec's own (``upstream_stop``)."""
        return bool(stop) and ctx.n == 1 and upstream_stop(self.spec.sampling.stop, tuple(stop)) is not None

    def render(self, ctx: PolicyContext, query: str, system: str | None = None,
               history: Sequence[tuple[str, str]] = ()) -> str | list[dict[str, str]]:
        """The prompt sent upstream for ``query`` in context ``ctx``: its template around the query, and a chat's
        system text and earlier turns as ``rules`` say (docs/deploy.md, "Chat front-ends"):

        * system ``as-context``: the system text, a blank line, then the query, in the template's ``{query}``;
        * system ``append``: chat API: after the text of the policy's last leading system message (a blank
          line between), or as a system message first when the policy has none; completions API: before the
          rendered prompt, a blank line between;
        * history ``keep``: chat API: the earlier turns as messages right before the policy's last message (its
          templated user turn); completions API: one line ``User: ...`` / ``Assistant: ...`` per turn, then a
          blank line, before the rendered prompt (after an appended system text).

        A system text or history the rules refuse raises ``ValueError``.
        """
        mode = self.rules.system_message
        if system is not None and mode == "refuse":
            raise ValueError("a system message is refused by this router's rules (system_message = 'refuse')")
        if history and self.rules.history == "refuse":
            raise ValueError("earlier turns are refused by this router's rules (history = 'refuse')")
        if system is not None and mode == "as-context":
            query = f"{system}\n\n{query}"
        rendered = self._prompts[ctx.prompt].render(query)
        appended = system if system is not None and mode == "append" else None
        if isinstance(rendered, str):
            head = [] if appended is None else [appended]
            if history:
                head.append("\n".join(f"{TURN_LABELS.get(role, role)}: {text}" for role, text in history))
            return "\n\n".join([*head, rendered])
        lead = next((i for i, m in enumerate(rendered) if m["role"] != "system"), len(rendered))
        if appended is not None:
            if lead:
                last = rendered[lead - 1]
                rendered[lead - 1] = {**last, "content": last["content"] + "\n\n" + appended}
            else:
                rendered.insert(0, {"role": "system", "content": appended})
                lead = 1
        if history:
            at = max(lead, len(rendered) - 1)
            rendered[at:at] = [{"role": role, "content": text} for role, text in history]
        return rendered

    def complete(self, query: str, context: PolicyContext | ContextRef = None,
                 options: RequestOptions | None = None, *, system: str | None = None,
                 history: Sequence[tuple[str, str]] = ()) -> Routed:
        """The blocking twin of ``acomplete`` (its own event loop on a background thread)."""
        if self._runner is None:
            if self._client is not None:
                raise RuntimeError("this Router is in use by an event loop: await acomplete() there")
            self._runner = LoopThread()
        return self._runner.run(self.acomplete(query, context, options, system=system, history=history))

    def _answer(self, text: str) -> str | None:
        """The bucket of a completion: its extracted answer stripped, None for no answer."""
        assert self._extract is not None
        a = self._extract(text)
        return a.strip() or None if a is not None else None

    async def _vote_in_waves(self, ctx: PolicyContext, query: str, rendered: Any,
                             options: RequestOptions | None = None) -> Routed:
        """Draw the context's N completions in waves and stop once no remaining one can change the winner, or once
        the context's stopping rule stops (``rule_wave``): each wave is the fewest completions after which either
        could stop, so the draws end at the first completion where one does.

        With ``early_stop`` off and no rule, all N in one wave. Every wave gets the same ``options`` (max_tokens bound,
        seed, spend tally: ``usage`` adds up over the waves). Where the upstream takes one request per
        completion, completion i is sample index i with its own seed in either case, so the completions
        drawn are the first ones of the full N and the vote gives the same answer; where it honours ``n``,
        a wave is one request seeded by its first index, so its completions are other independent draws
        and the answer has the distribution of the vote of all N.
        """
        client = self.client_for(ctx)
        rule = self._stopping_rule(ctx)
        completions: list[Completion] = []
        answers: list[str | None] = []
        while True:
            counts: dict[str | None, int] = {}
            for a in answers:
                counts[a] = counts.get(a, 0) + 1
            votes = np.fromiter(counts.values(), dtype=np.int64, count=len(counts))
            wave = ctx.n - len(completions)
            if self.early_stop:
                wave = min(wave, votes_to_decide(votes, ctx.n))
            if rule is not None:
                wave = min(wave, rule_wave(rule, votes, ctx.n - len(completions), self.policy.n_max))
            if wave == 0:
                break
            drawn = await client.complete(rendered, list(range(len(completions), len(completions) + wave)), options)
            completions += drawn
            answers += [self._answer(c.text) for c in drawn]
        return self._vote(ctx, query, completions, answers)

    def _vote(self, ctx: PolicyContext, query: str, completions: list[Completion],
              answers: list[str | None] | None = None) -> Routed:
        """The majority vote of ``completions`` (``answers``: their buckets, when already extracted)."""
        if answers is None:
            answers = [self._answer(c.text) for c in completions]
        counts: dict[str | None, int] = {}
        for a in answers:
            counts[a] = counts.get(a, 0) + 1
        top = max(counts.values())
        tied = [a for a, v in counts.items() if v == top]
        if len(tied) == 1:
            winner = tied[0]
        else:
            rng = derive_rng(self.seed, TIE_KEY, ctx.name, ctx.prompt, query, *(c.text for c in completions))
            winner = tied[int(rng.integers(len(tied)))]
        chosen = answers.index(winner)
        return Routed(completions[chosen].text, completions[chosen].finish, chosen, ctx, ctx.prompt, completions,
                      answers=answers, votes=list(counts.items()), tied=tied)

    async def _best_in_waves(self, ctx: PolicyContext, query: str, rendered: Any,
                             options: RequestOptions | None) -> Routed:
        """Best-of-N under a threshold rule: waves of ``bon_wave`` completions (at most the N left), each scored,
        until one reaches the context's tau (the rule's stop) or N are drawn; the first best of those drawn is
        returned (at a stop with waves of 1, the stopping completion: those before it are below tau)."""
        assert ctx.rule is not None and ctx.rule.tau is not None
        client = self.client_for(ctx)
        completions: list[Completion] = []
        raw: list[dict[str, float]] = []
        while len(completions) < ctx.n:
            first = len(completions)
            drawn = await client.complete(rendered, list(range(first, min(ctx.n, first + self.bon_wave))), options)
            completions += drawn
            raw += await self._score_all(query, drawn)
            if (self._weigh(ctx, raw)[first:] >= ctx.rule.tau).any():
                break
        return self._pick(ctx, completions, raw)

    async def _score_all(self, query: str, completions: list[Completion]) -> list[dict[str, float]]:
        """The scorer's objective scores of each completion."""
        score = self._score
        assert score is not None
        raw = await gather_all(*(score(c.text, query) for c in completions))
        names = self.policy.objectives
        missing = [n for n in names if n not in raw[0]]
        if missing:
            raise ValueError(f"the scorer gave objectives {sorted(raw[0])}, the policy needs {list(names)}")
        return list(raw)

    def _weigh(self, ctx: PolicyContext, raw: list[dict[str, float]]) -> np.ndarray:
        """Each completion's utility under the context: its scores rounded to the scorer's grid, as in the tables,
        times the context's objective weights."""
        vectors = np.array([[s[n] for n in self.policy.objectives] for s in raw], dtype=np.float64)
        if self._grid is not None:
            vectors = np.round(vectors / self._grid) * self._grid
        weighted: np.ndarray = vectors @ np.asarray(ctx.objective_weights, dtype=np.float64)
        return weighted

    async def _best(self, ctx: PolicyContext, query: str, completions: list[Completion]) -> Routed:
        return self._pick(ctx, completions, await self._score_all(query, completions))

    def _pick(self, ctx: PolicyContext, completions: list[Completion], raw: list[dict[str, float]]) -> Routed:
        """The first completion of the best utility among ``completions`` (scored ``raw``)."""
        weighted = self._weigh(ctx, raw)
        chosen = int(np.argmax(weighted))
        return Routed(completions[chosen].text, completions[chosen].finish, chosen, ctx, ctx.prompt, completions,
                      scores=[float(w) for w in weighted], objective_scores=raw)


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(a, b, strict=True))
