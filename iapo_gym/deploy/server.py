"""``iapo-gym serve``: a ``Router`` behind an OpenAI-compatible HTTP API (a plain ASGI app on uvicorn).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON bodies only; ``stream`` in
the OpenAI chunk format), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``. A request
names its context by ``iapo_context`` in the body (the official client's ``extra_body``) or by the
model ``iapo/<context>``; a context is a name or a JSON list of weights. Caller parameters are
honoured within what the policy was learned with or refused (``iapo_gym.deploy.params``).

Each request is bounded (``ServeLimits``: body size, prompt length, a deadline over all N completions,
one retry of an upstream call, a slot among ``max_concurrency`` with a bounded queue) and charged to
the serving budget (``iapo_gym.llm.budget.Budget``: requests, tokens, money per sliding window, shared by the
deployment's processes through its store). Errors have the
OpenAI shape ``{"error": {"message", "type", "param", "code"}}`` with the project's own codes; the
upstream's messages go only to the server's log (stderr), secrets masked (``iapo_gym.deploy.errors``).
Each request adds one JSON line to the access log (time, path, status, latency, context, N, completions
drawn, tokens, error code); keys and bodies are never logged.
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
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TextIO

from iapo_gym.deploy.errors import Masker, error_body, upstream_error
from iapo_gym.deploy.limits import ServeLimits, check_priced, host_name
from iapo_gym.deploy.params import MODEL_PREFIX, Plan, RequestError, read_request, stop_note
from iapo_gym.deploy.router import ContextError, EndpointError, Routed, Router
from iapo_gym.llm.budget import EXPIRY_MARGIN, Budget, RateLimited, Reservation, Spend
from iapo_gym.llm.client import OVERSHOOT_TOKENS, ClientOptions, RequestOptions, SpendingCap, Usage
from iapo_gym.llm.prices import prompt_token_bound
from iapo_gym.llm.retry import RetryPolicy
from iapo_gym.llm.spec import Endpoint

__all__ = ["AccessLog", "MODEL_PREFIX", "ServeApp", "create_app", "run_server", "serve"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

JSON_TYPE = b"application/json"
PROBE_TIMEOUT = 3.0  # seconds a /health probe of the upstream may take
PROBE_EVERY = 2.0  # at most one probe per this many seconds
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # Host names always answered (any port)
DRAIN_FACTOR = 8  # a body up to this many times the limit is read and dropped before the 413
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


def _bracketed(host: str) -> str:
    """An address as a Host header names it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _cut(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first of ``stops``, and whether it was cut."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


class _Upstream:
    """The upstream's state as the server has seen it: last success, last failure (time and code), and the
    requests in flight (since when), so that a hang shows before any timeout: a request waiting longer than
    ``stall_after`` s while nothing came back from the upstream meanwhile is a stall."""

    def __init__(self, stall_after: float) -> None:
        """``stall_after``: seconds (``ServeLimits.stall_after``)."""
        self.stall_after = stall_after
        self.last_success: float | None = None
        self.last_failure: float | None = None
        self.last_error: str | None = None
        self.last_probe = -math.inf
        self.answered = -math.inf  # monotonic time of the last answer from the upstream (a request or a probe)
        self.probe_lock = asyncio.Lock()
        self.in_flight: dict[int, float] = {}  # request token -> monotonic start
        self._tokens = 0

    def ok(self) -> None:
        self.last_success, self.answered = time.time(), time.monotonic()

    def failed(self, code: str) -> None:
        self.last_failure, self.last_error = time.time(), code

    def begin(self) -> int:
        """A request starts waiting for the upstream; returns its token for ``end``."""
        self._tokens += 1
        self.in_flight[self._tokens] = time.monotonic()
        return self._tokens

    def end(self, token: int) -> None:
        self.in_flight.pop(token, None)

    def stalled(self) -> int:
        """Requests waiting for the upstream longer than ``stall_after`` s, when nothing came back from it in the
        last ``stall_after`` s either (0: no stall)."""
        now = time.monotonic()
        if now - self.answered <= self.stall_after:
            return 0
        return sum(1 for started in self.in_flight.values() if now - started > self.stall_after)

    @property
    def down(self) -> bool:
        """The latest news is a failure to reach it, or a refusal of the server's key."""
        return self.last_failure is not None and self.last_error in ("upstream_unavailable", "upstream_auth") and \
            (self.last_success is None or self.last_failure > self.last_success)

    def report(self) -> dict[str, Any]:
        def stamp(t: float | None) -> str | None:
            return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
        stalled = self.stalled()
        state = "down" if self.down else "stalled" if stalled else "up" if self.last_success is not None else \
            "unknown"
        return {"state": state, "last_success": stamp(self.last_success), "last_failure": stamp(self.last_failure),
                "last_error": self.last_error, "stalled_requests": stalled}


class _Stream:
    """One streamed answer: server-sent events in the OpenAI chunk format, sent as the text comes.

    The response starts with the first event, so a refusal or failure before any text is still a plain
    error status. ``text`` takes each piece the upstream sends (N = 1) and sends it as one chunk, cut
    at the caller's stop sequences (the last characters that could begin one are held back until the
    next piece); ``finish`` sends the answer when nothing was streamed (N > 1: once decided), the rest
    held back, the final chunk with ``finish_reason`` and the ``iapo`` object, usage if asked, and
    ``[DONE]``; ``error`` ends a started stream with an ``error`` event, as the OpenAI API does.
    """

    def __init__(self, send: Send, cors: list[tuple[bytes, bytes]], chat: bool, upstream: _Upstream) -> None:
        self.send, self.cors, self.chat, self.upstream = send, cors, chat, upstream
        self.head: dict[str, Any] = {}
        self.stops: tuple[str, ...] = ()
        self.keep = 0  # characters held back: one less than the longest stop sequence
        self.held = ""
        self.cut = False  # a stop sequence was found: nothing more of the text goes out
        self.started = False
        self.role_sent = False
        self.first: float | None = None  # perf_counter() when the first text went out

    def open(self, model: str, stops: tuple[str, ...]) -> None:
        """Name the model and the stop sequences (once the request's context is known)."""
        self.head = {"id": ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex,
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.stops, self.keep = stops, max((len(s) for s in stops), default=1) - 1

    async def _write(self, data: bytes, more: bool = True) -> None:
        if not self.started:
            self.started = True
            await self.send({"type": "http.response.start", "status": 200, "headers": [
                *self.cors, (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]})
        try:
            await self.send({"type": "http.response.body", "body": data, "more_body": more})
        except OSError:  # the caller went away (uvicorn's ClientDisconnected): cancel the upstream call
            raise asyncio.CancelledError from None

    async def _event(self, doc: dict[str, Any]) -> None:
        await self._write(b"data: " + json.dumps(doc).encode() + b"\n\n")

    async def _chunk(self, text: str) -> None:
        if self.chat:
            delta = {"content": text} if self.role_sent else {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
        self.role_sent = True
        if self.first is None:
            self.first = time.perf_counter()
        await self._event({**self.head, "choices": [choice]})

    async def text(self, piece: str) -> None:
        """One piece of the answer as the upstream sent it (``Router.astream``'s ``on_text``)."""
        self.upstream.answered = time.monotonic()  # the upstream is answering: not a stall
        if self.cut:
            return
        buffer = self.held + piece
        if self.stops:
            cut, found = _cut(buffer, self.stops)
            if found:
                self.cut, self.held = True, ""
                out = cut
            else:
                split = max(0, len(buffer) - self.keep)
                out, self.held = buffer[:split], buffer[split:]
        else:
            out = buffer
        if out:
            await self._chunk(out)

    async def finish(self, routed: Routed, text: str, finish: str, info: dict[str, Any],
                     usage: dict[str, int] | None) -> None:
        """The rest of the answer (``text``: the returned text, cut), the final chunk, usage, ``[DONE]``."""
        rest = ("" if self.cut else self.held) if routed.streamed else text
        if rest or not self.role_sent:
            await self._chunk(rest)
        delta: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
        await self._event({**self.head, "choices": [{"index": 0, **delta, "finish_reason": finish, "logprobs": None}],
                           "iapo": info})
        if usage is not None:
            await self._event({**self.head, "choices": [], "usage": usage})
        await self._write(b"data: [DONE]\n\n", more=False)

    async def error(self, body: bytes) -> None:
        """End a started stream with the error (the OpenAI error object as one event)."""
        await self._write(b"data: " + body + b"\n\n", more=False)


class ServeApp:
    """The ASGI app serving a ``Router`` (module docstring)."""

    def __init__(self, router: Router, *, api_key: str | None = None, access_log: TextIO | None = None,
                 limits: ServeLimits | None = None, budget: Budget | None = None,
                 log: TextIO | None = None, host: str = "127.0.0.1") -> None:
        """``api_key``: the inbound key, if any; ``log``: where upstream failures are described (stderr);
        ``host``: the address the server is bound to (a Host header naming it is answered)."""
        self.router = router
        self.limits = limits or ServeLimits()
        self.budget = budget if budget is not None else Budget()
        self.access = AccessLog(access_log)
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
            for c in router.contexts:  # the smallest request of each context (an empty query) must fit every limit
                self.budget.check(self._worst(c, None, router.render(c, "")),
                                  f"the worst case of the smallest request in context {c.name!r}: N x (max_tokens + "
                                  f"{OVERSHOOT_TOKENS}) completion tokens plus N x the template's prompt tokens, "
                                  f"x {1 + self.retries} attempts")
        self.upstream = _Upstream(self.limits.stall_after)
        self.hosts = {host_name(h) for h in (*LOCAL_HOSTS, _bracketed(host), *self.limits.allowed_hosts)}
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
        """Route one HTTP request: first its Host (421 unless allowed: DNS rebinding), on every path."""
        path, method = scope["path"], scope["method"]
        headers = dict(scope["headers"])
        refused = self._host_refused(headers, sum(1 for name, _ in scope["headers"] if name == b"host"))
        if refused is not None:
            await self._send(send, refused.status, error_body(refused), [], refused.headers)
            return
        receive = self._timed(receive)
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
            await self._send(send, exc.status, error_body(exc), cors, exc.headers)

    def _host_refused(self, headers: dict[bytes, bytes], count: int) -> RequestError | None:
        """None when the one Host header names an allowed host (any port, or the port it was allowed with);
        else the 421 (400 without a Host header or with several). A page of another site whose name resolves
        to this address (DNS rebinding) sends its own name, so it is refused before anything runs."""
        raw = headers.get(b"host")
        if raw is None or count != 1:
            return RequestError(400, "the request must have one Host header", "missing_host",
                                headers={"Connection": "close"})
        try:
            name, port = host_name(raw.decode("latin-1"))
        except ValueError:
            name, port = "", None
        if (name, None) in self.hosts or (name, port) in self.hosts:
            return None
        return RequestError(421, "this server does not answer to the host named in the Host header; its operator "
                                 "can allow it with --allowed-host", "host_not_allowed",
                            headers={"Connection": "close"})

    def _timed(self, receive: Receive) -> Receive:
        """``receive`` with the request body bounded in time: the whole body must arrive within
        ``body_timeout`` (and the deadline) from now, else 408 and the connection is closed; after the
        body, ``receive`` only tells of a disconnect and is not bounded."""
        limit = min(self.limits.body_timeout, self.limits.deadline)
        loop = asyncio.get_running_loop()
        ends = loop.time() + limit
        done = False

        async def timed() -> MutableMapping[str, Any]:
            nonlocal done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), ends - loop.time())
            except asyncio.TimeoutError:
                raise RequestError(408, f"the request body did not arrive within this server's limit of {limit:g} s",
                                   "request_timeout", headers={"Connection": "close"}) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                done = True
            return message

        return timed

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

        out = _Stream(send, cors, chat, self.upstream)
        try:
            routed, plan = await self._answer(headers, receive, chat, deadline, record, out)
        except RequestError as exc:
            record["error"] = exc.code
            if out.started:  # the caller has part of the answer: the error is the stream's last event
                logged(200)
                with contextlib.suppress(OSError):
                    await out.error(error_body(exc))
                return
            logged(exc.status)
            await self._send(send, exc.status, error_body(exc), cors, exc.headers)
            return
        except asyncio.CancelledError:  # the caller went away: nothing to answer
            record["error"] = "client_disconnected"
            logged(499)
            return
        self.served += 1
        record.update(context=routed.context.name, prompt=routed.prompt_id, n=routed.context.n, drawn=routed.n,
                      prompt_tokens=routed.prompt_tokens, completion_tokens=routed.completion_tokens)
        if plan.stream:
            if out.first is not None:
                record["first_text_ms"] = round((out.first - start) * 1000.0, 3)
            logged(200)
            with contextlib.suppress(OSError):  # a caller gone at the end misses only the end
                await out.finish(routed, *self._answer_text(routed, plan), self._usage(routed) if plan.include_usage
                                 else None)
            return
        logged(200)
        await self._send(send, 200, json.dumps(self._response(routed, plan, chat)).encode(), cors)

    async def _answer(self, headers: dict[bytes, bytes], receive: Receive, chat: bool, deadline: float,
                      record: dict[str, Any], out: _Stream) -> tuple[Routed, Plan]:
        """The checks, then the routed answer (streamed to ``out`` as it comes when the caller asked for a stream)."""
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
        plan = read_request(body, chat, self.sampling, self.router.rules)
        try:
            ctx = self.router.resolve(plan.context)
            if plan.model_context is not None and self.router.resolve(plan.model_context) != ctx:
                raise RequestError(400, f"iapo_context and the model {body.get('model')!r} name different contexts",
                                   "invalid_context", "iapo_context")
        except ContextError as exc:
            raise RequestError(400, str(exc), "unknown_context", "model", {"contexts": exc.contexts}) from None
        if plan.stop:
            plan.changed["stop"] = stop_note(self.router.sends_stop(ctx, plan.stop))
        if plan.stream:
            out.open(MODEL_PREFIX + ctx.name, plan.stop)
        # everything sent counts: the policy's template, the query, an accepted system text and earlier turns
        rendered = self.router.render(ctx, plan.query, plan.system, plan.history)
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
            return await self._run(ctx, plan, receive, deadline, usage, out), plan
        finally:
            await self._settle(reservation, ctx, usage)

    async def _run(self, ctx: Any, plan: Plan, receive: Receive, deadline: float, usage: Usage,
                   out: _Stream | None = None) -> Routed:
        """The routed answer in a slot, before the deadline, cancelled if the caller goes away; with ``plan.stream``
        its text goes to ``out`` as the upstream sends it where the context's N is 1 (``Router.astream``)."""
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
            call = self.router.astream(plan.query, ctx, options, out.text, system=plan.system, history=plan.history)
        else:
            call = self.router.acomplete(plan.query, ctx, options, system=plan.system, history=plan.history)
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
            self.upstream.end(waiting)
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

    @staticmethod
    def _usage(routed: Routed) -> dict[str, int]:
        return {"prompt_tokens": routed.prompt_tokens, "completion_tokens": routed.completion_tokens,
                "total_tokens": routed.prompt_tokens + routed.completion_tokens}

    def _response(self, routed: Routed, plan: Plan, chat: bool) -> dict[str, Any]:
        text, finish, info = self._answer_text(routed, plan)
        common = {"created": int(time.time()), "model": MODEL_PREFIX + routed.context.name,
                  "usage": self._usage(routed), "iapo": info}
        if chat:
            return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", **common,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": finish, "logprobs": None}]}
        return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", **common,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

    # ---- health --------------------------------------------------------------------------------------
    async def health(self, headers: dict[bytes, bytes]) -> tuple[int, bytes]:
        """503 when the upstream is down or stalled, else 200.

        Each call asks the upstream (``GET /models``, at most every ``PROBE_EVERY`` s, within
        ``PROBE_TIMEOUT`` s): no answer in time while no request waits for it is down, so a hung upstream
        (stopped, deadlocked) shows within the probe timeout, not after the endpoint's; while requests wait,
        a request waiting past ``stall_after`` with no answer from the upstream meanwhile is a stall. The
        spend, the counters and the worker's pid only to a caller with the inbound key.
        """
        up = self.upstream
        await self._probe()
        spend = self._authorized(headers)
        report = up.report()
        status = {"down": "upstream_down", "stalled": "upstream_stalled"}.get(report["state"], "ok")
        body: dict[str, Any] = {"status": status, "contexts": len(self.router.contexts),
                                "upstream": report, "in_flight": self.active, "queued": self.waiting,
                                "budget": await self._budget_report(spend)}
        if spend:
            body.update(served=self.served, spent=self.router.spent, pid=os.getpid())
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

    async def _probe(self) -> None:
        up = self.upstream
        async with up.probe_lock:
            now = time.monotonic()
            if now - up.last_probe < PROBE_EVERY:
                return
            up.last_probe = now
            try:  # the whole probe within the timeout (waiting for a pooled connection too)
                status = await asyncio.wait_for(self.router.probe(PROBE_TIMEOUT), PROBE_TIMEOUT)
            except asyncio.TimeoutError:
                status = None
        if status is None and (up.answered >= now or up.in_flight):
            # no answer to the probe, but requests were answered meanwhile (busy, not hung), or requests are
            # waiting, ahead of which an upstream may put the probe (llama.cpp's server answers /models between
            # completions): whether those stall decides (``stall_after``)
            return
        if status is None or status >= 500:
            up.failed("upstream_unavailable")
        elif status in (401, 403):
            up.failed("upstream_auth")
        else:  # it answered (a 404 from an upstream without /models is an answer)
            up.ok()


