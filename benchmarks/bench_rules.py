"""Benchmark: stopping rules (``iapo_gym.rules``) against fixed N: exact optima, and PSST and ``auto`` trained with
and without them on held-out generated levels.

Three parts (``--part``; default all three, or ``exact`` alone when ``--tasks`` is given):

``exact``: for each task (MATH and one held-out level of each original generated family) two tables.

Time: today's ``q_table`` on the test split (with the table's exact tensor as loaded: MATH's file stores it; and
computed from nothing, the table's derived arrays cleared) beside ``q_table(split, rules=True)`` computed from
nothing, the first time in the process (with the rules' state enumeration) and again (enumeration cached per
process, the table's arrays cleared); best of ``--repeats`` for the repeated runs, in the same process.

Value, per context (its cost weight): the test ACR term of the oracle's best arm over (p, N) (fixed N) and over
(p, N, rule); the expected spend (cost per completion x expected completions, mean over test queries) of the
fixed-N optimum; the cheapest (p, N, rule) whose Q is at least the fixed-N optimum's, its spend and the share of
the fixed-N spend it saves at no loss of Q; and the best task reward among arms that spend no more than the
fixed-N optimum, against the fixed-N optimum's. Then the ACR (context-probability weighted) of both optima.

``levels``: the same value table on many held-out levels of each family (levels 1,000,000 on), summarised per
family: the test ACR of the optimum over (p, N) and over (p, N, rule), and at each level's highest cost weight the
share of the fixed-N optimum's spend saved at no loss of Q (the issue's goal: >= 25 % on majority vote).

``agents``: PSST and ``auto`` (``--agents``) trained by the leaderboard's own sweep (``run_sweep``) on held-out levels
(one level per run, its stored split) with ``rules=True`` (envs with ``rule_arms=True``, scored and the optimum over
``q_table(rules=True)``) and with ``rules=False``, with the same root seeds, so the env and agent seeds of each pair are
the same. Per (family, agent, budget): the enlarged ceiling, each arm set's test ACR and its regret against the
enlarged ceiling, and the paired ACR gained by rules (mean, 95 % t interval, wins/losses/ties, sign test and
Wilcoxon signed-rank p); then per majority-vote family whether ``auto`` with rules beats ``auto`` without at the
largest budget (mean gain > 0 and Wilcoxon p < 0.05). The sweeps are stored in ``--out`` (one folder per arm set and
seed) and resume when rerun (a rerun with the same options only prints); a change of an agent's source since is
refused (``OUT/agent_sources.json``: remove the folder or give another ``--out``).

Sizes: the default is small (the exact part's tasks; 2 levels per family; the agents on 2 levels x 1 seed of the
six original families); ``--full`` is the measurement in docs/rules.md (every family of ``families()``, 12 levels
each; the agents on those levels x 2 root seeds; about 15 minutes on 2 shared cores).

Run (MATH needs its table: ``IAPO_GYM_DATA`` pointing at a folder with MATH_final.pkl or math.h5; without it MATH
is skipped with a note)::

    nice -n 10 .venv/bin/python benchmarks/bench_rules.py
    nice -n 10 .venv/bin/python benchmarks/bench_rules.py --full --jobs 2
    nice -n 10 .venv/bin/python benchmarks/bench_rules.py --tasks generated:mv_categorical:1000000 --repeats 1
    nice -n 10 .venv/bin/python benchmarks/bench_rules.py --part agents --families mv_binary --levels 2 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

#: The held-out levels of every generated family start here (docs/tasks.md).
HELD_OUT = 1_000_000
#: The generated families of the paper-sized suite: three majority-vote (mv_categorical is the CommonsenseQA-like
#: one, math_like MATH-like) and three Best-of-N families.
ORIGINAL_FAMILIES = ("mv_categorical", "mv_binary", "math_like", "bon_shift", "bon_shape", "bon_flat")
DEFAULT_TASKS = ("IAPO-MATH-v0",) + tuple(f"generated:{f}:{HELD_OUT}" for f in ORIGINAL_FAMILIES)
AGENTS = ("psst", "auto")
BUDGETS = (3000, 5000, 10000)
DEFAULT_OUT = "results/bench_rules"


def load(task: str):
    """The env of ``task``: a registered env id or ``generated:FAMILY:LEVEL``."""
    import gymnasium as gym

    import iapo_gym  # noqa: F401

    if task.startswith("generated:"):
        _, family, level = task.split(":")
        return gym.make("IAPO-Generated-v0", family=family, level=int(level)).unwrapped
    return gym.make(task).unwrapped


def timings(env, repeats: int) -> dict[str, float]:
    """Seconds of today's q_table (as loaded, and from nothing) and of q_table(rules=True) (first, repeated)."""
    from iapo_gym.oracle import q_table

    table, queries = env.table, env.queries("test")
    out: dict[str, float] = {}
    start = time.perf_counter()
    q_table(table, queries)
    out["q_table as loaded"] = time.perf_counter() - start

    def cold(rules: bool) -> float:
        table._cache.clear()  # the exact tensor and the rules' tensors: computed again
        start = time.perf_counter()
        q_table(table, queries, rules=rules)
        return time.perf_counter() - start

    out["q_table from nothing"] = min(cold(False) for _ in range(repeats))
    out["rules, first in process"] = cold(True)
    out["rules, repeated"] = min(cold(True) for _ in range(repeats))
    return out


