"""A user-written IAPO agent: anything with ``train(env, budget) -> policy`` plugs in.

This one pulls every prompt at N_max as often as the budget allows, reads every smaller
scale from disjoint blocks of those completions (nested reuse), and deploys the best
estimated arm of each context. Run: ``python examples/custom_agent.py``.
"""

import gymnasium as gym
import numpy as np

import iapo_gym
from iapo_gym import Policy


class GreedyAtNMax:
    """Uniform pulls at N_max, estimates for all (context, prompt, N), greedy deployment."""

    def __init__(self, seed=None):
        self.rng = np.random.default_rng(seed)  # unused here; agents own their random draws

    def train(self, env, budget):
        """Spend at most ``budget`` completions and return one arm per context."""
        base = env.unwrapped  # the vectorized path lives on the IAPOEnv itself
        n_p, n_max = base.n_prompts, base.n_max
        per_prompt = budget // (n_p * n_max)
        n = n_max if per_prompt else max(1, budget // n_p)  # small budgets: one pull at a lower N
        prompts = np.repeat(np.arange(n_p), max(per_prompt, 1))[: budget // n]
        pulls = base.pull(prompts, np.full(prompts.size, n))
        sums = np.zeros((base.n_contexts, n_p, n_max))
        counts = np.zeros((n_p, n_max))
        for k in range(1, n + 1):  # every block of k completions is a sample of (p, k)
            pull_index, utils = base.block_utilities(pulls, k)  # (C, blocks), all contexts at once
            for c in range(base.n_contexts):
                sums[c, :, k - 1] += np.bincount(pulls.prompts[pull_index], utils[c], minlength=n_p)
            counts[:, k - 1] += np.bincount(pulls.prompts[pull_index], minlength=n_p)
        means = np.where(counts > 0, sums / np.maximum(counts, 1), -np.inf)
        best = means.reshape(base.n_contexts, -1).argmax(axis=1)
        return Policy(tuple((int(b // n_max), int(b % n_max) + 1) for b in best))


if __name__ == "__main__":
    env = gym.make("IAPO-SyntheticBernoulli-v0", instance=0)
    env.reset(seed=0)
    policy = GreedyAtNMax(seed=0).train(env, budget=10_000)
    print(f"spent {env.unwrapped.budget_used} completions; policy {policy.arms}")
    print(f"exact test ACR: {iapo_gym.evaluate(policy, env):.4f}")
    print(f"optimal:        {iapo_gym.evaluate(env.unwrapped.optimal_policy('test'), env):.4f}")
