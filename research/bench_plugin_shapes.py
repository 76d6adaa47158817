"""Training time of the plug-in agents against PSST's on a majority-vote table of CommonsenseQA's shape.

The plug-in agents' cost grows with the live (prompt, query) rows and with the answer buckets
of each row (the exact majority-vote credit); MATH has few distinct answers per query, while a
multiple-choice task has five for every query. The official CommonsenseQA table is not
shipped, so this builds a random table of its shape (48 prompts, 1,500 queries, 5 answers,
N_max 32, the three MV contexts; every answer of positive probability, the costliest case for
the credit) and times, per budget, PSST and each agent on the same env seeds, interleaved, as
the median over ``--runs`` runs and its ratio to PSST's median.

With ``--kernel``, it times instead the compiled majority-vote credit (``agents._vote_credit.credit_rows``)
on the rows one ``auto`` run at 10K reads through it on that table (its prior-read and its unbiased rows), for
several rows per block, as the median over ``--runs`` calls and its ratio to one row per block in the same run.

Usage: ``nice -n 10 .venv/bin/python research/bench_plugin_shapes.py --runs 5`` (add ``--kernel``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import agents
from iapo_gym import IAPOEnv
from iapo_gym.leaderboard.run.specs import parse_agent_spec
from iapo_gym.seeding import derive_seed
from iapo_gym.tasks.synthetic import random_mv_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--budgets", type=int, nargs="+", default=[3000, 10000, 40000])
    parser.add_argument("--agents", nargs="+",
                        default=["auto", "plugin_halving"])
    parser.add_argument("--kernel", action="store_true", help="time the credit kernel's block sizes instead")
    args = parser.parse_args()
    env = IAPOEnv(table=random_mv_table(0, n_prompts=48, n_queries=1500, n_answers=5, n_max=32,
                                         cost_range=(0.004, 0.01), task="multiple_choice_shape"))
    env.reset(seed=0)
    env.pull(np.zeros(1, np.int64), np.ones(1, np.int64))  # builds the table's sampler before any clock
    if args.kernel:
        time_kernel(env, args.runs)
        return
    specs: dict[str, tuple[str, dict[str, object]]] = {"psst": ("psst", {})}
    for spec in args.agents:
        parsed = parse_agent_spec(spec)
        specs[parsed.label] = (parsed.name, dict(parsed.params))
    for name, kwargs in specs.values():
        agents.make(name, seed=0, **kwargs)  # compiles (or loads) any kernel before the clocks start
    print(f"| T | {' | '.join(specs)} |")
    print(f"|---:|{'---:|' * len(specs)}")
    for budget in args.budgets:
        times: dict[str, list[float]] = {spec: [] for spec in specs}
        for run in range(args.runs):
            seed = derive_seed(0, "bench_plugin_shapes", budget, run)
            for spec, (name, kwargs) in specs.items():
                env.reset(seed=seed)
                agent = agents.make(name, seed=seed, **kwargs)
                start = time.perf_counter()
                agent.train(env, budget)
                times[spec].append(time.perf_counter() - start)
                if env.budget_used > budget:
                    raise SystemExit(f"{spec} spent {env.budget_used} > {budget}")
        base = float(np.median(times["psst"]))
        cells = [f"{1000 * base:.1f} ms"] + [f"{1000 * np.median(times[s]):.1f} ms ({np.median(times[s]) / base:.1f}x)"
                                             for s in list(specs)[1:]]
        print(f"| {budget} | {' | '.join(cells)} |")


def time_kernel(env: IAPOEnv, runs: int) -> None:
    """Median time per row of ``credit_rows`` on one ``auto`` run's rows, per rows per block, against one per block."""
    from agents import _vote_credit

    recorded: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray | None]] = []
    kernel = _vote_credit.credit_rows

    def record(p_gold: np.ndarray, others: np.ndarray, width: np.ndarray, n_max: int,
               draws: np.ndarray | None = None) -> np.ndarray:
        recorded.append((p_gold.copy(), others.copy(), width.copy(), n_max, None if draws is None else draws.copy()))
        return kernel(p_gold, others, width, n_max, draws=draws)

    _vote_credit.credit_rows = record  # type: ignore[assignment]
    try:
        env.reset(seed=1)
        agents.make("auto", seed=1).train(env, 10_000)
    finally:
        _vote_credit.credit_rows = kernel  # type: ignore[assignment]
    n_rows = sum(p.size for p, _, _, _, _ in recorded)
    print(f"{n_rows} rows in {len(recorded)} calls (one auto run, T = 10,000)")
    print("| rows per block | per row | against 1 per block |")
    print("|---:|---:|---:|")
    base = 0.0
    for block_rows in (1, 32, 128, 512):
        times = []
        for _ in range(runs + 1):  # the first call compiles or warms the caches: not counted
            start = time.perf_counter()
            for p_gold, others, width, n_max, draws in recorded:
                kernel(p_gold, others, width, n_max, block_rows, draws)
            times.append(time.perf_counter() - start)
        per_row = float(np.median(times[1:])) / n_rows
        base = base or per_row
        print(f"| {block_rows} | {1e6 * per_row:.1f} us | {base / per_row:.2f}x |")


if __name__ == "__main__":
    main()
