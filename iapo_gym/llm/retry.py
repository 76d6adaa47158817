"""One retry policy for every HTTP endpoint of a collection (the LLM and the reward endpoint).

What is retried: a connection that failed or dropped, a timeout, HTTP 429 and 5xx. Any other 4xx
is final. Retry k waits ``min(max_backoff, backoff * 2^(k-1))`` times a jitter in [0.5, 1.5)
drawn from a seeded generator, and at least what the server's ``Retry-After`` asks. A failure of
one request after ``max_retries`` retries stops every request of the run (``Stop``), so a dead
endpoint costs seconds, not the rest of the budget. ``Retrier`` runs this loop for one endpoint,
with its concurrency limit; the LLM client and the reward scorer each supply only one attempt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

import numpy as np


class EndpointError(RuntimeError):
    """The endpoint refused a request for a reason retrying cannot fix (4xx other than 429), or retries ran out."""

    def __init__(self, message: str, status: int | None = None) -> None:
        """``status``: the endpoint's HTTP status of a refusal (None when retries ran out)."""
        super().__init__(message)
        self.status = status


class EndpointUnreachable(EndpointError):
    """A request used up its retries without an answer (refused or dropped connections, timeouts).

    ``url`` is the endpoint; nothing more is sent once this is raised.
    """

    def __init__(self, message: str, url: str) -> None:
        """``message`` says what failed; ``url`` is the endpoint that did not answer."""
        super().__init__(message)
        self.url = url


T = TypeVar("T")


class Retry(Exception):
    """Raised by one attempt that is worth retrying.

    ``connection``: no HTTP answer came (refused, dropped, timed out); ``server_asks``: the seconds
    of the server's ``Retry-After``.
    """

    def __init__(self, error: BaseException, *, connection: bool = False, server_asks: float | None = None) -> None:
        """Wrap the attempt's ``error``."""
        super().__init__(str(error))
        self.error, self.connection, self.server_asks = error, connection, server_asks


def retryable_status(status: int) -> bool:
    """Whether an HTTP status is worth retrying: 429 (rate limited) and 5xx (server trouble)."""
    return status == 429 or status >= 500


def retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Seconds the server's ``Retry-After`` header asks for (seconds or an HTTP date), or None."""
    value = (headers or {}).get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry one request; ``delay`` is the wait before retry ``attempt``."""

    max_retries: int
    backoff: float
    max_backoff: float

    @classmethod
    def of(cls, endpoint: Any, max_retries: int | None = None) -> RetryPolicy:
        """An endpoint's own policy (``max_retries``, ``backoff``, ``max_backoff``), at most ``max_retries`` retries."""
        return cls(endpoint.max_retries, endpoint.backoff, endpoint.max_backoff).capped(max_retries)

    def capped(self, max_retries: int | None) -> RetryPolicy:
        """This policy with at most ``max_retries`` retries (None: as it is); the backoff stays the endpoint's."""
        if max_retries is None or max_retries >= self.max_retries:
            return self
        return RetryPolicy(max_retries, self.backoff, self.max_backoff)

    def delay(self, attempt: int, rng: np.random.Generator, server_asks: float | None = None) -> float:
        """Exponential backoff with jitter before retry ``attempt`` (1-based), at least ``server_asks`` seconds."""
        wait = min(self.max_backoff, self.backoff * 2 ** (attempt - 1)) * (0.5 + float(rng.random()))
        return wait if server_asks is None else max(wait, server_asks)


class Stop:
    """The run-wide stop signal: set by the first final failure, seen by every request before it is sent.

    Created inside the event loop that uses it (an ``asyncio.Event`` binds to one loop).
    """

    def __init__(self) -> None:
        """A signal not yet set."""
        self.error: EndpointError | None = None
        self._event = asyncio.Event()

    def set(self, error: EndpointError) -> EndpointError:
        """Record the first final failure (later ones keep it) and wake every waiting retry; returns it."""
        if self.error is None:
            self.error = error
            self._event.set()
        return self.error

    def check(self) -> None:
        """Raise the recorded failure, if any: nothing new starts after it."""
        if self.error is not None:
            raise self.error

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or less if the run is stopped meanwhile (then raise its failure)."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass
        self.check()


class Retrier:
    """One endpoint's requests: at most ``concurrency`` at once, each retried under ``policy``, and one stop signal.

    ``call(attempt)`` runs ``attempt()`` (one HTTP attempt) until it returns. An attempt raises
    ``Retry`` to be retried after the backoff, or ``EndpointError`` to stop every request; when one
    request has used up ``max_retries``, every request stops with ``EndpointUnreachable`` (no HTTP
    answer on the last attempt) or ``EndpointError``. Create it in the event loop that uses it.
    With ``stop_on_failure=False`` (a server answering independent callers) a failure ends only its
    own request.
    """

    def __init__(self, what: str, url: str, policy: RetryPolicy, rng: np.random.Generator, concurrency: int,
                 *, stop_on_failure: bool = True) -> None:
        """``what`` names the endpoint in messages ("the endpoint", "the reward endpoint")."""
        self.what, self.url, self.policy, self._rng = what, url, policy, rng
        self.stop_on_failure = stop_on_failure
        self._sem = asyncio.Semaphore(concurrency)
        self.stop = Stop()
        self.retries = 0  # attempts retried

    async def call(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """The result of the first attempt that succeeds (see the class docstring for failures)."""
        tries = 0
        while True:
            async with self._sem:
                self.stop.check()
                try:
                    return await attempt()
                except Retry as exc:
                    failure = exc
                except EndpointError as exc:
                    raise self._fail(exc) from None
            tries += 1
            if tries > self.policy.max_retries:
                if failure.connection:
                    raise self._fail(EndpointUnreachable(
                        f"{self.what} {self.url} is unreachable: no answer after {self.policy.max_retries} retries "
                        f"({describe(failure.error)})", self.url)) from None
                raise self._fail(EndpointError(f"giving up on {self.what} {self.url} after "
                                                  f"{self.policy.max_retries} retries: {describe(failure.error)}")) from None
            self.retries += 1
            await self.stop.sleep(self.policy.delay(tries, self._rng, failure.server_asks))

    def _fail(self, error: EndpointError) -> EndpointError:
        """The error to raise: with ``stop_on_failure`` the run's first failure, which stops every request."""
        return self.stop.set(error) if self.stop_on_failure else error


def describe(exc: BaseException) -> str:
    """``Type: message`` of an error, with its cause when the message alone says little."""
    text = f"{type(exc).__name__}: {exc}"
    cause: Any = exc.__cause__
    if cause is not None and str(cause) and str(cause) not in text:
        text += f" ({type(cause).__name__}: {cause})"
    return text
