"""``iapo-gym serve``: a ``Router`` behind an OpenAI-compatible HTTP API (a plain ASGI app on uvicorn).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON bodies only; ``stream`` in
the OpenAI chunk format), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``. A request
names its context by ``iapo_context`` in the body (the official client's ``extra_body``) or by the
model ``iapo/<context>``; a context is a name or a JSON list of weights. Caller parameters are
honoured within what the policy was learned with or refused (``iapo_gym.deploy.params``).

Each request is bounded (``ServeLimits``: body size, prompt length, a deadline over all N completions,
one retry of an upstream call, a slot among ``max_concurrency`` with a bounded queue) and charged to
the serving budget (``RateBudget``: requests, tokens, money per minute and per day). Errors have the
OpenAI shape ``{"error": {"message", "type", "param", "code"}}`` with the project's own codes; the
upstream's messages go only to the server's log (stderr), secrets masked (``iapo_gym.deploy.errors``).
Each request adds one JSON line to the access log (time, path, status, latency, context, N, completions
drawn, tokens, error code); keys and bodies are never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TextIO

from iapo_gym.deploy.errors import Masker, upstream_error
from iapo_gym.deploy.limits import RateBudget, RateLimited, ServeLimits
from iapo_gym.deploy.params import MODEL_PREFIX, Plan, RequestError, read_request
from iapo_gym.deploy.router import ContextError, EndpointError, Routed, Router
from iapo_gym.llm.client import OVERSHOOT_TOKENS, ClientOptions, RequestOptions, SpendingCap, Usage
from iapo_gym.llm.retry import RetryPolicy

__all__ = ["AccessLog", "MODEL_PREFIX", "ServeApp", "create_app", "serve"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

JSON_TYPE = b"application/json"
PROBE_TIMEOUT = 3.0  # seconds a /health probe of the upstream may take
PROBE_EVERY = 2.0  # at most one probe per this many seconds
DRAIN_FACTOR = 8  # a body up to this many times the limit is read and dropped before the 413
ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error",
               502: "upstream_error", 503: "server_error", 504: "server_error"}
COMPLETION_PATHS = {"/v1/chat/completions": True, "/v1/completions": False}


class AccessLog:
    """One JSON object per line, flushed per request; thread-safe."""

    def __init__(self, stream: TextIO | None) -> None:
        """``stream``: where lines go (None: nowhere)."""
        self.stream = stream
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        """Append one record."""
        if self.stream is None:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            self.stream.write(line)
            self.stream.flush()


def _error_body(exc: RequestError) -> bytes:
    kind = ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "server_error")
    return json.dumps({"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code,
                                 **exc.extra}}).encode()


def _cut(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first of ``stops``, and whether it was cut."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


class _Upstream:
    """The upstream's state as the server has seen it: last success, last failure (time and code)."""

    def __init__(self) -> None:
        self.last_success: float | None = None
        self.last_failure: float | None = None
        self.last_error: str | None = None
        self.last_probe = -math.inf
        self.probe_lock = asyncio.Lock()

    def ok(self) -> None:
        self.last_success = time.time()

    def failed(self, code: str) -> None:
        self.last_failure, self.last_error = time.time(), code

    @property
    def down(self) -> bool:
        """The latest news is a failure to reach it, or a refusal of the server's key."""
        return self.last_failure is not None and self.last_error in ("upstream_unavailable", "upstream_auth") and \
            (self.last_success is None or self.last_failure > self.last_success)

    def report(self) -> dict[str, Any]:
        def stamp(t: float | None) -> str | None:
            return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
        state = "down" if self.down else "up" if self.last_success is not None else "unknown"
        return {"state": state, "last_success": stamp(self.last_success), "last_failure": stamp(self.last_failure),
                "last_error": self.last_error}


