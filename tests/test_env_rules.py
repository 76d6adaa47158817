"""``IAPOEnv.step((p, N, r))``: completions drawn under a stopping rule, against the exact expectations
(``q_table(split, rules=True)``, ``expected_drawn``), fixed N bit for bit as before, the budget and bad rules."""

from __future__ import annotations

import hashlib
import json

import gymnasium as gym
import numpy as np
import pytest

import iapo_gym  # noqa: F401  (registers the envs)
from iapo_gym import Policy
from iapo_gym.env import IAPOEnv
from iapo_gym.oracle import greedy_policy, monte_carlo_acr, policy_arms
from iapo_gym.policy import PolicyError
from iapo_gym.rules import FixedN, context_thresholds, sampled_stop
from iapo_gym.tasks.generated import level_table
from iapo_gym.wrappers import CompletionBudget
from tests.conftest import tiny_bon_table, tiny_mv_table
from tests.test_source import ReplaySource, schema_of

# sha256 of the 12 steps of ``_fixed_n_record`` recorded with the step of before stopping rules (commit c16c917)
BEFORE_RULES = {"mv": "84a1e7248836ae4b087f984cb778ce887af58efdd88a493c7f36d34edae6b16b",
                "bon": "df6f1d813adf788a900e4fb0bc1153fb99c93404444eb78e825adce8143f7767"}


def _fixed_n_record(make, with_rule: bool) -> str:
    env = IAPOEnv(table=make())
    env.reset(seed=11)
    steps = []
    for i in range(12):
        env.reset()
        action = (i % 3, 1 + i % 6, 0) if with_rule else (i % 3, 1 + i % 6)
        _, reward, _, _, info = env.step(action)
        assert info["drawn"] == 1 + i % 6 and info["rule"] == 0
        steps.append((float(reward).hex(), info["query"], info["outcomes"].tolist(), info["cost"].tolist(),
                      info["budget_used"], info["context"]))
    return hashlib.sha256(json.dumps(steps).encode()).hexdigest()


@pytest.mark.parametrize(("name", "make"), [("mv", tiny_mv_table), ("bon", tiny_bon_table)])
def test_pair_and_rule_zero_are_the_step_of_before_rules_bit_for_bit(name: str, make) -> None:
    assert _fixed_n_record(make, with_rule=False) == BEFORE_RULES[name]
    assert _fixed_n_record(make, with_rule=True) == BEFORE_RULES[name]


