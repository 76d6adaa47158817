"""Gymnasium wrappers that let generic RL libraries (Stable-Baselines3 ...) drive an IAPOEnv.

The base env's action is the pair ``(p, N)`` in ``Tuple(Discrete(P), Discrete(N_max, start=1))``.
Libraries without Tuple actions, or that ignore ``Discrete.start`` (SB3), use ``FlattenArm``
(one 0-based ``Discrete(P * N_max)``) or ``MultiDiscreteArm`` (0-based ``MultiDiscrete([P, N_max])``).
``CompletionBudget`` caps the completions a stream of episodes may draw; ``ContextOneHot``
shows the context index instead of its weight vector; ``PadOutcomes`` gives the per-completion
info arrays one shape, so vector envs whose sub-envs pick different N can batch them. None of
them draws random numbers, so seeding and determinism are those of the base env.
"""

from __future__ import annotations

import numbers
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from iapo_gym.env import IAPOEnv, base_env

__all__ = ["ACTION_KINDS", "CompletionBudget", "ContextOneHot", "FlattenArm", "MultiDiscreteArm", "PadOutcomes",
           "flatten_env"]

#: The flat action encodings ``flatten_env`` offers.
ACTION_KINDS = ("discrete", "multidiscrete")


def _iapo_base(env: gym.Env[Any, Any]) -> IAPOEnv:
    return base_env(env, "iapo_gym wrappers wrap")


def _arm_space(env: gym.Env[Any, Any]) -> tuple[int, int]:
    """(P, N_max) of an env whose action space is the IAPO pair Tuple(Discrete(P), Discrete(N_max, start=1))."""
    space = env.action_space
    if (not isinstance(space, spaces.Tuple) or len(space.spaces) != 2
            or not all(isinstance(s, spaces.Discrete) for s in space.spaces)):
        raise TypeError(f"expected an env with the (p, N) action space Tuple(Discrete(P), Discrete(N_max, start=1)), "
                        f"got {space}; apply arm wrappers only once, directly over the IAPO action")
    prompts, ns = space.spaces
    assert isinstance(prompts, spaces.Discrete) and isinstance(ns, spaces.Discrete)
    if int(prompts.start) != 0 or int(ns.start) != 1:
        raise TypeError(f"expected prompts starting at 0 and N starting at 1, "
                        f"got starts {int(prompts.start)} and {int(ns.start)}")
    return int(prompts.n), int(ns.n)


def _as_int(value: Any, name: str, high: int) -> int:
    """An integer in [0, high) or a ValueError naming the value and the range."""
    if isinstance(value, np.ndarray) and value.shape in ((), (1,)):
        value = value.reshape(()).item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer in [0, {high - 1}], got {value!r}")
    if not 0 <= int(value) < high:
        raise ValueError(f"{name} must be in [0, {high - 1}], got {int(value)}")
    return int(value)


class FlattenArm(gym.ActionWrapper[Any, np.int64, tuple[int, int]], gym.utils.RecordConstructorArgs):
    """One 0-based ``Discrete(P * N_max)`` action: ``a = p * N_max + (N - 1)``.

    For libraries with neither Tuple actions nor ``Discrete.start`` (SB3's PPO, A2C, DQN).
    """

    def __init__(self, env: gym.Env[Any, Any]) -> None:
        """Wrap an env whose action is the IAPO pair (p, N)."""
        gym.utils.RecordConstructorArgs.__init__(self)
        super().__init__(env)
        self.n_prompts, self.n_max = _arm_space(env)
        self.action_space = spaces.Discrete(self.n_prompts * self.n_max)

    def to_arm(self, action: Any) -> tuple[int, int]:
        """The arm (p, N) of flat action ``action``."""
        a = _as_int(action, "flat action", self.n_prompts * self.n_max)
        return a // self.n_max, a % self.n_max + 1

    def from_arm(self, p: int, n: int) -> int:
        """The flat action of arm (p, N) (inverse of ``to_arm``)."""
        p = _as_int(p, "prompt p", self.n_prompts)
        n = _as_int(n - 1, "N - 1", self.n_max) + 1
        return p * self.n_max + n - 1

    def action(self, action: Any) -> tuple[int, int]:
        """Gymnasium hook: the (p, N) pair the inner env steps with."""
        return self.to_arm(action)


