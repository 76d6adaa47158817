"""What ``serve``'s ``/health`` knows of the upstream: its last answers and failures, the requests waiting for it, and a
probe that tells a hung upstream from a busy one (docs/deploy.md, "Health").

The server marks each upstream answer and failure (``ok``, ``failed``) and each request's wait
(``begin``, ``end``); ``probe`` asks the upstream itself (``GET /models``, at most every
``PROBE_EVERY`` s, within ``PROBE_TIMEOUT`` s). No answer in time while no request waits is down;
while requests wait, a request waiting past ``stall_after`` s with no answer from the upstream
meanwhile is a stall, which shows before any timeout.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

__all__ = ["PROBE_EVERY", "PROBE_TIMEOUT", "UpstreamWatch"]

PROBE_TIMEOUT = 3.0  # seconds a /health probe of the upstream may take
PROBE_EVERY = 2.0  # at most one probe per this many seconds


class UpstreamWatch:
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
        """The upstream answered."""
        self.last_success, self.answered = time.time(), time.monotonic()

    def failed(self, code: str) -> None:
        """A call failed with the caller's error ``code`` (``upstream_unavailable``, ``upstream_auth``, ...)."""
        self.last_failure, self.last_error = time.time(), code

    def begin(self) -> int:
        """A request starts waiting for the upstream; returns its token for ``end``."""
        self._tokens += 1
        self.in_flight[self._tokens] = time.monotonic()
        return self._tokens

    def end(self, token: int) -> None:
        """The request of ``token`` waits no more."""
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
        """``/health``'s ``upstream`` object: state (up, down, stalled, unknown), last success and failure, stalls."""
        def stamp(t: float | None) -> str | None:
            return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
        stalled = self.stalled()
        state = "down" if self.down else "stalled" if stalled else "up" if self.last_success is not None else \
            "unknown"
        return {"state": state, "last_success": stamp(self.last_success), "last_failure": stamp(self.last_failure),
                "last_error": self.last_error, "stalled_requests": stalled}

    async def probe(self, router: Any) -> None:
        """Ask the upstream (``router.probe``) unless it was asked less than ``PROBE_EVERY`` s ago, and note what it
        said: no answer within ``PROBE_TIMEOUT`` s or a 5xx is down, 401/403 a refused key, anything else up."""
        async with self.probe_lock:
            now = time.monotonic()
            if now - self.last_probe < PROBE_EVERY:
                return
            self.last_probe = now
            try:  # the whole probe within the timeout (waiting for a pooled connection too)
                status = await asyncio.wait_for(router.probe(PROBE_TIMEOUT), PROBE_TIMEOUT)
            except asyncio.TimeoutError:
                status = None
        if status is None and (self.answered >= now or self.in_flight):
            # no answer to the probe, but requests were answered meanwhile (busy, not hung), or requests are
            # waiting, ahead of which an upstream may put the probe (llama.cpp's server answers /models between
            # completions): whether those stall decides (``stall_after``)
            return
        if status is None or status >= 500:
            self.failed("upstream_unavailable")
        elif status in (401, 403):
            self.failed("upstream_auth")
        else:  # it answered (a 404 from an upstream without /models is an answer)
            self.ok()
