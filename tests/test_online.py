"""The online protocol (iapo_gym.online, agents/online): exact per-step regret under every schedule, determinism,
the agent interface and the drift property that separates a frozen agent from a learning one."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import iapo_gym  # noqa: F401  (registers IAPO-Online-v0)
from agents.online import make_online
from agents.online.explore_commit import ExploreThenCommit
from agents.online.ucb import ContextUCB
from iapo_gym.online import OnlineAgentBase, OnlineEnv, ScheduleError, build_schedule, checkpoints, run_online
from iapo_gym.oracle import q_table
from iapo_gym.tasks.generated import level_table, redraw_table

SMALL = [("mv_categorical", 2), ("mv_binary", 6), ("bon_flat", 7), ("bon_shift", 5)]


class RandomArms(OnlineAgentBase):
    """Uniform over the available prompts and every N: its choices do not depend on what it saw."""

    def start(self, env: OnlineEnv, seed: int) -> None:
        super().start(env, seed)
        self.n_max = env.table.n_max

    def choose_batch(self, requests):  # type: ignore[no-untyped-def]
        live = np.flatnonzero(requests.available)
        u = self.rng.random((len(requests), 2))  # two doubles per request, in request order: batch-size free
        return live[(u[:, 0] * live.size).astype(np.int64)], 1 + (u[:, 1] * self.n_max).astype(np.int64)


def _by_hand(family: str, level: int, kind: str, horizon: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(Q (C, P, N_max), available (P,)) at request t, rebuilt from the schedule's documented draws."""
    base = level_table(family, level)
    schedule = build_schedule(kind, base, horizon)
    seg = next(s for s in schedule.segments if s.start <= t < s.stop)
    probs = base.probs.copy()
    if seg.weight:
        other = redraw_table(family, level, "drift").probs
        d = schedule.drifting
        probs[d] = (1.0 - seg.weight) * base.probs[d] + seg.weight * other[d]
    from dataclasses import replace

    mixed = replace(base, probs=probs)
    return q_table(mixed, base.split_indices("test")), schedule.arrival <= t


@pytest.mark.parametrize("family,level", SMALL)
@pytest.mark.parametrize("kind", ["drift", "arrival", "context_shift"])
def test_step_regret_is_the_exact_regret_of_the_schedule(family: str, level: int, kind: str) -> None:
    horizon = 300
    env = gym.make("IAPO-Online-v0", family=family, level=level, schedule=kind, horizon=horizon).unwrapped
    assert len(env.schedule.segments) >= 2  # the schedule changes within the run
    agent = RandomArms()
    obs, _ = env.reset(seed=3)
    agent.start(env, 3)
    cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for t in range(horizon):
        p, n = agent.choose(obs)
        obs, _, terminated, _, info = env.step((p, n))
        seg = env.schedule.segment_at(t)
        if seg not in cache:
            cache[seg] = _by_hand(family, level, kind, horizon, t)
        q, available = cache[seg]
        c = info["context"]
        q_star = q[c][available].max()
        assert info["t"] == t
        assert info["q_star"] == pytest.approx(q_star, abs=1e-12)
        assert info["q_chosen"] == pytest.approx(q[c, p, n - 1], abs=1e-12)
        assert info["regret"] == pytest.approx(q_star - q[c, p, n - 1], abs=1e-12)
        assert info["regret"] >= -1e-12
        assert terminated == (t == horizon - 1)
    if kind == "drift":  # the drifting prompts' Q moved
        first, last = cache[0][0], cache[max(cache)][0]
        assert np.abs(first - last)[:, env.schedule.drifting].max() > 1e-3
        assert np.array_equal(first[:, ~env.schedule.drifting], last[:, ~env.schedule.drifting])


def test_stationary_keeps_q_star_constant_and_equal_to_the_oracle() -> None:
    env = OnlineEnv(family="bon_shift", level=5, schedule="stationary", horizon=500)
    assert len(env.schedule.segments) == 1
    best = q_table(env.table, env.table.split_indices("test")).reshape(env.table.n_contexts, -1).max(axis=1)
    agent = RandomArms()
    obs, _ = env.reset(seed=1)
    agent.start(env, 1)
    seen: dict[int, float] = {}
    for _ in range(500):
        obs_next, _, _, _, info = env.step(agent.choose(obs))
        assert seen.setdefault(info["context"], info["q_star"]) == info["q_star"]
        assert info["q_star"] == best[info["context"]]
        obs = obs_next
    assert len(seen) == env.table.n_contexts  # every context arrived


