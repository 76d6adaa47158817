"""research/late_regret.py: the run is ``run_online``'s, and the late arms account for the late regret."""

from __future__ import annotations

import numpy as np
import pytest
from late_regret import late_regret

from agents.online import make_online
from iapo_gym.online import OnlineEnv, run_online


def test_the_late_arms_add_up_to_the_late_regret_of_the_run_online_run() -> None:
    """Tuning level 1 of ``mv_few_queries``, 400 requests: each request's regret is bit for bit that of
    ``run_online`` with the same agent, seed and batch size; the late half's arms were served T/2 times in all and
    their regret adds up to the late half's; every gap is >= 0 and an arm's regret is its count times its gap."""
    run = late_regret("mv_few_queries", 1, horizon=400, batch_size=16, seed=3)
    reference = run_online(OnlineEnv(family="mv_few_queries", level=1, schedule="stationary", horizon=400),
                           make_online("iapo_online"), seed=3, batch_size=16)
    assert np.array_equal(run.regret, reference.regret) and run.late == 200
    assert sum(count for count, _ in run.arms.values()) == 200
    assert np.isclose(sum(total for _, total in run.arms.values()), run.regret[200:].sum())
    for arm, (count, total) in run.arms.items():
        assert run.gaps[arm] >= -1e-12 and np.isclose(total, count * run.gaps[arm])
    cold = late_regret("mv_few_queries", 1, horizon=400, batch_size=16, seed=3, params={"budget": 0})
    reference = run_online(OnlineEnv(family="mv_few_queries", level=1, schedule="stationary", horizon=400),
                           make_online("iapo_online", budget=0), seed=3, batch_size=16)
    assert np.array_equal(cold.regret, reference.regret) and not np.array_equal(cold.regret, run.regret)


def test_held_out_levels_and_moving_schedules_are_refused() -> None:
    with pytest.raises(SystemExit, match="tuning levels only"):
        late_regret("mv_few_queries", 1_000_000, horizon=10)
    with pytest.raises(SystemExit, match="must be 'stationary'"):
        late_regret("mv_few_queries", 1, schedule="drift", horizon=10)
