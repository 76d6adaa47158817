"""``run_online``: drive an online agent through a run of the protocol on the batch path, and score it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from iapo_gym.online.agent import OnlineAgent
from iapo_gym.online.env import OnlineEnv
from iapo_gym.seeding import derive_seed

#: Checkpoints of a run's cumulative regret curve: T/100, 2T/100, ..., T.
CHECKPOINTS = 100


@dataclass(frozen=True)
class OnlineResult:
    """A run's score: cumulative exact regret at the checkpoints, and the per-request regret behind it."""

    checkpoints: np.ndarray  # (100,) request counts T/100 .. T (rounded up, distinct)
    cumulative_regret: np.ndarray  # (100,) sum of the exact regret of the first checkpoints[k] requests
    regret: np.ndarray  # (T,) each request's exact regret
    completions: int  # completions drawn in the run (sum of N)


def checkpoints(horizon: int) -> np.ndarray:
    """The request counts the curve is reported at: ceil(k T / 100) for k = 1..100, distinct."""
    return np.unique(-(-np.arange(1, CHECKPOINTS + 1) * horizon // CHECKPOINTS)).astype(np.int64)


def run_online(env: OnlineEnv, agent: OnlineAgent, horizon: int | None = None, seed: int = 0,
               batch_size: int = 1) -> OnlineResult:
    """Serve ``horizon`` requests (default: the env's whole run) with ``agent``; score by exact cumulative regret.

    The env is reset with ``seed``; the agent starts with ``derive_seed(seed, "agent")``. ``batch_size`` is how
    many arrived requests the agent chooses for before it sees their outcomes (a server under concurrency): the
    env's draws do not depend on it, an adaptive agent's choices may. A batch never crosses a schedule change.
    """
    horizon = env.horizon if horizon is None else int(horizon)
    if not 1 <= horizon <= env.horizon:
        raise ValueError(f"horizon must be in [1, {env.horizon}] (the env's run), got {horizon}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    env.reset(seed=seed)
    agent.start(env, derive_seed(seed, "agent"))
    regret = np.empty(horizon)
    drawn = 0
    while env.t < horizon:
        requests = env.arrivals(min(batch_size, horizon - env.t))
        prompts, ns = agent.choose_batch(requests)
        served = env.serve(requests, prompts, ns)
        regret[requests.start:requests.start + len(requests)] = served.regret
        drawn += served.pulls.completions
        agent.update_batch(requests, served)
    points = checkpoints(horizon)
    return OnlineResult(points, np.cumsum(regret)[points - 1], regret, drawn)
