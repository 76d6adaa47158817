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
- doubly robust (DR): mean of q^_{-i} + o_i / P_i (y_i - q^_{-i}), where o_i says whether row i observed the
  candidate's utility y_i in context x_i, P_i is the probability of that observation under the logging
  distribution at row i, and q^_{-i} is a direct-method model of the candidate's utility cross-fitted by leaving
  row i out ("DR's observation model" below);
- the logging policy's on-policy value, the mean of r_i, and DR minus it, on paired per-row terms.

DR's observation model. Where the log determines the logging policy's whole distribution at every row
(``logging_model``: the exploring learner of ``serve --learn``, whose rows record the greedy arm, the contender,
the exploring share s and the uniform part: the contender s (1 - u), each of the K arms of the uniform part
s u / K, the greedy arm the rest, s = 0 where its budget left nothing to explore; also the learner's two
earlier forms, a contender without the uniform part, and greedy with probability 1 - s and each of the other
K - 1 arms s / (K - 1)), and for a Best-of-N candidate arm (p, n) of fixed N: a row served prompt p with
N_i >= n completions, valued by its scores (no feedback), observes the candidate's utility y_i = the best of its
first n weighted scores + cost_weight * n * unit_cost (the completions are independent draws, so their first n
are n draws: nested reuse, only completions the row drew); P_i = the probability that the learner served
prompt p with some N >= n at row i (all K arms' probabilities summed), larger than the exact arm's propensity;
q^_{-i} = the mean over every other logged Best-of-N row (any context) that drew >= n completions of prompt p of
the best of its first n under x_i's objective weights (the logged objective score vectors) plus the cost term:
a pooled model, exact in expectation where queries do not depend on the context, and DR stays unbiased when
it is not (the model only moves the variance). Rows where P_i = 0 (the budget left the learner only its
greedy arm, and it does not observe the candidate's) get q^ alone (counted as ``unobservable``). Otherwise
(majority vote, feedback-valued rows, an arm with a stopping rule, or a log whose distribution is not
determined: a fixed stochastic logger records only the served arm's propensity) y_i is observed on the exact
arm, P_i is its propensity, and q^_{-i} the plug-in mean of the logged utilities of (context, candidate's arm)
without row i (0 where no other row has it). ``Evaluation.dr_observation`` says which model DR used;
``observed`` counts the rows that observed the candidate.

Each comes with a 95 % normal confidence interval over the per-request terms (mean +- 1.96 standard errors;
for SNIPS the delta method: the terms w_i (r_i - SNIPS) / mean(w)). A context where the candidate's arm was
never logged has no IPS or SNIPS estimate (``support`` 0), one with no row observing the candidate no DR
estimate; the overall estimate needs every context's.
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

__all__ = ["Estimate", "Evaluation", "LoggingModel", "Z95", "arm_key", "evaluate", "logging_model",
           "row_utility"]

#: The share of the rows used above which ``format_report`` warns that DR rests on its model alone on too many
#: (rows that could not observe the candidate's arm).
UNOBSERVABLE_WARN = 0.05
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
    observed: int = 0  # rows where DR observed the candidate's utility
    unobservable: int = 0  # rows where the logging distribution gave the candidate's arm no chance to be observed
    dr_observation: str | None = None  # overall: what DR's observation model was (module docstring)

    def to_dict(self) -> dict[str, Any]:
        """As JSON."""
        def est(e: Estimate | None) -> dict[str, float | int] | None:
            return None if e is None else e.to_dict()
        return {"context": self.name, "weights": None if self.weights is None else list(self.weights),
                "candidate_arm": self.candidate_arm, "rows": self.rows, "support": self.support,
                "logged": est(self.logged), "ips": est(self.ips), "snips": est(self.snips), "dr": est(self.dr),
                "dr_minus_logged": est(self.dr_minus_logged), "logged_arms": self.logged_arms,
                "observed": self.observed, "unobservable": self.unobservable, "dr_observation": self.dr_observation}


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
    completions = row.n if _fixed(row.rule) else row.drawn
    return quality + cost_weight * completions * float(unit)


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(a, b, strict=True))


def _fixed(rule: Mapping[str, Any] | None) -> bool:
    return not rule or rule.get("name") == "fixed"


@dataclass(frozen=True)
class LoggingModel:
    """The logging policy's whole distribution over arms at each logged request, where the log determines it: the
    exploring learner of ``serve --learn``, either in the contender form (each row's own distribution, recorded in
    the row) or in the uniform form (greedy arm with probability 1 - s, each of the other K - 1 candidate arms
    s / (K - 1); s = 0 where its budget left nothing to explore; its arms every prompt of the policy with every N
    of its contexts) (module docstring, "DR's observation model")."""

    prompts: frozenset[str]  # the prompts served (a prompt of the K / len(ns) never served is not named)
    ns: tuple[int, ...]
    share: float
    arms: int  # K (0 for the contender form)
    #: The contender form (rows with ``outcomes.learn.contender``): each row's distribution is its own, the
    #: contender, a uniform part over the row's candidate arms and the greedy arm the rest (``_row_arms``).
    contender: bool = False

    def has_prompt(self, prompt: str) -> bool:
        """Whether ``prompt`` is one of the learner's: served, or possibly one of those never served."""
        return prompt in self.prompts or len(self.prompts) < self.arms // len(self.ns)


def logging_model(rows: Sequence[LogRow]) -> tuple[LoggingModel | None, str]:
    """The ``LoggingModel`` the rows were drawn from, with a sentence saying how it was found, or None and why not.

    Every row must carry ``outcomes["learn"]`` (``{"explored", "greedy"}``, as ``serve --learn`` writes it) or be
    served with propensity 1. The share s is 1 - the propensity of the greedy rows that could explore, one value
    for all; K is 1 + s / the explored rows' propensity, one value for all (within 1e-9); the Ns are those served
    (greedy or explored), and K must be a multiple of their number, with at most K / len(Ns) prompts served. A log
    of another logging policy (a fixed stochastic one, a policy swap that changed the arms, a learner that
    explores otherwise) fails these checks and gets None."""
    if any({"contender", "share"} & set(row.outcomes.get("learn") or {}) for row in rows):
        return _contender_model(rows)
    prompts: set[str] = set()
    ns: set[int] = set()
    shares: list[float] = []
    explored: list[float] = []
    records, why = _learner_records(rows)
    if why:
        return None, why
    for row, learn in records:
        greedy = learn.get("greedy")
        if not isinstance(greedy, list) or len(greedy) != 2:
            return None, f"row {row.id}'s learner record has no greedy arm [prompt, N]"
        prompts.update((row.prompt, str(greedy[0])))
        ns.update((int(row.n), int(greedy[1])))
        if bool(learn.get("explored")) == ((row.prompt, int(row.n)) == (str(greedy[0]), int(greedy[1]))):
            return None, f"row {row.id} says explored={learn.get('explored')} and served {row.prompt}/{row.n} with " \
                         f"greedy arm {greedy[0]}/{greedy[1]} (an explored row serves another arm than the greedy one)"
        if learn.get("explored"):
            explored.append(row.propensity)
        elif row.propensity < 1.0:
            shares.append(1.0 - row.propensity)
    if not shares or not explored:
        return None, "no explored row and greedy row of an exploring learner (outcomes.learn, propensity below 1)"
    share = shares[0]
    if any(not math.isclose(s, share, rel_tol=1e-9, abs_tol=1e-12) for s in shares):
        return None, "the greedy rows' propensities differ (not one explore share)"
    k = 1 + share / explored[0]
    arms = round(k)
    if arms < 2 or abs(k - arms) > 1e-6 or any(not math.isclose(p, share / (arms - 1), rel_tol=1e-9, abs_tol=1e-12)
                                   for p in explored):
        return None, "the explored rows' propensities are not one share / (K - 1)"
    if arms % len(ns) or len(prompts) > arms // len(ns):
        return None, (f"K = {arms} arms do not fit the {len(prompts)} prompts x {len(ns)} Ns served (another "
                      "logging policy, or a policy swap that changed the arms)")
    model = LoggingModel(frozenset(prompts), tuple(sorted(ns)), share, arms)
    return model, (f"serve --learn's exploration: greedy arm 1 - {share:g}, each other of the K = {arms} arms "
                   f"({arms // len(ns)} prompts x N in {sorted(ns)}) {share:g}/{arms - 1}")


def _learner_records(rows: Sequence[LogRow]) -> tuple[list[tuple[LogRow, Mapping[str, Any]]], str]:
    """The rows with a learner record (``outcomes.learn``) and their records; the others must have been served
    with propensity 1, else no records and why not."""
    records = []
    for row in rows:
        learn = row.outcomes.get("learn")
        if learn is None:
            if row.propensity != 1.0:
                return [], f"row {row.id} has propensity {row.propensity} and no learner record (outcomes.learn)"
            continue
        records.append((row, learn))
    return records, ""


def _contender_model(rows: Sequence[LogRow]) -> tuple[LoggingModel | None, str]:
    """``logging_model`` for rows whose learner record names the contender (``{"explored", "greedy",
    "contender"}``). A record with ``share`` s carries its row's whole distribution (``_row_arms``): the contender
    s - u, each of the K arms of ``spread`` (mass u, the uniform part) u / K, the greedy arm the rest; the served
    arm's probability under it must be the row's propensity. A record without ``share`` (the learner before the
    uniform part) serves its contender with one s for all rows as propensity, its greedy arm 1 - s where it has a
    contender and 1 where it has none."""
    shares: set[float] = set()
    records, why = _learner_records(rows)
    if why:
        return None, why
    spread = False
    for row, learn in records:
        greedy, contender = learn.get("greedy"), learn.get("contender")
        if not isinstance(greedy, list) or len(greedy) != 2 or (contender is not None and (
                not isinstance(contender, list) or len(contender) != 2)):
            return None, f"row {row.id}'s learner record has no greedy arm or contender [prompt, N]"
        arm = [row.prompt, int(row.n)]
        if bool(learn.get("explored")) == (arm == [str(greedy[0]), int(greedy[1])]):
            return None, f"row {row.id} says explored={learn.get('explored')} and served {row.prompt}/{row.n} with " \
                         f"greedy arm {greedy[0]}/{greedy[1]} (an explored row serves another arm than the greedy one)"
        if "share" in learn:
            try:
                arms, uniform = _row_arms(learn, 0.0)
            except (TypeError, ValueError, KeyError) as exc:
                return None, f"row {row.id}'s learner record is not a distribution: {exc}"
            spread = spread or uniform[2] > 0
            p = _mass(arms, uniform, row.prompt, int(row.n), nested=False)
            if not math.isclose(p, row.propensity, rel_tol=1e-9, abs_tol=1e-12):
                return None, (f"row {row.id}'s propensity {row.propensity} is not its learner record's probability "
                              f"{p} of the arm it served")
            continue
        if learn.get("explored"):
            if contender is None or [str(contender[0]), int(contender[1])] != arm:
                return None, f"row {row.id} says explored and did not serve its contender {contender}"
            shares.add(round(row.propensity, 12))
        else:
            if contender is None and row.propensity != 1.0:
                return None, f"row {row.id} has no contender and propensity {row.propensity} (expected 1)"
            if contender is not None:
                shares.add(round(1.0 - row.propensity, 12))
    if len(shares) > 1:
        return None, f"the rows' explore shares differ ({sorted(shares)}; one share s expected)"
    share = shares.pop() if shares else 0.0
    how = ("serve --learn's exploration, each row's own distribution: its contender, the uniform part over its K "
           "candidate arms, the greedy arm the rest" if spread else
           f"serve --learn's directed exploration: its contender {share:g}, the greedy arm 1 - {share:g}, every "
           "other arm 0")
    return LoggingModel(frozenset(), (), share, 0, contender=True), how


def _row_arms(learn: Mapping[str, Any], share: float) -> tuple[list[tuple[str, int, float]],
                                                                  tuple[frozenset[str], tuple[int, ...], float]]:
    """A contender-form row's distribution: the greedy arm's and the contender's (prompt, N, mass) and the uniform
    part (its prompts, its Ns, its whole mass u; each of its K arms has u / K on top). ``share`` is s for a record
    without its own (the learner before the uniform part). ValueError for a record that is not a distribution."""
    contender = learn.get("contender")
    if "share" in learn:
        share = float(learn["share"])
    elif contender is None:
        share = 0.0
    spread = learn.get("spread") or {"share": 0.0, "prompts": [], "ns": []}
    u = float(spread["share"])
    prompts = frozenset(str(p) for p in spread["prompts"])
    ns = tuple(sorted({int(n) for n in spread["ns"]}))
    if not (0.0 <= u <= share < 1.0) or (u > 0 and (not prompts or not ns or ns[0] < 1)):
        raise ValueError(f"share {share}, uniform part {u} over {len(prompts)} prompts x Ns {list(ns)} (expected "
                         "0 <= uniform part <= share < 1 over at least one prompt and N >= 1)")
    directed = share - u if contender is not None else 0.0
    arms = [(str(learn["greedy"][0]), int(learn["greedy"][1]), 1.0 - directed - u)]
    if contender is not None:
        arms.append((str(contender[0]), int(contender[1]), directed))
    return arms, (prompts, ns, u)


def _mass(arms: Sequence[tuple[str, int, float]], uniform: tuple[frozenset[str], tuple[int, ...], float],
          prompt: str, n: int, nested: bool) -> float:
    """The probability of the arms that show (``prompt``, ``n``) under a row's distribution (``_row_arms``): that arm,
    or with ``nested`` any arm of ``prompt`` with N >= n."""
    prompts, ns, u = uniform
    mass = sum(w for p, m, w in arms if p == prompt and (m >= n if nested else m == n))
    if u > 0 and prompt in prompts:
        mass += u / (len(prompts) * len(ns)) * sum((m >= n if nested else m == n) for m in ns)
    return mass


def _scored(row: LogRow) -> bool:
    """Whether a row's utility is its completions' scores (Best-of-N without feedback), so that a candidate arm of the
    same prompt and a smaller N is observed from its first completions."""
    return row.outcomes.get("aggregator") == "bon" and row.reward is None and _fixed(row.rule) and \
        isinstance(row.outcomes.get("scores"), list) and len(row.outcomes["scores"]) >= 1


def _unit(row: LogRow, prompt: str, costs: Mapping[str, float]) -> float:
    unit = row.unit_cost if row.unit_cost is not None and row.prompt == prompt else costs.get(prompt)
    if unit is None:
        raise LogError(f"the log has no cost per completion for prompt {prompt!r} (the serving policy had no "
                       f"arm_estimates), and the contexts' cost weights need one: give --cost {prompt}=VALUE in "
                       "the unit of the cost weights")
    return float(unit)


def evaluate(rows: Iterable[LogRow], candidate: PolicyFile, *, costs: Mapping[str, float] | None = None,
             terms: dict[str, np.ndarray] | None = None) -> tuple[list[Evaluation], Evaluation, dict[str, int]]:
    """Per logged context and overall, the candidate's estimated value and the logging policy's (module
    docstring); the counts of rows ``used``, ``unrated`` (no utility), ``uncovered`` (no candidate context),
    ``observed`` (where DR observed the candidate's utility) and ``unobservable`` (where the logging distribution
    gave the candidate's arm no chance to be observed: DR's term there is its model's alone). ``terms``: a dict
    to receive DR's per-row inputs over the rows used, in order (``y``, ``observed``, ``probability``, ``model``,
    ``dr``), for a check of the estimator by another implementation (``research/ope_vs_obp.py``)."""
    costs = dict(costs or {})
    kept: list[LogRow] = []
    keys: list[tuple[float, ...]] = []
    names: dict[tuple[float, ...], str] = {}
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
        if not (0 < row.propensity <= 1 and math.isfinite(row.propensity)):
            raise LogError(f"row {row.id}: propensity {row.propensity!r} is not a probability in (0, 1]")
        kept.append(row)
        keys.append(key)
        utils.append(r)
        counts["used"] += 1
    if not keys:
        raise LogError(f"no logged request can be evaluated: {counts['unrated']} without a utility (majority vote "
                       f"without feedback), {counts['uncovered']} in contexts the candidate does not have")
    n_rows = len(kept)
    r_all = np.asarray(utils, dtype=np.float64)
    p_all = np.fromiter((row.propensity for row in kept), dtype=np.float64, count=n_rows)
    arms = [arm_key(row.prompt, row.n, row.rule) for row in kept]
    ctx_index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    ctx_of = np.fromiter((ctx_index[k] for k in keys), dtype=np.int64, count=n_rows)
    target_arm = {k: _context_arm(c) for k, c in target.items() if c is not None}
    match = np.fromiter((a == target_arm[k] for a, k in zip(arms, keys, strict=True)), dtype=bool, count=n_rows)
    w = np.where(match, 1.0 / p_all, 0.0)
    ips_terms = w * r_all
    n_ctx = len(ctx_index)

    # DR's observation of the candidate's utility y_i, its probability o_i and the cross-fitted model q^_{-i}
    model, how = logging_model(kept)
    observed = match.copy()
    y = np.where(match, r_all, 0.0)
    o_prob = np.where(match, p_all, 1.0)  # without a logging model: the exact arm, its logged propensity
    q_hat = np.zeros(n_rows)
    pooled: _PooledScores | None = None
    nested = np.zeros(n_ctx, dtype=bool)  # contexts whose DR uses the nested observation and the pooled model
    for key, ci in ctx_index.items():
        ctx = target[key]
        assert ctx is not None
        sel = np.flatnonzero(ctx_of == ci)
        fixed = getattr(ctx, "rule", None) is None
        if model is not None:
            o_prob[sel] = [_arm_probability(kept[j], model, ctx.prompt, ctx.n, fixed and _scored(kept[j]))
                           for j in sel]
        if model is not None and fixed and candidate.aggregator == "bon":
            nested[ci] = True
            for j in sel:
                row = kept[j]
                if row.prompt == ctx.prompt and _scored(row) and row.n >= ctx.n:
                    observed[j] = True
                    unit = _unit(row, ctx.prompt, costs) if ctx.cost_weight != 0 else 0.0
                    y[j] = max(row.outcomes["scores"][:ctx.n]) + ctx.cost_weight * ctx.n * unit
            pooled = pooled if pooled is not None else _PooledScores(kept, costs)
            q_hat[sel] = pooled.model(n_rows, sel, ctx)
        else:
            s = float(y[sel][observed[sel]].sum())
            c = int(observed[sel].sum())
            s_i = s - np.where(observed[sel], y[sel], 0.0)
            c_i = c - observed[sel]
            q_hat[sel] = np.divide(s_i, c_i, out=np.zeros(sel.size), where=c_i > 0)
    unobservable = o_prob <= 0
    dr_terms = q_hat + np.where(observed & ~unobservable, (y - q_hat) / np.where(unobservable, 1.0, o_prob), 0.0)
    counts["observed"] = int(observed.sum())
    counts["unobservable"] = int(unobservable.sum())
    if terms is not None:
        terms.update(y=y, observed=observed, probability=o_prob, model=q_hat, dr=dr_terms)

    def block(name: str, weights: tuple[float, ...] | None, arm: dict[str, Any] | None, sel: np.ndarray) -> Evaluation:
        r, wt = r_all[sel], w[sel]
        logged_arms: dict[str, int] = {}
        for a in (arms[i] for i in np.flatnonzero(sel)):
            logged_arms[a] = logged_arms.get(a, 0) + 1
        ev = Evaluation(name, weights, arm, int(sel.sum()), int(match[sel].sum()), Estimate.of(r),
                        logged_arms=logged_arms, observed=int(observed[sel].sum()),
                        unobservable=int(unobservable[sel].sum()))
        if ev.observed > 0:
            ev.dr = Estimate.of(dr_terms[sel])
            ev.dr_minus_logged = Estimate.of(dr_terms[sel] - r)
        if ev.support == 0:
            return ev
        ev.ips = Estimate.of(ips_terms[sel])
        mean_w = float(wt.mean())
        snips = float((wt * r).sum() / wt.sum())
        ev.snips = Estimate(snips, Estimate.of(wt * (r - snips) / mean_w).stderr, ev.rows)
        return ev

    per_context = []
    for key, i in ctx_index.items():
        ctx = target[key]
        assert ctx is not None
        rule = getattr(ctx, "rule", None)
        arm = {"context": ctx.name, "prompt": ctx.prompt, "n": ctx.n,
               "rule": rule.to_dict() if rule is not None else None}
        per_context.append(block(names[key], key, arm, ctx_of == i))
    overall = block("overall", None, None, np.ones(n_rows, dtype=bool))
    overall.dr_observation = (f"nested (Best-of-N: first N completions of the same prompt) under {how}"
                              if nested.all() else
                              f"the candidate's arm under {how}" if model is not None else
                              f"the candidate's arm with its logged propensity (no logging distribution: {how})")
    if any(e.support == 0 for e in per_context):
        overall.ips = overall.snips = None  # a context it cannot estimate
    if any(e.dr is None for e in per_context):
        overall.dr = overall.dr_minus_logged = None
    return per_context, overall, counts


def _arm_probability(row: LogRow, model: LoggingModel, prompt: str, n: int, nested: bool) -> float:
    """The probability that the logging policy served ``row``'s request an arm from which the candidate's arm
    (``prompt``, ``n``) is observed: that arm itself, or with ``nested`` any arm of the same prompt and N >= n."""
    learn = row.outcomes.get("learn")
    if learn is None:  # served deterministically (propensity 1): only its own arm
        return 1.0 if row.prompt == prompt and (row.n >= n if nested else row.n == n) else 0.0
    if model.contender:
        arms, uniform = _row_arms(learn, model.share)
        return _mass(arms, uniform, prompt, n, nested)
    share = model.share if learn.get("explored") else 1.0 - row.propensity
    g_prompt, g_n = str(learn["greedy"][0]), int(learn["greedy"][1])
    if nested:
        greedy_in = g_prompt == prompt and g_n >= n
        arms_in = sum(m >= n for m in model.ns) if model.has_prompt(prompt) else 0
    else:
        greedy_in = g_prompt == prompt and g_n == n
        arms_in = int(model.has_prompt(prompt) and n in model.ns)
    return (1.0 - share) * greedy_in + share / (model.arms - 1) * (arms_in - greedy_in)


class _PooledScores:
    """The logged objective score vectors of the Best-of-N rows valued by their scores, per prompt, for DR's pooled
    model: ``vectors[p]`` (rows of prompt p, their largest N, objectives) padded with nan, ``index[p]`` the rows'
    positions, ``n[p]`` their N, ``unit[p]`` their cost per completion (nan where unknown)."""

    def __init__(self, rows: Sequence[LogRow], costs: Mapping[str, float]) -> None:
        groups: dict[str, list[int]] = {}
        for j, row in enumerate(rows):
            v = row.outcomes.get("objective_scores")
            if _scored(row) and isinstance(v, list) and len(v) >= row.n:
                groups.setdefault(row.prompt, []).append(j)
        self.vectors: dict[str, np.ndarray] = {}
        self.index: dict[str, np.ndarray] = {}
        self.n: dict[str, np.ndarray] = {}
        self.unit: dict[str, np.ndarray] = {}
        for prompt, idx in groups.items():
            width = max(rows[j].n for j in idx)
            dims = len(rows[idx[0]].outcomes["objective_scores"][0])
            v = np.full((len(idx), width, dims), np.nan)
            for k, j in enumerate(idx):
                v[k, :rows[j].n] = rows[j].outcomes["objective_scores"][:rows[j].n]
            self.vectors[prompt], self.index[prompt] = v, np.asarray(idx, dtype=np.int64)
            self.n[prompt] = np.fromiter((rows[j].n for j in idx), dtype=np.int64, count=len(idx))
            units = [rows[j].unit_cost if rows[j].unit_cost is not None else costs.get(prompt) for j in idx]
            self.unit[prompt] = np.array([math.nan if u is None else float(u) for u in units])

    def model(self, n_rows: int, sel: np.ndarray, ctx: PolicyContext) -> np.ndarray:
        """DR's model q^_{-i} of the candidate's arm (p, n) in context ``ctx`` for the rows ``sel`` of that context:
        the mean over every other logged Best-of-N row (any context) that drew n or more completions of prompt p
        of the best of its first n completions under ``ctx``'s objective weights (their logged objective scores),
        plus the cost term; row i itself left out (cross-fitting). 0 where no other row has them."""
        values = np.full(n_rows, np.nan)
        prompt, n = ctx.prompt, ctx.n
        if prompt in self.vectors:
            ok = self.n[prompt] >= n
            if ctx.cost_weight != 0:
                unit = self.unit[prompt]
                if np.isnan(unit[ok]).any():
                    raise LogError(f"the log has no cost per completion for prompt {prompt!r} (the serving policy had "
                                   f"no arm_estimates), and the contexts' cost weights need one: give --cost "
                                   f"{prompt}=VALUE in the unit of the cost weights")
            else:
                unit = np.zeros(ok.size)
            best = (self.vectors[prompt][ok, :n] @ np.asarray(ctx.objective_weights, dtype=np.float64)).max(axis=1)
            values[self.index[prompt][ok]] = best + ctx.cost_weight * n * unit[ok]
        have = ~np.isnan(values)
        total, count = float(values[have].sum()), int(have.sum())
        own = np.where(have[sel], values[sel], 0.0)
        c_i = count - have[sel]
        return np.divide(total - own, c_i, out=np.zeros(sel.size), where=c_i > 0)


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
    if overall.dr_observation is not None:
        lines.append(f"DR observes the candidate's arm: {overall.dr_observation}; on {counts.get('observed', 0)} "
                     f"rows ({counts.get('unobservable', 0)} rows could not observe it: the model alone there)")
        if counts.get("unobservable", 0) > UNOBSERVABLE_WARN * max(1, counts["used"]):
            lines.append("DR's interval leaves out the model's own error on the rows that could not observe the "
                         "candidate's arm, and they are many: it is too narrow (a log of serve --learn without the "
                         "uniform part, --learn-spread 0, or with a small --explore-share: judge the candidate on a "
                         "log of a learner that spreads its exploration)")
    return "\n".join(lines)
