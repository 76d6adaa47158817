"""research/detections.py: a drift's detection is reported near its change point; held-out levels are refused."""

from __future__ import annotations

import numpy as np
import pytest
from detections import detections

from agents.online import make_online
from iapo_gym.online import OnlineEnv, run_online


def test_a_drift_is_detected_soon_after_its_change_point() -> None:
    """Drift on tuning level 5 of ``bon_shift``, 20,000 requests: a detection within 500 requests of the change
    point, and the regret is each request's (T values, none negative)."""
    regret, changes = detections("bon_shift", 5, "drift", 20_000, seed=0)
    change = OnlineEnv(family="bon_shift", level=5, schedule="drift", horizon=20_000).schedule.segments[1].start
    assert regret.shape == (20_000,) and (regret >= -1e-12).all()
    assert any(change <= step < change + 500 for step in changes)


def test_params_go_to_the_agent() -> None:
    """``params`` override the agent's defaults: the run is ``run_online``'s with them (here without a warm start)."""
    regret, _ = detections("bon_shift", 5, "stationary", 300, seed=1, params={"budget": 0})
    env = OnlineEnv(family="bon_shift", level=5, schedule="stationary", horizon=300)
    assert np.array_equal(regret, run_online(env, make_online("iapo_online", budget=0), seed=1, batch_size=16).regret)
    assert not np.array_equal(regret, detections("bon_shift", 5, "stationary", 300, seed=1)[0])


def test_held_out_levels_are_refused() -> None:
    with pytest.raises(SystemExit, match="tuning levels only"):
        detections("bon_shift", 1_000_000, "stationary", 10, seed=0)