def test_arrival_refuses_a_prompt_before_its_step_and_draws_nothing() -> None:
    env = OnlineEnv(family="mv_categorical", level=2, schedule="arrival", horizon=400)
    late = int(np.argmax(env.schedule.arrival))
    arrives = int(env.schedule.arrival[late])
    assert arrives > 0
    env.reset(seed=5)
    obs, _, _, _, first = env.step((int(np.flatnonzero(env.schedule.arrival == 0)[0]), 1))
    assert obs["available"][late] == 0
    with pytest.raises(ValueError, match=rf"prompt {late} is not available at step 1: it arrives at step {arrives}"):
        env.step((late, 2))
    assert env.t == 1  # nothing served
    served = env.step((int(np.flatnonzero(env.schedule.arrival == 0)[0]), 1))[4]
    fresh = OnlineEnv(family="mv_categorical", level=2, schedule="arrival", horizon=400)
    fresh.reset(seed=5)
    fresh.step((int(np.flatnonzero(env.schedule.arrival == 0)[0]), 1))
    again = fresh.step((int(np.flatnonzero(env.schedule.arrival == 0)[0]), 1))[4]
    assert served["query"] == again["query"] and np.array_equal(served["atoms"], again["atoms"])  # no draw was spent
    while env.t < arrives:
        env.step((int(np.flatnonzero(env.schedule.arrival == 0)[0]), 1))
    info = env.step((late, 2))[4]  # accepted from its arrival on
    assert info["t"] == arrives and np.isfinite(info["regret"])


@pytest.mark.parametrize("make", [RandomArms, lambda: ExploreThenCommit(budget=500)])
def test_run_is_bit_identical_for_a_seed_whatever_the_batch_size(make) -> None:  # type: ignore[no-untyped-def]
    env = OnlineEnv(family="bon_flat", level=7, schedule="drift", horizon=2_000)
    runs = [run_online(env, make(), seed=11, batch_size=b) for b in (1, 7, 256, 5_000)]
    for other in runs[1:]:
        assert np.array_equal(runs[0].regret, other.regret)
        assert np.array_equal(runs[0].cumulative_regret, other.cumulative_regret)
        assert runs[0].completions == other.completions
    assert not np.array_equal(runs[0].regret, run_online(env, make(), seed=12).regret)


def test_gymnasium_loop_and_driver_agree_and_an_adaptive_agent_repeats() -> None:
    env = gym.make("IAPO-Online-v0", family="mv_binary", level=6, schedule="arrival", horizon=1_000)
    base = env.unwrapped
    result = run_online(base, ContextUCB(), seed=4, batch_size=1)
    from iapo_gym.seeding import derive_seed

    agent = ContextUCB()
    obs, _ = env.reset(seed=4)
    agent.start(base, derive_seed(4, "agent"))
    regret, done = [], False
    while not done:  # the plain Gymnasium loop: choose, step, update
        action = agent.choose(obs)
        next_obs, _, done, _, info = env.step(action)
        agent.update(obs, action, info)
        regret.append(info["regret"])
        obs = next_obs
    assert np.array_equal(np.array(regret), result.regret)
    with pytest.raises(ValueError, match="not the N = "):
        agent.update(obs, (action[0], action[1] + 1), info)
    again = run_online(base, ContextUCB(), seed=4, batch_size=32)
    assert np.array_equal(again.regret, run_online(base, ContextUCB(), seed=4, batch_size=32).regret)
    assert np.all(np.diff(result.cumulative_regret) >= -1e-9)
    assert list(result.checkpoints[:3]) == [10, 20, 30] and result.checkpoints[-1] == 1_000


