"""``iapo-gym serve``: a ``Router`` behind an OpenAI-compatible HTTP API (a Starlette app on uvicorn).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON bodies only; ``stream`` in
the OpenAI chunk format), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` (HEAD too). A request
names its context by ``iapo_context`` in the body (the official client's ``extra_body``) or by the
model ``iapo/<context>``; a context is a name or a JSON list of weights. Caller parameters are
honoured within what the policy was learned with or refused (``iapo_gym.deploy.params``).

This module is the request logic (``ServeApp``); the HTTP layer (the Host allow-list, single headers,
CORS, the body's time, errors of the routing, the access log's thread) is ``iapo_gym.deploy.app``, the
connection's bounds ``iapo_gym.deploy.connections``, a streamed answer's events ``iapo_gym.deploy.stream``,
what ``/health`` knows of the upstream ``iapo_gym.deploy.health``.

Each request is bounded (``ServeLimits``: body size, prompt length, a deadline over all N completions,
one retry of an upstream call, a slot among ``max_concurrency`` with a bounded queue) and charged to
the serving budget (``iapo_gym.llm.budget.Budget``: requests, tokens, money per sliding window, shared by the
deployment's processes through its store). Errors have the
OpenAI shape ``{"error": {"message", "type", "param", "code"}}`` with the project's own codes; the
upstream's messages go only to the server's log (stderr), secrets masked (``iapo_gym.deploy.errors``).
Each request adds one JSON line to the access log (time, path, status, latency, context, N, completions
drawn, tokens, error code) before its answer is complete; keys and bodies are never logged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hmac
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, TextIO

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from iapo_gym.deploy.app import JSON, AccessLog, answered_hosts, error_response, host_refusal, read_body, starlette_app
from iapo_gym.deploy.errors import Masker, error_body, upstream_error
from iapo_gym.deploy.feedback import answer_feedback, outcome_row, unit_costs
from iapo_gym.deploy.health import PROBE_EVERY, PROBE_TIMEOUT, UpstreamWatch
from iapo_gym.deploy.limits import ServeLimits, check_priced
from iapo_gym.deploy.metrics import CONTENT_TYPE as METRICS_TYPE
from iapo_gym.deploy.metrics import ServeMetrics
from iapo_gym.deploy.params import MODEL_PREFIX, Plan, RequestError, read_request, stop_note
from iapo_gym.deploy.router import ContextError, EndpointError, Routed, Router
from iapo_gym.deploy.stream import EventStream, cut
from iapo_gym.llm.budget import EXPIRY_MARGIN, Budget, RateLimited, Reservation, Spend
from iapo_gym.llm.client import OVERSHOOT_TOKENS, ClientOptions, RequestOptions, SpendingCap, Usage
from iapo_gym.llm.prices import prompt_token_bound
from iapo_gym.llm.retry import RetryPolicy
from iapo_gym.llm.spec import Endpoint
from iapo_gym.outcome_log import OutcomeLog, new_response_id

if TYPE_CHECKING:
    from iapo_gym.deploy.learn import Choice, ServeLearner, Shadow
    from iapo_gym.deploy.swap import PolicySwap

# PROBE_EVERY and PROBE_TIMEOUT: /health's probe of the upstream (iapo_gym.deploy.health), named here too
__all__ = ["AccessLog", "MODEL_PREFIX", "PROBE_EVERY", "PROBE_TIMEOUT", "ServeApp", "create_app", "run_server",
           "serve"]

COMPLETION_PATHS = {"/v1/chat/completions": True, "/v1/completions": False}
SSE = "text/event-stream; charset=utf-8"


class ServeApp:
    """The ASGI app serving a ``Router`` (module docstring): the request logic behind Starlette's routes."""

    def __init__(self, router: Router, *, api_key: str | None = None, access_log: TextIO | None = None,
                 limits: ServeLimits | None = None, budget: Budget | None = None,
                 log: TextIO | None = None, host: str = "127.0.0.1", outcomes: OutcomeLog | None = None,
                 log_queries: bool = False, learner: ServeLearner | None = None,
                 shadow: Shadow | None = None) -> None:
        """``api_key``: the inbound key, if any; ``log``: where upstream failures are described (stderr);
        ``host``: the address the server is bound to (a Host header naming it is answered); ``outcomes``: the
        outcome log each answered request goes to (``serve --log``), with its query text when ``log_queries``;
        ``learner``: chooses each request's arm and learns from its outcome (``serve --learn``); ``shadow``: the
        candidate policy whose arm each request is logged with (``serve --shadow``; ``iapo_gym.deploy.learn``)."""
        self.router = router
        self.learner, self.shadow = learner, shadow
        self.outcomes, self.log_queries = outcomes, log_queries
        self.swap: PolicySwap | None = None  # SIGHUP and POST /admin/policy (iapo_gym.deploy.swap.install)
        self.limits = limits or ServeLimits()
        self.budget = budget if budget is not None else Budget()
        self.metrics = ServeMetrics([c.name for c in router.contexts], [p.id for p in router.policy.prompts],
                                    lambda: self.active, lambda: self.waiting)  # GET /metrics
        self.access = AccessLog(access_log, self.metrics.observe)
        if learner is not None:
            self.metrics.learning(lambda: learner.chosen, lambda: learner.explored)
        self.log = log if log is not None else sys.stderr
        self.expected = api_key.encode() if api_key else None
        spec = router.spec
        reward = spec.reward_route()
        self.mask = Masker([api_key, *(route.key() for route in spec.llm_routes()), reward.key() if reward else None])
        self.sampling = spec.sampling.as_dict()
        # the most retries one upstream call can make: each endpoint's own, capped by upstream_retries
        self.retries = max(RetryPolicy.of(e, self.limits.upstream_retries).max_retries for e in spec.endpoints)
        # each arm's endpoint (its prices): a policy prompt that is no arm of a one-endpoint spec goes to that one
        self._arm_endpoint = {p.id: spec.endpoint_of(p) for p in spec.prompts}
        self._budget_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="iapo-gym-budget")
        if self.budget:
            check_priced(self.budget.rates, spec)
        self.check_router(router)
        self.upstream = UpstreamWatch(self.limits.stall_after)
        self.hosts = answered_hosts(host, self.limits.allowed_hosts)
        self.slots = asyncio.Semaphore(self.limits.max_concurrency)
        self.active = 0
        self.waiting = 0
        self.served = 0
        self.use_router(router)
        self.asgi = starlette_app([
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/health", self.health_route, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
            Route("/v1/feedback", self.feedback, methods=["POST"]),
        ], lifespan=self.lifespan, host_refused=self._host_refused, cors_origins=self.limits.cors_origins,
            preflight=lambda path: path in COMPLETION_PATHS or path.startswith("/v1/models"),
            body_limit=min(self.limits.body_timeout, self.limits.deadline))

    def client_options(self) -> ClientOptions:
        """The upstream clients of a server: no lifetime cap (the budget is a rate), at most ``upstream_retries``
        per call (each endpoint keeps its own backoff and lower max_retries), room for every slot's N calls at
        once (one slow request holds only its own slot), requests sent directly."""
        n_max = max(c.n for c in self.router.contexts)
        concurrency = max(e.concurrency for e in self.router.spec.endpoints)
        return ClientOptions(cap=SpendingCap(None, None), max_retries=self.limits.upstream_retries,
                             concurrency=max(concurrency, self.limits.max_concurrency * n_max), direct=True)

    def _endpoint(self, ctx: Any) -> Endpoint:
        return self._arm_endpoint.get(ctx.prompt, self.router.spec.endpoints[0])

    def _worst(self, ctx: Any, max_tokens: int | None, rendered: Any) -> Spend:
        """A request's worst case for the budget: N completions, each call tried 1 + ``retries`` times (so at
        most N x (1 + retries) upstream requests), each attempt at most ``max_tokens`` + ``OVERSHOOT_TOKENS``
        completion tokens per completion and the rendered prompt's token bound (``prices.prompt_token_bound``),
        at the arm's endpoint's prices (``Endpoint.price``) when it has them."""
        attempts = ctx.n * (1 + self.retries)
        completion = attempts * ((max_tokens or int(self.sampling["max_tokens"])) + OVERSHOOT_TOKENS)
        prompt = attempts * prompt_token_bound(rendered)
        endpoint = self._endpoint(ctx)
        cost = float(endpoint.price(prompt, completion)) if endpoint.priced else 0.0
        return Spend(requests=1, upstream=attempts, tokens=prompt + completion, cost=cost)

    def _used(self, ctx: Any, usage: Usage) -> Spend:
        """What a request spent: its upstream attempts, prompt and completion tokens, and their money."""
        endpoint = self._endpoint(ctx)
        cost = float(endpoint.price(usage.prompt_tokens, usage.tokens)) if endpoint.priced else 0.0
        return Spend(requests=1, upstream=usage.requests, tokens=usage.prompt_tokens + usage.tokens, cost=cost)

    async def _in_budget_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the budget's own thread (a store transaction may wait for another process's)."""
        return await asyncio.get_running_loop().run_in_executor(self._budget_pool, fn, *args)

    async def _admit(self, ctx: Any, plan: Plan, rendered: Any) -> Reservation | None:
        """Reserve the request's worst case in the serving budget until its deadline (plus ``EXPIRY_MARGIN``), or
        raise 429 (with ``Retry-After`` when waiting helps) or 503 when the budget's store does not answer."""
        if not self.budget:
            return None
        worst = self._worst(ctx, plan.max_tokens, rendered)
        try:
            return await self._in_budget_thread(self.budget.admit, worst, self.limits.deadline + EXPIRY_MARGIN)
        except RateLimited as exc:
            if math.isinf(exc.retry_after):  # a total spent, or a request larger than a limit: waiting won't help
                raise RequestError(429, str(exc), "rate_limited") from None
            raise RequestError(429, str(exc), "rate_limited",
                               headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))}) from None
        except Exception as exc:
            print(f"iapo-gym serve: budget_unavailable: {type(exc).__name__}: {self.mask(str(exc))}", file=self.log,
                  flush=True)
            raise RequestError(503, "the serving budget's store does not answer; try again shortly",
                               "budget_unavailable", headers={"Retry-After": "1"}) from None

    async def _settle(self, reservation: Reservation | None, ctx: Any, usage: Usage) -> None:
        """Replace the reservation by what the request spent (finished even if the request is cancelled meanwhile;
        a store that fails leaves the reservation to expire at its whole worst case)."""
        if reservation is None:
            return
        try:
            await asyncio.shield(self._in_budget_thread(self.budget.settle, reservation, self._used(ctx, usage)))
        except Exception as exc:
            print(f"iapo-gym serve: budget_unavailable: {type(exc).__name__}: {self.mask(str(exc))}", file=self.log,
                  flush=True)

    def check_router(self, router: Router) -> None:
        """Raise ValueError when a context of ``router``'s policy could never be admitted: the smallest request of
        each context (an empty query) must fit every limit of the serving budget (at start and at a policy swap)."""
        if not self.budget:
            return
        for c in router.contexts:
            self.budget.check(self._worst(c, None, router.render(c, "")),
                              f"the worst case of the smallest request in context {c.name!r}: N x (max_tokens + "
                              f"{OVERSHOOT_TOKENS}) completion tokens plus N x the template's prompt tokens, "
                              f"x {1 + self.retries} attempts")

    def use_router(self, router: Router) -> None:
        """Serve ``router`` (checked by ``check_router``) from now on: it, its contexts as models, its prompts' unit
        costs and metric labels are replaced in one step with no await between them, so each request sees one
        policy (a request takes ``self.router`` once, and one in flight finishes on the policy it started with)."""
        models = [{"id": MODEL_PREFIX + c.name, "object": "model", "created": 0, "owned_by": "iapo-gym",
                   "iapo": {"prompt": c.prompt, "n": c.n, "objective_weights": list(c.objective_weights),
                            "cost_weight": c.cost_weight, **({"rule": c.rule.to_dict()} if c.rule else {})}}
                  for c in router.contexts]
        body = json.dumps({"object": "list", "data": models}).encode()
        costs = unit_costs(router.policy)
        if self.learner is not None and self.learner.policy is not router.policy:
            self.learner.use_policy(router.policy)  # a swapped policy: its arms, warm-started from its estimates
        self.metrics.contexts = self.metrics.contexts | {c.name for c in router.contexts}  # earlier names stay
        self.metrics.prompts = self.metrics.prompts | {p.id for p in router.policy.prompts}
        self.router, self.models, self._models_body, self._unit_costs = router, models, body, costs

    # ---- the app -------------------------------------------------------------------------------------
    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI entry point (the Starlette app of ``iapo_gym.deploy.app.starlette_app``)."""
        await self.asgi(scope, receive, send)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: object) -> AsyncIterator[None]:
        """The upstream client opens at startup and closes at shutdown; the access log's queue is written out."""
        try:
            await self.router.start(self.client_options())
        except Exception as exc:  # reported to the server, which stops: the message only, secrets masked
            raise RuntimeError(self.mask(str(exc))) from None
        if self.swap is not None:
            self.swap.listen()
        try:
            yield
        finally:
            if self.swap is not None:
                await self.swap.close()
            await self.router.aclose()
            self.access.close()
            if self.outcomes is not None:
                self.outcomes.close()

    def _host_refused(self, headers: dict[bytes, bytes], count: int) -> RequestError | None:
        """None when the one Host header names an allowed host, else the refusal (``app.host_refusal``)."""
        return host_refusal(self.hosts, headers, count)

    def _authorized(self, headers: Mapping[str, str]) -> bool:
        if self.expected is None:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self.expected)

    @staticmethod
    def _unauthorized() -> RequestError:
        return RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key this "
                                 "server was started with (--api-key-env)", "invalid_api_key")

    async def list_models(self, request: Request) -> Response:
        """``GET /v1/models``: the contexts as models (the inbound key needed)."""
        if not self._authorized(request.headers):
            raise self._unauthorized()
        return Response(self._models_body, media_type=JSON)

    async def get_model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: one context as a model, or 404 ``model_not_found``."""
        if not self._authorized(request.headers):
            raise self._unauthorized()
        model = request.path_params["model"]
        found = [m for m in self.models if m["id"] == model]
        if not found:
            raise RequestError(404, f"the model {model!r} does not exist here; GET /v1/models lists them",
                               "model_not_found", "model")
        return Response(json.dumps(found[0]).encode(), media_type=JSON)

    async def metrics_route(self, request: Request) -> Response:
        """``GET /metrics``: the Prometheus metrics of this process (``iapo_gym.deploy.metrics``; the inbound key
        needed)."""
        if not self._authorized(request.headers):
            raise self._unauthorized()
        return Response(self.metrics.exposition(), media_type=METRICS_TYPE)

    async def health_route(self, request: Request) -> Response:
        """``GET /health`` (``health``)."""
        status, body = await self.health(request.headers)
        return Response(body, status, media_type=JSON)

    async def _body(self, request: Request) -> bytes:
        """The request body, refused with 413 past ``max_body_bytes`` (``app.read_body``)."""
        return await read_body(request, self.limits.max_body_bytes)

    # ---- completions ---------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions`` (``completion``)."""
        return await self.completion(request, True)

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions`` (``completion``)."""
        return await self.completion(request, False)

    async def completion(self, request: Request, chat: bool) -> Response:
        """One completion request: checks, a slot, the budget, the routed answer under the deadline.

        The work runs as its own task; the answer is a stream (``StreamingResponse``) from the first text it
        streams, else the whole answer, or an error status when it failed before any text went out. The access
        record is written (on the log's thread) before the answer's last byte leaves.
        """
        start = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.limits.deadline
        record: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "method": "POST",
                                  "path": request.scope["path"]}
        out = EventStream(chat, self.upstream)
        work = asyncio.ensure_future(self._answer(request, chat, deadline, out))
        work.add_done_callback(out.done)
        try:
            await out.decided  # the first text, or the work's end
        except BaseException:  # the server cancels the request (shutdown): so is its work
            work.cancel()
            raise
        if not work.done():  # text is going out while the upstream still sends
            return StreamingResponse(self._relay(work, out, record, start), media_type=SSE,
                                     headers={"cache-control": "no-cache"})
        try:
            routed, plan = work.result()
        except RequestError as exc:
            record["error"] = exc.code
            await self._log(record, exc.status, start)
            return error_response(exc)
        except (ClientDisconnect, asyncio.CancelledError):  # the caller went away: nothing to answer
            record["error"] = "client_disconnected"
            await self._log(record, 499, start)
            return Response(status_code=499)
        if plan.stream:  # decided before any text went out (N > 1): the whole stream at once
            return StreamingResponse(self._relay(work, out, record, start), media_type=SSE,
                                     headers={"cache-control": "no-cache"})
        self._served(record, routed)
        await self._log(record, 200, start)
        answer = self._response(routed, plan, chat)
        self._outcome(answer["id"], routed, plan)
        return Response(json.dumps(answer).encode(), media_type=JSON)

    def _outcome(self, rid: str, routed: Routed, plan: Plan) -> None:
        """Queue the outcome log's row of an answered request (``serve --log``; committed on the log's thread);
        with ``--learn``, the learner learns from it first."""
        if self.learner is not None:
            self.learner.observe(rid, routed)
        if self.outcomes is None:
            return
        ctx = routed.context
        endpoint = self._endpoint(ctx)
        cost = float(endpoint.price(routed.prompt_tokens, routed.completion_tokens)) if endpoint.priced else None
        self.outcomes.record(outcome_row(rid, routed, plan.query if self.log_queries else None,
                                         objectives=tuple(self.router.policy.objectives), cost=cost,
                                         unit_cost=self._unit_costs.get(routed.prompt_id),
                                         propensity=float(getattr(routed, "propensity", 1.0))))

    async def feedback(self, request: Request) -> Response:
        """``POST /v1/feedback``: a caller's reward for an answered request, joined to its outcome log row
        (``iapo_gym.deploy.feedback``; the inbound key needed, JSON only, the body limit)."""
        if not self._authorized(request.headers):
            raise self._unauthorized()
        content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != JSON:
            raise RequestError(415, "the request body must be JSON sent with 'Content-Type: application/json'",
                               "unsupported_media_type")
        raw = await self._body(request)
        body = await answer_feedback(self.outcomes, raw, tuple(self.router.policy.objectives))
        if self.learner is not None:  # recorded: a majority vote learning from feedback learns from it
            self.learner.feedback(body["id"], body["reward"])
        return Response(json.dumps(body).encode(), media_type=JSON)

    async def _log(self, record: dict[str, Any], status: int, start: float) -> None:
        record["status"] = status
        record["latency_ms"] = round((time.perf_counter() - start) * 1000.0, 3)
        await self.access.write(record)

    def _served(self, record: dict[str, Any], routed: Routed) -> None:
        self.served += 1
        record.update(context=routed.context.name, prompt=routed.prompt_id, n=routed.context.n, drawn=routed.n,
                      prompt_tokens=routed.prompt_tokens, completion_tokens=routed.completion_tokens)

    async def _relay(self, work: asyncio.Future[tuple[Routed, Plan]], out: EventStream, record: dict[str, Any],
                     start: float) -> AsyncIterator[bytes]:
        """A streamed answer's events: the text as it comes, then its end (or the error event); a caller gone
        mid-stream cancels the work (the upstream call with it) and is logged as 499."""
        logged = False
        try:
            async for event in out.events():
                yield event
            try:
                routed, plan = work.result()
            except RequestError as exc:  # the caller has part of the answer: the error is the stream's last event
                record["error"], logged = exc.code, True
                await self._log(record, 200, start)
                yield out.error(error_body(exc))
                return
            except (ClientDisconnect, asyncio.CancelledError):
                return
            self._served(record, routed)
            self._outcome(out.head["id"], routed, plan)
            if out.first is not None:
                record["first_text_ms"] = round((out.first - start) * 1000.0, 3)
            logged = True
            await self._log(record, 200, start)
            for event in out.finish(routed, *self._answer_text(routed, plan),
                                    self._usage(routed) if plan.include_usage else None):
                yield event
        finally:
            if not work.done():
                work.cancel()
            if not logged:  # the caller went away (no waiting here: the response may be cancelled)
                record.update(error="client_disconnected", status=499,
                              latency_ms=round((time.perf_counter() - start) * 1000.0, 3))
                self.access.submit(record)

    async def _answer(self, request: Request, chat: bool, deadline: float,
                      out: EventStream) -> tuple[Routed, Plan]:
        """The checks, then the routed answer (streamed to ``out`` as it comes when the caller asked for a stream)."""
        router = self.router  # the policy this request is answered by, to its end (a swap may replace self.router)
        headers = request.headers
        if not self._authorized(headers):
            raise self._unauthorized()
        content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != JSON:
            raise RequestError(415, "the request body must be JSON sent with 'Content-Type: application/json'",
                               "unsupported_media_type")
        raw = await self._body(request)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            reason = str(exc)[:200] if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
            raise RequestError(400, f"the request body is not valid JSON ({reason})", "invalid_json") from None
        plan = read_request(body, chat, self.sampling, router.rules)
        try:
            ctx = router.resolve(plan.context)
            if plan.model_context is not None and router.resolve(plan.model_context) != ctx:
                raise RequestError(400, f"iapo_context and the model {body.get('model')!r} name different contexts",
                                   "invalid_context", "iapo_context")
        except ContextError as exc:
            raise RequestError(400, str(exc), "unknown_context", "model", {"contexts": exc.contexts}) from None
        choice = self.learner.choose(ctx) if self.learner is not None else None
        if choice is not None:  # serve --learn: the context's greedy arm, or an explored one
            ctx = choice.context
        if plan.stop:
            plan.changed["stop"] = stop_note(router.sends_stop(ctx, plan.stop))
        if plan.stream:
            out.open(MODEL_PREFIX + ctx.name, plan.stop)
        # everything sent counts: the policy's template, the query, an accepted system text and earlier turns
        rendered = router.render(ctx, plan.query, plan.system, plan.history)
        length = len(rendered) if isinstance(rendered, str) else sum(len(m["content"]) for m in rendered)
        if length > self.limits.max_prompt_chars:
            raise RequestError(400, f"the prompt is {length} characters with the policy's template, more than this "
                                    f"server's limit of {self.limits.max_prompt_chars}", "prompt_too_long",
                               "messages" if chat else "prompt")
        if self.active >= self.limits.max_concurrency and self.waiting >= self.limits.max_queue:
            raise RequestError(503, "the server is at capacity; try again shortly", "overloaded",
                               headers={"Retry-After": "1"})
        reservation = await self._admit(ctx, plan, rendered)
        usage = Usage()
        try:
            routed = await self._run(ctx, plan, request.receive, deadline, usage, out, router)
        finally:
            await self._settle(reservation, ctx, usage)
        return self._mark(routed, choice), plan

    def _mark(self, routed: Routed, choice: Choice | None) -> Routed:
        """The routed answer with its arm's propensity and, with ``--learn`` / ``--shadow``, how the arm was chosen
        and the candidate's arm (for the outcome log and the response's ``iapo.learn``)."""
        learn: dict[str, Any] = {}
        if choice is not None:
            routed.propensity = choice.propensity
            learn.update(choice.to_dict())
        if self.shadow is not None:
            learn["shadow"] = self.shadow.arm(routed.context)
        if learn:
            routed.learn = learn
        return routed

    async def _run(self, ctx: Any, plan: Plan, receive: Callable[[], Any], deadline: float, usage: Usage,
                   out: EventStream | None = None, router: Router | None = None) -> Routed:
        """The routed answer in a slot, before the deadline, cancelled if the caller goes away; with ``plan.stream``
        its text goes to ``out`` as the upstream sends it where the context's N is 1 (``Router.astream``);
        ``router``: the one the request was resolved by (default: the one serving now)."""
        router = router or self.router
        loop = asyncio.get_running_loop()
        timeout = RequestError(504, f"the answer took longer than this server's deadline of {self.limits.deadline:g} s",
                               "deadline_exceeded")
        if self.slots.locked():
            self.waiting += 1
            try:
                await asyncio.wait_for(self.slots.acquire(), deadline - loop.time())
            except asyncio.TimeoutError:
                raise timeout from None
            finally:
                self.waiting -= 1
        else:
            await self.slots.acquire()
        self.active += 1
        waiting = self.upstream.begin()
        options = RequestOptions(max_tokens=plan.max_tokens, seed=plan.seed, usage=usage,
                                 sampling=tuple(plan.sampling.items()), stop=plan.stop)
        if plan.stream and out is not None:
            call = router.astream(plan.query, ctx, options, out.text, system=plan.system, history=plan.history)
        else:
            call = router.acomplete(plan.query, ctx, options, system=plan.system, history=plan.history)
        work = asyncio.ensure_future(call)
        watch = asyncio.ensure_future(receive())
        try:
            while True:
                done, _ = await asyncio.wait((work, watch), timeout=deadline - loop.time(),
                                             return_when=asyncio.FIRST_COMPLETED)
                if work in done:
                    break
                if watch in done and watch.result().get("type") != "http.disconnect":
                    watch = asyncio.ensure_future(receive())
                    continue
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work
                if watch in done:
                    raise ClientDisconnect
                self.upstream.failed("deadline_exceeded")
                raise timeout
            try:
                routed = work.result()
            except EndpointError as exc:
                error = upstream_error(exc)
                self.upstream.failed(error.code)
                print(f"iapo-gym serve: {error.code}: {self.mask(str(exc))}", file=self.log, flush=True)
                raise error from None
            except Exception as exc:
                print(f"iapo-gym serve: internal_error: {type(exc).__name__}: {self.mask(str(exc))}", file=self.log,
                      flush=True)
                raise RequestError(500, "the server failed to answer this request (see its log)",
                                   "internal_error") from None
            self.upstream.ok()
            return routed
        finally:
            for task in (work, watch):  # the request cancelled: so is its upstream call
                if not task.done():
                    task.cancel()
            self.upstream.end(waiting)
            self.active -= 1
            self.slots.release()

    def _answer_text(self, routed: Routed, plan: Plan) -> tuple[str, str, dict[str, Any]]:
        text, finish = routed.text, routed.finish or "stop"
        if plan.stop:
            text, was_cut = cut(text, plan.stop)
            finish = "stop" if was_cut else finish
        info = routed.info()
        if plan.changed:
            info["parameters"] = plan.changed
        return text, finish, info

    @staticmethod
    def _usage(routed: Routed) -> dict[str, int]:
        return {"prompt_tokens": routed.prompt_tokens, "completion_tokens": routed.completion_tokens,
                "total_tokens": routed.prompt_tokens + routed.completion_tokens}

    def _response(self, routed: Routed, plan: Plan, chat: bool) -> dict[str, Any]:
        text, finish, info = self._answer_text(routed, plan)
        common = {"created": int(time.time()), "model": MODEL_PREFIX + routed.context.name,
                  "usage": self._usage(routed), "iapo": info}
        if chat:
            return {"id": new_response_id("chatcmpl-"), "object": "chat.completion", **common,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": finish, "logprobs": None}]}
        return {"id": new_response_id("cmpl-"), "object": "text_completion", **common,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

    # ---- health --------------------------------------------------------------------------------------
    async def health(self, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """503 when the upstream is down or stalled, else 200.

        Each call asks the upstream (``UpstreamWatch.probe``: at most every ``PROBE_EVERY`` s, within
        ``PROBE_TIMEOUT`` s): no answer in time while no request waits for it is down, so a hung upstream
        (stopped, deadlocked) shows within the probe timeout, not after the endpoint's; while requests wait,
        a request waiting past ``stall_after`` with no answer from the upstream meanwhile is a stall. The
        spend, the counters, the worker's pid and the sha256 of the policy it serves only to a caller with the
        inbound key.
        """
        await self.upstream.probe(self.router)
        spend = self._authorized(headers)
        report = self.upstream.report()
        status = {"down": "upstream_down", "stalled": "upstream_stalled"}.get(report["state"], "ok")
        body: dict[str, Any] = {"status": status, "contexts": len(self.router.contexts),
                                "upstream": report, "in_flight": self.active, "queued": self.waiting,
                                "budget": await self._budget_report(spend)}
        if spend:
            body.update(served=self.served, spent=self.router.spent, pid=os.getpid(), policy=self.router.policy.sha256)
            if self.learner is not None:
                body["learn"] = self.learner.report()
        return (200 if status == "ok" else 503), json.dumps(body).encode()

    async def _budget_report(self, spend: bool) -> dict[str, object]:
        """The serving budget's limits and, with ``spend``, what each window holds across the deployment."""
        try:
            report: dict[str, object] = await self._in_budget_thread(self.budget.report, spend)
        except Exception as exc:  # the limits still; the spend is unknown while the store does not answer
            print(f"iapo-gym serve: budget_unavailable: {type(exc).__name__}: {self.mask(str(exc))}", file=self.log,
                  flush=True)
            return {**self.budget.report(False), "store": "unavailable"}
        return report


