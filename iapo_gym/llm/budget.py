"""A spending budget shared by every process of a deployment and kept across restarts: requests, tokens and money
per sliding window (a minute, an hour, a day) or in total.

One class, ``Budget``, serves a server's rate (``iapo-gym serve --rate``) and a lifetime cap (the window
``total``, of infinite length). A request is admitted by reserving its worst case (``Spend``) in every
window; it settles with what it actually spent. Settled spend plus reservations never passes a limit
within any window, whatever the number of processes, because every admission and settlement is one
atomic transaction on the store:

- ``SQLiteStore`` (the default of ``serve``): one database file, WAL mode, each transaction
  ``BEGIN IMMEDIATE`` (one writer at a time across processes; a process killed mid-transaction leaves
  nothing half-written);
- ``RedisStore`` (``redis://host:port/db``, where the processes span machines): optimistic
  ``WATCH``/``MULTI``/``EXEC`` on one key, retried when another process wrote in between;
- ``MemoryStore``: one process, nothing persisted.

The state of one budget (one deployment name) is the settled spend in slots of each window, and
the reservations in flight. Windows slide: a spend settled at time t counts in a window of length W
until t + W plus at most one slot (W / ``SLOTS``), so no window boundary lets twice a limit through
and nothing is ever under-counted. A spend is charged when it settles (never earlier than it
happened). A reservation expires at its ``hold`` (a server gives its request deadline plus
``EXPIRY_MARGIN``): a process killed while a request was in flight cannot settle it, so the
reservation is then charged at its whole worst case, never at zero, since the upstream may have been
paid. A settlement after expiry changes nothing (the worst case stays charged).

The clock is the caller's (``time.time`` by default): processes sharing a Redis store from several
machines need clocks in step (NTP), to within a slot.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

__all__ = ["EXPIRY_MARGIN", "SLOTS", "UNITS", "WINDOWS", "Budget", "BudgetStore", "MemoryStore", "Rate", "RateLimited",
           "RedisStore", "Reservation", "SQLiteStore", "Spend", "open_store", "parse_rate"]

#: Window lengths in seconds; ``total`` is a lifetime cap.
WINDOWS = {"minute": 60.0, "hour": 3600.0, "day": 86400.0, "total": math.inf}
#: What a rate limits: ``requests`` (caller requests admitted, and separately upstream HTTP attempts sent, each at
#: most the limit), ``tokens`` (upstream prompt plus completion tokens), ``cost`` (money at the endpoints' prices).
UNITS = ("requests", "tokens", "cost")
#: Slots per finite window: a spend counts for its window's length plus at most one slot (1/60 of it).
SLOTS = 60
#: Seconds past a request's deadline after which its unsettled reservation counts as spent whole (room for the
#: settlement's own transaction and for clocks a little out of step).
EXPIRY_MARGIN = 10.0
STATE_VERSION = 1
#: No stored amount or time reaches this (a larger one is a damaged state).
MAX_AMOUNT = 1e18
#: Attempts of one Redis transaction when other processes keep changing the key meanwhile.
REDIS_ATTEMPTS = 1000


@dataclass(frozen=True)
class Spend:
    """What one request may spend or has spent: caller requests, upstream HTTP attempts, tokens, money."""

    requests: int = 0  # caller requests
    upstream: int = 0  # upstream HTTP attempts (each retry counts)
    tokens: int = 0  # upstream prompt plus completion tokens
    cost: float = 0.0  # money, in the prices' currency

    def as_list(self) -> list[float]:
        """The four amounts in field order (the stores' format)."""
        return [self.requests, self.upstream, self.tokens, self.cost]

    def measures(self, unit: str) -> tuple[float, ...]:
        """The amounts a rate of ``unit`` limits (``requests``: the caller's and the upstream's, each)."""
        if unit == "requests":
            return (self.requests, self.upstream)
        return (self.tokens,) if unit == "tokens" else (self.cost,)


@dataclass(frozen=True)
class Rate:
    """One limit: at most ``limit`` of ``unit`` per ``window`` (``minute``, ``hour``, ``day``, or ``total``)."""

    unit: str
    window: str
    limit: float

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"a rate's unit is one of {list(UNITS)}, got {self.unit!r}")
        if self.window not in WINDOWS:
            raise ValueError(f"a rate's window is one of {list(WINDOWS)}, got {self.window!r}")
        if not (isinstance(self.limit, int | float) and math.isfinite(self.limit) and self.limit > 0):
            raise ValueError(f"the {self.unit} per {self.window} limit must be a positive number, got {self.limit!r}")

    @property
    def name(self) -> str:
        """``UNIT/WINDOW`` as written on the command line."""
        return f"{self.unit}/{self.window}"

    def describe(self) -> str:
        """The limit in words, for messages."""
        what = {"requests": f"{self.limit:g} requests", "tokens": f"{self.limit:g} tokens",
                "cost": f"a cost of {self.limit:g}"}[self.unit]
        return f"{what} in total" if self.window == "total" else f"{what} per {self.window}"


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
    """A request does not fit the budget now; ``retry_after``: seconds until it may (``inf``: never, it is larger
    than a limit on its own or the window is ``total``)."""

    def __init__(self, message: str, retry_after: float) -> None:
        """``message`` names the limit reached."""
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Reservation:
    """A request's worst case held in the budget until it settles (or expires at ``expires``)."""

    id: str
    worst: Spend
    expires: float
    settled: bool = field(default=False)


