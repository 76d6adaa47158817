"""What ``serve`` tells a caller when the upstream fails, and what it writes to its own log (secrets masked).

A caller gets the project's own code and message, never the upstream's text, address or status as
its own: ``upstream_auth`` (502) when the upstream refuses the server's key (401/403),
``upstream_rejected`` (502, with ``upstream_status``) for another refusal, ``upstream_unavailable``
(502) when it cannot be reached or keeps failing. The upstream's own message goes to the server's
log only, with every secret the server knows masked (``Masker``), also where a provider echoes part of one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from iapo_gym.deploy.params import RequestError
from iapo_gym.llm.retry import EndpointError

__all__ = ["ERROR_TYPES", "MASK", "Masker", "error_body", "upstream_error"]

MASK = "***"
WINDOW = 6  # a run of this many characters of a secret is masked wherever it appears
MAX_LOGGED = 4000  # characters of one upstream message kept in the log
ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error", 421: "invalid_request_error",
               429: "rate_limit_error", 502: "upstream_error", 503: "server_error", 504: "server_error"}


def error_body(exc: RequestError) -> bytes:
    """The OpenAI-shaped error body of ``exc``: ``{"error": {"message", "type", "param", "code", ...}}``."""
    kind = ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "server_error")
    return json.dumps({"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code,
                                 **exc.extra}}).encode()


class Masker:
    """Masks every run of ``WINDOW`` or more characters of any known secret (whole secrets when shorter)."""

    def __init__(self, secrets: Iterable[str | None]) -> None:
        """``secrets``: the values to mask (None and empty ones are skipped)."""
        self._pieces: dict[int, set[str]] = {}
        for secret in secrets:
            if not secret:
                continue
            size = min(WINDOW, len(secret))
            self._pieces.setdefault(size, set()).update(secret[i:i + size] for i in range(len(secret) - size + 1))

    def __call__(self, text: str) -> str:
        """``text`` (cut to ``MAX_LOGGED`` characters) with every piece of a secret replaced by ``MASK``."""
        text = text[:MAX_LOGGED]
        if not self._pieces:
            return text
        hidden = bytearray(len(text))
        for size, pieces in self._pieces.items():
            for i in range(len(text) - size + 1):
                if text[i:i + size] in pieces:
                    hidden[i:i + size] = b"\x01" * size
        if not any(hidden):
            return text
        out: list[str] = []
        for i, ch in enumerate(text):
            if not hidden[i]:
                out.append(ch)
            elif i == 0 or not hidden[i - 1]:
                out.append(MASK)
        return "".join(out)


def upstream_error(exc: EndpointError) -> RequestError:
    """The caller's error for an upstream failure (module docstring); the upstream's message is not in it."""
    status = exc.status
    if status in (401, 403):
        return RequestError(502, "the upstream refused this server's credentials; the operator must check the "
                                 "upstream key", "upstream_auth")
    if status is not None:
        return RequestError(502, f"the upstream rejected the request with HTTP {status}", "upstream_rejected",
                            extra={"upstream_status": status})
    return RequestError(502, "the upstream is unavailable (no answer, or it kept failing); try again later",
                        "upstream_unavailable", headers={"Retry-After": "5"})
