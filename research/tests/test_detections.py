"""research/detections.py: the run is ``run_online``'s, and the detections are the agent's."""

from __future__ import annotations

import numpy as np
import pytest
from detections import detections

from agents.online import make_online
from iapo_gym.online import OnlineEnv, run_online


def test_the_regret_and_detections_are_those_of_the_run_online_run() -> None:
    """Drift on tuning level 5 of ``bon_shift``, 20,000 requests: each request's regret is bit for bit that of
    ``run_online`` with the same agent, seed and batch size, and the detections are its agent's (one at least,
    after the change point)."""
    regret, changes = detections("bon_shift", 5, "drift", 20_000, seed=0)
    env = OnlineEnv(family="bon_shift", level=5, schedule="drift", horizon=20_000)
    agent = make_online("iapo_online")
    reference = run_online(env, agent, seed=0, batch_size=16)
    assert np.array_equal(regret, reference.regret)
    assert changes == [step for step, _, _ in agent.changes]
    assert any(step >= env.schedule.segments[1].start for step in changes)


def test_held_out_levels_are_refused() -> None:
    with pytest.raises(SystemExit, match="tuning levels only"):
        detections("bon_shift", 1_000_000, "stationary", 10, seed=0)
