"""``IAPO-Live-v0`` on a real llama.cpp server behind a counting proxy: agents train unchanged, reruns hit the cache."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import iapo_gym  # noqa: F401 (registers IAPO-Live-v0)
from iapo_gym.llm.live import LiveEnv
from tests.llm_scorer import score
from tests.llm_server import (
    llama_server,  # noqa: F401 (fixture)
    proxy,  # noqa: F401 (fixture)
    proxy_stats,
    tiny_model,  # noqa: F401 (fixture)
    write_spec,
)


def _spec(tmp_path: Path, port: int, aggregator: str = "mv") -> Path:
    return write_spec(tmp_path, port, aggregator=aggregator, n_max=4,
                      sampling={"temperature": 0.9, "max_tokens": 4}, endpoint={"concurrency": 8})


def test_check_env_and_rewards_follow_the_majority_vote(tmp_path: Path, proxy: int) -> None:  # noqa: F811
    env = gym.make("IAPO-Live-v0", spec=str(_spec(tmp_path, proxy)), cache=str(tmp_path / "cache.sqlite"))
    base = env.unwrapped
    assert isinstance(base, LiveEnv)
    check_env(base, skip_render_check=True)
    extract = base.source._extract
    assert extract is not None
    for seed in range(6):
        obs, info = base.reset(seed=seed)
        _, reward, terminated, _, info = base.step((seed % 2, 4))
        gold = base.llm_spec.queries[info["query"]].gold
        answers = [extract(t) for t in info["texts"]]
        counts = Counter(a if a else None for a in answers)  # "no answer" votes as one bucket
        top = max(counts.values())
        leaders = [a for a, c in counts.items() if c == top]
        credit = 1.0 / len(leaders) if gold in leaders else 0.0
        w = base.table.context_weights[info["context"]]
        assert terminated and reward == pytest.approx(w[0] * credit + w[-1] * 4 * base.table.cost_matrix()[seed % 2, 0])
        assert np.array_equal(info["outcomes"][:, 1], [int(a == gold) for a in answers])
        assert len(info["tokens"]) == 4 and all(1 <= t <= 4 for t in info["tokens"])
    with pytest.raises(NotImplementedError, match="iapo-gym collect"):
        iapo_gym.evaluate(iapo_gym.Policy(((0, 1),) * base.n_contexts), env)
    env.close()


def test_best_of_n_rewards_are_the_best_rounded_score(tmp_path: Path, proxy: int) -> None:  # noqa: F811
    env = LiveEnv(_spec(tmp_path, proxy, "bon"), cache=tmp_path / "cache.sqlite")
    check_env(env, skip_render_check=True)
    env.reset(seed=3)
    _, reward, _, _, info = env.step((1, 3))
    vectors = np.array([[score(t, "")[k] for k in ("length", "digits")] for t in info["texts"]])
    rounded = np.round(vectors / 0.5) * 0.5
    assert np.array_equal(info["outcomes"], rounded)
    w = env.table.context_weights[info["context"]]
    assert reward == pytest.approx((rounded @ w[:-1]).max() + w[-1] * 3 * env.table.cost_matrix()[1, 0])
    env.close()


@pytest.mark.parametrize("agent", ["psst", "ucb"])
def test_agents_train_within_budget_and_a_rerun_is_served_by_the_cache(tmp_path: Path, proxy: int, agent: str) -> None:  # noqa: F811
    from agents import make

    spec = _spec(tmp_path, proxy)
    policies, requests = [], []
    for _ in range(2):
        env = LiveEnv(spec, cache=tmp_path / "cache.sqlite")
        before = proxy_stats(proxy)["posts"]
        env.reset(seed=7)
        policies.append(make(agent, seed=1).train(env, 48))
        assert env.budget_used <= 48
        requests.append((env.requests, proxy_stats(proxy)["posts"] - before))
        env.close()
    assert requests[0][0] > 0 and requests[0][1] == requests[0][0]  # the first run asked the server
    assert requests[1] == (0, 0)  # the second was answered entirely from the cache
    assert policies[0] == policies[1]


def test_monte_carlo_evaluation_is_reproducible_from_the_cache(tmp_path: Path, proxy: int) -> None:  # noqa: F811
    spec = _spec(tmp_path, proxy)
    results = []
    for _ in range(2):
        env = LiveEnv(spec, cache=tmp_path / "cache.sqlite")
        env.reset(seed=0)
        policy = iapo_gym.Policy(((0, 2), (1, 1), (1, 3)))
        results.append((env.evaluate_monte_carlo(policy, split="train", n_samples=30, seed=5), env.requests))
        env.close()
    (mean, se), first_requests = results[0]
    assert np.isfinite(mean) and se >= 0 and first_requests > 0
    assert results[1] == ((mean, se), 0)


def test_bad_pulls_and_the_cap_stop_before_sending(tmp_path: Path, proxy: int) -> None:  # noqa: F811
    from iapo_gym.llm.client import BudgetExhausted

    spec = write_spec(tmp_path, proxy, n_max=4, sampling={"temperature": 0.9, "max_tokens": 4},
                      endpoint={"concurrency": 8}, budget={"max_requests": 3})
    env = LiveEnv(spec, cache=tmp_path / "cache.sqlite")
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"N must be in \[1, 4\], got 5"):
        env.step((0, 5))
    with pytest.raises(ValueError, match=r"prompt p must be in \[0, 1\], got 2"):
        env.pull(np.array([2]), np.array([1]))
    assert proxy_stats(proxy)["posts"] == 0
    with pytest.raises(BudgetExhausted, match="max_requests = 3"):
        env.pull(np.array([0, 1]), np.array([4, 4]))
    assert env.requests == 3 and proxy_stats(proxy)["posts"] == 3
    assert env.source._drawn.sum() == 0  # the failed pull used up no sample index
    env.close()


def test_pull_one_asks_the_endpoint_and_the_live_schema_has_nothing_to_sample(tmp_path: Path, proxy: int) -> None:  # noqa: F811
    env = LiveEnv(_spec(tmp_path, proxy), cache=tmp_path / "cache.sqlite")
    assert not hasattr(env.table, "probs") and not env.draws_from_table and not env.source.exact
    for refused in (env.q_table, env.optimal_policy):
        with pytest.raises(NotImplementedError, match="a live endpoint has no exact oracle"):
            refused()
    env.reset(seed=2)
    before = proxy_stats(proxy)["posts"]
    query, atoms = env.pull_one(1, 3)
    assert proxy_stats(proxy)["posts"] > before and env.requests > 0  # real requests, not table draws
    assert atoms.shape == (3,) and 0 <= query < env.table.n_queries and env.budget_used == 3
    env.reset(seed=2)
    again = env.pull_one(1, 3)  # the same sample indices: answered by the cache
    assert again[0] == query and np.array_equal(again[1], atoms)
    with pytest.raises(NotImplementedError, match="no outcome distribution"):
        env._get_sampler()
    env.close()
