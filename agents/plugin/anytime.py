"""``AnytimePlugIn`` (``plugin_anytime``, the recommended ``auto``): plug-in elimination paced by the spend.

Every live prompt is pulled on the same train queries (drawn without replacement), read through
``PlugInEstimator``. Whole steps that do not depend on the budget T trim the prompts at a pace set
by the completions spent, so one trajectory serves every budget; each budget ends in successive
halving of the prompts still live on what the whole steps leave (docs/agents.md, "auto").
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from agents.base import Agent
from agents.plugin.best_of_n import BON_READINGS
from agents.plugin.common import QueryStream, keep_top
from agents.plugin.estimator import PlugInEstimator, check_nonnegative, warm_up
from agents.psst import rounds_to_one
from agents.rule_readings import best_rule_arms, plugin_rule_values, trusted_rule_values
from iapo_gym import Policy

#: Completions per (prompt, query) at least: two draws show a query's spread, one does not.
MIN_DRAWS = 2
#: The share of a budget the whole steps may spend; the rest is the budget's tail (at least half of it).
STEPS_SHARE = 0.5
#: Best-of-N's kappa in place of ``kappa`` (majority vote's): a maximum of N reads the top of a query's
#: distribution, which its own completions show only as they grow, so n grows faster there.
BON_KAPPA = 1.0


@dataclass(frozen=True)
class Tail:
    """What the last ``train`` (or budget of ``train_budgets``) ended with, for diagnostics
    (research/trim_readings.py): the live prompts when its tail began, after the re-admission (C, P), and the
    trajectory's estimator at the read-out (its public ``draws`` and ``estimate``). Reading it changes nothing."""

    live: np.ndarray
    estimator: PlugInEstimator


class _Run:
    """The state of one trajectory: estimator, query stream, live prompts (C, P), completions spent."""

    def __init__(self, base: Any, est: PlugInEstimator, rng: np.random.Generator) -> None:
        self.base = base
        self.est = est
        self.stream = QueryStream(base.queries(), rng)
        self.alive = np.ones(est.shape[:2], dtype=bool)
        self.drawn = np.zeros(est.shape[1])  # completions of each prompt
        self.trimmed_with = np.full(est.shape[:2], np.inf)  # a prompt's completions when a context trimmed it
        self.spent = 0

    def branch(self) -> _Run:
        """A copy to run a budget's tail on: its own estimator, stream and generator (a copy of the
        agent's, so the tail never advances the agent's own); the same env."""
        memo = {id(self.base): self.base, id(self.est.env): self.est.env}
        return copy.deepcopy(self, memo)


