"""Benchmark: stopping rules (``iapo_gym.rules``) against fixed N, exact, on MATH and generated levels.

For each task it prints two tables.

Time: today's ``q_table`` on the test split (with the table's exact tensor as loaded: MATH's file stores it; and
computed from nothing, the table's derived arrays cleared) beside ``q_table(split, rules=True)`` computed from
nothing, the first time in the process (with the rules' state enumeration) and again (enumeration cached per
process, the table's arrays cleared); best of ``--repeats`` for the repeated runs, in the same process.

Value, per context (its cost weight): the test ACR term of the oracle's best arm over (p, N) (fixed N) and over
(p, N, rule); the expected spend (cost per completion x expected completions, mean over test queries) of the
fixed-N optimum; the cheapest (p, N, rule) whose Q is at least the fixed-N optimum's, its spend and the share of
the fixed-N spend it saves at no loss of Q; and the best task reward among arms that spend no more than the
fixed-N optimum, against the fixed-N optimum's. Then the ACR (context-probability weighted) of both optima.

Run (MATH needs its table: ``IAPO_GYM_DATA`` pointing at a folder with MATH_final.pkl or math.h5; without it MATH
is skipped with a note)::

    nice -n 10 .venv/bin/python benchmarks/bench_rules.py
    nice -n 10 .venv/bin/python benchmarks/bench_rules.py --tasks generated:mv_categorical:1000000 --repeats 1
"""

from __future__ import annotations

import argparse
import time

import numpy as np

DEFAULT_TASKS = ("IAPO-MATH-v0", "generated:mv_categorical:1000000", "generated:math_like:1000000",
                 "generated:bon_shift:1000000", "generated:bon_flat:1000000")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS),
                        help="env ids or generated:FAMILY:LEVEL (default: MATH and four held-out levels)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many repeated timings (default 3)")
    args = parser.parse_args()
    for task in args.tasks:
        try:
            env = load(task)
        except Exception as err:  # a table that is not on this machine: say so and go on
            print(f"\n## {task}: skipped ({type(err).__name__}: {str(err).splitlines()[0][:160]})")
            continue
        t = env.table
        print(f"\n## {task} ({t.aggregator}, P={t.n_prompts}, Q={t.n_queries}, B/M={t.n_atoms}, N_max={t.n_max}, "
              f"C={t.n_contexts}, rules: {len(env.rules)})")
        times = timings(env, args.repeats)
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
        probs = np.array([r["prob"] for r in rows])
        acr_fixed = float(probs @ [r["Q fixed"] for r in rows])
        acr_rules = float(probs @ [r["Q rules"] for r in rows])
        print(f"test ACR: fixed N {acr_fixed:.4f}, with rules {acr_rules:.4f} (+{acr_rules - acr_fixed:.4f})")


if __name__ == "__main__":
    main()
