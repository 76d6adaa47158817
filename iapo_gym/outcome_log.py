"""The outcome log of ``iapo-gym serve --log DIR``: one row per answered request, kept durably and bounded on disk.

Each row holds what an off-policy evaluation and a table build need of a served request (docs/deploy.md,
"Logging, feedback and off-policy evaluation"): its time, context (name and weights), arm (prompt id, N and
stopping rule), the completions drawn, the probability with which the arm was chosen (``propensity``: 1.0 for a
deterministic policy), the outcomes (majority vote: each completion's answer bucket and the vote; Best-of-N:
each completion's objective score vector and weighted score), tokens, money, the policy's cost per completion
of the arm's prompt (``unit_cost``: the unit the cost weights are in), the response id, and the caller's
``reward`` once feedback arrives (``POST /v1/feedback``). Never a key; the query text only when asked
(``--log-queries``).

Storage: SQLite files in ``DIR``, WAL mode, ``synchronous=FULL`` (each commit is flushed to the disk). Rows are
written by one thread of the log's own, in batches: a row's commit starts at most ``flush_ms`` milliseconds after
the request was answered (counted from when the row was queued, or once the thread's work before it ends, if that
takes longer), and at most ``batch`` rows go in one transaction (a backlog is committed in several transactions
back to back). So a process killed with -9 loses at most the rows of the requests answered in its last
``flush_ms`` milliseconds plus the time the thread takes to commit (one fsync; longer while it rotates a file or
joins feedback); a committed row is never lost or half-written (SQLite's transactions). Feedback is committed
before it is acknowledged.

Bounded on disk: when the current file ``outcomes.sqlite`` passes ``max_bytes`` (its committed pages), it is
checkpointed, closed and renamed ``outcomes.1.sqlite`` (the older ones shift to ``.2``, ``.3``, ...), a new
current file starts, and files past ``keep`` are deleted: at most ``keep + 1`` files, each about ``max_bytes``
(one batch more at most), plus the current file's WAL (at most about ``WAL_LIMIT`` after a checkpoint). The newest time of a
deleted file is remembered (``retained_after``): feedback for an older response id is refused as expired (410),
for an unknown newer one as not found (404). A response id carries its time (``new_response_id``).

One writing process per folder (the current file is renamed on rotation); readers (``iapo-gym data build``,
``iapo-gym evaluate-log``) may read while it writes.
"""

from __future__ import annotations

import json
import math
import os
import queue
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CURRENT", "DEFAULT_BATCH", "DEFAULT_FLUSH_MS", "DEFAULT_KEEP", "DEFAULT_MAX_BYTES", "FORMAT", "VERSION",
           "FeedbackResult", "LogError", "LogRow", "OutcomeLog", "log_files", "new_response_id", "read_log",
           "response_time"]

FORMAT = "iapo-gym-outcome-log"
VERSION = 1
CURRENT = "outcomes.sqlite"
#: Milliseconds a served row may wait before it is committed (the bound on what a kill -9 loses, with one commit).
DEFAULT_FLUSH_MS = 100
#: Rows per transaction at most.
DEFAULT_BATCH = 256
#: Size of the current file (and its WAL) past which it is rotated.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
#: Rotated files kept beside the current one (older ones are deleted).
DEFAULT_KEEP = 8
#: Bytes the current file's WAL is truncated to after a checkpoint (SQLite checkpoints every 1000 pages, 4 MB).
WAL_LIMIT = 4 * 1024 * 1024

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS requests (id TEXT PRIMARY KEY, time REAL NOT NULL, context TEXT NOT NULL, "
    "weights TEXT NOT NULL, prompt TEXT NOT NULL, n INTEGER NOT NULL, rule TEXT, drawn INTEGER NOT NULL, "
    "propensity REAL NOT NULL, outcomes TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, "
    "completion_tokens INTEGER NOT NULL, cost REAL, unit_cost REAL, query TEXT, reward TEXT, reward_time REAL)",
)
COLUMNS = ("id", "time", "context", "weights", "prompt", "n", "rule", "drawn", "propensity", "outcomes",
           "prompt_tokens", "completion_tokens", "cost", "unit_cost", "query", "reward", "reward_time")


class LogError(ValueError):
    """An outcome log that cannot be opened, written or read; the message names the file and the problem."""


def new_response_id(prefix: str, now: float | None = None) -> str:
    """A response id that carries its time: ``PREFIX`` + 12 hex digits of milliseconds since the epoch + 20 random
    hex digits (as long as the uuid4 hex ids it replaces)."""
    ms = int((time.time() if now is None else now) * 1000)
    return f"{prefix}{ms:012x}{secrets.token_hex(10)}"