def create_app(router: Router, *, api_key: str | None = None, access_log: TextIO | None = None,
               limits: ServeLimits | None = None, budget: Budget | None = None,
               log: TextIO | None = None, host: str = "127.0.0.1") -> ServeApp:
    """The ASGI app serving ``router`` (``ServeApp``); ``api_key``: the inbound key, if any; ``host``: the address
    it is bound to (Host headers naming it are answered, besides localhost's names and ``limits.allowed_hosts``)."""
    return ServeApp(router, api_key=api_key, access_log=access_log, limits=limits, budget=budget, log=log, host=host)


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
    (uvicorn's supervisor runs them all on one listening socket). Every connection is bounded by ``limits``
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
        uvicorn.run(app, factory=True, **options)
    else:
        uvicorn.Server(uvicorn.Config(app, **options)).run()


def serve(router: Router, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          access_log: TextIO | None = None, graceful_timeout: float = 30.0, limits: ServeLimits | None = None,
          budget: Budget | None = None) -> None:
    """Serve ``router`` in this process (``create_app`` then ``run_server``) until SIGINT/SIGTERM."""
    app = create_app(router, api_key=api_key, access_log=access_log, limits=limits, budget=budget, host=host)
    run_server(app, host=host, port=port, limits=app.limits, graceful_timeout=graceful_timeout)
