"""Agents on the arm set (p, N, rule) (``rule_arms``): the rules' block readings against a per-block simulation, the
estimates against the exact ``q_table(split="train", rules=True)``, policies over the enlarged arms, pairing with
the same agent without rules, seeding and the anytime branches."""

from __future__ import annotations

import numpy as np
import pytest

import agents
from agents.estimator import Estimator
from agents.plugin.estimator import PlugInEstimator
from agents.rule_readings import (
    RULE_CAP,
    RuleEstimator,
    best_rule_arms,
    block_readings,
    plugin_rule_values,
    trusted_rule_values,
)
from iapo_gym import IAPOEnv, Policy
from iapo_gym.oracle import expected_cost
from iapo_gym.rules import context_thresholds, sampled_stop
from iapo_gym.tasks.synthetic import random_mv_table
from iapo_gym.utility import mv_credit
from tests.conftest import tiny_bon_table

#: The agents that choose rules with ``rule_arms``; the rest stay on fixed N (docs/agents.md, "Stopping rules").
RULE_AGENTS = ["psst", "psst_topk", "psst_rb", "uniform", "epsilon_greedy", "softmax", "ucb", "auto", "plugin_halving"]
FIXED_ONLY = ["triple_n1", "triple_random_n", "sequential_halving"]


def _mv_table() -> object:
    # context "high" of this table gains 0.017 from the rules on the train split (exact), "low" and "mid" nothing
    return random_mv_table(1, n_prompts=3, n_queries=12, n_answers=3, n_max=10, cost_range=(0.02, 0.06))


def _bon_table() -> object:
    return tiny_bon_table(seed=0, n_max=8)


