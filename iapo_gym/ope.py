"""Off-policy evaluation of a policy file on an outcome log (``iapo-gym evaluate-log LOG --policy CANDIDATE.json``).

The log (``iapo_gym.outcome_log``, written by ``serve --log``) holds, per answered request i, its context x_i
(the weights), the arm a_i served (prompt, N, stopping rule), the probability p_i with which it was chosen
(``propensity``) and, once known, its utility r_i under its own weights:

    r_i = sum_k w_k * q_k + cost_weight * N_i * unit_cost(prompt_i)

where q is the quality: the caller's feedback (``POST /v1/feedback``: true/false or a number is the quality of a
one-objective policy, and the weighted quality of a policy of several objectives; a vector is weighted by the
context's objective weights), else for Best-of-N the served completion's weighted score; a majority-vote row
without feedback has no utility and is left out (counted as ``unrated``). ``N_i`` is the context's N (fixed N,
and the lossless early stop of a majority vote, which the utility counts as N), or the completions drawn for
an arm with a stopping rule. ``unit_cost`` is the serving policy's cost per completion of the prompt (its
``arm_estimates``, the unit its cost weights are in), or ``--cost PROMPT=VALUE`` where the log has none.

The candidate pi_e is deterministic: in context x it serves the arm of its context with the same weights (a
logged context whose weights no candidate context has is not evaluated: counted as ``uncovered``). With
w_i = 1[a_i = pi_e(x_i)] / p_i, per context (the rows of that context) and overall (all rated rows: the
logged distribution of contexts):

- IPS: mean of w_i r_i;
- self-normalized IPS (SNIPS): sum w_i r_i / sum w_i;
- doubly robust (DR): mean of q^(x_i, pi_e(x_i)) + w_i (r_i - q^(x_i, pi_e(x_i))), with the direct-method model
  q^ the plug-in mean of the logged utilities of (context, arm), cross-fitted by leaving row i out
  (q^_{-i}: the mean over the other rows of that context and arm; 0 where there is none, when DR is IPS);
- the logging policy's on-policy value, the mean of r_i, and DR minus it, on paired per-row terms.

Each comes with a 95 % normal confidence interval over the per-request terms (mean +- 1.96 standard errors;
for SNIPS the delta method: the terms w_i (r_i - SNIPS) / mean(w)). A context where the candidate's arm was
never logged has no estimate (``support`` 0): no estimator can say anything of an arm never served there.
The estimators assume the recorded propensities are the true ones, and that rows with feedback are not
chosen by their outcome.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from iapo_gym.outcome_log import LogError, LogRow
from iapo_gym.policyfile import PolicyContext, PolicyFile

__all__ = ["Estimate", "Evaluation", "Z95", "arm_key", "evaluate", "row_utility"]

#: The normal quantile of a two-sided 95 % interval.
Z95 = 1.959963984540054


@dataclass(frozen=True)
class Estimate:
    """A value with its 95 % normal interval over ``rows`` per-request terms (``stderr``: the terms' standard
    deviation over sqrt(rows))."""

    value: float
    stderr: float
    rows: int

    @property
    def low(self) -> float:
        """The interval's lower end."""
        return self.value - Z95 * self.stderr

    @property
    def high(self) -> float:
        """The interval's upper end."""
        return self.value + Z95 * self.stderr

    def covers(self, x: float) -> bool:
        """Whether ``x`` lies in the interval."""
        return self.low <= x <= self.high

    def to_dict(self) -> dict[str, float | int]:
        """The estimate as JSON: value, stderr, the interval and the rows."""
        return {"value": self.value, "stderr": self.stderr, "low": self.low, "high": self.high, "rows": self.rows}

    @classmethod
    def of(cls, terms: np.ndarray) -> Estimate:
        """The mean of ``terms`` with its standard error."""
        n = int(terms.size)
        sd = float(terms.std(ddof=1)) if n > 1 else math.inf
        return cls(float(terms.mean()), sd / math.sqrt(n), n)


