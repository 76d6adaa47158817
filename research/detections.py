"""The change detections of an online agent and the regret they cost: per (family, schedule, tuning level, seed), its
cumulative exact regret at T, over the late half (requests T/2 on) and the requests at which it detected a change,
then per schedule the means over the runs and the detections in all. Run through the public ``make_online``,
``OnlineEnv`` and ``run_online``, tuning levels only.

    .venv/bin/python research/detections.py --schedules stationary,drift --levels 0 1 2 3

Used for research/online_tuning.md, "False detections from rare failed votes" (every family, both schedules, levels
0-3: about 6 minutes on one core).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from agents.online import make_online
from iapo_gym.online import OnlineEnv, run_online
from iapo_gym.tasks.generated import TUNING_LEVELS, families


def detections(family: str, level: int, schedule: str, horizon: int, seed: int, agent: str = "iapo_online",
               batch_size: int = 16, params: dict[str, Any] | None = None) -> tuple[np.ndarray, list[int]]:
    """``run_online`` on a tuning level with ``agent`` (its defaults, overridden by ``params``): each request's exact
    regret (T,) and the requests at which the agent detected a change (empty for an agent without a detector)."""
    if level not in TUNING_LEVELS:
        raise SystemExit(f"tuning levels only (ids < {TUNING_LEVELS.stop:,}), got {level}")
    online = make_online(agent, **(params or {}))
    result = run_online(OnlineEnv(family=family, level=level, schedule=schedule, horizon=horizon), online, seed=seed,
                        batch_size=batch_size)
    return result.regret, [int(step) for step, _, _ in getattr(online, "changes", [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(families()))
    parser.add_argument("--schedules", default="stationary,drift")
    parser.add_argument("--levels", type=int, nargs="+", default=[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--horizon", type=int, default=100_000)
    parser.add_argument("--agent", default="iapo_online")
    parser.add_argument("--budget", type=int, default=None,
                        help="iapo_online's warm-start completions (default: its own; 0: no warm start)")
    args = parser.parse_args()
    params = {} if args.budget is None else {"budget": args.budget}
    half = args.horizon // 2
    for schedule in args.schedules.split(","):
        totals, lates, found = [], [], 0
        for family in args.families.split(","):
            for level in args.levels:
                for seed in args.seeds:
                    regret, changes = detections(family, level, schedule, args.horizon, seed, args.agent, params=params)
                    totals.append(regret.sum())
                    lates.append(regret[half:].sum())
                    found += len(changes)
                    print(f"{family} {schedule} level {level} seed {seed}: regret {regret.sum():.1f}, "
                          f"late half {regret[half:].sum():.1f}, detections at {changes}", flush=True)
        print(f"{schedule}: {len(totals)} runs, mean regret {np.mean(totals):.1f}, over the late half "
              f"{np.mean(lates):.1f}; {found} detections", flush=True)


if __name__ == "__main__":
    main()
