"""Benchmark of the online protocol (docs/online.md): cumulative exact regret of the online agents, and the
driver's requests per second.

Results mode (default): held-out levels of the chosen families under each schedule, a few runs each, every
agent through ``run_online``; prints the mean cumulative regret at T/10, T/2 and T (and its spread over the
level x run pairs). Agents are ``make_online`` names or the peers of ``online_peers.py`` (``vw``, ``mabwiser``).
``--speed``: requests per second at T = 100K on a 27-context table, of the driver with a trivial agent (one fixed
arm) through ``env.step``, through ``run_online`` one request at a time and in batches, of the recommended agent
``iapo_online`` through ``env.step`` and in batches, of the UCB agent (T = 20K) and of the peers (T = 2K);
``--speed-peers``: the peers' rows alone.
``--tune c`` / ``--tune discount`` / ``--tune sigma``: UCB's exploration weight and discount, Thompson sampling's
sigma, on tuning levels (never held-out).

``--out DIR``: the same grid through the leaderboard's runner (``iapo-gym leaderboard --protocol online``):
resumable (rerun the command to continue after an interruption), ``--jobs`` worker processes, rows in
``DIR/results.sqlite``; the peers run as the agent specs ``online_peers:VowpalWabbit@vw`` and
``online_peers:MABWiserLinUCB@mabwiser`` (worker processes import ``online_peers`` from this folder, on the
``sys.path`` they inherit). Prints the online report (cumulative regret at the checkpoints, each agent paired
against the first ``--baseline``, default ``etc_auto``) and each agent's paired comparison against every further
``--baseline`` (default ``vw``, when it is among ``--agents``), then the goal table of ``--candidate`` (default
``iapo_online``) against every baseline at T; ``--figure PNG`` draws every cell's regret curves in one figure. The
report covers the command's families, schedules and agents, whatever else the folder holds.

Run: ``.venv/bin/python benchmarks/bench_online.py`` (about two minutes on two cores),
``.venv/bin/python benchmarks/bench_online.py --speed``, ``.venv/bin/python benchmarks/bench_online.py --tune c``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from agents.online import make_online
from iapo_gym.online import OnlineAgent, OnlineAgentBase, OnlineEnv, Requests, run_online
from iapo_gym.tasks.generated import HELD_OUT_LEVELS, TUNING_LEVELS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_peers import PEERS  # noqa: E402  (benchmarks/ is not a package)

SPEED_TABLE = ("bon_shift", 1_000_017)  # 23 prompts, 924 queries, 27 contexts, N_max 44
VERDICT = {1: "**less**", -1: "**more**", 0: "n.s."}  # a paired row's winner (+1: significantly less regret)
PEER_SPEED_HORIZON = 2_000  # the peers' speed rows: VW and MABWiser are far slower than the suite's agents


def make_agent(name: str) -> OnlineAgent:
    """An agent of ``make_online`` or a peer of ``online_peers.PEERS`` (``vw``, ``mabwiser``), by name."""
    return PEERS[name]() if name in PEERS else make_online(name)


class FixedArm(OnlineAgentBase):
    """The trivial agent of the speed test: prompt 0 (or the first available), N = 1."""

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        """One fixed arm for every request."""
        p = int(np.argmax(requests.available))
        return np.full(len(requests), p, dtype=np.int64), np.ones(len(requests), dtype=np.int64)


def results(families: list[str], schedules: list[str], agents: list[str], levels: int, runs: int,
            horizon: int, batch_size: int) -> None:
    """Print the regret table: one row per (family, schedule, agent)."""
    rows: dict[tuple[str, str, str], list[np.ndarray]] = {}
    start = time.perf_counter()
    for family in families:
        for schedule in schedules:
            for level in range(HELD_OUT_LEVELS.start, HELD_OUT_LEVELS.start + levels):
                env = OnlineEnv(family=family, level=level, schedule=schedule, horizon=horizon)
                for run in range(runs):
                    for name in agents:
                        result = run_online(env, make_agent(name), seed=run, batch_size=batch_size)
                        rows.setdefault((family, schedule, name), []).append(result.cumulative_regret)
    elapsed = time.perf_counter() - start
    print(f"T = {horizon}, held-out levels {HELD_OUT_LEVELS.start}..{HELD_OUT_LEVELS.start + levels - 1} x "
          f"{runs} runs, batch size {batch_size}; {elapsed:.0f} s")
    print("| family | schedule | agent | regret at T/10 | at T/2 | at T (mean ± sd over level x run) |")
    print("|---|---|---|---:|---:|---:|")
    for (family, schedule, name), curves in rows.items():
        c = np.array(curves)
        at = c[:, [9, 49, 99]] if c.shape[1] == 100 else c[:, [c.shape[1] // 10 - 1, c.shape[1] // 2 - 1, -1]]
        mean, sd = at.mean(axis=0), at[:, 2].std(ddof=1) if len(at) > 1 else 0.0
        print(f"| {family} | {schedule} | {name} | {mean[0]:.1f} | {mean[1]:.1f} | {mean[2]:.1f} ± {sd:.1f} |")


def runner_spec(name: str) -> str:
    """The leaderboard agent spec of a ``--agents`` name: a peer becomes ``online_peers:Class@name`` (its module is
    importable here and in the worker processes, which inherit this script's ``sys.path``), anything else stays."""
    return f"online_peers:{PEERS[name].__name__}@{name}" if name in PEERS else name


def versus_markdown(report: Any) -> str:
    """Every agent against ``report.baseline`` at T/2 and T of each (task, schedule, horizon): the mean ratio of
    cumulative regret, the adjusted p and the verdict (the report's paired statistics, ``pair_online``)."""
    lines = [f"Against `{report.baseline}` ({report.test} test, {report.correction} correction, alpha "
             f"{report.alpha}; ratio = agent's mean cumulative regret / `{report.baseline}`'s on the paired runs; "
             "**less** / **more**: significantly less / more regret):", "",
             "| task | schedule | T | agent | at T/2 | at T |", "|---|---|---:|---|---:|---:|"]
    cells: dict[tuple[str, str, int, str], dict[int, Any]] = {}  # per (task, schedule, T, label): checkpoint -> row
    for p in report.pairs:
        cells.setdefault((p.task, p.schedule, p.horizon, p.label), {})[p.checkpoint] = p
    for (task, schedule, horizon, label), at in sorted(cells.items()):
        shown = []
        for point in (horizon // 2, horizon):
            p = at[min(at, key=lambda c: abs(c - point))]  # noqa: B023  (the tested checkpoint nearest T/2, T)
            shown.append(f"{p.mean_ratio:.2f}x, p {p.p_adjusted:.3g}, {VERDICT[p.winner]}")
        lines.append(f"| {task} | {schedule} | {horizon} | {label} | {shown[0]} | {shown[1]} |")
    return "\n".join(lines) + "\n"


def _goal_rule(schedule: str, first: bool) -> tuple[str, Any]:
    """The part of issue 53's goal a cell of ``schedule`` is judged by against the first baseline (``first``) or a
    further one: its wording and its test of the candidate's paired row at T."""
    if not first:
        return "significantly less regret", lambda p: p.winner == 1
    if schedule in ("drift", "arrival"):
        return "at most half the regret", lambda p: p.mean_ratio <= 0.5
    return "not significantly more regret", lambda p: p.winner >= 0


def goal_markdown(reports: list[Any], candidate: str) -> str:
    """Issue 53's goal at T, one row per (task, schedule, horizon): ``candidate``'s mean cumulative regret and each
    baseline's (one report per baseline, each paired against it), the mean ratio, adjusted p and verdict; then the
    counts the goal is judged by (``_goal_rule``: drift and arrival: at most half of the first baseline's regret;
    stationary and the other schedules: never significantly more; every cell: significantly less than each further
    baseline)."""
    names = [r.baseline for r in reports]
    lines = [f"`{candidate}` at T against {', '.join(f'`{n}`' for n in names)} (ratio = mean cumulative regret over "
             "the baseline's on the paired runs; p adjusted; **less** / **more**: significantly less / more):", "",
             "| task | schedule | T | " + " | ".join([candidate, *names]) + " | "
             + " | ".join(f"vs {n}" for n in names) + " |",
             "|---|---|---:|" + "---:|" * (1 + 2 * len(names))]
    at_t = [{(p.task, p.schedule, p.horizon): p for p in r.pairs if p.label == candidate and p.checkpoint == p.horizon}
            for r in reports]  # per report: the candidate's paired row at T of each cell
    counts: dict[tuple[str, str], list[int]] = {}  # (schedule, baseline) -> [cells meeting the goal, cells]
    for cell in reports[0].cells():
        curves = [r.curves(cell) for r in reports]
        if candidate not in curves[0] or any(n not in c for n, c in zip(names, curves, strict=True)):
            continue
        means = [curves[0][candidate][1][-1]] + [c[n][1][-1] for n, c in zip(names, curves, strict=True)]
        verdicts = []
        for k, name in enumerate(names):
            p = at_t[k][cell]
            verdicts.append(f"{p.mean_ratio:.2f}x, p {p.p_adjusted:.2g}, {VERDICT[p.winner]}")
            tally = counts.setdefault((cell[1], name), [0, 0])
            tally[0] += int(_goal_rule(cell[1], k == 0)[1](p))
            tally[1] += 1
        task = cell[0].split(":")[1] if cell[0].startswith("generated:") else cell[0]
        lines.append(f"| {task} | {cell[1]} | {cell[2]} | " + " | ".join(f"{m:,.1f}" for m in means) + " | "
                     + " | ".join(verdicts) + " |")
    lines.append("")
    for (schedule, name), (good, total) in sorted(counts.items()):
        rule = _goal_rule(schedule, name == names[0])[0]
        lines.append(f"- {schedule}, against `{name}` ({rule}): {good} of {total} cells")
    return "\n".join(lines) + "\n"


def through_runner(out: str, families: list[str], schedules: list[str], agents: list[str], levels: int, runs: int,
                   horizon: int, batch_size: int, jobs: int, baselines: list[str], candidate: str,
                   figure: str | None) -> None:
    """The results grid through the leaderboard's runner into ``out`` (resumable), then its online report paired
    against the first of ``baselines`` and the paired comparisons against each other one that has runs; the goal
    table of ``candidate`` against the baselines when all of them ran, and (``figure``) every cell's regret curves
    in one figure."""
    from iapo_gym.leaderboard.report.online import online_markdown, online_report, plot_regret_grid
    from iapo_gym.leaderboard.run.online import parse_online_spec, run_online_sweep
    from iapo_gym.leaderboard.run.specs import resolve_task

    first = HELD_OUT_LEVELS.start
    tasks = [resolve_task(f"generated:{family}:{first}-{first + levels - 1}") for family in families]
    specs = [parse_online_spec(runner_spec(a)) for a in agents]
    summary = run_online_sweep(out, tasks, specs, schedules, [horizon], runs, jobs=jobs, batch_size=batch_size)
    print(f"{summary.added} runs added, {summary.skipped} already in {out}, {len(summary.failures)} failed; "
          f"{summary.seconds:.0f} s")
    reports = []
    for k, baseline in enumerate(baselines):
        report = online_report(out, baseline=baseline, tasks=[t.name for t in tasks], schedules=schedules,
                               agents=[spec.label for spec in specs])
        if report is None:
            return
        if k == 0:
            print(online_markdown(report))
        elif any(r.label == baseline for r in report.results):
            print(versus_markdown(report))
        else:
            print(f"No runs of `{baseline}` among --agents in {out}: no comparison against it.\n")
            continue
        reports.append(report)
    if any(r.label == candidate for r in reports[0].results):
        print(goal_markdown(reports, candidate))
    if figure:
        print(f"regret curves: {plot_regret_grid(reports[0], Path(figure))}")


def rate(fn: Any, requests: int) -> float:
    """Requests per second of ``fn`` (best of two)."""
    best = np.inf
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return requests / best


def speed(horizon: int) -> None:
    """Print requests per second at ``horizon`` on the 27-context table."""
    family, level = SPEED_TABLE
    env = OnlineEnv(family=family, level=level, horizon=horizon)
    print(f"{family} level {level}: {env.table.n_prompts} prompts, {env.table.n_queries} queries, "
          f"{env.table.n_contexts} contexts, N_max {env.table.n_max}; T = {horizon}")
    env.segment_tensors(0)  # the exact tensor, outside the timing

    def step_loop() -> None:
        agent = FixedArm()
        obs, _ = env.reset(seed=0)
        while True:
            obs, _, done, _, _ = env.step(agent.choose(obs))
            if done:
                return

    print(f"  trivial agent, env.step loop:             {rate(step_loop, horizon):>10,.0f} requests/s")
    for b in (1, 64, 1024):
        r = rate(lambda b=b: run_online(env, FixedArm(), seed=0, batch_size=b), horizon)
        print(f"  trivial agent, run_online batch {b:>5}:     {r:>10,.0f} requests/s")

    def agent_loop(name: str) -> None:
        agent = make_online(name)
        assert isinstance(agent, OnlineAgentBase)  # the one-request forms choose / update
        obs, _ = env.reset(seed=0)
        agent.start(env, 0)
        while True:
            action = agent.choose(obs)
            next_obs, _, done, _, info = env.step(action)
            agent.update(obs, action, info)
            obs = next_obs
            if done:
                return

    r = rate(lambda: agent_loop("iapo_online"), horizon)
    print(f"  iapo_online, env.step loop:               {r:>10,.0f} requests/s")
    for b in (16, 64, 256, 1024):
        r = rate(lambda b=b: run_online(env, make_online("iapo_online"), seed=0, batch_size=b), horizon)
        print(f"  iapo_online, run_online batch {b:>5}:       {r:>10,.0f} requests/s")
    short = min(horizon, 20_000)
    env_short = OnlineEnv(family=family, level=level, horizon=short)
    for b in (1, 256):
        r = rate(lambda b=b: run_online(env_short, make_online("ucb"), seed=0, batch_size=b), short)
        print(f"  ucb, run_online batch {b:>5} (T = {short}): {r:>10,.0f} requests/s")
    peer_speed(min(horizon, PEER_SPEED_HORIZON))


def peer_speed(horizon: int) -> None:
    """Print the peers' requests per second at ``horizon`` on the 27-context table, batch size 16."""
    family, level = SPEED_TABLE
    env = OnlineEnv(family=family, level=level, horizon=horizon)
    env.segment_tensors(0)
    for name in PEERS:
        r = rate(lambda name=name: run_online(env, make_agent(name), seed=0, batch_size=16), horizon)
        print(f"  {name}, run_online batch 16 (T = {horizon}):   {r:>10,.0f} requests/s")


def tune(horizon: int, what: str) -> None:
    """On tuning levels 0-3 of every family, the mean cumulative regret at T of UCB with each ``c`` (stationary
    schedule; ``what="c"``), with c = 0.05 each ``discount`` (drift schedule; ``"discount"``), or of Thompson
    sampling with each ``sigma`` (stationary; ``"sigma"``)."""
    from iapo_gym.tasks.generated import families

    levels = range(TUNING_LEVELS.start, TUNING_LEVELS.start + 4)
    agent = "thompson" if what == "sigma" else "ucb"
    grid: list[dict[str, float]] = {
        "c": [{"c": c} for c in (0.02, 0.05, 0.1, 0.2, 0.5)],
        "discount": [{"c": 0.05, "discount": d} for d in (1.0, 0.9999, 0.9995, 0.999)],
        "sigma": [{"sigma": s} for s in (0.03, 0.1, 0.3)],
    }[what]
    schedule = "drift" if what == "discount" else "stationary"
    envs = [OnlineEnv(family=f, level=k, schedule=schedule, horizon=horizon) for f in families() for k in levels]
    for params in grid:
        total = [run_online(env, make_online(agent, **params), seed=0, batch_size=16).cumulative_regret[-1]
                 for env in envs]
        print(f"{agent} {params} ({schedule}): mean cumulative regret at T = {horizon}: {np.mean(total):.1f} "
              f"(levels {levels.start}-{levels.stop - 1} of every family, {len(total)} runs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="mv_categorical,mv_binary,bon_shift")
    parser.add_argument("--schedules", default="stationary,drift,arrival,retirement,model_arrival")
    parser.add_argument("--agents", default="iapo_online,ucb,ucb_discounted,thompson,etc_auto,etc_psst",
                        help="comma-separated names of agents.online.make_online and of online_peers.PEERS (vw, "
                             "mabwiser); with --out also leaderboard online agent specs (module:Class[:k=v][@label], "
                             "one parameter each, as commas separate the agents)")
    parser.add_argument("--levels", type=int, default=3, help="held-out levels per family (from 1,000,000)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--horizon", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--speed", action="store_true", help="requests per second at T = 100K instead")
    parser.add_argument("--speed-peers", action="store_true",
                        help=f"only the peers' requests per second (T = {PEER_SPEED_HORIZON:,}) instead")
    parser.add_argument("--tune", choices=("c", "discount", "sigma"),
                        help="UCB's c or discount, or Thompson's sigma, on tuning levels instead")
    parser.add_argument("--out", help="run through the leaderboard's runner into this folder (resumable)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes with --out (default: 1)")
    parser.add_argument("--baseline", action="append", metavar="LABEL",
                        help="with --out: an agent label the others pair against; repeatable, the first gets the "
                             "full report, each other one a table of paired comparisons (default: etc_auto, then "
                             "vw when it is among --agents)")
    parser.add_argument("--candidate", default="iapo_online",
                        help="with --out: the agent whose goal table (against every --baseline at T) is printed")
    parser.add_argument("--figure", metavar="PNG",
                        help="with --out: draw every (family, schedule) cell's regret curves into this file")
    args = parser.parse_args()
    if args.out:
        through_runner(args.out, args.families.split(","), args.schedules.split(","), args.agents.split(","),
                       args.levels, args.runs, args.horizon, args.batch_size, args.jobs,
                       args.baseline or ["etc_auto", "vw"], args.candidate, args.figure)
    elif args.speed:
        speed(100_000)
    elif args.speed_peers:
        peer_speed(PEER_SPEED_HORIZON)
    elif args.tune:
        tune(args.horizon, args.tune)
    else:
        results(args.families.split(","), args.schedules.split(","), args.agents.split(","), args.levels,
                args.runs, args.horizon, args.batch_size)


if __name__ == "__main__":
    main()
