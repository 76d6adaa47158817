"""An agent with stopping rules against the same agent without them, paired, on generated levels.

For each level of each family and each seed, the agent trains twice on the level's stored train split with the
same env seed and agent seed, once on ``IAPOEnv(rule_arms=False)`` and once with ``rule_arms=True`` (the same
completions for every agent but ``random``: docs/agents.md, "Stopping rules"), and both policies are scored by
the exact test ACR (``env.evaluate``). It prints each pair, the test-optimal ACR over (p, N) and over (p, N, rule),
and per family the mean paired gain +- its SEM and how many pairs gained. Tuning: levels below 10,000; held-out
reports: levels from 1,000,000.

    nice -n 10 python research/rules_paired.py auto --families mv_categorical mv_binary math_like \\
        --levels 1000000:1000003 --seeds 4 --budget 10000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import agents  # noqa: E402
from iapo_gym.env import generated_env  # noqa: E402


def paired(agent: str, family: str, level: int, seed: int, budget: int) -> tuple[float, float]:
    """Test ACR of ``agent`` trained without and with ``rule_arms`` on the same env seed and agent seed."""
    acr = []
    for rule_arms in (False, True):
        env = generated_env(family, level, rule_arms=rule_arms)
        env.reset(seed=1000 + seed)
        acr.append(env.evaluate(agents.make(agent, seed=seed).train(env, budget), "test"))
    return acr[0], acr[1]


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run the pairs, print them and each family's summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("agent", help="a registered agent name")
    parser.add_argument("--families", nargs="+", default=["mv_categorical", "mv_binary", "math_like"])
    parser.add_argument("--levels", default="0:5", help="FIRST:LAST levels, inclusive (default 0:5)")
    parser.add_argument("--seeds", type=int, default=2, help="env and agent seeds per level (default 2)")
    parser.add_argument("--budget", type=int, default=10_000)
    args = parser.parse_args(argv)
    first, last = (int(x) for x in args.levels.split(":"))
    for family in args.families:
        gains = []
        for level in range(first, last + 1):
            q4 = generated_env(family, level).q_table("test", rules=True)
            weights = generated_env(family, level).table.context_probs
            ceiling_rules = float(weights @ q4.max(axis=(1, 2, 3)))
            ceiling_fixed = float(weights @ q4[..., 0].max(axis=(1, 2)))
            for seed in range(args.seeds):
                without, with_rules = paired(args.agent, family, level, seed, args.budget)
                gains.append(with_rules - without)
                print(f"{family} level {level} seed {seed}: without {without:.4f} with {with_rules:.4f} "
                      f"gain {gains[-1]:+.4f} (test-optimal: fixed N {ceiling_fixed:.4f}, rules {ceiling_rules:.4f})",
                      flush=True)
        g = np.array(gains)
        sem = g.std(ddof=1) / np.sqrt(g.size) if g.size > 1 else float("nan")
        print(f"== {args.agent} {family} T={args.budget}: gain {g.mean():+.4f} +- {sem:.4f}, "
              f"gained on {int((g > 0).sum())} of {g.size}", flush=True)


if __name__ == "__main__":
    main()
