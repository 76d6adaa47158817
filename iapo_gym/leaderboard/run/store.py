"""The results database: one SQLite file per output directory, one row per finished run.

Rows are keyed by (task, agent, params, budget, run) and written with ``INSERT OR IGNORE``
inside one transaction per finished work unit, so a sweep killed at any instant leaves only
whole units behind and a rerun skips them. WAL journaling and a busy timeout let several
processes write to the same file at once.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

DB_NAME = "results.sqlite"
SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 120.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    task TEXT NOT NULL,
    table_sha256 TEXT NOT NULL,
    agent TEXT NOT NULL,
    params TEXT NOT NULL,
    label TEXT NOT NULL,
    budget INTEGER NOT NULL,
    run INTEGER NOT NULL,
    root_seed INTEGER NOT NULL,
    split_seed INTEGER,
    env_seed INTEGER NOT NULL,
    agent_seed INTEGER NOT NULL,
    acr REAL NOT NULL,
    optimal_acr REAL NOT NULL,
    train_optimal_acr REAL NOT NULL,
    regret REAL NOT NULL,
    arms TEXT NOT NULL,
    optimal_arms TEXT NOT NULL,
    train_seconds REAL NOT NULL,
    budget_spent INTEGER NOT NULL,
    version TEXT NOT NULL,
    created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    effective_params TEXT,
    arm_set TEXT,
    PRIMARY KEY (task, agent, params, budget, run)
);
CREATE TABLE IF NOT EXISTS tasks (
    task TEXT NOT NULL,
    table_sha256 TEXT NOT NULL,
    title TEXT NOT NULL,
    aggregator TEXT NOT NULL,
    n_prompts INTEGER NOT NULL,
    n_max INTEGER NOT NULL,
    context_names TEXT NOT NULL,
    PRIMARY KEY (task, table_sha256)
);
"""


@dataclass(frozen=True)
class RunResult:
    """One finished (task, agent, budget, run): the learned policy's exact test ACR and its context."""

    task: str
    table_sha256: str
    agent: str
    params: str  # canonical JSON
    label: str
    budget: int
    run: int
    root_seed: int
    split_seed: int | None  # None: the table's stored split (synthetic instances)
    env_seed: int
    agent_seed: int
    acr: float
    optimal_acr: float
    train_optimal_acr: float
    regret: float
    arms: str  # JSON [[p, N], ...] per context; [[p, N, rule], ...] in a run over rules
    optimal_arms: str  # JSON: the test-optimal policy of this run
    train_seconds: float
    budget_spent: int
    version: str
    #: JSON of the agent's ``params()``, its effective parameters with the defaults; None for runs stored before
    #: they were recorded, or an agent without ``params()``.
    effective_params: str | None = None
    #: The arm set of a run over (p, N, stopping rule) (``--rules``): JSON of its rules' labels, rule 0 (fixed N)
    #: first, which ``arms``' third entries index; None for the paper's (p, N) arms.
    arm_set: str | None = None

    @property
    def key(self) -> tuple[str, str, str, int, int]:
        """The unique key (task, agent, params, budget, run)."""
        return (self.task, self.agent, self.params, self.budget, self.run)


@dataclass(frozen=True)
class TaskInfo:
    """What reports need to know about a task's table without loading it."""

    task: str
    table_sha256: str
    title: str
    aggregator: str
    n_prompts: int
    n_max: int
    context_names: tuple[str, ...]


_RESULT_FIELDS = [f.name for f in fields(RunResult)]
_TASK_FIELDS = [f.name for f in fields(TaskInfo)]


