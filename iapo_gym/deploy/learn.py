"""``serve --learn`` and ``serve --shadow CANDIDATE.json``: learning the served arm per context from the traffic,
and what another policy would have served, without serving it (docs/deploy.md, "Learning while serving").

``ServeLearner`` keeps, for every context of the served policy, an estimate of the utility of every candidate arm
(p, N): every servable prompt (the policy file's, and the upstream spec's prompts the file never served, which the
router can render: ``extra_prompts``) with every N from 1 to the policy's ``n_max`` (Best-of-N) or every N the
policy's contexts use (majority vote, where each N is learned on its own). What it learns from:

* **Cross-context reuse.** An observation is a draw of the served arm's outcomes, not of one context's utility:
  a Best-of-N request's score vectors give the exact observed utility under *every* context's weights (each
  completion's scores, rounded to the scorer's grid, times the context's objective weights), a majority vote's
  agreement share (or the caller's feedback) the credit every context weighs by its first objective weight. Every
  context learns from every request (the online agents' "cross-context and nested reuse", docs/online.md).
* **Nested reuse (Best-of-N).** Any k of the N completions drawn are a draw of arm (p, k): one request at N
  teaches every k <= N (the mean over all k-subsets of their best, an unbiased estimate of the expected best of k,
  plus k completions' cost).
* **Forgetting.** Every estimate is a discounted mean: each request answered multiplies the weight of all earlier
  evidence (the policy file's warm start included) by ``2 ** (-1 / half_life)``, so after a drift the old
  outcomes fade within a few half-lives, and an arm not observed for long becomes uncertain again. A change
  test speeds this up: when an arm's recent mean (half-life ``FAST_SHARE x half_life``) is more than ``CHANGE_Z``
  standard errors from its long-run mean, its prompt's long-run evidence is replaced by the recent one and every
  other prompt's evidence is cut to ``RESTART_WEIGHT`` observations, so the exploration checks them again (a drift
  moves several prompts at once).
* **Warm start.** Before any request an arm's estimate is the policy file's (the context's own arm: the file's
  ``value.mean``, optimize's check; the others: the plug-in utility of its ``arm_estimates``, which underrates large
  N, docs/deploy.md "Any weights"), counted as ``prior_weight`` observations. An arm without one (a prompt the file
  never saw) has no estimate and an infinite upper bound: it is explored first.

Each request in a context is served its greedy arm (the best estimate; the policy's own arm on a tie or while no
arm has an estimate), except that with probability ``explore_share`` s it explores: with probability
``s x (1 - spread)`` it is served the *most promising* other arm, the contender: the one of highest upper
confidence bound ``estimate + bonus x sigma / sqrt(weight)`` (``sigma`` the context's pooled spread of observed
utilities, ``weight`` the arm's discounted observations), when that bound is above the greedy arm's estimate
(directed exploration: arms that cannot be better are not the contender; without one, that mass stays on the
greedy arm); with probability ``s x spread`` an arm drawn uniformly from all K candidate arms (the greedy one
included), so that every arm keeps a known probability above 0 and ``evaluate-log`` can judge any candidate
policy on the log, not only those of the greedy arms and contenders. Exploration is allowed while the budget
holds: the requests served another arm than the greedy one never exceed ``floor(explore_share x requests
chosen)``, counted over the process's lifetime and, with ``--log``, over the log it resumes from (s is 0 at a
request where one more would not fit). The served arm's propensity (the sum of the three parts' mass on it) is
the exact probability it had, and goes to the outcome log with the greedy arm, the contender, s and the uniform
part (its mass and arm set): the whole distribution the arm was drawn from.

What an answered request teaches (its observed utility, in the policy's units):

* Best-of-N: at once, under each context, the mean best of k of the completions' weighted scores for every k up
  to the completions drawn (a context with a stopping rule other than ``fixed`` learns only from its own requests,
  their served score: a rule's draws are not a prefix of a fixed N's);
* majority vote, ``reward="agreement"`` (the default): at once, the share of the completions drawn that voted
  for the winner, a proxy of correctness that needs no caller, for the served (p, N);
* majority vote, ``reward="feedback"``: when ``POST /v1/feedback`` brings the caller's reward for the response
  (true/false as 1/0, a number, or a vector weighted by the context's objective weights); a request without
  feedback teaches nothing. At most ``PENDING_MAX`` answered requests wait for theirs (the oldest are dropped);

plus ``cost_weight x completions x the prompt's unit cost`` (the file's ``arm_estimates`` cost per completion;
for a prompt without one, its observed completion tokens per completion times the cost per token observed on the
prompts that have one; 0 while nothing is known). Requests with weights no context of the policy has
(``RatedContext``) are served as the policy's estimates rate them; their outcomes teach the policy's contexts.

The learner lives in ``iapo_gym.deploy`` on the policy file's public estimator pieces (``ArmRatings``): a server
has no ``OnlineEnv`` (no table schema, no atom indices of its outcomes) for an ``iapo_gym.online`` agent to start
on, and deploy may not import ``agents`` (``.importlinter``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from iapo_gym.deploy.estimates import ArmRatings, choose_arm
from iapo_gym.outcome_log import LogRow
from iapo_gym.policyfile import PolicyContext, PolicyFile, load_policy

__all__ = ["DEFAULT_BONUS", "DEFAULT_EXPLORE_SHARE", "DEFAULT_HALF_LIFE", "DEFAULT_PRIOR_WEIGHT", "DEFAULT_SPREAD",
           "PENDING_MAX", "REWARDS", "Choice", "ServeLearner", "Shadow"]

#: The default share of requests ``--learn`` may explore.
DEFAULT_EXPLORE_SHARE = 0.05
#: Observations the policy file's plug-in estimate of an arm counts as (``--learn-prior``).
DEFAULT_PRIOR_WEIGHT = 20.0
#: Requests after which earlier evidence counts half (``--learn-half-life``).
DEFAULT_HALF_LIFE = 1500.0
#: The upper confidence bound's width in pooled standard deviations per sqrt(observation) (``--learn-bonus``).
DEFAULT_BONUS = 2.0
#: The share of the exploration spread uniformly over all candidate arms (``--learn-spread``); the rest goes to
#: the contender.
DEFAULT_SPREAD = 0.1
#: Majority vote with ``reward="feedback"``: answered requests remembered until their feedback arrives.
PENDING_MAX = 100_000
#: What a majority vote learns from.
REWARDS = ("agreement", "feedback")
#: The change test: recent evidence of half-life ``half_life x FAST_SHARE`` against the long-run mean.
FAST_SHARE = 0.125
#: Standard errors between the recent and the long-run mean of an arm that mean its outcomes changed.
CHANGE_Z = 6.0
#: Recent observations an arm needs before the change test looks at it.
CHANGE_MIN = 10.0
#: Explorations reserved at a time in the budget file (``budget_file``): one durable write per this many explored
#: requests, and after a kill -9 the budget counts at most this many explorations that never happened.
RESERVE_BLOCK = 8
#: The budget file's name in the ``--log`` folder.
BUDGET_FILE = "learn-budget.json"
#: After a detected change, the evidence every other prompt's arm keeps (in observations).
RESTART_WEIGHT = 5.0
#: A discounted weight below this is no evidence (the arm's estimate is forgotten).
_NO_WEIGHT = 1e-9


@dataclass(frozen=True)
class Choice:
    """The arm served for one request: the context as served (its prompt and N the arm's), and how it was chosen."""

    context: PolicyContext
    propensity: float
    explored: bool  # served another arm than the greedy one
    greedy: tuple[str, int]
    contender: tuple[str, int] | None = None  # the directed part's arm (None: none was promising, or s = 0)
    share: float = 0.0  # s at this request: the probability of exploring (0 where the budget allowed none)
    spread: float = 0.0  # the part of s drawn uniformly over ``arms``
    arms: tuple[tuple[str, ...], tuple[int, ...]] = ((), ())  # the candidate arms: prompts x Ns

    def to_dict(self) -> dict[str, Any]:
        """What the outcome log and the response's ``iapo.learn`` keep of the choice, the whole distribution the arm
        was drawn from: the contender ``share - spread`` (no contender: that mass on the greedy arm), each of the
        K = prompts x Ns candidate arms ``spread / K``, the greedy arm the rest."""
        out: dict[str, Any] = {"explored": self.explored, "propensity": self.propensity, "greedy": list(self.greedy),
                               "contender": None if self.contender is None else list(self.contender),
                               "share": self.share}
        if self.spread > 0:
            out["spread"] = {"share": self.spread, "prompts": list(self.arms[0]), "ns": list(self.arms[1])}
        return out


@dataclass(frozen=True)
class _Outcome:
    """What one answered request drew, in the learner's terms (from a ``Routed`` or a log row)."""

    context: str  # the context it was served in (a policy context's name, or a rated context's)
    weights: tuple[float, ...]
    prompt: str
    n: int
    fixed: bool  # drawn with no stopping rule (or ``fixed``): its first k completions are a draw of N = k
    drawn: int
    completion_tokens: int
    vectors: np.ndarray | None = None  # bon: (drawn, objectives) raw scores
    served: float | None = None  # bon: the served completion's weighted score (a rule context's own observation)
    agreement: float | None = None  # mv: share of the drawn answers that voted for the winner


def _check_number(value: Any, option: str, what: str, *, low: float, strict: bool = False,
                  high: float | None = None) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and \
        (value > low if strict else value >= low) and (high is None or value < high)
    if not ok:
        bound = f"> {low}" if strict else f">= {low}"
        raise ValueError(f"{option} must be a finite number {bound}{'' if high is None else f' and < {high}'} "
                         f"({what}), got {value!r}")
    return float(value)


class ServeLearner:
    """Per-context arm estimates learned from served requests with cross-context and nested reuse and forgetting,
    directed exploration within a hard budget, exact propensities (module docstring)."""

    def __init__(self, policy: PolicyFile, *, explore_share: float = DEFAULT_EXPLORE_SHARE, seed: int = 0,
                 reward: str = "agreement", prior_weight: float = DEFAULT_PRIOR_WEIGHT,
                 half_life: float = DEFAULT_HALF_LIFE, bonus: float = DEFAULT_BONUS, spread: float = DEFAULT_SPREAD,
                 extra_prompts: Sequence[str] = (), budget_file: str | os.PathLike[str] | None = None) -> None:
        """``policy``: the served policy file; ``explore_share``: the share of requests that may be served another
        arm than the greedy one (0 <= share < 1); ``seed``: the root of the exploration draws; ``reward``: what a
        majority vote learns from (``REWARDS``); ``prior_weight``: observations each estimate of the policy file
        counts as (>= 0; 0 ignores them); ``half_life``: requests after which evidence counts half (> 0; ``inf``
        never forgets); ``bonus``: the upper confidence bound's width (>= 0; 0 makes only arms without evidence
        contenders); ``spread``: the share of the exploration drawn uniformly over all candidate arms (0 <= spread
        <= 1; 0: the contender only, and a candidate off the greedy arms and contenders is never observed; 1: no
        direction); ``extra_prompts``: prompt ids the router can serve beyond the policy file's (the upstream spec's
        new prompts); ``budget_file``: where the explorations are reserved before they are served
        (``RESERVE_BLOCK`` at a time, an atomic fsynced write), so that the budget holds across a kill -9 that
        loses the last rows of the log (``serve --learn --log DIR`` keeps it in DIR; None: the process's
        lifetime and the rows resumed). ValueError names a bad value."""
        from iapo_gym.seeding import derive_rng

        self.explore_share = _check_number(explore_share, "--explore-share", "the share of requests explored",
                                           low=0.0, high=1.0)
        if reward not in REWARDS:
            raise ValueError(f"--learn-reward must be one of {list(REWARDS)}, got {reward!r}")
        self.prior_weight = _check_number(prior_weight, "--learn-prior",
                                          "observations the policy file's estimate of an arm counts as", low=0.0)
        if isinstance(half_life, (int, float)) and not isinstance(half_life, bool) and half_life == math.inf:
            self.half_life = math.inf
        else:
            self.half_life = _check_number(half_life, "--learn-half-life",
                                           "requests after which evidence counts half", low=0.0, strict=True)
        self.bonus = _check_number(bonus, "--learn-bonus", "the exploration bound's width in standard deviations",
                                   low=0.0)
        self.spread = _check_number(spread, "--learn-spread", "the share of the exploration drawn uniformly",
                                    low=0.0)
        if self.spread > 1:
            raise ValueError(f"--learn-spread must be a share in [0, 1] (the share of the exploration drawn uniformly), "
                             f"got {spread!r}")
        self.reward = reward
        self.extra_prompts = tuple(str(p) for p in extra_prompts)
        self.gamma = 1.0 if math.isinf(self.half_life) else 2.0 ** (-1.0 / self.half_life)
        self.fast_gamma = 2.0 ** (-1.0 / (FAST_SHARE * (self.half_life if math.isfinite(self.half_life)
                                                        else DEFAULT_HALF_LIFE)))
        self.changes = 0  # changes detected
        self.rng = derive_rng(int(seed), "iapo_gym.deploy.learn")
        self.chosen = 0  # requests an arm was chosen for (the budget's denominator)
        self.explored = 0  # of them, served another arm than the greedy one
        self.budget_file = None if budget_file is None else os.fspath(budget_file)
        self._spent = 0  # explorations the budget counts: explored, or more after a kill (the reservation)
        self._reserved = 0  # explorations reserved in the budget file
        self.observed = 0  # requests learned from (the clock of the discount)
        self._pending: OrderedDict[str, _Outcome] = OrderedDict()  # mv feedback: rid -> what it drew
        self.use_policy(policy)

    # ---- the policy ------------------------------------------------------------------------------------
    def use_policy(self, policy: PolicyFile) -> None:
        """Learn for ``policy`` from now on (a start, or a policy swap): its contexts' candidate arms, warm-started
        from its estimates; the exploration budget's counts go on."""
        self.policy = policy
        self.aggregator = policy.aggregator
        if self.reward == "feedback" and self.aggregator != "mv":
            raise ValueError("--learn-reward feedback is for a majority-vote policy; a Best-of-N policy learns from "
                             "the scores of its completions at once")
        self.unit_cost = {str(e["id"]): float(e["cost"]) for e in (policy.arm_estimates or {}).get("prompts", ())}
        ratings = (ArmRatings(policy.arm_estimates, policy.aggregator, policy.n_max, policy.objectives)
                   if policy.arm_estimates is not None else None)
        known = sorted(p.id for p in policy.prompts if p.servable)
        self.prompts = known + sorted(set(self.extra_prompts) - set(known))
        self._p = {p: i for i, p in enumerate(self.prompts)}
        self.n_max = int(policy.n_max)
        contexts = policy.contexts
        self._contexts = list(contexts)
        self._c = {c.name: i for i, c in enumerate(contexts)}
        self._objective = np.array([c.objective_weights for c in contexts], dtype=np.float64).reshape(
            len(contexts), -1)
        self._cost_weight = np.array([c.cost_weight for c in contexts], dtype=np.float64)
        self._free = np.array([c.rule is None or c.rule.fixed for c in contexts], dtype=bool)
        scorer = policy.scorer or {}
        self._grid = float(scorer["grid"]) if scorer.get("grid") else None
        shape = (len(contexts), len(self.prompts), self.n_max)
        # the candidate N: Best-of-N every N up to n_max (one request teaches every smaller N), majority vote the
        # N the policy's contexts use (each N is learned on its own)
        self._allowed = np.zeros(shape[1:], dtype=bool)
        if self.aggregator == "bon":
            self._allowed[:] = True
        else:
            self._allowed[:, sorted({c.n - 1 for c in contexts if 1 <= c.n <= self.n_max})] = True
        # the K candidate arms of the uniform part, prompt-major, and their names for the log
        self._arms = [(int(p), int(k)) for p, k in zip(*np.nonzero(self._allowed), strict=True)]
        self._arm_names = (tuple(self.prompts), tuple(int(k) + 1 for k in np.flatnonzero(self._allowed[0])))
        self._sum, self._square, self._weight = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        self._fast_sum, self._fast_weight = np.zeros(shape), np.zeros(shape)  # the recent evidence (change test)
        self._tokens = np.zeros(len(self.prompts))  # completion tokens observed per prompt
        self._completions = np.zeros(len(self.prompts))  # completions observed per prompt
        self._pending.clear()
        if self.prior_weight <= 0:
            return
        for c, ctx in enumerate(contexts):
            if ratings is not None:
                u = ratings.utilities(ctx.objective_weights, ctx.cost_weight)
                for p, pid in enumerate(self.prompts):
                    if ratings.shown(pid):
                        k = min(self.n_max, ratings.n_max)
                        self._prior(c, p, slice(0, k), u[ratings.prompts.index(pid), :k])
            if ctx.value is not None and math.isfinite(ctx.value) and 1 <= ctx.n <= self.n_max:
                self._prior(c, self._p[ctx.prompt], ctx.n - 1, float(ctx.value))  # the file's estimate of its arm

    def _prior(self, c: int, p: int, k: slice | int, mean: Any) -> None:
        self._sum[c, p, k] = self.prior_weight * np.asarray(mean)
        self._square[c, p, k] = self.prior_weight * np.asarray(mean) ** 2
        self._weight[c, p, k] = self.prior_weight

    # ---- estimates --------------------------------------------------------------------------------------
    def _estimates(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """Context ``c``'s (P, N_max) estimates (NaN: no evidence) and upper confidence bounds (inf: none)."""
        weight = self._weight[c]
        has = weight > _NO_WEIGHT
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(has, self._sum[c] / weight, np.nan)
            spread = np.where(has, self._square[c] / weight - mean ** 2, 0.0)
        total = float(weight[has].sum())
        sigma = math.sqrt(max(float((spread[has] * weight[has]).sum()) / total, 0.0)) if total > 0 else 0.0
        with np.errstate(divide="ignore"):
            upper = np.where(has, mean + self.bonus * sigma / np.sqrt(np.where(has, weight, 1.0)), np.inf)
        return np.where(self._allowed, mean, np.nan), np.where(self._allowed, upper, -np.inf)

    def _greedy(self, c: int, mean: np.ndarray) -> tuple[int, int]:
        ctx = self._contexts[c]
        own = (self._p[ctx.prompt], ctx.n - 1)
        if np.isnan(mean).all():
            return own
        best = float(np.nanmax(mean))
        if own[1] < self.n_max and mean[own] == best:
            return own
        flat = int(np.flatnonzero(mean.ravel() == best)[0])
        return flat // self.n_max, flat % self.n_max

    def greedy(self, name: str) -> tuple[str, int]:
        """The arm a context is served when not explored: the best estimate; the policy's own arm on a tie or while
        no arm has an estimate."""
        c = self._c[name]
        p, k = self._greedy(c, self._estimates(c)[0])
        return self.prompts[p], k + 1

    # ---- choosing ---------------------------------------------------------------------------------------
    def choose(self, ctx: PolicyContext) -> Choice | None:
        """The arm to serve ``ctx`` (a context the router resolved); None for weights no context of the policy has
        (served as the router rated them). One draw of the seeded generator per request; no await, so the budget's
        check and count are one step in the event loop."""
        c = self._c.get(ctx.name)
        if c is None or self._contexts[c] != ctx:
            return None
        mean, upper = self._estimates(c)
        g = self._greedy(c, mean)
        target = float(mean[g]) if not math.isnan(mean[g]) else -math.inf
        upper = upper.copy()
        upper[g] = -np.inf
        best = float(upper.max())
        share = self.explore_share if self._spent + 1 <= self.explore_share * (self.chosen + 1) else 0.0
        spread = share * self.spread
        contender = self._contender(upper, best) if share > spread and (best > target or best == math.inf) else None
        directed = share - spread if contender is not None else 0.0
        u = float(self.rng.random())
        self.chosen += 1
        if u < directed:
            arm = contender
        elif u < directed + spread:  # the uniform part: the same draw, rescaled, picks one of the K arms
            cells = self._arms
            arm = cells[min(int((u - directed) / spread * len(cells)), len(cells) - 1)]
        else:
            arm = g
        assert arm is not None
        propensity = (1.0 - directed - spread) * (arm == g) + directed * (arm == contender) + spread / len(self._arms)
        if arm != g:
            if self._spent + 1 > self._reserved:
                self._reserve(self._spent + RESERVE_BLOCK)
            self.explored += 1
            self._spent += 1
        prompt, n = self.prompts[arm[0]], arm[1] + 1
        served = ctx if (prompt, n) == (ctx.prompt, ctx.n) else dataclasses.replace(ctx, prompt=prompt, n=n)
        return Choice(served, propensity, arm != g, (self.prompts[g[0]], g[1] + 1),
                      None if contender is None else (self.prompts[contender[0]], contender[1] + 1),
                      share, spread, self._arm_names)

    def _contender(self, upper: np.ndarray, best: float) -> tuple[int, int]:
        """The arm explored: the highest upper bound (of tied ones, the first prompt's largest N, whose completions
        teach every smaller N at once; an arm without evidence has an infinite bound)."""
        if best == math.inf:
            unknown = np.isinf(upper) & (upper > 0)
            p = int(np.flatnonzero(unknown.any(axis=1))[0])
            return p, int(np.flatnonzero(unknown[p])[-1])
        flat = int(np.argmax(upper[:, ::-1].ravel()))  # on a tie, the larger N (it teaches the smaller ones)
        return flat // self.n_max, self.n_max - 1 - flat % self.n_max

    # ---- learning ---------------------------------------------------------------------------------------
    def _unit(self, prompt: int) -> float:
        """The prompt's cost per completion: the policy file's, else its observed tokens per completion times the
        cost per token observed on the prompts the file prices (0 while unknown)."""
        pid = self.prompts[prompt]
        if pid in self.unit_cost:
            return self.unit_cost[pid]
        if self._completions[prompt] == 0:
            return 0.0
        priced = [(self.unit_cost[q] * self._completions[i], self._tokens[i]) for q, i in self._p.items()
                  if q in self.unit_cost and self._tokens[i] > 0]
        if not priced:
            return 0.0
        per_token = sum(a for a, _ in priced) / sum(b for _, b in priced)
        return per_token * float(self._tokens[prompt] / self._completions[prompt])

    def _tick(self) -> None:
        """One more request learned from: all earlier evidence counts ``gamma`` times as much."""
        self.observed += 1
        if self.gamma < 1.0:
            self._sum *= self.gamma
            self._square *= self.gamma
            self._weight *= self.gamma
        self._fast_sum *= self.fast_gamma
        self._fast_weight *= self.fast_gamma

    def _add(self, mask: np.ndarray, p: int, k: slice | int, values: np.ndarray) -> None:
        """Observed utilities ``values`` (contexts of ``mask``, the N of ``k``) of prompt ``p``."""
        self._sum[mask, p, k] += values
        self._square[mask, p, k] += values ** 2
        self._weight[mask, p, k] += 1.0
        self._fast_sum[mask, p, k] += values
        self._fast_weight[mask, p, k] += 1.0
        self._test_change(p)

    def _test_change(self, p: int) -> None:
        """A change test on prompt ``p``: where the recent mean of an arm is more than ``CHANGE_Z`` standard errors
        from its long-run mean, the prompt's outcomes have changed: its long-run evidence is replaced by the recent
        one, and every other prompt's evidence is capped at ``RESTART_WEIGHT`` observations, so that the directed
        exploration checks whether they changed too (a drift moves several prompts)."""
        fw, w = self._fast_weight[:, p], self._weight[:, p]
        ok = fw >= CHANGE_MIN
        if not ok.any():
            return
        with np.errstate(invalid="ignore", divide="ignore"):
            slow = self._sum[:, p] / w
            fast = self._fast_sum[:, p] / fw
            var = np.maximum(self._square[:, p] / w - slow ** 2, 0.0)
            z = np.abs(fast - slow) / np.sqrt(var / fw + 1e-12)
        if not (ok & (z > CHANGE_Z)).any():
            return
        self.changes += 1
        scale = np.where(w > 0, fw / np.where(w > 0, w, 1.0), 0.0)
        self._sum[:, p] = self._fast_sum[:, p]
        self._square[:, p] *= scale
        self._weight[:, p] = fw
        cap = np.minimum(1.0, RESTART_WEIGHT / np.maximum(self._weight, 1e-300))
        cap[:, p] = 1.0
        self._sum *= cap
        self._square *= cap
        self._weight *= cap

    def _learn(self, o: _Outcome, reward: bool | float | Sequence[float] | None = None) -> bool:
        """Learn from one answered request (``reward``: a majority vote's feedback); whether it taught anything."""
        p = self._p.get(o.prompt)
        if p is None or not 1 <= o.n <= self.n_max or o.drawn < 1:
            return False
        if o.completion_tokens > 0:
            self._tokens[p] += o.completion_tokens
            self._completions[p] += o.drawn
        unit = self._unit(p)
        own = self._c.get(o.context)
        if own is not None and tuple(self._contexts[own].weights) != tuple(o.weights):
            own = None
        if o.vectors is not None:  # Best-of-N
            if o.fixed and o.vectors.shape[0] == o.drawn and o.drawn <= self.n_max:
                self._tick()
                vectors = o.vectors if self._grid is None else np.round(o.vectors / self._grid) * self._grid
                ordered = np.sort(vectors @ self._objective.T, axis=0)  # (drawn, C), ascending per context
                best = ordered.T @ _subset_max_weights(o.drawn)  # (C, k): the mean best of k of the drawn
                k = np.arange(1, o.drawn + 1, dtype=np.float64)
                values = best + self._cost_weight[:, None] * k[None, :] * unit  # (C, k)
                self._add(self._free, p, slice(0, o.drawn), values[self._free])
                return True
            if own is None or o.served is None or self._free[own]:
                return False
            self._tick()
            mask = np.zeros(len(self._contexts), dtype=bool)
            mask[own] = True
            self._add(mask, p, o.n - 1, np.array([o.served + self._cost_weight[own] * o.drawn * unit]))
            return True
        if reward is None and o.agreement is None:
            return False
        if reward is None:
            credit = self._objective[:, 0] * float(o.agreement or 0.0)
        else:
            credit = np.array([_weighted(reward, w.tolist()) for w in self._objective])
        self._tick()
        mask = self._free.copy()
        if own is not None:
            mask[own] = True
        self._add(mask, p, o.n - 1, (credit + self._cost_weight * o.drawn * unit)[mask])
        return True

    def observe(self, rid: str, routed: Any) -> None:
        """Learn from the answered request ``rid`` (a ``Routed``): Best-of-N and majority-vote agreement at once,
        majority-vote feedback once it arrives (``feedback``)."""
        ctx = routed.context
        rule = getattr(ctx, "rule", None)
        common: dict[str, Any] = {"context": ctx.name, "weights": tuple(ctx.weights), "prompt": routed.prompt_id,
                                  "n": int(ctx.n), "fixed": rule is None or rule.fixed, "drawn": routed.n,
                                  "completion_tokens": int(routed.completion_tokens)}
        if routed.answers is None:  # Best-of-N: every completion's score vector
            raw = routed.objective_scores or []
            if not raw:
                return
            vectors = np.array([[float(s[name]) for name in self.policy.objectives] for s in raw], dtype=np.float64)
            served = float(routed.scores[routed.chosen]) if routed.scores else None
            self._learn(_Outcome(**common, vectors=vectors, served=served))
            return
        if self.reward == "agreement":
            winner = routed.answers[routed.chosen]
            agree = sum(1 for a in routed.answers if a == winner) / max(1, len(routed.answers))
            self._learn(_Outcome(**common, agreement=agree))
            return
        self._pending[rid] = _Outcome(**common)
        while len(self._pending) > PENDING_MAX:
            self._pending.popitem(last=False)

    def feedback(self, rid: str, reward: bool | float | Sequence[float]) -> None:
        """Learn from the caller's ``reward`` of response ``rid`` (accepted by ``POST /v1/feedback``); a second
        reward of the same id, or one the learner no longer waits for, teaches nothing."""
        pending = self._pending.pop(rid, None)
        if pending is not None:
            self._learn(pending, reward)

    def _reserve(self, upto: int) -> None:
        """Make ``upto`` explorations durable in the budget file before the next one is served."""
        if self.budget_file is not None:
            from iapo_gym.atomic import atomic_write_text

            atomic_write_text(self.budget_file, json.dumps({"explored_reserved": int(upto)}) + "\n")
        self._reserved = int(upto)

    def _read_reserved(self) -> int:
        """The explorations the budget file reserved (0 without one); ValueError names a file that is not one."""
        if self.budget_file is None or not os.path.exists(self.budget_file):
            return 0
        try:
            with open(self.budget_file, encoding="utf-8") as fh:
                value = json.load(fh)["explored_reserved"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"the --learn budget file {self.budget_file} is not one ({exc}); expected "
                             '{"explored_reserved": <count>}') from None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"the --learn budget file {self.budget_file} holds explored_reserved={value!r}; "
                             "expected a count >= 0")
        return value

    def resume(self, rows: Iterable[LogRow]) -> int:
        """Learn from the rows of an outcome log this serve writes to (``--log`` at start), in their order: their
        outcomes (and, for feedback, their rewards) teach as when they were served, and their exploration counts
        toward the budget, as does every exploration the budget file reserved (those of rows a kill -9 lost).
        Returns the rows learned from."""
        used = 0
        for row in rows:
            learn = row.outcomes.get("learn")
            if isinstance(learn, Mapping):
                self.chosen += 1
                self.explored += bool(learn.get("explored"))
                self._spent += bool(learn.get("explored"))
            out = row.outcomes
            common: dict[str, Any] = {
                "context": row.context, "weights": tuple(row.weights), "prompt": row.prompt, "n": int(row.n),
                "fixed": not row.rule or row.rule.get("name") == "fixed", "drawn": int(row.drawn),
                "completion_tokens": int(row.completion_tokens or 0)}
            if out.get("aggregator") == "bon":
                raw, scores, chosen = out.get("objective_scores") or [], out.get("scores") or [], out.get("chosen")
                if not raw:
                    continue
                served = float(scores[chosen]) if isinstance(chosen, int) and 0 <= chosen < len(scores) else None
                taught = self._learn(_Outcome(**common, vectors=np.asarray(raw, dtype=np.float64), served=served))
            elif self.reward == "agreement":
                answers = out.get("answers") or []
                if not answers:
                    continue
                winner = out.get("winner")
                taught = self._learn(_Outcome(**common, agreement=sum(a == winner for a in answers) / len(answers)))
            elif row.reward is not None:
                taught = self._learn(_Outcome(**common), row.reward)
            else:
                continue
            used += taught
        self._reserved = max(self._reserved, self._read_reserved())
        self._spent = max(self._spent, self._reserved)
        return used

    def report(self) -> dict[str, Any]:
        """The budget's counts and, per context, the greedy arm and the estimate and discounted observations of
        every arm that has any."""
        out: dict[str, Any] = {"chosen": self.chosen, "explored": self.explored, "budget_spent": self._spent,
                               "explore_share": self.explore_share, "spread": self.spread,
                               "observed": self.observed, "half_life": self.half_life, "changes": self.changes,
                               "reward": self.reward if self.aggregator == "mv" else "scores", "contexts": {}}
        for c, ctx in enumerate(self._contexts):
            mean, _ = self._estimates(c)
            arms = [{"prompt": self.prompts[int(p)], "n": int(k) + 1, "estimate": float(mean[p, k]),
                     "weight": float(self._weight[c, p, k])}
                    for p, k in zip(*np.nonzero(~np.isnan(mean)), strict=True)]
            out["contexts"][ctx.name] = {"greedy": list(self.greedy(ctx.name)), "arms": arms}
        return out


@functools.lru_cache(maxsize=256)
def _subset_max_weights(n: int) -> np.ndarray:
    """(n, n): column k - 1 weighs the ascending values of n draws into the mean of the best of every k of them,
    ``C(i - 1, k - 1) / C(n, k)`` for the i-th smallest: an unbiased estimate of the expected best of k draws,
    with less variance than the best of the first k."""
    weights = np.zeros((n, n))
    for k in range(1, n + 1):
        for i in range(k, n + 1):
            weights[i - 1, k - 1] = math.comb(i - 1, k - 1) / math.comb(n, k)
    weights.setflags(write=False)
    return weights


def _weighted(reward: bool | float | Sequence[float], objective_weights: Sequence[float]) -> float:
    """A feedback reward in utility units: true/false as 1/0 and a number times the first objective weight; a
    vector weighted by the objective weights."""
    if isinstance(reward, bool):
        return float(objective_weights[0]) * float(reward)
    if isinstance(reward, (int, float)):
        return float(objective_weights[0]) * float(reward)
    return float(np.dot(np.asarray(list(reward), dtype=np.float64), np.asarray(objective_weights, dtype=np.float64)))


class Shadow:
    """What a candidate policy would serve each request (``serve --shadow``), computed and logged, never served."""

    def __init__(self, path: str | os.PathLike[str], served: PolicyFile) -> None:
        """``path``: the candidate policy file; ``served``: the policy serving (the candidate must share its
        aggregator and objectives). ValueError (or ``PolicyFileError``) names what does not fit."""
        self.path = str(path)
        self.policy = load_policy(path)
        if self.policy.aggregator != served.aggregator or tuple(self.policy.objectives) != tuple(served.objectives):
            raise ValueError(f"--shadow {self.path}: the candidate is a {self.policy.aggregator} policy of objectives "
                             f"{list(self.policy.objectives)}; the served one is {served.aggregator} of "
                             f"{list(served.objectives)}")
        self._ratings = (ArmRatings(self.policy.arm_estimates, self.policy.aggregator, self.policy.n_max,
                                    self.policy.objectives) if self.policy.arm_estimates is not None else None)

    def arm(self, ctx: PolicyContext) -> dict[str, Any]:
        """The candidate's arm for the request's weights: its context of the same weights, else the arm its estimates
        rate best (``choose_arm``), else none (``{"context": None}``)."""
        weights = tuple(float(w) for w in ctx.weights)
        for c in self.policy.contexts:
            if len(c.weights) == len(weights) and all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
                                                      for a, b in zip(c.weights, weights, strict=True)):
                return {"context": c.name, "prompt": c.prompt, "n": c.n}
        if self._ratings is None:
            return {"context": None, "prompt": None, "n": None}
        chosen = choose_arm(self._ratings, self.policy.contexts, weights)
        return {"context": json.dumps(list(weights)), "prompt": chosen["prompt"], "n": chosen["n"]}
