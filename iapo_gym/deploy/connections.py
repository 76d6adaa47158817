"""Connections that end: ``serve``'s HTTP protocol, uvicorn's with bounds of its own, whichever parser runs.

uvicorn bounds a request's head only with h11 (``h11_max_incomplete_event_size``; httptools, the
documented install, takes any size), never bounds the time a head takes to arrive, and keeps a
connection that sends nothing open forever. ``serve`` therefore runs uvicorn's protocol (httptools
when installed, else h11) with the same bounds added around its parser (``ServeLimits``):

- the head (request line and headers) past ``max_header_bytes``: 431, connection closed;
- a head not complete within ``header_timeout`` s of its first byte (of the connection's opening, for a
  new connection): 408, connection closed (a new connection that sent nothing is closed without a word);
- idle keep-alive connections close after ``keep_alive_timeout`` s (uvicorn's own timer);
- past ``max_connections`` open connections in a process, the oldest idle one (no request under way)
  is closed; when none is idle, the new connection is closed unanswered.

The body's time (``body_timeout``, 408) is bounded in the app, where the request's deadline is
(``iapo_gym.deploy.app.BodyTimer``). Refusals have the OpenAI error shape with the project's codes.
"""

from __future__ import annotations

import asyncio
import functools
import http
import weakref
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from iapo_gym.deploy.errors import error_body
from iapo_gym.deploy.limits import ServeLimits
from iapo_gym.deploy.params import RequestError

try:
    import httptools  # noqa: F401 (uvicorn's faster parser, when installed)
except ImportError:  # h11 serves alone
    HAVE_HTTPTOOLS = False
else:
    HAVE_HTTPTOOLS = True

__all__ = ["PARSERS", "Bounded", "BoundedH11", "protocol"]

LINGER = 1.0  # seconds a refused connection stays open, unread, for its answer to reach the client


class _Guard:
    """The open connections of one server process, the idle ones in the order they became idle."""

    def __init__(self) -> None:
        self.live: set[Bounded] = set()
        self.idle: dict[Bounded, None] = {}

    def admit(self, conn: Bounded, cap: int) -> None:
        """Count ``conn``, idle; past ``cap`` close the oldest idle connection (``conn`` itself when none is)."""
        self.live.add(conn)
        self.idle[conn] = None
        if len(self.live) > cap:
            victim = next((c for c in self.idle if c is not conn), conn)
            victim.close_quietly()

    def busy(self, conn: Bounded) -> None:
        self.idle.pop(conn, None)

    def idle_again(self, conn: Bounded) -> None:
        if conn in self.live:
            self.idle.pop(conn, None)
            self.idle[conn] = None

    def forget(self, conn: Bounded) -> None:
        self.live.discard(conn)
        self.idle.pop(conn, None)


_GUARDS: weakref.WeakKeyDictionary[Any, _Guard] = weakref.WeakKeyDictionary()