class MultiDiscreteArm(gym.ActionWrapper[Any, np.ndarray, tuple[int, int]], gym.utils.RecordConstructorArgs):
    """A 0-based ``MultiDiscrete([P, N_max])`` action ``[p, N - 1]`` (factorized policies: PPO, A2C)."""

    def __init__(self, env: gym.Env[Any, Any]) -> None:
        """Wrap an env whose action is the IAPO pair (p, N)."""
        gym.utils.RecordConstructorArgs.__init__(self)
        super().__init__(env)
        self.n_prompts, self.n_max = _arm_space(env)
        self.action_space = spaces.MultiDiscrete([self.n_prompts, self.n_max])

    def to_arm(self, action: Any) -> tuple[int, int]:
        """The arm (p, N) of action ``[p, N - 1]``."""
        arr = np.asarray(action)
        if arr.shape != (2,):
            raise ValueError(f"MultiDiscrete arm action must be [p, N - 1] of shape (2,), got {action!r}")
        p = _as_int(arr[0].item(), "prompt p", self.n_prompts)
        n = _as_int(arr[1].item(), "N - 1", self.n_max) + 1
        return p, n

    def from_arm(self, p: int, n: int) -> np.ndarray:
        """The action ``[p, N - 1]`` of arm (p, N) (inverse of ``to_arm``)."""
        p = _as_int(p, "prompt p", self.n_prompts)
        n = _as_int(n - 1, "N - 1", self.n_max) + 1
        return np.array([p, n - 1], dtype=np.int64)

    def action(self, action: Any) -> tuple[int, int]:
        """Gymnasium hook: the (p, N) pair the inner env steps with."""
        return self.to_arm(action)


class ContextOneHot(gym.ObservationWrapper[np.ndarray, Any, np.ndarray], gym.utils.RecordConstructorArgs):
    """Observation = one-hot of the context index (``Box(0, 1, (C,), float32)``) instead of its weights.

    Turns the task into C separate bandits for a neural policy; the weight vector (the base
    observation) instead lets a policy generalize across contexts with similar weights.
    """

    def __init__(self, env: gym.Env[np.ndarray, Any]) -> None:
        """Wrap any env whose unwrapped base is an IAPOEnv."""
        gym.utils.RecordConstructorArgs.__init__(self)
        super().__init__(env)
        self._base = _iapo_base(env)
        self.n_contexts = self._base.n_contexts
        self.observation_space = spaces.Box(0.0, 1.0, shape=(self.n_contexts,), dtype=np.float32)

    def observation_of(self, context: int) -> np.ndarray:
        """The observation shown in context ``context``."""
        obs = np.zeros(self.n_contexts, dtype=np.float32)
        obs[_as_int(context, "context", self.n_contexts)] = 1.0
        return obs

    def observation(self, observation: np.ndarray) -> np.ndarray:
        """Gymnasium hook: one-hot of the base env's current context."""
        return self.observation_of(self._base.context)


class CompletionBudget(gym.Wrapper[Any, Any, Any, Any], gym.utils.RecordConstructorArgs):
    """Cap a stream of episodes at ``budget`` completions (the completions drawn by executed steps: N, or fewer
    for a stopping rule's step ``(p, N, r)``, ``info["drawn"]``).

    A step whose N (the cap, for a stopping rule) exceeds the remaining budget is **refused**, never clipped: nothing is
    drawn or spent, the reward is 0.0, ``truncated=True`` and ``info["budget_refused"]`` is
    True (clipping N would credit a reward to an arm that was not pulled). A step that
    brings the spend to exactly ``budget`` also returns ``truncated=True``; from then on every
    step is refused. Every ``info`` reports ``budget``, ``budget_spent``, ``budget_remaining``
    and ``budget_refused``. Like ``IAPOEnv.budget_used``, the spend returns to 0 on a
    seeded ``reset`` (a seeded rerun is identical). Only steps through this wrapper count,
    not the base env's vectorized ``pull``. N is read from the action after the action
    wrappers beneath, so this wrapper may sit above or below ``FlattenArm``.
    """

    budget: int
    spent: int
    _base: IAPOEnv

    def __init__(self, env: gym.Env[Any, Any], budget: int) -> None:
        """Wrap ``env`` (an IAPOEnv or a wrapper of one) with a budget of ``budget`` completions."""
        gym.utils.RecordConstructorArgs.__init__(self, budget=budget)
        super().__init__(env)
        if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, numbers.Integral) or budget < 0:
            raise ValueError(f"budget must be an integer >= 0 (completions), got {budget!r}")
        self.budget = int(budget)
        self.spent = 0
        self._base = _iapo_base(env)
        self._last_obs: Any = None
        self._last_context: dict[str, Any] = {}

    @property
    def remaining(self) -> int:
        """Completions still available."""
        return self.budget - self.spent

    @property
    def exhausted(self) -> bool:
        """True once the whole budget is spent."""
        return self.spent >= self.budget

    def arm_of(self, action: Any) -> tuple[int, int]:
        """The (p, N) this wrapper's ``action`` pulls, through the action wrappers beneath (validated; N is the cap
        of a stopping rule's action (p, N, r))."""
        env: Any = self.env
        while isinstance(env, gym.Wrapper):
            if isinstance(env, gym.ActionWrapper):
                action = env.action(action)
            env = env.env
        p, n, _ = self._base.validate_rule_action(action)
        return p, n

    def _budget_info(self, refused: bool) -> dict[str, Any]:
        return {"budget": self.budget, "budget_spent": self.spent, "budget_remaining": self.remaining,
                "budget_refused": refused}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Reset the inner env; a seeded reset also returns the spend to 0."""
        obs, info = self.env.reset(seed=seed, options=options)
        if seed is not None:
            self.spent = 0
        self._last_obs = obs
        self._last_context = {k: info[k] for k in ("context", "context_name") if k in info}
        return obs, {**info, **self._budget_info(False)}

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Step the inner env if N fits in the remaining budget, else refuse (see the class doc)."""
        if self._last_obs is None:
            raise gym.error.ResetNeeded("CompletionBudget: call reset() before step()")
        _, n = self.arm_of(action)
        if n > self.remaining:
            return self._last_obs, 0.0, False, True, {**self._last_context, **self._budget_info(True)}
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.spent += int(info.get("drawn", n))
        self._last_obs = obs
        return obs, reward, terminated, bool(truncated) or self.exhausted, {**info, **self._budget_info(False)}