# ---- the state of one budget and its arithmetic (the same whatever the store) ---------------------------------------

State = dict[str, Any]


def _new_state() -> State:
    return {"version": STATE_VERSION, "slots": {w: {} for w in WINDOWS}, "reservations": {}}


def _slot_length(window: str) -> float:
    seconds = WINDOWS[window]
    return seconds / SLOTS if math.isfinite(seconds) else math.inf


def _slot(window: str, t: float) -> int:
    length = _slot_length(window)
    return 0 if math.isinf(length) else math.floor(t / length)


def _live(window: str, index: int, now: float) -> bool:
    """Whether slot ``index`` still counts at ``now`` (its end is within the window)."""
    length = _slot_length(window)
    return math.isinf(length) or (index + 1) * length > now - WINDOWS[window]


def _charge(state: State, amounts: Sequence[float], t: float, now: float) -> None:
    """Add a spend at time ``t`` to every window's slot, dropping the slots that no longer count."""
    for window, slots in state["slots"].items():
        key = str(_slot(window, t))
        if _live(window, int(key), now):
            old = slots.get(key, [0, 0, 0, 0.0])
            slots[key] = [a + b for a, b in zip(old, amounts, strict=True)]
        for k in [k for k in slots if not _live(window, int(k), now)]:
            del slots[k]


def _expire(state: State, now: float) -> None:
    """Charge each reservation past its expiry at its whole worst case (at its expiry time) and drop it."""
    held = state["reservations"]
    for rid in [rid for rid, r in held.items() if r[0] <= now]:
        expires, *amounts = held.pop(rid)
        _charge(state, amounts, min(expires, now), now)


def _settled(state: State, window: str, now: float) -> list[float]:
    total = [0.0, 0.0, 0.0, 0.0]
    for key, amounts in state["slots"][window].items():
        if _live(window, int(key), now):
            total = [a + b for a, b in zip(total, amounts, strict=True)]
    return total


def _reserved(state: State) -> list[float]:
    total = [0.0, 0.0, 0.0, 0.0]
    for r in state["reservations"].values():
        total = [a + b for a, b in zip(total, r[1:], strict=True)]
    return total


_MEASURES = {"requests": (0, 1), "tokens": (2,), "cost": (3,)}


def _wait(state: State, rate: Rate, index: int, worst: float, now: float) -> float:
    """Seconds until the settled spend in ``rate``'s window leaves room for ``worst`` (inf: never, a ``total``)."""
    if rate.window == "total":
        return math.inf
    length = _slot_length(rate.window)
    slots = sorted((int(k), v[index]) for k, v in state["slots"][rate.window].items() if _live(rate.window, int(k), now))
    left = sum(v for _, v in slots)
    for k, v in slots:  # the oldest slot stops counting first
        left -= v
        if left + worst <= rate.limit:
            return max((k + 1) * length + WINDOWS[rate.window] - now, 0.001)
    return 0.001


def _check(state: State, rates: Sequence[Rate], worst: Spend, now: float) -> None:
    """Raise ``RateLimited`` unless ``worst`` fits every rate's window on top of the settled and reserved spend."""
    _expire(state, now)
    amounts = worst.as_list()
    reserved = _reserved(state)
    for rate in rates:
        settled = _settled(state, rate.window, now)
        for i in _MEASURES[rate.unit]:
            if settled[i] + reserved[i] + amounts[i] <= rate.limit:
                continue
            if settled[i] + amounts[i] <= rate.limit:  # requests in flight hold the room: they settle soon
                raise RateLimited(f"the budget of {rate.describe()} is reached", 1.0)
            raise RateLimited(f"the budget of {rate.describe()} is reached", _wait(state, rate, i, amounts[i], now))


