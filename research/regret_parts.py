"""Where an agent's regret comes from: the choice of prompt or the choice of N (a leaderboard store's runs).

Per (agent, context), the regret against the train-optimal arm (p*, N*) on the test split,
Q_test(c, p*, N*) - Q_test(c, p, N), splits into the prompt part Q_test(c, p*, N*) -
Q_test(c, p, N_train(p)) and the N part Q_test(c, p, N_train(p)) - Q_test(c, p, N), N_train(p)
being the best N of the agent's prompt on the train split; each is weighted by the context's
probability, so the parts of a row add up to the agent's regret. ``--top K`` also prints the
regret of a reference agent that picks uniformly among the K prompts best on the train split
(each at its train-best N): how close a prompt choice must come to rank the prompts.

Usage: ``python research/regret_parts.py results/challenger --task math --budget 3000 --top 1 3 8``
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np

from iapo_gym.leaderboard.run.runner import run_setup
from iapo_gym.leaderboard.run.specs import resolve_task
from iapo_gym.leaderboard.run.store import ResultStore
from iapo_gym.oracle import greedy_policy, q_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", help="a leaderboard results directory")
    parser.add_argument("--task", required=True)
    parser.add_argument("--budget", type=int, required=True)
    parser.add_argument("--top", type=int, nargs="*", default=[], metavar="K")
    args = parser.parse_args()
    with ResultStore(args.store, create=False) as store:
        rows = [r for r in store.results() if r.task == args.task and r.budget == args.budget]
    if not rows:
        raise SystemExit(f"no runs of task {args.task!r} at budget {args.budget} in {args.store}")
    task = resolve_task(args.task)
    parts: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    top: dict[int, list[float]] = defaultdict(list)
    tables: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
    for r in rows:
        key = (r.root_seed, r.run)
        if key not in tables:
            table = run_setup(task, r.run, r.root_seed).run_table
            q_test, q_train = q_table(table, table.split_indices("test")), q_table(table, table.split_indices("train"))
            optimal, probs = np.array(greedy_policy(q_train).arms), table.context_probs
            tables[key] = (q_test, q_train, optimal, probs)
            contexts = np.arange(q_test.shape[0])
            best_n = q_train.argmax(axis=2)  # (C, P): each prompt's train-best N - 1
            ceiling = q_test[contexts, optimal[:, 0], optimal[:, 1] - 1]
            for k in args.top:
                picks = np.argsort(-q_train.max(axis=2), axis=1)[:, :k]  # (C, k)
                value = q_test[contexts[:, None], picks, best_n[contexts[:, None], picks]].mean(axis=1)
                top[k].append(float(probs @ (ceiling - value)))
        q_test, q_train, optimal, probs = tables[key]
        arms = np.array(json.loads(r.arms))
        for c, ((p, n), (p_opt, n_opt)) in enumerate(zip(arms, optimal, strict=True)):
            total = q_test[c, p_opt, n_opt - 1] - q_test[c, p, n - 1]
            n_part = q_test[c, p, int(q_train[c, p].argmax())] - q_test[c, p, n - 1]
            parts[(r.label, c)].append((probs[c] * total, probs[c] * n_part))
    print(f"{args.task} at T = {args.budget}: regret against the train-optimal arm on the test split, "
          "per context (weighted by its probability)")
    print("| agent | context | runs | regret | prompt part | N part |\n|---|---:|---:|---:|---:|---:|")
    for (label, c), values in sorted(parts.items()):
        v = np.array(values)
        print(f"| {label} | {c} | {len(v)} | {v[:, 0].mean():.4f} | {(v[:, 0] - v[:, 1]).mean():.4f} "
              f"| {v[:, 1].mean():.4f} |")
    for k, values in sorted(top.items()):
        print(f"uniform among the train top {k}: regret {np.mean(values):.4f} over {len(values)} runs")


if __name__ == "__main__":
    main()
