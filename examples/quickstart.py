"""Quickstart: make a synthetic IAPO task, step it, and print its exact optimal policy and ACR."""

import gymnasium as gym
import numpy as np

import iapo_gym  # noqa: F401  (registers the IAPO-* ids)

env = gym.make("IAPO-SyntheticBernoulli-v0", instance=0)
obs, info = env.reset(seed=0)
obs, reward, terminated, truncated, info = env.step((3, 8))  # prompt 3, majority vote of 8
print(f"context {info['context_name']}: one pull of (p=3, N=8) gave utility {reward:.3f}")

base = env.unwrapped
policy = base.optimal_policy("test")
for c, (p, n) in enumerate(policy.arms):
    print(f"  optimal arm in context {base.table.context_names[c]:>4}: prompt {p:2d} ({base.table.prompts[p]}), N = {n}")
print(f"exact test ACR of the optimal policy: {iapo_gym.evaluate(policy, env):.4f}")
mc, se = base.evaluate_monte_carlo(policy, n_samples=10_000, seed=1)
print(f"Monte Carlo check (10,000 samples): {mc:.4f} +- {se:.4f}")
single = base.q_table("test")[:, :, 0]  # N = 1 only
best_n1 = [(int(np.argmax(row)), 1) for row in single]
print(f"best single-sample (N=1) policy: exact test ACR {iapo_gym.evaluate(best_n1, env):.4f}")
