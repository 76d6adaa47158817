"""What ``iapo-gym data show`` reports: a table's shape, contexts and exact oracle values per split."""

from __future__ import annotations

from typing import Any

import numpy as np

from iapo_gym.oracle import acr_from_q, greedy_policy, q_table
from iapo_gym.tables import OutcomeTable


def oracle_summary(table: OutcomeTable) -> dict[str, Any]:
    """Exact optimal policy and ACR per split, the best single-sample (N=1) policy, and train-optimal on test.

    With a stored split, ``train_optimal_on_test`` is the train-optimal policy scored on test
    queries (the generalisation gap a perfect learner on the train split would still pay).
    """
    splits = ("train", "test") if table.split is not None else ("all",)
    out: dict[str, Any] = {}
    q_by_split = {}
    for split in splits:
        q = q_table(table, table.split_indices(split))
        q_by_split[split] = q
        best = greedy_policy(q)
        best_n1 = greedy_policy(q[:, :, :1])
        out[split] = {
            "queries": int(table.split_indices(split).size),
            "optimal_policy": [list(a) for a in best.arms],
            "optimal_acr": acr_from_q(q, np.array(best.arms), table.context_probs),
            "best_n1_policy": [list(a) for a in best_n1.arms],
            "best_n1_acr": acr_from_q(q, np.array(best_n1.arms), table.context_probs),
        }
    if table.split is not None:
        train_best = np.array(out["train"]["optimal_policy"])
        out["train_optimal_on_test"] = acr_from_q(q_by_split["test"], train_best, table.context_probs)
    return out


def table_summary(table: OutcomeTable) -> dict[str, Any]:
    """Shape, objectives, contexts, cost range and provenance of a table (JSON-friendly)."""
    meta = table.metadata()
    cost = table.cost
    return {
        **meta,
        "n_train": int(table.split_indices("train").size) if table.split is not None else None,
        "n_test": int(table.split_indices("test").size) if table.split is not None else None,
        "cost_min": float(cost.min()),
        "cost_max": float(cost.max()),
        "contexts": [
            {"name": n, "weights": [float(x) for x in w], "prob": float(p)}
            for n, w, p in zip(table.context_names, table.context_weights, table.context_probs, strict=True)
        ],
    }


def format_summary(table: OutcomeTable, oracle: dict[str, Any]) -> str:
    """Human-readable lines for ``data show``."""
    s = table_summary(table)
    lines = [
        f"task        {s['task']} ({s['aggregator']})",
        f"prompts     {s['n_prompts']}",
        f"queries     {s['n_queries']}"
        + (f" ({s['n_train']} train, {s['n_test']} test)" if s["n_train"] is not None else " (no stored split)"),
        f"atoms       {s['n_atoms']} per (prompt, query)",
        f"objectives  {', '.join(s['objective_names'])} (+ cost)",
        f"N_max       {s['n_max']}",
        f"cost        {s['cost_min']:.6g} .. {s['cost_max']:.6g} per completion",
        f"contexts    {s['n_contexts']}: {s.get('contexts_source', 'where from is not recorded in this table')}",
    ]
    shown = s["contexts"] if len(s["contexts"]) <= 9 else s["contexts"][:4] + [None] + s["contexts"][-4:]
    for c in shown:
        lines.append("  ..." if c is None else f"  {c['name']:<28} weights {c['weights']}  p={c['prob']:.4g}")
    for key in ("source", "license", "build", "columns", "cost_source", "verified"):
        if key in s:
            lines.append(f"{key:<11} {s[key]}")
    lines.append("exact oracle (ACR = E_c Q(c, pi(c))):")
    for split in ("train", "test", "all"):
        if split in oracle:
            o = oracle[split]
            lines.append(f"  {split:<5} ({o['queries']} queries): optimal ACR {o['optimal_acr']:.4f}, "
                         f"best N=1 ACR {o['best_n1_acr']:.4f}")
            lines.append(f"        optimal (prompt, N) per context: {_arms(o['optimal_policy'], table)}")
    if "train_optimal_on_test" in oracle:
        lines.append(f"  train-optimal policy on test: ACR {oracle['train_optimal_on_test']:.4f}")
    return "\n".join(lines)


def _arms(arms: list[list[int]], table: OutcomeTable) -> str:
    if len(arms) > 9:
        return f"{len(arms)} contexts, N in {sorted({a[1] for a in arms})}, prompts {sorted({a[0] for a in arms})}"
    return ", ".join(f"{n}:({p},{N})" for n, (p, N) in zip(table.context_names, arms, strict=True))
