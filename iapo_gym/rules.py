"""Stopping rules: an arm is (prompt, cap N, rule), with the exact expected task reward and completions drawn.

A rule watches the completions one at a time and stops before the cap N when the aggregate looks settled;
rule 0 of every family is ``FixedN`` (draw all N, today's arm). The families (``default_rules``):

- majority vote: ``Margin(m)``, stop once the leader has m votes more than the runner-up (m = 2, 3, 4), and
  ``Posterior(level)``, Adaptive-Consistency's Beta rule on the top two counts v1 >= v2: stop once
  P(Beta(v1 + 1, v2 + 1) > 1/2) >= level (0.95, 0.99), computed exactly as P(Binomial(v1 + v2 + 1, 1/2) <= v1).
  A rule is checked after every completion; at a stop the leader is unique and the credit is 1 when it is the gold
  answer; at the cap it is today's tie-aware credit (1/t when gold is among the t most-voted answers).
- Best-of-N: ``Threshold(q)``, stop at the first completion whose utility w . a under the context reaches tau, the
  context's q-quantile of its utility atoms (q = 0.5, 0.75, 0.9), returning the best completion seen. tau is
  ``np.quantile(..., method="inverted_cdf")`` of w . a over every (prompt, query, atom) cell of positive probability
  of the whole table (both splits), so it is one number per context and rule, as a deployed rule needs.

Exact expectations, for every cap N = 1..N_max at once (``mv_rule_expectations``, ``bon_rule_expectations``):

- majority vote: the stopping set depends only on the counts, symmetrically in the wrong answers. A row's
  probability of reaching a count vector s unstopped is W(s) p^s, W(s) the number of draw orders that reach s
  without stopping before it; W and the credit are equal on each orbit (gold count c0, wrong counts as a
  partition lambda), so the orbits reachable without a stop are enumerated once per (wrong answers of positive
  probability, N_max, rule) (``_orbits``), and an orbit's mass is W p_gold^c0 m_lambda(p_wrong), m_lambda the
  monomial symmetric polynomial, all of a row's from one recurrence over its answers (``_vote_pass``, compiled,
  rows in vector lanes). The mass stopped at draw n adds its credit to every cap >= n, the unstopped mass at
  n = N gives the cap-N credit, and E[min(T, N)] = sum_{n < N} P(T > n). Rows equal up to the order of the wrong
  answers are computed once.
- Best-of-N: with h = P(w . a >= tau) the stop is geometric: E[reward_N] = (1 - (1 - h)^N) E[u | u >= tau]
  + (1 - h)^N E[max of N draws | all < tau] (``iapo_gym.exact.bon_expected_max`` on the truncated distribution),
  E[drawn_N] = sum_{n < N} (1 - h)^n.

Cost model. Majority vote: per distinct row with n_w wrong answers of positive probability, (partitions of at
most N_max into at most n_w parts) x (their distinct parts) x n_w multiply-adds for the polynomials, shared by the
rules, plus one per orbit of each rule: for N_max = 32, n_w = 4, 3,396 partitions and 8,561 (margin 2) to 22,897
(posterior 0.99) orbits, where the count vectors number C(36, 4) = 58,905 at n = 32 alone. The enumeration
(numpy, level by level, cached per process per (n_w, N_max, rule)) grows with the orbits: with N_max, the answers and, linearly,
the rules. Fixed N is ``iapo_gym.exact.mv_expected_credit``. Best-of-N: per threshold rule one more max-of-N pass
per distinct objective weighting, (C' x P x Q x M x N_max) per rule, with the per-weighting kernel (the grouped
kernel of ``bon_weighted_max`` serves fixed N only).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from fractions import Fraction
from functools import cache
from math import comb
from typing import ClassVar

import numpy as np

from iapo_gym.compiled import njit
from iapo_gym.exact import (
    TENSOR_LIMIT_BYTES,
    TableArrays,
    bon_expected_max,
    bon_weighted_max,
    context_rows,
    mv_expected_credit,
    objective_rows,
)


@dataclass(frozen=True)
class FixedN:
    """Draw all N completions (today's arm); rule 0 of every family."""

    name: ClassVar[str] = "fixed"

    def params(self) -> dict[str, float]:
        """The rule's parameters by name (none)."""
        return {}


@dataclass(frozen=True)
class Margin:
    """Majority vote: stop once the leader is ``m`` votes ahead of the runner-up (m >= 1)."""

    m: int
    name: ClassVar[str] = "margin"

    def __post_init__(self) -> None:
        if isinstance(self.m, bool) or not isinstance(self.m, (int, np.integer)) or self.m < 1:
            raise ValueError(f"Margin(m): m must be an integer >= 1, got {self.m!r}")

    def params(self) -> dict[str, float]:
        """The rule's parameters by name."""
        return {"m": int(self.m)}


@dataclass(frozen=True)
class Posterior:
    """Majority vote: stop once P(Beta(v1 + 1, v2 + 1) > 1/2) >= ``level`` for the top two counts (0.5 < level < 1)."""

    level: float
    name: ClassVar[str] = "posterior"

    def __post_init__(self) -> None:
        if not isinstance(self.level, (float, int)) or not 0.5 < float(self.level) < 1.0:
            raise ValueError(f"Posterior(level): level must be a number in (0.5, 1), got {self.level!r}")

    def params(self) -> dict[str, float]:
        """The rule's parameters by name."""
        return {"level": float(self.level)}


@dataclass(frozen=True)
class Threshold:
    """Best-of-N: stop at the first completion whose utility reaches the context's ``q``-quantile (0 <= q <= 1)."""

    q: float
    name: ClassVar[str] = "threshold"

    def __post_init__(self) -> None:
        if not isinstance(self.q, (float, int)) or not 0.0 <= float(self.q) <= 1.0:
            raise ValueError(f"Threshold(q): q must be a number in [0, 1], got {self.q!r}")

    def params(self) -> dict[str, float]:
        """The rule's parameters by name."""
        return {"q": float(self.q)}


Rule = FixedN | Margin | Posterior | Threshold

#: The default rule family of each aggregator; index 0 is fixed N.
MV_RULES: tuple[Rule, ...] = (FixedN(), Margin(2), Margin(3), Margin(4), Posterior(0.95), Posterior(0.99))
BON_RULES: tuple[Rule, ...] = (FixedN(), Threshold(0.5), Threshold(0.75), Threshold(0.9))


def default_rules(aggregator: str) -> tuple[Rule, ...]:
    """The rule family of ``aggregator`` ("mv" or "bon")."""
    if aggregator == "mv":
        return MV_RULES
    if aggregator == "bon":
        return BON_RULES
    raise ValueError(f"aggregator must be 'mv' or 'bon', got {aggregator!r}")


def rule_label(rule: Rule) -> str:
    """A rule as text, e.g. ``margin(m=2)``."""
    params = ", ".join(f"{k}={v:g}" for k, v in rule.params().items())
    return f"{rule.name}({params})" if params else rule.name


#: The rule classes by ``name`` (``make_rule``).
RULE_TYPES: dict[str, type] = {t.name: t for t in (FixedN, Margin, Posterior, Threshold)}


def make_rule(name: str, params: dict[str, float]) -> Rule:
    """The rule named ``name`` with ``params`` (``rule.name`` and ``rule.params()`` of a rule give it back).

    An unknown name, a missing or unknown parameter or a bad value raises ``ValueError`` naming it.
    """
    kind = RULE_TYPES.get(name)
    if kind is None:
        raise ValueError(f"unknown stopping rule {name!r}; expected one of {sorted(RULE_TYPES)}")
    wanted = [f.name for f in fields(kind)]
    if not isinstance(params, dict) or sorted(params) != sorted(wanted):
        raise ValueError(f"stopping rule {name!r} takes the parameters {wanted}, got {params!r}")
    rule: Rule = kind(**params)
    return rule


def _check_rules(rules: tuple[Rule, ...], allowed: tuple[type, ...], aggregator: str) -> None:
    if not rules or not isinstance(rules[0], FixedN):
        raise ValueError(f"rule 0 must be FixedN(), got {rules[0] if rules else 'no rules'!r}")
    for r in rules:
        if not isinstance(r, allowed):
            raise ValueError(f"rule {r!r} does not apply to aggregator {aggregator!r}; "
                             f"expected one of {[t.__name__ for t in allowed]}")


# ---- majority vote ------------------------------------------------------------------------------
@cache
def _posterior_stops(level: float, n_max: int) -> np.ndarray:
    """(n_max + 1, n_max + 1) bool: stop at top counts (v1, v2), exactly P(Bin(v1 + v2 + 1, 1/2) <= v1) >= level."""
    out = np.zeros((n_max + 1, n_max + 1), dtype=bool)
    target = Fraction(level)
    for v1 in range(n_max + 1):
        for v2 in range(min(v1, n_max - v1) + 1):
            trials = v1 + v2 + 1
            out[v1, v2] = Fraction(sum(comb(trials, i) for i in range(v1 + 1)), 2**trials) >= target
    return out


def vote_stops(rule: Rule, v1: np.ndarray, v2: np.ndarray, n_max: int) -> np.ndarray:
    """Whether majority-vote ``rule`` stops at the top two vote counts ``v1 >= v2`` (arrays, v1 + v2 <= ``n_max``).

    The one stopping test of the exact enumeration (``_orbits``) and of the env's sampled steps (``sampled_stops``).
    """
    if isinstance(rule, Margin):
        return np.asarray(v1 - v2 >= rule.m)
    if isinstance(rule, Posterior):
        return _posterior_stops(float(rule.level), n_max)[v1, v2]
    raise ValueError(f"{rule!r} is not a majority-vote stopping rule")


@dataclass(frozen=True)
class _Partitions:
    """The partitions with at most ``n_wrong`` parts and size <= N_max, ascending in size (index 0: the empty one),
    as rows of ``n_wrong`` counts, descending, zeros last.

    ``remove[u, t]`` is the partition u without one part of its t-th distinct value ``part[u, t]`` (t < ``n_distinct[u]``):
    the recurrence m_u(x_1..x_j) = m_u(x_1..x_(j-1)) + sum_t x_j^part[u, t] m_remove[u, t](x_1..x_(j-1)) of the
    monomial symmetric polynomials. ``lookup`` gives the index of partitions by their ``_keys``.
    """

    keys: np.ndarray
    order: np.ndarray
    remove: np.ndarray
    part: np.ndarray
    n_distinct: np.ndarray

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Indices of the partitions with ``keys`` (each must be one of them)."""
        return self.order[np.searchsorted(self.keys[self.order], keys)]


def _keys(rows: np.ndarray, n_max: int) -> np.ndarray:
    """Each row of counts in [0, n_max] as one int64 (base n_max + 1)."""
    if (n_max + 1) ** max(1, rows.shape[1]) >= 2**63:
        raise ValueError(f"{rows.shape[1]} answers of up to {n_max} votes are too many for the stopping rules' "
                         "exact computation (its vote states are numbered in 64 bits)")
    return rows @ ((n_max + 1) ** np.arange(rows.shape[1], dtype=np.int64)[::-1])


def _grow(parents: np.ndarray, first_col: int, n_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row with one more vote in one column >= ``first_col`` (where those columns are a partition: only the
    first column of each value, so the row stays sorted): the children, their parent and the column grown."""
    kids, parent, column = [], [], []
    for i in range(first_col, parents.shape[1]):
        ok = np.ones(parents.shape[0], dtype=bool) if i == first_col else parents[:, i] < parents[:, i - 1]
        rows = np.flatnonzero(ok)
        child = parents[rows].copy()
        child[:, i] += 1
        kids.append(child)
        parent.append(rows)
        column.append(np.full(rows.size, i))
    if not kids:
        return np.zeros((0, parents.shape[1]), dtype=np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(kids), np.concatenate(parent), np.concatenate(column)


@cache
def _partitions(n_wrong: int, n_max: int) -> _Partitions:
    """The ``_Partitions`` of ``n_wrong`` wrong answers up to ``n_max`` votes (vectorized, size by size)."""
    width = max(1, n_wrong)
    levels = [np.zeros((1, width), dtype=np.int64)]
    for _ in range(n_max if n_wrong else 0):  # every partition of size n + 1 adds a vote to one of size n
        kids = _grow(levels[-1], 0, n_max)[0]
        levels.append(kids[np.unique(_keys(kids, n_max), return_index=True)[1]])
    rows = np.concatenate(levels)
    keys = _keys(rows, n_max)
    order = np.argsort(keys)
    remove = np.zeros((rows.shape[0], width), dtype=np.int64)
    part = np.zeros((rows.shape[0], width), dtype=np.int64)
    n_distinct = np.zeros(rows.shape[0], dtype=np.int64)
    found = _Partitions(keys, order, remove, part, n_distinct)
    for i in range(n_wrong):  # the first part of each distinct positive value, removed (zeros move up)
        has = (rows[:, i] > 0) & ((rows[:, i] < rows[:, i - 1]) if i else True)
        u = np.flatnonzero(has)
        smaller = np.concatenate([rows[u, :i], rows[u, i + 1 :], np.zeros((u.size, 1), dtype=np.int64)], axis=1)
        remove[u, n_distinct[u]] = found.lookup(_keys(smaller, n_max))
        part[u, n_distinct[u]] = rows[u, i]
        n_distinct[u] += 1
    return found


@cache
def _orbits(n_wrong: int, n_max: int, rule: Rule) -> np.ndarray:
    """The vote states of ``rule`` reachable without a stop, one per orbit (gold count c0, wrong counts as a
    partition): (S, 6) float rows (level, c0, partition index, W x [gold leads at a stop], W if no stop,
    W x tie credit of gold if no stop), where W is the number of draw orders of one count vector of the orbit
    that reach it without stopping before (the rule and W are symmetric in the wrong answers). Vectorized, level
    by level: W(child) is the sum over its unstopped parents of W(parent) times the number of the child's answers
    the vote could have gone to (1 for gold; for a wrong answer, those at the child's new count)."""
    parts = _partitions(n_wrong, n_max)
    alive = np.zeros((1, 1 + n_wrong), dtype=np.int64)  # unstopped orbits: gold count, then the partition
    alive_w = np.ones(1)
    out = []
    for n in range(1, n_max + 1):
        if alive.shape[0] == 0:
            break
        wrong, parent, column = _grow(alive, 1, n_max)
        grown = wrong[np.arange(wrong.shape[0]), column]
        mult = (wrong[:, 1:] == grown[:, None]).sum(axis=1)
        gold = alive.copy()
        gold[:, 0] += 1
        kids = np.concatenate([gold, wrong])
        kid_w = np.concatenate([alive_w, alive_w[parent] * mult])
        keys, first, inverse = np.unique(_keys(kids, n_max), return_index=True, return_inverse=True)
        states, w = kids[first], np.bincount(inverse.reshape(-1), weights=kid_w, minlength=keys.size)
        top = np.sort(np.concatenate([states[:, :3], np.zeros((states.shape[0], 1), np.int64)], axis=1), axis=1)
        v1, v2 = top[:, -1], top[:, -2]  # the partition is sorted: the top two are among c0 and its first two
        stop = vote_stops(rule, v1, v2, n_max)
        lead = states[:, 0] == v1
        ties = (states == v1[:, None]).sum(axis=1)
        u = parts.lookup(_keys(states[:, 1:], n_max)) if n_wrong else np.zeros(states.shape[0], np.int64)
        out.append(np.column_stack([np.full(keys.size, n), states[:, 0], u, np.where(stop & lead, w, 0.0),
                                    np.where(stop, 0.0, w), np.where(lead & ~stop, w / ties, 0.0)]))
        alive, alive_w = states[~stop], w[~stop]
    return np.concatenate(out).astype(np.float64)


#: Rows per pass of ``_vote_pass``: they run in vector lanes (the innermost loops).
_LANES = 16


@njit
def _vote_pass(p_gold: np.ndarray, p_wrong: np.ndarray, remove: np.ndarray, part: np.ndarray,
               n_distinct: np.ndarray, orbits: np.ndarray, orbit_rule: np.ndarray, n_rules: int,
               n_max: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Expected credit and completions drawn (n_rules, n_max, L) of L rows: gold probabilities ``p_gold`` (L,),
    wrong-answer probabilities ``p_wrong`` (n_wrong, L), over the orbits of every rule (``orbit_rule`` its rule).

    First the monomial symmetric polynomials m_u(p_wrong) of every partition u (shared by the rules), then each
    orbit's mass W p_gold^c0 m_u adds to its rule's stopped credit, unstopped mass or cap credit at its level.
    """
    n_wrong, n_lanes = p_wrong.shape
    n_parts = remove.shape[0]
    power = np.empty((n_wrong + 1, n_max + 1, n_lanes))  # row n_wrong: the gold answer
    for j in range(n_wrong + 1):
        for lane in range(n_lanes):
            x = p_gold[lane] if j == n_wrong else p_wrong[j, lane]
            power[j, 0, lane] = 1.0
            for a in range(1, n_max + 1):
                power[j, a, lane] = power[j, a - 1, lane] * x
    mono = np.zeros((n_parts, n_lanes))
    mono[0, :] = 1.0
    for j in range(n_wrong):  # add variable j; larger partitions first, so each reads the previous m of smaller ones
        for u in range(n_parts - 1, 0, -1):
            for t in range(n_distinct[u]):
                v, a = remove[u, t], part[u, t]
                for lane in range(n_lanes):
                    mono[u, lane] += power[j, a, lane] * mono[v, lane]
    stopped = np.zeros((n_rules, n_max + 1, n_lanes))
    cont = np.zeros((n_rules, n_max + 1, n_lanes))
    capc = np.zeros((n_rules, n_max + 1, n_lanes))
    for i in range(orbits.shape[0]):
        r, n, c0, u = orbit_rule[i], int(orbits[i, 0]), int(orbits[i, 1]), int(orbits[i, 2])
        ws, wm, wc = orbits[i, 3], orbits[i, 4], orbits[i, 5]
        for lane in range(n_lanes):
            m = power[n_wrong, c0, lane] * mono[u, lane]
            stopped[r, n, lane] += ws * m
            cont[r, n, lane] += wm * m
            capc[r, n, lane] += wc * m
    credit = np.empty((n_rules, n_max, n_lanes))
    drawn = np.empty((n_rules, n_max, n_lanes))
    for r in range(n_rules):
        for lane in range(n_lanes):
            acc_credit, acc_drawn = 0.0, 1.0
            for n in range(1, n_max + 1):
                acc_credit += stopped[r, n, lane]
                credit[r, n - 1, lane] = acc_credit + capc[r, n, lane]
                drawn[r, n - 1, lane] = acc_drawn
                acc_drawn += cont[r, n, lane]
    return credit, drawn


def mv_rule_expectations(probs: np.ndarray, gold: np.ndarray, n_max: int,
                         rules: tuple[Rule, ...] = MV_RULES) -> tuple[np.ndarray, np.ndarray]:
    """Exact expected majority-vote credit and completions drawn, each (R, n_max, len(rules)), caps N = 1..n_max.

    ``probs`` (R, B) are per-row answer probabilities, ``gold`` (R,) the gold answers. Rule 0 must be ``FixedN``:
    its credit is ``iapo_gym.exact.mv_expected_credit`` and its draws N.
    """
    _check_rules(rules, (FixedN, Margin, Posterior), "mv")
    probs = np.asarray(probs, dtype=np.float64)
    n_rows, n_buckets = probs.shape
    gold = np.asarray(gold, dtype=np.int64).reshape(-1)
    if gold.shape != (n_rows,) or (gold < 0).any() or (gold >= n_buckets).any():
        raise ValueError(f"gold must be {n_rows} answer indices in [0, {n_buckets}), got shape {gold.shape}")
    credit = np.empty((n_rows, n_max, len(rules)))
    drawn = np.empty((n_rows, n_max, len(rules)))
    credit[:, :, 0] = mv_expected_credit(probs, gold, n_max)
    drawn[:, :, 0] = np.arange(1, n_max + 1)
    if len(rules) == 1 or n_rows == 0:
        return credit, drawn
    # Each row as (gold, wrong answers descending, zeros last); equal rows are computed once.
    others = probs.copy()
    others[np.arange(n_rows), gold] = -1.0
    others = -np.sort(-others, axis=1)[:, :-1]
    keys, inverse = np.unique(np.column_stack([probs[np.arange(n_rows), gold], others]), axis=0,
                              return_inverse=True)
    n_positive = (keys[:, 1:] > 0).sum(axis=1)  # the wrong answers that count: zero ones never get a vote
    key_credit = np.empty((keys.shape[0], n_max, len(rules) - 1))
    key_drawn = np.empty((keys.shape[0], n_max, len(rules) - 1))
    most = int(n_positive.max()) + 1
    if (n_max + 1) ** most >= 2**63:
        raise ValueError(f"a row with {most} answers of positive probability at N_max = {n_max} is beyond the "
                         f"stopping rules' exact computation: (N_max + 1)^answers must stay below 2^63")
    for n_wrong in np.unique(n_positive).tolist():
        rows = np.flatnonzero(n_positive == n_wrong)
        parts = _partitions(n_wrong, n_max)
        tables = [_orbits(n_wrong, n_max, rule) for rule in rules[1:]]
        orbits = np.concatenate(tables)
        orbit_rule = np.repeat(np.arange(len(tables)), [t.shape[0] for t in tables])
        for start in range(0, rows.size, _LANES):
            block = keys[rows[start : start + _LANES]]
            c, d = _vote_pass(np.ascontiguousarray(block[:, 0]), np.ascontiguousarray(block[:, 1 : 1 + n_wrong].T),
                              parts.remove, parts.part, parts.n_distinct, orbits, orbit_rule, len(tables), n_max)
            key_credit[rows[start : start + _LANES]] = c.transpose(2, 1, 0)
            key_drawn[rows[start : start + _LANES]] = d.transpose(2, 1, 0)
    credit[:, :, 1:] = np.clip(key_credit[inverse.reshape(-1)], 0.0, 1.0)
    drawn[:, :, 1:] = key_drawn[inverse.reshape(-1)]
    return credit, drawn


# ---- Best-of-N ----------------------------------------------------------------------------------
def thresholds(atoms: np.ndarray, probs: np.ndarray, weights: np.ndarray, rules: tuple[Rule, ...]) -> np.ndarray:
    """tau (C', len(rules)) of each objective weighting and rule: the q-quantile of w . a over the cells of
    positive probability (``inverted_cdf``: an atom's value); +inf for ``FixedN`` (never stops)."""
    positive = probs > 0
    out = np.full((weights.shape[0], len(rules)), np.inf)
    qs = [float(r.q) for r in rules if isinstance(r, Threshold)]
    if not qs:
        return out
    cols = [j for j, r in enumerate(rules) if isinstance(r, Threshold)]
    for c, w in enumerate(weights):
        values = (atoms @ w)[positive]
        out[c, cols] = np.quantile(values, qs, method="inverted_cdf")
    return out


def bon_rule_expectations(atoms: np.ndarray, probs: np.ndarray, weights: np.ndarray, n_max: int,
                          rules: tuple[Rule, ...] = BON_RULES,
                          taus: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact expected Best-of-N reward and completions drawn, each (C', P, Q, n_max, len(rules)).

    ``atoms`` (P, Q, M, K), ``probs`` (P, Q, M), ``weights`` (C', K) objective weightings; ``taus`` (C', len(rules))
    the thresholds (default ``thresholds`` of these arrays). Rule 0 must be ``FixedN``: its reward is
    ``iapo_gym.exact.bon_weighted_max``.
    """
    _check_rules(rules, (FixedN, Threshold), "bon")
    weights = np.asarray(weights, dtype=np.float64)
    if taus is None:
        taus = thresholds(atoms, probs, weights, rules)
    n_p, n_q, _ = probs.shape
    shape = (weights.shape[0], n_p, n_q, n_max, len(rules))
    reward, drawn = np.empty(shape), np.empty(shape)
    reward[..., 0] = bon_weighted_max(atoms, probs, weights, n_max)
    drawn[..., 0] = np.arange(1, n_max + 1)
    probs_in, total = probs, probs.sum(axis=-1)
    for c, w in enumerate(weights):
        order = np.argsort(atoms @ w, axis=-1, kind="stable")  # sorted once: each rule's max-of-N sort is then a pass
        scores = np.take_along_axis(atoms @ w, order, axis=-1)
        probs = np.take_along_axis(probs_in, order, axis=-1)
        for j in range(1, len(rules)):
            high = scores >= taus[c, j]
            low_probs = np.where(high, 0.0, probs)
            stay = low_probs.sum(axis=-1) / total  # 1 - h: one completion does not stop
            hit = np.where(high, probs, 0.0).sum(axis=-1)
            mean_high = np.divide((np.where(high, probs, 0.0) * scores).sum(axis=-1), hit,
                                  out=np.zeros_like(hit), where=hit > 0)
            powers = np.cumprod(np.repeat(stay[..., None], n_max, axis=-1), axis=-1)  # (1 - h)^N, N = 1..n_max
            with np.errstate(invalid="ignore", divide="ignore"):
                low_max = bon_expected_max(scores, low_probs, n_max)
            low_max = np.where(stay[..., None] > 0, low_max, 0.0)
            reward[c, ..., j] = (1.0 - powers) * mean_high[..., None] + powers * low_max
            drawn[c, ..., j] = 1.0 + np.concatenate([np.zeros((n_p, n_q, 1)), np.cumsum(powers[..., :-1], axis=-1)],
                                                    axis=-1)
    return reward, drawn


# ---- a table's tensors --------------------------------------------------------------------------
@dataclass(frozen=True)
class RuleExpectations:
    """A table's exact expected task reward and completions drawn, each (C', P, Q, N_max, R), read-only.

    As ``iapo_gym.exact.ExactReward``: majority vote has one row (the credit; scale by w_1), Best-of-N one row per
    distinct objective weighting, ``context_index`` (C,) the row of each context (None: all row 0).
    """

    rules: tuple[Rule, ...]
    reward: np.ndarray
    drawn: np.ndarray
    context_index: np.ndarray | None = None

    def rows(self, n_contexts: int) -> np.ndarray:
        """The tensor row of each of ``n_contexts`` contexts."""
        return context_rows(self.context_index, n_contexts)


_KEY = "rules"  # the entry of the table's derived-array cache this module owns


def rule_expectations(table: TableArrays, rules: tuple[Rule, ...] | None = None) -> RuleExpectations:
    """The table's ``RuleExpectations`` under ``rules`` (default: its aggregator's family), cached on the table."""
    rules = default_rules(table.aggregator) if rules is None else tuple(rules)
    found: RuleExpectations | None = table._cache.get(_KEY)
    if found is not None and found.rules == rules:
        return found
    n_p, n_q, n_m = table.probs.shape
    n_rows = 1 if table.aggregator == "mv" else objective_rows(table)[0].shape[0]
    size = 2 * n_rows * n_p * n_q * table.n_max * len(rules) * 8
    if size > TENSOR_LIMIT_BYTES:
        raise ValueError(f"the stopping rules' tensors of this table take {size / 2**30:.1f} GiB, above the "
                         f"{TENSOR_LIMIT_BYTES / 2**30:.0f} GiB of iapo_gym.exact.TENSOR_LIMIT_BYTES (they are built whole)")
    index = None
    if table.aggregator == "mv":
        assert table.gold is not None
        gold = np.broadcast_to(table.gold[None, :], (n_p, n_q)).reshape(-1)
        credit, drawn = mv_rule_expectations(table.probs.reshape(-1, n_m), gold, table.n_max, rules)
        reward = credit.reshape(1, n_p, n_q, table.n_max, len(rules))
        drawn = drawn.reshape(1, n_p, n_q, table.n_max, len(rules))
    else:
        assert table.atoms is not None
        weights, index = objective_rows(table)
        reward, drawn = bon_rule_expectations(table.atoms, table.probs, weights, table.n_max, rules)
    reward.setflags(write=False)
    drawn.setflags(write=False)
    result = RuleExpectations(rules, reward, drawn, index)
    table._cache[_KEY] = result
    return result


# ---- sampled steps ------------------------------------------------------------------------------
_TAUS_KEY = "rule_thresholds"  # the entry of the table's derived-array cache with ``context_thresholds``


def context_thresholds(table: TableArrays, rules: tuple[Rule, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each context's tau (C, len(rules)) and objective weights (C, K), cached on the table.

    tau is ``thresholds`` of the whole table for the context's objective weighting (``objective_rows``), the values
    ``rule_expectations`` uses; +inf for a rule that is not a ``Threshold`` and for every rule of majority vote.
    """
    rules = default_rules(table.aggregator) if rules is None else tuple(rules)
    found = table._cache.get(_TAUS_KEY)
    if found is not None and found[0] == rules:
        return found[1], found[2]
    weights, index = objective_rows(table)
    if table.aggregator == "mv":
        taus = np.full((index.size, len(rules)), np.inf)
    else:
        assert table.atoms is not None
        taus = thresholds(table.atoms, table.probs, weights, rules)[index]
    per_context = weights[index]
    taus.setflags(write=False)
    per_context.setflags(write=False)
    table._cache[_TAUS_KEY] = (rules, taus, per_context)
    return taus, per_context


def sampled_stop(table: TableArrays, rules: tuple[Rule, ...], rule_index: int, context: int, prompt: int,
                 query: int, atoms: np.ndarray) -> int:
    """Completions a pull draws under ``rules[rule_index]`` in ``context`` when its completions come out as ``atoms``
    (L,) in draw order with cap L: the first k after which the rule stops (checked after every completion), else L.

    The sampled counterpart of the exact expectations, vectorized over the draws: majority vote checks
    ``vote_stops`` on the running counts' top two; Best-of-N compares each completion's utility w . a (w the
    context's objective weights) with the context's tau (``context_thresholds``). ``FixedN`` draws all L.
    """
    rule = rules[rule_index]
    atoms = np.asarray(atoms, dtype=np.int64).reshape(-1)
    length = atoms.size
    if isinstance(rule, FixedN) or length == 0:
        return length
    if table.aggregator == "mv":
        n_buckets = table.probs.shape[-1]
        counts = np.zeros((length, max(n_buckets, 2)), dtype=np.int64)
        counts[np.arange(length), atoms] = 1
        np.cumsum(counts, axis=0, out=counts)
        top2 = np.partition(counts, counts.shape[1] - 2, axis=1)[:, -2:]
        stop = vote_stops(rule, top2[:, 1], top2[:, 0], max(table.n_max, length))
    else:
        assert table.atoms is not None
        taus, weights = context_thresholds(table, rules)
        scores = table.atoms[prompt, query] @ weights[context]  # as ``thresholds`` scores the table's cells
        stop = scores[atoms] >= taus[context, rule_index]
    return int(stop.argmax()) + 1 if stop.any() else length
