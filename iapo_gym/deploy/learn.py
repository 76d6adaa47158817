"""``serve --learn`` and ``serve --shadow CANDIDATE.json``: learning the served arm per context from the traffic,
and what another policy would have served, without serving it (docs/deploy.md, "Learning while serving").

``ServeLearner`` keeps, per context of the served policy, an estimate of the utility of each candidate arm
(p, N): every servable prompt of the policy with every N its contexts use. An estimate is a mean of observed
utilities, warm-started from the policy file (counted as ``prior_weight`` observations): the context's own arm from
the file's estimate of its value (``value.mean``, optimize's check) where it has one, every arm else from the
plug-in utility of its ``arm_estimates`` (``ArmRatings``), which underrates large N ("Any weights" in
docs/deploy.md), so the policy's choice is not dropped for it before any request; an arm without estimates in the
file starts with none. Each request in a
context is served its greedy arm (the best estimate; the policy's own arm wins ties and is served while no arm has
an estimate), except that with probability ``explore_share`` it is served another candidate arm uniformly, while
the exploration budget allows it: the requests explored never exceed ``floor(explore_share x requests chosen)``,
counted over the process's lifetime and, with ``--log``, over the log it resumes from. Each served arm's
probability of being chosen (its propensity: 1 - share for the greedy arm, share / (K - 1) for each other, 1
when the budget or a single arm leaves nothing to explore) goes to the outcome log.

What an answered request teaches (its observed utility, in the policy's units):

* Best-of-N: at once, the served completion's weighted score (the best of those drawn);
* majority vote, ``reward="agreement"`` (the default): at once, the share of the completions drawn that voted
  for the winner, a proxy of correctness that needs no caller;
* majority vote, ``reward="feedback"``: when ``POST /v1/feedback`` brings the caller's reward for the response
  (true/false as 1/0, a number, or a vector weighted by the context's objective weights); a request without
  feedback teaches nothing. At most ``PENDING_MAX`` answered requests wait for theirs (the oldest are dropped);

plus ``cost_weight x completions drawn x the prompt's unit cost`` (the file's ``arm_estimates`` cost per
completion; 0 without estimates). Requests with weights no context of the policy has (``RatedContext``) are
served as the policy's estimates rate them and teach nothing.

The learner lives in ``iapo_gym.deploy`` on the policy file's public estimator pieces (``ArmRatings``): a server
has no ``OnlineEnv`` (no table schema, no atom indices of its outcomes) for an ``iapo_gym.online`` agent to start
on, and deploy may not import ``agents`` (``.importlinter``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from iapo_gym.deploy.estimates import ArmRatings, choose_arm
from iapo_gym.outcome_log import LogRow
from iapo_gym.policyfile import PolicyContext, PolicyFile, load_policy
from iapo_gym.seeding import derive_rng

__all__ = ["DEFAULT_EXPLORE_SHARE", "DEFAULT_PRIOR_WEIGHT", "PENDING_MAX", "REWARDS", "Choice", "ServeLearner",
           "Shadow"]

#: The default share of requests ``--learn`` may explore.
DEFAULT_EXPLORE_SHARE = 0.05
#: Observations the policy file's plug-in estimate of an arm counts as (``--learn-prior``).
DEFAULT_PRIOR_WEIGHT = 20.0
#: Majority vote with ``reward="feedback"``: answered requests remembered until their feedback arrives.
PENDING_MAX = 100_000
#: What a majority vote learns from.
REWARDS = ("agreement", "feedback")
RNG_KEY = "iapo_gym.deploy.learn"


@dataclass(frozen=True)
class Choice:
    """The arm served for one request: the context as served (its prompt and N the arm's), and how it was chosen."""

    context: PolicyContext
    propensity: float
    explored: bool
    greedy: tuple[str, int]

    def to_dict(self) -> dict[str, Any]:
        """What the outcome log and the response's ``iapo.learn`` keep of the choice."""
        return {"explored": self.explored, "propensity": self.propensity, "greedy": list(self.greedy)}


@dataclass
class _ContextArms:
    """One context's candidate arms and their estimates (prior and observed, kept apart)."""

    arms: list[tuple[str, int]]
    prior_mean: np.ndarray
    prior_weight: np.ndarray
    sums: np.ndarray = field(init=False)
    counts: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.sums = np.zeros(len(self.arms))
        self.counts = np.zeros(len(self.arms))

    def estimates(self) -> np.ndarray:
        """Per arm the mean of its prior and observations (NaN for an arm with neither)."""
        weight = self.prior_weight + self.counts
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(weight > 0, (self.prior_weight * self.prior_mean + self.sums) / weight, np.nan)


class ServeLearner:
    """Per-context arm estimates learned from served requests, a bounded exploration, propensities (module
    docstring)."""

    def __init__(self, policy: PolicyFile, *, explore_share: float = DEFAULT_EXPLORE_SHARE, seed: int = 0,
                 reward: str = "agreement", prior_weight: float = DEFAULT_PRIOR_WEIGHT) -> None:
        """``policy``: the served policy file; ``explore_share``: the share of requests that may be served another
        arm than the greedy one (0 <= share < 1); ``seed``: the root of the exploration draws; ``reward``: what a
        majority vote learns from (``REWARDS``); ``prior_weight``: observations each estimate of the file's
        ``arm_estimates`` counts as (>= 0; 0 ignores them). ValueError names a bad value."""
        if isinstance(explore_share, bool) or not isinstance(explore_share, (int, float)) or \
                not math.isfinite(explore_share) or not 0 <= explore_share < 1:
            raise ValueError(f"--explore-share must be a number in [0, 1) (the share of requests explored), got "
                             f"{explore_share!r}")
        if reward not in REWARDS:
            raise ValueError(f"--learn-reward must be one of {list(REWARDS)}, got {reward!r}")
        if not math.isfinite(prior_weight) or prior_weight < 0:
            raise ValueError(f"--learn-prior must be a finite number >= 0 (observations the policy file's estimate "
                             f"of an arm counts as), got {prior_weight!r}")
        self.explore_share, self.reward, self.prior_weight = float(explore_share), reward, float(prior_weight)
        self.rng = derive_rng(int(seed), RNG_KEY)
        self.chosen = 0  # requests an arm was chosen for (the budget's denominator)
        self.explored = 0  # of them, served another arm than the greedy one
        self._pending: OrderedDict[str, tuple[str, tuple[str, int], float]] = OrderedDict()  # rid -> (context, arm, cost term)
        self.use_policy(policy)

    # ---- the policy ------------------------------------------------------------------------------------
    def use_policy(self, policy: PolicyFile) -> None:
        """Learn for ``policy`` from now on (a start, or a policy swap): its contexts' candidate arms, warm-started
        from its ``arm_estimates``; the exploration budget's counts go on."""
        self.policy = policy
        self.aggregator = policy.aggregator
        if self.reward == "feedback" and self.aggregator != "mv":
            raise ValueError("--learn-reward feedback is for a majority-vote policy; a Best-of-N policy learns from "
                             "the scores of its completions at once")
        self.unit_cost = {str(e["id"]): float(e["cost"]) for e in (policy.arm_estimates or {}).get("prompts", ())}
        ratings = (ArmRatings(policy.arm_estimates, policy.aggregator, policy.n_max, policy.objectives)
                   if policy.arm_estimates is not None else None)
        prompts = sorted(p.id for p in policy.prompts if p.servable)
        ns = sorted({c.n for c in policy.contexts})
        self._contexts: dict[str, _ContextArms] = {}
        self._by_name = {c.name: c for c in policy.contexts}
        self._pending.clear()
        for c in policy.contexts:
            arms = [(c.prompt, c.n)] + [(p, n) for p in prompts for n in ns if (p, n) != (c.prompt, c.n)]
            mean = np.zeros(len(arms))
            weight = np.zeros(len(arms))
            if ratings is not None and self.prior_weight > 0:
                u = ratings.utilities(c.objective_weights, c.cost_weight)
                for i, (p, n) in enumerate(arms):
                    if ratings.shown(p) and n <= ratings.n_max:
                        mean[i], weight[i] = float(u[ratings.prompts.index(p), n - 1]), self.prior_weight
            if c.value is not None and math.isfinite(c.value) and self.prior_weight > 0:
                mean[0], weight[0] = float(c.value), self.prior_weight  # the file's estimate of its own arm
            self._contexts[c.name] = _ContextArms(arms, mean, weight)

    # ---- choosing ---------------------------------------------------------------------------------------
    def greedy(self, name: str) -> tuple[str, int]:
        """The arm a context is served when not explored: the best estimate; the policy's own arm on a tie or while
        no arm has an estimate."""
        state = self._contexts[name]
        est = state.estimates()
        if np.isnan(est).all():
            return state.arms[0]
        best = float(np.nanmax(est))
        return state.arms[int(np.flatnonzero(est == best)[0])]

    def choose(self, ctx: PolicyContext) -> Choice | None:
        """The arm to serve ``ctx`` (a context the router resolved); None for weights no context of the policy has
        (served as the router rated them). One draw of the seeded generator per request; no await, so the budget's
        check and count are one step in the event loop."""
        state = self._contexts.get(ctx.name)
        if state is None or self._by_name.get(ctx.name) != ctx:
            return None
        greedy = self.greedy(ctx.name)
        others = [a for a in state.arms if a != greedy]
        share = self.explore_share if others and self.explored + 1 <= self.explore_share * (self.chosen + 1) else 0.0
        u = float(self.rng.random())
        self.chosen += 1
        if u < share:
            self.explored += 1
            arm = others[int(self.rng.integers(len(others)))]
            propensity = share / len(others)
        else:
            arm, propensity = greedy, 1.0 - share
        served = ctx if arm == (ctx.prompt, ctx.n) else dataclasses.replace(ctx, prompt=arm[0], n=arm[1])
        return Choice(served, propensity, arm != greedy, greedy)

    # ---- learning ---------------------------------------------------------------------------------------
    def _cost_term(self, ctx: PolicyContext, prompt: str, drawn: int) -> float:
        return float(ctx.cost_weight) * drawn * self.unit_cost.get(prompt, 0.0)

    def _add(self, name: str, arm: tuple[str, int], utility: float) -> None:
        state = self._contexts.get(name)
        if state is None or arm not in state.arms or not math.isfinite(utility):
            return
        i = state.arms.index(arm)
        state.sums[i] += utility
        state.counts[i] += 1

    def observe(self, rid: str, routed: Any) -> None:
        """Learn from the answered request ``rid`` (a ``Routed``): Best-of-N and majority-vote agreement at once,
        majority-vote feedback once it arrives (``feedback``)."""
        ctx = routed.context
        if ctx.name not in self._contexts or self._by_name[ctx.name].weights != ctx.weights:
            return
        arm = (routed.prompt_id, int(ctx.n))
        cost = self._cost_term(ctx, routed.prompt_id, routed.n)
        if routed.answers is None:  # Best-of-N: the served completion's weighted score
            scores = routed.scores or []
            if scores:
                self._add(ctx.name, arm, float(scores[routed.chosen]) + cost)
            return
        if self.reward == "agreement":
            winner = routed.answers[routed.chosen]
            agree = sum(1 for a in routed.answers if a == winner) / max(1, len(routed.answers))
            self._add(ctx.name, arm, float(ctx.objective_weights[0]) * agree + cost)
            return
        self._pending[rid] = (ctx.name, arm, cost)
        while len(self._pending) > PENDING_MAX:
            self._pending.popitem(last=False)

    def feedback(self, rid: str, reward: bool | float | Sequence[float]) -> None:
        """Learn from the caller's ``reward`` of response ``rid`` (accepted by ``POST /v1/feedback``); a second
        reward of the same id, or one the learner no longer waits for, teaches nothing."""
        pending = self._pending.pop(rid, None)
        if pending is None:
            return
        name, arm, cost = pending
        ctx = self._by_name[name]
        self._add(name, arm, _weighted(reward, ctx.objective_weights) + cost)

    def resume(self, rows: Iterable[LogRow]) -> int:
        """Learn from the rows of an outcome log this serve writes to (``--log`` at start): their outcomes (and,
        for feedback, their rewards) teach as when they were served, and their exploration counts toward the
        budget. Rows of other contexts or arms are skipped. Returns the rows learned from."""
        used = 0
        for row in rows:
            ctx = self._by_name.get(row.context)
            if ctx is None or tuple(row.weights) != ctx.weights:
                continue
            learn = row.outcomes.get("learn")
            if isinstance(learn, dict):
                self.chosen += 1
                self.explored += bool(learn.get("explored"))
            arm = (row.prompt, int(row.n))
            cost = self._cost_term(ctx, row.prompt, row.drawn)
            out = row.outcomes
            if out.get("aggregator") == "bon":
                scores, chosen = out.get("scores") or [], out.get("chosen")
                if not scores or not isinstance(chosen, int):
                    continue
                self._add(ctx.name, arm, float(scores[chosen]) + cost)
            elif self.reward == "agreement":
                answers = out.get("answers") or []
                if not answers:
                    continue
                winner = out.get("winner")
                self._add(ctx.name, arm, float(ctx.objective_weights[0]) * sum(a == winner for a in answers) /
                          len(answers) + cost)
            elif row.reward is not None:
                self._add(ctx.name, arm, _weighted(row.reward, ctx.objective_weights) + cost)
            else:
                continue
            used += 1
        return used

    def report(self) -> dict[str, Any]:
        """The budget's counts and, per context, the greedy arm and every candidate's estimate and observations."""
        out: dict[str, Any] = {"chosen": self.chosen, "explored": self.explored, "explore_share": self.explore_share,
                               "reward": self.reward if self.aggregator == "mv" else "scores", "contexts": {}}
        for name, state in self._contexts.items():
            est = state.estimates()
            out["contexts"][name] = {
                "greedy": list(self.greedy(name)),
                "arms": [{"prompt": p, "n": n, "estimate": None if np.isnan(e) else float(e), "observed": int(k)}
                         for (p, n), e, k in zip(state.arms, est, state.counts, strict=True)]}
        return out


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