@dataclass
class Evaluation:
    """One context's (or the overall) estimates (module docstring)."""

    name: str
    weights: tuple[float, ...] | None
    candidate_arm: dict[str, Any] | None
    rows: int  # rated rows
    support: int  # rows that served the candidate's arm
    logged: Estimate
    ips: Estimate | None = None
    snips: Estimate | None = None
    dr: Estimate | None = None
    dr_minus_logged: Estimate | None = None
    logged_arms: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """As JSON."""
        def est(e: Estimate | None) -> dict[str, float | int] | None:
            return None if e is None else e.to_dict()
        return {"context": self.name, "weights": None if self.weights is None else list(self.weights),
                "candidate_arm": self.candidate_arm, "rows": self.rows, "support": self.support,
                "logged": est(self.logged), "ips": est(self.ips), "snips": est(self.snips), "dr": est(self.dr),
                "dr_minus_logged": est(self.dr_minus_logged), "logged_arms": self.logged_arms}


def arm_key(prompt: str, n: int, rule: Mapping[str, Any] | None) -> str:
    """An arm as text: ``prompt/N``, with its stopping rule when it has one other than fixed N."""
    if not rule or rule.get("name") == "fixed":
        return f"{prompt}/{n}"
    return f"{prompt}/{n}/{json.dumps(dict(rule), sort_keys=True, separators=(',', ':'))}"


def _context_arm(c: PolicyContext) -> str:
    rule = getattr(c, "rule", None)
    return arm_key(c.prompt, c.n, rule.to_dict() if rule is not None else None)


def row_utility(row: LogRow, costs: Mapping[str, float]) -> float | None:
    """The utility r of a logged request under its own weights (module docstring); None for a majority-vote row
    without feedback. Raises ``LogError`` when the cost term needs a cost per completion the log lacks."""
    weights = row.weights[:-1]
    cost_weight = row.weights[-1]
    reward = row.reward
    if isinstance(reward, list):
        if len(reward) != len(weights):
            raise LogError(f"row {row.id}: a feedback vector of {len(reward)} values for {len(weights)} objectives")
        quality = float(np.dot(weights, reward))
    elif reward is not None:
        value = float(reward)
        quality = weights[0] * value if len(weights) == 1 else value
    elif row.outcomes.get("aggregator") == "bon":
        quality = float(row.outcomes["scores"][row.outcomes["chosen"]])
    else:
        return None
    if cost_weight == 0:
        return quality
    unit = row.unit_cost if row.unit_cost is not None else costs.get(row.prompt)
    if unit is None:
        raise LogError(f"the log has no cost per completion for prompt {row.prompt!r} (the serving policy had no "
                       f"arm_estimates), and the contexts' cost weights need one: give --cost {row.prompt}=VALUE in "
                       "the unit of the cost weights")
    fixed = not row.rule or row.rule.get("name") == "fixed"
    completions = row.n if fixed else row.drawn
    return quality + cost_weight * completions * float(unit)


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(a, b, strict=True))