class ServeApp:
    """The ASGI app serving a ``Router`` (module docstring)."""

    def __init__(self, router: Router, *, api_key: str | None = None, access_log: TextIO | None = None,
                 limits: ServeLimits | None = None, budget: RateBudget | None = None,
                 log: TextIO | None = None) -> None:
        """``api_key``: the inbound key, if any; ``log``: where upstream failures are described (stderr)."""
        self.router = router
        self.limits = limits or ServeLimits()
        self.budget = budget or RateBudget()
        self.access = AccessLog(access_log)
        self.log = log if log is not None else sys.stderr
        self.expected = api_key.encode() if api_key else None
        spec = router.spec
        reward = spec.reward_route()
        self.mask = Masker([api_key, *(route.key() for route in spec.llm_routes()), reward.key() if reward else None])
        self.sampling = spec.sampling.as_dict()
        # the most retries one upstream call can make: each endpoint's own, capped by upstream_retries
        self.retries = max(RetryPolicy.of(e, self.limits.upstream_retries).max_retries for e in spec.endpoints)
        if self.budget:
            worst = max(self._worst(c.n, None) for c in router.contexts)
            if worst > self.budget.largest():
                raise ValueError(f"the serving budget's token or cost limit is below one request's worst case "
                                 f"({worst} completion tokens: N x (max_tokens + {OVERSHOOT_TOKENS}) x "
                                 f"{1 + self.retries} attempts); raise it")
        self.upstream = _Upstream()
        self.slots = asyncio.Semaphore(self.limits.max_concurrency)
        self.active = 0
        self.waiting = 0
        self.served = 0
        self.cors = self.limits.cors_origins
        self.models = [{"id": MODEL_PREFIX + c.name, "object": "model", "created": 0, "owned_by": "iapo-gym",
                        "iapo": {"prompt": c.prompt, "n": c.n, "objective_weights": list(c.objective_weights),
                                 "cost_weight": c.cost_weight}} for c in router.contexts]
        self._models_body = json.dumps({"object": "list", "data": self.models}).encode()

    def client_options(self) -> ClientOptions:
        """The upstream clients of a server: no lifetime cap (the budget is a rate), at most ``upstream_retries``
        per call (each endpoint keeps its own backoff and lower max_retries), room for every slot's N calls at
        once (one slow request holds only its own slot), requests sent directly."""
        n_max = max(c.n for c in self.router.contexts)
        concurrency = max(e.concurrency for e in self.router.spec.endpoints)
        return ClientOptions(cap=SpendingCap(None, None), max_retries=self.limits.upstream_retries,
                             concurrency=max(concurrency, self.limits.max_concurrency * n_max), direct=True)

    def _worst(self, n: int, max_tokens: int | None) -> int:
        return n * ((max_tokens or int(self.sampling["max_tokens"])) + OVERSHOOT_TOKENS) * (1 + self.retries)

    # ---- ASGI ----------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point: HTTP requests and the lifespan (the upstream client opens and closes there)."""
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        elif scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    try:
                        await self.router.start(self.client_options())
                    except Exception as exc:  # noqa: BLE001 (reported to the server, which stops)
                        await send({"type": "lifespan.startup.failed", "message": self.mask(str(exc))})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.router.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Route one HTTP request."""
        path, method = scope["path"], scope["method"]
        headers = dict(scope["headers"])
        cors = self._cors(headers)
        chat = COMPLETION_PATHS.get(path)
        if method == "OPTIONS" and self.cors and (chat is not None or path.startswith("/v1/models")):
            await self._send(send, 204 if cors else 403, b"", cors + [
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", b"authorization, content-type"),
                (b"access-control-max-age", b"600")], content_type=None)
            return
        try:
            if chat is not None:
                if method != "POST":
                    raise RequestError(405, f"{path} takes POST, got {method}", "method_not_allowed")
                await self.completion(scope, headers, receive, send, chat, cors)
                return
            known = path in ("/health", "/v1/models") or path.startswith("/v1/models/")
            if method != "GET" and known:
                raise RequestError(405, f"{path} takes GET, got {method}", "method_not_allowed")
            if path == "/health":
                status, body = await self.health(headers)
                await self._send(send, status, body, cors)
                return
            if path == "/v1/models" or path.startswith("/v1/models/"):
                if not self._authorized(headers):
                    raise self._unauthorized()
                if path == "/v1/models":
                    await self._send(send, 200, self._models_body, cors)
                    return
                model = path[len("/v1/models/"):]
                found = [m for m in self.models if m["id"] == model]
                if not found:
                    raise RequestError(404, f"the model {model!r} does not exist here; GET /v1/models lists them",
                                       "model_not_found", "model")
                await self._send(send, 200, json.dumps(found[0]).encode(), cors)
                return
            raise RequestError(404, f"{path} is not served: the endpoints are /v1/chat/completions, "
                                    "/v1/completions, /v1/models and /health", "not_found")
        except RequestError as exc:
            await self._send(send, exc.status, _error_body(exc), cors, exc.headers)

    def _cors(self, headers: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        if not self.cors:
            return []
        origin = headers.get(b"origin")
        if origin is None:
            return []
        if "*" in self.cors:
            return [(b"access-control-allow-origin", b"*")]
        if origin.decode("latin-1") in self.cors:
            return [(b"access-control-allow-origin", origin), (b"vary", b"origin")]
        return []

    async def _send(self, send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]],
                    headers: dict[str, str] | None = None, content_type: bytes | None = JSON_TYPE) -> None:
        out = [(b"content-length", str(len(body)).encode()), *extra]
        if content_type is not None:
            out.append((b"content-type", content_type))
        for k, v in (headers or {}).items():
            out.append((k.lower().encode(), v.encode()))
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if self.expected is None:
            return True
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)

    @staticmethod
    def _unauthorized() -> RequestError:
        return RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key this "
                                 "server was started with (--api-key-env)", "invalid_api_key")

    async def _body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes:
        """The request body, refused with 413 past ``max_body_bytes``.

        A body declared (``Content-Length``) or found larger is read on and dropped, never kept, up to
        ``DRAIN_FACTOR`` times the limit, so that the caller reliably hears the 413 rather than a reset
        connection; a body declared larger still is refused at once, unread.
        """
        limit = self.limits.max_body_bytes
        too_big = RequestError(413, f"the request body is larger than this server's limit of {limit} bytes",
                               "body_too_large")
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > DRAIN_FACTOR * limit):
            raise too_big
        over = declared is not None and int(declared) > limit
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                over = True
                chunks.clear()
            if not over:
                chunks.append(chunk)
            if size > DRAIN_FACTOR * limit:
                raise too_big
            if not message.get("more_body", False):
                if over:
                    raise too_big
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # ---- completions ---------------------------------------------------------------------------------
    async def completion(self, scope: Scope, headers: dict[bytes, bytes], receive: Receive, send: Send, chat: bool,
                         cors: list[tuple[bytes, bytes]]) -> None:
        """One completion request: checks, a slot, the budget, the routed answer under the deadline."""
        start = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.limits.deadline
        record: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "method": "POST",
                                  "path": scope["path"]}

        def logged(status: int) -> None:  # the record is written before the answer leaves: it is there once read
            record["status"] = status
            record["latency_ms"] = round((time.perf_counter() - start) * 1000.0, 3)
            self.access.write(record)

        try:
            routed, plan = await self._answer(headers, receive, chat, deadline, record)
        except RequestError as exc:
            record["error"] = exc.code
            logged(exc.status)
            await self._send(send, exc.status, _error_body(exc), cors, exc.headers)
            return
        except asyncio.CancelledError:  # the caller went away: nothing to answer
            record["error"] = "client_disconnected"
            logged(499)
            return
        self.served += 1
        record.update(context=routed.context.name, prompt=routed.prompt_id, n=routed.context.n, drawn=routed.n,
                      prompt_tokens=routed.prompt_tokens, completion_tokens=routed.completion_tokens)
        if plan.stream:
            body, content_type = self._stream_body(routed, plan, chat), b"text/event-stream; charset=utf-8"
        else:
            body, content_type = json.dumps(self._response(routed, plan, chat)).encode(), JSON_TYPE
        logged(200)
        await self._send(send, 200, body, cors, {"Cache-Control": "no-cache"} if plan.stream else None,
                         content_type=content_type)

    async def _answer(self, headers: dict[bytes, bytes], receive: Receive, chat: bool, deadline: float,
                      record: dict[str, Any]) -> tuple[Routed, Plan]:
        if not self._authorized(headers):
            raise self._unauthorized()
        content_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if content_type != JSON_TYPE:
            raise RequestError(415, "the request body must be JSON sent with 'Content-Type: application/json'",
                               "unsupported_media_type")
        raw = await self._body(headers, receive)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            reason = str(exc)[:200] if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
            raise RequestError(400, f"the request body is not valid JSON ({reason})", "invalid_json") from None
        plan = read_request(body, chat, self.sampling)
        try:
            ctx = self.router.resolve(plan.context)
            if plan.model_context is not None and self.router.resolve(plan.model_context) != ctx:
                raise RequestError(400, f"iapo_context and the model {body.get('model')!r} name different contexts",
                                   "invalid_context", "iapo_context")
        except ContextError as exc:
            raise RequestError(400, str(exc), "unknown_context", "model", {"contexts": exc.contexts}) from None
        rendered = self.router.render(ctx, plan.query)
        length = len(rendered) if isinstance(rendered, str) else sum(len(m["content"]) for m in rendered)
        if length > self.limits.max_prompt_chars:
            raise RequestError(400, f"the prompt is {length} characters with the policy's template, more than this "
                                    f"server's limit of {self.limits.max_prompt_chars}", "prompt_too_long",
                               "messages" if chat else "prompt")
        if self.active >= self.limits.max_concurrency and self.waiting >= self.limits.max_queue:
            raise RequestError(503, "the server is at capacity; try again shortly", "overloaded",
                               headers={"Retry-After": "1"})
        reservation = None
        if self.budget:
            try:
                reservation = self.budget.admit(self._worst(ctx.n, plan.max_tokens))
            except RateLimited as exc:
                raise RequestError(429, str(exc), "rate_limited",
                                   headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))}) from None
        usage = Usage()
        try:
            return await self._run(ctx, plan, receive, deadline, usage), plan
        finally:
            if reservation is not None:
                self.budget.settle(reservation, usage.tokens)

    async def _run(self, ctx: Any, plan: Plan, receive: Receive, deadline: float, usage: Usage) -> Routed:
        """The routed answer in a slot, before the deadline, cancelled if the caller goes away."""
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
        work = asyncio.ensure_future(self.router.acomplete(
            plan.query, ctx, RequestOptions(max_tokens=plan.max_tokens, seed=plan.seed, usage=usage)))
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
                    raise asyncio.CancelledError
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
            if not watch.done():
                watch.cancel()
            self.active -= 1
            self.slots.release()

    def _answer_text(self, routed: Routed, plan: Plan) -> tuple[str, str, dict[str, Any]]:
        text, finish = routed.text, routed.finish or "stop"
        if plan.stop:
            text, cut = _cut(text, plan.stop)
            finish = "stop" if cut else finish
        info = routed.info()
        if plan.changed:
            info["parameters"] = plan.changed
        return text, finish, info

    def _response(self, routed: Routed, plan: Plan, chat: bool) -> dict[str, Any]:
        text, finish, info = self._answer_text(routed, plan)
        usage = {"prompt_tokens": routed.prompt_tokens, "completion_tokens": routed.completion_tokens,
                 "total_tokens": routed.prompt_tokens + routed.completion_tokens}
        common = {"created": int(time.time()), "model": MODEL_PREFIX + routed.context.name, "usage": usage,
                  "iapo": info}
        if chat:
            return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", **common,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": finish, "logprobs": None}]}
        return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", **common,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

    def _stream_body(self, routed: Routed, plan: Plan, chat: bool) -> bytes:
        """Server-sent events in the OpenAI chunk format: the answer, the final chunk, usage if asked, [DONE]."""
        text, finish, info = self._answer_text(routed, plan)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                "model": MODEL_PREFIX + routed.context.name}
        if chat:
            chunks = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                                            "finish_reason": None, "logprobs": None}]},
                      {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish, "logprobs": None}],
                       "iapo": info}]
        else:
            chunks = [{**head, "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}]},
                      {**head, "choices": [{"index": 0, "text": "", "finish_reason": finish, "logprobs": None}],
                       "iapo": info}]
        if plan.include_usage:
            chunks.append({**head, "choices": [], "usage": {
                "prompt_tokens": routed.prompt_tokens, "completion_tokens": routed.completion_tokens,
                "total_tokens": routed.prompt_tokens + routed.completion_tokens}})
        return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"

    # ---- health --------------------------------------------------------------------------------------
    async def health(self, headers: dict[bytes, bytes]) -> tuple[int, bytes]:
        """503 when the upstream is down (probed with ``GET /models`` then, at most every ``PROBE_EVERY`` s)."""
        up = self.upstream
        if up.down or up.last_success is None:
            await self._probe()
        spend = self._authorized(headers)
        body: dict[str, Any] = {"status": "upstream_down" if up.down else "ok", "contexts": len(self.router.contexts),
                                "upstream": up.report(), "in_flight": self.active, "queued": self.waiting,
                                "budget": self.budget.report(spend)}
        if spend:
            body.update(served=self.served, spent=self.router.spent)
        return (503 if up.down else 200), json.dumps(body).encode()

    async def _probe(self) -> None:
        up = self.upstream
        async with up.probe_lock:
            now = time.monotonic()
            if now - up.last_probe < PROBE_EVERY:
                return
            up.last_probe = now
            status = await self.router.probe(PROBE_TIMEOUT)
        if status is None or status >= 500:
            up.failed("upstream_unavailable")
        elif status in (401, 403):
            up.failed("upstream_auth")
        else:  # it answered (a 404 from an upstream without /models is an answer)
            up.ok()


def create_app(router: Router, *, api_key: str | None = None, access_log: TextIO | None = None,
               limits: ServeLimits | None = None, budget: RateBudget | None = None,
               log: TextIO | None = None) -> ServeApp:
    """The ASGI app serving ``router`` (``ServeApp``); ``api_key``: the inbound key, if any."""
    return ServeApp(router, api_key=api_key, access_log=access_log, limits=limits, budget=budget, log=log)


def serve(router: Router, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          access_log: TextIO | None = None, graceful_timeout: float = 30.0, limits: ServeLimits | None = None,
          budget: RateBudget | None = None) -> None:
    """Run the server until SIGINT/SIGTERM; requests in flight then finish (up to ``graceful_timeout`` s)."""
    import uvicorn

    app = create_app(router, api_key=api_key, access_log=access_log, limits=limits, budget=budget)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=max(1, math.ceil(graceful_timeout)))
    print(f"iapo-gym serve: {len(router.contexts)} contexts of task {router.policy.task!r} on http://{host}:{port}/v1 "
          f"(upstream model{'s' if len(router.spec.endpoints) > 1 else ''} "
          f"{', '.join(repr(e.model) for e in router.spec.endpoints)})", file=sys.stderr, flush=True)
    uvicorn.Server(config).run()
