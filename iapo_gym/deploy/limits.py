"""What one ``iapo-gym serve`` process lets its callers cause: request limits and a serving budget that is a rate.

``ServeLimits`` bounds each request (body size, rendered prompt length, a deadline over all N
completions, at most one retry of an upstream call) and the server as a whole (requests answered at
once, requests waiting for a slot). ``RateBudget`` is the serving budget: caller requests, upstream
completion tokens and, when the spec prices tokens, money per minute and per day, in fixed UTC
windows; a request is admitted only when its worst case fits every window, and settles with what the
upstream reported. It is separate from a collection spec's ``[budget]``, which caps one run's lifetime
spend and does not apply to ``serve``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Rate", "RateBudget", "RateLimited", "Reservation", "ServeLimits", "parse_rate"]

WINDOWS = {"minute": 60, "day": 86400}
UNITS = ("requests", "tokens", "cost")


@dataclass(frozen=True)
class ServeLimits:
    """Per-request and per-server bounds of ``serve`` (docs/deploy.md, "Limits")."""

    max_body_bytes: int = 1 << 20  # request bodies past this get 413, unread
    max_prompt_chars: int = 32_000  # the rendered prompt (template + caller's text) past this gets 400
    deadline: float = 120.0  # seconds for the whole request (queue, all N completions, retries): 504 after
    max_concurrency: int = 64  # requests answered at once, each with its own N upstream calls
    max_queue: int = 64  # requests waiting for a slot; past this 503 with Retry-After
    upstream_retries: int = 1  # retries of one upstream call (the spec's endpoint.max_retries, at most this)
    cors_origins: tuple[str, ...] = ()  # origins allowed by CORS ("*" for any); none: no CORS headers

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "max_concurrency"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if self.max_queue < 0 or self.upstream_retries < 0:
            raise ValueError(f"max_queue and upstream_retries must be >= 0, got {self.max_queue}, "
                             f"{self.upstream_retries}")
        if not (math.isfinite(self.deadline) and self.deadline > 0):
            raise ValueError(f"deadline must be a positive number of seconds, got {self.deadline!r}")


@dataclass(frozen=True)
class Rate:
    """One limit of the serving budget: at most ``limit`` of ``unit`` per ``window`` ("minute" or "day")."""

    unit: str  # "requests" (caller requests admitted), "tokens" (upstream completion tokens), "cost"
    window: str
    limit: float

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"a rate's unit is one of {list(UNITS)}, got {self.unit!r}")
        if self.window not in WINDOWS:
            raise ValueError(f"a rate's window is one of {list(WINDOWS)}, got {self.window!r}")
        if not (math.isfinite(self.limit) and self.limit > 0):
            raise ValueError(f"the {self.unit} per {self.window} limit must be a positive number, got {self.limit!r}")


def parse_rate(text: str) -> Rate:
    """``UNIT/WINDOW=LIMIT`` (``requests/minute=600``, ``tokens/day=2e6``, ``cost/day=5``) as a ``Rate``."""
    head, sep, value = text.partition("=")
    unit, slash, window = head.strip().partition("/")
    if not sep or not slash:
        raise ValueError(f"a rate is UNIT/WINDOW=LIMIT (e.g. requests/minute=600), got {text!r}")
    try:
        limit = float(value)
    except ValueError:
        raise ValueError(f"the limit of {text!r} is not a number") from None
    return Rate(unit.strip(), window.strip(), limit)


class RateLimited(RuntimeError):
    """A request does not fit the serving budget now; ``retry_after``: seconds until it may."""

    def __init__(self, message: str, retry_after: float) -> None:
        """``message`` names the limit reached."""
        super().__init__(message)
        self.retry_after = retry_after


class _Window:
    """The spend of one window length (minute or day): settled and reserved, reset when a new window starts."""

    __slots__ = ("reserved", "requests", "seconds", "start", "tokens")

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds
        self.start = -1.0
        self.requests = 0
        self.tokens = 0
        self.reserved = 0

    def roll(self, now: float) -> None:
        start = now - now % self.seconds
        if start != self.start:
            self.start, self.requests, self.tokens, self.reserved = start, 0, 0, 0

    def left(self, now: float) -> float:
        return self.start + self.seconds - now


@dataclass
class Reservation:
    """A request's worst case held in the budget until it settles."""

    tokens: int
    starts: tuple[float, ...]  # the windows it was reserved in (a rolled window has forgotten it)
    settled: bool = False