def response_time(rid: str) -> float | None:
    """The time (s since the epoch) a response id of ``new_response_id`` carries; None for another id."""
    _, sep, tail = rid.rpartition("-")
    if not sep or len(tail) != 32:
        return None
    try:
        return int(tail[:12], 16) / 1000.0
    except ValueError:
        return None


@dataclass(frozen=True)
class LogRow:
    """One served request as logged (module docstring); ``reward`` is the feedback (None before it arrives)."""

    id: str
    time: float
    context: str
    weights: tuple[float, ...]
    prompt: str
    n: int
    rule: dict[str, Any] | None
    drawn: int
    propensity: float
    outcomes: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    cost: float | None
    unit_cost: float | None
    query: str | None
    reward: bool | float | list[float] | None
    reward_time: float | None

    @property
    def arm(self) -> tuple[str, int, str]:
        """(prompt id, N, the rule as canonical JSON or '') : what identifies the arm served."""
        return self.prompt, self.n, json.dumps(self.rule, sort_keys=True) if self.rule else ""

    def as_tuple(self) -> tuple[Any, ...]:
        """The row's columns as stored (``COLUMNS``)."""
        return (self.id, self.time, self.context, json.dumps(list(self.weights)), self.prompt, self.n,
                json.dumps(self.rule, sort_keys=True) if self.rule else None, self.drawn, self.propensity,
                json.dumps(self.outcomes, separators=(",", ":")), self.prompt_tokens, self.completion_tokens,
                self.cost, self.unit_cost, self.query,
                None if self.reward is None else json.dumps(self.reward), self.reward_time)

    @classmethod
    def from_tuple(cls, values: Sequence[Any]) -> LogRow:
        """A row read back from its columns."""
        d = dict(zip(COLUMNS, values, strict=True))
        return cls(id=d["id"], time=float(d["time"]), context=d["context"],
                   weights=tuple(float(w) for w in json.loads(d["weights"])), prompt=d["prompt"], n=int(d["n"]),
                   rule=json.loads(d["rule"]) if d["rule"] else None, drawn=int(d["drawn"]),
                   propensity=float(d["propensity"]), outcomes=json.loads(d["outcomes"]),
                   prompt_tokens=int(d["prompt_tokens"]), completion_tokens=int(d["completion_tokens"]),
                   cost=d["cost"], unit_cost=d["unit_cost"], query=d["query"],
                   reward=None if d["reward"] is None else json.loads(d["reward"]), reward_time=d["reward_time"])


@dataclass(frozen=True)
class FeedbackResult:
    """What ``OutcomeLog.feedback`` did: ``status`` 200 (recorded, or the same reward again), 404 (no such id),
    409 (another reward was recorded for it) or 410 (older than the log keeps); ``previous``: the recorded reward."""

    status: int
    previous: Any = None


def log_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The log's files in ``folder``, oldest first (``outcomes.K.sqlite`` ... ``outcomes.1.sqlite``, then the current
    one); a folder without one raises ``LogError``."""
    folder = Path(folder)
    if folder.is_file():
        return [folder]
    if not folder.is_dir():
        raise LogError(f"the outcome log {str(folder)!r} does not exist (give the folder serve --log wrote)")
    rotated = []
    for p in folder.glob("outcomes.*.sqlite"):
        middle = p.name[len("outcomes."):-len(".sqlite")]
        if middle.isdigit():
            rotated.append((int(middle), p))
    files = [p for _, p in sorted(rotated, reverse=True)]
    if (folder / CURRENT).exists():
        files.append(folder / CURRENT)
    if not files:
        raise LogError(f"the folder {str(folder)!r} holds no outcome log ({CURRENT}, outcomes.N.sqlite)")
    return files


def _connect(path: Path, *, readonly: bool = False) -> sqlite3.Connection:
    try:
        if readonly:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)
        else:
            db = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT}")
            for statement in SCHEMA:
                db.execute(statement)
        return db
    except sqlite3.Error as exc:
        raise LogError(f"the outcome log {str(path)!r} cannot be opened: {exc}") from None


def _meta(db: sqlite3.Connection, where: str) -> dict[str, Any]:
    try:
        rows = db.execute("SELECT key, value FROM meta").fetchall()
    except sqlite3.Error as exc:
        raise LogError(f"{where} is not an outcome log of iapo-gym serve: {exc}") from None
    meta = {k: json.loads(v) for k, v in rows}
    if meta and meta.get("format") != FORMAT:
        raise LogError(f"{where} is not an outcome log of iapo-gym serve (format {meta.get('format')!r})")
    if meta and meta.get("version", 0) > VERSION:
        raise LogError(f"{where} is of outcome log version {meta['version']}; this iapo-gym reads up to {VERSION}")
    return meta


def read_log(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Iterator[LogRow]]:
    """The log's metadata (of its newest file) and its rows, oldest file first; ``path``: the folder or one file."""
    files = log_files(path)
    newest = _connect(files[-1], readonly=True)
    try:
        meta = _meta(newest, str(files[-1]))
    finally:
        newest.close()
    if not meta:
        raise LogError(f"{str(files[-1])!r} holds no outcome log metadata (an empty or foreign file)")

    def rows() -> Iterator[LogRow]:
        for f in files:
            db = _connect(f, readonly=True)
            try:
                cursor = db.execute(f"SELECT {', '.join(COLUMNS)} FROM requests ORDER BY time, id")
                while True:
                    chunk = cursor.fetchmany(4096)
                    if not chunk:
                        break
                    for values in chunk:
                        yield LogRow.from_tuple(values)
            except sqlite3.Error as exc:
                raise LogError(f"{str(f)!r} cannot be read: {exc}") from None
            finally:
                db.close()

    return meta, rows()


