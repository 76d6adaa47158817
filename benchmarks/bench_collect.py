"""Benchmark: ``iapo-gym collect`` against the tiny local llama.cpp server, vs the raw ``openai`` client.

For concurrency 1, 4 and 16, the same completions (prompts x queries x N_max, one request per
completion, the same sampling parameters and seeds) are requested by (a) ``AsyncOpenAI`` alone
with a semaphore, and (b) the collector end to end (cache, spending cap, log with fsync, table
build), alternating, best of ``--repeats``. Prints requests per second (wall clock) and the
client process's CPU time per completion of each side: on a shared machine the CPU time is the
steady measure of what the collector adds per completion. A last collector run per concurrency,
not timed, measures what blocks its event loop: the time spent in the response cache's SQLite
statements (reads and commits, fetching included) per completion, on the loop's thread and on any
thread, and the lateness of a 1 ms heartbeat task (99th percentile and maximum). Needs
``pip install "iapo-gym[llm]"``. Run: ``nice -n 5 python benchmarks/bench_collect.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import iapo_gym.llm.cache as cache_module  # noqa: E402
from iapo_gym.llm.client import LLMClient  # noqa: E402
from iapo_gym.llm.collect import Collector, collect  # noqa: E402
from iapo_gym.llm.spec import Spec, load_spec  # noqa: E402
from tests.llm_server import free_port, start_llama_server, stop, write_spec, write_tiny_gguf  # noqa: E402


def queries(n: int) -> list[dict[str, str]]:
    """``n`` small arithmetic queries."""
    return [{"id": f"q{i}", "text": f"What is {i} + {2 * i}?", "gold": str(3 * i)} for i in range(n)]


async def raw(spec: Spec) -> int:
    """Every completion of the spec through ``AsyncOpenAI`` alone; returns the number of requests."""
    import openai

    client = openai.AsyncOpenAI(base_url=spec.base_url(), api_key="none", max_retries=0, timeout=60)
    sem = asyncio.Semaphore(spec.endpoint.concurrency)
    seeder = LLMClient(spec)  # only for the per-completion seeds, so both sides send identical requests
    params = spec.sampling.as_dict()
    params.pop("seed", None)

    async def one(prompt: str, index: int) -> None:
        async with sem:
            await client.completions.create(model=spec.endpoint.model, prompt=prompt, seed=seeder._seed(prompt, index),
                                            **params)
    jobs = [one(p.render(q.text), i) for p in spec.prompts for q in spec.queries for i in range(spec.n_max)]  # type: ignore[arg-type]
    await asyncio.gather(*jobs)
    await client.close()
    return len(jobs)


class _Rows:
    """The rows of one statement, fetched inside the timed call (so iteration costs nothing after it)."""

    def __init__(self, rows: list[Any]) -> None:
        self._rows = rows

    def __iter__(self) -> Any:
        return iter(self._rows)

    def fetchone(self) -> Any:
        return self._rows[0] if self._rows else None


class _TimedConnection:
    """A ``sqlite3.Connection`` whose statements (execution and fetching) are timed by the calling thread."""

    def __init__(self, db: sqlite3.Connection, record: Any) -> None:
        self._db, self._record = db, record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)

    def _timed(self, fn: Any, *args: Any) -> _Rows:
        t0 = time.perf_counter()
        try:
            return _Rows(list(fn(*args)))
        finally:
            self._record(time.perf_counter() - t0)

    def execute(self, *args: Any) -> _Rows:
        return self._timed(self._db.execute, *args)

    def executemany(self, *args: Any) -> _Rows:
        return self._timed(self._db.executemany, *args)


class _SqliteShim:
    """The ``sqlite3`` module as the response cache sees it during the measurement: timed connections."""

    def __init__(self, record: Any) -> None:
        self._record = record

    def __getattr__(self, name: str) -> Any:
        return getattr(sqlite3, name)

    def connect(self, *args: Any, **kwargs: Any) -> _TimedConnection:
        return _TimedConnection(sqlite3.connect(*args, **kwargs), self._record)


def loop_blocking(spec: Spec, out: Path) -> tuple[float, float, float, float]:
    """One collector run with a 1 ms heartbeat on its loop and every SQLite statement of the cache timed.

    Returns (SQLite seconds per completion on the loop's thread, on any thread, heartbeat lateness p99, max).
    """
    loop_thread = threading.get_ident()  # the collector's loop runs on the calling thread
    spent = {"loop": 0.0, "all": 0.0}

    def record(seconds: float) -> None:
        spent["all"] += seconds
        if threading.get_ident() == loop_thread:
            spent["loop"] += seconds
    late: list[float] = []

    async def run() -> Any:
        done = asyncio.Event()

        async def heartbeat() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.001)
                late.append(time.perf_counter() - t0 - 0.001)
        beat = asyncio.ensure_future(heartbeat())
        try:
            return await collector._run()
        finally:
            done.set()
            await beat

    cache_module.sqlite3 = _SqliteShim(record)  # type: ignore[assignment]
    try:
        collector = Collector(spec, out, progress=False)
        collector.out.mkdir(parents=True, exist_ok=True)
        collector._check_manifest()
        result = asyncio.run(run())
    finally:
        cache_module.sqlite3 = sqlite3
    assert result.complete, result
    n = result.total
    return spent["loop"] / n, spent["all"] / n, float(np.percentile(late, 99)), float(max(late))


def main() -> None:
    """Start the server, time both sides at each concurrency, print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--n-max", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    opts = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-collect-"))
    model = write_tiny_gguf(work / "tiny.gguf")
    port = free_port()
    server = start_llama_server(model, port)
    try:
        print(f"{'concurrency':>11} {'raw req/s':>10} {'collect req/s':>14} {'wall overhead':>14} "
              f"{'raw CPU/compl':>14} {'collect CPU/compl':>18} {'CPU overhead':>13}")
        blocking: list[tuple[int, float, float, float, float]] = []
        for conc in (1, 4, 16):
            spec_path = write_spec(work / f"c{conc}", port, n_max=opts.n_max, queries=queries(opts.queries),
                                   endpoint={"concurrency": conc},
                                   sampling={"temperature": 0.9, "max_tokens": opts.max_tokens})
            spec = load_spec(spec_path)
            t_raw, t_col, c_raw, c_col = [], [], [], []
            for r in range(opts.repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                n = asyncio.run(raw(spec))
                t_raw.append(time.perf_counter() - t0)
                c_raw.append(time.process_time() - c0)
                t0, c0 = time.perf_counter(), time.process_time()
                result = collect(spec, work / f"c{conc}" / f"out{r}", progress=False)
                t_col.append(time.perf_counter() - t0)
                c_col.append(time.process_time() - c0)
                assert result.complete and result.requests == n, result
            raw_t, col_t = min(t_raw), min(t_col)
            raw_c, col_c = min(c_raw) / n, min(c_col) / n
            print(f"{conc:>11} {n / raw_t:>10.1f} {n / col_t:>14.1f} {100 * (col_t / raw_t - 1):>13.1f}% "
                  f"{raw_c * 1e3:>11.3f} ms {col_c * 1e3:>15.3f} ms {100 * (col_c / raw_c - 1):>12.1f}%")
            blocking.append((conc, *loop_blocking(spec, work / f"c{conc}" / "blocking")))
        print(f"\n{'concurrency':>11} {'SQLite on the loop/compl':>25} {'SQLite anywhere/compl':>22} "
              f"{'loop lateness p99':>18} {'max':>9}")
        for conc, on_loop, anywhere, p99, worst in blocking:
            print(f"{conc:>11} {on_loop * 1e3:>22.3f} ms {anywhere * 1e3:>19.3f} ms {p99 * 1e3:>15.2f} ms "
                  f"{worst * 1e3:>6.1f} ms")
    finally:
        stop(server)


if __name__ == "__main__":
    main()
