"""Benchmark of the built-in agents on the official MATH table and of the estimator.

Parts (``--part``):

* ``acr``: ``--runs`` seeded 80/20 resplits at T = ``--budget``; exact test ACR of every
  agent, the train- and test-optimal policies for reference, and paired two-sided
  Wilcoxon signed-rank tests (psst vs triple_n1, psst_rb vs psst, ...).
* ``time``: median training time over ``--runs`` runs at T = ``--budget`` for every agent.
* ``speedup``: old/new training-time ratios against another checkout (``--baseline``, e.g.
  the main branch), timed alternately in subprocesses of one invocation, and a check that
  both train identical policies with identical env draws.
* ``estimator``: time of one PSST-round update (T / 9 completions at N_max) at T = 40,000
  for both reuse modes on MATH and the two synthetic tasks.

Usage: ``.venv/bin/python benchmarks/bench_agents.py --part all [--write-docs]``. Without
the release file (``--release``), the ``acr``/``time`` parts fall back to the synthetic
Bernoulli task. All seeds come from ``iapo_gym.seeding.derive_seed(--seed, ...)``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
from scipy.stats import wilcoxon

import agents
from agents.base import Agent
from agents.estimator import REUSE_MODES, Estimator
from iapo_gym import IAPOEnv
from iapo_gym.seeding import derive_seed

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RELEASE = ROOT.parent / "shared" / "iapo-release" / "MATH_final.pkl"
DOCS = ROOT / "docs" / "agents.md"
PAIRS = [("psst", "triple_n1"), ("psst_topk", "triple_n1"), ("psst", "uniform"), ("psst", "ucb"),
         ("psst_rb", "psst"), ("psst_rb_topk", "psst_topk")]


def load_env(release: Path) -> tuple[IAPOEnv, str]:
    """The MATH env from the official release, or the synthetic Bernoulli task if it is absent."""
    if release.is_file():
        from iapo_gym.data.release import read_release

        return IAPOEnv(table=read_release(str(release))[0]), f"MATH (official release {release.name})"
    print(f"warning: {release} not found, benchmarking on IAPO-SyntheticBernoulli-v0 instead", file=sys.stderr)
    return Agent.base_env(gym.make("IAPO-SyntheticBernoulli-v0", instance=0)), "Synthetic-Bernoulli instance 0"


def acr_part(env: IAPOEnv, names: list[str], runs: int, budget: int, seed: int) -> tuple[str, dict[str, np.ndarray]]:
    """Exact test ACR per agent and resplit; returns a markdown report and the raw scores."""
    scores = {name: np.empty(runs) for name in [*names, "train-optimal", "test-optimal"]}
    for i in range(runs):
        env.resplit(0.8, seed=derive_seed(seed, "resplit", i))
        scores["train-optimal"][i] = env.evaluate(env.optimal_policy("train"), "test")
        scores["test-optimal"][i] = env.evaluate(env.optimal_policy("test"), "test")
        for name in names:
            env.reset(seed=derive_seed(seed, "env", i))  # the same draws for every agent (paired)
            policy = agents.make(name, seed=derive_seed(seed, "agent", name, i)).train(env, budget)
            if env.budget_used > budget:
                raise AssertionError(f"{name} spent {env.budget_used} > {budget}")
            scores[name][i] = env.evaluate(policy, "test")
    lines = [f"| agent | test ACR (mean +- SEM, {runs} resplits) | regret vs train-optimal |", "|---|---|---|"]
    ref = scores["train-optimal"]
    for name, values in sorted(scores.items(), key=lambda kv: -kv[1].mean()):
        sem = values.std(ddof=1) / np.sqrt(runs)
        lines.append(f"| {name} | {values.mean():.4f} +- {sem:.4f} | {np.mean(ref - values):+.4f} |")
    lines += ["", "| comparison (paired by resplit) | mean difference +- SEM | Wilcoxon p (two-sided) |", "|---|---|---|"]
    for a, b in PAIRS:
        if a in scores and b in scores:
            diff = scores[a] - scores[b]
            p = wilcoxon(scores[a], scores[b], zero_method="wilcox").pvalue if np.any(diff != 0) else 1.0
            lines.append(f"| {a} - {b} | {diff.mean():+.4f} +- {diff.std(ddof=1) / np.sqrt(runs):.4f} | {p:.2g} |")
    return "\n".join(lines), scores


def train_times(env: IAPOEnv, names: list[str], runs: int, budget: int, seed: int) -> dict[str, dict[str, list]]:
    """Per agent: wall-clock training times (s) and the trained policies' arms of ``runs`` seeded runs."""
    env.resplit(0.8, seed=derive_seed(seed, "resplit", 0))
    env.reset(seed=0)
    env.pull(np.array([0]), np.array([1]))  # build the sampler once, outside the timings
    out: dict[str, dict[str, list]] = {}
    for name in names:
        times, policies = [], []
        for i in range(runs):
            env.reset(seed=derive_seed(seed, "time", i))
            agent = agents.make(name, seed=derive_seed(seed, "agent", name, i))
            start = time.perf_counter()
            policy = agent.train(env, budget)
            times.append(time.perf_counter() - start)
            policies.append([list(arm) for arm in policy.arms] + [[env.budget_used, float(env.np_random.random())]])
        out[name] = {"times": times, "policies": policies}
    return out


