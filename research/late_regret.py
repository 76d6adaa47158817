"""Where an online agent's late regret goes: per tuning level, its regret per request over two windows, the changes
its detector found, and the (context, prompt, N) arms that took the most regret in the late window with their exact
gaps to the context's best arm. Run through the public ``make_online`` and ``OnlineEnv`` as ``run_online`` runs an
agent (``arrivals`` / ``choose_batch`` / ``serve`` / ``update_batch``), tuning levels only.

    .venv/bin/python research/late_regret.py mv_few_queries --levels 0 1 2 3

Used for research/online_tuning.md, "Why the per-request regret rises late on `mv_few_queries`".
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np

from agents.online import make_online
from iapo_gym.online import OnlineEnv
from iapo_gym.seeding import derive_seed
from iapo_gym.tasks.generated import TUNING_LEVELS

#: The requests of a run, by default: the online benchmark's long horizon.
HORIZON = 100_000


@dataclass(frozen=True)
class LateRegret:
    """One run: ``regret`` (T,) each request's exact regret; ``changes`` the requests at which the agent detected a
    change (empty for an agent without a detector); ``arms`` the late window's (context, prompt, N) -> (requests
    served, regret taken), requests from ``late`` on; ``gaps`` the same arms' exact gap to their context's best arm."""

    regret: np.ndarray
    changes: list[int]
    late: int
    arms: dict[tuple[int, int, int], tuple[int, float]]
    gaps: dict[tuple[int, int, int], float]


def late_regret(family: str, level: int, agent: str = "iapo_online", schedule: str = "stationary",
                horizon: int = HORIZON, batch_size: int = 16, seed: int = 0,
                params: dict[str, Any] | None = None) -> LateRegret:
    """Serve ``horizon`` requests of a tuning level with ``agent`` (its defaults, overridden by ``params``) as
    ``run_online(..., seed, batch_size)`` does, keeping what the late half (requests T/2 on) was served. Stationary
    schedules only: the gaps are read from the one segment's exact tensor."""
    if level not in TUNING_LEVELS:
        raise SystemExit(f"tuning levels only (ids < {TUNING_LEVELS.stop:,}), got {level}")
    if schedule != "stationary":
        raise SystemExit(f"late_regret reads one segment's gaps: --schedule must be 'stationary', got {schedule!r}")
    env = OnlineEnv(family=family, level=level, schedule=schedule, horizon=horizon)
    online = make_online(agent, **(params or {}))
    env.reset(seed=seed)
    online.start(env, derive_seed(seed, "agent"))
    q, q_star = env.segment_tensors(0)
    late = horizon // 2
    regret = np.empty(horizon)
    served: dict[tuple[int, int, int], list[float]] = {}
    while env.t < horizon:
        requests = env.arrivals(min(batch_size, horizon - env.t))
        prompts, ns = online.choose_batch(requests)
        out = env.serve(requests, prompts, ns)
        regret[requests.start:requests.start + len(requests)] = out.regret
        if requests.start + len(requests) > late:
            keep = np.arange(requests.start, requests.start + len(requests)) >= late
            for c, p, n, r in zip(requests.contexts[keep].tolist(), prompts[keep].tolist(), ns[keep].tolist(),
                                  out.regret[keep].tolist(), strict=True):
                tally = served.setdefault((c, p, n), [0, 0.0])
                tally[0] += 1
                tally[1] += r
        online.update_batch(requests, out)
    arms = {arm: (int(count), float(total)) for arm, (count, total) in served.items()}
    gaps = {(c, p, n): float(q_star[c] - q[c, p, n - 1]) for c, p, n in arms}
    changes = [int(step) for step, _, _ in getattr(online, "changes", [])]
    return LateRegret(regret, changes, late, arms, gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family")
    parser.add_argument("--levels", type=int, nargs="+", default=[0])
    parser.add_argument("--agent", default="iapo_online")
    parser.add_argument("--horizon", type=int, default=HORIZON)
    parser.add_argument("--top", type=int, default=10, help="late arms shown per level, by regret taken")
    parser.add_argument("--budget", type=int, default=None,
                        help="iapo_online's warm-start completions (default: its own; 0: no warm start)")
    args = parser.parse_args()
    params = {} if args.budget is None else {"budget": args.budget}
    for level in args.levels:
        run = late_regret(args.family, level, args.agent, horizon=args.horizon, params=params)
        t = args.horizon
        windows = [(t // 4, t // 2), (t // 2, t)]
        per_request = [run.regret[a:b].mean() * 1e4 for a, b in windows]
        print(f"level {level}: regret {run.regret.sum():.1f}; per request x 1e-4 over {windows[0]}: "
              f"{per_request[0]:.2f}, over {windows[1]}: {per_request[1]:.2f}; detections {len(run.changes)}; "
              f"late regret {run.regret[run.late:].sum():.1f}")
        for (c, p, n), (count, total) in sorted(run.arms.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"  context {c}, prompt {p}, N {n}: served {count}, regret {total:.1f}, gap {run.gaps[(c, p, n)]:.4f}")


if __name__ == "__main__":
    main()
