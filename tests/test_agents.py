"""Built-in agents: budgets, seeding, a toy task with a known optimum, and the halving rules."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import agents
from agents.base import Agent
from agents.psst import partial_allocation, round_budget, rounds_to_one, trim
from iapo_gym import IAPOEnv, OutcomeTable, Policy

BUILT_IN = [name for name in agents.available() if name != "sb3"]
LEARNING = [name for name in BUILT_IN if name != "random"]
PROMPT_ONLY = {"triple_n1", "triple_random_n"}
SYNTHETIC = ["IAPO-SyntheticBernoulli-v0", "IAPO-SyntheticCategorical-v0"]


def toy_table() -> OutcomeTable:
    """Best-of-N over one 0/1 objective; prompt 2 (success 0.5) is best in both contexts.

    Free context: (2, 3) at 0.875 (next best (2, 2) at 0.75). Costly context (0.5 per
    completion): (2, 1) at 0.0 (next best (3, 1) at -0.2).
    """
    n_prompts, n_queries = 4, 10
    success = np.array([0.1, 0.2, 0.5, 0.3])
    probs = np.stack([1 - success, success], axis=-1)[:, None, :].repeat(n_queries, axis=1)
    atoms = np.broadcast_to(np.array([[0.0], [1.0]]), (n_prompts, n_queries, 2, 1)).copy()
    split = np.zeros(n_queries, dtype=np.uint8)
    split[:2] = 1
    return OutcomeTable(
        task="toy", aggregator="bon", probs=probs, atoms=atoms, cost=np.full(n_prompts, 0.5), n_max=3,
        context_weights=np.array([[1.0, 0.0], [1.0, -1.0]]), context_names=("free", "costly"),
        context_probs=np.array([0.5, 0.5]), objective_names=("success",), split=split,
    )


@pytest.fixture(scope="module")
def synthetic_envs() -> dict[str, IAPOEnv]:
    return {env_id: gym.make(env_id, instance=0).unwrapped for env_id in SYNTHETIC}


def _check_policy(policy: Policy, env: IAPOEnv) -> None:
    assert isinstance(policy, Policy) and len(policy) == env.n_contexts
    for p, n in policy.arms:
        assert 0 <= p < env.n_prompts and 1 <= n <= env.n_max


@pytest.mark.parametrize("env_id", SYNTHETIC)
@pytest.mark.parametrize("name", BUILT_IN)
def test_never_spends_more_than_the_budget(name: str, env_id: str, synthetic_envs: dict[str, IAPOEnv]) -> None:
    env = synthetic_envs[env_id]
    below_one_pass = env.n_prompts * env.n_max - 1
    for budget in (0, 1, 37, 500, below_one_pass, 5_000, 40_000):
        env.reset(seed=budget)
        policy = agents.make(name, seed=1).train(env, budget)
        assert env.budget_used <= budget, (name, budget, env.budget_used)
        _check_policy(policy, env)
        if name not in ("random", "sequential_halving") and budget >= 5_000:
            assert env.budget_used >= 0.9 * budget, (name, budget, env.budget_used)  # leftovers stay small


@pytest.mark.parametrize("name", BUILT_IN)
def test_same_seed_same_policy(name: str, synthetic_envs: dict[str, IAPOEnv]) -> None:
    env = synthetic_envs["IAPO-SyntheticBernoulli-v0"]
    runs = []
    for _ in range(2):
        env.reset(seed=11)
        runs.append((agents.make(name, seed=5).train(env, 3_000), env.budget_used))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", LEARNING)
def test_finds_the_known_optimum_of_a_toy_task(name: str) -> None:
    env = IAPOEnv(table=toy_table())
    best = env.optimal_policy("train")
    assert best.arms == ((2, 3), (2, 1))
    env.reset(seed=3)
    policy = agents.make(name, seed=3).train(env, 6_000)
    assert [p for p, _ in policy.arms] == [2, 2]
    if name == "triple_n1":
        assert policy.arms == ((2, 1), (2, 1))
    elif name not in PROMPT_ONLY:
        assert policy == best


def test_random_agent_spends_nothing_and_varies_with_seed() -> None:
    env = IAPOEnv(table=toy_table())
    env.reset(seed=0)
    policies = {agents.make("random", seed=s).train(env, 1_000) for s in range(20)}
    assert env.budget_used == 0 and len(policies) > 5


def test_top_k_screening_restricts_prompts() -> None:
    env = IAPOEnv(table=toy_table())
    env.reset(seed=4)
    policy = agents.make("psst_topk", seed=4, k=1, rho=0.5).train(env, 2_000)
    assert [p for p, _ in policy.arms] == [2, 2]
    assert env.budget_used <= 2_000
    with pytest.raises(ValueError, match="rho"):
        agents.make("psst_topk", rho=1.5)
    with pytest.raises(ValueError, match="k must"):
        agents.make("psst_topk", k=0)


@pytest.mark.parametrize("name", ["psst", "psst_topk", "uniform", "triple_n1", "sequential_halving"])
def test_tiny_budgets_give_a_policy(name: str) -> None:
    env = IAPOEnv(table=toy_table())
    for budget in (0, 1, 3, 11):
        env.reset(seed=budget)
        policy = agents.make(name, seed=0).train(env, budget)
        assert env.budget_used <= budget
        _check_policy(policy, env)


def test_registry_params_and_errors() -> None:
    for name in BUILT_IN:
        agent = agents.make(name, seed=0)
        assert isinstance(agent, Agent)
        json.dumps(agent.params())
    assert agents.make("psst_rb").params()["reuse"] == "all_subsets"
    assert agents.make("triple_random_n").params()["n_mode"] == "random"
    for name, bad in [("psst", {"reuse": "pairs"}), ("psst", {"leftover": "keep"}), ("ucb", {"c": -1.0}),
                      ("epsilon_greedy", {"epsilon": 2.0}), ("softmax", {"temperature": 0.0}),
                      ("triple_n1", {"n_mode": "all"}), ("ucb", {"batch_size": 0})]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            agents.make(name, **bad)
    env = IAPOEnv(table=toy_table())
    with pytest.raises(ValueError, match="budget"):
        agents.make("psst").train(env, -5)


def test_registry_refuses_a_taken_name_and_topk_one_spelling() -> None:
    entry = agents.REGISTRY["psst"]
    with pytest.raises(ValueError, match="'psst' is already registered.*agents.psst:PSST"):
        agents.register("psst", "tests.leaderboard_toy_agents:Greedy")
    assert agents.REGISTRY["psst"] == entry
    with pytest.raises(ValueError, match="not K: write k=4"):
        agents.make("psst_topk", K=4)
    assert agents.make("psst_topk", k=3).params()["k"] == 3


def test_agents_of_other_distributions_register_through_the_entry_point_group(tmp_path: Path) -> None:
    """A distribution declaring ``iapo_gym.agents`` entry points: a fresh process (as a spawned worker) sees
    its agent; one that would take a built-in name is skipped with a warning."""
    import subprocess
    import sys

    dist = tmp_path / "toy_agents-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-agents\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[iapo_gym.agents]\ntoy_greedy = tests.leaderboard_toy_agents:Greedy\n"
                                           "psst = tests.leaderboard_toy_agents:Greedy\n")
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import agents\n"
            "print(agents.REGISTRY['toy_greedy'][0], agents.REGISTRY['psst'][0], type(agents.make('toy_greedy')).__name__)")
    root = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": f"{tmp_path}{__import__('os').pathsep}{root}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["tests.leaderboard_toy_agents:Greedy", "agents.psst:PSST", "Greedy"]
    assert "toy-agents: entry point psst = tests.leaderboard_toy_agents:Greedy not registered" in done.stderr


def test_trim_halves_each_context_and_ranks_unseen_last() -> None:
    rng = np.random.default_rng(0)
    alive = np.array([[True] * 5 + [False], [True] + [False] * 5, [True] * 6])
    means = np.array([[0.1, 0.5, np.nan, 0.3, 0.2, 9.0], [0.0] * 6, [np.nan, 1, 2, 3, 4, np.nan]])
    kept = trim(alive, means, rng)
    assert kept[0].tolist() == [False, True, False, True, False, False]  # 5 -> 2, dead arm stays dead
    assert kept[1].tolist() == alive[1].tolist()  # a single survivor is never removed
    assert kept[2].tolist() == [False, False, True, True, True, False]  # 6 -> 3, unsampled arms go first
    assert [rounds_to_one(n) for n in (1, 2, 3, 800, 1024)] == [0, 1, 1, 9, 10]


def test_round_budget_and_partial_allocation() -> None:
    assert round_budget(10_000, 0, 10, 0, 9, "drop") == 1_000
    assert round_budget(10_000, 0, 10, 0, 9, "carry") == 1_111
    assert round_budget(10_000, 9_000, 10, 9, 1, "carry") == 1_000
    rng = np.random.default_rng(0)
    top = np.array([32, 0, 8, 32])
    prompts, ns = partial_allocation(top, 50, rng)
    assert prompts.tolist() == [0, 2, 3] and ns.tolist() == [16, 8, 16]
    prompts, ns = partial_allocation(top, 2, rng)
    assert prompts.size == 2 and set(prompts) <= {0, 2, 3} and ns.tolist() == [1, 1]


def test_custom_agent_example_runs() -> None:
    path = Path(__file__).resolve().parents[1] / "examples" / "custom_agent.py"
    namespace = runpy.run_path(str(path))
    env = IAPOEnv(table=toy_table())
    env.reset(seed=0)
    policy = namespace["GreedyAtNMax"](seed=0).train(env, 600)
    assert env.budget_used <= 600 and len(policy.arms) == env.n_contexts
