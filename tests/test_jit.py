"""The numba loop of the sequential baselines takes exactly the numpy path's (``IAPO_GYM_JIT=0``) steps.

For softmax, epsilon-greedy and UCB on both aggregators, several seeds and budgets (below
N_max, around it, and the anytime branches of ``train_budgets``): the same policy, bitwise
the same estimator sums, counts and means, the same completions spent, and the env's and the
agent's generators in the same state afterwards. The env's completion counter still counts
every completion. The FROZEN, recorded-MATH and anytime tests also run on both paths (the
``sequential_path`` fixture). Only the MATH cases need data (../shared); they skip without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import agents
from agents import _jit
from agents.baselines import _Sequential, _Trajectory
from iapo_gym import IAPOEnv
from iapo_gym.tables import OutcomeTable
from tests.conftest import tiny_bon_table, tiny_mv_table

NAMES = ["softmax", "epsilon_greedy", "ucb"]
TABLES = {"mv": lambda seed: tiny_mv_table(seed=seed, n_prompts=4, n_buckets=3, n_max=16),
          "bon": lambda seed: tiny_bon_table(seed=seed, n_prompts=4, n_max=16)}


def _use_jit(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    monkeypatch.setenv("IAPO_GYM_JIT", "1" if on else "0")


def _state(env: IAPOEnv, agent: _Sequential, run: _Trajectory, arms: tuple) -> dict[str, Any]:
    """Everything that must match, floating-point arrays as raw bytes (bitwise)."""
    return {"arms": arms, "sums": run.est.sums.tobytes(), "counts": run.est.counts.tobytes(),
            "means": run.means.tobytes(), "spent": run.spent, "budget_used": env.budget_used,
            "env_rng": env.np_random.bit_generator.state, "agent_rng": agent.rng.bit_generator.state}


def _train(table: OutcomeTable, name: str, seed: int, budget: int, jit: bool, monkeypatch: pytest.MonkeyPatch,
           **params: Any) -> dict[str, Any]:
    _use_jit(monkeypatch, jit)
    env = IAPOEnv(table=table)
    env.reset(seed=100 + seed)
    agent = agents.make(name, seed=seed, **params)
    run = _Trajectory(agent, env)
    assert (run.compiled is not None) == jit
    agent._advance(run, budget, stop=budget)
    return _state(env, agent, run, run.est.best_arms(agent.rng).arms)


@pytest.mark.parametrize("aggregator", ["mv", "bon"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_loop_takes_the_numpy_paths_steps(aggregator: str, name: str, seed: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    table = TABLES[aggregator](seed)
    for budget in [1, 7, 16, 17, 250, 1500]:  # below N_max = 16, at it, just above, and long runs
        fast = _train(table, name, seed, budget, True, monkeypatch)
        slow = _train(table, name, seed, budget, False, monkeypatch)
        assert fast["spent"] == fast["budget_used"] == budget
        assert fast == slow, (budget, [k for k in fast if fast[k] != slow[k]])


@pytest.mark.parametrize("name,params", [("softmax", {"temperature": 0.01}), ("epsilon_greedy", {"epsilon": 0.9}),
                                         ("epsilon_greedy", {"epsilon": 0.0}), ("ucb", {"c": 2.0})])
def test_compiled_loop_matches_with_other_hyper_parameters(name: str, params: dict[str, float],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for aggregator in ("mv", "bon"):
        table = TABLES[aggregator](7)
        fast = _train(table, name, 3, 900, True, monkeypatch, **params)
        assert fast == _train(table, name, 3, 900, False, monkeypatch, **params)


@pytest.mark.parametrize("aggregator", ["mv", "bon"])
@pytest.mark.parametrize("name", NAMES)
def test_train_budgets_branches_match_on_both_paths(aggregator: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    table = TABLES[aggregator](5)
    budgets = [3, 16, 40, 41, 600, 1200]
    out = {}
    for jit in (True, False):
        _use_jit(monkeypatch, jit)
        env = IAPOEnv(table=table)
        env.reset(seed=9)
        agent = agents.make(name, seed=4)
        policies = [(b, p.arms, env.completions_drawn, env.snapshot()) for b, p in agent.train_budgets(env, budgets)]
        out[jit] = (policies, env.budget_used, env.completions_drawn, env.np_random.bit_generator.state,
                    agent.rng.bit_generator.state)
    assert out[True] == out[False]
    assert [drawn for _, _, drawn, _ in out[True][0]] == budgets  # each branch metered as a fresh run


@pytest.mark.parametrize("name", NAMES)
def test_the_env_counts_every_compiled_completion(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_jit(monkeypatch, True)
    table = TABLES["bon"](2)
    env = IAPOEnv(table=table)
    env.reset(seed=1)
    agent = agents.make(name, seed=2)
    assert _Trajectory(agent, env).compiled is not None
    for budget in (5, 333, 1000):
        before = env.completions_drawn
        agent.train(env, budget)
        assert env.completions_drawn - before == budget
    assert env.completions_drawn == env.budget_used == 5 + 333 + 1000


def test_envs_that_do_not_draw_from_their_table_keep_the_numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    _use_jit(monkeypatch, True)

    class Logged(IAPOEnv):  # as a live env: its pulls are its own, the compiled loop cannot replicate them
        draws_from_table = False
        pulls = 0

        def pull_one(self, prompt: int, n: int) -> tuple[int, np.ndarray]:
            Logged.pulls += 1
            return super().pull_one(prompt, n)

    env = Logged(table=TABLES["mv"](0))
    env.reset(seed=0)
    agent = agents.make("ucb", seed=0)
    assert _Trajectory(agent, env).compiled is None
    agent.train(env, 300)
    assert Logged.pulls > 10 and env.budget_used == 300


@pytest.mark.parametrize("name", ["softmax", "ucb"])
def test_compiled_loop_matches_past_numpys_pairwise_block(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At N_max 300 a Best-of-N pull of n > 129 sums more than 128 blocks of one, which numpy's pairwise sum
    splits in halves: the compiled block sums split them the same way (the same sums, bit for bit)."""
    table = tiny_bon_table(seed=2, n_prompts=3, n_max=300)
    fast = _train(table, name, 1, 6000, True, monkeypatch)
    assert fast == _train(table, name, 1, 6000, False, monkeypatch)
    counts = np.frombuffer(fast["counts"]).reshape(table.n_contexts, 3, 300)
    assert (counts[..., 130:] > 0).any()  # some pull had more than 129 completions