def _sampled(env: IAPOEnv, context: int, p: int, n: int, r: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    rewards, drawn = np.empty(steps), np.empty(steps)
    for i in range(steps):
        env.reset(options={"context": context})
        _, rewards[i], _, _, info = env.step((p, n, r))
        drawn[i] = info["drawn"]
    return rewards, drawn


@pytest.mark.parametrize(("family", "level", "p", "steps"), [("mv_categorical", 1, 0, 1200), ("bon_shape", 1, 3, 1000)])
def test_sampled_rule_steps_match_the_exact_expectations(family: str, level: int, p: int, steps: int) -> None:
    # mv_categorical 1: 10 answers, N_max 10, 3 contexts; bon_shape 1: 7 contexts of distinct objective weights (tau
    # per context), N_max 10
    env = IAPOEnv(table=level_table(family, level), split="test")
    q, expected = env.q_table("test", rules=True), env.expected_drawn("test")
    n = env.n_max
    env.reset(seed=2026)
    z2, stopped_early = [], 0
    for c in range(env.n_contexts):
        for r in range(len(env.rules)):
            rewards, drawn = _sampled(env, c, p, n, r, steps)
            for values, exact in ((rewards, q[c, p, n - 1, r]), (drawn, expected[c, p, n - 1, r])):
                se = values.std(ddof=1) / np.sqrt(steps)
                if se == 0:
                    assert values.mean() == pytest.approx(exact, abs=1e-9), (c, r)
                    continue
                z = (values.mean() - exact) / se
                assert abs(z) < 4.5, (c, env.rules[r], values.mean(), exact, se)
                z2.append(z * z)
            stopped_early += int(drawn.mean() < n - 1)
    assert np.mean(z2) < 2.5  # no bias shared by the (context, rule) cells: E[z^2] = 1
    assert stopped_early >= env.n_contexts  # the rules do stop before the cap (not a check of fixed N only)


def test_a_rule_step_returns_and_charges_only_the_drawn_completions() -> None:
    env = IAPOEnv(table=level_table("mv_categorical", 1), split="test")
    env.reset(seed=5, options={"context": 1})
    before = env.completions_drawn
    fewer = 0
    for _ in range(60):
        env.reset(options={"context": 1})
        used = env.budget_used
        _, reward, _, _, info = env.step((0, env.n_max, 1))  # margin(m=2), cap N_max
        k = info["drawn"]
        assert 1 <= k <= env.n_max and env.budget_used - used == k
        assert info["outcomes"].shape == (k, 2) and info["cost"].shape == (k,)
        fewer += k < env.n_max
        buckets = info["outcomes"][:, 0]
        counts = np.bincount(buckets, minlength=env.table.n_atoms)
        top = np.sort(counts)[-2:]
        if k < env.n_max:  # stopped: the leader is 2 ahead for the first time at the k-th completion
            assert top[1] - top[0] == 2
            for j in range(1, k):
                head = np.sort(np.bincount(buckets[:j], minlength=env.table.n_atoms))[-2:]
                assert head[1] - head[0] < 2
        w = env.table.context_weights[1]
        leader = counts == counts.max()
        credit = leader[env.table.gold[info["query"]]] / leader.sum()
        assert reward == pytest.approx(w[0] * credit + w[-1] * info["cost"].sum(), abs=1e-12)
    assert fewer > 0
    assert env.completions_drawn - before == env.budget_used


def test_best_of_n_rule_step_stops_at_the_first_completion_reaching_tau_and_returns_the_best_seen() -> None:
    env = IAPOEnv(table=level_table("bon_shape", 0), split="test")
    taus, weights = context_thresholds(env.table)
    env.reset(seed=3)
    for _ in range(80):
        env.reset()
        c = env.context
        _, reward, _, _, info = env.step((3, env.n_max, 2))  # threshold(q=0.75)
        scores = info["outcomes"] @ weights[c]
        hits = scores >= taus[c, 2]
        k = info["drawn"]
        assert not hits[:-1].any() and (hits[-1] or k == env.n_max)
        w = env.table.context_weights[c]
        assert reward == pytest.approx(scores.max() + w[-1] * info["cost"].sum(), abs=1e-12)


def test_same_seed_same_rule_steps_and_other_seeds_differ() -> None:
    def run(seed: int) -> list[tuple[float, int, int]]:
        env = IAPOEnv(table=tiny_mv_table())
        env.reset(seed=seed)
        out = []
        for i in range(150):
            env.reset()
            _, reward, _, _, info = env.step((i % 3, 6, i % 6))
            out.append((float(reward), info["query"], info["drawn"]))
        return out

    assert run(4) == run(4)
    assert run(4) != run(5)


def test_rule_action_space_and_a_numpy_triple() -> None:
    env = IAPOEnv(table=tiny_bon_table())
    space = env.rule_action_space
    assert [s.n for s in space.spaces] == [env.n_prompts, env.n_max, len(env.rules)]
    assert env.action_space.spaces == space.spaces[:2]  # the declared space is still the pair
    env.reset(seed=1)
    a = env.step(np.array([1, 5, 3]))[4]
    env.reset(seed=1)
    b = env.step((1, 5, 3))[4]
    assert a["drawn"] == b["drawn"] and a["query"] == b["query"] and a["rule"] == 3
    made = gym.make("IAPO-Generated-v0", family="bon_shape", level=1)  # through gym.make's checking wrappers
    made.reset(seed=0)
    assert 1 <= made.step((1, 5, 3))[4]["drawn"] <= 5


def test_completion_budget_spends_what_a_rule_step_drew() -> None:
    env = CompletionBudget(IAPOEnv(table=level_table("mv_categorical", 1), split="test"), budget=60)
    env.reset(seed=9, options={"context": 0})
    spent = 0
    while True:
        env.reset(options={"context": 0})
        _, _, _, truncated, info = env.step((0, 10, 1))
        if info["budget_refused"]:
            assert env.remaining < 10  # refused only when the cap does not fit
            break
        spent += info["drawn"]
        assert info["budget_spent"] == spent == env.unwrapped.budget_used
    assert spent <= 60


def test_a_source_without_outcome_distributions_refuses_rules_before_drawing() -> None:
    table = tiny_mv_table()
    source = ReplaySource(table.n_atoms)
    env = IAPOEnv(table=schema_of(table), source=source)
    env.reset(seed=0)
    with pytest.raises(NotImplementedError, match="ReplaySource draws fixed N only"):
        env.step((0, 3, 1))
    assert source.used == 0 and env.budget_used == 0
    assert env.step((0, 3, 0))[4]["drawn"] == 3


def test_sampled_stop_of_fixed_n_and_a_margin_on_written_sequences() -> None:
    table = tiny_mv_table()
    rules = (FixedN(), *IAPOEnv(table=table).rules[1:])
    seq = np.array([1, 1, 0, 1, 2, 2])  # after k draws the lead is 1, 2, 1, 2, 2, 1
    assert sampled_stop(table, rules, 0, 0, 0, 0, seq) == 6
    assert sampled_stop(table, rules, 1, 0, 0, 0, seq) == 2  # margin(m=2)
    assert sampled_stop(table, rules, 2, 0, 0, 0, seq) == 6  # margin(m=3): never 3 ahead
    assert sampled_stop(table, rules, 1, 0, 0, 0, seq[:1]) == 1


def test_rule_arms_env_declares_the_triple_space_and_its_greedy_rule_policy_scores_the_enlarged_optimum() -> None:
    plain = gym.make("IAPO-Generated-v0", family="mv_categorical", level=1)
    made = gym.make("IAPO-Generated-v0", family="mv_categorical", level=1, rule_arms=True)
    env = made.unwrapped
    assert env.rule_arms and not plain.unwrapped.rule_arms
    assert [s.n for s in env.action_space.spaces] == [env.n_prompts, env.n_max, len(env.rules)]
    assert [s.n for s in plain.unwrapped.action_space.spaces] == [env.n_prompts, env.n_max]
    made.reset(seed=3)
    assert made.step((0, 4, 1))[4]["rule"] == 1  # gym.make's checker accepts the declared triple
    q4 = env.q_table("test", rules=True)
    policy = greedy_policy(q4)
    best = q4.reshape(env.n_contexts, -1).max(axis=1)
    assert env.evaluate(policy) == pytest.approx(float(best @ env.table.context_probs), abs=1e-12)
    for c, (p, n, r) in enumerate(policy.triples):
        assert q4[c, p, n - 1, r] == best[c]
    fixed = greedy_policy(q4[..., 0])  # the paper's arms: rule 0 everywhere, the Q-table without rules
    assert not fixed.has_rules and env.evaluate(fixed) == env.evaluate(greedy_policy(env.q_table("test")))
    assert env.evaluate(policy) >= env.evaluate(fixed)
    with pytest.raises(ValueError, match="rule_arms must be True or False, got 'yes'"):
        IAPOEnv(table=tiny_mv_table(), rule_arms="yes")  # type: ignore[arg-type]


def test_policy_rules_round_trip_json_and_are_refused_out_of_range() -> None:
    table = tiny_mv_table()
    pairs = Policy(((0, 2), (1, 3)))
    assert pairs.rules == (0, 0) and pairs.to_json() == '{"arms": [[0, 2], [1, 3]]}'  # the paper's JSON, unchanged
    ruled = Policy(((0, 2, 0), (1, 3, 2)))
    assert ruled == Policy(((0, 2), (1, 3)), (0, 2)) and ruled.rule(1) == 2 and ruled.has_rules
    assert Policy.from_json(ruled.to_json()) == ruled
    with pytest.raises(PolicyError, match="field 'rules' must be a list of 2 rule indices"):
        Policy.from_json('{"arms": [[0, 2], [1, 3]], "rules": [0]}')
    with pytest.raises(ValueError, match="policy rule for context 1 must be an integer >= 0, got -1"):
        Policy(((0, 2), (1, 3)), (0, -1))
    n_rules = len(IAPOEnv(table=table).rules)
    bad = Policy(tuple((0, 1, n_rules) for _ in range(table.n_contexts)))
    with pytest.raises(ValueError, match=rf"x rules \[0, {n_rules}\)"):
        policy_arms(bad, table)
    assert policy_arms(Policy(tuple((0, 1) for _ in range(table.n_contexts))), table).shape == (table.n_contexts, 2)
    with pytest.raises(ValueError, match="sampled by env.step"):
        monte_carlo_acr(table, Policy(tuple((0, 2, 1) for _ in range(table.n_contexts))), None, 10,
                        np.random.default_rng(0))
