"""A persistent response cache (SQLite): one completion per key, so reruns are free and reproducible.

The key hashes the endpoint, model, API, the rendered prompt (prompt template and query), the
sampling parameters and the sample index; the API key is never part of it. Async code uses
``aget_many``/``aput``, which run the SQLite calls on the cache's own thread, so a read or a commit
never stalls the event loop that has requests in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import os
import sqlite3
from pathlib import Path
from typing import Any


def completion_key(base_url: str, model: str, api: str, prompt: Any, sampling: dict[str, Any], index: int) -> str:
    """The cache key of completion ``index`` of one rendered prompt under one set of sampling parameters."""
    blob = json.dumps({"base_url": base_url, "model": model, "api": api, "prompt": prompt, "sampling": sampling,
                       "index": int(index)}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ResponseCache:
    """Completions by key in one SQLite file (WAL mode; each ``put`` is its own committed transaction).

    Every SQLite call of the async methods runs on one worker thread, in submission order, so a
    ``put`` is visible to any later read; the sync methods are for sync callers.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Open (or create) the cache at ``path``."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS completions (key TEXT PRIMARY KEY, text TEXT NOT NULL, "
                         "tokens INTEGER NOT NULL, finish TEXT)")
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="iapo-gym-cache")

    def get(self, key: str) -> tuple[str, int, str | None] | None:
        """(text, completion tokens, finish reason) or None."""
        row = self._db.execute("SELECT text, tokens, finish FROM completions WHERE key = ?", (key,)).fetchone()
        return None if row is None else (str(row[0]), int(row[1]), row[2])

    def get_many(self, keys: list[str]) -> dict[str, tuple[str, int, str | None]]:
        """The cached entries among ``keys``."""
        out: dict[str, tuple[str, int, str | None]] = {}
        for start in range(0, len(keys), 500):
            chunk = keys[start:start + 500]
            marks = ",".join("?" * len(chunk))
            for key, text, tokens, finish in self._db.execute(
                    f"SELECT key, text, tokens, finish FROM completions WHERE key IN ({marks})", chunk):
                out[key] = (str(text), int(tokens), finish)
        return out

    def put(self, key: str, text: str, tokens: int, finish: str | None) -> None:
        """Store one completion (an existing key keeps its first value)."""
        self._db.execute("INSERT OR IGNORE INTO completions VALUES (?, ?, ?, ?)", (key, text, int(tokens), finish))

    async def aget_many(self, keys: list[str]) -> dict[str, tuple[str, int, str | None]]:
        """``get_many`` on the cache's thread (the event loop keeps running meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, self.get_many, keys)

    async def aput(self, key: str, text: str, tokens: int, finish: str | None) -> None:
        """``put`` (one committed transaction) on the cache's thread."""
        await asyncio.get_running_loop().run_in_executor(self._worker, self.put, key, text, tokens, finish)

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM completions").fetchone()[0])

    def close(self) -> None:
        """Finish the queued calls, then close the database."""
        self._worker.shutdown(wait=True)
        self._db.close()
