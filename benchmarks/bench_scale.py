"""Benchmark: time and peak memory of the exact oracle and PSST as prompts P and contexts C grow.

Tables are Synthetic-Categorical (81-atom Best-of-N grid) with P prompts, Q queries and N_max 64,
and C contexts that all have distinct objective weightings (w1 evenly spaced in [0.05, 0.95],
w2 = 1 - w1, cost weight cycling 0.1 / 0.5 / 1.0), the worst case for the exact tensor. Each
size runs in its own subprocess; per step it records wall time and the tracemalloc peak (numpy
reports its buffers to tracemalloc), plus the process's ru_maxrss. Steps: build (generate and
validate the table), q_table on the test split (fresh table: nothing cached), PSST training at
T = 10K and 100K, and evaluate (exact test ACR of the PSST policy on a fresh table object, which
computes only the policy's arms).

Growth exponents are least-squares slopes of log(time) and log(peak) against log(P) (C fixed)
and log(C) (P fixed). Run (the default finishes in a few minutes on 2 shared cores)::

    nice -n 10 .venv/bin/python benchmarks/bench_scale.py
    nice -n 10 .venv/bin/python benchmarks/bench_scale.py --prompts 32 128 512 --contexts 27 243 1000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

STEPS = ("build", "q_table", "psst_10k", "psst_100k", "evaluate")


def contexts(n: int) -> tuple[np.ndarray, tuple[str, ...], np.ndarray]:
    """``n`` contexts with distinct objective weightings."""
    w1 = np.linspace(0.05, 0.95, n)
    cost = np.array([0.1, 0.5, 1.0])[np.arange(n) % 3]
    weights = np.column_stack([w1, 1.0 - w1, -cost])
    return weights, tuple(f"c{i}" for i in range(n)), np.full(n, 1.0 / n)


def build(n_prompts: int, n_contexts: int, n_queries: int, n_max: int):
    """The benchmark table of one size."""
    from dataclasses import replace

    from iapo_gym.tasks.synthetic import synthetic_categorical

    table = synthetic_categorical(0, n_prompts=n_prompts, n_queries=n_queries, n_max=n_max)
    weights, names, probs = contexts(n_contexts)
    return replace(table, context_weights=weights, context_names=names, context_probs=probs)


def measure(n_prompts: int, n_contexts: int, n_queries: int, n_max: int) -> dict[str, float]:
    """One size, all steps, in this process: {step: seconds, step_mb: peak MiB, maxrss_mb}."""
    import resource
    import tracemalloc
    from dataclasses import replace

    from agents.psst import PSST
    from iapo_gym.env import IAPOEnv
    from iapo_gym.oracle import exact_acr, q_table

    out: dict[str, float] = {}
    tracemalloc.start()

    def step(name: str, fn):
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        start = time.perf_counter()
        result = fn()
        out[name] = time.perf_counter() - start
        out[f"{name}_mb"] = (tracemalloc.get_traced_memory()[1] - base) / 2**20
        return result

    table = step("build", lambda: build(n_prompts, n_contexts, n_queries, n_max))
    test = table.split_indices("test")
    step("q_table", lambda: q_table(replace(table), test))
    policy = None
    for name, budget in (("psst_10k", 10_000), ("psst_100k", 100_000)):
        env = IAPOEnv(table=table)
        env.reset(seed=0)
        policy = step(name, lambda env=env, budget=budget: PSST(seed=0).train(env, budget))
    step("evaluate", lambda: exact_acr(replace(table), policy, test))
    tracemalloc.stop()
    out["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def run_size(n_prompts: int, n_contexts: int, n_queries: int, n_max: int) -> dict[str, float]:
    """``measure`` in a fresh subprocess (so ru_maxrss is this size's alone)."""
    code = (f"import json, benchmarks.bench_scale as b; "
            f"print(json.dumps(b.measure({n_prompts}, {n_contexts}, {n_queries}, {n_max})))")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares exponent of y ~ x^k."""
    if len(xs) < 2:
        return float("nan")
    return float(np.polyfit(np.log(xs), np.log(np.maximum(ys, 1e-9)), 1)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[32, 64, 128], help="P sweep (C = first --contexts)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[27, 81, 243], help="C sweep (P = first --prompts)")
    parser.add_argument("--queries", type=int, default=128, help="Q (default 128; 80%% train)")
    parser.add_argument("--n-max", type=int, default=64)
    parser.add_argument("--json", help="also write all rows to this JSON file")
    args = parser.parse_args()
    p0, c0 = args.prompts[0], args.contexts[0]
    sizes = [(p, c0) for p in args.prompts] + [(p0, c) for c in args.contexts[1:]]
    rows = []
    print(f"Q = {args.queries}, N_max = {args.n_max}; seconds and tracemalloc peak MiB per step")
    print(f"{'P':>5} {'C':>5} " + " ".join(f"{s:>18}" for s in STEPS) + f" {'maxrss MiB':>11}")
    for p, c in sizes:
        r = run_size(p, c, args.queries, args.n_max)
        rows.append({"P": p, "C": c, **r})
        cells = " ".join(f"{r[s]:8.3f}s {r[s + '_mb']:7.1f}M" for s in STEPS)
        print(f"{p:>5} {c:>5} {cells} {r['maxrss_mb']:11.1f}", flush=True)
    by_p = [r for r in rows if r["C"] == c0]
    by_c = [r for r in rows if r["P"] == p0]
    print("growth exponents (time, peak memory)")
    for s in STEPS:
        print(f"  {s:10s} in P: {slope([r['P'] for r in by_p], [r[s] for r in by_p]):5.2f}, "
              f"{slope([r['P'] for r in by_p], [r[s + '_mb'] for r in by_p]):5.2f}   "
              f"in C: {slope([r['C'] for r in by_c], [r[s] for r in by_c]):5.2f}, "
              f"{slope([r['C'] for r in by_c], [r[s + '_mb'] for r in by_c]):5.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"queries": args.queries, "n_max": args.n_max, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
