"""What ``iapo-gym serve`` lets its callers cause: request limits, and the serving budget shared by its processes.

``ServeLimits`` bounds each request (body size, rendered prompt length, a deadline over all N
completions, at most one retry of an upstream call), each connection (head size and time, body time,
idle keep-alive: ``iapo_gym.deploy.connections``), the hosts answered (``allowed_hosts``, ``host_name``)
and the server as a whole (requests answered at once, requests waiting for a slot, connections per
process, when requests waiting for the upstream are a stall). The serving budget is an ``iapo_gym.llm.budget.Budget`` of
``--rate`` limits (requests, tokens and money per sliding minute, hour, day or in total) kept in a
store every process of the deployment shares and that outlives them (``budget_from_args``: SQLite
next to the policy file by default, or Redis). It is separate from a collection spec's ``[budget]``,
which caps one collection's lifetime spend and does not apply to ``serve``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iapo_gym.llm.budget import Budget, Rate, RateLimited, open_store, parse_rate

__all__ = ["BUDGET_FILE", "Rate", "RateLimited", "ServeLimits", "budget_from_args", "check_priced", "default_budget_name",
           "default_budget_store", "host_name", "parse_rate"]

#: The default budget store: this SQLite file in the policy file's folder.
BUDGET_FILE = "budget.sqlite"


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
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides the bound address and localhost's: 421 else
    max_header_bytes: int = 16_384  # request line plus headers past this: 431, connection closed
    header_timeout: float = 10.0  # seconds from a connection's (or a request's) first byte to its last header: 408
    body_timeout: float = 30.0  # seconds to receive a request body (also within the deadline): 408
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    max_connections: int = 1024  # open connections per process; past it the oldest idle one is closed
    stall_after: float = 10.0  # a request in flight this long with no upstream answer meanwhile: /health 503

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "max_concurrency", "max_header_bytes", "max_connections"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if self.max_queue < 0 or self.upstream_retries < 0:
            raise ValueError(f"max_queue and upstream_retries must be >= 0, got {self.max_queue}, "
                             f"{self.upstream_retries}")
        for name in ("deadline", "header_timeout", "body_timeout", "keep_alive_timeout", "stall_after"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for host in self.allowed_hosts:
            host_name(host)  # raises naming the bad entry


def host_name(text: str) -> tuple[str, int | None]:
    """A Host header's (or an ``--allowed-host`` entry's) name, lower-cased, and its port (None when absent).

    ``example.com``, ``example.com:8000``, ``127.0.0.1``, ``[::1]:8000`` (an IPv6 address in brackets);
    raises ``ValueError`` naming ``text`` for anything else (a scheme, a path, spaces, a bad port).
    """
    value = text.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name, rest = value[:end + 1], value[end + 1:]
        ok = end > 1 and all(c in "0123456789abcdef:." for c in name[1:-1])
    else:
        name, colon, port_text = value.partition(":")
        rest = colon + port_text
        ok = bool(name) and all(c.isalnum() or c in "-._" for c in name) and name.isascii()
    if ok and rest and not (rest[0] == ":" and rest[1:].isdigit() and 0 < int(rest[1:]) < 65536):
        ok = False
    if not ok:
        raise ValueError(f"a host is NAME or NAME:PORT (e.g. api.example.com, 10.0.0.5:8000, [::1]), got {text!r}")
    return name.rstrip("."), (int(rest[1:]) if rest else None)


def default_budget_store(policy: str | os.PathLike[str]) -> str:
    """``serve``'s budget store without ``--budget-store``: ``budget.sqlite`` in the policy file's folder."""
    return "sqlite:///" + str(Path(policy).resolve().parent / BUDGET_FILE)


def default_budget_name(policy: str | os.PathLike[str], spec: str | os.PathLike[str]) -> str:
    """``serve``'s budget name without ``--budget-name``: the policy's and the spec's file names and a digest of
    their absolute paths, so the processes serving one policy file with one spec share a budget, and others don't."""
    a, b = Path(policy).resolve(), Path(spec).resolve()
    digest = hashlib.sha256(f"{a}\0{b}".encode()).hexdigest()[:12]
    return f"{a.name}+{b.name}@{digest}"


def check_priced(rates: Sequence[Rate], spec: Any) -> None:
    """Raise ValueError when a cost rate is given for a spec without prices (money could not be counted)."""
    if any(r.unit == "cost" for r in rates) and not spec.priced:
        raise ValueError("a cost rate counts money at the upstream spec's prices, but its endpoints give no "
                         "input_price_per_million and output_price_per_million (docs/collect.md, \"Cost in money\")")


def budget_from_args(args: argparse.Namespace, router: Any) -> Budget:
    """The serving budget of ``iapo-gym serve``'s parsed arguments (``--rate``, ``--budget-store``, ``--budget-name``)
    for ``router``'s policy and spec; no ``--rate``: no budget (no store opened). Raises ValueError on a bad rate,
    a cost rate for a spec without prices, or a store that cannot be opened."""
    rates = [parse_rate(r) for r in getattr(args, "rate", None) or ()]
    if not rates:
        return Budget()
    check_priced(rates, router.spec)
    url = getattr(args, "budget_store", None) or default_budget_store(args.policy)
    name = getattr(args, "budget_name", None) or default_budget_name(args.policy, args.upstream)
    return Budget(rates, open_store(url, name))