def create_app(router: Router, *, api_key: str | None = None, access_log: TextIO | None = None,
               limits: ServeLimits | None = None, budget: Budget | None = None,
               log: TextIO | None = None, host: str = "127.0.0.1", outcomes: OutcomeLog | None = None,
               log_queries: bool = False, learner: ServeLearner | None = None,
               shadow: Shadow | None = None) -> ServeApp:
    """The ASGI app serving ``router`` (``ServeApp``); ``api_key``: the inbound key, if any; ``host``: the address
    it is bound to (Host headers naming it are answered, besides localhost's names and ``limits.allowed_hosts``)."""
    return ServeApp(router, api_key=api_key, access_log=access_log, limits=limits, budget=budget, log=log, host=host,
                    outcomes=outcomes, log_queries=log_queries, learner=learner, shadow=shadow)


FD_RESERVE = 64  # file descriptors kept beside the connections (upstream sockets, logs, the budget store)


def _open_files(limits: ServeLimits) -> ServeLimits:
    """Raise the process's open-files limit to fit ``max_connections`` (and what else it opens); where the hard
    limit does not allow it, lower ``max_connections`` to fit, with a warning."""
    try:
        import resource
    except ImportError:  # not on this platform
        return limits
    need = limits.max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < need:
        fit = max(1, soft - FD_RESERVE)
        print(f"iapo-gym serve: warning: the open-files limit ({soft}) leaves room for {fit} connections, not "
              f"--max-connections {limits.max_connections}; serving with {fit}", file=sys.stderr, flush=True)
        return dataclasses.replace(limits, max_connections=fit)
    return limits


