"""The plug-in agents (``agents.plugin``): the estimator, plug-in halving and the anytime agent ``auto``."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import agents
from agents.online.served_log import select_pulls
from agents.plugin import PlugInEstimator
from agents.plugin.anytime import read_policy
from agents.plugin.common import QueryStream
from agents.plugin.majority_vote import prior_votes
from iapo_gym import IAPOEnv, OutcomeTable, Policy, Pulls
from tests.conftest import query_shifted_bon_table, shape_bon_table, tiny_bon_table, tiny_mv_table

NAMES = ["plugin_halving", "plugin_anytime", "auto"]


class RecordingEnv(IAPOEnv):
    """An IAPOEnv that keeps every batch of pulls it served."""

    def __init__(self, table: OutcomeTable) -> None:
        super().__init__(table=table)
        self.batches: list[Pulls] = []

    def pull(self, prompts: Any, ns: Any, queries: Any = None) -> Pulls:
        pulls = super().pull(prompts, ns, queries)
        self.batches.append(pulls)
        return pulls


def test_auto_is_plugin_anytime_on_majority_vote() -> None:
    """Same hyper-parameters, and on a majority-vote table the same pulls and policy as ``plugin_anytime``."""
    auto, plugin = agents.make("auto", seed=0), agents.make("plugin_anytime", seed=0)
    assert auto.params() == plugin.params()  # type: ignore[attr-defined]
    runs = []
    for name in ("auto", "plugin_anytime"):
        env = RecordingEnv(BIT_IDENTITY_TABLES["mv"]())
        env.reset(seed=4)
        policy = agents.make(name, seed=1).train(env, 3_000)
        runs.append((policy, np.concatenate([b.atoms for b in env.batches])))
    assert runs[0][0] == runs[1][0] and np.array_equal(runs[0][1], runs[1][1])


def test_auto_halves_for_its_budget_on_best_of_n() -> None:
    """On Best-of-N ``auto`` runs ``plugin_halving``'s rounds (each live prompt min(N_max, b // (8 L)) draws per
    common query, half the live prompts kept per context after each round but the last) read with the blended
    reading: its pulls are ``plugin_halving``'s, and its estimator's readings are the blended ones."""
    from agents.plugin.auto import BON_QUERIES

    table = shape_bon_table(seed=3, n_prompts=8, n_queries=200, n_max=16)
    envs = {}
    for name in ("auto", "plugin_halving:m_min=8"):
        spec = name.split(":")
        env = RecordingEnv(table)
        env.reset(seed=2)
        agent = agents.make(spec[0], seed=6, **({"m_min": BON_QUERIES} if len(spec) > 1 else {}))
        agent.train(env, 6_000)
        envs[name] = (env, agent)
    auto_env, auto = envs["auto"]
    first = auto_env.batches[0]
    assert np.unique(first.prompts).size == 8 and np.all(first.ns == min(16, (6_000 // 4) // (BON_QUERIES * 8)))
    assert auto.last_tail.estimator.bon_reading == "blend"  # type: ignore[attr-defined]
    halving_env = envs["plugin_halving:m_min=8"][0]
    assert np.array_equal(auto_env.batches[0].atoms, halving_env.batches[0].atoms)  # the same first round
    assert auto_env.budget_used <= 6_000


@pytest.mark.parametrize("name", NAMES)
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


@pytest.mark.parametrize("name", NAMES)
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


@pytest.mark.parametrize("name", ["plugin_halving", "plugin_anytime"])
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
    every = np.concatenate([u for u, first in zip(used, first_pass, strict=True) if first])
    assert every.size >= 0.5 * pool
    assert np.unique(every).size == every.size  # no query reused before the split is used up
    assert np.isin(np.concatenate(used), env.queries("train")).all()


def _pull_every_train_query(env: IAPOEnv, est: PlugInEstimator, pulls_per_query: int) -> None:
    """``pulls_per_query`` pulls of N_max completions of every (prompt, train query), in one update."""
    train = env.queries("train")
    prompts = np.repeat(np.arange(env.n_prompts), train.size * pulls_per_query)
    queries = np.tile(np.repeat(train, pulls_per_query), env.n_prompts)
    est.update(env.pull(prompts, np.full(prompts.size, env.n_max), queries=queries))


@pytest.mark.parametrize(("alpha", "curve"), [(0.0, 0.0), (4.0, 0.0), (4.0, 3.0), (32.0, 0.0), (32.0, 3.0)])
def test_plug_in_majority_vote_converges_to_the_exact_train_q_table(alpha: float, curve: float) -> None:
    table = tiny_mv_table(seed=1, n_prompts=4, n_queries=30, n_buckets=3, n_max=6)
    env = IAPOEnv(table=table)
    env.reset(seed=0)
    est = PlugInEstimator(env, alpha=alpha, curve=curve)
    for _ in range(4):  # 4 x 1002 completions of every (prompt, train query), in several updates
        _pull_every_train_query(env, est, 167)
    exact = env.q_table("train")
    assert np.abs(est.mean() - exact).max() < 0.02


def test_prior_votes_recover_the_beta_binomial_concentration() -> None:
    """The majority-vote prior's empirical-Bayes pseudo-votes: a of gold shares Beta(a s, a (1 - s)) around the
    prior shares s is recovered from 8 votes per row; votes that follow s exactly keep the cap, all-or-nothing
    rows (a query every completion gets right or every one gets wrong) give the prior no weight."""
    rng = np.random.default_rng(0)
    rows = 40_000
    share = rng.uniform(0.1, 0.9, rows)
    votes = np.full(rows, 8.0)
    for a in (2.0, 6.0, 20.0):
        theta = rng.beta(a * share, a * (1.0 - share))
        gold = rng.binomial(8, theta).astype(np.float64)
        assert prior_votes(gold, votes, share, cap=1000.0) == pytest.approx(a, rel=0.15), a
        assert prior_votes(gold, votes, share, cap=1.0) == 1.0  # at most the cap
    assert prior_votes(rng.binomial(8, share).astype(np.float64), votes, share, cap=32.0) == 32.0
    assert prior_votes(8.0 * (rng.random(rows) < share), votes, share, cap=32.0) < 0.1
    assert prior_votes(np.ones(rows), np.ones(rows), share, cap=32.0) == 32.0  # no row with two votes


@pytest.mark.parametrize("curve", [0.0, 3.0])
def test_majority_vote_value_is_corrected_by_the_mean_credit_over_every_subset(curve: float,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each prompt's majority-vote value at N is the mean over its s queries of C_q(N) + lam (U_q(m) - C_q(m)),
    m = min(N, n_q): C_q the exact credit of the query's prior-read answer distribution, U_q the mean credit of a
    majority vote over every m-subset of its n_q votes (enumerated here), lam = s / (s + K) and K
    ``CORRECTION_QUERIES`` (set low here, so the correction weighs); queries with fewer votes than N keep the gap
    measured at their votes."""
    from agents.plugin import majority_vote
    from iapo_gym.exact import mv_expected_credit
    from iapo_gym.utility import mv_credit

    monkeypatch.setattr(majority_vote, "CORRECTION_QUERIES", 3.0)
    table = tiny_mv_table(seed=4, n_prompts=3, n_queries=12, n_buckets=3, n_max=6)
    env = IAPOEnv(table=table)
    env.reset(seed=2)
    rng = np.random.default_rng(3)
    est = PlugInEstimator(env, curve=curve)
    train = env.queries("train")
    prompts, queries = np.repeat(np.arange(3), train.size), np.tile(train, 3)
    kept = (prompts != 1) | (queries < train[-3])  # prompt 1 misses three train queries
    for low in (1, 1):  # 2 to 8 votes of a query: some have fewer than N_max
        est.update(env.pull(prompts[kept], rng.integers(low, 5, int(kept.sum())), queries=queries[kept]))
    gold = table.gold
    for p in range(3):
        seen = np.flatnonzero(est.atom_counts[p].sum(axis=1) > 0)
        lam = seen.size / (seen.size + 3.0)
        expected = np.zeros(6)
        for q in seen:
            c = mv_expected_credit(est._probs[p, q][None], gold[q:q + 1], 6)[0]
            votes = np.repeat(np.arange(table.n_atoms), est.atom_counts[p, q])
            u = np.zeros(6)
            for k in range(1, min(6, votes.size) + 1):
                subsets = np.array(list(itertools.combinations(votes.tolist(), k)))
                tallies = np.stack([(subsets == b).sum(axis=1) for b in range(table.n_atoms)], axis=1)
                u[k - 1] = mv_credit(tallies, np.full(len(subsets), gold[q])).mean()
            m = np.minimum(np.arange(6), votes.size - 1)
            expected += c + lam * (u[m] - c[m])
        np.testing.assert_allclose(est.mean()[0, p], expected / seen.size, rtol=0, atol=1e-12)