def _admit(state: State, rates: Sequence[Rate], rid: str, worst: Spend, expires: float, now: float) -> None:
    _check(state, rates, worst, now)
    state["reservations"][rid] = [expires, *worst.as_list()]


def _settle(state: State, rid: str, used: Spend, now: float) -> bool:
    _expire(state, now)
    if state["reservations"].pop(rid, None) is None:
        return False  # expired (charged whole) or unknown
    _charge(state, used.as_list(), now, now)
    return True


# ---- stores ---------------------------------------------------------------------------------------------------------

class BudgetStore(Protocol):
    """Where a budget's state lives: ``transact(fn)`` runs ``fn`` on the state atomically and keeps its changes
    (none when ``fn`` raises)."""

    url: str

    def transact(self, fn: Callable[[State], Any]) -> Any:
        """Run ``fn`` on the state as one atomic transaction; its changes are kept unless it raises."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...


def _amounts(value: Any, size: int) -> bool:
    """Whether ``value`` is a list of ``size`` numbers from 0 to below ``MAX_AMOUNT`` (the first of 5 may also be
    +inf: an expiry that never comes)."""
    return isinstance(value, list) and len(value) == size and all(
        isinstance(v, int | float) and not isinstance(v, bool) and
        (0 <= v < MAX_AMOUNT or (i == 0 and size == 5 and v == math.inf)) for i, v in enumerate(value))


def _loads(text: str | bytes | None, where: str) -> State:
    """The state stored as ``text`` (None: a new budget); ValueError naming ``where`` and the fault when it is not
    one (a store written by something else, or damaged)."""
    if text is None:
        return _new_state()
    try:
        state = json.loads(text)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        problem = f"not JSON ({type(exc).__name__})"
    else:
        problem = _state_fault(state)
    if problem:
        raise ValueError(f"{where}: {problem}, not a budget state of version {STATE_VERSION}; remove the deployment's "
                         "entry to start its budget afresh")
    state["slots"].update({w: {} for w in WINDOWS if w not in state["slots"]})
    result: State = state
    return result


def _state_fault(state: Any) -> str:
    """What is wrong with a stored state ('' for nothing)."""
    if not isinstance(state, dict):
        return f"a JSON {type(state).__name__}"
    if state.get("version") != STATE_VERSION:
        return f"version {str(state.get('version'))[:20]!r}"
    slots, held = state.get("slots"), state.get("reservations")
    if not isinstance(slots, dict) or not isinstance(held, dict):
        return "slots or reservations missing"
    for window, table in slots.items():
        if window not in WINDOWS or not isinstance(table, dict):
            return f"slots of an unknown window {str(window)[:20]!r}"
        for key, value in table.items():
            if not (key.lstrip("-").isdigit() and len(key) < 16):
                return f"slot {key[:20]!r} of the {window} window"
            if not _amounts(value, 4):
                return f"amounts of slot {key} of the {window} window"
    for rid, value in held.items():
        if not _amounts(value, 5):
            return f"reservation {rid[:40]!r}"
    return ""


class MemoryStore:
    """A budget in this process's memory only (nothing shared, nothing kept)."""

    url = "memory:"

    def __init__(self) -> None:
        self._state = _new_state()
        self._lock = threading.Lock()

    def transact(self, fn: Callable[[State], Any]) -> Any:
        """``fn`` on the state under a lock. The state's functions raise before they change anything but the
        expiry of reservations (a change the next transaction would make anyway), so nothing needs undoing."""
        with self._lock:
            return fn(self._state)

    def close(self) -> None:
        """Nothing to release."""