def value_table(env) -> list[dict[str, float | str]]:
    """Per context: the fixed-N and rules optima, the spend saved at equal Q and the reward added at equal spend."""
    from iapo_gym.oracle import expected_cost, q_table
    from iapo_gym.rules import rule_label

    table, queries = env.table, env.queries("test")
    q = q_table(table, queries, rules=True)  # (C, P, N, R)
    spend = expected_cost(table, queries)
    w_cost = table.context_weights[:, -1]
    reward = q - w_cost[:, None, None, None] * spend
    rules = env.rules
    rows = []
    n_max = table.n_max
    for c in range(table.n_contexts):
        fixed = np.unravel_index(int(q[c, :, :, 0].argmax()), q[c, :, :, 0].shape)
        best = np.unravel_index(int(q[c].argmax()), q[c].shape)
        q_fixed, s_fixed = q[c][fixed + (0,)], spend[c][fixed + (0,)]
        tol = 1e-12 * max(1.0, abs(q_fixed))
        ok = q[c] >= q_fixed - tol
        cheap = np.unravel_index(int(np.where(ok, spend[c], np.inf).argmin()), ok.shape)
        within = spend[c] <= s_fixed * (1 + 1e-12)
        rich = np.unravel_index(int(np.where(within, reward[c], -np.inf).argmax()), within.shape)
        rows.append({
            "context": table.context_names[c], "cost weight": float(-w_cost[c]), "prob": float(table.context_probs[c]),
            "Q fixed": float(q_fixed), "Q rules": float(q[c][best]),
            "fixed arm": f"p{fixed[0]} N={fixed[1] + 1}",
            "rules arm": f"p{best[0]} N={best[1] + 1} {rule_label(rules[best[2]])}",
            "spend fixed": float(s_fixed), "spend at equal Q": float(spend[c][cheap]),
            "saved": float(1.0 - spend[c][cheap] / s_fixed) if s_fixed > 0 else 0.0,
            "cheapest arm": f"p{cheap[0]} N={cheap[1] + 1} {rule_label(rules[cheap[2]])}",
            "reward fixed": float(reward[c][fixed + (0,)]), "reward at equal spend": float(reward[c][rich]),
            "draws fixed": float(fixed[1] + 1),
            "draws at equal Q": float(env.expected_drawn("test")[c][cheap]),
            "n_max": n_max,
        })
    return rows


