"""A persistent response cache (SQLite): one completion per key, so reruns are free and reproducible.

The key hashes the endpoint, model, API, the rendered prompt (prompt template and query), the
sampling parameters and the sample index; the API key is never part of it. All SQLite work runs on
the cache's own thread: ``put`` only queues the row (the event loop never waits for a commit), and
the thread commits every row queued meanwhile in one transaction; reads are answered on that
thread after every earlier ``put``, so they see them.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import hashlib
import json
import os
import queue
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: (text, completion tokens, finish reason, prompt tokens or None where the cache predates them)
Entry = tuple[str, int, "str | None", "int | None"]


def completion_key(base_url: str, model: str, api: str, prompt: Any, sampling: dict[str, Any], index: int) -> str:
    """The cache key of completion ``index`` of one rendered prompt under one set of sampling parameters."""
    return _digest({"base_url": base_url, **_sample_fields(model, api, prompt, sampling, index)})


def sample_key(model: str, api: str, prompt: Any, sampling: dict[str, Any], index: int) -> str:
    """What names sample ``index`` of one rendered prompt wherever the model is served: the cache key without the
    server's address. Its per-completion seed derives from it, so a rerun against the same model at another
    address (another port, a proxy) asks for the same samples; the cache, which must not mix servers, keys by
    ``completion_key``."""
    return _digest(_sample_fields(model, api, prompt, sampling, index))


def _sample_fields(model: str, api: str, prompt: Any, sampling: dict[str, Any], index: int) -> dict[str, Any]:
    return {"model": model, "api": api, "prompt": prompt, "sampling": sampling, "index": int(index)}


def _digest(fields: dict[str, Any]) -> str:
    blob = json.dumps(fields, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ResponseCache:
    """Completions by key in one SQLite file (WAL mode), read and written on one worker thread.

    A process killed with -9 loses at most the rows queued since the last commit (milliseconds);
    the completion log, not the cache, is what a resumed run trusts.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Open (or create) the cache at ``path`` and start its thread."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS completions (key TEXT PRIMARY KEY, text TEXT NOT NULL, "
                         "tokens INTEGER NOT NULL, finish TEXT, prompt_tokens INTEGER)")
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(completions)")}
        if "prompt_tokens" not in columns:  # a cache written before prompt tokens were kept: their rows read None
            self._db.execute("ALTER TABLE completions ADD COLUMN prompt_tokens INTEGER")
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="iapo-gym-cache", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # an owner that never closes it (a notebook's env) still gets its last rows committed

    # ---- the worker thread -------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:  # everything queued meanwhile: one transaction for all its rows
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            rows: list[tuple[str, str, int, str | None, int | None]] = []
            for item in batch:
                if item is None:  # close
                    self._commit(rows)
                    return
                if item[0] == "put":
                    rows.append(item[1])
                    continue
                self._commit(rows)  # a read sees every earlier put
                rows = []
                _, fn, args, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:  # handed to the caller
                        future.set_exception(exc)
            self._commit(rows)

    def _commit(self, rows: list[tuple[str, str, int, str | None, int | None]]) -> None:
        if not rows or self._error is not None:
            return
        try:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR IGNORE INTO completions (key, text, tokens, finish, prompt_tokens) "
                                 "VALUES (?, ?, ?, ?, ?)", rows)
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:  # reported by the next call from the caller's side
            self._error = exc
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")

    def _call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        self._check()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put(("call", fn, args, future))
        return future

    def _check(self) -> None:
        if self._error is not None:
            raise OSError(f"the response cache {self.path} could not be written: {self._error}")
        if self._closed:
            raise ValueError(f"the response cache {self.path} is closed")

    def _get_many(self, keys: list[str]) -> dict[str, Entry]:
        out: dict[str, Entry] = {}
        for start in range(0, len(keys), 500):
            chunk = keys[start:start + 500]
            marks = ",".join("?" * len(chunk))
            for key, text, tokens, finish, prompt_tokens in self._db.execute(
                    f"SELECT key, text, tokens, finish, prompt_tokens FROM completions WHERE key IN ({marks})", chunk):
                out[key] = (str(text), int(tokens), finish, None if prompt_tokens is None else int(prompt_tokens))
        return out

    def _count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM completions").fetchone()[0])

    # ---- the callers' side -------------------------------------------------------------
    def get_many(self, keys: list[str]) -> dict[str, Entry]:
        """The cached entries among ``keys`` (waits for the cache's thread)."""
        result: dict[str, Entry] = self._call(self._get_many, list(keys)).result()
        return result

    async def aget_many(self, keys: list[str]) -> dict[str, Entry]:
        """``get_many`` without blocking the event loop."""
        result: dict[str, Entry] = await asyncio.wrap_future(self._call(self._get_many, list(keys)))
        return result

    def get(self, key: str) -> Entry | None:
        """(text, completion tokens, finish reason, prompt tokens) or None."""
        return self.get_many([key]).get(key)

    def put(self, key: str, text: str, tokens: int, finish: str | None, prompt_tokens: int | None = None) -> None:
        """Queue one completion (with its share of the request's prompt tokens) for the next commit (an existing
        key keeps its first value); returns at once."""
        self._check()
        self._queue.put(("put", (key, text, int(tokens), finish, None if prompt_tokens is None else int(prompt_tokens))))

    def flush(self) -> None:
        """Wait until every queued ``put`` is committed."""
        self._call(lambda: None).result()
        self._check()

    def __len__(self) -> int:
        return int(self._call(self._count).result())

    def close(self) -> None:
        """Commit what is queued, stop the thread and close the database (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._queue.put(None)
        self._thread.join()
        self._db.close()
