"""Benchmark: what the shared serving budget costs per request, by store and by processes sharing it.

One request of ``iapo-gym serve`` under ``--rate`` makes two budget transactions: an admission (its
worst case reserved) and a settlement. Each of ``--processes`` processes (spawned, started together
behind a barrier) runs ``--pairs`` admit + settle pairs as fast as it can on one budget
(``iapo_gym.llm.budget.Budget`` with a minute, an hour, a day and a total limit that never bind), on:

* ``memory``: this process's memory (one process only: nothing is shared);
* ``sqlite``: one SQLite file (WAL, ``BEGIN IMMEDIATE``), the default of ``serve``;
* ``redis``: a ``redis-server`` on 127.0.0.1 started here on a free port (skipped when the binary is absent).

It prints per store and process count the median and p99 time of one pair (the latency a request
gains) and the pairs per second of all processes together (the request rate the store allows).
Run: ``nice -n 5 python benchmarks/bench_budget.py`` (``--processes 1 4 --pairs 2000``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from iapo_gym.llm.budget import Budget, MemoryStore, Spend, open_store, parse_rate  # noqa: E402

RATES = ("requests/minute=1e12", "tokens/hour=1e15", "cost/day=1e12", "requests/total=1e15")


def _worker(url: str, pairs: int, start: Any, out: Any) -> None:
    budget = Budget([parse_rate(r) for r in RATES], MemoryStore() if url == "memory" else open_store(url, "bench"))
    budget.report(True)  # connected before the start
    times = np.empty(pairs)
    start.wait()
    begin = time.perf_counter()
    for i in range(pairs):
        t = time.perf_counter()
        budget.settle(budget.admit(Spend(1, 2, 300, 0.01), 130.0), Spend(1, 1, 120, 0.004))
        times[i] = time.perf_counter() - t
    out.put((times.tolist(), time.perf_counter() - begin))


def run(url: str, processes: int, pairs: int) -> tuple[float, float, float]:
    """(median s, p99 s, pairs per second) of ``processes`` processes on ``url``."""
    ctx = multiprocessing.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(processes)
    procs = [ctx.Process(target=_worker, args=(url, pairs, start, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    times = np.concatenate([np.asarray(r[0]) for r in results])
    wall = max(r[1] for r in results)
    return float(np.median(times)), float(np.quantile(times, 0.99)), processes * pairs / wall


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    """Parse the options, run every store at every process count, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--pairs", type=int, default=2000, help="admit + settle pairs per process")
    opts = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-budget-"))
    redis_proc = None
    stores = {"memory": "memory", "sqlite": f"sqlite:///{work / 'budget.sqlite'}"}
    binary = shutil.which("redis-server")
    if binary:
        port = _free_port()
        redis_proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(work)], stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        stores["redis"] = f"redis://127.0.0.1:{port}/0"
    else:
        print("redis-server not found: the redis store is not measured", file=sys.stderr)
    try:
        print(f"{'store':8} {'processes':>9} {'median ms':>10} {'p99 ms':>8} {'pairs/s':>9}")
        for name, url in stores.items():
            for processes in opts.processes:
                if name == "memory" and processes > 1:
                    continue
                median, p99, rate = run(url, processes, opts.pairs)
                print(f"{name:8} {processes:>9} {median * 1e3:>10.3f} {p99 * 1e3:>8.3f} {rate:>9.0f}", flush=True)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