def run_server(app: ServeApp | str, *, host: str = "127.0.0.1", port: int = 8000, limits: ServeLimits | None = None,
               graceful_timeout: float = 30.0, workers: int = 1, parser: str = "auto") -> None:
    """Run ``app`` on uvicorn until SIGINT/SIGTERM; requests in flight then finish (up to ``graceful_timeout`` s).

    ``app``: a ``ServeApp``, or with ``workers`` > 1 the import string of a factory each worker process calls
    (uvicorn's supervisor runs them all on one listening socket; SIGHUP to it goes on to each worker,
    ``iapo_gym.deploy.swap.run_workers``). Every connection is bounded by ``limits``
    (``iapo_gym.deploy.connections``: head size and time, idle keep-alive, connections per process), whichever
    HTTP ``parser`` runs (``auto``: httptools when installed, else h11); websockets are off.
    """
    import uvicorn

    from iapo_gym.deploy.connections import protocol

    limits = _open_files(limits or ServeLimits())
    http = protocol(limits, parser)
    options: dict[str, Any] = {
        "host": host, "port": port, "log_level": "warning", "access_log": False, "lifespan": "on",
        "timeout_graceful_shutdown": max(1, math.ceil(graceful_timeout)), "http": http, "ws": "none",
        "timeout_keep_alive": limits.keep_alive_timeout, "h11_max_incomplete_event_size": limits.max_header_bytes,
        "workers": workers}
    if workers > 1:
        if not isinstance(app, str):
            raise ValueError("several workers need the app as an import string of its factory")
        from iapo_gym.deploy.swap import run_workers

        run_workers(app, options)  # uvicorn's supervisor, SIGHUP passed on to the workers (a policy swap)
    else:
        uvicorn.Server(uvicorn.Config(app, **options)).run()


def serve(router: Router, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          access_log: TextIO | None = None, graceful_timeout: float = 30.0, limits: ServeLimits | None = None,
          budget: Budget | None = None) -> None:
    """Serve ``router`` in this process (``create_app`` then ``run_server``) until SIGINT/SIGTERM."""
    app = create_app(router, api_key=api_key, access_log=access_log, limits=limits, budget=budget, host=host)
    run_server(app, host=host, port=port, limits=app.limits, graceful_timeout=graceful_timeout)