class SQLiteStore:
    """A budget in an SQLite file shared by the processes of one machine: WAL, ``BEGIN IMMEDIATE`` per transaction.

    ``name`` keys the budget within the file, so deployments may share a file without sharing limits.
    """

    def __init__(self, path: str | os.PathLike[str], name: str, timeout: float = 30.0) -> None:
        """``timeout``: seconds to wait for another process's transaction before failing. The file is opened at
        the first transaction, in each process (a connection never crosses a fork)."""
        self.path = Path(path)
        self.name = name
        self.url = f"sqlite:///{self.path}"
        self.timeout = timeout
        if not self.path.parent.is_dir():
            raise ValueError(f"the budget store's folder {str(self.path.parent)!r} does not exist")
        if not os.access(self.path if self.path.exists() else self.path.parent, os.R_OK | os.W_OK):
            raise ValueError(f"the budget store {str(self.path)!r} is not writable by this user")
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._pid = -1

    def _connect(self) -> sqlite3.Connection:
        """This process's connection, opened at its first use: WAL mode, the table created if missing.

        Switching a new file to WAL takes a lock that SQLite does not wait for (its busy handler is not asked),
        so processes opening a new store at once see "database is locked": the opening is tried again, after
        5 ms, 10 ms, ... up to 100 ms apart, until ``timeout`` seconds have passed."""
        if self._db is None or self._pid != os.getpid():
            deadline = time.monotonic() + self.timeout
            pause = 0.005
            while True:
                db = None
                try:
                    db = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None,
                                         check_same_thread=False)
                    db.execute("PRAGMA journal_mode=WAL")
                    db.execute("PRAGMA synchronous=NORMAL")
                    db.execute("CREATE TABLE IF NOT EXISTS budget (name TEXT PRIMARY KEY, state TEXT NOT NULL)")
                    break
                except sqlite3.Error as exc:
                    if db is not None:
                        db.close()
                    busy = isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))
                    if not busy or time.monotonic() + pause > deadline:
                        raise ValueError(f"the budget store {str(self.path)!r} cannot be opened: {exc}") from None
                    time.sleep(pause)
                    pause = min(0.1, 2 * pause)
            self._db, self._pid = db, os.getpid()
        return self._db

    def transact(self, fn: Callable[[State], Any]) -> Any:
        """``fn`` on the state inside ``BEGIN IMMEDIATE``; committed when it returns, rolled back when it raises."""
        where = f"the budget store {str(self.path)!r}"
        with self._lock:
            db = self._connect()
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise ValueError(f"{where} cannot be written: {exc}") from None
            try:
                row = db.execute("SELECT state FROM budget WHERE name = ?", (self.name,)).fetchone()
                state = _loads(row[0] if row else None, where)
                out = fn(state)
                db.execute("INSERT INTO budget (name, state) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET "
                           "state = excluded.state", (self.name, json.dumps(state, separators=(",", ":"))))
                db.execute("COMMIT")
            except BaseException as exc:
                db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise ValueError(f"{where} failed: {exc}") from None
                raise
            return out

    def close(self) -> None:
        """Close the connection (a later transaction opens it again)."""
        with self._lock:
            if self._db is not None and self._pid == os.getpid():
                self._db.close()
            self._db = None


class RedisStore:
    """A budget in one Redis key (``iapo-gym:budget:NAME``) shared by processes on several machines.

    Each transaction reads the key under ``WATCH`` and writes it in ``MULTI``/``EXEC``; when another
    process wrote in between, it runs again on the new state.
    """

    def __init__(self, url: str, name: str) -> None:
        """``url``: ``redis://[:password@]host:port/db`` (``rediss://`` for TLS)."""
        try:
            import redis
        except ImportError:
            raise ValueError('a redis:// budget store needs the redis client: pip install "iapo-gym[serve]"') \
                from None
        parts = urlsplit(url)
        self.url = f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path}"  # no password
        self.name = name
        self.key = f"iapo-gym:budget:{name}"
        self._redis = redis
        self._client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=10)
        try:
            self._client.ping()
        except redis.RedisError as exc:
            raise ValueError(f"the budget store {self.url} does not answer: {type(exc).__name__}: {exc}") from None

    def transact(self, fn: Callable[[State], Any]) -> Any:
        """``fn`` on the state read under ``WATCH``, written with ``MULTI``/``EXEC``; again if the key changed (up
        to ``REDIS_ATTEMPTS`` times, then ValueError: the store is too contended to answer)."""
        for _ in range(REDIS_ATTEMPTS):
            with self._client.pipeline() as pipe:
                try:
                    pipe.watch(self.key)
                    state = _loads(pipe.get(self.key), f"the budget store {self.url} (key {self.key})")
                    out = fn(state)
                    pipe.multi()
                    pipe.set(self.key, json.dumps(state, separators=(",", ":")))
                    pipe.execute()
                    return out
                except self._redis.WatchError:
                    continue
        raise ValueError(f"the budget store {self.url}: the key {self.key} changed under each of {REDIS_ATTEMPTS} "
                         "attempts to update it")

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()


