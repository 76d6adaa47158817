"""A paired tuning screen on the leaderboard's tasks or on the tests' Best-of-N tables whose queries change shape.

Every spec of a level trains on the same table and env seed with the same agent seed (common random
numbers); it prints, per spec and budget, the mean train-split regret (the train-optimal policy's
train ACR minus the agent's: 0 once the agent finds it) and test regret (as the leaderboard's),
± SEM over levels, and each spec's paired gain over the first. Kinds: ``task:NAME`` (the
leaderboard's resplit / instance ``level`` under ``--seed``), ``family:FAMILY`` (generated level
``level`` of FAMILY, its stored split), ``shape6`` (6 prompts, 40 train
queries, one objective) and ``shape10`` (10 prompts, 160 train queries, two objectives), both
``tests.conftest.shape_bon_table`` with seed ``level``. For tuning: use levels and seeds never
reported on.

    IAPO_GYM_OFFLINE=1 IAPO_GYM_DATA=../shared/iapo-release nice -n 10 python research/screen_tables.py \\
        auto auto:restore=0.0 psst --kind shape6 --levels 60 --first 100 --budgets 3000 10000 40000 100000

To pair two versions of the code (the seeds depend on the level and spec only, not the code), run the screen at
the first with ``--out FILE`` and at the second with ``--against FILE``: it adds, per spec, the paired gain over the
saved run's regrets of the same spec, with the levels better and worse. ``--jobs K`` runs the levels in K worker
processes, with the same regrets.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import agents  # noqa: E402
from iapo_gym import IAPOEnv, OutcomeTable  # noqa: E402
from iapo_gym.atomic import atomic_write_text  # noqa: E402
from iapo_gym.leaderboard.run.runner import run_setup  # noqa: E402
from iapo_gym.leaderboard.run.specs import parse_agent_spec, resolve_task  # noqa: E402
from iapo_gym.oracle import acr_from_q, greedy_policy, policy_arms, q_table  # noqa: E402
from iapo_gym.seeding import derive_seed  # noqa: E402
from tests.conftest import shape_bon_table  # noqa: E402


def level_table(kind: str, level: int, seed: int) -> tuple[OutcomeTable, int, int]:
    """(table, env seed, agent seed) of one level of ``kind``."""
    if kind.startswith("family:"):  # generated level ``level``, its stored split (run 0)
        return level_table(f"task:generated:{kind[7:]}:{level}", 0, seed)
    if kind.startswith("task:"):
        setup = run_setup(resolve_task(kind[5:]), level, seed)
        return setup.run_table, setup.env_seed, derive_seed(seed, "screen-tables", kind, level)
    if kind == "shape6":
        table = shape_bon_table(seed=level, n_prompts=6, n_queries=50, n_max=32)
    elif kind == "shape10":
        table = shape_bon_table(seed=level, n_prompts=10, n_queries=200, n_max=32, n_objectives=2)
    else:
        raise SystemExit(f"--kind must be task:NAME, family:FAMILY, shape6 or shape10, got {kind!r}")
    return table, derive_seed(seed, "screen-env", kind, level), derive_seed(seed, "screen-agent", kind, level)


def level_regrets(kind: str, level: int, seed: int, budgets: list[int], specs: list[str]) -> np.ndarray:
    """(2: train, test regret; specs; budgets) of one level."""
    table, env_seed, agent_seed = level_table(kind, level, seed)
    q_train, q_test = q_table(table, table.split_indices("train")), q_table(table, table.split_indices("test"))
    reference = np.array(greedy_policy(q_train).arms, dtype=np.int64)
    ceilings = [acr_from_q(q, reference, table.context_probs) for q in (q_train, q_test)]
    out = np.zeros((2, len(specs), len(budgets)))
    for i, text in enumerate(specs):
        spec = parse_agent_spec(text)
        env = IAPOEnv(table=table)
        env.reset(seed=env_seed)
        agent = agents.make(spec.name, seed=agent_seed, **spec.params)
        if getattr(agent, "anytime", False):
            policies = [policy for _, policy in agent.train_budgets(env, budgets)]
        else:
            policies = []
            for budget in budgets:
                env.reset(seed=env_seed)
                policies.append(agents.make(spec.name, seed=agent_seed, **spec.params).train(env, budget))
        for j, policy in enumerate(policies):
            arms = policy_arms(policy, table)
            for w, q in enumerate((q_train, q_test)):
                out[w, i, j] = ceilings[w] - acr_from_q(q, arms, table.context_probs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+", help="leaderboard agent specs; the first is the reference")
    parser.add_argument("--kind", required=True)
    parser.add_argument("--levels", type=int, default=40)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--seed", type=int, default=90, help="a tuning root seed")
    parser.add_argument("--budgets", type=int, nargs="+", default=[3000, 10000, 40000])
    parser.add_argument("--out", type=Path, help="write the per-level regrets to this JSON file")
    parser.add_argument("--against", type=Path, help="a JSON file of --out, from the same arguments: paired gains over it")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes over the levels (the regrets do not depend on it)")
    args = parser.parse_args()
    budgets = sorted(args.budgets)
    setup = {"kind": args.kind, "levels": args.levels, "first": args.first, "seed": args.seed, "budgets": budgets,
             "specs": args.specs}
    saved = None
    if args.against is not None:
        try:
            against = json.loads(args.against.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise SystemExit(f"--against {args.against} cannot be read as the JSON of --out: {error}") from None
        if not isinstance(against, dict) or not {"setup", "regrets"} <= against.keys():
            raise SystemExit(f"--against {args.against} is not a file written by --out (expected the keys setup and regrets)")
        if against["setup"] != setup:
            raise SystemExit(f"--against {args.against} was run with {against['setup']}, not {setup}")
        saved = np.array(against["regrets"])  # (L, 2, S, B), as ``regrets`` below
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, got {args.jobs}")
    levels = range(args.first, args.first + args.levels)
    one = functools.partial(level_regrets, args.kind, seed=args.seed, budgets=budgets, specs=args.specs)
    if args.jobs == 1:
        per_level = [one(level) for level in levels]
    else:  # each level's seeds depend on the level alone, so the workers give what one process gives
        with multiprocessing.Pool(args.jobs) as pool:
            per_level = pool.map(one, levels, chunksize=1)
    regrets = np.array(per_level)  # (L, 2, S, B)
    if args.out is not None:
        atomic_write_text(args.out, json.dumps({"setup": setup, "regrets": regrets.tolist()}))
    root = np.sqrt(args.levels)
    for w, name in enumerate(("train regret", "test regret")):
        print(f"\n{args.kind}, {name}, levels {args.first}-{args.first + args.levels - 1}, seed {args.seed}")
        print(f"| spec | {' | '.join(f'T={b}' for b in budgets)} | gain over {args.specs[0]} |")
        print("|---|" + "---:|" * len(budgets) + "---|")
        for i, spec in enumerate(args.specs):
            r, gain = regrets[:, w, i], regrets[:, w, 0] - regrets[:, w, i]
            cells = [f"{m:.4f} ± {s:.4f}" for m, s in zip(r.mean(0), r.std(0, ddof=1) / root, strict=True)]
            gains = [f"{m:+.4f} ± {s:.4f}" for m, s in zip(gain.mean(0), gain.std(0, ddof=1) / root, strict=True)]
            print(f"| {spec} | {' | '.join(cells)} | {' / '.join(gains)} |")
        if saved is not None:
            print(f"\npaired gain over {args.against} (+: this code better), levels better / worse")
            for i, spec in enumerate(args.specs):
                gain = saved[:, w, i] - regrets[:, w, i]
                cells = [f"{g.mean():+.5f} ± {g.std(ddof=1) / root:.5f} ({(g > 1e-12).sum()}/{(g < -1e-12).sum()})"
                         for g in gain.T]
                print(f"| {spec} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
