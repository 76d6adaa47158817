"""Benchmark: ``gym.make("IAPO-MATH-v0")`` + exact ``evaluate(policy)`` in a fresh process.

Each repeat starts real subprocesses: the bare interpreter, a baseline (interpreter start +
``import iapo_gym``, which imports numpy, gymnasium and h5py) and
the measured one (the same, then ``gym.make`` and ``evaluate`` of a fixed policy). The figure is
the median wall time of the measured process minus the median baseline of the same run. A first
run converts the table into a private cache (not timed). Run::

    IAPO_GYM_OFFLINE=1 IAPO_GYM_DATA=../shared/iapo-release \\
        nice -n 10 .venv/bin/python benchmarks/bench_fresh.py --repeats 21

``--compile`` times instead a first training of ``auto`` (``TRAIN``: Synthetic-Bernoulli and
Synthetic-Categorical, T = 3,000) in a fresh process, cold (numba's cache an empty folder, so every
kernel it calls compiles) and warm (a cache those runs filled, so the kernels load), interleaved;
cold minus warm is what compiling costs a user once per install::

    nice -n 10 .venv/bin/python benchmarks/bench_fresh.py --compile --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

BARE = "pass"
BASELINE = "import iapo_gym"
MEASURED = """
import iapo_gym, gymnasium as gym
env = gym.make({env_id!r})
value = iapo_gym.evaluate([(0, 1)] * env.unwrapped.n_contexts, env)
assert value == value
"""
TRAIN = """
import gymnasium as gym
import agents, iapo_gym
for env_id in ("IAPO-SyntheticBernoulli-v0", "IAPO-SyntheticCategorical-v0"):
    env = gym.make(env_id, instance=0)
    env.reset(seed=0)
    agents.make("auto", seed=0).train(env, 3000)
"""


def run(code: str, env: dict[str, str]) -> float:
    """Wall time of one fresh interpreter running ``code``."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-id", default="IAPO-MATH-v0")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--user-cache", action="store_true",
                        help="use the user's cache ($IAPO_GYM_CACHE or the OS cache) instead of a private temporary one")
    parser.add_argument("--compile", action="store_true",
                        help="time a first training of auto with numba's cache empty and filled (module docstring)")
    args = parser.parse_args()
    if args.compile:
        compile_cost(args.repeats)
        return
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ) if args.user_cache else {**os.environ, "IAPO_GYM_CACHE": cache}
        code = MEASURED.format(env_id=args.env_id)
        run(code, env)  # converts the table into the private cache, compiles bytecode
        run(BASELINE, env)
        bare, base, full = [], [], []
        for _ in range(args.repeats):  # interleaved, so load changes hit all alike
            bare.append(run(BARE, env))
            base.append(run(BASELINE, env))
            full.append(run(code, env))
    a, b, f = statistics.median(bare), statistics.median(base), statistics.median(full)
    print(f"{args.env_id}: fresh process, median of {args.repeats}")
    print(f"  interpreter only              : {a * 1e3:7.1f} ms")
    print(f"  interpreter + import iapo_gym : {b * 1e3:7.1f} ms")
    print(f"  + gym.make + exact evaluate   : {f * 1e3:7.1f} ms")
    print(f"  beyond interpreter + import   : {(f - b) * 1e3:7.1f} ms")


def compile_cost(repeats: int) -> None:
    """Median wall time of ``TRAIN`` in fresh processes with numba's cache empty and filled (interleaved)."""
    cold, warm = [], []
    with tempfile.TemporaryDirectory() as folder:
        filled = {**os.environ, "NUMBA_CACHE_DIR": os.path.join(folder, "filled")}
        run(TRAIN, filled)  # fills the warm cache (not timed)
        for i in range(repeats):
            cold.append(run(TRAIN, {**os.environ, "NUMBA_CACHE_DIR": os.path.join(folder, f"empty{i}")}))
            warm.append(run(TRAIN, filled))
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"auto's first training (Synthetic-Bernoulli and -Categorical, T = 3,000): fresh process, median of {repeats}")
    print(f"  numba's cache empty  : {c:6.1f} s")
    print(f"  numba's cache filled : {w:6.1f} s")
    print(f"  compiling            : {c - w:6.1f} s")


if __name__ == "__main__":
    main()
