"""A generic deep-RL baseline: a Stable-Baselines3 model (PPO, A2C or DQN) trained on the IAPO env.

The model sees the env through ``iapo_gym.wrappers`` (a completion budget, optionally a
one-hot context, a 0-based flat action) and learns from single pulls like any one-step RL
task; it knows nothing of the (p, N) structure nor reuses completions across contexts or
scales, which is what makes it the generic baseline. stable-baselines3 is an optional extra.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from agents.base import Agent
from iapo_gym import IAPOEnv, Policy
from iapo_gym.seeding import derive_seed
from iapo_gym.wrappers import ACTION_KINDS, FlattenArm, MultiDiscreteArm, flatten_env

#: Algorithms this agent drives.
ALGOS = ("PPO", "A2C", "DQN")

INSTALL_HINT = 'pip install torch==2.13.0, then pip install -e ".[sb3]" (the sb3 extra: stable-baselines3)'

#: Small-network defaults for a one-step contextual bandit: every episode ends after one
#: step, so the discount is irrelevant (0); short rollouts so training starts early.
DEFAULTS: dict[str, dict[str, Any]] = {
    "PPO": {"n_steps": 64, "batch_size": 64, "n_epochs": 4, "learning_rate": 3e-3, "gamma": 0.0,
            "gae_lambda": 1.0, "ent_coef": 0.01},
    "A2C": {"n_steps": 8, "learning_rate": 3e-3, "gamma": 0.0, "gae_lambda": 1.0, "ent_coef": 0.01},
    "DQN": {"learning_rate": 1e-3, "learning_starts": 64, "batch_size": 64, "train_freq": 1, "gradient_steps": 1,
            "target_update_interval": 100, "exploration_final_eps": 0.05, "gamma": 0.0},
}


def import_sb3() -> Any:
    """The ``stable_baselines3`` module, or an ImportError saying how to install the extra."""
    try:
        import stable_baselines3
    except ImportError as exc:
        raise ImportError(f"the 'sb3' agent needs stable-baselines3 and torch: {INSTALL_HINT}") from exc
    return stable_baselines3


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` torch threads (small nets are fastest and reproducible on one), then restore."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _budget_callback(base_callback: Any) -> Any:
    """An SB3 callback that stops training once the budget wrapper refuses a step or runs dry."""

    class StopOnBudget(base_callback):
        """Returns False (stop) when any env's info shows a refused step or an empty budget."""

        def _on_step(self) -> bool:
            return not any(info.get("budget_refused") or info.get("budget_remaining", 1) <= 0
                           for info in self.locals["infos"])

    return StopOnBudget()


