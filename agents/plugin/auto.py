"""``Auto`` (``auto``, the recommended agent): on majority vote ``AnytimePlugIn``, on Best-of-N successive halving
for the known budget read through the blended Best-of-N reading (docs/agents.md, "auto")."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from agents.plugin.anytime import AnytimePlugIn, Tail
from agents.plugin.estimator import PlugInEstimator
from agents.plugin.halving import halve
from iapo_gym import Policy

#: Best-of-N: common queries per live prompt and round at least (``plugin_halving``'s ``m_min``), so a round of b
#: completions draws each live prompt min(N_max, b // (BON_QUERIES L)) times per query: a query's own draws reach
#: the N a maximum is read at as soon as the budget allows. Chosen on the generated tuning levels (research/README.md).
BON_QUERIES = 8


class Auto(AnytimePlugIn):
    """``AnytimePlugIn`` on majority vote; on Best-of-N, ``plugin_halving``'s rounds for the known budget, read
    through ``PlugInEstimator`` with the blended reading and the agent's ``bon_prior``.

    On Best-of-N a maximum of N is read best from a query's own N draws: halving for the budget draws each live
    prompt min(N_max, b // (``BON_QUERIES`` L)) times per query from its first round, where the anytime whole steps,
    not knowing T, draw a few dozen times on most queries and leave the large N to the pooled readings
    (research/README.md). The hyper-parameters are ``AnytimePlugIn``'s; on Best-of-N only ``bon_prior`` is read.
    ``train_budgets`` on Best-of-N trains each budget from the same start (generator and env state), so each policy
    is ``train(env, budget)``'s.
    """

    @staticmethod
    def halves(table: Any) -> bool:
        """Whether ``auto`` halves for its budget on ``table`` (Best-of-N) rather than run ``AnytimePlugIn``."""
        return bool(table.aggregator == "bon")

    def shares_trajectory(self, table: Any) -> bool:
        """One trajectory serves every budget on majority vote; on Best-of-N each budget is trained on its own."""
        return not self.halves(table)

    def train(self, env: Any, budget: int) -> Policy:
        """Spend at most ``budget`` completions of ``env``; per context the best live arm."""
        base = self.base_env(env)
        if not self.halves(base.table):
            return super().train(env, budget)
        budget = self.check_budget(budget)
        est = PlugInEstimator(base, **self.prior, bon_reading=self.bon_reading)
        policy, live = halve(base, est, budget, BON_QUERIES, self.rng)
        self.last_tail = Tail(live, est)
        return policy

    def train_budgets(self, env: Any, budgets: Any) -> Iterator[tuple[int, Policy]]:
        """(budget, policy) for each budget in increasing order, each bit-identical to ``train(env, budget)`` by a
        fresh agent with the same seed on an env reset with the same seed (``AnytimePlugIn.train_budgets``)."""
        base = self.base_env(env)
        if not self.halves(base.table):
            yield from super().train_budgets(env, budgets)
            return
        checked = sorted({self.check_budget(b) for b in budgets})
        start_rng, start_env = copy.deepcopy(self.rng), base.snapshot()
        for i, budget in enumerate(checked):
            if i:
                self.rng = copy.deepcopy(start_rng)
                base.restore(start_env)
            yield budget, self.train(env, budget)
