"""The common-query agents: plug-in halving (``auto``), anytime plug-in elimination and common-query PSST."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import agents
from agents.challenger import PlugInEstimator, QueryStream
from iapo_gym import IAPOEnv, OutcomeTable, Pulls
from tests.conftest import query_shifted_bon_table, tiny_bon_table, tiny_mv_table

NEW = ["plugin_halving", "psst_cq", "plugin_anytime", "auto"]


class RecordingEnv(IAPOEnv):
    """An IAPOEnv that keeps every batch of pulls it served."""

    def __init__(self, table: OutcomeTable) -> None:
        super().__init__(table=table)
        self.batches: list[Pulls] = []

    def pull(self, prompts: Any, ns: Any, queries: Any = None) -> Pulls:
        pulls = super().pull(prompts, ns, queries)
        self.batches.append(pulls)
        return pulls


def test_auto_is_plugin_anytime_with_its_defaults() -> None:
    auto, plugin = agents.make("auto", seed=0), agents.make("plugin_anytime", seed=0)
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


@pytest.mark.parametrize("name", ["plugin_halving", "psst_cq", "plugin_anytime"])
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
    pool = env.queries("train").size  # 160
    first_pass = np.cumsum([u.size for u in used]) <= pool
    every = np.concatenate([u for u, first in zip(used, first_pass) if first])
    assert every.size >= 0.5 * pool
    assert np.unique(every).size == every.size  # no query reused before the split is used up
    assert np.isin(np.concatenate(used), env.queries("train")).all()


def _pull_every_train_query(env: IAPOEnv, est: PlugInEstimator, pulls_per_query: int) -> None:
    """``pulls_per_query`` pulls of N_max completions of every (prompt, train query), in one update."""
    train = env.queries("train")
    prompts = np.repeat(np.arange(env.n_prompts), train.size * pulls_per_query)
    queries = np.tile(np.repeat(train, pulls_per_query), env.n_prompts)
    est.update(env.pull(prompts, np.full(prompts.size, env.n_max), queries=queries))


@pytest.mark.parametrize(("alpha", "curve"), [(0.0, 0.0), (4.0, 0.0), (4.0, 3.0)])
def test_plug_in_majority_vote_converges_to_the_exact_train_q_table(alpha: float, curve: float) -> None:
    table = tiny_mv_table(seed=1, n_prompts=4, n_queries=30, n_buckets=3, n_max=6)
    env = IAPOEnv(table=table)
    env.reset(seed=0)
    est = PlugInEstimator(env, alpha=alpha, curve=curve)
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


def test_query_offsets_recover_an_additive_query_shift() -> None:
    table, shift = query_shifted_bon_table()
    env = IAPOEnv(table=table)
    env.reset(seed=0)
    est = PlugInEstimator(env, center=True)
    _pull_every_train_query(env, est, 500)
    train = env.queries("train")
    offsets = est.query_offsets()
    for row, w in enumerate(est._objectives):
        expected = shift[train] * w.sum()
        assert np.allclose(offsets[row, train], expected - expected.mean(), atol=0.05)
        assert np.all(offsets[row, env.queries("test")] == 0.0)  # never seen


def test_centred_best_of_n_reads_each_query_s_maximum_not_the_pooled_one() -> None:
    table, _ = query_shifted_bon_table()
    env = IAPOEnv(table=table)
    env.reset(seed=0)
    centred, pooled = PlugInEstimator(env, center=True), PlugInEstimator(env)
    train = env.queries("train")
    prompts = np.repeat(np.arange(env.n_prompts), train.size * 500)
    queries = np.tile(np.repeat(train, 500), env.n_prompts)
    pulls = env.pull(prompts, np.full(prompts.size, env.n_max), queries=queries)
    centred.update(pulls)
    pooled.update(pulls)
    exact = env.q_table("train")  # centred offsets: each residual keeps the train queries' mean offset
    assert np.abs(centred.mean() - exact).max() < 0.03
    assert np.abs(pooled.mean() - exact)[:, :, -1].max() > 0.3  # pooled, the queries' spread inflates max-of-6


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


# ---- the anytime plug-in agent (plugin_anytime) ------------------------------------------------------------


@pytest.mark.parametrize("params", [{"tail": "step"}, {"tail": "halving"}, {"tail": "halving", "eb": 2},
                                    {"tail": "halving_trim"}, {"reserve": 0.5, "tail_growth": 1.5},
                                    {"revisit": 0.25}, {"revisit": 0.5, "revisit_in": "tail"},
                                    {"revisit": 0.25, "revisit_in": "tail", "revisit_by": "disagree"},
                                    {"center": False}])
def test_anytime_train_budgets_is_bit_identical_to_separate_runs(math_release: Path, params: dict[str, Any]) -> None:
    from iapo_gym.data.release import read_release

    budgets = [0, 7, 900, 3_000, 5_000, 10_000]
    for table in (read_release(str(math_release))[0], tiny_bon_table(seed=3, n_prompts=6, n_queries=40)):
        env = IAPOEnv(table=table)
        separate = []
        for budget in budgets:
            env.reset(seed=11)
            separate.append((agents.make("plugin_anytime", seed=5, **params).train(env, budget),
                             env.budget_used))
        env.reset(seed=11)
        agent = agents.make("plugin_anytime", seed=5, **params)
        assert agent.anytime  # type: ignore[attr-defined]
        shared = list(agent.train_budgets(env, reversed(budgets)))  # type: ignore[attr-defined]
        assert [b for b, _ in shared] == budgets
        assert [p for _, p in shared] == [p for p, _ in separate]
        assert all(used <= b for (_, used), b in zip(separate, budgets))
        assert env.budget_used == separate[-1][1]  # the env continues the largest budget's trajectory


def test_anytime_steps_do_not_depend_on_the_budget() -> None:
    """The pulls of a smaller budget are a prefix of a larger one's, up to the smaller one's last step."""
    batches = []
    for budget in (2_000, 6_000):
        env = RecordingEnv(tiny_mv_table(n_prompts=8, n_queries=200, n_max=8))
        env.reset(seed=0)
        agents.make("plugin_anytime", seed=0, tail="step").train(env, budget)
        batches.append(env.batches)
    small, large = batches
    assert len(large) > len(small) >= 3
    for a, b in zip(small[:-1], large):
        assert np.array_equal(a.prompts, b.prompts) and np.array_equal(a.queries, b.queries)
        assert np.array_equal(a.atoms, b.atoms)
    assert not np.array_equal(small[-1].queries, large[len(small) - 1].queries)  # the branch: its own last step


def test_anytime_live_prompts_shrink_at_the_documented_pace() -> None:
    env = RecordingEnv(tiny_mv_table(n_prompts=16, n_queries=400, n_max=8))
    env.reset(seed=0)
    agent = agents.make("plugin_anytime", seed=0, n_min=1, q0=4, growth=1.0, rate=1.0, tail="step")
    agent.train(env, 4_000)
    s0 = 16 * 4 * 1
    spent = 0
    for pulls in env.batches[:-1]:  # the whole steps
        live = np.unique(pulls.prompts).size
        target = 16 if spent <= s0 else max(1, int(np.ceil(16 * s0 / spent)))  # per context
        assert live <= min(16, env.n_contexts * target), (spent, live, target)
        spent += pulls.completions
    assert np.unique(env.batches[0].prompts).size == 16 and np.unique(env.batches[-1].prompts).size < 16


def test_anytime_halving_tail_halves_each_context_on_what_is_left() -> None:
    """tail="halving": the same whole steps as tail="step", then rounds whose live prompts never grow,
    ending with one per context, within the budget and spending nearly all of it; "halving_trim":
    the same but for the round on the survivors, whose completions go to the earlier rounds."""
    table = tiny_mv_table(n_prompts=16, n_queries=400, n_max=8)
    runs = {}
    for tail in ("step", "halving", "halving_trim"):
        env = RecordingEnv(table)
        env.reset(seed=0)
        agents.make("plugin_anytime", seed=0, tail=tail).train(env, 5_000)
        runs[tail] = env.batches
    step, halving = runs["step"], runs["halving"]
    whole = len(step) - 1
    for a, b in zip(step[:whole], halving[:whole]):
        assert np.array_equal(a.prompts, b.prompts) and np.array_equal(a.atoms, b.atoms)
    live = [np.unique(pulls.prompts).size for pulls in halving[whole:]]
    assert len(live) >= 3 and all(b <= a for a, b in zip(live, live[1:])), live
    assert live[-1] <= table.n_contexts < live[0], live
    spent = sum(pulls.completions for pulls in halving)
    assert 4_500 <= spent <= 5_000, spent
    trimmed = runs["halving_trim"]
    assert all(np.array_equal(a.atoms, b.atoms) for a, b in zip(halving[:whole], trimmed[:whole]))
    trim_live = [np.unique(pulls.prompts).size for pulls in trimmed[whole:]]
    assert len(trim_live) == len(live) - 1 and trim_live[0] == live[0], (trim_live, live)
    assert trimmed[whole].completions > halving[whole].completions  # the survivors' round spread over the others
    assert 4_500 <= sum(pulls.completions for pulls in trimmed) <= 5_000


def test_anytime_reserve_and_tail_growth_shape_the_tail() -> None:
    """``reserve`` stops the whole steps where they would leave the tail less than that share of T
    (the steps before are the default's); ``tail_growth`` makes each halving round spend that many
    times the one before; the budget is kept and nearly all spent either way."""
    table = tiny_mv_table(n_prompts=16, n_queries=400, n_max=8)
    budget = 5_000

    def batches(**params: Any) -> list[Pulls]:
        env = RecordingEnv(table)
        env.reset(seed=0)
        agents.make("plugin_anytime", seed=0, **params).train(env, budget)
        return env.batches

    def whole_steps(pulls: list[Pulls], s0: int) -> int:
        """How many leading batches are doubling steps (each spends what was spent before)."""
        spent, count = 0, 0
        for p in pulls:
            if spent and p.completions < spent * 0.9 or (not spent and p.completions != s0):
                break
            spent, count = spent + p.completions, count + 1
        return count

    s0 = 16 * 8 * 2
    default, reserved = batches(), batches(reserve=0.5)
    k_default, k_reserved = whole_steps(default, s0), whole_steps(reserved, s0)
    assert k_reserved < k_default
    assert all(np.array_equal(a.atoms, b.atoms) for a, b in zip(default[:k_reserved], reserved[:k_reserved]))
    steps_spent = sum(p.completions for p in reserved[:k_reserved])
    assert steps_spent <= 0.5 * budget < sum(p.completions for p in default[:k_default])
    for pulls in (default, reserved):
        assert 0.9 * budget <= sum(p.completions for p in pulls) <= budget
    grown = batches(tail_growth=2.0)
    tail = [p.completions for p in grown[k_default:]]
    assert len(tail) >= 2 and all(1.6 <= b / a <= 2.5 for a, b in zip(tail, tail[1:])), tail
    assert 0.9 * budget <= sum(p.completions for p in grown) <= budget


@pytest.mark.parametrize(("revisit", "revisit_by"), [(0.25, "close"), (0.5, "close"), (0.25, "disagree")])
def test_anytime_revisit_takes_the_top_scored_seen_queries_again(revisit: float, revisit_by: str) -> None:
    """After the first step, floor(revisit m) of each step's m common queries are queries every live
    prompt has seen, those with the highest ``close_calls`` (or ``disagreements``) score just before
    the step; the rest are fresh; a Best-of-N table (no per-query credit) takes only fresh queries."""
    table = tiny_mv_table(n_prompts=12, n_queries=400, n_buckets=3, n_max=8)
    env = RecordingEnv(table)
    env.reset(seed=0)
    agent = agents.make("plugin_anytime", seed=0, revisit=revisit, revisit_in="all", revisit_by=revisit_by)
    run = agent._new_run(agent.base_env(env))  # type: ignore[attr-defined]
    scorer = run.est.close_calls if revisit_by == "close" else run.est.disagreements
    revisited = 0
    while run.spent < 5_000:
        live = np.flatnonzero(run.alive.any(axis=0))
        before = run.est._seen[np.ix_(live, run.stream.pool)].all(axis=0)
        pool_seen = run.stream.pool[before]
        means = np.where(run.alive[:, :, None], run.est.mean(unseen=-np.inf), -np.inf)
        scales = np.unique(means.reshape(means.shape[0], -1).argmax(axis=1) % table.n_max) + 1
        score = scorer(live, pool_seen, scales) if pool_seen.size else np.zeros(0)
        agent._pull(run, agent._next_step(run))  # type: ignore[attr-defined]
        common = np.unique(env.batches[-1].queries)
        again = np.intersect1d(common, pool_seen)
        m = common.size
        assert again.size == (math.floor(revisit * m) if pool_seen.size else 0), (again.size, m)
        if again.size:
            cutoff = np.sort(score)[::-1][again.size - 1]
            assert score[np.isin(pool_seen, again)].min() >= cutoff  # the top scores were taken
            revisited += again.size
        agent._trim(run, max(1, run.alive.sum(axis=1).max() - 2))  # type: ignore[attr-defined]
    assert revisited > 0
    tail_only = RecordingEnv(table)
    tail_only.reset(seed=0)
    agents.make("plugin_anytime", seed=0, revisit=revisit, revisit_in="tail", revisit_by=revisit_by).train(
        tail_only, 5_000)
    default = RecordingEnv(table)
    default.reset(seed=0)
    agents.make("plugin_anytime", seed=0, revisit=0.0).train(default, 5_000)
    taken: set[int] = set()
    again_per_batch = []
    for pulls in tail_only.batches:
        common = set(np.unique(pulls.queries).tolist())
        again_per_batch.append(len(common & taken))
        taken |= common
    whole = next(i for i, (a, b) in enumerate(zip(tail_only.batches, default.batches))
                 if not np.array_equal(a.atoms, b.atoms))  # the first tail round: the steps are the default's
    assert whole >= 2 and not any(again_per_batch[:whole]) and all(again_per_batch[whole:]), again_per_batch
    bon = RecordingEnv(tiny_bon_table(seed=1, n_prompts=6, n_queries=300))
    bon.reset(seed=0)
    agents.make("plugin_anytime", seed=0, revisit=revisit, revisit_by=revisit_by).train(bon, 3_000)
    pulled = np.concatenate([np.unique(b.queries) for b in bon.batches])
    assert np.unique(pulled).size == pulled.size  # 240 train queries: no query taken twice


def test_disagreements_score_queries_where_prompts_differ_and_are_unsure() -> None:
    """``disagreements``: per query, the sum over scales of the variance of the prompts' credits times their
    mean c (1 - c); zero where every prompt has the same credit or every credit is 0 or 1."""
    table = tiny_mv_table(n_prompts=3, n_queries=40, n_buckets=2, n_max=4)
    env = IAPOEnv(table=table)
    env.reset(seed=0)
    agent = agents.make("plugin_anytime", seed=0)
    est = agent._new_run(agent.base_env(env)).est  # type: ignore[attr-defined]
    prompts, queries, scales = np.array([0, 1, 2]), np.array([0, 1, 2, 3]), np.array([1, 3])
    est._credit[:, :4, :] = 0.0
    est._credit[:, 0, :] = 0.5  # every prompt equally unsure: 0
    est._credit[:, 1, :] = np.array([0.0, 1.0, 1.0])[:, None]  # split but sure: 0
    est._credit[:, 2, :] = np.array([0.2, 0.8, 0.5])[:, None]
    est._credit[:, 3, :] = np.array([0.4, 0.6, 0.5])[:, None]
    wide, narrow = np.array([0.2, 0.8, 0.5]), np.array([0.4, 0.6, 0.5])
    expected = [2 * c.var() * (c * (1 - c)).mean() for c in (wide, narrow)]  # two scales
    score = est.disagreements(prompts, queries, scales)
    np.testing.assert_allclose(score, [0.0, 0.0, *expected], atol=1e-15)
    assert 0.0 < score[3] < score[2]  # a smaller split between about as unsure prompts scores less
    np.testing.assert_allclose(est.close_calls(prompts, queries, scales)[:2], [1.5, 0.0])


@pytest.mark.parametrize("votes", [0, 16, 48])
def test_anytime_votes_give_every_common_query_enough_completions(votes: int) -> None:
    """Every step gives each (prompt, query) at least ceil(votes / live) completions (at most N_max), so
    a common query has ``votes`` or more votes over the live prompts however few are live; a step
    that cannot afford one query at that n gives one query all it can."""
    table = tiny_mv_table(n_prompts=12, n_queries=300, n_max=8)
    env = RecordingEnv(table)
    env.reset(seed=0)
    agents.make("plugin_anytime", seed=0, n_min=1, kappa=8.0, votes=votes).train(env, 6_000)
    floors = []
    for pulls in env.batches:
        live = np.unique(pulls.prompts).size
        floor = min(table.n_max, max(1, -(-votes // live)))
        assert np.unique(pulls.ns).size == 1, "every (prompt, query) of a step gets the same n"
        if np.unique(pulls.queries).size > 1:
            assert pulls.ns[0] >= floor, (live, pulls.ns[0], floor)
        floors.append(floor)
    if votes:
        assert max(floors) > 1  # the rule bound somewhere: few prompts were live


def test_mv_credit_rows_matches_the_exact_oracle() -> None:
    from agents import _plugin_jit
    from agents.challenger import mv_credit_rows
    from iapo_gym.utility import mv_expected_credit

    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(5, 0.5), size=300)
    probs[probs < 0.08] = 0.0  # rows with 0-4 other buckets of positive probability
    probs[:20] = np.eye(5)[rng.integers(5, size=20)]
    probs /= probs.sum(axis=1, keepdims=True)
    gold = rng.integers(5, size=300)
    exact = mv_expected_credit(probs, gold, 16)
    assert np.abs(mv_credit_rows(probs, gold, 16) - exact).max() < 1e-12
    if _plugin_jit.available():
        others = np.sort(np.where(np.eye(5, dtype=bool)[gold], -1.0, probs), axis=1)[:, ::-1][:, :4]
        width = (others > 0).sum(axis=1)
        compiled = _plugin_jit.credit_rows(probs[np.arange(300), gold], others, width, 16)
        assert np.abs(compiled - exact).max() < 1e-12
        for block_rows in (1, 7):  # a row's lane never reads another row's: any block gives the same bits
            assert np.array_equal(_plugin_jit.credit_rows(probs[np.arange(300), gold], others, width, 16, block_rows),
                                  compiled)
        with pytest.raises(ValueError, match="block_rows"):
            _plugin_jit.credit_rows(probs[np.arange(300), gold], others, width, 16, 0)


def test_response_curve_prior_separates_a_steep_prompt_from_a_flat_one() -> None:
    """Prompt 0 is right with 0.95 on easy and 0.3 on hard queries, prompt 1 with 0.65 on both.

    At N = 15 prompt 1 wins (majority votes: about 0.87 against 0.5 * 1 + 0.5 * 0.05). With two
    votes per (prompt, query) the pooled prior pulls both towards the same per-query accuracy;
    the response curves keep the difference, so their large-N estimate is closer to the truth.
    """
    n_queries = 400
    easy = np.arange(n_queries) % 2 == 0
    correct = np.stack([np.where(easy, 0.95, 0.3), np.full(n_queries, 0.65), np.where(easy, 0.9, 0.45)])
    probs = np.stack([correct, 1 - correct], axis=-1)
    table = OutcomeTable(
        task="steep_flat", aggregator="mv", probs=probs, cost=np.full(3, 0.0), n_max=15,
        context_weights=np.array([[1.0, 0.0]]), context_names=("free",), context_probs=np.array([1.0]),
        objective_names=("correct",), gold=np.zeros(n_queries, np.int64),
        split=(np.arange(n_queries) >= n_queries - 4).astype(np.uint8),
    )
    env = IAPOEnv(table=table)
    exact = env.q_table("train")[0, :, -1]
    errors, gaps = {}, {}
    for curve in (0.0, 3.0):
        env.reset(seed=0)
        est = PlugInEstimator(env, alpha=32.0, curve=curve)
        train = env.queries("train")
        prompts = np.repeat(np.arange(3), train.size)
        est.update(env.pull(prompts, np.full(prompts.size, 2), queries=np.tile(train, 3)))
        errors[curve] = np.abs(est.mean()[0, :, -1] - exact).max()
        gaps[curve] = est.mean()[0, 1, -1] - est.mean()[0, 0, -1]  # truth: about 0.36
    assert errors[3.0] < 0.8 * errors[0.0], errors
    assert gaps[3.0] > 0.1 and gaps[3.0] > 3 * gaps[0.0], gaps


def test_zprior_pulls_a_thinly_answered_query_towards_the_typical_difficulty() -> None:
    """Query 0 is answered by every prompt (half right), query 1 by prompt 0 alone, twice right.

    Without ``zprior`` query 1 looks as easy as two votes make it, so prompt 0's prior share of
    gold there is far above its share on query 0; with a strong ``zprior`` query 1's difficulty is
    the pool's, and the two rows' priors nearly meet; ``zprior=0`` is the unshrunk estimator.
    """
    table = _curve_table(np.zeros(6), np.ones(6), np.zeros(8))
    env = IAPOEnv(table=table)
    votes = np.array([1, 0] * 6 + [1, 1])  # gold is answer 0: six prompts half right on query 0
    gaps = {}
    for zprior in (0.0, 4.0, 1e6):
        env.reset(seed=0)
        est = PlugInEstimator(env, alpha=32.0, curve=3.0, zprior=zprior)
        prompts = np.concatenate([np.repeat(np.arange(6), 2), [0, 0]])
        queries = np.concatenate([np.zeros(12, np.int64), [1, 1]])
        est.update(Pulls(prompts=prompts, ns=np.ones(14, np.int64), queries=queries,
                         atoms=(1 - votes).astype(np.int64), offsets=np.arange(15, dtype=np.int64)))
        gaps[zprior] = est._credit[0, 1, 0] - est._credit[0, 0, 0]  # N = 1: the row's gold probability
    assert gaps[0.0] > gaps[4.0] > gaps[1e6] >= 0.0, gaps
    assert gaps[1e6] < 0.1 * gaps[0.0], gaps
    with pytest.raises(ValueError, match="zprior"):
        PlugInEstimator(env, curve=3.0, zprior=-1.0)


def _curve_table(a: np.ndarray, b: np.ndarray, z: np.ndarray) -> OutcomeTable:
    """A two-answer majority-vote table whose prompt p is right on query q with sigmoid(a_p + b_p z_q)."""
    correct = 1.0 / (1.0 + np.exp(-(a[:, None] + b[:, None] * z[None, :])))
    return OutcomeTable(
        task="curves", aggregator="mv", probs=np.stack([correct, 1 - correct], axis=-1), cost=np.zeros(a.size),
        n_max=5, context_weights=np.array([[1.0, 0.0]]), context_names=("free",), context_probs=np.array([1.0]),
        objective_names=("correct",), gold=np.zeros(z.size, np.int64),
        split=(np.arange(z.size) >= z.size - 2).astype(np.uint8),
    )


def test_response_curve_fit_of_a_prompt_far_from_the_pool_stays_finite_and_low() -> None:
    """Two prompts right 0.15 of the time among 23 right 0.95 of the time on mostly easy queries.

    Their likelihood's maximum is far from the pooled curve (0, 1) where the fit starts; full
    Newton steps from there overshoot more each time and call them nearly always right at large N
    (an estimate of about 1). The safeguarded steps reach the maximum: a low share.
    """
    rng = np.random.default_rng(2)
    n_queries, n_prompts = 240, 25
    easy = rng.random(n_queries) < 0.95
    correct = np.vstack([np.tile(np.where(easy, 0.95, 0.5), (23, 1)), np.full((2, n_queries), 0.15)])
    buckets = np.stack([correct, (1 - correct) * 0.5, (1 - correct) * 0.3, (1 - correct) * 0.2], axis=-1)
    table = OutcomeTable(
        task="far_prompt", aggregator="mv", probs=buckets, cost=np.zeros(n_prompts), n_max=32,
        context_weights=np.array([[1.0, 0.0]]), context_names=("free",), context_probs=np.array([1.0]),
        objective_names=("correct",), gold=np.zeros(n_queries, np.int64),
        split=(np.arange(n_queries) >= n_queries - 4).astype(np.uint8),
    )
    env = IAPOEnv(table=table)
    env.reset(seed=2)
    est = PlugInEstimator(env, alpha=32.0, curve=3.0)
    queries = env.queries("train")[:30]
    prompts = np.repeat(np.arange(n_prompts), queries.size)
    est.update(env.pull(prompts, np.full(prompts.size, 4), queries=np.tile(queries, n_prompts)))
    estimate = est.mean()[0, :, -1]
    assert np.all(np.isfinite(estimate))
    assert estimate[23:].max() < 0.5, estimate[23:]  # exact: about 0.01
    assert estimate[:23].min() > 0.8, estimate[:23]


def test_empirical_bayes_ridges_recover_the_spread_of_the_prompts_curves() -> None:
    """With many votes the fitted ridges are about 1 / the variance of the offsets and of the slopes.

    Offsets spread 0.6 and slopes 0.25 here, so the two ridges differ about sixfold; fixed ridges
    (``eb`` = 0) stay where they were set.
    """
    rng = np.random.default_rng(4)
    a, b = rng.normal(0.0, 0.6, 40), rng.normal(1.0, 0.25, 40)
    a -= a.mean()
    b += 1.0 - b.mean()
    table = _curve_table(a, b, rng.normal(0.0, 1.5, 300))
    ridges = {}
    for eb in (0, 4):
        env = IAPOEnv(table=table)
        env.reset(seed=0)
        est = PlugInEstimator(env, alpha=32.0, curve=3.0, eb=eb)
        _pull_every_train_query(env, est, 40)
        ridges[eb] = est._ridge
    assert ridges[0] == (3.0, 3.0)
    ridge_a, ridge_b = ridges[4]
    assert 0.6 < ridge_a * a.var() < 1.6, (ridge_a, 1 / a.var())
    assert 0.6 < ridge_b * b.var() < 1.6, (ridge_b, 1 / b.var())


def _difficulty(est: PlugInEstimator) -> tuple[np.ndarray, np.ndarray]:
    """The queries ``est`` has seen and their difficulty z_q as the estimator computes it (the logit
    of the gold rate pooled over every prompt)."""
    seen = np.flatnonzero(est._seen.any(axis=0))
    g, n = est._gold_votes[:, seen].sum(axis=0), est._votes[:, seen].sum(axis=0)
    return seen, np.log((g + 0.5) / (n - g + 0.5))


def test_slope_ridge_holds_every_slope_at_the_pooled_one() -> None:
    """``slope`` penalises the slope alone: a huge one fixes every b_p at 1, the offsets still fit."""
    rng = np.random.default_rng(5)
    a, b = rng.normal(0.0, 0.6, 8), rng.normal(1.0, 0.4, 8)
    env = IAPOEnv(table=_curve_table(a, b, rng.normal(0.0, 1.5, 200)))
    env.reset(seed=0)
    fits = {}
    for slope in (None, 1e6):
        est = PlugInEstimator(env, alpha=32.0, curve=3.0, slope=slope)
        _pull_every_train_query(env, est, 20)
        seen, z = _difficulty(est)
        fits[slope], _ = est._fit_curves(np.arange(8), seen, z, (est.curve, est.slope), est._curves[:8])
    assert np.abs(fits[1e6][:, 1] - 1.0).max() < 0.01
    assert np.abs(fits[None][:, 1] - 1.0).max() > 0.2  # the free slopes do move
    assert np.corrcoef(fits[1e6][:, 0], a)[0, 1] > 0.9


def test_pretest_frees_only_the_slopes_far_from_the_median() -> None:
    """Two prompts of slope 0.2 and 2.5 among six of slope 1: ``pretest`` = 2 keeps the two fitted
    slopes and holds the six at one common slope, the fitted slopes' median (their offsets refitted),
    where the free fit spreads them."""
    rng = np.random.default_rng(6)
    a, b = rng.normal(0.0, 0.5, 8), np.array([0.2, 2.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    env = IAPOEnv(table=_curve_table(a, b, rng.normal(0.0, 1.5, 200)))
    env.reset(seed=0)
    est = PlugInEstimator(env, alpha=32.0, curve=3.0, slope=0.3, pretest=2.0)
    _pull_every_train_query(env, est, 8)
    seen, z = _difficulty(est)
    theta, variance = est._fit_curves(np.arange(8), seen, z, (3.0, 0.3), est._curves)
    held = est._pretest_slopes(np.arange(8), seen, z, 3.0, theta, variance)
    np.testing.assert_array_equal(held[:2], theta[:2])  # far from the median by many SDs: free
    assert abs(theta[0, 1] - 0.2) < 0.3 and abs(theta[1, 1] - 2.5) < 0.6, theta[:2]
    assert np.abs(held[2:, 1] - np.median(theta[:, 1])).max() < 1e-4
    assert np.ptp(theta[2:, 1]) > 0.05  # the free fit spreads them
    assert np.corrcoef(held[2:, 0], a[2:])[0, 1] > 0.9


def test_anytime_rejects_bad_parameters() -> None:
    for bad in ({"n_min": 0}, {"q0": 0}, {"keep_last": 0}, {"growth": 0.0}, {"rate": -1.0}, {"alpha": -1.0},
                {"kappa": -1.0}, {"curve": -1.0}, {"tail": "rounds"}, {"votes": -1}, {"votes": 2.5},
                {"slope": -1.0}, {"eb": -1}, {"eb": 1.5}, {"pretest": -1.0}, {"reserve": -0.1},
                {"reserve": 1.0}, {"tail_growth": 0.0}, {"zprior": -1.0},
                {"revisit": 1.0}, {"revisit": -0.5}, {"revisit_in": "steps"}, {"revisit_by": "spread"},
                {"center": "yes"}, {"center": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            agents.make("plugin_anytime", **bad)