def open_store(url: str, name: str) -> BudgetStore:
    """The store at ``url``: ``sqlite:///PATH`` or a plain file path (SQLite), ``redis://host:port/db``
    (``rediss://`` for TLS); ``name`` keys the budget within it. (A budget of one process only: ``MemoryStore``.)"""
    if not name or len(name) > 200:
        raise ValueError(f"a budget name is 1 to 200 characters, got {name!r}")
    scheme = url.split(":", 1)[0].lower() if "://" in url else ""
    if scheme in ("redis", "rediss"):
        return RedisStore(url, name)
    if scheme == "sqlite":
        path = url[len("sqlite://"):]
        if not path.startswith("/") or path == "/":
            raise ValueError(f"a SQLite budget store is sqlite:///PATH (an absolute path after the third slash), "
                             f"got {url!r}")
        return SQLiteStore(path, name)
    if scheme:
        raise ValueError(f"a budget store is sqlite:///PATH, a file path, or redis://HOST:PORT/DB; got the scheme "
                         f"{scheme!r}")
    return SQLiteStore(url, name)


# ---- the budget ---------------------------------------------------------------------------------------------------

class Budget:
    """Limits (``Rate``) on the spend shared through a store (module docstring).

    ``admit(worst)`` reserves a request's worst case or raises ``RateLimited``; ``settle`` replaces the
    reservation by what was spent. Thread-safe (each call is one store transaction); blocking.
    """

    def __init__(self, rates: Sequence[Rate] = (), store: BudgetStore | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``store``: where the spend is shared (default: this process's memory)."""
        self.rates = tuple(rates)
        seen = set()
        for r in self.rates:
            if r.name in seen:
                raise ValueError(f"{r.name} is given twice")
            seen.add(r.name)
        self.store: BudgetStore = store if store is not None else MemoryStore()
        self.clock = clock

    def __bool__(self) -> bool:
        return bool(self.rates)

    def check(self, worst: Spend, what: str = "one request's worst case") -> None:
        """Raise ValueError when ``worst`` alone passes a limit (such a request could never be admitted)."""
        for rate in self.rates:
            amount = max(worst.measures(rate.unit))
            if amount > rate.limit:
                raise ValueError(f"the budget's {rate.name} limit of {rate.limit:g} is below {what} ({amount:g}); "
                                 "raise it")

    def admit(self, worst: Spend, hold: float) -> Reservation:
        """Reserve ``worst`` for at most ``hold`` seconds (then it counts as spent whole), or raise ``RateLimited``."""
        for rate in self.rates:
            if max(worst.measures(rate.unit)) > rate.limit:
                raise RateLimited(f"this request's worst case is more than the budget of {rate.describe()}", math.inf)
        now = self.clock()
        res = Reservation(uuid.uuid4().hex, worst, now + hold)
        self.store.transact(lambda state: _admit(state, self.rates, res.id, worst, res.expires, now))
        return res

    def fits(self, worst: Spend) -> bool:
        """Whether a request of at most ``worst`` would be admitted now (nothing is reserved)."""
        now = self.clock()
        try:
            self.store.transact(lambda state: _check(state, self.rates, worst, now))
        except RateLimited:
            return False
        return True

    def settle(self, reservation: Reservation, used: Spend) -> None:
        """Replace ``reservation`` by ``used`` (charged now); after its expiry the worst case stays charged."""
        if reservation.settled:
            return
        reservation.settled = True
        now = self.clock()
        self.store.transact(lambda state: _settle(state, reservation.id, used, now))

    def spent(self) -> dict[str, dict[str, float]]:
        """Per window: the settled spend in it now and the reservations in flight (``Spend`` fields as keys)."""
        now = self.clock()

        def read(state: State) -> dict[str, dict[str, float]]:
            _expire(state, now)
            reserved = _reserved(state)
            names = ("requests", "upstream", "tokens", "cost")
            out = {w: dict(zip(names, _settled(state, w, now), strict=True)) for w in WINDOWS}
            out["reserved"] = dict(zip(names, reserved, strict=True))
            return out
        result: dict[str, dict[str, float]] = self.store.transact(read)
        return result

    def report(self, spend: bool) -> dict[str, object]:
        """Each limit, and with ``spend`` what its window holds now across every process (settled and reserved)."""
        out: dict[str, object] = {r.name: {"limit": r.limit} for r in self.rates}
        if not spend or not self.rates:
            return out
        spent = self.spent()
        reserved = spent["reserved"]
        for r in self.rates:
            used = spent[r.window]
            entry: dict[str, object] = {"limit": r.limit}
            if r.unit == "requests":
                entry.update(used=int(used["requests"]), upstream=int(used["upstream"]),
                             reserved=int(reserved["requests"]), upstream_reserved=int(reserved["upstream"]))
            elif r.unit == "tokens":
                entry.update(used=int(used["tokens"]), reserved=int(reserved["tokens"]))
            else:
                entry.update(used=round(used["cost"], 9), reserved=round(reserved["cost"], 9))
            out[r.name] = entry
        return out

    def close(self) -> None:
        """Release the store."""
        self.store.close()
