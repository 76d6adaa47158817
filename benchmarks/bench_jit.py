"""Benchmark of the optional numba loop of the sequential baselines: numpy path vs JIT path.

For every task (MATH from ``IAPO_GYM_DATA`` or ``--release``, Synthetic-Bernoulli, Synthetic-
Categorical) and each of softmax, epsilon-greedy and UCB: the median training time at T =
``--budget`` over ``--runs`` seeded runs with the numpy path (``IAPO_GYM_JIT=0``) and with the
compiled one, timed alternately in this process, their ratio, and a check that both train the
same policy with the same budget spent and the same env and agent generator states afterwards.
The one-off compile is excluded from the timings and measured separately in a subprocess with
an empty numba cache. ``--others`` also times PSST, TRIPLE (n1, random N) and sequential
halving (round-based batch agents, no JIT) on the same runs for comparison.

Usage: ``IAPO_GYM_OFFLINE=1 IAPO_GYM_DATA=../shared/iapo-release nice -n 10 .venv/bin/python
benchmarks/bench_jit.py --runs 5 --others``. Seeds come from ``iapo_gym.seeding.derive_seed``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np

import agents
from agents import _jit
from agents.base import Agent
from iapo_gym import IAPOEnv
from iapo_gym.seeding import derive_seed

ROOT = Path(__file__).resolve().parents[1]
SEQUENTIAL = ["softmax", "epsilon_greedy", "ucb"]
OTHERS = ["psst", "triple_n1", "triple_random_n", "sequential_halving"]
COMPILE_SNIPPET = """
import time, numpy as np
import agents
from iapo_gym import IAPOEnv
from tests.conftest import tiny_bon_table, tiny_mv_table
start = time.perf_counter()
for make in (tiny_mv_table, tiny_bon_table):
    env = IAPOEnv(table=make(seed=0, n_prompts=2, n_max=4))
    env.reset(seed=0)
    agents.make("ucb", seed=0).train(env, 20)
print(time.perf_counter() - start)
"""


def task_envs(release: Path | None) -> dict[str, IAPOEnv]:
    """The benchmark's tasks: MATH (when the release is found) and the two synthetic ones."""
    envs: dict[str, IAPOEnv] = {}
    if release is not None and release.is_file():
        from iapo_gym.data.release import read_release

        envs["MATH"] = IAPOEnv(table=read_release(str(release))[0])
    else:
        print(f"warning: MATH release not found ({release}); synthetic tasks only", file=sys.stderr)
    envs["Synthetic-Bernoulli"] = Agent.base_env(gym.make("IAPO-SyntheticBernoulli-v0", instance=0))
    envs["Synthetic-Categorical"] = Agent.base_env(gym.make("IAPO-SyntheticCategorical-v0", instance=0))
    return envs


def one_run(env: IAPOEnv, name: str, budget: int, seed: int, i: int, jit: bool) -> tuple[float, tuple]:
    """(training time in s, what must match across paths) of run ``i`` of agent ``name``."""
    os.environ["IAPO_GYM_JIT"] = "1" if jit else "0"
    env.reset(seed=derive_seed(seed, "time", i))
    agent = agents.make(name, seed=derive_seed(seed, "agent", name, i))
    start = time.perf_counter()
    policy = agent.train(env, budget)
    elapsed = time.perf_counter() - start
    return elapsed, (policy.arms, env.budget_used, float(env.np_random.random()), float(agent.rng.random()))


def compile_seconds() -> float:
    """Seconds of the first compiled training calls (both aggregators) in a fresh process with an empty cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": cache, "IAPO_GYM_JIT": "1"}
        out = subprocess.run([sys.executable, "-c", COMPILE_SNIPPET], env=env, cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Print the markdown tables (times in ms, medians over the runs)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--budget", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=2025)
    data = os.environ.get("IAPO_GYM_DATA")
    parser.add_argument("--release", type=Path, default=Path(data) / "MATH_final.pkl" if data else None)
    parser.add_argument("--others", action="store_true", help="also time PSST, TRIPLE and sequential halving")
    args = parser.parse_args(argv)
    if not _jit.enabled():
        raise SystemExit("the JIT path is unavailable (numba missing or IAPO_GYM_JIT=0)")
    print(f"compile (fresh process, empty numba cache, both aggregators): {compile_seconds():.1f} s\n")
    lines = [f"| task | agent | numpy median (T = {args.budget:,}) | JIT median | numpy/JIT | identical |",
             "|---|---|---|---|---|---|"]
    others = [f"| task | agent | median (T = {args.budget:,}) |", "|---|---|---|"]
    for task, env in task_envs(args.release).items():
        env.resplit(0.8, seed=derive_seed(args.seed, "resplit", 0))
        for name in SEQUENTIAL:
            one_run(env, name, 50, args.seed + 1, 0, jit=True)  # load or compile the kernel outside the timings
            numpy_t, jit_t, same = [], [], True
            for i in range(args.runs):
                t_np, r_np = one_run(env, name, args.budget, args.seed, i, jit=False)
                t_jit, r_jit = one_run(env, name, args.budget, args.seed, i, jit=True)
                numpy_t.append(t_np)
                jit_t.append(t_jit)
                same &= r_np == r_jit
            a, b = np.median(numpy_t) * 1000, np.median(jit_t) * 1000
            lines.append(f"| {task} | {name} | {a:.1f} ms | {b:.2f} ms | {a / b:.0f}x | {'yes' if same else 'NO'} |")
            print(lines[-1], flush=True)
        if args.others:
            for name in OTHERS:
                times = [one_run(env, name, args.budget, args.seed, i, jit=False)[0] for i in range(args.runs)]
                others.append(f"| {task} | {name} | {np.median(times) * 1000:.1f} ms |")
                print(others[-1], flush=True)
    print("\n" + "\n".join(lines))
    if args.others:
        print("\n" + "\n".join(others))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