class PadOutcomes(gym.Wrapper[Any, Any, Any, Any], gym.utils.RecordConstructorArgs):
    """Pad ``info["outcomes"]`` and ``info["cost"]`` to N_max rows and add ``info["n"]``, the real rows.

    ``IAPOEnv.step`` returns N rows per step; Gymnasium's vector-info batching fixes each key's
    shape from the first sub-env, so sub-envs that pick different N fail to batch. The first
    ``info["n"]`` rows are the env's own, unchanged; padded rows are neutral for the usual
    reductions: Best-of-N objective vectors -inf (a max ignores them), majority-vote rows
    (bucket -1, correct 0) (no vote, never correct), cost 0 (a sum ignores them). Finite or
    infinite, never NaN, so seeded reruns compare equal. Use it as
    ``gym.make_vec(id, num_envs, wrappers=[PadOutcomes])``.
    """

    def __init__(self, env: gym.Env[Any, Any]) -> None:
        """Wrap ``env`` (an IAPOEnv or a wrapper of one)."""
        gym.utils.RecordConstructorArgs.__init__(self)
        super().__init__(env)
        base = _iapo_base(env)
        self._n_max = base.n_max
        self._outcome_fill: np.ndarray = (np.array([-1, 0], dtype=np.int64) if base.table.aggregator == "mv"
                                          else np.full(base.table.n_objectives, -np.inf))

    def _pad(self, values: np.ndarray, fill: Any) -> np.ndarray:
        padded = np.empty((self._n_max, *values.shape[1:]), dtype=values.dtype)
        padded[values.shape[0]:] = fill
        padded[: values.shape[0]] = values
        return padded

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Step the inner env and pad its per-completion info arrays (a refused step has none to pad)."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        if "outcomes" in info:
            info = {**info, "n": int(len(info["outcomes"])),
                    "outcomes": self._pad(np.asarray(info["outcomes"]), self._outcome_fill),
                    "cost": self._pad(np.asarray(info["cost"]), 0.0)}
        return obs, reward, terminated, truncated, info


def flatten_env(env: gym.Env[Any, Any], *, action: str = "discrete", one_hot: bool = False,
                budget: int | None = None) -> gym.Env[Any, Any]:
    """``env`` ready for SB3-style libraries: optional ``CompletionBudget``, optional ``ContextOneHot``,
    then ``FlattenArm`` (``action="discrete"``) or ``MultiDiscreteArm`` (``"multidiscrete"``)."""
    if action not in ACTION_KINDS:
        raise ValueError(f"action must be one of {ACTION_KINDS}, got {action!r}")
    if budget is not None:
        env = CompletionBudget(env, budget)
    if one_hot:
        env = ContextOneHot(env)
    return FlattenArm(env) if action == "discrete" else MultiDiscreteArm(env)