class SB3Agent(Agent):
    """Train an SB3 ``algo`` within the completion budget; the policy is its greedy action per context.

    Every env step is one pull and costs its N; the env is wrapped in ``CompletionBudget``,
    so the sum of N never exceeds ``budget``: training stops at the first step that would
    overspend (that step is refused, not executed), leaving at most N_max - 1 completions
    unspent. A rollout cut short by the budget is not trained on (SB3 stops collecting).
    ``seed`` seeds SB3 (python, numpy, torch, action sampling) and the env's first
    ``reset(seed=...)``, so the same seed gives the same policy; ``seed=None`` leaves the env's
    generator as the caller seeded it.
    """

    def __init__(self, seed: int | None = None, algo: str = "PPO", action: str | None = None,
                 one_hot: bool = False, net_arch: tuple[int, ...] | list[int] = (64,),
                 algo_kwargs: dict[str, Any] | None = None, torch_threads: int = 1) -> None:
        """``algo`` PPO/A2C/DQN; ``action`` "discrete" or "multidiscrete" (default: multidiscrete for
        PPO/A2C, discrete for DQN, which supports nothing else); ``one_hot`` observes the context
        index instead of its weight vector (the default, the weights, lets the network share what
        it learns between similar contexts); ``algo_kwargs`` override the defaults in ``DEFAULTS``."""
        super().__init__(seed)
        key = str(algo).upper()
        if key not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
        if action is None:
            action = "discrete" if key == "DQN" else "multidiscrete"
        if action not in ACTION_KINDS:
            raise ValueError(f"action must be one of {ACTION_KINDS}, got {action!r}")
        if key == "DQN" and action != "discrete":
            raise ValueError(f"DQN supports only the discrete action encoding, got action={action!r}")
        arch = tuple(net_arch)
        if not arch or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w > 0 for w in arch):
            raise ValueError(f"net_arch must be a non-empty sequence of positive layer widths, got {net_arch!r}")
        if not isinstance(torch_threads, int) or torch_threads < 1:
            raise ValueError(f"torch_threads must be an integer >= 1, got {torch_threads!r}")
        if algo_kwargs is not None and not isinstance(algo_kwargs, dict):
            raise ValueError(f"algo_kwargs must be a dict of {key} constructor arguments, got {algo_kwargs!r}")
        self.algo = key
        self.action = action
        self.one_hot = bool(one_hot)
        self.net_arch = tuple(int(w) for w in arch)
        self.algo_kwargs = dict(algo_kwargs or {})
        self.torch_threads = torch_threads
        self.model: Any = None  # the trained SB3 model, kept for inspection
        import_sb3()  # fail at construction, with the install hint, not mid-sweep

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"algo": self.algo, "action": self.action, "one_hot": self.one_hot, "net_arch": list(self.net_arch),
                "algo_kwargs": dict(self.algo_kwargs), "torch_threads": self.torch_threads}

    def model_kwargs(self, base: IAPOEnv, budget: int) -> dict[str, Any]:
        """The SB3 constructor arguments for ``base`` and ``budget`` (defaults, then ``algo_kwargs``)."""
        kwargs = dict(DEFAULTS[self.algo])
        if self.algo == "DQN":
            # Stretch exploration over half the steps a uniform-random policy would take
            # (budget / mean N); SB3 measures it against total_timesteps = budget.
            kwargs["exploration_fraction"] = min(1.0, 0.5 * 2.0 / (base.n_max + 1))
            kwargs["buffer_size"] = max(1, min(budget, 100_000))
        kwargs.update(self.algo_kwargs)
        policy_kwargs = {"net_arch": list(self.net_arch), **kwargs.pop("policy_kwargs", {})}
        sb3_seed = None if self.seed is None else derive_seed(self.seed, "sb3") % 2**32
        return {**kwargs, "policy_kwargs": policy_kwargs, "seed": sb3_seed, "device": "cpu", "verbose": 0}

    def train(self, env: Any, budget: int) -> Policy:
        """Train within ``budget`` completions of ``env``'s base IAPOEnv; the greedy policy per context."""
        budget = self.check_budget(budget)
        base = self.base_env(env)
        sb3 = import_sb3()
        from stable_baselines3.common.callbacks import BaseCallback

        wrapped = flatten_env(base, action=self.action, one_hot=self.one_hot, budget=budget)
        with _torch_threads(self.torch_threads):
            model = getattr(sb3, self.algo)("MlpPolicy", wrapped, **self.model_kwargs(base, budget))
            if budget > 0:
                model.learn(total_timesteps=budget, callback=_budget_callback(BaseCallback))
            self.model = model
            return self.greedy_policy(model, wrapped, base)

    def greedy_policy(self, model: Any, wrapped: Any, base: IAPOEnv) -> Policy:
        """``model.predict(obs_c, deterministic=True)`` for every context c, mapped back to (p, N)."""
        if self.one_hot:
            observations = np.eye(base.n_contexts, dtype=np.float32)
        else:
            observations = base.table.context_weights.astype(np.float32)
        actions, _ = model.predict(observations, deterministic=True)
        assert isinstance(wrapped, (FlattenArm, MultiDiscreteArm)), "flatten_env puts the arm wrapper outermost"
        return Policy(tuple(wrapped.to_arm(a) for a in np.asarray(actions)))


__all__ = ["ALGOS", "DEFAULTS", "INSTALL_HINT", "SB3Agent", "import_sb3"]