class Bounded:
    """The bounds of the module docstring, mixed into a uvicorn HTTP protocol (before it in the MRO).

    The parser-specific parts: ``_in_head`` (the connection waits for, or reads, a request's head) and
    ``heads`` (heads completed so far), kept by the subclasses.
    """

    limits: ServeLimits
    heads: int
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any
    server_state: Any

    def _setup(self, limits: ServeLimits) -> None:
        self.limits = limits
        self.heads = 0
        self.head_bytes = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.refused = False
        guard = _GUARDS.get(self.server_state)
        if guard is None:
            guard = _GUARDS[self.server_state] = _Guard()
        self.guard = guard

    def _in_head(self) -> bool:
        raise NotImplementedError

    # ---- asyncio.Protocol ------------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_head_timer()
        self.guard.admit(self, self.limits.max_connections)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self.guard.forget(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        """Feed the parser; while a head is read, only up to ``max_header_bytes`` of it."""
        if self.refused or self.transport.is_closing():
            return
        if not self._in_head():
            self._feed(data)
            return
        self.guard.busy(self)
        if self.head_timer is None:
            self._arm_head_timer()
        room = self.limits.max_header_bytes - self.head_bytes
        if len(data) <= room:
            self.head_bytes += len(data)
            self._feed(data)
            return
        before = self.heads
        self.head_bytes += room
        self._feed(data[:room])
        if self.heads == before:
            self._refuse(431, f"the request line and headers are larger than this server's limit of "
                              f"{self.limits.max_header_bytes} bytes", "headers_too_large")
        elif not self.transport.is_closing():
            self.data_received(data[room:])

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing() and self.head_bytes == 0 and self._in_head():
            self.guard.idle_again(self)

    # ---- the parts of the bounds ---------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]

    def _head_done(self) -> None:
        """A request's head is complete: its bytes and its time no longer count."""
        self.heads += 1
        self.head_bytes = 0
        self._disarm_head_timer()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self.head_timer = self.loop.call_later(self.limits.header_timeout, self._head_expired)

    def _disarm_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_expired(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or not self._in_head():
            return
        if self.head_bytes == 0:  # a connection that never sent a byte
            self.close_quietly()
            return
        self._refuse(408, f"the request's headers did not arrive within this server's limit of "
                          f"{self.limits.header_timeout:g} s", "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` with the OpenAI error shape (unless a response is under way) and close.

        The answer goes out with the end of the server's side of the stream; reading stops, and the
        connection closes ``LINGER`` s later, so that a client still sending reads the answer before the
        close (a close with unread data resets the connection, and the reset can destroy the answer)."""
        self._disarm_head_timer()
        self.guard.forget(self)
        self.refused = True
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        body = error_body(RequestError(status, message, code))
        head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        self.transport.pause_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER, self.transport.close)

    def close_quietly(self) -> None:
        """Close the connection (its request, if any, sees a disconnect)."""
        self._disarm_head_timer()
        self.guard.forget(self)
        if not self.transport.is_closing():
            self.transport.close()


class BoundedH11(Bounded, H11Protocol):
    """uvicorn's h11 protocol with the bounds (the head is pending while the client's side is IDLE)."""

    def __init__(self, *args: Any, limits: ServeLimits, **kwargs: Any) -> None:
        """``limits``: the server's ``ServeLimits``; the rest as uvicorn passes them."""
        super().__init__(*args, **kwargs)
        self._setup(limits)

    def _in_head(self) -> bool:
        return bool(self.conn.their_state is h11.IDLE)

    def _feed(self, data: bytes) -> None:
        waiting = self._in_head()
        super()._feed(data)
        if waiting and not self._in_head():
            self._head_done()


if HAVE_HTTPTOOLS:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpTools(Bounded, HttpToolsProtocol):
        """uvicorn's httptools protocol with the bounds (httptools itself takes a head of any size)."""

        def __init__(self, *args: Any, limits: ServeLimits, **kwargs: Any) -> None:
            """``limits``: the server's ``ServeLimits``; the rest as uvicorn passes them."""
            super().__init__(*args, **kwargs)
            self.reading_head = True
            self._setup(limits)

        def _in_head(self) -> bool:
            return self.reading_head

        def on_headers_complete(self) -> None:
            self.reading_head = False
            self._head_done()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self.reading_head = True


PARSERS = ("auto", "httptools", "h11")


def protocol(limits: ServeLimits, parser: str = "auto") -> Any:
    """The protocol factory for ``uvicorn.Config(http=...)``, bounded by ``limits``: ``parser`` ``httptools``,
    ``h11`` or ``auto`` (httptools when installed, else h11). A ``functools.partial`` of a module-level class, so
    that ``--workers`` can pickle it. Raises ValueError for an unknown or uninstalled parser."""
    if parser not in PARSERS:
        raise ValueError(f"the HTTP parser is one of {list(PARSERS)}, got {parser!r}")
    if parser == "httptools" and not HAVE_HTTPTOOLS:
        raise ValueError("the HTTP parser httptools is not installed: pip install \"iapo-gym[serve]\"")
    cls = BoundedHttpTools if HAVE_HTTPTOOLS and parser != "h11" else BoundedH11
    return functools.partial(cls, limits=limits)