def test_switches_and_cases_without_a_compiled_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    env = IAPOEnv(table=TABLES["mv"](0))
    env.reset(seed=0)
    _use_jit(monkeypatch, True)
    assert _Trajectory(agents.make("softmax", seed=0), env).compiled is not None
    assert _Trajectory(agents.make("softmax", seed=0, reuse="all_subsets"), env).compiled is None

    class Greedy(agents.baselines.EpsilonGreedy):  # type: ignore[name-defined]
        def choose(self, means: np.ndarray, counts: np.ndarray, feasible: np.ndarray | None) -> int:
            return super().choose(means, counts, feasible)

    assert _Trajectory(Greedy(seed=0), env).compiled is None  # a redefined choose has no compiled copy
    monkeypatch.setenv("IAPO_GYM_JIT", "0")
    assert not _jit.enabled()
    assert _Trajectory(agents.make("softmax", seed=0), env).compiled is None
    monkeypatch.setenv("IAPO_GYM_JIT", " 0 ")
    assert _Trajectory(agents.make("ucb", seed=0), env).compiled is None
    monkeypatch.setenv("IAPO_GYM_JIT", "1")
    assert _Trajectory(agents.make("ucb", seed=0), env).compiled is not None


@pytest.mark.parametrize("name", NAMES)
def test_batched_approximation_is_unchanged_by_the_switch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    table = TABLES["bon"](1)
    out = []
    for jit in (True, False):
        _use_jit(monkeypatch, jit)
        env = IAPOEnv(table=table)
        env.reset(seed=3)
        out.append((agents.make(name, seed=3, batch_size=8).train(env, 700).arms, env.np_random.random()))
    assert out[0] == out[1]


@pytest.mark.parametrize("task", ["IAPO-SyntheticCategorical-v0", "IAPO-SyntheticBernoulli-v0"])
@pytest.mark.parametrize("name", NAMES)
def test_compiled_loop_matches_on_the_synthetic_tasks(name: str, task: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import gymnasium as gym

    table = gym.make(task, instance=0).unwrapped.table  # 27 contexts and 2 objectives (BoN), 81 atoms; 5-bucket votes
    fast = _train(table, name, 11, 3000, True, monkeypatch)
    assert fast == _train(table, name, 11, 3000, False, monkeypatch), table.task


@pytest.mark.parametrize("name", NAMES)
def test_compiled_loop_matches_on_math(name: str, math_release: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """MATH (25 prompts), read from the release file: skips where ../shared is absent."""
    from iapo_gym.data.release import read_release

    table = read_release(str(math_release))[0]
    assert _train(table, name, 11, 3000, True, monkeypatch) == _train(table, name, 11, 3000, False, monkeypatch)
