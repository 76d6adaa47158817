"""Anytime training: one sequential trajectory serves several budgets with fresh-run results.

``train_budgets`` must give, for every budget, exactly what ``train`` gives a fresh agent
on a freshly seeded env (policy, completions drawn, the env's generator afterwards), and
the leaderboard's shared path must store the same rows as one run per budget.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import agents
from agents.baselines import _Sequential
from iapo_gym import IAPOEnv
from iapo_gym.leaderboard.run.runner import run_sweep
from iapo_gym.leaderboard.run.specs import parse_agent_spec, resolve_task
from iapo_gym.leaderboard.run.store import ResultStore
from iapo_gym.tables import OutcomeTable
from tests.conftest import tiny_bon_table, tiny_mv_table

TABLES = {"mv": tiny_mv_table, "bon": tiny_bon_table}
pytestmark = pytest.mark.usefixtures("sequential_path")  # the compiled loop and the numpy path
BUDGETS = [5, 40, 41, 300, 617, 1000]  # includes budgets below N_max and one N_max apart


def _fresh(table: OutcomeTable, name: str, budget: int, env_seed: int, agent_seed: int) -> tuple:
    env = IAPOEnv(table=table)
    env.reset(seed=env_seed)
    policy = agents.make(name, seed=agent_seed).train(env, budget)
    return policy.arms, env.completions_drawn, env.np_random.random()


@pytest.mark.parametrize("aggregator", ["mv", "bon"])
@pytest.mark.parametrize("name", ["softmax", "epsilon_greedy", "ucb"])
@pytest.mark.parametrize("seed", [0, 1])
def test_train_budgets_equals_a_fresh_run_per_budget(aggregator: str, name: str, seed: int) -> None:
    table = TABLES[aggregator](seed=seed, n_prompts=4, n_max=16)
    env = IAPOEnv(table=table)
    env.reset(seed=seed + 10)
    agent = agents.make(name, seed=seed + 20)
    assert agent.anytime
    shared = {}
    for budget, policy in agent.train_budgets(env, list(reversed(BUDGETS))):  # any order in, increasing out
        shared[budget] = (policy.arms, env.completions_drawn, env.snapshot())
    assert list(shared) == BUDGETS
    for budget in BUDGETS:
        arms, drawn, after = _fresh(table, name, budget, seed + 10, seed + 20)
        assert shared[budget][0] == arms, (budget, shared[budget][0], arms)
        assert shared[budget][1] == drawn == budget  # spent exactly, never more
        probe = IAPOEnv(table=table)
        probe.restore(shared[budget][2])
        assert probe.np_random.random() == after  # the env's stream is where a fresh run leaves it


def test_train_budgets_refuses_the_batched_approximation() -> None:
    env = IAPOEnv(table=tiny_mv_table())
    agent = agents.make("ucb", seed=0, batch_size=4)
    assert not agent.anytime
    with pytest.raises(ValueError, match="batch_size=1"):
        list(agent.train_budgets(env, [10, 20]))


def test_snapshot_restore_replays_the_same_draws() -> None:
    env = IAPOEnv(table=tiny_bon_table(n_max=6))
    env.reset(seed=4)
    env.pull_one(0, 3)
    saved = env.snapshot()
    first = [env.pull_one(1, 6) for _ in range(5)]
    assert env.completions_drawn == 33 and env.budget_used == 33
    env.restore(saved)
    assert env.completions_drawn == 3 and env.budget_used == 3
    again = [env.pull_one(1, 6) for _ in range(5)]
    assert [q for q, _ in first] == [q for q, _ in again]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(first, again, strict=True))
    with pytest.raises(ValueError, match="keys 'rng' and 'budget_used'.*'budget'"):
        env.restore({"budget": 3})


def _rows(out: Path) -> dict[tuple, tuple]:
    with ResultStore(out, create=False) as store:
        return {(r.task, r.label, r.budget, r.run): (r.acr, r.arms, r.budget_spent, r.agent_seed, r.env_seed)
                for r in store.results()}


def test_sweep_shares_trajectories_and_stores_the_rows_of_separate_runs(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    tasks = [resolve_task("synthetic_bernoulli"), resolve_task("synthetic_categorical")]
    specs = [parse_agent_spec(s) for s in ("softmax", "ucb", "epsilon_greedy:epsilon=0.3", "uniform")]
    budgets = [200, 1000, 1500]
    shared = run_sweep(tmp_path / "shared", tasks, specs, budgets, runs=2, jobs=1, log=io.StringIO(), bar=False)
    monkeypatch.setattr(_Sequential, "anytime", property(lambda self: False))
    separate = run_sweep(tmp_path / "separate", tasks, specs, budgets, runs=2, jobs=1, log=io.StringIO(), bar=False)
    assert shared.failures == separate.failures == []
    a, b = _rows(tmp_path / "shared"), _rows(tmp_path / "separate")
    assert len(a) == 2 * 4 * 3 * 2
    assert a == b
    assert all(spent == key[2] for key, (_, _, spent, _, _) in a.items() if key[1] != "uniform")


def test_auto_shares_one_trajectory_on_majority_vote_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep gives ``auto`` every budget from one trajectory on a majority-vote task only (on Best-of-N it trains
    and times each budget alone), and its rows are what ``train_budgets`` gives on both."""
    from agents.plugin.auto import Auto

    tasks = [resolve_task("synthetic_bernoulli"), resolve_task("synthetic_categorical")]
    specs = [parse_agent_spec("auto")]
    budgets = [300, 1200]
    shared_on: list[str] = []
    original = Auto.train_budgets

    def spy(self: Auto, env: IAPOEnv, budgets: list[int]):  # type: ignore[no-untyped-def]
        shared_on.append(env.table.aggregator)
        yield from original(self, env, budgets)

    monkeypatch.setattr(Auto, "train_budgets", spy)
    own = run_sweep(tmp_path / "own", tasks, specs, budgets, runs=2, jobs=1, log=io.StringIO(), bar=False)
    assert shared_on == ["mv", "mv"]
    monkeypatch.setattr(Auto, "shares_trajectory", lambda self, table: True)
    everywhere = run_sweep(tmp_path / "all", tasks, specs, budgets, runs=2, jobs=1, log=io.StringIO(), bar=False)
    assert shared_on.count("bon") == 2
    assert own.failures == everywhere.failures == []
    assert _rows(tmp_path / "own") == _rows(tmp_path / "all") and len(_rows(tmp_path / "own")) == 2 * 2 * 2