class AnytimePlugIn(Agent):
    """Plug-in elimination over prompts on common queries, paced by the completions spent (anytime).

    Whole steps: the first spends s0 = P q0 MIN_DRAWS completions, each later one as much as was
    spent before it, while it fits in STEPS_SHARE T. A step of b completions gives every prompt live
    in some context the same m train queries, n completions each: n = min(N_max, max(MIN_DRAWS,
    ceil(sqrt(b / (L kappa))), ceil(b / (L |train|)))), m = floor(b / (L n)), L the live prompts, kappa
    BON_KAPPA on Best-of-N.
    After a step, with s spent in all, each context keeps its top max(1, ceil(P (s0 / s)^rate)) live
    prompts by max_N of the estimate. The budget's tail (on a branch of the trajectory in
    ``train_budgets``) first re-admits, per context, every prompt it trimmed while that prompt had
    fewer than restore T / P completions (so every early trim is re-examined once T is large enough:
    consistency), then runs successive halving of each context's live prompts on what is left:
    max(1, floor(log2 largest live set)) rounds of equal shares by the step rule, each context
    halving its live set after each. The policy is, per context, the best (p, N) of the prompts still live in
    some context (``read_policy``).

    :param seed: the agent's generator (query order, ties).
    :param q0: common queries of the first step (its spend s0 = P q0 MIN_DRAWS).
    :param rate: the whole steps' trimming pace: P (s0 / s)^rate prompts live after s completions.
    :param kappa: majority vote: completions per (prompt, query) grow as sqrt(step / (live kappa)) (0: MIN_DRAWS).
    :param alpha: majority vote: the prior's pseudo-votes per (prompt, query) at most (below it, the empirical-Bayes weight).
    :param curve: ridge on the response curves' offsets (majority vote; 0: the pooled answers as prior).
    :param pretest: posterior SDs from the median slope beyond which a prompt keeps its own (0: all do).
    :param bon_prior: Best-of-N: the pooled reading's weight, in a query's own completions per unit of N.
    :param restore: a budget's tail re-admits the prompts a context trimmed with < restore T / P completions.
    """

    anytime = True
    #: The Best-of-N pooled reading of its estimator (``PlugInEstimator``'s ``bon_reading``): the location-scale
    #: reading blended with the threshold-logit one (docs/agents.md, "auto", item 2).
    bon_reading = BON_READINGS[1]

    def __init__(self, seed: int | None = None, q0: int = 8, rate: float = 0.5, kappa: float = 12.0,
                 alpha: float = 32.0, curve: float = 3.0, pretest: float = 2.0, bon_prior: float = 1.0,
                 restore: float = 0.5) -> None:
        """Check and keep the hyper-parameters (the class docstring says what each does)."""
        super().__init__(seed)
        if isinstance(q0, bool) or not isinstance(q0, (int, np.integer)) or q0 < 1:
            raise ValueError(f"q0 must be an integer >= 1, got {q0!r}")
        self.q0 = int(q0)
        self.rate, self.kappa = check_nonnegative(rate=rate, kappa=kappa)
        self.prior: dict[str, Any] = dict(zip(("alpha", "curve", "pretest", "bon_prior"), check_nonnegative(
            alpha=alpha, curve=curve, pretest=pretest, bon_prior=bon_prior), strict=True))
        (self.restore,) = check_nonnegative(restore=restore)
        self.last_tail: Tail | None = None
        warm_up()

    def params(self) -> dict[str, Any]:
        """Hyper-parameters recorded with results."""
        return {"q0": self.q0, "rate": self.rate, "kappa": self.kappa, **self.prior, "restore": self.restore}

    def train(self, env: Any, budget: int) -> Policy:
        """Spend at most ``budget`` completions of ``env``; the best live arm per context.

        The tail runs on the trajectory itself (nothing follows it), so the policy is
        ``train_budgets``' for this budget.
        """
        budget = self.check_budget(budget)
        run = self._new_run(self.base_env(env))
        self._advance(run, budget)
        return self._finish(run, budget)

    def train_budgets(self, env: Any, budgets: Any) -> Iterator[tuple[int, Policy]]:
        """(budget, policy) for each budget in increasing order, from one trajectory.

        Each policy is bit-identical to ``train(env, budget)`` by a fresh agent with the same seed on
        an env reset with the same seed: the whole steps are the same for every budget; each budget's
        tail and read-out branch off on a copy of the trajectory (the env's state is saved and
        restored around it).
        """
        checked = sorted({self.check_budget(b) for b in budgets})
        base = self.base_env(env)
        run = self._new_run(base)
        for i, budget in enumerate(checked):
            self._advance(run, budget)
            env_state = None if i == len(checked) - 1 else base.snapshot()
            policy = self._finish(run.branch(), budget)
            yield budget, policy
            if env_state is not None:
                base.restore(env_state)

    def _new_run(self, base: Any) -> _Run:
        """A fresh trajectory on ``base``: an empty estimator with the agent's prior, the agent's generator."""
        return _Run(base, PlugInEstimator(base, **self.prior, bon_reading=self.bon_reading), self.rng)

    def _s0(self, run: _Run) -> int:
        return run.alive.shape[1] * self.q0 * MIN_DRAWS

    def _advance(self, run: _Run, budget: int) -> None:
        """Take whole steps while the next one fits in ``budget``, trimming after each."""
        n_prompts = run.alive.shape[1]
        s0 = self._s0(run)
        while True:
            live = int(run.alive.any(axis=0).sum())
            step = s0 if run.spent == 0 else max(MIN_DRAWS * live, run.spent)
            if step > math.floor(STEPS_SHARE * budget) - run.spent:
                return
            self._pull(run, step)
            if run.spent > s0:
                before = run.alive.copy()
                keep_top(run.alive, run.est, max(1, math.ceil(n_prompts * (s0 / run.spent) ** self.rate)),
                         run.stream.rng)
                gone = before & ~run.alive
                run.trimmed_with[gone] = np.broadcast_to(run.drawn, gone.shape)[gone]

    def _pull(self, run: _Run, b: int) -> None:
        """One step of at most ``b`` completions on common queries (nothing if not one per live prompt)."""
        live = np.flatnonzero(run.alive.any(axis=0))
        if not live.size or b < live.size:
            return
        n = max(MIN_DRAWS, math.ceil(b / (live.size * run.stream.pool.size)))
        kappa = BON_KAPPA if run.est.aggregator == "bon" else self.kappa
        if kappa > 0:
            n = max(n, math.ceil(math.sqrt(b / (live.size * kappa))))
        n = min(n, run.est.n_max)
        m = b // (live.size * n)
        if m == 0:
            n, m = b // live.size, 1
        queries = np.tile(run.stream.take(m), live.size)
        pulls = run.base.pull(np.repeat(live, m), np.full(live.size * m, n), queries=queries)
        run.spent += pulls.completions
        run.drawn[live] += m * n
        run.est.update(pulls)

    def _finish(self, run: _Run, budget: int) -> Policy:
        """The budget's tail: successive halving of each context's live prompts on what is left, then
        the read-out. Stops early if a round cannot give one completion to every live prompt."""
        run.alive |= run.trimmed_with < self.restore * budget / run.alive.shape[1]
        live = run.alive.copy()
        rounds = max(1, rounds_to_one(int(run.alive.sum(axis=1).max())))
        for r in range(rounds):
            b = (budget - run.spent) // (rounds - r)
            if b < int(run.alive.any(axis=0).sum()):
                break
            self._pull(run, b)
            keep_top(run.alive, run.est, np.maximum(1, run.alive.sum(axis=1) // 2), run.stream.rng)
        self.last_tail = Tail(live, run.est)
        return read_policy(run.base, run.est, run.alive, run.stream.rng)


def read_policy(base: Any, est: PlugInEstimator, alive: np.ndarray, rng: np.random.Generator) -> Policy:
    """The plug-in agents' read-out: per context the best (p, N) by ``est`` of the prompts live in some context of
    ``alive`` (C, P), not only of its own: every such prompt was pulled up to the end as the context's own survivors
    were, so a prompt one context trimmed but another kept is read on as many completions as they are and re-enters
    the comparison. With the env's ``rule_arms``, the best (p, N, r), the rules' values added to those prompts'
    estimates only (``agents.rule_readings.plugin_rule_values``), a rule only at the caps ``trusted_rule_values``
    keeps. On Best-of-N those prompts are compared read together (``PlugInEstimator.read_together``); their stored
    estimates stay."""
    kept = alive.any(axis=0)
    live = np.flatnonzero(kept)
    mask = np.repeat(np.broadcast_to(kept, alive.shape)[:, :, None], est.n_max, axis=2)
    with est.read_together(live) if est.aggregator == "bon" else contextlib.nullcontext():
        if not base.rule_arms:
            return est.best_arms(rng, mask)
        values = plugin_rule_values(est, live)
    return best_rule_arms(trusted_rule_values(values, mask), rng, mask)
