"""Stopping rules (``iapo_gym.rules``): exact expectations against enumeration of every draw sequence, against
Monte Carlo, and fixed N against today's exact kernels and Q-table."""

from __future__ import annotations

import itertools

import gymnasium as gym
import numpy as np
import pytest
from scipy.stats import beta

import iapo_gym  # noqa: F401  (registers the envs)
from iapo_gym.exact import bon_weighted_max, mv_expected_credit, objective_rows
from iapo_gym.oracle import expected_cost, expected_drawn, q_table
from iapo_gym.rules import (
    BON_RULES,
    MV_RULES,
    FixedN,
    Margin,
    Posterior,
    Threshold,
    bon_rule_expectations,
    default_rules,
    mv_rule_expectations,
    rule_expectations,
    rule_label,
    thresholds,
)
from iapo_gym.tasks.generated import level_table
from iapo_gym.utility import mv_credit


def _stops(rule, counts: list[int]) -> bool:
    """The rule's stopping test, written out: top two counts, then the rule's definition (scipy's Beta for the
    posterior rule)."""
    v2, v1 = sorted([*counts, 0])[-2:]
    if isinstance(rule, Margin):
        return v1 - v2 >= rule.m
    if isinstance(rule, Posterior):
        return bool(beta.sf(0.5, v1 + 1, v2 + 1) >= rule.level)
    return False


def _enumerate_mv(probs: np.ndarray, gold: int, cap: int, rule) -> tuple[float, float]:
    """Expected credit and draws of one row by walking every sequence of ``cap`` answers."""
    credit = drawn = 0.0
    for seq in itertools.product(range(probs.size), repeat=cap):
        weight = float(np.prod(probs[list(seq)]))
        counts = [0] * probs.size
        n = cap
        for i, a in enumerate(seq):
            counts[a] += 1
            if _stops(rule, counts):
                n = i + 1
                break
        credit += weight * float(mv_credit(np.array(counts), np.array(gold)))
        drawn += weight * n
    return credit, drawn


TINY_MV_RULES = (FixedN(), Margin(1), Margin(2), Margin(3), Margin(6), Posterior(0.6), Posterior(0.95))


def test_majority_vote_matches_enumeration_of_every_sequence():
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.ones(3), size=7)
    probs[1] = [0.5, 0.5, 0.0]  # a wrong answer that never comes out
    probs[2] = [0.0, 0.3, 0.7]  # gold never comes out: credit 0, draws still matter
    probs[3] = [1.0, 0.0, 0.0]  # one answer only
    probs[4] = [0.25, 0.5, 0.25]  # ties of wrong answers
    gold = np.array([0, 1, 0, 0, 2, 1, 2])
    credit, drawn = mv_rule_expectations(probs, gold, 5, TINY_MV_RULES)
    assert credit.shape == drawn.shape == (7, 5, len(TINY_MV_RULES))
    for r in range(7):
        for cap in range(1, 6):
            for j, rule in enumerate(TINY_MV_RULES):
                want_credit, want_drawn = _enumerate_mv(probs[r], int(gold[r]), cap, rule)
                assert credit[r, cap - 1, j] == pytest.approx(want_credit, abs=1e-12), (r, cap, rule)
                assert drawn[r, cap - 1, j] == pytest.approx(want_drawn, abs=1e-12), (r, cap, rule)


def test_majority_vote_with_more_answers_matches_enumeration():
    """B = 5 (four wrong answers, some equal): the orbit sums over the wrong answers' permutations."""
    probs = np.array([[0.3, 0.2, 0.2, 0.15, 0.15], [0.1, 0.4, 0.1, 0.3, 0.1]])
    gold = np.array([0, 3])
    rules = (FixedN(), Margin(2), Posterior(0.9))
    credit, drawn = mv_rule_expectations(probs, gold, 4, rules)
    for r in range(2):
        for cap in range(1, 5):
            for j, rule in enumerate(rules):
                want_credit, want_drawn = _enumerate_mv(probs[r], int(gold[r]), cap, rule)
                assert credit[r, cap - 1, j] == pytest.approx(want_credit, abs=1e-12)
                assert drawn[r, cap - 1, j] == pytest.approx(want_drawn, abs=1e-12)


