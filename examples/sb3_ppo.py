"""PPO (Stable-Baselines3) on IAPO-SyntheticCategorical-v0, scored beside PSST at the same budget.

Needs the sb3 extra: ``pip install torch==2.13.0`` then ``pip install -e ".[sb3]"``.
Run: ``python examples/sb3_ppo.py [--budget 10000] [--seed 0]``.
"""

from __future__ import annotations

import argparse

import gymnasium as gym

import agents
import iapo_gym
from iapo_gym import IAPOEnv, Policy

TASK = "IAPO-SyntheticCategorical-v0"


def train(agent_name: str, budget: int, seed: int, **params: object) -> tuple[Policy, float, int]:
    """Train agent ``agent_name`` on a fresh env; (policy, exact test ACR, completions spent)."""
    env = gym.make(TASK)
    env.reset(seed=seed)
    base = env.unwrapped
    assert isinstance(base, IAPOEnv)
    policy = Policy.coerce(agents.make(agent_name, seed=seed, **params).train(env, budget), base.n_contexts)
    return policy, iapo_gym.evaluate(policy, env, "test"), base.budget_used


def main(argv: list[str] | None = None) -> None:
    """Train PPO, then PSST, at the same budget and print both exact test ACRs beside the optimum."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=10_000, help="completions per agent (default 10000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    base = gym.make(TASK).unwrapped
    assert isinstance(base, IAPOEnv)
    optimum = base.evaluate(base.optimal_policy("test"))
    ppo_policy, ppo_acr, ppo_spent = train("sb3", args.budget, args.seed, algo="PPO")
    print(f"{TASK}, budget {args.budget} completions, exact test ACR (optimal {optimum:.4f}):")
    print(f"  sb3 PPO: {ppo_acr:.4f}  (spent {ppo_spent})")
    _, psst_acr, psst_spent = train("psst", args.budget, args.seed)
    print(f"  PSST:    {psst_acr:.4f}  (spent {psst_spent})")
    names = base.table.context_names
    print("PPO's greedy arm per context:")
    for c, (p, n) in enumerate(ppo_policy.arms):
        print(f"  {names[c]:>24}: prompt {p:2d}, N = {n:2d}")


if __name__ == "__main__":
    main()
