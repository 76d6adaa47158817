"""Structure-agnostic sequential halving over all (p, N) arms: the paper's reference point.

Every context runs its own halving with floor(T / C) completions, and a pull counts only
for the arm pulled, in the context it was pulled for: no sharing across contexts or
scales (the sample complexity the paper's theorem compares PSST with).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from agents.base import Agent
from agents.estimator import Estimator
from agents.psst import LEFTOVER_MODES, round_budget, rounds_to_one, trim
from iapo_gym import Policy


class SequentialHalving(Agent):
    """Per-context sequential halving over all P * N_max arms, one pull costing N.

    Each round every live arm of a context gets floor(b_c / sum of live N) pulls; when
    that is 0 the round instead pulls live arms once each, least-sampled first (ties at
    random), while they fit b_c. Trimming and the round budget b_c follow PSST's rules.
    """


    def __init__(self, seed: int | None = None, leftover: str = "carry") -> None:
        """``leftover``: "carry" or "drop" (as for PSST)."""
        super().__init__(seed)
        if leftover not in LEFTOVER_MODES:
            raise ValueError(f"leftover must be one of {LEFTOVER_MODES}, got {leftover!r}")
        self.leftover = leftover

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"leftover": self.leftover}

    def train(self, env: Any, budget: int) -> Policy:
        """Spend floor(budget / C) per context; one surviving arm per context."""
        base = self.base_env(env)
        budget = self.check_budget(budget)
        est = Estimator(base, "blocks")
        n_c, n_p, n_max = base.n_contexts, base.n_prompts, base.n_max
        n_arms = n_p * n_max
        arm_n = np.tile(np.arange(1, n_max + 1), n_p)
        alive = np.ones((n_c, n_arms), dtype=bool)
        per_context = budget // n_c
        spent = np.zeros(n_c, dtype=np.int64)
        rounds_total = max(1, math.ceil(math.log2(n_arms)))
        for r in range(rounds_total):
            if alive.sum(axis=1).max() <= 1:
                break
            arms_list, ctx_list = [], []
            for c in range(n_c):
                n_alive = int(alive[c].sum())
                if n_alive <= 1:
                    continue
                b = round_budget(per_context, int(spent[c]), rounds_total, r, rounds_to_one(n_alive), self.leftover)
                live = np.flatnonzero(alive[c])
                cost = int(arm_n[live].sum())
                per_arm = b // cost
                if per_arm == 0 and self.leftover == "carry" and per_context - spent[c] >= cost:
                    per_arm = 1
                if per_arm >= 1:
                    arms = np.repeat(live, per_arm)
                else:
                    counts = est.counts[c].ravel()[live]
                    order = live[np.lexsort((self.rng.random(live.size), counts))]
                    arms = order[np.cumsum(arm_n[order]) <= b]
                spent[c] += int(arm_n[arms].sum())
                arms_list.append(arms)
                ctx_list.append(np.full(arms.size, c, dtype=np.int64))
            arms = np.concatenate(arms_list) if arms_list else np.zeros(0, np.int64)
            if arms.size:
                pulls = base.pull(arms // n_max, arm_n[arms])
                est.update(pulls, scales="own", contexts=np.concatenate(ctx_list))
            alive = trim(alive, est.mean().reshape(n_c, -1), self.rng)
        return est.best_arms(self.rng, alive.reshape(est.sums.shape))