_STOP = object()


@dataclass(frozen=True)
class _Queued:
    """A row waiting for the writer's thread, and when it was queued (``time.monotonic``): its commit is due
    ``flush_ms`` after that, however long the thread was busy with the commit before."""

    row: LogRow
    at: float


class OutcomeLog:
    """The writer of one log folder (module docstring): ``record`` queues a row, ``feedback`` joins a reward."""

    def __init__(self, folder: str | os.PathLike[str], meta: Mapping[str, Any], *, flush_ms: float = DEFAULT_FLUSH_MS,
                 batch: int = DEFAULT_BATCH, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP) -> None:
        """``meta``: what the rows do not repeat (the aggregator, the objectives, the policy's checksum); a folder
        written before by another policy is continued (each file keeps the metadata it was started with)."""
        if not (math.isfinite(flush_ms) and flush_ms > 0):
            raise ValueError(f"--log-flush-ms must be a number > 0, got {flush_ms!r}")
        if batch < 1:
            raise ValueError(f"--log-batch must be at least 1, got {batch}")
        if max_bytes < 64 * 1024:
            raise ValueError(f"--log-max-bytes must be at least 65536, got {max_bytes}")
        if keep < 0:
            raise ValueError(f"--log-keep must be at least 0, got {keep}")
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LogError(f"the log folder {str(self.folder)!r} cannot be created: {exc}") from None
        if not os.access(self.folder, os.W_OK):
            raise LogError(f"the log folder {str(self.folder)!r} is not writable by this user")
        self.meta = {**meta, "format": FORMAT, "version": VERSION}
        self.flush_s, self.batch, self.max_bytes, self.keep = flush_ms / 1000.0, int(batch), int(max_bytes), int(keep)
        self._db = self._open_current()
        self._jobs: queue.Queue[Any] = queue.Queue()
        self.written = 0
        self._thread = threading.Thread(target=self._run, name="iapo-gym-outcome-log", daemon=True)
        self._thread.start()

    # ---- files -------------------------------------------------------------------------------------------
    def _open_current(self) -> sqlite3.Connection:
        path = self.folder / CURRENT
        db = _connect(path)
        old = _meta(db, str(path))
        self.retained_after = float(old.get("retained_after", 0.0))
        if not old:
            self._write_meta(db, {**self.meta, "created": time.time(), "retained_after": self.retained_after})
        return db

    @staticmethod
    def _write_meta(db: sqlite3.Connection, meta: Mapping[str, Any]) -> None:
        db.execute("BEGIN IMMEDIATE")
        db.executemany("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = "
                       "excluded.value", [(k, json.dumps(v)) for k, v in meta.items()])
        db.execute("COMMIT")

    def _size(self) -> int:
        """The current file's size in bytes as its rows make it (committed pages, in the WAL or not)."""
        pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        return int(pages) * int(self._db.execute("PRAGMA page_size").fetchone()[0])

    def _rotate(self) -> None:
        """The current file becomes ``outcomes.1.sqlite`` (older ones shift up); files past ``keep`` are deleted and
        the newest time they held becomes ``retained_after``."""
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()
        files = log_files(self.folder)[:-1]  # the rotated ones, oldest first
        numbered = [(int(p.name.split(".")[1]), p) for p in files]
        for index, path in sorted(numbered, reverse=True):
            if index + 1 > self.keep:
                newest = _newest_time(path)
                self.retained_after = max(self.retained_after, newest)
                for suffix in ("", "-wal", "-shm"):
                    Path(str(path) + suffix).unlink(missing_ok=True)
            else:
                os.replace(path, self.folder / f"outcomes.{index + 1}.sqlite")
        if self.keep >= 1:
            os.replace(self.folder / CURRENT, self.folder / "outcomes.1.sqlite")
        else:
            self.retained_after = max(self.retained_after, _newest_time(self.folder / CURRENT))
            (self.folder / CURRENT).unlink()
        for suffix in ("-wal", "-shm"):
            Path(str(self.folder / CURRENT) + suffix).unlink(missing_ok=True)
        self._db = _connect(self.folder / CURRENT)
        self._write_meta(self._db, {**self.meta, "created": time.time(), "retained_after": self.retained_after})

    # ---- the writer's thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        pending: list[LogRow] = []
        due = math.inf
        while True:
            timeout = None if not pending else max(0.0, due - time.monotonic())
            try:
                job = self._jobs.get(timeout=timeout)
            except queue.Empty:
                job = None
            if isinstance(job, _Queued):
                if not pending:  # from when it was answered: a commit in progress does not extend its wait
                    due = job.at + self.flush_s
                pending.append(job.row)
                if len(pending) < self.batch:
                    continue
            if pending:
                self._commit(pending)
                pending = []
                due = math.inf
            if job is _STOP:
                self._db.close()
                return
            if isinstance(job, tuple):  # (future, function): feedback, a flush, run after the rows before it
                done, fn = job
                try:
                    done.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 (handed to the waiting caller)
                    done.set_exception(exc)

    def _commit(self, rows: list[LogRow]) -> None:
        for start in range(0, len(rows), self.batch):
            part = rows[start:start + self.batch]
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany(f"INSERT OR IGNORE INTO requests ({', '.join(COLUMNS)}) VALUES "
                                     f"({', '.join('?' * len(COLUMNS))})", [r.as_tuple() for r in part])
                self._db.execute("COMMIT")
                self.written += len(part)
            except sqlite3.Error as exc:  # a full disk: the rows are lost, the server goes on answering
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                _warn(f"{len(part)} rows not written: {exc}")
        try:
            if self._size() > self.max_bytes:
                self._rotate()
        except (OSError, sqlite3.Error, LogError) as exc:  # the log goes on in the current file, or a new one
            _warn(f"rotation failed: {exc}")
            try:
                self._db.execute("SELECT 1")
            except sqlite3.Error:
                self._db = _connect(self.folder / CURRENT)

    # ---- the API -----------------------------------------------------------------------------------------
    def record(self, row: LogRow) -> None:
        """Queue ``row``; it is committed within ``flush_ms`` (never blocks the caller)."""
        self._jobs.put(_Queued(row, time.monotonic()))

    def _call(self, fn: Any) -> Future[Any]:
        done: Future[Any] = Future()
        self._jobs.put((done, fn))
        return done

    def flush(self) -> Future[None]:
        """A future done once every row queued before it is committed."""
        return self._call(lambda: None)

    def feedback(self, rid: str, reward: Any, now: float | None = None) -> Future[FeedbackResult]:
        """Join ``reward`` to the row of response ``rid`` (after every row queued before it is committed); the
        future's ``FeedbackResult`` says what happened."""
        return self._call(lambda: self._feedback(rid, reward, time.time() if now is None else now))

    def _feedback(self, rid: str, reward: Any, now: float) -> FeedbackResult:
        value = json.dumps(reward)
        for path in reversed(log_files(self.folder)):
            current = path == self.folder / CURRENT
            db = self._db if current else _connect(path)
            try:
                row = db.execute("SELECT reward FROM requests WHERE id = ?", (rid,)).fetchone()
                if row is None:
                    continue
                if row[0] is not None:
                    previous = json.loads(row[0])
                    return FeedbackResult(200 if row[0] == value else 409, previous)
                db.execute("BEGIN IMMEDIATE")
                db.execute("UPDATE requests SET reward = ?, reward_time = ? WHERE id = ?", (value, now, rid))
                db.execute("COMMIT")
                return FeedbackResult(200)
            finally:
                if not current:
                    db.close()
        born = response_time(rid)
        if born is not None and self.retained_after and born <= self.retained_after:
            return FeedbackResult(410)
        return FeedbackResult(404)

    def close(self) -> None:
        """Commit what is queued and close the file."""
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join()


def _warn(message: str) -> None:
    import sys

    print(f"iapo-gym serve: outcome log: {message}", file=sys.stderr, flush=True)


def _newest_time(path: Path) -> float:
    db = _connect(path, readonly=True)
    try:
        row = db.execute("SELECT MAX(time) FROM requests").fetchone()
        return float(row[0]) if row and row[0] is not None else 0.0
    finally:
        db.close()
