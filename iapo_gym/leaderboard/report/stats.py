"""Statistics of a sweep (paper section 5 and appendix D).

- mean +- SEM of the test ACR per (task, agent, budget);
- pairwise two-sided Wilcoxon signed-rank tests (or the sign test) on runs paired by run
  index, with Holm-Bonferroni (default), Benjamini-Hochberg or no correction within each
  (task, budget); a winner is declared when the adjusted p < alpha, in the direction the test
  measured: the larger of the signed-rank sums (the sign test: the more frequent sign). The paper's
  appendix D takes the sign of the median difference, which can point the other way when many small
  differences go one way and fewer large ones the other (the test rejects because of the large ones).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from iapo_gym.leaderboard.report import CORRECTIONS, DEFAULT_ALPHA, TESTS  # noqa: F401  (the stats' options)
from iapo_gym.leaderboard.run.store import RunResult


def mean_sem(values: Sequence[float] | np.ndarray) -> tuple[float, float, int]:
    """(mean, standard error of the mean, n) of the finite values; SEM is NaN for n < 2."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    n = int(x.size)
    if n == 0:
        return math.nan, math.nan, 0
    sem = float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    return float(x.mean()), sem, n


@dataclass(frozen=True)
class SummaryRow:
    """Mean +- SEM of one (task, agent, budget) over its runs."""

    task: str
    label: str
    budget: int
    n_runs: int
    acr_mean: float
    acr_sem: float
    regret_mean: float
    regret_sem: float
    optimal_acr_mean: float
    train_optimal_acr_mean: float
    train_seconds_mean: float
    budget_spent_mean: float


def summarize(results: Iterable[RunResult]) -> list[SummaryRow]:
    """One SummaryRow per (task, label, budget), sorted by task, budget, then label."""
    groups: dict[tuple[str, str, int], list[RunResult]] = defaultdict(list)
    for r in results:
        groups[(r.task, r.label, r.budget)].append(r)
    rows = []
    for (task, label, budget), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        acr, acr_sem, n = mean_sem([r.acr for r in rs])
        regret, regret_sem, _ = mean_sem([r.regret for r in rs])
        rows.append(SummaryRow(
            task, label, budget, n, acr, acr_sem, regret, regret_sem,
            mean_sem([r.optimal_acr for r in rs])[0], mean_sem([r.train_optimal_acr for r in rs])[0],
            mean_sem([r.train_seconds for r in rs])[0], mean_sem([float(r.budget_spent) for r in rs])[0],
        ))
    return rows


@dataclass(frozen=True)
class PairedTest:
    """A paired two-sided test of x against y: effective sample size, p-value, median difference, and the
    direction the test measured."""

    n_pairs: int  # finite pairs after truncation
    n_effective: int  # pairs with a non-zero difference
    statistic: float
    p_value: float  # NaN when skipped (< 2 effective samples)
    median_diff: float  # median of the non-zero differences x - y (NaN if none)
    # +1 when x - y leans positive by the test's own statistic (Wilcoxon: the positive differences' rank sum is the
    # larger; sign test: positive differences are the more), -1 negative, 0 balanced or no effective pair
    direction: int


def paired_test(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray, test: str = "wilcoxon") -> PairedTest:
    """Two-sided paired test: truncate to the shorter length, drop non-finite pairs and exact ties.

    ``test="wilcoxon"``: ``scipy.stats.wilcoxon(zero_method="wilcox")``; ``"sign"``: binomial
    test of the number of positive differences. Fewer than 2 effective pairs: p is NaN. ``direction`` is the
    side the test's statistic leans to (a significant result is significant in that direction).
    """
    if test not in TESTS:
        raise ValueError(f"test must be one of {TESTS}, got {test!r}")
    a = np.asarray(x, dtype=np.float64).ravel()
    b = np.asarray(y, dtype=np.float64).ravel()
    n = min(a.size, b.size)
    a, b = a[:n], b[:n]
    finite = np.isfinite(a) & np.isfinite(b)
    d = a[finite] - b[finite]
    n_pairs = int(d.size)
    d = d[d != 0.0]
    n_eff = int(d.size)
    median = float(np.median(d)) if n_eff else math.nan
    positives = int((d > 0).sum())
    if test == "wilcoxon":
        ranks = sps.rankdata(np.abs(d))  # tied magnitudes share their mean rank, as in the test
        direction = int(np.sign(ranks[d > 0].sum() - ranks[d < 0].sum()))
    else:
        direction = int(np.sign(2 * positives - n_eff))
    if n_eff < 2:
        return PairedTest(n_pairs, n_eff, math.nan, math.nan, median, direction)
    if test == "wilcoxon":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            res = sps.wilcoxon(d, zero_method="wilcox", alternative="two-sided")
        return PairedTest(n_pairs, n_eff, float(res.statistic), float(res.pvalue), median, direction)
    res_b = sps.binomtest(positives, n_eff, 0.5, alternative="two-sided")
    return PairedTest(n_pairs, n_eff, float(positives), float(res_b.pvalue), median, direction)


