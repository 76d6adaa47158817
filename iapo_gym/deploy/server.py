"""``iapo-gym serve``: a ``Router`` behind an OpenAI-compatible HTTP API (Starlette on uvicorn).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.
A request names its context by ``iapo_context`` in the body (the official client's ``extra_body``)
or by the model ``iapo/<context>``; a context is a name or a JSON list of weights. The query is the
``prompt`` (completions) or the content of the last user message (chat); the policy renders its own
prompt around it, so the caller's system messages and sampling parameters are not used.

Errors have the OpenAI shape ``{"error": {"message", "type", "code"}}``: 400 for a bad body or an
unknown context (the message lists the contexts), 401 for a missing or wrong inbound key, the
upstream's own status for its 4xx refusals, 502 when the upstream cannot be reached (with the
cause), 503 when the spec's spending cap is reached. Each request adds one JSON line to the access
log (time, path, status, latency, context, N, tokens); keys and bodies are never logged.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TextIO

from iapo_gym.deploy.router import BudgetExhausted, ContextError, EndpointError, Routed, Router

MODEL_PREFIX = "iapo/"


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
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock:
            self.stream.write(line)
            self.stream.flush()


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, code: str, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra or {}


def _error_body(status: int, message: str, code: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    kind = {401: "authentication_error", 502: "upstream_error", 503: "server_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "code": code, **(extra or {})}}


def _context_ref(body: dict[str, Any]) -> Any:
    """The context a request names: ``iapo_context``, else the model ``iapo/<context>``, else None."""
    ref = body.get("iapo_context")
    model = body.get("model")
    from_model = None
    if isinstance(model, str) and model.startswith(MODEL_PREFIX):
        from_model = model[len(MODEL_PREFIX):]
        if from_model.startswith("["):
            try:
                from_model = json.loads(from_model)
            except json.JSONDecodeError:
                raise _BadRequest(400, f"model {model!r}: the weights after 'iapo/' are not a JSON list",
                                  "invalid_context") from None
    if ref is not None and from_model is not None and ref != from_model:
        raise _BadRequest(400, f"iapo_context {ref!r} and model {model!r} name different contexts", "invalid_context")
    ref = ref if ref is not None else from_model
    if ref is not None and not isinstance(ref, (str, list)):
        raise _BadRequest(400, f"iapo_context must be a context name or a list of weights, got {ref!r}",
                          "invalid_context")
    return ref


def _query(body: dict[str, Any], chat: bool) -> str:
    """The user's content: the completions ``prompt``, or the last user message of a chat."""
    if body.get("stream"):
        raise _BadRequest(400, "streaming is not supported: the answer is chosen after all N completions are in",
                          "unsupported_parameter")
    n = body.get("n", 1)
    if n not in (1, None):
        raise _BadRequest(400, f"n = {n!r} is not supported: the policy chooses how many completions to sample "
                               "(ask for one answer)", "unsupported_parameter")
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _BadRequest(400, f"'prompt' must be a non-empty string, got {prompt!r}", "invalid_prompt")
        return prompt
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest(400, "'messages' must be a non-empty list of {role, content} objects", "invalid_messages")
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):  # content parts: the text parts, in order
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
            if isinstance(content, str) and content:
                return content
            raise _BadRequest(400, "the last user message has no text content", "invalid_messages")
    raise _BadRequest(400, "'messages' has no message with role 'user'", "invalid_messages")


def _response(routed: Routed, chat: bool) -> dict[str, Any]:
    usage = {"prompt_tokens": routed.prompt_tokens, "completion_tokens": routed.completion_tokens,
             "total_tokens": routed.prompt_tokens + routed.completion_tokens}
    finish = routed.finish or "stop"
    common = {"created": int(time.time()), "model": MODEL_PREFIX + routed.context.name, "usage": usage,
              "iapo": routed.info()}
    if chat:
        return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", **common,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": routed.text},
                             "finish_reason": finish, "logprobs": None}]}
    return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", **common,
            "choices": [{"index": 0, "text": routed.text, "finish_reason": finish, "logprobs": None}]}


