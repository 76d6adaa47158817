"""The response cache's own thread: reads see earlier puts, close commits what is queued, SQLite stays off the loop."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from iapo_gym.llm.cache import ResponseCache


def test_reads_see_every_earlier_put_and_close_commits_the_queue(tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite"
    cache = ResponseCache(path)
    for i in range(2000):
        cache.put(f"k{i}", f"text {i}", i, "stop" if i % 2 else None)
        if i % 500 == 0:  # a read right behind a put sees it
            assert cache.get(f"k{i}") == (f"text {i}", i, None, None)
    cache.put("k0", "another text", 99, None)  # an existing key keeps its first value
    cache.close()
    cache.close()  # idempotent
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM completions").fetchone()[0] == 2000
        assert db.execute("SELECT text, tokens FROM completions WHERE key = 'k0'").fetchone() == ("text 0", 0)
    again = ResponseCache(path)
    assert len(again) == 2000 and again.get_many(["k1", "nope"]) == {"k1": ("text 1", 1, "stop", None)}
    again.close()
    with pytest.raises(ValueError, match="closed"):
        again.put("x", "y", 1, None)


def test_async_reads_run_on_the_cache_thread(tmp_path: Path) -> None:
    cache = ResponseCache(tmp_path / "cache.sqlite")
    threads: set[int] = set()
    real = cache._get_many

    def spy(keys: list[str]) -> dict:
        threads.add(threading.get_ident())
        return real(keys)
    cache._get_many = spy  # type: ignore[method-assign]

    async def main() -> tuple[dict, int]:
        cache.put("a", "x", 1, None)
        return await cache.aget_many(["a"]), threading.get_ident()

    got, loop_thread = asyncio.run(main())
    cache.close()
    assert got == {"a": ("x", 1, None, None)}
    assert threads and loop_thread not in threads


def test_prompt_tokens_are_kept_and_an_older_cache_gains_the_column(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:  # a cache file of the four columns it had before prompt tokens were kept
        db.execute("CREATE TABLE completions (key TEXT PRIMARY KEY, text TEXT NOT NULL, tokens INTEGER NOT NULL, "
                   "finish TEXT)")
        db.execute("INSERT INTO completions VALUES ('old', 'an old answer', 7, 'stop')")
    db.close()
    cache = ResponseCache(path)
    cache.put("new", "a new answer", 5, "length", 42)
    assert cache.get_many(["old", "new"]) == {"old": ("an old answer", 7, "stop", None),
                                              "new": ("a new answer", 5, "length", 42)}
    cache.close()