def time_part(env: IAPOEnv, names: list[str], runs: int, budget: int, seed: int) -> str:
    """Median (and quartiles of) wall-clock training time at ``budget`` for every agent."""
    lines = [f"| agent | median train time at T = {budget:,} | IQR |", "|---|---|---|"]
    for name, rec in train_times(env, names, runs, budget, seed).items():
        q1, med, q3 = np.percentile(np.asarray(rec["times"]) * 1000, [25, 50, 75])
        lines.append(f"| {name} | {med:.1f} ms | {q1:.1f}-{q3:.1f} ms |")
    return "\n".join(lines)


def speedup_part(baseline: Path, release: Path, names: list[str], runs: int, budget: int, seed: int,
                 rounds: int) -> str:
    """Old/new training-time ratio per agent, measured in one invocation, and a check of identical results.

    Each round times every agent in two fresh subprocesses, one importing ``baseline``'s
    checkout (e.g. the main branch) and one this checkout, alternately (so machine load hits
    both alike); ratios are of the medians over all rounds. The trained policies, the budget
    spent and the env generator's next draw must be identical for every agent and run.
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", "time", "--json", "--runs", str(runs),
           "--budget", str(budget), "--seed", str(seed), "--release", str(release), "--agents", *names]
    times: dict[str, dict[str, list[float]]] = {"old": {n: [] for n in names}, "new": {n: [] for n in names}}
    policies: dict[str, dict[str, list]] = {}
    for _ in range(rounds):
        for label, root in (("old", baseline.resolve()), ("new", ROOT)):
            env = {**os.environ, "PYTHONPATH": str(root)}
            rec = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            for name in names:
                times[label][name] += rec[name]["times"]
                policies.setdefault(label, {})[name] = rec[name]["policies"]
    lines = [f"| agent | old median ({baseline.name}) | new median | old/new | identical policies and draws |",
             "|---|---|---|---|---|"]
    for name in names:
        old, new = np.median(times["old"][name]) * 1000, np.median(times["new"][name]) * 1000
        same = policies["old"][name] == policies["new"][name]
        lines.append(f"| {name} | {old:.1f} ms | {new:.1f} ms | {old / new:.1f}x | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


def estimator_part(math_env: IAPOEnv | None, seed: int, repeats: int = 5) -> str:
    """Time of one round's update (T / 9 completions pulled at N_max, every scale) at T = 40,000."""
    envs = {"Synthetic-Bernoulli": Agent.base_env(gym.make("IAPO-SyntheticBernoulli-v0", instance=0)),
            "Synthetic-Categorical": Agent.base_env(gym.make("IAPO-SyntheticCategorical-v0", instance=0))}
    if math_env is not None:
        envs = {"MATH": math_env, **envs}
    lines = ["| task | reuse | completions | update time (median) |", "|---|---|---|---|"]
    for task, env in envs.items():
        env.reset(seed=derive_seed(seed, "estimator", task))
        per_prompt = (40_000 // 9) // (env.n_prompts * env.n_max)
        pulls = env.pull(np.repeat(np.arange(env.n_prompts), per_prompt),
                         np.full(env.n_prompts * per_prompt, env.n_max))
        for reuse in REUSE_MODES:
            times = []
            for _ in range(repeats):
                est = Estimator(env, reuse)
                start = time.perf_counter()
                est.update(pulls)
                times.append(time.perf_counter() - start)
            lines.append(f"| {task} | {reuse} | {pulls.completions:,} | {np.median(times) * 1000:.1f} ms |")
    return "\n".join(lines)


def write_docs(section: str, text: str) -> None:
    """Replace the text between ``<!-- bench:SECTION:start -->`` and ``...:end -->`` in docs/agents.md."""
    doc = DOCS.read_text()
    pattern = re.compile(rf"(<!-- bench:{section}:start -->\n).*?(\n<!-- bench:{section}:end -->)", re.S)
    if not pattern.search(doc):
        raise SystemExit(f"docs/agents.md has no bench:{section} markers")
    DOCS.write_text(pattern.sub(lambda m: m.group(1) + text + m.group(2), doc))


def main(argv: list[str] | None = None) -> int:
    """Run the requested parts, print markdown tables, optionally write them into docs/agents.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["acr", "time", "speedup", "estimator", "all"], default="all")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--budget", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=2025)
    parser.add_argument("--release", type=Path, default=DEFAULT_RELEASE)
    parser.add_argument("--agents", nargs="*", default=[n for n in agents.available() if n != "sb3"])
    parser.add_argument("--write-docs", action="store_true", help="write the tables into docs/agents.md")
    parser.add_argument("--json", action="store_true", help="time part: print raw times and policies as JSON")
    parser.add_argument("--baseline", type=Path, help="speedup part: the checkout to compare with (e.g. main's)")
    parser.add_argument("--rounds", type=int, default=3, help="speedup part: alternating subprocess rounds")
    args = parser.parse_args(argv)
    env, label = load_env(args.release)
    if args.part == "time" and args.json:
        print(json.dumps(train_times(env, args.agents, args.runs, args.budget, args.seed)))
        return 0
    if args.part == "speedup":
        if args.baseline is None:
            parser.error("--part speedup needs --baseline DIR (a checkout of the code to compare with)")
        text = (f"{label}, T = {args.budget:,}, {args.rounds} rounds x {args.runs} runs per agent:\n\n"
                + speedup_part(args.baseline, args.release, args.agents, args.runs, args.budget, args.seed,
                               args.rounds))
        print(text, "\n")
        if args.write_docs:
            write_docs("speedup", text)
        return 0
    if args.part in ("acr", "all"):
        report, _ = acr_part(env, args.agents, args.runs, args.budget, args.seed)
        text = f"{label}, T = {args.budget:,}, seed {args.seed}:\n\n{report}"
        print(text, "\n")
        if args.write_docs:
            write_docs("acr", text)
    if args.part in ("time", "all"):
        text = f"{label}:\n\n{time_part(env, args.agents, args.runs, args.budget, args.seed)}"
        print(text, "\n")
        if args.write_docs:
            write_docs("time", text)
    if args.part in ("estimator", "all"):
        text = estimator_part(env if args.release.is_file() else None, args.seed)
        print(text, "\n")
        if args.write_docs:
            write_docs("estimator", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