def exact_part(tasks: list[str], repeats: int) -> None:
    """Per task: the timings and the per-context value table (see the module docstring)."""
    for task in tasks:
        try:
            env = load(task)
        except Exception as err:  # a table that is not on this machine: say so and go on
            print(f"\n## {task}: skipped ({type(err).__name__}: {str(err).splitlines()[0][:160]})")
            continue
        t = env.table
        print(f"\n## {task} ({t.aggregator}, P={t.n_prompts}, Q={t.n_queries}, B/M={t.n_atoms}, N_max={t.n_max}, "
              f"C={t.n_contexts}, rules: {len(env.rules)})")
        times = timings(env, repeats)
        base = times["q_table from nothing"]
        print("time (s): " + ", ".join(f"{k} {v:.3f}" for k, v in times.items())
              + f"; rules / from nothing: first {times['rules, first in process'] / base:.1f}x, "
              f"repeated {times['rules, repeated'] / base:.1f}x")
        rows = value_table(env)
        print("| context | cost weight | Q fixed (arm) | Q rules (arm) | spend fixed (draws) | spend at equal Q "
              "(draws, arm) | saved | reward fixed | reward at equal spend |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['context']} | {r['cost weight']:g} | {r['Q fixed']:.4f} ({r['fixed arm']}) | "
                  f"{r['Q rules']:.4f} ({r['rules arm']}) | {r['spend fixed']:.4g} ({r['draws fixed']:.0f}) | "
                  f"{r['spend at equal Q']:.4g} ({r['draws at equal Q']:.2f}, {r['cheapest arm']}) | "
                  f"{100 * r['saved']:.1f} % | {r['reward fixed']:.4f} | {r['reward at equal spend']:.4f} |")
        acr_fixed, acr_rules = optimum_acrs(rows)
        print(f"test ACR: fixed N {acr_fixed:.4f}, with rules {acr_rules:.4f} (+{acr_rules - acr_fixed:.4f})")


