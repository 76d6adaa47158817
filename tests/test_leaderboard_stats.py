"""Leaderboard statistics: mean +- SEM, paired tests, multiplicity corrections, winners."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from iapo_gym.leaderboard.report.stats import (
    adjust_pvalues,
    mean_sem,
    paired_test,
    pairwise,
    rank_agents,
    summarize,
    win_matrix,
)
from iapo_gym.leaderboard.run.store import RunResult


def _row(label: str, budget: int, run: int, acr: float, task: str = "t") -> RunResult:
    return RunResult(task, "sha", label, "{}", label, budget, run, 0, None, 1, 2, acr, 1.0, 0.9, 1.0 - acr,
                     "[[0, 1]]", "[[0, 1]]", 0.01, budget, "0")


def test_mean_sem_by_hand() -> None:
    mean, sem, n = mean_sem([1.0, 2.0, 3.0, 4.0, float("nan")])
    assert (mean, n) == (2.5, 4)
    assert sem == pytest.approx(math.sqrt(5 / 3) / 2)
    assert math.isnan(mean_sem([1.0])[1])


def test_holm_and_bh_match_hand_computed_values() -> None:
    p = [0.01, 0.04, 0.03, 0.005]
    # Holm: sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> running max.
    np.testing.assert_allclose(adjust_pvalues(p, "holm"), [0.03, 0.06, 0.06, 0.02])
    # BH: p_(i) m / i = 0.02, 0.02, 0.04, 0.04 -> running min from the top.
    np.testing.assert_allclose(adjust_pvalues(p, "bh"), [0.02, 0.04, 0.04, 0.02])
    np.testing.assert_allclose(adjust_pvalues(p, "none"), p)


def test_corrections_skip_nan_and_cap_at_one() -> None:
    np.testing.assert_allclose(adjust_pvalues([0.01, np.nan, 0.04], "holm"), [0.02, np.nan, 0.04])
    np.testing.assert_allclose(adjust_pvalues([0.01, np.nan, 0.04], "bh"), [0.02, np.nan, 0.04])
    np.testing.assert_allclose(adjust_pvalues([0.5, 0.6], "holm"), [1.0, 1.0])
    np.testing.assert_allclose(adjust_pvalues([0.5, 0.6], "bh"), [0.6, 0.6])
    with pytest.raises(ValueError, match="correction"):
        adjust_pvalues([0.1], "bonferroni")


def test_paired_test_truncates_drops_nonfinite_and_ties() -> None:
    x = [1.0, 2.0, 3.0, 4.0, 5.0, float("nan")]
    y = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 7.0]
    w = paired_test(x, y, "wilcoxon")
    assert (w.n_pairs, w.n_effective, w.median_diff) == (5, 4, 2.5)
    assert w.p_value == pytest.approx(2 / 16)  # exact: all four differences positive
    s = paired_test(x, y, "sign")
    assert s.p_value == pytest.approx(2 / 16)
    assert s.statistic == 4


def test_paired_test_matches_scipy_and_skips_tiny_samples() -> None:
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=40), rng.normal(0.3, size=40)
    expected = sps.wilcoxon(x - y, zero_method="wilcox").pvalue
    assert paired_test(x, y).p_value == pytest.approx(expected)
    k = int((x > y).sum())
    assert paired_test(x, y, "sign").p_value == pytest.approx(sps.binomtest(k, 40).pvalue)
    skipped = paired_test([1.0, 2.0], [1.0, 1.0])
    assert skipped.n_effective == 1 and math.isnan(skipped.p_value)


def test_a_significant_result_points_the_way_the_test_measured_not_the_median() -> None:
    # 25 small positive differences and 23 large negative ones: the median is positive, but the negative
    # differences hold the larger rank sum, and they are what makes the signed-rank test reject
    d = np.concatenate([np.linspace(1.0, 3.0, 25), -np.linspace(10.0, 40.0, 23)])
    x, y = 100.0 + d, np.full(d.size, 100.0)
    w = paired_test(x, y, "wilcoxon")
    ranks = sps.rankdata(np.abs(d))
    assert w.median_diff > 0 and ranks[d < 0].sum() > ranks[d > 0].sum() and w.p_value < 0.01
    assert w.direction == -1
    assert paired_test(x, y, "sign").direction == 1  # the sign test counts signs: 25 positive against 23
    rows = [_row("a", 10, r, float(x[r])) for r in range(d.size)] + [_row("b", 10, r, 100.0) for r in range(d.size)]
    (pair,) = pairwise(rows)
    assert pair.median_diff > 0 and pair.winner == -1  # a's ACR is significantly lower: b wins
    assert paired_test([1.0, 1.0], [1.0, 1.0]).direction == 0  # no effective pair


def test_pairwise_winner_direction_and_matrix() -> None:
    rng = np.random.default_rng(0)
    base = rng.uniform(0.4, 0.6, 12)
    rows = []
    for run in range(12):
        rows.append(_row("good", 100, run, base[run] + 0.1 + 0.01 * rng.random()))
        rows.append(_row("bad", 100, run, base[run]))
        rows.append(_row("same", 100, run, base[run] + (0.002 if run % 2 else -0.001)))
    pairs = pairwise(rows)
    by_pair = {(p.a, p.b): p for p in pairs}
    assert by_pair[("bad", "good")].winner == -1  # labels are compared in sorted order
    assert by_pair[("good", "same")].winner == 1
    assert by_pair[("bad", "same")].winner == 0  # alternating signs: not significant
    assert by_pair[("bad", "good")].p_adjusted == pytest.approx(min(1.0, 3 * by_pair[("bad", "good")].p_value))
    labels = ["good", "same", "bad"]
    m = win_matrix(pairs, "t", 100, labels)
    np.testing.assert_array_equal(m, -m.T)
    assert m[0].tolist() == [0, 1, 1] and m[2, 0] == -1
    ranking = rank_agents(summarize(rows), pairs)
    assert [r.label for r in ranking] == ["good", "same", "bad"]
    assert (ranking[0].wins, ranking[0].losses) == (2, 0)


def test_pairwise_pairs_runs_by_index_not_position() -> None:
    # Agent b lacks run 0; pairing must align runs 1..5, where a is always better.
    rows = [_row("a", 10, r, 0.5 + 0.1 * r) for r in range(6)]
    rows += [_row("b", 10, r, 0.45 + 0.1 * r) for r in range(1, 6)]
    (pair,) = pairwise(rows, correction="none")
    assert pair.n_pairs == 5 and pair.median_diff == pytest.approx(0.05)


def test_summary_groups_by_task_agent_budget() -> None:
    rows = [_row("a", 10, r, float(r)) for r in range(3)] + [_row("a", 20, 0, 5.0)]
    summary = summarize(rows)
    assert [(s.budget, s.n_runs, s.acr_mean) for s in summary] == [(10, 3, 1.0), (20, 1, 5.0)]
    assert summary[0].acr_sem == pytest.approx(1 / math.sqrt(3))
