"""The challenger agents: plug-in halving (``auto``) and common-query PSST on the public pull interface."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import agents
from agents.challenger import PlugInEstimator, QueryStream
from iapo_gym import IAPOEnv, OutcomeTable, Pulls
from tests.conftest import tiny_bon_table, tiny_mv_table

NEW = ["plugin_halving", "psst_cq", "auto"]


class RecordingEnv(IAPOEnv):
    """An IAPOEnv that keeps every batch of pulls it served."""

    def __init__(self, table: OutcomeTable) -> None:
        super().__init__(table=table)
        self.batches: list[Pulls] = []

    def pull(self, prompts: Any, ns: Any, queries: Any = None) -> Pulls:
        pulls = super().pull(prompts, ns, queries)
        self.batches.append(pulls)
        return pulls


def test_auto_is_plugin_halving_with_its_defaults() -> None:
    auto, plugin = agents.make("auto", seed=0), agents.make("plugin_halving", seed=0)
    assert type(auto) is type(plugin) and auto.params() == plugin.params()  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", NEW)
def test_budget_on_math_and_seeded_reruns(name: str, math_release: Path) -> None:
    from iapo_gym.data.release import read_release

    env = IAPOEnv(table=read_release(str(math_release))[0])
    for budget in (0, 1, 24, 799, 3_000, 20_000):
        env.reset(seed=budget)
        policy = agents.make(name, seed=2).train(env, budget)
        assert env.budget_used <= budget, (name, budget, env.budget_used)
        assert len(policy) == env.n_contexts
        if budget >= 3_000:
            assert env.budget_used >= 0.9 * budget
    runs = []
    for _ in range(2):
        env.reset(seed=7)
        runs.append((agents.make(name, seed=3).train(env, 5_000), env.budget_used))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", NEW)
def test_tiny_budgets_and_tables(name: str) -> None:
    for table in (tiny_mv_table(), tiny_bon_table()):
        env = IAPOEnv(table=table)
        for budget in (0, 1, 2, 5, 50, 600):
            env.reset(seed=budget)
            policy = agents.make(name, seed=0).train(env, budget)
            assert env.budget_used <= budget
            assert len(policy) == env.n_contexts


def test_query_stream_draws_without_replacement_then_reshuffles() -> None:
    pool = np.arange(10, 30)
    stream = QueryStream(pool, np.random.default_rng(0))
    first = np.concatenate([stream.take(7), stream.take(13)])
    assert np.array_equal(np.sort(first), pool)  # one full pass: every query exactly once
    second = stream.take(20)
    assert np.array_equal(np.sort(second), pool) and not np.array_equal(first, second)
    with pytest.raises(ValueError, match="no queries"):
        QueryStream(np.zeros(0, np.int64), np.random.default_rng(0))


@pytest.mark.parametrize("name", ["plugin_halving", "psst_cq"])
def test_every_round_pulls_live_prompts_on_common_fresh_queries(name: str) -> None:
    env = RecordingEnv(tiny_mv_table(n_prompts=6, n_queries=200, n_max=8))
    env.reset(seed=0)
    agents.make(name, seed=0).train(env, 2_000)
    used: list[np.ndarray] = []
    for pulls in env.batches:
        per_prompt = {int(p): np.sort(pulls.queries[pulls.prompts == p]) for p in np.unique(pulls.prompts)}
        reference = next(iter(per_prompt.values()))
        assert all(np.array_equal(q, reference) for q in per_prompt.values())  # common queries
        used.append(np.unique(pulls.queries))
    every = np.concatenate(used)
    assert np.unique(every).size == every.size  # no query reused across rounds (160 train queries)
    assert np.isin(every, env.queries("train")).all()


def _pull_every_train_query(env: IAPOEnv, est: PlugInEstimator, pulls_per_query: int) -> None:
    """``pulls_per_query`` pulls of N_max completions of every (prompt, train query), in one update."""
    train = env.queries("train")
    prompts = np.repeat(np.arange(env.n_prompts), train.size * pulls_per_query)
    queries = np.tile(np.repeat(train, pulls_per_query), env.n_prompts)
    est.update(env.pull(prompts, np.full(prompts.size, env.n_max), queries=queries))


@pytest.mark.parametrize("alpha", [0.0, 4.0])
def test_plug_in_majority_vote_converges_to_the_exact_train_q_table(alpha: float) -> None:
    table = tiny_mv_table(seed=1, n_prompts=4, n_queries=30, n_buckets=3, n_max=6)
    env = IAPOEnv(table=table)
    env.reset(seed=0)
    est = PlugInEstimator(env, alpha=alpha)
    for _ in range(4):  # 4 x 1002 completions of every (prompt, train query), in several updates
        _pull_every_train_query(env, est, 167)
    exact = env.q_table("train")
    assert np.abs(est.mean() - exact).max() < 0.02
    assert np.all(est.counts == env.queries("train").size)  # one sample per query


def test_plug_in_best_of_n_is_exact_when_queries_share_one_distribution() -> None:
    base = tiny_bon_table(seed=2, n_prompts=3, n_queries=10, n_atoms=4, n_max=6)
    same = dataclasses.replace(base, probs=np.repeat(base.probs[:, :1], 10, axis=1),
                               atoms=np.repeat(base.atoms[:, :1], 10, axis=1))
    env = IAPOEnv(table=same)
    env.reset(seed=0)
    est = PlugInEstimator(env)
    _pull_every_train_query(env, est, 3_334)
    assert np.abs(est.mean() - env.q_table("train")).max() < 0.03


def test_plugin_halving_finds_the_best_prompt_with_enough_budget() -> None:
    """Prompt 1 is right on every query with probability 0.8 (others 0.4 / 0.45 / 0.3)."""
    n_prompts, n_queries = 4, 50
    correct = np.array([0.4, 0.8, 0.45, 0.3])
    probs = np.stack([correct, (1 - correct) / 2, (1 - correct) / 2], axis=-1)[:, None, :].repeat(n_queries, axis=1)
    split = np.zeros(n_queries, dtype=np.uint8)
    split[:10] = 1
    table = OutcomeTable(
        task="easy_mv", aggregator="mv", probs=probs, cost=np.full(n_prompts, 0.05), n_max=8,
        context_weights=np.array([[1.0, 0.0], [1.0, -1.0]]), context_names=("free", "costly"),
        context_probs=np.array([0.5, 0.5]), objective_names=("correct",), gold=np.zeros(n_queries, np.int64),
        split=split,
    )
    env = IAPOEnv(table=table)
    best = env.optimal_policy("train")
    for seed in range(3):
        env.reset(seed=seed)
        assert agents.make("auto", seed=seed).train(env, 20_000) == best


def test_plugin_halving_rejects_bad_parameters() -> None:
    for bad in ({"m_min": 0}, {"keep_last": 0}, {"alpha": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            env = IAPOEnv(table=tiny_mv_table())
            env.reset(seed=0)
            agents.make("plugin_halving", **bad).train(env, 100)
