"""Run async code from sync code, also where an event loop is already running (Jupyter, ``asyncio.run``).

``asyncio.run`` and ``loop.run_until_complete`` refuse to run inside a running loop, which is
where every notebook cell executes. ``run(coro)`` uses ``asyncio.run`` when the calling thread has
no running loop and otherwise runs the coroutine on a fresh loop in a helper thread, blocking the
caller until it is done. ``LoopThread`` is a long-lived loop on its own thread for objects that
keep async resources between sync calls (the live env's HTTP client is bound to one loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _in_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def gather_all(*aws: Awaitable[T]) -> list[T]:
    """Like ``asyncio.gather``, but a failure is raised only after every awaitable has ended.

    Plain ``gather`` raises at the first failure and leaves the others running unobserved, which on
    a loop that outlives the call (``LoopThread``) means requests still going out after the error.
    """
    got = await asyncio.gather(*aws, return_exceptions=True)
    for outcome in got:
        if isinstance(outcome, BaseException):
            raise outcome
    return list(got)  # type: ignore[arg-type]


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion and return its result, whether or not this thread runs an event loop."""
    if not _in_running_loop():
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(coro)
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc
    thread = threading.Thread(target=target, name="iapo-gym-run", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    result: T = box["result"]
    return result


class LoopThread:
    """An event loop running forever on a daemon thread; ``run`` submits a coroutine and waits for it."""

    def __init__(self, name: str = "iapo-gym-loop") -> None:
        """Start the loop's thread."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        """Whether ``close`` has run."""
        return self._loop.is_closed()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop's thread and return its result; Ctrl-C in the caller cancels it."""
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this LoopThread is closed")
        if threading.get_ident() == self._thread.ident:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop; await the coroutine instead")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except (KeyboardInterrupt, SystemExit):
            future.cancel()
            try:
                future.result(timeout=5)
            except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError, Exception):
                pass
            raise

    def close(self) -> None:
        """Stop the loop after its pending callbacks, join the thread and close the loop (idempotent)."""
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._loop.shutdown_asyncgens(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
