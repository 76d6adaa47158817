"""The online protocol (docs/online.md): requests served one by one, judged by exact cumulative regret.

``OnlineEnv`` (``gym.make("IAPO-Online-v0", ...)``) with its schedules (``stationary``, ``drift``, ``arrival``,
``context_shift``), the ``OnlineAgent`` interface, and ``run_online``, the fast driver.
"""

from iapo_gym.online.agent import OnlineAgent, OnlineAgentBase
from iapo_gym.online.env import OnlineEnv, Requests, Served
from iapo_gym.online.run import CHECKPOINTS, OnlineResult, checkpoints, run_online
from iapo_gym.online.schedule import SCHEDULES, Schedule, ScheduleError, Segment, build_schedule

__all__ = ["CHECKPOINTS", "SCHEDULES", "OnlineAgent", "OnlineAgentBase", "OnlineEnv", "OnlineResult", "Requests",
           "Schedule", "ScheduleError", "Segment", "Served", "build_schedule", "checkpoints", "run_online"]