def evaluate(rows: Iterable[LogRow], candidate: PolicyFile, *,
             costs: Mapping[str, float] | None = None) -> tuple[list[Evaluation], Evaluation, dict[str, int]]:
    """Per logged context and overall, the candidate's estimated value and the logging policy's (module
    docstring); the counts of rows ``used``, ``unrated`` (no utility) and ``uncovered`` (no candidate context)."""
    costs = dict(costs or {})
    keys: list[tuple[float, ...]] = []
    names: dict[tuple[float, ...], str] = {}
    arms: list[str] = []
    props: list[float] = []
    utils: list[float] = []
    counts = {"used": 0, "unrated": 0, "uncovered": 0}
    target: dict[tuple[float, ...], PolicyContext | None] = {}
    for row in rows:
        key = tuple(row.weights)
        if key not in target:
            target[key] = next((c for c in candidate.contexts if _same(c.weights, key)), None)
            names[key] = row.context
        if target[key] is None:
            counts["uncovered"] += 1
            continue
        r = row_utility(row, costs)
        if r is None:
            counts["unrated"] += 1
            continue
        if not (row.propensity > 0 and math.isfinite(row.propensity)):
            raise LogError(f"row {row.id}: propensity {row.propensity!r} is not a probability > 0")
        keys.append(key)
        arms.append(arm_key(row.prompt, row.n, row.rule))
        props.append(row.propensity)
        utils.append(r)
        counts["used"] += 1
    if not keys:
        raise LogError(f"no logged request can be evaluated: {counts['unrated']} without a utility (majority vote "
                       f"without feedback), {counts['uncovered']} in contexts the candidate does not have")
    r_all = np.asarray(utils, dtype=np.float64)
    p_all = np.asarray(props, dtype=np.float64)
    ctx_index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    ctx_of = np.fromiter((ctx_index[k] for k in keys), dtype=np.int64, count=len(keys))
    target_arm = {k: _context_arm(c) for k, c in target.items() if c is not None}
    match = np.fromiter((a == target_arm[k] for a, k in zip(arms, keys, strict=True)), dtype=bool, count=len(keys))
    w = np.where(match, 1.0 / p_all, 0.0)
    # the plug-in q^(x, pi_e(x)) with row i left out: per context, the sum and count of the candidate arm's rows
    n_ctx = len(ctx_index)
    s = np.bincount(ctx_of, weights=np.where(match, r_all, 0.0), minlength=n_ctx)
    c = np.bincount(ctx_of, weights=match.astype(np.float64), minlength=n_ctx)
    s_i = s[ctx_of] - np.where(match, r_all, 0.0)
    c_i = c[ctx_of] - match
    q_hat = np.divide(s_i, c_i, out=np.zeros_like(s_i), where=c_i > 0)
    dr_terms = q_hat + w * (r_all - q_hat)
    ips_terms = w * r_all

    def block(name: str, weights: tuple[float, ...] | None, arm: dict[str, Any] | None, sel: np.ndarray) -> Evaluation:
        r, wt = r_all[sel], w[sel]
        logged_arms: dict[str, int] = {}
        for a in (arms[i] for i in np.flatnonzero(sel)):
            logged_arms[a] = logged_arms.get(a, 0) + 1
        ev = Evaluation(name, weights, arm, int(sel.sum()), int(match[sel].sum()), Estimate.of(r),
                        logged_arms=logged_arms)
        if ev.support == 0:
            return ev
        ev.ips = Estimate.of(ips_terms[sel])
        mean_w = float(wt.mean())
        snips = float((wt * r).sum() / wt.sum())
        ev.snips = Estimate(snips, Estimate.of(wt * (r - snips) / mean_w).stderr, ev.rows)
        ev.dr = Estimate.of(dr_terms[sel])
        ev.dr_minus_logged = Estimate.of(dr_terms[sel] - r)
        return ev

    per_context = []
    for key, i in ctx_index.items():
        ctx = target[key]
        assert ctx is not None
        rule = getattr(ctx, "rule", None)
        arm = {"context": ctx.name, "prompt": ctx.prompt, "n": ctx.n,
               "rule": rule.to_dict() if rule is not None else None}
        per_context.append(block(names[key], key, arm, ctx_of == i))
    overall = block("overall", None, None, np.ones(len(keys), dtype=bool))
    if any(e.support == 0 for e in per_context):
        overall.ips = overall.snips = overall.dr = overall.dr_minus_logged = None  # a context it cannot estimate
    return per_context, overall, counts


def format_report(per_context: Sequence[Evaluation], overall: Evaluation, counts: Mapping[str, int]) -> str:
    """The evaluation as a text table: per context and overall, each estimate with its 95 % interval."""
    def cell(e: Estimate | None) -> str:
        return "no support" if e is None else f"{e.value:.4f} [{e.low:.4f}, {e.high:.4f}]"
    head = f"{'context':<16} {'rows':>7} {'support':>7}  {'logging policy':<26} {'IPS':<26} {'SNIPS':<26} {'DR':<26}"
    lines = [head, "-" * len(head)]
    for e in [*per_context, overall]:
        name = e.name if e.candidate_arm is None else f"{e.name}"
        lines.append(f"{name:<16} {e.rows:>7} {e.support:>7}  {cell(e.logged):<26} {cell(e.ips):<26} "
                     f"{cell(e.snips):<26} {cell(e.dr):<26}")
    lines.append(f"(95% normal intervals over per-request terms; rows used {counts['used']}, without a utility "
                 f"{counts['unrated']}, in contexts the candidate lacks {counts['uncovered']})")
    return "\n".join(lines)
