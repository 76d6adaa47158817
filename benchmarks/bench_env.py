"""Benchmark: completions per second of the batch path, and the exact q_table's time per task.

Baseline in the same run: a per-pull loop drawing with ``Generator.choice`` (the reference
code's style). Run: ``.venv/bin/python benchmarks/bench_env.py`` (data-backed tasks are
included when their tables are present, e.g. with IAPO_GYM_DATA set).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from iapo_gym.data import MissingTableError, load_task_table
from iapo_gym.env import IAPOEnv
from iapo_gym.tasks import TASKS


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_task(name: str, n_pulls: int, repeats: int) -> None:
    """Print one task's row: batch and loop completion rates, q_table first and cached time."""
    try:
        table = load_task_table(name)
    except MissingTableError:
        print(f"{name:24s} (table absent; skipped)")
        return
    env = IAPOEnv(table=table)
    env.reset(seed=0)
    prompts = np.arange(n_pulls) % table.n_prompts
    ns = np.full(n_pulls, 16)
    env.pull(prompts[:10], ns[:10])  # builds the alias tables outside the timing
    batch = best_of(repeats, lambda: env.pull(prompts, ns))
    rng = np.random.default_rng(0)
    n_loop = 5_000
    train = env.queries()

    def loop() -> None:
        for i in range(n_loop):
            q = train[rng.integers(train.size)]
            rng.choice(table.n_atoms, size=16, p=table.probs[i % table.n_prompts, q])

    loop_time = best_of(2, loop)
    batch_rate = n_pulls * 16 / batch / 1e6
    loop_rate = n_loop * 16 / loop_time / 1e6
    table._cache.clear()
    start = time.perf_counter()
    env.q_table("test")
    first = time.perf_counter() - start
    cached = best_of(3, lambda: env.q_table("test"))
    print(f"{name:24s} {batch_rate:11.1f} {loop_rate:10.2f} {batch_rate / loop_rate:8.0f}x {first:10.3f} {cached:9.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pulls", type=int, default=200_000, help="pulls per batch (N = 16 each)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"pid {os.getpid()}; batch of {args.pulls} pulls of N = 16; Mc/s = million completions per second")
    print(f"{'task':24s} {'batch Mc/s':>11s} {'loop Mc/s':>10s} {'speed-up':>9s} {'q_table s':>10s} {'cached s':>9s}")
    for spec in TASKS.values():
        bench_task(spec.name, args.pulls, args.repeats)


if __name__ == "__main__":
    main()