def optimum_acrs(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """The test ACR (context-probability weighted) of the optimum over (p, N) and over (p, N, rule)."""
    probs = np.array([r["prob"] for r in rows])
    return float(probs @ [r["Q fixed"] for r in rows]), float(probs @ [r["Q rules"] for r in rows])


def levels_part(families: list[str], n_levels: int) -> None:
    """Per family, the exact value of rules over ``n_levels`` held-out levels (see the module docstring)."""
    print(f"\n## Exact, held-out levels {HELD_OUT}-{HELD_OUT + n_levels - 1} of each family (test split)\n")
    print("| family | aggregator | levels | ACR fixed N (mean) | ACR with rules (mean) | ACR gained: mean [min, max] "
          "| saved at the highest cost weight, equal Q: mean / median [min, max] | levels saving >= 25 % | "
          "reward added at equal spend, highest cost weight: mean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for family in families:
        fixed, rules, saved, added = [], [], [], []
        aggregator = "?"
        for level in range(HELD_OUT, HELD_OUT + n_levels):
            env = load(f"generated:{family}:{level}")
            aggregator = env.table.aggregator
            rows = value_table(env)
            acr_fixed, acr_rules = optimum_acrs(rows)
            fixed.append(acr_fixed)
            rules.append(acr_rules)
            high = max(rows, key=lambda r: (r["cost weight"], r["context"]))
            saved.append(high["saved"])
            added.append(high["reward at equal spend"] - high["reward fixed"])
            env.table._cache.clear()  # the rules' tensors of a level are not needed again
        gain = np.array(rules) - np.array(fixed)
        s = 100 * np.array(saved)
        print(f"| {family} | {aggregator} | {n_levels} | {np.mean(fixed):.4f} | {np.mean(rules):.4f} | "
              f"+{gain.mean():.4f} [{gain.min():+.4f}, {gain.max():+.4f}] | {s.mean():.1f} % / {np.median(s):.1f} % "
              f"[{s.min():.1f}, {s.max():.1f}] | {int((s >= 25).sum())} of {n_levels} | +{np.mean(added):.4f} |")


def family_aggregator(family: str) -> str:
    """``mv`` or ``bon``."""
    from iapo_gym.tasks.generated import get_family

    return str(get_family(family).aggregator)


def sweep_folder(out: Path, rules: bool, seed: int) -> Path:
    """Where the agents part stores one arm set's runs of one root seed."""
    return out / f"{'rules' if rules else 'fixed'}-seed{seed}"


def check_agent_sources(out: Path, specs: list[Any]) -> None:
    """Runs kept in ``out`` are only reused by agents of the same source: ``out/agent_sources.json`` records each
    agent's source digest (the bundles' ``agent_source_digest``); a changed agent stops the benchmark with a message."""
    from iapo_gym.leaderboard.submit.bundle import agent_source_digest

    record = out / "agent_sources.json"
    here = {spec.name: agent_source_digest(spec.name)["sha256"] for spec in specs}
    kept = json.loads(record.read_text()) if record.is_file() else {}
    changed = sorted(name for name in here if name in kept and kept[name] != here[name])
    if changed:
        raise SystemExit(f"the source of {', '.join(changed)} changed since the runs in {out} were made; "
                         f"remove {out} or give another --out")
    out.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({**kept, **here}, indent=1, sort_keys=True) + "\n")


def agents_part(families: list[str], n_levels: int, seeds: list[int], agents: list[str], budgets: list[int],
                out: Path, jobs: int) -> None:
    """Train the agents with and without rules on held-out levels (resumable) and print the paired comparison."""
    from iapo_gym.leaderboard.run.runner import run_sweep
    from iapo_gym.leaderboard.run.specs import parse_agent_spec, resolve_task
    from iapo_gym.leaderboard.run.store import ResultStore

    last = HELD_OUT + n_levels - 1
    tasks = [resolve_task(f"generated:{f}:{HELD_OUT}-{last}") for f in families]
    specs = [parse_agent_spec(a) for a in agents]
    check_agent_sources(out, specs)
    rows: dict[tuple[bool, int], dict[tuple[str, str, int, int], Any]] = {}
    start = time.monotonic()
    for seed in seeds:
        for rules in (False, True):
            folder = sweep_folder(out, rules, seed)
            summary = run_sweep(folder, tasks, specs, budgets, 1, jobs=jobs, root_seed=seed, rules=rules,
                                log=sys.stderr)
            if summary.failures:
                raise SystemExit(f"{len(summary.failures)} runs failed in {folder}: {summary.failures[0].message}")
            with ResultStore(folder, create=False) as store:
                rows[(rules, seed)] = {(r.task, r.label, r.budget, r.run): r for r in store.results()
                                       if r.task in {t.name for t in tasks}}
    print(f"\n## Agents with and without rules, held-out levels {HELD_OUT}-{last} x root seeds "
          f"{', '.join(map(str, seeds))} (sweeps kept in {out}; {time.monotonic() - start:.0f} s in this call)\n")
    print("Per pair (level, seed): the same env and agent seeds with rule_arms=True and False. Regret is against the "
          "enlarged ceiling (the optimum over (p, N, rule)); the fixed-N ceiling is the optimum over (p, N). "
          "Gain = ACR with rules - ACR without, paired; CI: 95 % t interval; W/L/T: pairs won, lost, tied by rules; "
          "p: two-sided sign test and Wilcoxon signed-rank test.\n")
    print("| family | agent | T | pairs | ceiling fixed N / with rules | ACR without / with rules | "
          "regret vs enlarged ceiling without / with | gain mean [95 % CI] | W/L/T | sign p | Wilcoxon p |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    goals = []
    for task, family in zip(tasks, families, strict=True):
        for spec in specs:
            for budget in budgets:
                pairs = []
                for seed in seeds:
                    for key, f_row in rows[(False, seed)].items():
                        if key[:3] == (task.name, spec.label, budget) and key in rows[(True, seed)]:
                            pairs.append((f_row, rows[(True, seed)][key]))
                if not pairs:
                    continue
                line, gain, p_wilcoxon = paired_line(family, spec.label, budget, pairs)
                print(line)
                if spec.name == "auto" and budget == max(budgets) and family_aggregator(family) == "mv":
                    goals.append((family, gain, p_wilcoxon, len(pairs)))
    for family, gain, p, n in goals:
        met = gain > 0 and p < 0.05
        few = "; fewer than 6 pairs cannot reach p < 0.05" if n < 6 else ""
        print(f"goal ({family}): auto with rules beats auto without at T={max(budgets)}, paired: "
              f"{'met' if met else 'NOT met'} (mean gain {gain:+.4f}, Wilcoxon p {p:.3g}, {n} pairs{few})")


def paired_line(family: str, label: str, budget: int, pairs: list[tuple[Any, Any]]) -> tuple[str, float, float]:
    """One row of the agents table from (run without rules, run with rules) pairs; the mean gain and Wilcoxon p."""
    from scipy import stats as sps

    from iapo_gym.leaderboard.report.stats import mean_sem, paired_test

    fixed = np.array([f.acr for f, _ in pairs])
    rules = np.array([r.acr for _, r in pairs])
    ceiling = np.array([r.optimal_acr for _, r in pairs])
    gain = rules - fixed
    mean, sem, n = mean_sem(gain)
    half = float(sps.t.ppf(0.975, n - 1) * sem) if n > 1 and sem > 0 else math.nan
    sign, wilcoxon = paired_test(rules, fixed, "sign"), paired_test(rules, fixed, "wilcoxon")
    wins, losses = int((gain > 0).sum()), int((gain < 0).sum())
    ci = f"[{mean - half:+.4f}, {mean + half:+.4f}]" if math.isfinite(half) else "[-]"
    line = (f"| {family} | {label} | {budget} | {n} | {np.mean([f.optimal_acr for f, _ in pairs]):.4f} / "
            f"{ceiling.mean():.4f} | {fixed.mean():.4f} / {rules.mean():.4f} | {(ceiling - fixed).mean():.4f} / "
            f"{(ceiling - rules).mean():.4f} | {mean:+.4f} {ci} | {wins}/{losses}/{n - wins - losses} | "
            f"{sign.p_value:.3g} | {wilcoxon.p_value:.3g} |")
    return line, mean, wilcoxon.p_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("exact", "levels", "agents", "all"),
                        help="which part to run (default: all, or exact when --tasks is given)")
    parser.add_argument("--full", action="store_true",
                        help="the measurement of docs/rules.md: every generated family, 12 levels each; the agents on "
                             "those 12 levels x root seeds 0 1")
    parser.add_argument("--tasks", nargs="+",
                        help="the exact part's tasks: env ids or generated:FAMILY:LEVEL (default: MATH and one held-out "
                             "level of each original family)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many repeated timings (default 3)")
    parser.add_argument("--families", nargs="+",
                        help="generated families of the levels and agents parts (default: the six original families; "
                             "with --full, every family)")
    parser.add_argument("--levels", type=int, help="held-out levels per family (default 2, --full 12)")
    parser.add_argument("--seeds", type=int, nargs="+", help="root seeds of the agents part (default 0, --full 0 1)")
    parser.add_argument("--agents", nargs="+", default=list(AGENTS), help="agent specs (default: psst auto)")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS), help="default: 3000 5000 10000")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"where the agents' sweeps are kept (default {DEFAULT_OUT})")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes of the agents' sweeps (default 1)")
    args = parser.parse_args()
    part = args.part or ("exact" if args.tasks else "all")
    levels = args.levels if args.levels is not None else (12 if args.full else 2)
    if levels < 1:
        parser.error(f"--levels must be >= 1, got {levels}")
    if part in ("exact", "all"):
        exact_part(args.tasks or list(DEFAULT_TASKS), args.repeats)
    if args.families:
        families = args.families
    elif args.full:
        from iapo_gym.tasks.generated import families as all_families

        families = sorted(all_families(), key=lambda f: family_aggregator(f) != "mv")  # majority vote first
    else:
        families = list(ORIGINAL_FAMILIES)
    if part in ("levels", "all"):
        levels_part(families, levels)
    if part in ("agents", "all"):
        seeds = args.seeds if args.seeds is not None else ([0, 1] if args.full else [0])
        agents_part(families, levels, seeds, args.agents, args.budgets, Path(args.out), args.jobs)


if __name__ == "__main__":
    main()
