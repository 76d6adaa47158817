"""``serve``'s HTTP layer on Starlette: what every request passes before its route, errors in the OpenAI shape, CORS,
and the access log written off the event loop.

``starlette_app`` puts a server's routes behind these middlewares, outermost first:

- ``Doors``: the Host header names an allowed host (else 421, or 400 without one Host header: DNS
  rebinding is refused before anything runs), and each header the server reads (``SINGLE_HEADERS``)
  is sent at most once (else 400 ``duplicate_header``: two keys or two content types are not guessed
  between); on every path and method, OPTIONS and unknown paths included;
- ``Cors``: with ``--cors-origin``, the preflight of the API paths (204 for an allowed origin, else 403)
  and the ``access-control-allow-origin`` header on every answer to an allowed origin; the project's own,
  because Starlette's ``CORSMiddleware`` answers a preflight with 200 or 400 and only when it names a method;
- ``BodyTimer``: the request body must arrive within ``body_timeout`` (and the deadline), else 408
  and the connection is closed.

Starlette's routing answers HEAD on the GET routes and honours the ASGI ``root_path`` (a server mounted
under a prefix); its 404 and 405 and a ``RequestError`` raised by a route become the OpenAI error shape.
The connection itself (head size and time, idle keep-alive, the connection cap) is bounded below the
app, in uvicorn's protocol (``iapo_gym.deploy.connections``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from iapo_gym.deploy.errors import error_body
from iapo_gym.deploy.params import RequestError

__all__ = ["AccessLog", "BodyTimer", "Cors", "Doors", "JSON", "SINGLE_HEADERS", "error_response", "route_path", "starlette_app"]

JSON = "application/json"
SINGLE_HEADERS = (b"host", b"authorization", b"content-type", b"content-length", b"origin")
PREFLIGHT = [(b"access-control-allow-methods", b"GET, POST, OPTIONS"),
             (b"access-control-allow-headers", b"authorization, content-type"), (b"access-control-max-age", b"600")]


def route_path(scope: Scope) -> str:
    """The request's path below the app's ``root_path`` (the prefix it is mounted under, if any)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


def error_response(exc: RequestError) -> Response:
    """``exc`` as an answer: its status, the OpenAI error body and its headers (``Retry-After``, ...)."""
    return Response(error_body(exc), exc.status, headers=exc.headers, media_type=JSON)


class Doors:
    """The Host allow-list and single headers, before anything else (module docstring)."""

    def __init__(self, app: ASGIApp, host_refused: Callable[[dict[bytes, bytes], int], RequestError | None]) -> None:
        """``host_refused(headers, count)``: None when the one Host header is allowed, else the refusal."""
        self.app, self.host_refused = app, host_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen: dict[bytes, int] = {}
        host = b""
        for name, value in scope["headers"]:
            if name in SINGLE_HEADERS:
                seen[name] = seen.get(name, 0) + 1
                if name == b"host":
                    host = value
        refused = self.host_refused({b"host": host} if b"host" in seen else {}, seen.get(b"host", 0))
        if refused is None:
            twice = next((name for name, count in seen.items() if count > 1), None)
            if twice is not None:
                name = twice.decode()
                refused = RequestError(400, f"the request has the {name} header more than once; send it once",
                                       "duplicate_header", name)
        if refused is not None:
            await error_response(refused)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class Cors:
    """CORS for the ``origins`` given (``'*'``: any): preflights of the paths ``preflight`` accepts, and the allow
    header on answers (module docstring)."""

    def __init__(self, app: ASGIApp, origins: Sequence[str], preflight: Callable[[str], bool]) -> None:
        self.app, self.origins, self.preflight = app, frozenset(origins), preflight

    def allow(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The allow headers for the request's Origin (none when it has none or another)."""
        origin = next((value for name, value in scope["headers"] if name == b"origin"), None)
        if origin is None:
            return []
        if "*" in self.origins:
            return [(b"access-control-allow-origin", b"*")]
        if origin.decode("latin-1") in self.origins:
            return [(b"access-control-allow-origin", origin), (b"vary", b"origin")]
        return []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        allowed = self.allow(scope)
        if scope["method"] == "OPTIONS" and self.preflight(route_path(scope)):
            response = Response(status_code=204 if allowed else 403)
            response.raw_headers = [*response.raw_headers, *allowed, *PREFLIGHT]
            await response(scope, receive, send)
            return
        if not allowed:
            await self.app(scope, receive, send)
            return

        async def send_allowed(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *allowed]}
            await send(message)

        await self.app(scope, receive, send_allowed)