def adjust_pvalues(p_values: Sequence[float] | np.ndarray, method: str = "holm") -> np.ndarray:
    """Multiplicity-adjusted p-values; NaN entries (skipped tests) stay NaN and do not count in m.

    ``holm``: step-down Holm-Bonferroni; ``bh``: Benjamini-Hochberg step-up FDR; ``none``.
    """
    if method not in CORRECTIONS:
        raise ValueError(f"correction must be one of {CORRECTIONS}, got {method!r}")
    p = np.asarray(p_values, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    m = ok.size
    if m == 0:
        return out
    if method == "none":
        out[ok] = p[ok]
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    ranked = p[order]
    i = np.arange(1, m + 1)
    if method == "holm":
        adjusted = np.maximum.accumulate((m - i + 1) * ranked)
    else:
        adjusted = np.minimum.accumulate((m / i * ranked)[::-1])[::-1]
    out[order] = np.minimum(adjusted, 1.0)
    return out


@dataclass(frozen=True)
class PairwiseRow:
    """Agent ``a`` against agent ``b`` on one (task, budget); ``winner`` is +1 (a wins), -1 or 0."""

    task: str
    budget: int
    a: str
    b: str
    n_pairs: int
    n_effective: int
    median_diff: float
    p_value: float
    p_adjusted: float
    winner: int


def pairwise(results: Iterable[RunResult], test: str = "wilcoxon", correction: str = "holm",
             alpha: float = DEFAULT_ALPHA) -> list[PairwiseRow]:
    """All pairwise comparisons (a < b by label) per (task, budget), runs paired by run index."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    cells: dict[tuple[str, int], dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in results:
        cells[(r.task, r.budget)][r.label][r.run] = r.acr
    out: list[PairwiseRow] = []
    for (task, budget), by_label in sorted(cells.items()):
        labels = sorted(by_label)
        pairs, tests = [], []
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                common = sorted(set(by_label[a]) & set(by_label[b]))
                x = [by_label[a][r] for r in common]
                y = [by_label[b][r] for r in common]
                pairs.append((a, b))
                tests.append(paired_test(x, y, test))
        adjusted = adjust_pvalues([t.p_value for t in tests], correction)
        for (a, b), t, p_adj in zip(pairs, tests, adjusted, strict=True):
            winner = t.direction if np.isfinite(p_adj) and p_adj < alpha else 0
            out.append(PairwiseRow(task, budget, a, b, t.n_pairs, t.n_effective, t.median_diff, t.p_value,
                                   float(p_adj), winner))
    return out


def win_matrix(rows: Iterable[PairwiseRow], task: str, budget: int, labels: Sequence[str]) -> np.ndarray:
    """(L, L) matrix in {-1, 0, +1}: entry [i, j] is +1 when ``labels[i]`` beats ``labels[j]``."""
    index = {label: i for i, label in enumerate(labels)}
    matrix = np.zeros((len(labels), len(labels)), dtype=np.int64)
    for row in rows:
        if row.task != task or row.budget != budget or row.a not in index or row.b not in index:
            continue
        matrix[index[row.a], index[row.b]] = row.winner
        matrix[index[row.b], index[row.a]] = -row.winner
    return matrix


@dataclass(frozen=True)
class RankRow:
    """An agent's standing on one task: mean ACR over budgets, significant wins minus losses."""

    task: str
    rank: int
    label: str
    acr_mean_over_budgets: float
    regret_mean_over_budgets: float
    wins: int
    losses: int


def rank_agents(summary: Iterable[SummaryRow], pairs: Iterable[PairwiseRow]) -> list[RankRow]:
    """Per task, agents ranked by their ACR averaged over the budgets every agent has results for
    (all of its own budgets if there are none in common); ties: more net wins first."""
    by_task: dict[str, dict[str, list[SummaryRow]]] = defaultdict(lambda: defaultdict(list))
    for s in summary:
        by_task[s.task][s.label].append(s)
    wins: dict[tuple[str, str], int] = defaultdict(int)
    losses: dict[tuple[str, str], int] = defaultdict(int)
    for p in pairs:
        if p.winner > 0:
            wins[(p.task, p.a)] += 1
            losses[(p.task, p.b)] += 1
        elif p.winner < 0:
            wins[(p.task, p.b)] += 1
            losses[(p.task, p.a)] += 1
    out: list[RankRow] = []
    for task in sorted(by_task):
        entries = []
        common = set.intersection(*({r.budget for r in rows} for rows in by_task[task].values()))
        for label, rows in by_task[task].items():
            used = [r for r in rows if r.budget in common] or rows
            acr = float(np.mean([r.acr_mean for r in used]))
            regret = float(np.mean([r.regret_mean for r in used]))
            entries.append((label, acr, regret, wins[(task, label)], losses[(task, label)]))
        entries.sort(key=lambda e: (-e[1], -(e[3] - e[4]), e[0]))
        out.extend(RankRow(task, i + 1, *e) for i, e in enumerate(entries))
    return out
