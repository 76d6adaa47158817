"""The Stable-Baselines3 baseline agent: budget, seeding, greedy policy, install hint, the example."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import agents
import iapo_gym  # noqa: F401  (registers the ids)
from iapo_gym import IAPOEnv, OutcomeTable, Policy
from iapo_gym.wrappers import flatten_env
from tests.conftest import tiny_bon_table, tiny_mv_table

pytest.importorskip("stable_baselines3", reason="stable-baselines3 and torch are not installed (the sb3 extra; CI installs "
                    "it on Python 3.11 only, the CPU torch wheel on these machines being for 3.11)")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sb3_ppo.py"
SMALL = {"net_arch": (16,)}


@pytest.mark.parametrize("algo", ["PPO", "A2C", "DQN"])
@pytest.mark.parametrize("budget", [0, 5, 257, 1500])
def test_budget_never_exceeded(algo: str, budget: int) -> None:
    env = IAPOEnv(table=tiny_mv_table(n_max=6))
    policy = agents.make("sb3", algo=algo, seed=1, **SMALL).train(env, budget)
    assert env.budget_used <= budget
    assert budget - env.budget_used < env.n_max  # stops only when the next pull would overspend
    assert isinstance(policy, Policy) and len(policy) == env.n_contexts
    assert all(0 <= p < env.n_prompts and 1 <= n <= env.n_max for p, n in policy.arms)


def test_budget_never_exceeded_on_synthetic_task() -> None:
    env = gym.make("IAPO-SyntheticCategorical-v0")
    env.reset(seed=0)
    agents.make("sb3", algo="PPO", seed=0, **SMALL).train(env, 2000)
    assert 2000 - env.unwrapped.n_max < env.unwrapped.budget_used <= 2000


@pytest.mark.parametrize("algo", ["PPO", "DQN"])
def test_same_seed_same_policy(algo: str) -> None:
    def run(seed: int) -> tuple[Policy, int]:
        env = IAPOEnv(table=tiny_bon_table())
        policy = agents.make("sb3", algo=algo, seed=seed, **SMALL).train(env, 800)
        return policy, env.budget_used

    first = run(4)
    assert run(4) == first


def test_policy_is_the_models_greedy_action_in_each_context() -> None:
    """The returned policy agrees with model.predict on the observation the env shows in each context."""
    for one_hot, action in [(False, "multidiscrete"), (True, "discrete")]:
        base = IAPOEnv(table=tiny_bon_table())
        agent: Any = agents.make("sb3", algo="PPO", seed=2, one_hot=one_hot, action=action, **SMALL)
        policy = agent.train(base, 600)
        view = flatten_env(IAPOEnv(table=tiny_bon_table()), action=action, one_hot=one_hot)
        for c in range(base.n_contexts):
            obs, _ = view.reset(seed=0, options={"context": c})
            predicted, _ = agent.model.predict(obs, deterministic=True)
            assert policy(c) == view.to_arm(predicted)  # type: ignore[attr-defined]


def easy_table() -> OutcomeTable:
    """Best-of-N on success (1) or failure (0): prompt 3 succeeds with probability 0.9, the others 0.2-0.3."""
    p_count, q_count = 4, 6
    success = np.array([0.2, 0.3, 0.25, 0.9])
    probs = np.stack([1 - success, success], axis=-1)[:, None, :].repeat(q_count, axis=1)
    atoms = np.zeros((p_count, q_count, 2, 1))
    atoms[:, :, 1, 0] = 1.0
    split = np.zeros(q_count, dtype=np.uint8)
    split[:2] = 1
    return OutcomeTable(task="easy", aggregator="bon", probs=probs, atoms=atoms, cost=np.full(p_count, 0.1), n_max=4,
                        context_weights=np.array([[1.0, -0.1], [1.0, -1.0]]), context_names=("cheap", "dear"),
                        context_probs=np.array([0.5, 0.5]), objective_names=("success",), split=split)


@pytest.mark.parametrize("algo", ["PPO", "A2C", "DQN"])
def test_learns_the_dominant_prompt(algo: str) -> None:
    """Like SB3's identity-env tests: on a task with one clearly best prompt, every algorithm finds it."""
    env = IAPOEnv(table=easy_table())
    assert {p for p, _ in env.optimal_policy("test").arms} == {3}
    policy = agents.make("sb3", algo=algo, seed=0, **SMALL).train(env, 1500)
    assert [p for p, _ in policy.arms] == [3, 3]


def test_params_are_json_and_bad_params_rejected() -> None:
    agent: Any = agents.make("sb3", algo="a2c", algo_kwargs={"n_steps": 4})
    assert json.loads(json.dumps(agent.params()))["algo"] == "A2C"
    assert agent.params()["action"] == "multidiscrete"
    assert agents.make("sb3", algo="DQN").params()["action"] == "discrete"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="algo must be one of"):
        agents.make("sb3", algo="SAC")
    with pytest.raises(ValueError, match="DQN supports only"):
        agents.make("sb3", algo="DQN", action="multidiscrete")
    with pytest.raises(ValueError, match="net_arch"):
        agents.make("sb3", net_arch=())
    with pytest.raises(ValueError, match="budget"):
        agents.make("sb3").train(IAPOEnv(table=tiny_mv_table()), -3)


def test_algo_kwargs_reach_the_model() -> None:
    agent: Any = agents.make("sb3", algo="PPO", seed=0, algo_kwargs={"n_steps": 16, "batch_size": 16}, **SMALL)
    agent.train(IAPOEnv(table=tiny_mv_table()), 100)
    assert agent.model.n_steps == 16 and agent.model.gamma == 0.0
    assert agent.model.policy.net_arch == [16]


def test_missing_sb3_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "stable_baselines3", None)  # makes `import stable_baselines3` fail
    with pytest.raises(ImportError, match=r'torch==2\.13\.0.*pip install -e "\.\[sb3\]"'):
        agents.make("sb3")


def test_example_sb3_half_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/sb3_ppo.py: the PPO half (PSST is another agent's test) spends its budget and scores."""
    spec = importlib.util.spec_from_file_location("sb3_ppo_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    policy, acr, spent = module.train("sb3", 1000, 0, algo="PPO", net_arch=(16,))
    base = gym.make(module.TASK).unwrapped
    assert len(policy) == base.n_contexts and spent <= 1000
    assert np.isclose(acr, base.evaluate(policy, "test"))
