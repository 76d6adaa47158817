"""Early lock-outs of ``iapo_online``: stretches of requests in which it serves a prompt below the context's best
while the best prompt's estimate sits far under its exact value, on tuning levels only. The agent is driven through
the public ``OnlineEnv`` as ``run_online`` drives it (``arrivals`` / ``choose_batch`` / ``serve`` /
``update_batch``); the script reads ``IAPOOnline``'s public ``value`` (its estimate max_N Q^(c, p, N)) and
``entries`` (requests served per prompt).

    .venv/bin/python research/lockout.py mv_many_queries --levels 3 8 17 --runs 2

For each run it prints its regret at ``--horizon`` and every window of ``--window`` requests (after the first)
whose regret per request exceeds ``--rate``: the prompt served most in it, context 0's best prompt with its exact
value, the agent's estimate of it and its requests at the window's start, and what those requests showed: their
mean utility under context 0 against the mean exact Q(0, p, N) of their arms (an estimate far below both is the
estimator's bias; one near the first and below the second, unlucky pulls). Used for research/online_tuning.md,
"Early lock-outs on `mv_many_queries`".
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from agents.online.iapo_online import IAPOOnline
from iapo_gym.online import OnlineEnv
from iapo_gym.seeding import derive_seed
from iapo_gym.tasks.generated import TUNING_LEVELS


@dataclass(frozen=True)
class Window:
    """A window of requests ``start`` .. ``start + size - 1`` with more regret per request than the rate asked for."""

    start: int
    regret: float
    served: int  # the prompt served most in it
    estimate: float  # the agent's estimate of context 0's best prompt at the window's start
    entries: int  # that prompt's requests then
    shown: float  # their mean utility under context 0
    due: float  # the mean exact Q(0, p, N) of their arms


@dataclass(frozen=True)
class Run:
    """One run: ``regret`` (T,) each request's exact regret, context 0's ``best`` prompt, the windows found."""

    regret: np.ndarray
    best: int
    exact: np.ndarray  # (C, P) each prompt's exact value at its best N
    windows: list[Window]


def lockouts(family: str, level: int, seed: int = 0, horizon: int = 25_000, window: int = 2_000,
             rate: float = 0.02, batch_size: int = 16, budget: int | None = None) -> Run:
    """The windows of one stationary run of ``iapo_online`` (defaults; ``budget``: its warm start's completions, 0
    for none) whose regret per request exceeds ``rate``."""
    if not TUNING_LEVELS.start <= level < TUNING_LEVELS.stop:
        raise ValueError(f"tuning levels only: {TUNING_LEVELS.start}..{TUNING_LEVELS.stop - 1}, got {level}")
    if window % batch_size:
        raise ValueError(f"window ({window}) must be a multiple of batch_size ({batch_size})")
    env = OnlineEnv(family=family, level=level, horizon=horizon)
    q, _ = env.segment_tensors(0)
    exact = q.max(axis=2)
    best = int(np.argmax(exact[0]))
    agent = IAPOOnline() if budget is None else IAPOOnline(budget=budget)
    env.reset(seed=seed)
    agent.start(env, derive_seed(seed, "agent"))
    regret = np.empty(horizon)
    prompts = np.empty(horizon, dtype=np.int64)
    shown: list[np.ndarray] = []  # utilities under context 0 of the best prompt's pulls so far
    due: list[np.ndarray] = []  # the exact Q(0, best, N) of those pulls
    at_start: dict[int, tuple[float, int, float, float]] = {}
    while env.t < horizon:
        if env.t % window == 0:
            u, e = np.concatenate(shown or [np.zeros(0)]), np.concatenate(due or [np.zeros(0)])
            at_start[env.t] = (float(agent.value[0, best]), int(agent.entries[best]),
                               float(u.mean()) if u.size else np.nan, float(e.mean()) if e.size else np.nan)
        requests = env.arrivals(min(batch_size, horizon - env.t))
        chosen, ns = agent.choose_batch(requests)
        served = env.serve(requests, chosen, ns)
        agent.update_batch(requests, served)
        regret[requests.start:requests.start + len(requests)] = served.regret
        prompts[requests.start:requests.start + len(requests)] = chosen
        mine = np.flatnonzero(chosen == best)
        shown.append(served.utilities[0, mine])
        due.append(q[0, best, ns[mine] - 1])
    found = []
    for start in range(window, horizon, window):
        part = slice(start, start + window)
        if regret[part].mean() > rate:
            found.append(Window(start, float(regret[part].sum()), int(np.bincount(prompts[part]).argmax()),
                                *at_start[start]))
    return Run(regret, best, exact, found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family")
    parser.add_argument("--levels", type=int, nargs="+", default=[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--horizon", type=int, default=25_000)
    parser.add_argument("--window", type=int, default=2_000)
    parser.add_argument("--rate", type=float, default=0.02, help="regret per request that marks a lock-out window")
    parser.add_argument("--budget", type=int, default=None,
                        help="the agent's warm-start completions (default: its own; 0: no warm start)")
    args = parser.parse_args()
    for level in args.levels:
        for seed in range(args.runs):
            run = lockouts(args.family, level, seed, args.horizon, args.window, args.rate, budget=args.budget)
            print(f"{args.family} level {level} run {seed}: regret {run.regret.sum():.1f} at {args.horizon}; context "
                  f"0's best prompt {run.best} (exact {run.exact[0, run.best]:.3f})")
            for w in run.windows:
                print(f"  requests {w.start:,}-{w.start + args.window:,}: regret {w.regret:.1f}, mostly prompt "
                      f"{w.served} (exact {run.exact[0, w.served]:.3f}); prompt {run.best} estimated {w.estimate:.3f} "
                      f"on {w.entries} requests (their mean utility {w.shown:.3f}, exact {w.due:.3f})")


if __name__ == "__main__":
    main()