def test_a_frozen_agent_is_caught_by_its_regret_slope_after_drift() -> None:
    """After the change point explore-then-commit keeps paying (its slope stays up); UCB relearns (its slope falls)."""
    horizon = 20_000
    env = OnlineEnv(family="bon_shift", level=5, schedule="drift", horizon=horizon)
    change = env.schedule.segments[-1].start
    assert env.schedule.segments[-1].weight > 0
    frozen = run_online(env, make_online("etc_auto"), seed=0, batch_size=64)
    learner = run_online(env, make_online("ucb"), seed=0, batch_size=64)

    def slope(result, a: int, b: int) -> float:  # type: ignore[no-untyped-def]
        return float(result.regret[a:b].mean())

    tail = (horizon - (horizon - change) // 3, horizon)
    assert slope(frozen, change, horizon) > 0.02  # the committed arm is no longer optimal
    assert slope(frozen, *tail) > 0.8 * slope(frozen, change, change + (horizon - change) // 3)  # and never will be
    assert slope(learner, *tail) < 0.5 * slope(learner, change, change + (horizon - change) // 3)  # UCB relearns
    assert slope(learner, *tail) < 0.5 * slope(frozen, *tail)


def test_bad_input_names_the_value() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'sometimes'"):
        OnlineEnv(family="bon_shift", level=5, schedule="sometimes")
    with pytest.raises(ScheduleError, match="horizon must be an integer >= 1"):
        OnlineEnv(family="bon_shift", level=5, horizon=0)
    from dataclasses import replace

    plain = replace(level_table("bon_shift", 5), attrs={})
    with pytest.raises(ScheduleError, match="not a generated level"):
        OnlineEnv(table=plain, schedule="drift")
    env = OnlineEnv(family="bon_shift", level=5, horizon=100)
    with pytest.raises(ValueError, match=r"N must be in \[1, 21\], got 22"):
        env.step((0, 22))
    with pytest.raises(ValueError, match="horizon must be in"):
        run_online(env, RandomArms(), horizon=101)
    with pytest.raises(ValueError, match="unknown online agent"):
        make_online("nope")


def test_redraw_keeps_everything_but_the_distributions() -> None:
    for family, level in SMALL:
        base, other = level_table(family, level), redraw_table(family, level, "drift")
        assert other.probs.shape == base.probs.shape and np.abs(other.probs - base.probs).max() > 0.05
        assert np.array_equal(other.split, base.split) and np.array_equal(other.cost, base.cost)
        assert np.array_equal(other.context_weights, base.context_weights)
        assert np.array_equal(redraw_table(family, level, "drift").probs, other.probs)  # seeded


def test_checkpoints_cover_the_horizon() -> None:
    assert list(checkpoints(100)) == list(range(1, 101))
    assert list(checkpoints(50)) == list(range(1, 51))  # distinct counts only
    assert checkpoints(10_000)[0] == 100 and checkpoints(10_000)[-1] == 10_000


@pytest.mark.parametrize("name", ["ucb", "ucb_discounted", "thompson"])
def test_learning_agents_repeat_for_a_seed_and_learn(name: str) -> None:
    env = OnlineEnv(family="bon_shift", level=5, schedule="stationary", horizon=6_000)
    first = run_online(env, make_online(name), seed=2, batch_size=8)
    assert np.array_equal(first.regret, run_online(env, make_online(name), seed=2, batch_size=8).regret)
    assert first.regret[-600:].mean() < 0.5 * first.regret[:600].mean()  # the regret per request falls


def test_arrival_is_explored_by_optimistic_entry_and_ignored_by_a_frozen_agent() -> None:
    env = OnlineEnv(family="mv_categorical", level=2, schedule="arrival", horizon=3_000)
    late = np.flatnonzero(env.schedule.arrival > 0)
    ucb = run_online(env, ContextUCB(), seed=0, batch_size=4)
    assert ucb.completions > 0
    agent = ContextUCB()
    env2 = OnlineEnv(family="mv_categorical", level=2, schedule="arrival", horizon=3_000)
    env2.reset(seed=0)
    agent.start(env2, 0)
    while env2.t < env2.horizon:
        requests = env2.arrivals(4)
        prompts, ns = agent.choose_batch(requests)
        assert requests.available[prompts].all()  # never an unavailable prompt
        agent.update_batch(requests, env2.serve(requests, prompts, ns))
    assert (agent.counts[late] > 0).all()  # every late prompt was tried after it arrived
    frozen = ExploreThenCommit(budget=500)
    run_online(env, frozen, seed=0)
    assert not np.isin(frozen.arms[:, 0], late).any()  # trained before they arrived: never served


@pytest.mark.heavy
def test_the_python_blocks_of_docs_online_run() -> None:
    """Every ```python block of docs/online.md runs as written (the interface sketch is a plain block)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "online.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 3
    scopes = []
    for block in blocks:
        scope: dict[str, object] = {}
        exec(compile(block, "docs/online.md", "exec"), scope)  # noqa: S102
        scopes.append(scope)
    result = scopes[1]["result"]
    assert result.checkpoints.size == 100 and result.regret.size == 10_000  # type: ignore[attr-defined]
    assert scopes[2]["env"].t == 1_000  # type: ignore[attr-defined]  # the Gymnasium loop served the whole run


def test_context_shift_draws_each_segment_from_its_mix() -> None:
    env = OnlineEnv(family="bon_shift", level=5, schedule="context_shift", horizon=40_000)
    first, second = env.schedule.segments
    assert first.context_probs is None and second.context_probs is not None
    assert np.abs(second.context_probs - env.table.context_probs).max() > 0.1  # the mix moved
    result = run_online(env, RandomArms(), seed=0, batch_size=1_000)
    contexts = env._contexts
    for seg, probs in ((first, env.table.context_probs), (second, second.context_probs)):
        freq = np.bincount(contexts[seg.start:seg.stop], minlength=env.table.n_contexts) / (seg.stop - seg.start)
        assert np.abs(freq - probs).max() < 0.02
    q_star = env.segment_tensors(1)[1]
    assert np.array_equal(q_star, env.segment_tensors(0)[1])  # the outcome distributions did not change
    assert result.regret.shape == (40_000,)
    with pytest.raises(ScheduleError, match="context_shift needs at least 2 contexts"):
        from dataclasses import replace

        base = level_table("bon_shift", 5)
        one = replace(base, context_weights=base.context_weights[:1], context_names=base.context_names[:1],
                      context_probs=np.ones(1))
        OnlineEnv(table=one, schedule="context_shift")


def test_gymnasium_env_checker_passes() -> None:
    from gymnasium.utils.env_checker import check_env

    env = gym.make("IAPO-Online-v0", family="bon_shift", level=5, horizon=50)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    check_env(env.unwrapped, skip_render_check=True)


@pytest.mark.parametrize("family,level,kind", [("bon_shift", 5, "drift"), ("bon_multi", 3, "retirement"),
                                               ("bon_large_n", 4, "stationary"), ("mv_categorical", 2, "arrival"),
                                               ("mv_binary", 6, "model_arrival")])
def test_one_request_outcomes_and_utilities_are_the_batch_paths_bit_for_bit(family: str, level: int,
                                                                           kind: str) -> None:
    """``step`` serves a request with the one-request kernels, ``serve`` a batch with the batch kernels: for the same
    seed and arms the queries, atoms, utilities under every context, rewards, costs and regret agree bit for bit (a
    score summed in another order, a maximum or a vote tie taken otherwise would show)."""
    horizon = 500
    env = OnlineEnv(family=family, level=level, schedule=kind, horizon=horizon)
    rng = np.random.default_rng(1)
    obs, _ = env.reset(seed=3)
    arms, one, done = [], [], False
    while not done:
        live = np.flatnonzero(obs["available"])
        arm = (int(live[rng.integers(live.size)]), int(rng.integers(1, env.table.n_max + 1)))
        obs, reward, done, _, info = env.step(arm)
        arms.append(arm)
        one.append((info, reward))
    assert {n for _, n in arms} >= {1, 2}  # single completions and ties of two are served
    env.reset(seed=3)
    while env.t < horizon:
        requests = env.arrivals(50)
        chosen = np.array(arms[requests.start:requests.start + len(requests)])
        served = env.serve(requests, chosen[:, 0], chosen[:, 1])
        pulls = served.pulls
        for i in range(len(requests)):
            info, reward = one[requests.start + i]
            assert info["query"] == pulls.queries[i]
            assert np.array_equal(info["atoms"], pulls.atoms[pulls.offsets[i]:pulls.offsets[i + 1]])
            assert info["utilities"].dtype == np.float64 and info["utilities"].shape == (env.table.n_contexts,)
            assert info["utilities"].tobytes() == served.utilities[:, i].tobytes()
            assert reward == served.rewards[i] and info["cost"] == served.costs[i]
            assert info["regret"] == served.regret[i]


def _reference_serve(env: OnlineEnv, prompts: np.ndarray, ns: np.ndarray, rng_queries: np.random.Generator,
                     rng_atoms: np.random.Generator, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(queries, atoms, utilities (C, B)) of a batch in plain numpy: the alias draw of ``AliasSampler.sample``, each
    Best-of-N score summed objective by objective left to right and its maximum over the pull's completions by
    ``np.maximum.reduceat``, each vote's credit by ``mv_credit``."""
    from iapo_gym.sampling import AliasSampler
    from iapo_gym.utility import mv_credit

    table = env.schedule.table_at(env.table, env.schedule.segment_at(t))
    pool = env.table.split_indices(env.split)
    queries = pool[(rng_queries.random(prompts.size) * pool.size).astype(np.int64)]
    sampler = AliasSampler(table.probs.reshape(-1, table.n_atoms))
    atoms = sampler.sample(np.repeat(prompts * table.n_queries + queries, ns), rng_atoms)
    offsets = np.concatenate([[0], np.cumsum(ns)])
    weights = table.context_weights
    cost_term = weights[:, -1:] * (ns * table.cost_matrix()[prompts, queries])[None, :]
    if table.aggregator == "bon":
        vectors = table.atoms[np.repeat(prompts, ns), np.repeat(queries, ns), atoms]
        scores = weights[:, :1] * vectors[None, :, 0]
        for d in range(1, vectors.shape[1]):
            scores += weights[:, d:d + 1] * vectors[None, :, d]
        return queries, atoms, np.maximum.reduceat(scores, offsets[:-1], axis=1) + cost_term
    counts = np.zeros((prompts.size, table.n_atoms), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(prompts.size), ns), atoms), 1)
    return queries, atoms, weights[:, :1] * mv_credit(counts, table.gold[queries])[None, :] + cost_term


@pytest.mark.parametrize("family,level,kind", [("bon_multi", 3, "drift"), ("bon_large_n", 4, "stationary"),
                                               ("bon_shift", 5, "model_arrival"), ("mv_categorical", 2, "drift"),
                                               ("mv_binary", 6, "arrival")])
def test_a_served_batch_equals_the_plain_numpy_draws_and_scores_bit_for_bit(family: str, level: int,
                                                                            kind: str) -> None:
    """``serve``'s compiled pass against a plain numpy reference on copies of the env's generators: the same
    queries and atoms, and utilities equal bit for bit under every context (a score summed in another order, a
    maximum or a vote tie taken otherwise, or a completion drawn from another row would show)."""
    import copy

    env = OnlineEnv(family=family, level=level, schedule=kind, horizon=3_000)
    env.reset(seed=5)
    rng = np.random.default_rng(2)
    checked = 0
    while env.t < env.horizon:
        requests = env.arrivals(int(rng.integers(2, 300)))
        live = np.flatnonzero(requests.available)
        prompts = live[rng.integers(live.size, size=len(requests))]
        ns = rng.integers(1, env.table.n_max + 1, size=len(requests))
        rng_queries, rng_atoms = copy.deepcopy(env._rng_queries), copy.deepcopy(env._rng_atoms)
        queries, atoms, utilities = _reference_serve(env, prompts, ns, rng_queries, rng_atoms, env.t)
        served = env.serve(requests, prompts, ns)
        assert np.array_equal(served.pulls.queries, queries) and np.array_equal(served.pulls.atoms, atoms)
        assert served.utilities.shape == utilities.shape
        assert served.utilities.tobytes() == utilities.tobytes()
        checked += int(ns.sum())
    assert checked > 2 * env.horizon  # every request served, most of them with several completions