def test_mv_correction_must_be_a_bool() -> None:
    env = IAPOEnv(table=tiny_mv_table(seed=1, n_prompts=2, n_queries=6, n_buckets=3, n_max=4))
    with pytest.raises(ValueError, match="mv_correction must be True or False, got 'no'"):
        PlugInEstimator(env, mv_correction="no")  # type: ignore[arg-type]


def test_plug_in_majority_vote_gives_a_contradicted_prior_less_weight() -> None:
    """On a table whose (prompt, query) gold shares are all 0 or 1 the response-curve prior explains little:
    after 4 votes per (prompt, train query) the estimate reads each query from its own votes (pseudo-votes
    near 0, not ``alpha``), so the estimated Q is within 0.01 of the train split's at every N."""
    base = tiny_mv_table(seed=3, n_prompts=4, n_queries=200, n_buckets=2, n_max=6)
    rng = np.random.default_rng(1)
    gold_bucket = base.gold
    right = rng.random(base.probs.shape[:2]) < 0.6  # (P, Q) every completion right, or every one wrong
    probs = np.zeros_like(base.probs)
    rows, cols = np.indices(right.shape)
    probs[rows, cols, np.where(right, gold_bucket[None, :], 1 - gold_bucket[None, :])] = 1.0
    env = IAPOEnv(table=dataclasses.replace(base, probs=probs))
    env.reset(seed=0)
    est = PlugInEstimator(env)
    train = env.queries("train")
    prompts = np.repeat(np.arange(env.n_prompts), train.size)
    est.update(env.pull(prompts, np.full(prompts.size, 4), queries=np.tile(train, env.n_prompts)))
    assert np.abs(est.mean() - env.q_table("train")).max() < 0.01


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
    est = PlugInEstimator(env)
    _pull_every_train_query(env, est, 500)
    train = env.queries("train")
    offsets = est.query_offsets()
    for row, w in enumerate(est._objectives):
        expected = shift[train] * w.sum()
        assert np.allclose(offsets[row, train], expected - expected.mean(), atol=0.05)
        assert np.all(offsets[row, env.queries("test")] == 0.0)  # never seen


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


def _whole_steps_and_tail(table: OutcomeTable, budget: int,
                          **params: Any) -> tuple[list[Pulls], list[Pulls], np.ndarray]:
    """The batches of ``auto``'s whole steps and of its tail for ``budget`` (as ``train`` runs them), and
    the prompts live in some context after the steps."""
    env = RecordingEnv(table)
    env.reset(seed=0)
    agent = agents.make("plugin_anytime", seed=0, **params)
    run = agent._new_run(env)  # type: ignore[attr-defined]
    agent._advance(run, budget)  # type: ignore[attr-defined]
    whole = len(env.batches)
    live = np.flatnonzero(run.alive.any(axis=0))
    agent._finish(run, budget)  # type: ignore[attr-defined]
    return env.batches[:whole], env.batches[whole:], live


def test_anytime_steps_do_not_depend_on_the_budget() -> None:
    """The whole steps of a smaller budget are a prefix of a larger one's; its tail is its own."""
    table = tiny_mv_table(n_prompts=8, n_queries=200, n_max=8)
    (small, small_tail, _), (large, _, _) = (_whole_steps_and_tail(table, budget) for budget in (2_000, 6_000))
    assert len(large) > len(small) >= 3
    for a, b in zip(small, large[:len(small)], strict=True):
        assert np.array_equal(a.prompts, b.prompts) and np.array_equal(a.queries, b.queries)
        assert np.array_equal(a.atoms, b.atoms)
    assert not np.array_equal(small_tail[0].queries, large[len(small)].queries)  # the branch: its own tail
    assert sum(p.completions for p in small) <= 1_000  # the whole steps spend at most half of T


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
    for slope in (3.0, 1e6):
        est = PlugInEstimator(env, alpha=32.0, curve=3.0, slope=slope)
        _pull_every_train_query(env, est, 20)
        seen, z = _difficulty(est)
        fits[slope], _ = est._fit_curves(np.arange(8), seen, z, (est.curve, est.slope), est._curves[:8])
    assert np.abs(fits[1e6][:, 1] - 1.0).max() < 0.01
    assert np.abs(fits[3.0][:, 1] - 1.0).max() > 0.2  # the free slopes do move
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
    held = est._pretest_slopes(np.arange(8), seen, z, theta, variance)
    np.testing.assert_array_equal(held[:2], theta[:2])  # far from the median by many SDs: free
    assert abs(theta[0, 1] - 0.2) < 0.3 and abs(theta[1, 1] - 2.5) < 0.6, theta[:2]
    assert np.abs(held[2:, 1] - np.median(theta[:, 1])).max() < 1e-4
    assert np.ptp(theta[2:, 1]) > 0.05  # the free fit spreads them
    assert np.corrcoef(held[2:, 0], a[2:])[0, 1] > 0.9


def test_best_of_n_reads_each_query_s_own_maximum_once_it_has_the_draws() -> None:
    """On queries that differ in the shape of the prompts' score distributions, the pooled (location-scale)
    reading keeps an error no number of draws removes; the per-query reading it is shrunk towards
    converges to the train-split Q, and with few draws per query stays near the pooled one."""
    table = shape_bon_table(seed=1, n_prompts=4, n_queries=30, n_max=16)
    env = IAPOEnv(table=table)
    env.reset(seed=0)
    exact = env.q_table("train")
    shrunk, pooled, light = PlugInEstimator(env), PlugInEstimator(env, bon_prior=1e9), PlugInEstimator(env, bon_prior=0.5)
    few = env.pull(np.repeat(np.arange(4), 24), np.full(96, 2), queries=np.tile(env.queries("train"), 4))
    for est in (shrunk, pooled, light):
        est.update(few)
    # 2 draws per query: the stronger the prior, the nearer the pooled reading
    assert 0 < np.abs(shrunk.mean() - pooled.mean()).max() < np.abs(light.mean() - pooled.mean()).max()
    for _ in range(3):
        train = env.queries("train")
        prompts = np.repeat(np.arange(4), train.size * 100)
        pulls = env.pull(prompts, np.full(prompts.size, 16), queries=np.tile(np.repeat(train, 100), 4))
        shrunk.update(pulls)
        pooled.update(pulls)
    assert np.abs(shrunk.mean() - exact).max() < 0.02
    assert np.abs(pooled.mean() - exact).max() > 0.05


