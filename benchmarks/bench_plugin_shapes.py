"""Training time of the plug-in agents against PSST's on a majority-vote table of CommonsenseQA's shape.

The plug-in agents' cost grows with the live (prompt, query) rows and with the answer buckets
of each row (the exact majority-vote credit); MATH has few distinct answers per query, while a
multiple-choice task has five for every query. The official CommonsenseQA table is not
shipped, so this builds a random table of its shape (48 prompts, 1,500 queries, 5 answers,
N_max 32, the three MV contexts; every answer of positive probability, the costliest case for
the credit) and times, per budget, PSST and each agent on the same env seeds, interleaved, as
the median over ``--runs`` runs and its ratio to PSST's median.

Usage: ``nice -n 10 .venv/bin/python benchmarks/bench_plugin_shapes.py --runs 5``.
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
                        default=["auto", "plugin_anytime:n_min=2,kappa=2.0,votes=0,slope=3.0,pretest=0.0@round2",
                                 "plugin_halving"])
    args = parser.parse_args()
    env = IAPOEnv(table=random_mv_table(0, n_prompts=48, n_queries=1500, n_answers=5, n_max=32,
                                         cost_range=(0.004, 0.01), task="multiple_choice_shape"))
    env.reset(seed=0)
    env.pull(np.zeros(1, np.int64), np.ones(1, np.int64))  # builds the table's sampler before any clock
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


if __name__ == "__main__":
    main()