def _brute_force(table: object, env: IAPOEnv, prompts: np.ndarray, queries: np.ndarray,
                 atoms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``block_readings`` one block, rule and context at a time: ``sampled_stop`` (the env's stopping test) on the
    block, then the credit of the votes drawn, or the best utility drawn."""
    rules = env.rules
    n_pulls, n = atoms.shape
    n_rows = 1 if table.aggregator == "mv" else table.n_contexts
    reward = np.zeros((n_rows, n_pulls, n, len(rules)))
    drawn = np.zeros_like(reward)
    taus, weights = context_thresholds(table, rules)
    for i in range(n_pulls):
        p, q = int(prompts[i]), int(queries[i])
        for k in range(1, n + 1):
            for j in range(n // k):
                block = atoms[i, j * k:(j + 1) * k]
                for r in range(len(rules)):
                    for c in range(n_rows):
                        t = sampled_stop(table, rules, r, c, p, q, block)
                        if table.aggregator == "mv":
                            value = mv_credit(np.bincount(block[:t], minlength=table.n_atoms), table.gold[q])
                        else:
                            value = (table.atoms[p, q] @ weights[c])[block[:t]].max()
                        reward[c, i, k - 1, r] += value
                        drawn[c, i, k - 1, r] += t
    return reward, drawn


@pytest.mark.parametrize("make", [_mv_table, _bon_table])
def test_block_readings_equal_a_per_block_simulation(make) -> None:
    table = make()
    env = IAPOEnv(table=table, split="train", rule_arms=True)
    env.reset(seed=3)
    for n in (1, 5, table.n_max):
        pulls = env.pull(np.arange(6) % table.probs.shape[0], np.full(6, n))
        atoms = pulls.atoms.reshape(6, n)
        got = block_readings(table, env.rules, pulls.prompts, pulls.queries, atoms)
        want = _brute_force(table, env, pulls.prompts, pulls.queries, atoms)
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-12)
        np.testing.assert_array_equal(got[1], want[1])
        if n == table.n_max:  # the rules stop early on some blocks: the readings are not fixed N's
            assert (got[1][..., 1:] < got[1][..., :1]).any()


def _wrong_readings(env: IAPOEnv, q4: np.ndarray) -> dict[str, np.ndarray]:
    """Two readings a bug would give: every rule read as fixed N, and the rules' cost counted at the cap."""
    weight = env.table.context_weights[:, -1, None, None, None]
    spend = expected_cost(env.table, env.queries("train"))
    return {"as fixed N": np.broadcast_to(q4[..., :1], q4.shape),
            "cost at the cap": q4 - weight * spend + weight * spend[..., :1]}


@pytest.mark.parametrize(("make", "tol"), [(_mv_table, 0.02), (_bon_table, 0.04)])  # bon: utilities span about 4
def test_rule_estimator_converges_to_the_exact_rule_q_table(make, tol: float) -> None:
    env = IAPOEnv(table=make(), split="train", rule_arms=True)
    env.reset(seed=0)
    q4 = env.q_table("train", rules=True)
    est = RuleEstimator(env)
    n_prompts, n_max = env.n_prompts, env.n_max
    for _ in range(4):
        est.update(env.pull(np.repeat(np.arange(n_prompts), 2500), np.full(2500 * n_prompts, n_max)))
    got = est.rule_mean()
    assert np.abs(got - q4).max() < tol
    np.testing.assert_array_equal(got[..., 0], Estimator.mean(est))  # rule 0: the estimator's own, bit for bit
    np.testing.assert_array_equal(est.mean(), got[..., 0])  # what the agents explore and trim by: fixed N
    for name, wrong in _wrong_readings(env, q4).items():
        assert np.abs(wrong - q4).max() > 4 * tol, name


def test_plugin_rule_values_converge_to_the_exact_rule_q_table() -> None:
    env = IAPOEnv(table=_mv_table(), split="train", rule_arms=True)
    env.reset(seed=1)
    q4 = env.q_table("train", rules=True)
    est = PlugInEstimator(env)  # auto's defaults
    queries = env.queries("train")
    n_prompts = env.n_prompts
    for _ in range(20):  # 200 completions per (prompt, query) on common queries
        est.update(env.pull(np.repeat(np.arange(n_prompts), queries.size), np.full(n_prompts * queries.size, 10),
                            queries=np.tile(queries, n_prompts)))
    got = plugin_rule_values(est, np.arange(n_prompts))
    np.testing.assert_array_equal(got[..., 0], est.mean())  # rule 0: the fixed-N estimate, unchanged
    tol = 0.03
    assert np.abs(got - q4).max() < tol
    for name, wrong in _wrong_readings(env, q4).items():
        assert np.abs(wrong - q4).max() > 4 * tol, name
    some = plugin_rule_values(est, np.array([2]))  # only where asked
    assert np.isnan(some[:, :2]).all() and np.array_equal(some[:, 2], got[:, 2])


def test_plugin_rule_values_on_best_of_n_stop_at_the_caps_a_prompts_queries_reach() -> None:
    """Best-of-N: a rule has a plug-in value only at caps up to the median number of completions of the prompt's
    seen queries (past them the plug-in maximum of fixed N is biased low, and the rule read too well); fixed N
    keeps every cap."""
    env = IAPOEnv(table=_bon_table(), split="train", rule_arms=True)
    env.reset(seed=3)
    queries = env.queries("train")[:4]
    est = PlugInEstimator(env)
    # prompt 0: 3, 3, 5 and 8 completions on four queries (median 4); prompt 1: 8 on each (N_max)
    est.update(env.pull(np.zeros(4, dtype=np.int64), np.array([3, 3, 5, 8]), queries=queries))
    est.update(env.pull(np.ones(4, dtype=np.int64), np.full(4, 8), queries=queries))
    got = plugin_rule_values(est, np.array([0, 1]))
    np.testing.assert_array_equal(got[..., 0][:, :2], est.mean()[:, :2])  # rule 0: the fixed-N estimate, every cap
    assert np.isfinite(got[:, 0, :4, 1:]).all() and np.isnan(got[:, 0, 4:, 1:]).all()
    assert np.isfinite(got[:, 1, :, 1:]).all()


def test_trusted_rule_values_drop_rules_far_above_the_fixed_n_choice() -> None:
    rng = np.random.default_rng(0)
    values = rng.uniform(0.0, 0.5, size=(2, 3, 10, 4))
    mask = np.ones((2, 3, 10), dtype=bool)
    mask[0, 2] = False  # context 0 may not choose prompt 2
    values[0, 2, 9, 0] = 2.0  # the best fixed arm overall, but masked out in context 0
    values[0, 1, 2, 0] = 1.0  # context 0's best fixed arm among its mask: cap 3
    values[1, 2, 9, 0] = 2.0  # context 1's: cap 10
    values[0, 0, 9, 3] = 5.0  # a rule far above context 0's cap 3: no candidate
    values[0, 0, 4, 1] = 4.0  # a rule at cap 5 <= RULE_CAP x 3: kept
    values[0, 1, :, 2] = np.nan  # no estimate stays none
    got = trusted_rule_values(values, mask)
    np.testing.assert_array_equal(got[..., 0], values[..., 0])  # fixed N unchanged
    limit = int(RULE_CAP * 3)
    assert np.isnan(got[0, :, limit:, 1:]).all()
    np.testing.assert_array_equal(got[0, :, :limit], values[0, :, :limit])
    np.testing.assert_array_equal(got[1], values[1])  # cap 10 is N_max: every rule stays
    policy = best_rule_arms(got, np.random.default_rng(1), mask)
    assert policy.triples[0] == (0, 5, 1) and policy.triples[1] == (2, 10, 0)
    values[0, 0, 4, 1] = 0.0  # without the kept rule, context 0 falls back on its fixed-N best, not the dropped rule
    assert best_rule_arms(trusted_rule_values(values, mask), np.random.default_rng(1), mask).triples[0] == (1, 3, 0)
    nothing = np.full_like(values, np.nan)  # a context without any estimate keeps every cap
    assert np.isnan(trusted_rule_values(nothing, mask)).all()


def _train(name: str, table: object, rule_arms: bool, budget: int, seed: int = 0) -> tuple[Policy, IAPOEnv]:
    env = IAPOEnv(table=table, split="train", rule_arms=rule_arms)
    env.reset(seed=100 + seed)
    return agents.make(name, seed=seed).train(env, budget), env


@pytest.mark.parametrize("name", ["psst", "uniform", "auto", "plugin_halving"])
def test_agents_with_rules_reach_the_optimum_over_rules_at_a_large_budget(name: str) -> None:
    table = _mv_table()
    policy, env = _train(name, table, True, 200_000)
    q4 = env.q_table("train", rules=True)
    chosen = np.array([q4[c, p, n - 1, r] for c, (p, n, r) in enumerate(policy.triples)])
    best_rules, best_fixed = q4.max(axis=(1, 2, 3)), q4[..., 0].max(axis=(1, 2))
    assert (chosen >= best_rules - 0.004).all(), (chosen, best_rules)
    assert (chosen > best_fixed + 0.01).any()  # beyond what fixed N can reach (context "high" gains 0.017)


@pytest.mark.parametrize("make", [_mv_table, _bon_table])
@pytest.mark.parametrize("name", RULE_AGENTS + FIXED_ONLY + ["random"])
def test_policies_over_rules_are_in_range_seeded_and_evaluated(name: str, make) -> None:
    table = make()
    first, env = _train(name, table, True, 3_000, seed=5)
    again, _ = _train(name, table, True, 3_000, seed=5)
    assert first == again and first.to_json() == again.to_json()
    assert len(first.rules) == env.n_contexts
    assert all(0 <= r < len(env.rules) for r in first.rules)
    assert all(0 <= p < env.n_prompts and 1 <= n <= env.n_max for p, n in first.arms)
    if name in FIXED_ONLY:
        assert not first.has_rules
    acr = env.evaluate(first, "train")
    q4 = env.q_table("train", rules=True)
    assert np.isfinite(acr) and acr <= float(np.dot(env.table.context_probs, q4.max(axis=(1, 2, 3)))) + 1e-12


@pytest.mark.parametrize("make", [_mv_table, _bon_table])
@pytest.mark.parametrize("name", RULE_AGENTS)
def test_rules_leave_the_training_pulls_unchanged(name: str, make) -> None:
    # The same seeds draw the same completions with and without rules (the comparison is paired): the env's
    # generator and spend end the same, and only the read-out differs.
    table = make()
    without, env0 = _train(name, table, False, 4_000, seed=2)
    with_rules, env1 = _train(name, table, True, 4_000, seed=2)
    assert not without.has_rules and with_rules.has_rules
    assert env0.budget_used == env1.budget_used
    assert env0.np_random.bit_generator.state == env1.np_random.bit_generator.state
    if name in ("epsilon_greedy", "softmax", "ucb"):  # the arm they return without rules, with its best rule
        assert with_rules.arms == without.arms


@pytest.mark.parametrize("name", ["ucb", "auto"])
def test_anytime_budgets_with_rules_equal_fresh_runs(name: str) -> None:
    table = _mv_table()
    budgets = [500, 1_500, 4_000]
    env = IAPOEnv(table=table, split="train", rule_arms=True)
    env.reset(seed=7)
    together = dict(agents.make(name, seed=1).train_budgets(env, budgets))
    assert any(policy.has_rules for policy in together.values())
    for budget in budgets:
        fresh = IAPOEnv(table=table, split="train", rule_arms=True)
        fresh.reset(seed=7)
        assert agents.make(name, seed=1).train(fresh, budget) == together[budget]


def test_psst_without_stockpiling_forgets_the_rules_readings_too() -> None:
    table = _mv_table()
    env = IAPOEnv(table=table, split="train", rule_arms=True)
    env.reset(seed=4)
    est = RuleEstimator(env)
    est.update(env.pull(np.arange(3), np.full(3, 10)))
    est.reset()
    assert not est.rule_sums.any() and np.isnan(est.rule_mean()).all()
    policy = agents.make("psst", seed=0, stockpile=False).train(env, 3_000)
    assert len(policy.rules) == env.n_contexts and np.isfinite(env.evaluate(policy, "train"))


def test_rule_readings_refuse_per_pull_contexts_and_own_scales() -> None:
    env = IAPOEnv(table=_mv_table(), split="train", rule_arms=True)
    env.reset(seed=0)
    est = RuleEstimator(env)
    pulls = env.pull(np.arange(3), np.full(3, 4))
    with pytest.raises(ValueError, match="every context at every scale"):
        est.update(pulls, contexts=np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="scales='own'"):
        est.update(pulls, scales="own")
    assert not est.counts.any()  # nothing half-added
