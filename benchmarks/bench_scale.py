"""Benchmark: time and peak memory of the exact oracle and PSST as prompts P and contexts C grow.

Tables are Synthetic-Categorical (81-atom Best-of-N grid) with P prompts, Q queries and N_max 64,
and C contexts that all have distinct objective weightings (w1 evenly spaced in [0.05, 0.95],
w2 = 1 - w1, cost weight cycling 0.1 / 0.5 / 1.0), the worst case for the exact tensor. Each
size runs in its own subprocess; per step it records wall time and the tracemalloc peak (numpy
reports its buffers to tracemalloc), plus the process's ru_maxrss. Steps: build (generate and
validate the table), q_table on the test split (fresh table: nothing cached), PSST training at
T = 10K and 100K, evaluate (exact test ACR of the PSST policy on a fresh table object, which
computes only the policy's arms), with ``--auto`` the ``auto`` agent at T = 100K, and with ``--rules`` the Q-table over
the stopping rules, ``q_table(test, rules=True)`` (fresh table: the exact tensor and the rules' tensors computed; a
table whose rules' tensors exceed ``iapo_gym.exact.TENSOR_LIMIT_BYTES`` is refused, shown as nan), beside today's
``q_table`` with the ratio of the two.

Each size also reports the Best-of-N kernel's throughput: the operations the per-weighting formula
needs for that q_table, 2 x C' x P x Q' x M x N_max (C' distinct weightings, M atoms, Q' the test
queries, or every query when the whole tensor is built), divided by q_table's time, beside a
float64 matrix product (numpy's dgemm) of the kernel's shape, (16384 x M) @ (M x C'), and a square
one (2048^3), best of 3 each, timed in the same process right after q_table.

``--kernel P C`` instead times q_table of one P x C table with the grouped kernel and with the
per-weighting kernel (every weighting on its own, ``iapo_gym.exact.bon_expected_max``), alternating,
in one process (median of ``--repeats``), and prints their largest difference; ``--kernel-paper``
does the same on the paper's Synthetic-Categorical task (instance 0: 27 contexts, 9 distinct weightings).

Growth exponents are least-squares slopes of log(time) and log(peak) against log(P) (C fixed)
and log(C) (P fixed). Run (the default finishes in a few minutes on 2 shared cores)::

    nice -n 10 .venv/bin/python benchmarks/bench_scale.py
    nice -n 10 .venv/bin/python benchmarks/bench_scale.py --prompts 1000 --contexts 1000 --auto
    nice -n 10 .venv/bin/python benchmarks/bench_scale.py --prompts 16 32 --contexts 9 27 --rules
    nice -n 10 .venv/bin/python benchmarks/bench_scale.py --kernel 256 256 --repeats 3
    nice -n 10 .venv/bin/python benchmarks/bench_scale.py --kernel-paper --repeats 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

STEPS = ("build", "q_table", "psst_10k", "psst_100k", "evaluate")
KERNEL_SHAPE_ROWS = 16384  # rows of the dgemm of the kernel's shape: (rows x M) @ (M x C')


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


def best_seconds(fn, repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def dgemm_gflops(n_atoms: int, n_weightings: int) -> tuple[float, float]:
    """GFLOP/s of numpy's float64 matrix product: of the kernel's shape, and square 2048^3."""
    rng = np.random.default_rng(0)
    a, b = rng.random((KERNEL_SHAPE_ROWS, n_atoms)), rng.random((n_atoms, n_weightings))
    shaped = 2 * KERNEL_SHAPE_ROWS * n_atoms * n_weightings / best_seconds(lambda: a @ b) / 1e9
    x, y = rng.random((2048, 2048)), rng.random((2048, 2048))
    square = 2 * 2048**3 / best_seconds(lambda: x @ y) / 1e9
    return shaped, square


def kernel_operations(table, queries: np.ndarray) -> float:
    """2 x C' x P x Q' x M x N_max: the per-weighting formula's multiply-adds for a fresh q_table on ``queries``
    (Q' = every query when the whole tensor fits ``TENSOR_LIMIT_BYTES`` and is built, else the asked ones)."""
    from iapo_gym.exact import objective_rows, task_reward_fits

    n_weightings = objective_rows(table)[0].shape[0]
    n_queries = table.n_queries if task_reward_fits(table) else queries.size
    return 2.0 * n_weightings * table.n_prompts * n_queries * table.n_atoms * table.n_max


def measure(n_prompts: int, n_contexts: int, n_queries: int, n_max: int, with_auto: bool = False,
            with_rules: bool = False) -> dict[str, float]:
    """One size, all steps, in this process: {step: seconds, step_mb: peak MiB, maxrss_mb, GFLOP/s figures}."""
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
    if with_rules:
        try:
            step("q_table_rules", lambda: q_table(replace(table), test, rules=True))
        except ValueError:  # the rules' tensors exceed TENSOR_LIMIT_BYTES: refused
            out["q_table_rules"] = out["q_table_rules_mb"] = float("nan")
    tracemalloc.stop()  # the reference products are timed untraced, as numpy runs them
    out["q_table_gflops"] = kernel_operations(table, test) / out["q_table"] / 1e9
    out["dgemm_shape_gflops"], out["dgemm_square_gflops"] = dgemm_gflops(table.n_atoms, n_contexts)
    tracemalloc.start()
    policy = None
    for name, budget in (("psst_10k", 10_000), ("psst_100k", 100_000)):
        env = IAPOEnv(table=table)
        env.reset(seed=0)
        policy = step(name, lambda env=env, budget=budget: PSST(seed=0).train(env, budget))
    step("evaluate", lambda: exact_acr(replace(table), policy, test))
    if with_auto:
        import agents

        env = IAPOEnv(table=table)
        env.reset(seed=0)
        step("auto_100k", lambda: agents.make("auto", seed=0).train(env, 100_000))
    tracemalloc.stop()
    out["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def run_size(n_prompts: int, n_contexts: int, n_queries: int, n_max: int, with_auto: bool,
             with_rules: bool = False) -> dict[str, float]:
    """``measure`` in a fresh subprocess (so ru_maxrss is this size's alone)."""
    code = (f"import json, benchmarks.bench_scale as b; "
            f"print(json.dumps(b.measure({n_prompts}, {n_contexts}, {n_queries}, {n_max}, {with_auto}, {with_rules})))")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_kernels(n_prompts: int, n_contexts: int, n_queries: int, n_max: int, repeats: int,
                    paper_task: bool = False) -> None:
    """q_table of one table with the grouped and the per-weighting kernel, alternating, in this process
    (``paper_task``: Synthetic-Categorical instance 0 as the paper task has it, 27 contexts)."""
    import statistics
    from dataclasses import replace

    import iapo_gym.exact as exact
    from iapo_gym.oracle import q_table
    from iapo_gym.tasks.synthetic import synthetic_categorical

    table = synthetic_categorical(0) if paper_task else build(n_prompts, n_contexts, n_queries, n_max)
    n_prompts, n_contexts, n_queries, n_max = table.n_prompts, table.n_contexts, table.n_queries, table.n_max
    test = table.split_indices("test")
    grouped_share = exact._MIN_SHARE
    times: dict[str, list[float]] = {"grouped": [], "per-weighting": []}
    results = {}
    for _ in range(repeats):
        for name, share in (("grouped", grouped_share), ("per-weighting", 1 << 62)):
            exact._MIN_SHARE = share  # 2^62: no table shares its atoms that often, so every weighting runs alone
            start = time.perf_counter()
            results[name] = q_table(replace(table), test)
            times[name].append(time.perf_counter() - start)
    exact._MIN_SHARE = grouped_share
    operations = kernel_operations(table, test)
    distinct = exact.objective_rows(table)[0].shape[0]
    print(f"q_table, P = {n_prompts}, C = {n_contexts} ({distinct} distinct weightings), Q = {n_queries} "
          f"({test.size} test queries), N_max = {n_max}; median of {repeats}, alternating")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:13s} {median:8.2f} s  ({operations / median / 1e9:6.1f} GFLOP/s of the per-weighting "
              f"formula's {operations:.3g} operations)  runs: {', '.join(f'{v:.2f}' for v in values)}")
    print(f"  ratio {statistics.median(times['per-weighting']) / statistics.median(times['grouped']):.1f}x; "
          f"largest difference {np.abs(results['grouped'] - results['per-weighting']).max():.2e}")
    shaped, square = dgemm_gflops(table.n_atoms, distinct)
    print(f"  numpy dgemm in this process: {shaped:.1f} GFLOP/s at ({KERNEL_SHAPE_ROWS} x {table.n_atoms}) @ "
          f"({table.n_atoms} x {n_contexts}), {square:.1f} GFLOP/s at 2048^3 (best of 3)")


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares exponent of y ~ x^k over the finite y (a refused step is nan)."""
    keep = [(x, y) for x, y in zip(xs, ys, strict=True) if np.isfinite(y)]
    if len(keep) < 2:
        return float("nan")
    x, y = np.array(keep).T
    return float(np.polyfit(np.log(x), np.log(np.maximum(y, 1e-9)), 1)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[32, 64, 128], help="P sweep (C = first --contexts)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[27, 81, 243], help="C sweep (P = first --prompts)")
    parser.add_argument("--queries", type=int, default=128, help="Q (default 128; 80%% train)")
    parser.add_argument("--n-max", type=int, default=64)
    parser.add_argument("--json", help="also write all rows to this JSON file")
    parser.add_argument("--auto", action="store_true", help="also train the auto agent at T = 100K")
    parser.add_argument("--rules", action="store_true",
                        help="also time q_table(test, rules=True), the Q-table over the stopping rules, beside q_table")
    parser.add_argument("--kernel", type=int, nargs=2, metavar=("P", "C"),
                        help="only compare the grouped and the per-weighting kernel on one P x C table")
    parser.add_argument("--kernel-paper", action="store_true",
                        help="only compare the two kernels on the paper's Synthetic-Categorical (instance 0, 27 contexts)")
    parser.add_argument("--repeats", type=int, default=3, help="--kernel: alternating runs per kernel")
    args = parser.parse_args()
    if args.kernel or args.kernel_paper:
        p, c = args.kernel or (0, 0)
        compare_kernels(p, c, args.queries, args.n_max, args.repeats, paper_task=args.kernel_paper)
        return
    steps = STEPS[:2] + (("q_table_rules",) if args.rules else ()) + STEPS[2:] + (("auto_100k",) if args.auto else ())
    p0, c0 = args.prompts[0], args.contexts[0]
    sizes = [(p, c0) for p in args.prompts] + [(p0, c) for c in args.contexts[1:]]
    rows = []
    print(f"Q = {args.queries}, N_max = {args.n_max}; seconds and tracemalloc peak MiB per step")
    print(f"{'P':>5} {'C':>5} " + " ".join(f"{s:>18}" for s in steps) + f" {'maxrss MiB':>11}"
          + "  kernel / dgemm (kernel's shape, square) GFLOP/s")
    for p, c in sizes:
        r = run_size(p, c, args.queries, args.n_max, args.auto, args.rules)
        rows.append({"P": p, "C": c, **r})
        cells = " ".join(f"{r[s]:8.3f}s {r[s + '_mb']:7.1f}M" for s in steps)
        print(f"{p:>5} {c:>5} {cells} {r['maxrss_mb']:11.1f}  {r['q_table_gflops']:6.1f} / "
              f"{r['dgemm_shape_gflops']:.1f}, {r['dgemm_square_gflops']:.1f}"
              + (f"  rules / q_table {r['q_table_rules'] / r['q_table']:.1f}x" if args.rules else ""), flush=True)
    by_p = [r for r in rows if r["C"] == c0]
    by_c = [r for r in rows if r["P"] == p0]
    if len(sizes) < 2:
        _write(args.json, args, rows)
        return
    print("growth exponents (time, peak memory)")
    for s in steps:
        print(f"  {s:10s} in P: {slope([r['P'] for r in by_p], [r[s] for r in by_p]):5.2f}, "
              f"{slope([r['P'] for r in by_p], [r[s + '_mb'] for r in by_p]):5.2f}   "
              f"in C: {slope([r['C'] for r in by_c], [r[s] for r in by_c]):5.2f}, "
              f"{slope([r['C'] for r in by_c], [r[s + '_mb'] for r in by_c]):5.2f}")
    _write(args.json, args, rows)


def _write(path: str | None, args: argparse.Namespace, rows: list[dict]) -> None:
    """Write the rows to ``path`` as JSON (if given)."""
    if path:
        with open(path, "w") as fh:
            json.dump({"queries": args.queries, "n_max": args.n_max, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