class RateBudget:
    """Caller requests, completion tokens and money per minute and per day (module docstring).

    ``admit(tokens)`` reserves one request of at most ``tokens`` completion tokens or raises
    ``RateLimited``; ``settle`` replaces the reservation by the tokens used. Settled plus reserved
    never passes a limit within a window. Single event loop; no locking needed.
    """

    def __init__(self, rates: Sequence[Rate] = (), price_per_1k_tokens: float = 0.0,
                 clock: Callable[[], float] = time.time) -> None:
        """``price_per_1k_tokens``: the spec's price of 1,000 completion tokens (needed by a cost rate)."""
        self.rates = tuple(rates)
        self.price = float(price_per_1k_tokens)
        if any(r.unit == "cost" for r in self.rates) and not self.price > 0:
            raise ValueError("a cost rate needs the upstream spec's budget.price_per_1k_tokens (it is 0)")
        seen = set()
        for r in self.rates:
            if (r.unit, r.window) in seen:
                raise ValueError(f"{r.unit}/{r.window} is given twice")
            seen.add((r.unit, r.window))
        self.clock = clock
        self._windows = {w: _Window(WINDOWS[w]) for w in sorted({r.window for r in self.rates})}

    def __bool__(self) -> bool:
        return bool(self.rates)

    def _token_limit(self, rate: Rate) -> float:
        return rate.limit if rate.unit == "tokens" else rate.limit * 1000.0 / self.price

    def largest(self) -> float:
        """The most tokens one request may reserve and still fit an empty window."""
        limits = [self._token_limit(r) for r in self.rates if r.unit != "requests"]
        return min(limits) if limits else math.inf

    def admit(self, tokens: int) -> Reservation:
        """Reserve one request of at most ``tokens`` completion tokens, or raise ``RateLimited``."""
        now = self.clock()
        for w in self._windows.values():
            w.roll(now)
        for r in self.rates:
            w = self._windows[r.window]
            if r.unit == "requests":
                if w.requests + 1 > r.limit:
                    raise RateLimited(f"the serving budget of {r.limit:g} requests per {r.window} is reached",
                                      w.left(now))
                continue
            limit = self._token_limit(r)
            if w.tokens + w.reserved + tokens > limit:
                # settled spend alone leaves no room: wait for the next window; else in-flight requests will settle
                wait = w.left(now) if w.tokens + tokens > limit else min(1.0, w.left(now))
                what = f"{r.limit:g} tokens" if r.unit == "tokens" else f"a cost of {r.limit:g}"
                raise RateLimited(f"the serving budget of {what} per {r.window} is reached", wait)
        for w in self._windows.values():
            w.requests += 1
            w.reserved += tokens
        return Reservation(tokens, tuple(w.start for w in self._windows.values()))

    def settle(self, reservation: Reservation, used: int) -> None:
        """Replace ``reservation`` by the ``used`` completion tokens (counted in the current windows)."""
        if reservation.settled:
            return
        reservation.settled = True
        now = self.clock()
        for w, start in zip(self._windows.values(), reservation.starts, strict=True):
            if w.start == start:
                w.reserved -= reservation.tokens
            w.roll(now)
            w.tokens += used

    def report(self, spend: bool) -> dict[str, object]:
        """The budget for ``/health``: the limits, and with ``spend`` what each window has used."""
        now = self.clock()
        out: dict[str, object] = {}
        for r in self.rates:
            w = self._windows[r.window]
            w.roll(now)
            entry: dict[str, object] = {"limit": r.limit}
            if spend:
                used = w.requests if r.unit == "requests" else w.tokens if r.unit == "tokens" else \
                    round(w.tokens * self.price / 1000.0, 6)
                entry.update(used=used, resets_in=round(w.left(now), 3))
            out[f"{r.unit}/{r.window}"] = entry
        return out
