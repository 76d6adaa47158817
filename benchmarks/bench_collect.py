"""Benchmark: ``iapo-gym collect`` against the tiny local llama.cpp server, vs the raw ``openai`` client.

For concurrency 1, 4 and 16, the same completions (prompts x queries x N_max, one request per
completion, the same sampling parameters and seeds) are requested by (a) ``AsyncOpenAI`` alone
with a semaphore, and (b) the collector end to end (cache, spending cap, log with fsync, table
build), alternating, best of ``--repeats``. Prints requests per second (wall clock) and the
client process's CPU time per completion of each side: on a shared machine the CPU time is the
steady measure of what the collector adds per completion. A last collector run per concurrency,
not timed, measures what blocks its event loop: the time spent in the response cache's sync
methods (SQLite reads and commits, or queueing for them) on the loop's thread per completion, and
the lateness of a 1 ms heartbeat task (99th percentile and maximum). Needs
``pip install "iapo-gym[llm]"``. Run: ``nice -n 5 python benchmarks/bench_collect.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from iapo_gym.llm.cache import ResponseCache  # noqa: E402
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


def loop_blocking(spec: Spec, out: Path) -> tuple[float, float, float]:
    """One collector run with a 1 ms heartbeat on its loop and every ``ResponseCache`` method timed.

    Returns (SQLite seconds on the loop's thread per completion, heartbeat lateness p99, max).
    """
    loop_thread = threading.get_ident()  # the collector's loop runs on the calling thread
    on_loop = [0.0]
    originals = {name: fn for name, fn in vars(ResponseCache).items()  # the sync ones: they run SQLite or queue for it
                 if callable(fn) and not name.startswith("__") and not inspect.iscoroutinefunction(fn)
                 and name not in ("close", "_serve")}

    def timed(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if threading.get_ident() == loop_thread:
                    on_loop[0] += time.perf_counter() - t0
        return wrapper

    for name, fn in originals.items():
        setattr(ResponseCache, name, timed(fn))
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

    try:
        collector = Collector(spec, out, progress=False)
        collector.out.mkdir(parents=True, exist_ok=True)
        collector._check_manifest()
        result = asyncio.run(run())
    finally:
        for name, fn in originals.items():
            setattr(ResponseCache, name, fn)
    assert result.complete, result
    return on_loop[0] / result.total, float(np.percentile(late, 99)), float(max(late))


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
        blocking: list[tuple[int, float, float, float]] = []
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
        print(f"\n{'concurrency':>11} {'SQLite on loop/compl':>21} {'loop lateness p99':>18} {'max':>9}")
        for conc, sqlite_s, p99, worst in blocking:
            print(f"{conc:>11} {sqlite_s * 1e3:>18.3f} ms {p99 * 1e3:>15.2f} ms {worst * 1e3:>6.1f} ms")
    finally:
        stop(server)


if __name__ == "__main__":
    main()