def create_app(router: Router, *, api_key: str | None = None, access_log: TextIO | None = None) -> Any:
    """The ASGI app serving ``router`` (module docstring); ``api_key``: the inbound key, if any."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    log = AccessLog(access_log)
    expected = api_key.encode() if api_key else None
    state = {"in_flight": 0, "served": 0}

    def json_response(status: int, body: dict[str, Any]) -> Response:
        return Response(json.dumps(body, ensure_ascii=False, separators=(",", ":")), status_code=status,
                        media_type="application/json")

    def authorized(request: Request) -> bool:
        if expected is None:
            return True
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected)

    async def handle(request: Request, chat: bool) -> Response:
        start = time.perf_counter()
        record: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "method": "POST",
                                  "path": request.url.path}
        state["in_flight"] += 1
        try:
            status, body = await respond(request, chat, record)
        finally:
            state["in_flight"] -= 1
        record["status"] = status
        record["latency_ms"] = round((time.perf_counter() - start) * 1000.0, 3)
        log.write(record)
        return json_response(status, body)

    async def respond(request: Request, chat: bool, record: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            if not authorized(request):
                raise _BadRequest(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key "
                                       "this server was started with (--api-key-env)", "invalid_api_key")
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise _BadRequest(400, f"the request body is not valid JSON ({exc})", "invalid_json") from None
            if not isinstance(body, dict):
                raise _BadRequest(400, f"the request body must be a JSON object, got {type(body).__name__}",
                                  "invalid_json")
            query = _query(body, chat)
            try:
                routed = await router.acomplete(query, _context_ref(body))
            except ContextError as exc:
                raise _BadRequest(400, str(exc), "unknown_context", {"contexts": exc.contexts}) from None
        except _BadRequest as exc:
            record["error"] = exc.code
            return exc.status, _error_body(exc.status, exc.message, exc.code, exc.extra)
        except EndpointError as exc:
            status = exc.status if exc.status is not None and 400 <= exc.status < 500 else 502
            record["error"] = "upstream_refused" if status < 500 else "upstream_unreachable"
            return status, _error_body(status, f"upstream: {exc}", record["error"])
        except BudgetExhausted as exc:
            record["error"] = "spending_cap"
            return 503, _error_body(503, f"the upstream spending cap is reached: {exc}", "spending_cap")
        except Exception as exc:  # a scorer or extractor failure: the server keeps serving
            record["error"] = "internal_error"
            return 500, _error_body(500, f"{type(exc).__name__}: {exc}", "internal_error")
        state["served"] += 1
        record.update(context=routed.context.name, prompt=routed.prompt_id, n=routed.n,
                      prompt_tokens=routed.prompt_tokens, completion_tokens=routed.completion_tokens)
        return 200, _response(routed, chat)

    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    async def models(request: Request) -> Response:
        if not authorized(request):
            return json_response(401, _error_body(401, "missing or wrong API key", "invalid_api_key"))
        data = [{"id": MODEL_PREFIX + c.name, "object": "model", "created": 0, "owned_by": "iapo-gym",
                 "iapo": {"prompt": c.prompt, "n": c.n, "objective_weights": list(c.objective_weights),
                          "cost_weight": c.cost_weight}} for c in router.contexts]
        return json_response(200, {"object": "list", "data": data})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "contexts": len(router.contexts), "in_flight": state["in_flight"],
                             "served": state["served"], "upstream": router.spent})

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.aclose()

    return Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"]),
                             Route("/health", health, methods=["GET"])], lifespan=lifespan)


def serve(router: Router, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          access_log: TextIO | None = None, graceful_timeout: float = 30.0) -> None:
    """Run the server until SIGINT/SIGTERM; requests in flight then finish (up to ``graceful_timeout`` s)."""
    import uvicorn

    app = create_app(router, api_key=api_key, access_log=access_log)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=max(1, math.ceil(graceful_timeout)))
    print(f"iapo-gym serve: {len(router.contexts)} contexts of task {router.policy.task!r} on http://{host}:{port}/v1 "
          f"(upstream model {router.spec.endpoint.model!r})", file=sys.stderr, flush=True)
    uvicorn.Server(config).run()