class ResultStore:
    """The SQLite results of one output directory (created on first use)."""

    def __init__(self, out_dir: str | os.PathLike[str], *, create: bool = True) -> None:
        """Open ``out_dir/results.sqlite``; ``create=False`` raises FileNotFoundError if it is absent."""
        self.dir = Path(out_dir)
        self.path = self.dir / DB_NAME
        if not self.path.is_file():
            if not create:
                raise FileNotFoundError(f"no leaderboard results at {self.path} (run `iapo-gym leaderboard --out {self.dir}`)")
            self.dir.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        self._conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute("PRAGMA synchronous = NORMAL")
        with self._transaction() as cur:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    cur.execute(statement)
            cur.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            columns = {row[1] for row in cur.execute("PRAGMA table_info(runs)").fetchall()}
            if "effective_params" not in columns:  # a database written before the column existed
                cur.execute("ALTER TABLE runs ADD COLUMN effective_params TEXT")
            if "arm_set" not in columns:
                cur.execute("ALTER TABLE runs ADD COLUMN arm_set TEXT")
        stored = self.get_meta("schema_version")
        if stored != str(SCHEMA_VERSION):
            raise RuntimeError(f"{self.path} has results schema {stored}, this iapo-gym writes {SCHEMA_VERSION}")

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        cur = self._conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        cur.execute("COMMIT")

    # ---- meta -----------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        """A value of the meta table (None if unset)."""
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def claim_meta(self, key: str, value: str) -> None:
        """Set ``key`` if unset; if set to something else, raise a ValueError (e.g. another root seed)."""
        self._conn.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (key, value))
        stored = self.get_meta(key)
        if stored != value:
            raise ValueError(f"{self.path} was written with {key}={stored}, not {value}; "
                             f"use another --out directory or the same {key}")

    # ---- rows -----------------------------------------------------------------------------
    def add(self, results: Iterable[RunResult], tasks: Iterable[TaskInfo] = ()) -> int:
        """Insert results (duplicates ignored) and task infos in one transaction; returns rows added."""
        results = list(results)
        with self._transaction() as cur:
            for info in tasks:
                row = asdict(info)
                row["context_names"] = json.dumps(list(info.context_names))
                cur.execute(f"INSERT OR IGNORE INTO tasks ({', '.join(_TASK_FIELDS)}) "
                            f"VALUES ({', '.join('?' * len(_TASK_FIELDS))})", [row[k] for k in _TASK_FIELDS])
            before = self._conn.total_changes
            cur.executemany(f"INSERT OR IGNORE INTO runs ({', '.join(_RESULT_FIELDS)}) "
                            f"VALUES ({', '.join('?' * len(_RESULT_FIELDS))})",
                            [[getattr(r, k) for k in _RESULT_FIELDS] for r in results])
            added = self._conn.total_changes - before
        return added

    def done_keys(self) -> set[tuple[str, str, str, int, int]]:
        """Keys (task, agent, params, budget, run) of every stored run."""
        rows = self._conn.execute("SELECT task, agent, params, budget, run FROM runs").fetchall()
        return {(str(t), str(a), str(p), int(b), int(r)) for t, a, p, b, r in rows}

    def results(self, task: str | None = None) -> list[RunResult]:
        """Every stored run (optionally of one task), ordered by its key."""
        sql = f"SELECT {', '.join(_RESULT_FIELDS)} FROM runs"
        args: tuple[Any, ...] = ()
        if task is not None:
            sql += " WHERE task = ?"
            args = (task,)
        sql += " ORDER BY task, agent, params, budget, run"
        return [RunResult(*row) for row in self._conn.execute(sql, args).fetchall()]

    def tasks(self) -> list[TaskInfo]:
        """Task infos (one per task and table checksum seen)."""
        rows = self._conn.execute(f"SELECT {', '.join(_TASK_FIELDS)} FROM tasks ORDER BY task").fetchall()
        out = []
        for row in rows:
            values = dict(zip(_TASK_FIELDS, row, strict=True))
            values["context_names"] = tuple(json.loads(values["context_names"]))
            out.append(TaskInfo(**values))
        return out

    def count(self) -> int:
        """Number of stored runs."""
        return int(self._conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