def _enumerate_bon(scores: np.ndarray, probs: np.ndarray, cap: int, tau: float) -> tuple[float, float]:
    """Expected best score seen and draws of one row by walking every sequence of ``cap`` completions."""
    reward = drawn = 0.0
    for seq in itertools.product(range(scores.size), repeat=cap):
        weight = float(np.prod(probs[list(seq)]))
        best, n = -np.inf, cap
        for i, a in enumerate(seq):
            best = max(best, scores[a])
            if scores[a] >= tau:
                n = i + 1
                break
        reward += weight * best
        drawn += weight * n
    return reward, drawn


def test_best_of_n_matches_enumeration_of_every_sequence():
    rng = np.random.default_rng(3)
    atoms = rng.random((2, 3, 3, 2))
    probs = rng.dirichlet(np.ones(3), size=(2, 3))
    probs[0, 1] = [0.6, 0.4, 0.0]
    probs[1, 2] = [0.0, 0.0, 1.0]
    weights = np.array([[0.3, 0.7], [1.0, 0.0]])
    rules = (FixedN(), Threshold(0.0), Threshold(0.5), Threshold(0.9), Threshold(1.0))
    taus = thresholds(atoms, probs, weights, rules)
    reward, drawn = bon_rule_expectations(atoms, probs, weights, 5, rules)
    assert reward.shape == drawn.shape == (2, 2, 3, 5, len(rules))
    for c in range(2):
        for p, q in itertools.product(range(2), range(3)):
            scores = atoms[p, q] @ weights[c]
            for cap in range(1, 6):
                for j in range(len(rules)):
                    want_reward, want_drawn = _enumerate_bon(scores, probs[p, q], cap, taus[c, j])
                    assert reward[c, p, q, cap - 1, j] == pytest.approx(want_reward, abs=1e-12)
                    assert drawn[c, p, q, cap - 1, j] == pytest.approx(want_drawn, abs=1e-12)


def test_thresholds_are_quantiles_of_the_contexts_atoms():
    rng = np.random.default_rng(5)
    atoms = rng.random((2, 4, 6, 2))
    probs = rng.dirichlet(np.ones(6), size=(2, 4))
    probs[0, 0, :3] = 0.0  # cells of zero probability are no atoms of the context
    weights = np.array([[0.5, 0.5], [0.9, 0.1]])
    taus = thresholds(atoms, probs, weights, (FixedN(), Threshold(0.0), Threshold(0.5), Threshold(1.0)))
    assert np.isinf(taus[:, 0]).all()
    for c in range(2):
        values = np.sort((atoms @ weights[c])[probs > 0])
        assert taus[c, 1] == values[0] and taus[c, 3] == values[-1]
        assert np.mean(values <= taus[c, 2]) >= 0.5 > np.mean(values < taus[c, 2])


def test_posterior_rule_is_the_beta_tail():
    from iapo_gym.rules import _posterior_stops

    for level in (0.6, 0.95, 0.99):
        table = _posterior_stops(level, 20)
        for v1 in range(21):
            for v2 in range(min(v1, 20 - v1) + 1):
                tail = beta.sf(0.5, v1 + 1, v2 + 1)
                if abs(tail - level) > 1e-9:
                    assert table[v1, v2] == (tail >= level), (level, v1, v2)