class BodyTimer:
    """The request body within ``limit`` s of the request's start, else 408 and the connection closed; after the
    body, ``receive`` only tells of a disconnect and is not bounded."""

    def __init__(self, app: ASGIApp, limit: float) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        ends = loop.time() + self.limit
        done = False

        async def timed() -> Message:
            nonlocal done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), ends - loop.time())
            except asyncio.TimeoutError:
                raise RequestError(408, f"the request body did not arrive within this server's limit of "
                                        f"{self.limit:g} s", "request_timeout", headers={"Connection": "close"}) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                done = True
            return message

        await self.app(scope, timed, send)


async def _request_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 and 405 in the OpenAI shape (other statuses keep its text)."""
    assert isinstance(exc, HTTPException)
    path, method = request.scope["path"], request.method
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return error_response(RequestError(405, f"{path} takes {' or '.join(sorted(allowed.split(', ')))}, got "
                                                f"{method}", "method_not_allowed", headers={"Allow": allowed}))
    if exc.status_code == 404:
        return error_response(RequestError(404, f"{path} is not served: the endpoints are /v1/chat/completions, "
                                                "/v1/completions, /v1/models and /health", "not_found"))
    return Response(exc.detail, exc.status_code, headers=exc.headers)


async def _internal_error(_: Request, exc: Exception) -> Response:
    """A failure no route handled: 500 in the OpenAI shape (uvicorn logs the traceback)."""
    return error_response(RequestError(500, "the server failed to answer this request (see its log)",
                                       "internal_error"))


def starlette_app(routes: list[Route], *, lifespan: Callable[[Any], contextlib.AbstractAsyncContextManager[None]],
                  host_refused: Callable[[dict[bytes, bytes], int], RequestError | None], cors_origins: Sequence[str],
                  preflight: Callable[[str], bool], body_limit: float) -> Starlette:
    """The Starlette app of ``routes`` behind ``Doors``, ``Cors`` (when ``cors_origins``) and ``BodyTimer``."""
    middleware = [Middleware(Doors, host_refused=host_refused)]
    if cors_origins:
        middleware.append(Middleware(Cors, origins=cors_origins, preflight=preflight))
    middleware.append(Middleware(BodyTimer, limit=body_limit))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={RequestError: _request_error, 404: _http_error, 405: _http_error,
                                        Exception: _internal_error})
    app.router.redirect_slashes = False  # /health/ is not /health: 404, not a redirect
    return app


class AccessLog:
    """One JSON object per line, written and flushed on the log's own thread, so that a slow disk never holds the
    event loop. ``write`` returns once the line is flushed (a request awaits its line before its answer is
    complete: at most one line per request in flight waits); ``submit`` does not wait."""

    def __init__(self, stream: TextIO | None) -> None:
        """``stream``: where lines go (None: nowhere)."""
        self.stream = stream
        self._thread = None if stream is None else \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="iapo-gym-access-log")

    def _append(self, line: str) -> None:
        assert self.stream is not None
        self.stream.write(line)
        self.stream.flush()

    def submit(self, record: dict[str, Any]) -> concurrent.futures.Future[None] | None:
        """Queue one record for the log's thread; the future is done once it is flushed."""
        if self._thread is None:
            return None
        return self._thread.submit(self._append, json.dumps(record, separators=(",", ":")) + "\n")

    async def write(self, record: dict[str, Any]) -> None:
        """Append one record; returns once it is flushed."""
        done = self.submit(record)
        if done is not None:
            await asyncio.wrap_future(done)

    def close(self) -> None:
        """Write what is queued; later records go nowhere (the stream itself stays open)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
