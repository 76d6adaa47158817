"""research/lockout.py: its run is ``run_online``'s, and a window is reported exactly when its regret rate is high."""

from __future__ import annotations

import numpy as np
import pytest
from lockout import lockouts

from agents.online import make_online
from iapo_gym.online import OnlineEnv, run_online


def test_the_run_is_run_onlines_and_the_windows_are_the_high_regret_ones() -> None:
    """The agent without a warm start (``budget`` 0, the lock-outs' agent): its first requests explore."""
    run = lockouts("mv_many_queries", 3, seed=0, horizon=1_600, window=160, rate=0.01, budget=0)
    env = OnlineEnv(family="mv_many_queries", level=3, horizon=1_600)
    same = run_online(env, make_online("iapo_online", budget=0), seed=0, batch_size=16)
    assert np.array_equal(run.regret, same.regret)
    rates = run.regret.reshape(-1, 160).mean(axis=1)[1:]
    assert [w.start for w in run.windows] == [160 * (k + 1) for k in np.flatnonzero(rates > 0.01)]
    assert run.windows  # early in a run the rate is high: the check above is not vacuous
    for w in run.windows:
        assert w.regret == pytest.approx(run.regret[w.start:w.start + 160].sum())
    warm = lockouts("mv_many_queries", 3, seed=0, horizon=1_600, window=160, rate=0.01)  # the default: warm
    assert np.array_equal(warm.regret, run_online(env, make_online("iapo_online"), seed=0, batch_size=16).regret)


def test_held_out_levels_and_uneven_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="tuning levels only"):
        lockouts("mv_many_queries", 1_000_000, horizon=32)
    with pytest.raises(ValueError, match="multiple of batch_size"):
        lockouts("mv_many_queries", 3, horizon=100, window=50)