def _monte_carlo_mv(probs: np.ndarray, gold: int, n_max: int, rule, n_seq: int,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean and standard error of credit and draws for caps 1..n_max from ``n_seq`` simulated sequences."""
    draws = rng.choice(probs.size, size=(n_seq, n_max), p=probs)
    counts = np.cumsum(np.eye(probs.size, dtype=np.int64)[draws], axis=1)  # (S, n_max, B)
    top2 = np.sort(counts, axis=2)[:, :, -2:]
    v1, v2 = top2[:, :, 1], top2[:, :, 0]
    if isinstance(rule, Margin):
        stop = v1 - v2 >= rule.m
    else:
        grid = np.arange(n_max + 1)
        stop = (beta.sf(0.5, grid[:, None] + 1, grid[None, :] + 1) >= rule.level)[v1, v2]
    first = np.where(stop.any(axis=1), stop.argmax(axis=1) + 1, n_max + 1)
    credit_at = mv_credit(counts, np.full(counts.shape[:2], gold))  # (S, n_max): the credit after each draw
    credit_mean, credit_se, drawn_mean, drawn_se = (np.empty(n_max) for _ in range(4))
    for cap in range(1, n_max + 1):
        n = np.minimum(first, cap)
        credit = credit_at[np.arange(n_seq), n - 1]
        credit_mean[cap - 1], credit_se[cap - 1] = credit.mean(), credit.std(ddof=1) / np.sqrt(n_seq)
        drawn_mean[cap - 1], drawn_se[cap - 1] = n.mean(), n.std(ddof=1) / np.sqrt(n_seq)
    return credit_mean, credit_se, drawn_mean, drawn_se


def test_majority_vote_agrees_with_monte_carlo_on_a_generated_level():
    table = level_table("mv_categorical", 2)  # 4 answers, N_max 42
    rng = np.random.default_rng(20_261_128)
    flat = table.probs.reshape(-1, table.n_atoms)
    gold = np.broadcast_to(table.gold[None, :], table.probs.shape[:2]).reshape(-1)
    rows = rng.choice(np.flatnonzero((flat > 0.05).sum(axis=1) >= 4), size=3, replace=False)
    credit, drawn = mv_rule_expectations(flat[rows], gold[rows], table.n_max)
    for i, row in enumerate(rows):
        for j, rule in enumerate(MV_RULES[1:], start=1):
            c_mean, c_se, d_mean, d_se = _monte_carlo_mv(flat[row], int(gold[row]), table.n_max, rule, 20_000, rng)
            assert np.all(np.abs(credit[i, :, j] - c_mean) <= 5 * c_se + 1e-9), (row, rule)
            assert np.all(np.abs(drawn[i, :, j] - d_mean) <= 5 * d_se + 1e-9), (row, rule)


def test_best_of_n_agrees_with_monte_carlo_on_a_generated_level():
    table = level_table("bon_flat", 0)
    rng = np.random.default_rng(11)
    weights, _ = objective_rows(table)
    reward, drawn = bon_rule_expectations(table.atoms, table.probs, weights, table.n_max)
    taus = thresholds(table.atoms, table.probs, weights, BON_RULES)
    n_seq, cap = 20_000, table.n_max
    for _ in range(3):
        p, q = int(rng.integers(table.n_prompts)), int(rng.integers(table.n_queries))
        scores = table.atoms[p, q] @ weights[0]
        sample = scores[rng.choice(scores.size, size=(n_seq, cap), p=table.probs[p, q])]
        for j in range(1, len(BON_RULES)):
            hit = sample >= taus[0, j]
            first = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, cap)
            best = np.maximum.accumulate(sample, axis=1)[np.arange(n_seq), first - 1]
            for value, exact in ((best, reward[0, p, q, cap - 1, j]), (first, drawn[0, p, q, cap - 1, j])):
                assert abs(value.mean() - exact) <= 5 * value.std(ddof=1) / np.sqrt(n_seq) + 1e-9


def test_fixed_n_is_todays_exact_kernel_bit_for_bit():
    table = level_table("mv_categorical", 1)
    flat = table.probs.reshape(-1, table.n_atoms)[:300]
    gold = np.broadcast_to(table.gold[None, :], table.probs.shape[:2]).reshape(-1)[:300]
    credit, drawn = mv_rule_expectations(flat, gold, table.n_max)
    np.testing.assert_array_equal(credit[:, :, 0], mv_expected_credit(flat, gold, table.n_max))
    np.testing.assert_array_equal(drawn[:, :, 0], np.broadcast_to(np.arange(1, table.n_max + 1), drawn.shape[:2]))
    bon = level_table("bon_shape", 0)
    weights, _ = objective_rows(bon)
    reward, drawn = bon_rule_expectations(bon.atoms, bon.probs, weights, bon.n_max)
    np.testing.assert_array_equal(reward[..., 0], bon_weighted_max(bon.atoms, bon.probs, weights, bon.n_max))
    assert (drawn[..., 0] == np.arange(1, bon.n_max + 1)).all()


def test_draws_stay_within_the_cap_and_a_wide_margin_is_fixed_n():
    table = level_table("mv_categorical", 1)
    flat = table.probs.reshape(-1, table.n_atoms)[:200]
    gold = np.broadcast_to(table.gold[None, :], table.probs.shape[:2]).reshape(-1)[:200]
    n_max = table.n_max
    rules = (*MV_RULES, Margin(n_max + 1))
    credit, drawn = mv_rule_expectations(flat, gold, n_max, rules)
    caps = np.arange(1, n_max + 1)[None, :, None]
    assert (drawn <= caps + 1e-12).all() and (drawn >= 1 - 1e-12).all()
    assert (np.diff(drawn, axis=1) >= -1e-12).all()  # a higher cap never draws fewer
    assert (drawn[:, 1:, 1] < caps[:, 1:, 0]).any()  # and the rules do stop early
    np.testing.assert_allclose(credit[:, :, -1], credit[:, :, 0], atol=1e-12)
    np.testing.assert_allclose(drawn[:, :, -1], drawn[:, :, 0], atol=1e-12)


def test_bad_rules_are_refused_with_their_value():
    with pytest.raises(ValueError, match="m must be an integer >= 1, got 0"):
        Margin(0)
    with pytest.raises(ValueError, match=r"level must be a number in \(0.5, 1\), got 0.5"):
        Posterior(0.5)
    with pytest.raises(ValueError, match=r"q must be a number in \[0, 1\], got 1.5"):
        Threshold(1.5)
    with pytest.raises(ValueError, match="rule 0 must be FixedN"):
        mv_rule_expectations(np.array([[0.5, 0.5]]), np.array([0]), 3, (Margin(2),))
    with pytest.raises(ValueError, match="does not apply to aggregator 'mv'"):
        mv_rule_expectations(np.array([[0.5, 0.5]]), np.array([0]), 3, (FixedN(), Threshold(0.5)))
    with pytest.raises(ValueError, match="aggregator must be 'mv' or 'bon', got 'vote'"):
        default_rules("vote")
    assert [rule_label(r) for r in MV_RULES[:2]] == ["fixed", "margin(m=2)"]
    with pytest.raises(ValueError, match=r"a row with 12 answers of positive probability at N_max = 64 is beyond"):
        mv_rule_expectations(np.full((1, 12), 1 / 12), np.array([0]), 64, (FixedN(), Margin(2)))


@pytest.mark.parametrize("family", ["mv_categorical", "bon_shape"])
def test_env_q_table_with_rules(family):
    env = gym.make("IAPO-Generated-v0", family=family, level=2)
    u = env.unwrapped
    table = u.table
    rules = u.rules
    assert isinstance(rules[0], FixedN) and rules == default_rules(table.aggregator)
    q = u.q_table("test", rules=True)
    shape = (table.n_contexts, table.n_prompts, table.n_max, len(rules))
    assert q.shape == shape
    np.testing.assert_array_equal(q[..., 0], u.q_table("test"))  # rule 0 is today's Q-table, bit for bit
    drawn = u.expected_drawn("test")
    assert drawn.shape == shape
    assert (drawn[..., 0] == np.arange(1, table.n_max + 1)[None, None, :]).all()
    # Q of a rule = task reward + cost weight x mean over queries of (cost x expected draws)
    queries = u.queries("test")
    found = rule_expectations(table)
    rows = found.rows(table.n_contexts)
    reward = found.reward[:, :, queries].mean(axis=2)[rows]
    if table.aggregator == "mv":
        reward = table.context_weights[:, 0, None, None, None] * reward
    cost = table.cost_matrix()[:, queries]
    spend = (found.drawn[:, :, queries] * cost[None, :, :, None, None]).mean(axis=2)[rows]
    np.testing.assert_allclose(q[..., 1:], (reward + table.context_weights[:, -1, None, None, None] * spend)[..., 1:],
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose(drawn, expected_drawn(table, queries))
    np.testing.assert_allclose(expected_cost(table, queries), spend, rtol=1e-13)
    assert q_table(table, queries, rules=True).shape == shape


def test_the_docs_api_block_runs_and_the_bench_command_runs() -> None:
    """docs/rules.md: its ```python block runs as written, and ``benchmarks/bench_rules.py`` (the command it gives)
    runs on a generated level (MATH needs its table; without one the script says so and goes on)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "rules.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 1
    scope: dict[str, object] = {}
    exec(compile(blocks[0], "docs/rules.md", "exec"), scope)  # noqa: S102
    assert 1 <= scope["info"]["drawn"] <= 10  # type: ignore[index]
    assert "benchmarks/bench_rules.py" in text
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_rules.py"), "--tasks",
                          "generated:mv_binary:1000000", "--repeats", "1"], capture_output=True, text=True,
                         timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mv_binary" in out.stdout