def _ceiling_bon_table(n_queries: int = 120, n_max: int = 32) -> OutcomeTable:
    """Best-of-N, queries all alike: prompt 0's scores stop at a ceiling (0.6), prompts 1-3 have long upper tails."""
    grid = np.linspace(0.0, 1.0, 11)
    bounded = np.where(grid <= 0.6, np.exp(-0.5 * ((grid - 0.55) / 0.15) ** 2), 0.0)
    tailed = [np.exp(-grid / s) for s in (0.15, 0.25, 0.4)]
    probs = np.stack([p / p.sum() for p in [bounded, *tailed]])
    split = np.zeros(n_queries, dtype=np.uint8)
    split[: n_queries // 5] = 1
    return OutcomeTable(
        task="ceiling_bon", aggregator="bon", probs=np.repeat(probs[:, None], n_queries, axis=1),
        atoms=np.broadcast_to(grid[None, None, :, None], (4, n_queries, grid.size, 1)).copy(),
        cost=np.full((4, n_queries), 0.01), n_max=n_max, context_weights=np.array([[1.0, -0.1], [1.0, -1.0]]),
        context_names=("cheap", "dear"), context_probs=np.array([0.5, 0.5]), objective_names=("score",), split=split)


def test_best_of_n_reading_of_a_prompt_read_alone_keeps_its_own_shape() -> None:
    """The tail's last survivor is updated alone: its reading at large N must still follow its own draws. Every
    prompt gets 2 draws on every train query, then prompt 0 alone 12 more on each (few per query against N = 32,
    so the location-scale reading weighs): its estimate at every N stays within 0.03 of the exact train Q (0.02 at
    N = 32), though its scores stop at 0.6 and the query pools it is read through mix in the long tails of prompts
    1-3. A shape taken against the prompts read with it vanishes for a prompt read alone: 0.05 too high at N = 32."""
    env = IAPOEnv(table=_ceiling_bon_table())
    env.reset(seed=0)
    est = PlugInEstimator(env)
    train = env.queries("train")
    est.update(env.pull(np.repeat(np.arange(4), train.size), np.full(4 * train.size, 2), queries=np.tile(train, 4)))
    for _ in range(6):
        est.update(env.pull(np.zeros(train.size, np.int64), np.full(train.size, 2), queries=train))
    error = est.mean()[:, 0] - env.q_table("train")[:, 0]
    assert np.abs(error).max() < 0.03, np.round(error, 3)


def test_best_of_n_correction_carries_past_a_querys_draws() -> None:
    """Every prompt drawn 6 times on each of 480 alike train queries, read at N up to 32: the correction measured
    where a query's draws reach (its sample maximum's gap to the shrunk reading at N = 6) still applies beyond them,
    so the estimates at N = 32 are within 0.08 of the exact train Q on average over the prompts (0.092 when the
    correction stops at N = 6, where a query's draws end: the estimate then bends at N = 6 and reads the large N
    too low against the small)."""
    env = IAPOEnv(table=_ceiling_bon_table(n_queries=600))
    env.reset(seed=0)
    est = PlugInEstimator(env)
    train = env.queries("train")
    est.update(env.pull(np.repeat(np.arange(4), train.size), np.full(4 * train.size, 6), queries=np.tile(train, 4)))
    error = (est.mean() - env.q_table("train"))[:, :, 31]
    assert np.abs(error).mean(axis=1).max() < 0.08, np.round(error, 3)


def test_best_of_n_reading_of_a_prompt_does_not_depend_on_the_prompts_read_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With every prompt drawn on the same queries, a prompt's Best-of-N reading is the same whether it is read
    alone or with the others (its shape is against the pool of every query, not against the prompts read). The
    correction, whose pooled part is read from the prompts read, is weighed 0 here (``CORRECTION_QUERIES`` huge)."""
    from agents.plugin import best_of_n

    monkeypatch.setattr(best_of_n, "CORRECTION_QUERIES", 1e300)
    env = IAPOEnv(table=shape_bon_table(seed=4, n_prompts=5, n_queries=30, n_max=8, n_objectives=2))
    env.reset(seed=0)
    est = PlugInEstimator(env)
    train = env.queries("train")
    rng = np.random.default_rng(1)
    est.update(env.pull(np.repeat(np.arange(5), train.size), rng.integers(1, 6, 5 * train.size),
                        queries=np.tile(train, 5)))
    together = est._bon_value(np.arange(5))
    for p in range(5):
        np.testing.assert_allclose(est._bon_value(np.array([p]))[:, 0], together[:, p], rtol=0, atol=1e-12)


def test_public_readings_draws_and_estimate() -> None:
    """``draws`` counts each (prompt, query)'s completions; ``estimate`` recomputes the Best-of-N estimates from every
    completion: for the prompts of the last update it is what that update stored, bit for bit, while an earlier
    prompt's stored estimate has since moved (the fits over every prompt changed); a prompt that shares no query
    with the reference stays where it is (finite); majority vote is refused."""
    table = shape_bon_table(seed=2, n_prompts=5, n_queries=20, n_max=8, n_objectives=2)
    env = IAPOEnv(table=table)
    env.reset(seed=3)
    rng = np.random.default_rng(0)
    est, counts = PlugInEstimator(env), np.zeros((5, table.n_queries), dtype=np.int64)
    for prompts in (np.array([0, 1, 2, 3, 4] * 6), np.array([1, 3] * 15)):
        queries = rng.choice(env.queries("train"), prompts.size)
        ns = rng.integers(1, 6, prompts.size)
        est.update(env.pull(prompts, ns, queries=queries))
        np.add.at(counts, (prompts, queries), ns)
    assert np.array_equal(est.draws(np.arange(5)), counts)
    assert np.array_equal(est.estimate(np.array([1, 3])), est.mean()[:, [1, 3]])
    seen = est.seen(np.array([0, 2, 4]))
    assert seen.sum(axis=1).argmax() == 2 and not (seen[1] & seen[2]).any()  # 2 shares no query with the reference 4
    later = est.estimate(np.array([0, 2, 4]))
    assert np.isfinite(later).all() and not np.array_equal(later, est.mean()[:, [0, 2, 4]])
    mv = IAPOEnv(table=tiny_mv_table(seed=1))
    with pytest.raises(ValueError, match="aggregator is 'mv'"):
        PlugInEstimator(mv).estimate(np.array([0]))


def test_the_read_out_reads_its_candidates_together_whatever_they_were_updated_with() -> None:
    """The plug-in read-out compares the live prompts under one fit: fed the same completions, an estimator whose
    last update pulled prompts 1 and 3 together and one that pulled 3, then 1 alone, read prompt 1 alike once 1
    is the only candidate (its estimate recomputed over it alone), though their stored estimates of it differ; the
    stored estimates are left as they were."""
    table = shape_bon_table(seed=2, n_prompts=5, n_queries=20, n_max=8, n_objectives=2)
    env = IAPOEnv(table=table)
    env.reset(seed=3)
    rng = np.random.default_rng(0)
    first = env.pull(np.repeat(np.arange(5), 6), rng.integers(1, 6, 30), queries=rng.choice(env.queries("train"), 30))
    last = env.pull(np.array([1, 3] * 15), rng.integers(1, 6, 30), queries=rng.choice(env.queries("train"), 30))
    together, apart = PlugInEstimator(env), PlugInEstimator(env)
    for est, parts in ((together, [last]), (apart, [select_pulls(last, last.prompts == p) for p in (3, 1)])):
        est.update(first)
        for part in parts:
            est.update(part)
    stored = [est.mean().copy() for est in (together, apart)]
    assert np.abs(stored[0][:, 1] - stored[1][:, 1]).max() > 1e-6  # the pooled correction differs
    alive = np.zeros((table.n_contexts, 5), dtype=bool)
    alive[:, 1] = True
    policies = [read_policy(env, est, alive, np.random.default_rng(1)) for est in (together, apart)]
    value = together.estimate(np.array([1]))[:, 0]
    np.testing.assert_allclose(apart.estimate(np.array([1]))[:, 0], value, rtol=0, atol=1e-12)
    assert policies[0] == policies[1]
    assert all(p == 1 and n == int(value[c].argmax()) + 1 for c, (p, n) in enumerate(policies[0].arms))
    assert all(np.array_equal(est.mean(), before) for est, before in zip((together, apart), stored, strict=True))


def test_the_read_out_of_a_context_takes_a_prompt_it_trimmed_that_another_context_kept() -> None:
    """A context's read-out compares every prompt still live in some context, all read on the same completions: the
    first context kept only the prompt read worst there, the others only the one read best; the first context now
    takes the best (the read-out of its own survivors alone would keep the worst), and every context takes the best
    (p, N) of the two read together, never a prompt no context kept."""
    table = shape_bon_table(seed=2, n_prompts=5, n_queries=20, n_max=8, n_objectives=2)
    env = IAPOEnv(table=table)
    env.reset(seed=3)
    queries = np.random.default_rng(0).choice(env.queries("train"), 12, replace=False)
    est = PlugInEstimator(env)
    est.update(env.pull(np.repeat(np.arange(5), 12), np.full(60, 6), queries=np.tile(queries, 5)))
    first = est.mean()[0].max(axis=1)
    worst, best = int(first.argmin()), int(first.argmax())
    pair = np.array([worst, best])
    together = est.estimate(pair)
    assert together[0, 1].max() > together[0, 0].max()  # read together, the first context's order stays
    alive = np.zeros((table.n_contexts, 5), dtype=bool)
    alive[0, worst] = True
    alive[1:, best] = True
    policy = read_policy(env, est, alive, np.random.default_rng(1))
    assert policy.arms[0][0] == best
    for c, (p, n) in enumerate(policy.arms):
        k, at = np.unravel_index(int(together[c].argmax()), together[c].shape)
        assert (p, n) == (int(pair[k]), int(at) + 1)


def test_best_of_n_own_sums_match_a_fresh_recount() -> None:
    """The per-prompt sums of the shrunk own readings, kept by taking back and adding each pulled (prompt,
    query)'s share, equal a fresh estimator's fed the same completions in one update."""
    table = shape_bon_table(seed=2, n_prompts=5, n_queries=20, n_max=8, n_objectives=2)
    env = IAPOEnv(table=table)
    env.reset(seed=3)
    rng = np.random.default_rng(0)
    stepwise, batches = PlugInEstimator(env), []
    for _ in range(6):
        prompts = rng.integers(0, 5, 30)
        pulls = env.pull(prompts, rng.integers(1, 9, 30), queries=rng.choice(env.queries("train"), 30))
        stepwise.update(pulls)
        batches.append(pulls)
    once = PlugInEstimator(env)
    ns = np.concatenate([b.ns for b in batches])
    once.update(Pulls(prompts=np.concatenate([b.prompts for b in batches]), ns=ns,
                      queries=np.concatenate([b.queries for b in batches]),
                      atoms=np.concatenate([b.atoms for b in batches]), offsets=np.concatenate([[0], np.cumsum(ns)])))
    np.testing.assert_allclose(stepwise._own, once._own, atol=1e-9)
    np.testing.assert_allclose(stepwise._own_held, once._own_held, atol=1e-9)
    np.testing.assert_allclose(stepwise.mean(), once.mean(), atol=1e-9)


@pytest.mark.parametrize("bon_prior", [0.0, 1.0, 4.0, 1e12])
def test_best_of_n_weight_matches_a_query_by_query_reading(bon_prior: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each prompt's Best-of-N value is the mean over its s queries of the shrunk reading S_q(N) = R_q + w_q (V_own -
    o_q - R_q), w_q = n_q / (n_q + bon_prior N), R_q the location-scale reading, plus the correction s / (s + K)
    (U_q(m) - o_q - S_q(m)) at m = min(N, n_q), U_q the mean max over the query's m-subsets (PSST's U-statistic:
    the sample maximum at m = n_q) and K ``CORRECTION_QUERIES`` (set low here, so the correction weighs), plus
    the pooled correction (1 - s / (s + K)) S / (S + K) times the mean gap U_q(m) - o_q - S_q(m) over the S queries
    of every prompt read. R is
    held within the outcomes' score range and recomputed query by query with the exact oracle (unbinned): the
    scales' fit, each query's pooled residuals, the pool over every query (a query drawn once stays out of it)
    and each prompt's shrunk shape against that pool. A prompt that saw other queries than the one that saw the
    most (prompt 0 here) is moved by that prompt's value on its own queries less its value on the prompt's."""
    from agents.plugin import best_of_n, location_scale
    from agents.scoring import bon_subset_weights
    from iapo_gym.exact import bon_expected_max

    monkeypatch.setattr(location_scale, "POOL_BINS", 10 ** 6)
    monkeypatch.setattr(best_of_n, "CORRECTION_QUERIES", 3.0)
    table = shape_bon_table(seed=6, n_prompts=4, n_queries=15, n_max=8, n_objectives=2)
    table = dataclasses.replace(table, atoms=np.minimum(table.atoms, 0.5))  # a ceiling the readings meet
    env = IAPOEnv(table=table)
    env.reset(seed=1)
    rng = np.random.default_rng(2)
    est = PlugInEstimator(env, bon_prior=bon_prior)
    train = env.queries("train")
    pairs = np.repeat(np.arange(4), train.size), np.tile(train, 4)
    kept = (pairs[0] != 2) | (pairs[1] < train[-4])  # prompt 2 misses four train queries
    for low in (2, 1):  # up to 16 draws of a query: some have more than N_max
        est.update(env.pull(pairs[0][kept], rng.integers(low, 9, int(kept.sum())), queries=pairs[1][kept]))
    est.update(env.pull(np.array([0]), np.array([1]), queries=env.queries("test")[:1]))  # one draw, one prompt
    value = est._bon_value(np.arange(4))  # (C, P, N)
    level, offsets = est._additive_fit()
    n, counts = est._completions, est.atom_counts
    scale_n = np.arange(1, 9, dtype=np.float64)
    seen_q = np.flatnonzero(n.sum(axis=0) > 0)

    def emax(parts: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        x, w = np.concatenate([v for v, _ in parts]), np.concatenate([c for _, c in parts]).astype(np.float64)
        return bon_expected_max(x[None], w[None] / w.sum(), 8)[0]

    clipped = 0
    for r, objective in enumerate(est._objectives):
        scores = table.atoms @ objective
        low, high = scores.min(), scores.max()  # the outcomes' range (every grid point is an atom)
        resid = {(p, q): table.atoms[p, q] @ objective - level[r, p] - offsets[r, q] for p in range(4) for q in seen_q
                 if n[p, q] > 0}
        ss = np.zeros(n.shape)
        for (p, q), x in resid.items():
            ss[p, q] = (counts[p, q] * x ** 2).sum()
        var_q = np.ones(n.shape[1])
        for _ in range(location_scale.SCALE_SWEEPS):
            var_p = ss.sum(axis=1) / (n @ var_q)
            var_q = (ss.sum(axis=0) + location_scale.LS_PRIOR_DRAWS) / (var_p @ n + location_scale.LS_PRIOR_DRAWS)
        sp, sq = np.sqrt(var_p), np.sqrt(var_q)
        unit = {(p, q): (x / sp[p] / sq[q], counts[p, q]) for (p, q), x in resid.items() if n[:, q].sum() > 1}
        pool = emax(list(unit.values()))
        shape = np.array([emax([u for (pp, _), u in unit.items() if pp == p]) - pool for p in range(4)])
        drawn = n.sum(axis=1)
        shape *= drawn[:, None] / (drawn[:, None] + best_of_n.SHAPE_DRAWS * scale_n)
        own_queries = [[q for q in seen_q if n[p, q] > 0] for p in range(4)]
        values, reached_n = {}, {}  # (prompt, read on whose queries) -> its value; prompt -> its k at each N
        gaps = {}  # (prompt, read on whose queries) -> the sum over the queries of the correction's gap U - S
        for p, on in [(p, p) for p in range(4)] + [(0, p) for p in range(1, 4)]:
            queries = own_queries[on]
            total, gap = np.zeros(8), np.zeros(8)
            k = (n[p, queries][:, None] >= scale_n).sum(axis=0)
            lam_s = len(queries) / (len(queries) + 3.0)
            for q in queries:
                d = n[:, q].sum() - 1.0
                lam = d / (d + location_scale.LS_PRIOR_DRAWS)
                own_pool = emax([(x / sp[pp], counts[pp, q]) for (pp, qq), x in resid.items() if qq == q])
                reading = level[r, p] + sp[p] * (lam * own_pool + (1.0 - lam) * sq[q] * pool + sq[q] * shape[p])
                reading = np.clip(reading + offsets[r, q], low, high) - offsets[r, q]
                clipped += int(np.sum(reading + offsets[r, q] == high))
                own = bon_expected_max((table.atoms[p, q] @ objective)[None], counts[p, q][None] / n[p, q], 8)[0]
                weight = n[p, q] / (n[p, q] + bon_prior * scale_n)
                shrunk = reading + weight * (own - offsets[r, q] - reading)
                draws = np.sort(np.repeat(table.atoms[p, q] @ objective, counts[p, q]))
                m = np.minimum(np.arange(8), draws.size - 1)
                unbiased = draws @ bon_subset_weights(draws.size)  # N = 1..n
                total += shrunk + lam_s * (unbiased[m] - offsets[r, q] - shrunk[m])
                gap += unbiased[m] - offsets[r, q] - shrunk[m]
                if bon_prior == 0.0:
                    np.testing.assert_allclose(weight, 1.0)
            values[p, on], gaps[p, on] = total / len(queries), gap
            if p == on:
                reached_n[p] = k
        # the pooled correction: the mean gap over every read prompt's queries, weighed S / (S + K), of which a
        # value on s queries takes 1 - s / (s + K)
        n_total = sum(len(own_queries[p]) for p in range(4))
        pooled = sum(gaps[p, p] for p in range(4)) / (n_total + 3.0)
        for key in values:
            values[key] = values[key] + 3.0 / (len(own_queries[key[1]]) + 3.0) * pooled
        for p in range(4):
            expected = values[p, p]
            if p != 0:  # prompt 0 saw the most queries: each other prompt moves by its value on its own less on theirs
                expected = expected + values[0, 0] - values[0, p]
            for context in np.flatnonzero(est._objective_row == r):
                np.testing.assert_allclose(value[context, p], expected, atol=1e-10)
        # some queries reach N_max and some do not, for most prompts
        reach_some = sum(bool(k[0] > k[-1] > 0) for k in reached_n.values())
        assert reach_some >= 3
    assert clipped > 0  # some readings pass the top of the range: the clip is checked too


BIT_IDENTITY_TABLES = {
    "mv": lambda: tiny_mv_table(seed=3, n_prompts=8, n_queries=60, n_max=8),
    "bon": lambda: shape_bon_table(seed=3, n_prompts=6, n_queries=40, n_max=16, n_objectives=2),
}


def _budgets_match_separate_runs(table: OutcomeTable, name: str, budgets: list[int]) -> None:
    env = IAPOEnv(table=table)
    separate = []
    for budget in budgets:
        env.reset(seed=11)
        separate.append((agents.make(name, seed=5).train(env, budget), env.budget_used))
    env.reset(seed=11)
    agent = agents.make(name, seed=5)
    assert agent.anytime  # type: ignore[attr-defined]
    shared = list(agent.train_budgets(env, reversed(budgets)))  # type: ignore[attr-defined]
    assert [b for b, _ in shared] == budgets
    assert [p for _, p in shared] == [p for p, _ in separate]
    assert all(used <= b for (_, used), b in zip(separate, budgets, strict=True))
    assert env.budget_used == separate[-1][1]  # the env continues the largest budget's trajectory


@pytest.mark.parametrize(("aggregator", "name"), [("mv", "auto"), ("bon", "auto")])
def test_anytime_train_budgets_is_bit_identical_to_separate_runs(aggregator: str, name: str) -> None:
    _budgets_match_separate_runs(BIT_IDENTITY_TABLES[aggregator](), name, [0, 7, 900, 3_000, 5_000, 10_000])


def test_the_best_of_n_reading_changes_nothing_on_majority_vote_and_the_estimates_on_best_of_n() -> None:
    """``auto``'s blended Best-of-N reading against the location-scale one alone: on a majority-vote table the same
    pulls and policy; on a Best-of-N table its estimates differ."""
    def run(reading: str, table: OutcomeTable) -> tuple[Any, np.ndarray, np.ndarray]:
        env = RecordingEnv(table)
        env.reset(seed=4)
        agent = agents.make("auto", seed=1)
        agent.bon_reading = reading  # type: ignore[attr-defined]
        policy = agent.train(env, 3_000)
        return policy, np.concatenate([b.atoms for b in env.batches]), agent.last_tail.estimator.mean()  # type: ignore[attr-defined]

    assert agents.make("auto").bon_reading == "blend"  # type: ignore[attr-defined]
    mv = BIT_IDENTITY_TABLES["mv"]()
    plain, blend = run("location_scale", mv), run("blend", mv)
    assert plain[0] == blend[0] and np.array_equal(plain[1], blend[1])
    bon = BIT_IDENTITY_TABLES["bon"]()
    assert not np.array_equal(run("location_scale", bon)[2], run("blend", bon)[2])


def test_anytime_train_budgets_is_bit_identical_to_separate_runs_on_math(math_release: Path) -> None:
    from iapo_gym.data.release import read_release

    _budgets_match_separate_runs(read_release(str(math_release))[0], "auto", [0, 7, 900, 3_000, 5_000, 10_000])


def test_anytime_live_prompts_shrink_at_the_documented_pace() -> None:
    table = tiny_mv_table(n_prompts=16, n_queries=400, n_max=8)
    steps, _, _ = _whole_steps_and_tail(table, 8_000, q0=4, rate=1.0)
    s0 = 16 * 4 * 2
    assert steps[0].completions == s0 and np.unique(steps[0].prompts).size == 16
    spent = 0
    for pulls in steps:
        live = np.unique(pulls.prompts).size
        target = 16 if spent <= s0 else max(1, int(np.ceil(16 * s0 / spent)))  # per context
        assert live <= min(16, table.n_contexts * target), (spent, live, target)
        assert spent == 0 or pulls.completions <= spent  # each step at most what was spent before it
        spent += pulls.completions
    assert len(steps) >= 3 and spent <= 4_000


@pytest.mark.parametrize("restore", [0.0, 0.5, 100.0])
def test_anytime_tail_readmits_early_trims_then_halves(restore: float) -> None:
    """The tail first re-admits the prompts trimmed with fewer than restore T / P completions (none with
    0, every one with a large ``restore``), then halves: its live prompts never grow again, end with few
    per context, and the whole run keeps within the budget and spends nearly all of it."""
    table = tiny_mv_table(n_prompts=16, n_queries=400, n_max=8)
    steps, tail, live_steps = _whole_steps_and_tail(table, 5_000, q0=2, rate=0.25, restore=restore)
    live = [np.unique(pulls.prompts).size for pulls in tail]
    assert len(live) >= 2 and all(b <= a for a, b in zip(live[1:-1], live[2:], strict=True)), live
    assert np.isin(live_steps, tail[0].prompts).all()  # re-admission never drops a live prompt
    if restore == 0.0:
        assert live[0] == live_steps.size
    elif restore == 100.0:
        assert live[0] == 16  # every trimmed prompt is back
    assert live[-1] < live[0]
    assert 4_500 <= sum(p.completions for p in steps + tail) <= 5_000


def test_anytime_rejects_bad_parameters() -> None:
    for bad in ({"q0": 0}, {"q0": 2.5}, {"rate": -1.0}, {"alpha": -1.0}, {"kappa": -1.0}, {"curve": -1.0},
                {"pretest": -1.0}, {"bon_prior": -1.0}, {"restore": -0.5}, {"alpha": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            agents.make("plugin_anytime", **bad)
    with pytest.raises(TypeError, match="revisit"):
        agents.make("plugin_anytime", revisit=0.25)  # earlier rounds' options live in the git tag, not here


def test_plugin_halving_rejects_bad_parameters() -> None:
    for bad in ({"m_min": 0}, {"alpha": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            agents.make("plugin_halving", **bad)


def test_auto_has_at_most_eight_documented_hyper_parameters() -> None:
    from agents.plugin import AnytimePlugIn

    params = agents.make("auto").params()  # type: ignore[attr-defined]
    assert len(params) <= 8
    doc = AnytimePlugIn.__doc__ or ""
    for name in params:
        assert doc.count(f":param {name}:") == 1, name


def _binary_mv_table(seed: int) -> OutcomeTable:
    """A right/wrong majority-vote table: prompt p right on query q with sigmoid(a_p + b_p z_q)."""
    rng = np.random.default_rng(seed)
    a, b, z = rng.normal(0.0, 0.8, 4), rng.uniform(0.5, 1.5, 4), rng.normal(0.0, 1.5, 40)
    correct = 1.0 / (1.0 + np.exp(-(a[:, None] + b[:, None] * z[None, :])))
    return OutcomeTable(
        task="binary_mv", aggregator="mv", probs=np.stack([correct, 1 - correct], axis=-1),
        cost=rng.uniform(0.0, 0.02, 4), n_max=8, context_weights=np.array([[1.0, 0.0], [1.0, -1.0]]),
        context_names=("free", "costly"), context_probs=np.array([0.5, 0.5]), objective_names=("correct",),
        gold=np.zeros(40, np.int64), split=(np.arange(40) >= 32).astype(np.uint8),
    )


def _flat_bon_table(seed: int) -> OutcomeTable:
    """Best-of-N with no query structure: every query shares each prompt's distribution."""
    base = tiny_bon_table(seed=seed, n_prompts=4, n_queries=30, n_atoms=5, n_max=8)
    return dataclasses.replace(base, probs=np.repeat(base.probs[:, :1], 30, axis=1),
                               atoms=np.repeat(base.atoms[:, :1], 30, axis=1))


#: One small table of every kind the generated families cover: majority vote (categorical, binary) and
#: Best-of-N whose queries shift the scores, change their shape, or do nothing.
FAMILY_TABLES = {
    "mv_categorical": lambda: tiny_mv_table(seed=2, n_prompts=4, n_queries=40, n_buckets=4, n_max=8),
    "mv_binary": lambda: _binary_mv_table(1),
    "bon_shift": lambda: query_shifted_bon_table()[0],
    "bon_shape": lambda: shape_bon_table(seed=4, n_prompts=4, n_queries=30, n_max=8),
    "bon_flat": lambda: _flat_bon_table(0),
}


@pytest.mark.parametrize("family", sorted(FAMILY_TABLES))
def test_auto_finds_the_train_optimal_policy_where_psst_does(family: str) -> None:
    """Consistency: at a budget where PSST finds the train-optimal policy on every seed, ``auto`` finds a policy of
    the same train value in every context (an arm of the same exact value is as optimal: with two answers and half
    credit for a tie, majority vote of 2k votes is worth exactly what 2k - 1 are)."""
    table = FAMILY_TABLES[family]()
    env = IAPOEnv(table=table)
    best = env.optimal_policy("train")
    q_train = env.q_table("train")
    contexts = np.arange(table.n_contexts)

    def value(policy: Policy) -> np.ndarray:
        arms = np.array(policy.arms)
        return q_train[contexts, arms[:, 0], arms[:, 1] - 1]

    budget = 200_000
    for seed in range(3):
        env.reset(seed=seed)
        assert agents.make("psst", seed=seed).train(env, budget) == best, (family, seed)  # the premise
        env.reset(seed=seed)
        np.testing.assert_allclose(value(agents.make("auto", seed=seed).train(env, budget)), value(best), rtol=0,
                                   atol=1e-12, err_msg=f"{family}, seed {seed}")


def test_binned_pooled_reading_is_within_a_bin_of_the_exact_one() -> None:
    """Once a row has more than ``bins`` outcomes the pooled readings are merged into bins; every expected max
    of N moves by less than one bin width of its row's score range; with fewer outcomes they are exact."""
    from agents.plugin.location_scale import pooled_values

    rng = np.random.default_rng(0)
    sizes = np.array([5000, 300, 1200])
    row = np.repeat(np.arange(3), sizes)
    values = rng.normal(0.0, 1.0, (2, row.size)) * np.array([[1.0], [3.0]])
    counts = rng.integers(1, 5, row.size)
    exact = pooled_values(values, counts, row, 3, 32)
    binned = pooled_values(values, counts, row, 3, 32, bins=1024)
    alone = pooled_values(values[:, 5000:5300], counts[5000:5300], row[5000:5300] - 1, 1, 32, 1024)
    np.testing.assert_allclose(alone, exact[:, 1:2], rtol=0, atol=1e-12)  # 300 outcomes alone: not binned
    assert not np.array_equal(binned, exact)
    for r in range(3):
        span = values[:, row == r].max(axis=1) - values[:, row == r].min(axis=1)
        assert (np.abs(binned[:, r] - exact[:, r]).max(axis=1) < span / 1024).all()


def test_best_of_n_readings_in_blocks_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocking the Best-of-N readings (``BLOCK_ELEMENTS``: here every pair and prompt a block of its own)
    changes the memory they take, not the estimates."""
    from agents.plugin import location_scale

    table = shape_bon_table(seed=4, n_prompts=5, n_queries=20, n_max=8, n_objectives=2)
    rng = np.random.default_rng(1)
    env = IAPOEnv(table=table)
    env.reset(seed=2)
    batches = []
    for _ in range(4):
        prompts = rng.integers(0, 5, 40)
        batches.append(env.pull(prompts, rng.integers(1, 6, 40), queries=rng.choice(env.queries("train"), 40)))

    def means(block_elements: int) -> np.ndarray:
        monkeypatch.setattr(location_scale, "BLOCK_ELEMENTS", block_elements)
        est = PlugInEstimator(env)
        for pulls in batches:
            est.update(pulls)
        return est.mean()

    np.testing.assert_allclose(means(1), means(1 << 30), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("pool_bins", "read"), [(256, [1, 3]), (4, [1, 3]), (8, [1])])
def test_location_scale_of_the_read_prompts_equals_their_rows_of_the_whole(pool_bins: int, read: list[int],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``_location_scale`` for some prompts computes only their shapes and their queries' expected maxima, each
    as among all of them, bit for bit (the choice to bin is the whole set's: with 8 bins prompt 1's few
    outcomes alone would not be binned): the fits, the query readings the prompts use and their shapes equal the
    whole computation's."""
    from agents.plugin import location_scale

    monkeypatch.setattr(location_scale, "POOL_BINS", pool_bins)
    table = shape_bon_table(seed=3, n_prompts=6, n_queries=40, n_max=8, n_objectives=2)
    env = IAPOEnv(table=table)
    env.reset(seed=1)
    rng = np.random.default_rng(2)
    est = PlugInEstimator(env)
    train = env.queries("train")
    assert train.size >= 28
    others = np.array([0, 2, 3, 4, 5])
    for _ in range(3):
        prompts = others[rng.integers(0, 5, 60)]
        est.update(env.pull(prompts, rng.integers(1, 6, 60), queries=rng.choice(train[:20], 60)))
    est.update(env.pull(np.full(4, 1), np.full(4, 2), queries=train[20:24]))  # prompt 1: few outcomes, its own queries
    est.update(env.pull(np.array([3, 3]), np.array([3, 3]), queries=train[20:22]))
    est.update(env.pull(np.full(4, 5), np.full(4, 3), queries=train[24:28]))  # queries only 5 saw
    level, offsets = est._additive_fit()
    whole = est._location_scale(level, offsets, np.arange(6))
    part = est._location_scale(level, offsets, np.array(read))
    for name, a, b in zip(("scale", "spread"), whole[::2], part[::2], strict=True):
        assert np.array_equal(a, b), name
    cols = np.flatnonzero(est._seen[read].any(axis=0))
    assert np.array_equal(part[1][:, cols], whole[1][:, cols])
    assert np.array_equal(part[3][:, read], whole[3][:, read])
    unread = np.setdiff1d(np.arange(6), read)
    assert not part[3][:, unread].any() and whole[3][:, unread].any()  # the others are not computed
    assert not part[1][:, train[24:28]].any() and whole[1][:, train[24:28]].any()


@pytest.mark.heavy
def test_the_threshold_logit_fit_stops_at_the_maximum_in_autos_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/agents.md's constants table: at every update of ``auto``'s training on a level of each Best-of-N family
    the fit's stop (``LOGIT_TOL``) leaves every fitted probability within 2e-6 of where 500 sweeps take it, and it
    is the stop that ends the fit, never the cap of ``LOGIT_SWEEPS`` (at most 33 sweeps on one objective row here)."""
    import gymnasium as gym

    from agents.plugin import threshold_logit
    from agents.plugin._logit_kernels import threshold_fit

    calls: list[tuple[Any, ...]] = []

    def keep(*args: Any) -> Any:
        calls.append(args)
        return threshold_fit(*args)

    monkeypatch.setattr(threshold_logit, "threshold_fit", keep)
    worst, most = 0.0, 0
    for family in ("bon_shift", "bon_shape", "bon_flat", "bon_multi", "bon_mixture", "bon_large_n"):
        env = gym.make("IAPO-Generated-v0", family=family, level=1)
        env.reset(seed=0)
        calls.clear()
        agents.make("auto", seed=0).train(env, 10_000)
        assert calls, family
        for args in calls:
            pp, qq = args[3], args[4]
            for w in range(args[0].shape[0]):
                one = (args[0][w:w + 1], *args[1:8])

                def probs(sweeps: int, tol: float, one: tuple[Any, ...] = one, args: tuple[Any, ...] = args,
                          pp: np.ndarray = pp, qq: np.ndarray = qq) -> np.ndarray:
                    a, b, _, k = threshold_fit(*one, sweeps, *args[9:12], tol)
                    return 1 / (1 + np.exp(-(a[0, pp, :k[0]] + b[0, qq, :k[0]])))
                stopped = probs(args[8], args[12])
                worst = max(worst, float(np.abs(stopped - probs(500, 0.0)).max()))
                most = max(most, next(s for s in range(1, args[8] + 1) if np.array_equal(probs(s, 0.0), stopped)))
    assert worst <= 2e-6 and most < threshold_logit.LOGIT_SWEEPS, (worst, most)


@pytest.mark.heavy
@pytest.mark.parametrize(("name", "bounds"), [("plugin_anytime", (0.004, 0.0015)), ("auto", (0.03, 0.003))])
def test_eight_fit_sweeps_sit_at_the_fixed_point(name: str, bounds: tuple[float, float],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/agents.md's constants table: after training on levels 0-2 of the three Best-of-N tuning families at
    T = 3K and 40K, ``OFFSET_SWEEPS`` = ``SCALE_SWEEPS`` = 8 leave the offsets within ``bounds[0]`` of the largest
    offset, and the scales and spreads within ``bounds[1]`` of the largest, of where 64 sweeps take them: on
    ``plugin_anytime``'s whole steps (every prompt on the same queries, so the offsets are exact after one sweep)
    within 0.4 % and 0.15 %; at ``auto``'s Best-of-N read-out, after its halving (the prompts trimmed early saw
    fewer queries), within 3 % and 0.3 %."""
    import gymnasium as gym

    from agents.plugin import location_scale
    from agents.plugin.anytime import AnytimePlugIn

    seen: list = []
    finish = AnytimePlugIn._finish

    def keep(self: AnytimePlugIn, run: object, budget: int) -> object:
        seen.append(run.est)  # type: ignore[attr-defined]
        return finish(self, run, budget)  # type: ignore[arg-type]

    monkeypatch.setattr(AnytimePlugIn, "_finish", keep)
    worst = {"offsets": 0.0, "scale": 0.0, "spread": 0.0}
    for family in ("bon_shift", "bon_shape", "bon_flat"):
        for level in range(3):
            for budget in (3000, 40000):
                env = gym.make("IAPO-Generated-v0", family=family, level=level)
                env.reset(seed=0)
                seen.clear()
                agent = agents.make(name, seed=0)
                agent.train(env, budget)
                est = seen[-1] if name == "plugin_anytime" else agent.last_tail.estimator  # type: ignore[attr-defined]
                prompts = np.flatnonzero(est._completions.sum(axis=1) > 0)
                fits = {}
                for sweeps in (8, 64):
                    monkeypatch.setattr(location_scale, "OFFSET_SWEEPS", sweeps)
                    monkeypatch.setattr(location_scale, "SCALE_SWEEPS", sweeps)
                    level_fit, offsets = est._additive_fit()
                    scale, _, spread, _ = est._location_scale(level_fit, offsets, prompts)
                    fits[sweeps] = (offsets, scale, spread)
                for key, a, b in zip(("offsets", "scale", "spread"), fits[8], fits[64], strict=True):
                    worst[key] = max(worst[key], float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)))
    assert worst["offsets"] <= bounds[0], worst
    assert worst["scale"] <= bounds[1] and worst["spread"] <= bounds[1], worst


def _threshold_model_table(seed: int, n_prompts: int = 6, n_queries: int = 60, n_max: int = 16) -> OutcomeTable:
    """Best-of-N drawn from the threshold-logit model: six score levels 0, 0.2, .., 1 and P(score > t_k | p, q) =
    sigmoid(a_pk + b_q), a prompt's failure rate and a query's combining on the logit scale. Prompts differ in
    risk: a safe one climbs the levels evenly, a risky one mostly fails or reaches the top."""
    rng = np.random.default_rng(seed)
    grid = np.linspace(0.0, 1.0, 6)
    risk = rng.uniform(0.0, 1.0, n_prompts)[:, None]
    even = np.linspace(2.0, -2.0, 5)
    a = (1.0 - risk) * even + risk * np.r_[-1.0, -1.2, -1.4, -1.6, -1.8] + rng.normal(0.0, 0.3, (n_prompts, 1))
    b = rng.normal(0.0, 1.5, n_queries)
    above = 1.0 / (1.0 + np.exp(-(a[:, None, :] + b[None, :, None])))
    above = np.minimum.accumulate(above, axis=-1)
    probs = -np.diff(np.concatenate([np.ones(above.shape[:2] + (1,)), above, np.zeros(above.shape[:2] + (1,))], -1))
    split = np.zeros(n_queries, dtype=np.uint8)
    split[: n_queries // 5] = 1
    return OutcomeTable(
        task="threshold_bon", aggregator="bon", probs=probs,
        atoms=np.broadcast_to(grid[None, None, :, None], (n_prompts, n_queries, grid.size, 1)).copy(),
        cost=np.full((n_prompts, n_queries), 0.01), n_max=n_max, context_weights=np.array([[1.0, -0.1]]),
        context_names=("cheap",), context_probs=np.array([1.0]), objective_names=("score",), split=split)


def _location_scale_table(seed: int, n_prompts: int = 6, n_queries: int = 60, n_max: int = 16) -> OutcomeTable:
    """Best-of-N drawn from the location-scale model: score = level_p + o_q + scale_p e, e on a skewed seven-point
    grid shared by every (prompt, query), the query offsets o_q large against the spreads."""
    rng = np.random.default_rng(seed)
    e = np.array([-1.0, -0.6, -0.3, 0.0, 0.4, 1.0, 2.0])
    pe = np.array([0.1, 0.2, 0.25, 0.2, 0.12, 0.08, 0.05])
    level, scale = rng.normal(0.0, 0.3, n_prompts), rng.uniform(0.3, 1.0, n_prompts)
    offsets = rng.normal(0.0, 1.5, n_queries)
    atoms = level[:, None, None] + offsets[None, :, None] + scale[:, None, None] * e
    split = np.zeros(n_queries, dtype=np.uint8)
    split[: n_queries // 5] = 1
    return OutcomeTable(
        task="location_scale_bon", aggregator="bon", probs=np.broadcast_to(pe, atoms.shape).copy(),
        atoms=atoms[..., None], cost=np.full((n_prompts, n_queries), 0.01), n_max=n_max,
        context_weights=np.array([[1.0, -0.1]]), context_names=("cheap",), context_probs=np.array([1.0]),
        objective_names=("score",), split=split)


def _blend_after_equal_draws(table: OutcomeTable, draws: int, seed: int = 0) -> PlugInEstimator:
    """A blending estimator after every prompt drew ``draws`` completions on every train query."""
    env = IAPOEnv(table=table)
    env.reset(seed=seed)
    est = PlugInEstimator(env, bon_reading="blend")
    train = env.queries("train")
    n_prompts = table.probs.shape[0]
    est.update(env.pull(np.repeat(np.arange(n_prompts), train.size), np.full(n_prompts * train.size, draws),
                        queries=np.tile(train, n_prompts)))
    return est


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_blend_weight_picks_the_model_the_table_was_drawn_from(seed: int) -> None:
    """The blend weight is the least-squares weight of the threshold-logit reading in predicting how the unbiased
    readings rise with N: near 1 on a table drawn from the threshold-logit model, near 0 on one drawn from the
    location-scale model (12 prompts, each drawn 16 times on each of 48 train queries; with fewer draws the
    threshold-logit fit's own noise keeps its weight lower, 0.25-0.8 at 6 prompts and 6 draws)."""
    logit = _blend_after_equal_draws(_threshold_model_table(seed, n_prompts=12), 16).blend_weight
    location_scale = _blend_after_equal_draws(_location_scale_table(seed, n_prompts=12), 16).blend_weight
    assert logit.min() > 0.7 and location_scale.max() < 0.1, (logit, location_scale)


def test_blended_reading_is_closer_on_a_threshold_model_table() -> None:
    """On tables drawn from the threshold-logit model, with 3 draws per (prompt, query), the blended estimate at
    N_max is closer to the exact train Q than the location-scale one (mean absolute error over prompts and 6 tables)."""
    errors = {"location_scale": [], "blend": []}
    for seed in range(6):
        table = _threshold_model_table(seed)
        for reading in errors:
            env = IAPOEnv(table=table)
            env.reset(seed=seed)
            est = PlugInEstimator(env, bon_reading=reading)
            train = env.queries("train")
            est.update(env.pull(np.repeat(np.arange(6), train.size), np.full(6 * train.size, 3),
                                queries=np.tile(train, 6)))
            errors[reading].append(np.abs(est.mean()[0, :, -1] - env.q_table("train")[0, :, -1]).mean())
    assert np.mean(errors["blend"]) < 0.7 * np.mean(errors["location_scale"]), errors


def test_blended_value_is_the_location_scale_one_moved_by_the_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blend enters every place the location-scale reading R does (the shrunk readings, the correction and the
    move onto the reference's queries), so the value is affine in the weight alpha: at alpha = 0 it is the
    location-scale estimator's bit for bit, at 0.5 the mean of the values at 0 and 1. With no own reading, no
    correction and every prompt on the same queries, the value at alpha = 1 is the mean over the prompt's queries of
    the threshold-logit reading less the query offset."""
    from agents.plugin import best_of_n, threshold_logit
    from agents.plugin._logit_kernels import threshold_readings

    table = shape_bon_table(seed=6, n_prompts=4, n_queries=15, n_max=8, n_objectives=2)
    rng = np.random.default_rng(2)
    env = IAPOEnv(table=table)
    env.reset(seed=1)
    train = env.queries("train")
    pairs = np.repeat(np.arange(4), train.size), np.tile(train, 4)
    kept = (pairs[0] != 2) | (pairs[1] < train[-4])  # prompt 2 misses four train queries: it is moved
    batches = [env.pull(pairs[0][kept], rng.integers(1, 9, int(kept.sum())), queries=pairs[1][kept]) for _ in range(2)]

    def value(alpha: float | None, reading: str = "blend", same_queries: bool = False
              ) -> tuple[np.ndarray, PlugInEstimator]:
        if alpha is not None:
            monkeypatch.setattr(threshold_logit.ThresholdLogitFit, "_blend_weight",
                                lambda self, *args: np.full(self._objectives.shape[0], alpha))
        est = PlugInEstimator(env, bon_reading=reading, bon_prior=1e12 if same_queries else 1.0)
        for pulls in batches:
            if same_queries:  # prompts 0, 1 and 3 only, which saw every train query
                keep = pulls.prompts != 2
                pulls = Pulls.of(pulls.prompts[keep], pulls.ns[keep], pulls.queries[keep],
                                 pulls.atoms[np.repeat(keep, pulls.ns)])
            est.update(pulls)
        return est._bon_value(np.array([0, 1, 3]) if same_queries else np.arange(4)), est

    plain, _ = value(None, "location_scale")
    none, _ = value(0.0)
    half, _ = value(0.5)
    full, _ = value(1.0)
    assert np.array_equal(plain, none)
    assert np.abs(full - none).max() > 1e-3
    np.testing.assert_allclose(half, (none + full) / 2, rtol=0, atol=1e-12)

    monkeypatch.setattr(best_of_n, "CORRECTION_QUERIES", 1e300)
    logit_only, est = value(1.0, same_queries=True)
    prompts, cols = np.array([0, 1, 3]), np.flatnonzero(est._seen[0])
    readings = threshold_readings(est._threshold_fit(), prompts, cols, est._seen[prompts][:, cols], 8)
    offsets = est._additive_fit()[1][:, cols]
    expected = (readings - offsets[:, None, :, None]).mean(axis=2)[est._objective_row]
    np.testing.assert_allclose(logit_only, expected, rtol=0, atol=1e-9)


def test_estimator_rejects_an_unknown_best_of_n_reading() -> None:
    env = IAPOEnv(table=tiny_bon_table())
    with pytest.raises(ValueError, match=r"bon_reading must be one of 'location_scale', 'blend', got 'logit'"):
        PlugInEstimator(env, bon_reading="logit")
