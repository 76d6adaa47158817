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
from iapo_gym.deploy.limits import host_name
from iapo_gym.deploy.params import RequestError

__all__ = ["AccessLog", "BodyTimer", "Cors", "DRAIN_FACTOR", "Doors", "JSON", "LOCAL_HOSTS", "SINGLE_HEADERS",
           "answered_hosts", "error_response", "host_refusal", "read_body", "route_path", "starlette_app"]

JSON = "application/json"
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # Host names always answered (any port)
DRAIN_FACTOR = 8  # a body up to this many times the limit is read and dropped before the 413
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


def answered_hosts(bound: str, allowed: Sequence[str] = ()) -> set[tuple[str, int | None]]:
    """The (name, port) pairs a server bound to ``bound`` answers: localhost's names, the bound address (an IPv6
    address in brackets, as a Host header names it) and the ``allowed`` hosts (``--allowed-host``)."""
    bracketed = f"[{bound}]" if ":" in bound and not bound.startswith("[") else bound
    return {host_name(h) for h in (*LOCAL_HOSTS, bracketed, *allowed)}


def host_refusal(hosts: set[tuple[str, int | None]], headers: dict[bytes, bytes], count: int) -> RequestError | None:
    """None when the one Host header names a host of ``hosts`` (any port, or the port it was allowed with); else
    the 421 (400 without a Host header or with several). A page of another site whose name resolves to this
    address (DNS rebinding) sends its own name, so it is refused before anything runs."""
    raw = headers.get(b"host")
    if raw is None or count != 1:
        return RequestError(400, "the request must have one Host header", "missing_host",
                            headers={"Connection": "close"})
    try:
        name, port = host_name(raw.decode("latin-1"))
    except ValueError:
        name, port = "", None
    if (name, None) in hosts or (name, port) in hosts:
        return None
    return RequestError(421, "this server does not answer to the host named in the Host header; its operator "
                             "can allow it with --allowed-host", "host_not_allowed",
                        headers={"Connection": "close"})


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes.

    A body declared (``Content-Length``) or found larger is read on and dropped, never kept, up to
    ``DRAIN_FACTOR`` times the limit, so that the caller reliably hears the 413 rather than a reset
    connection; a body declared larger still is refused at once, unread.
    """
    too_big = RequestError(413, f"the request body is larger than this server's limit of {limit} bytes",
                           "body_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > DRAIN_FACTOR * limit):
        raise too_big
    over = declared is not None and int(declared) > limit
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():  # ClientDisconnect when the caller goes away
        size += len(chunk)
        if size > limit:
            over = True
            chunks.clear()
        if not over:
            chunks.append(chunk)
        if size > DRAIN_FACTOR * limit:
            raise too_big
    if over:
        raise too_big
    return b"".join(chunks)


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
    if exc.status_code == 404:  # the app's own paths (a path with a parameter by its prefix)
        paths = sorted({route.path.split("{", 1)[0].rstrip("/") for route in request.app.routes
                        if isinstance(route, Route)})
        return error_response(RequestError(404, f"{path} is not served: the endpoints are {', '.join(paths[:-1])} "
                                                f"and {paths[-1]}", "not_found"))
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

    def __init__(self, stream: TextIO | None, observer: Callable[[dict[str, Any]], None] | None = None) -> None:
        """``stream``: where lines go (None: nowhere); ``observer``: called with each record as it is submitted, on
        the caller's thread, also without a stream (``serve``'s metrics)."""
        self.stream = stream
        self.observer = observer
        self._thread = None if stream is None else \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="iapo-gym-access-log")

    def _append(self, line: str) -> None:
        assert self.stream is not None
        self.stream.write(line)
        self.stream.flush()

    def submit(self, record: dict[str, Any]) -> concurrent.futures.Future[None] | None:
        """Queue one record for the log's thread; the future is done once it is flushed."""
        if self.observer is not None:
            self.observer(record)
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
