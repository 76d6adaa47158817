"""``iapo-gym leaderboard merge``: combine result folders and bundles from several machines into one store.

Runs are identified by (task, agent, params, budget, run). A run present in several inputs is
kept once, after checking that everything it computed (table digest, seeds, ACRs, policies,
completions spent) agrees exactly; any disagreement is an error naming the run. Inputs of
different protocol parameters (root seed, train fraction), different tables for a (task, run),
or different source code for one agent are refused, never mixed. The output folder gets
``results.sqlite`` and ``provenance.json`` (every merged input's manifest and verify status).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iapo_gym.atomic import atomic_directory
from iapo_gym.leaderboard.run.online import OnlineRunResult, OnlineStore
from iapo_gym.leaderboard.run.specs import AgentSpec, check_unique_labels
from iapo_gym.leaderboard.run.store import ResultStore, RunResult, TaskInfo
from iapo_gym.leaderboard.submit.bundle import Bundle, BundleError
from iapo_gym.leaderboard.submit.online import merge_online
from iapo_gym.leaderboard.submit.provenance import PROVENANCE, ProvenanceError, load_source, provenance_entries

#: Fields of a run that a re-run reproduces exactly (everything but wall time, label and bookkeeping).
COMPUTED = ("table_sha256", "root_seed", "split_seed", "env_seed", "agent_seed", "acr", "optimal_acr",
            "train_optimal_acr", "regret", "arms", "optimal_arms", "budget_spent", "arm_set")


class MergeError(ProvenanceError):
    """Inputs that cannot be merged without mixing or losing results; the message names the cause."""


def run_name(r: RunResult) -> str:
    """A run as people read it: ``task/label budget=T run=r``."""
    return f"{r.task}/{r.label} budget={r.budget} run={r.run}"


def arm_set(bundle: Bundle) -> str:
    """The bundle's arm set: ``rules`` ((p, N, stopping rule), ``--rules``) or ``fixed`` (the paper's (p, N))."""
    return str(bundle.manifest["protocol"].get("arm_set", "fixed"))


def _check_protocol(bundles: Sequence[Bundle]) -> None:
    first = bundles[0]
    for key in ("root_seed", "train_fraction"):
        for other in bundles[1:]:
            a, b = first.manifest["protocol"][key], other.manifest["protocol"][key]
            if a != b and None not in (a, b):  # a bundle of online runs alone has no train fraction (null)
                raise MergeError(f"{first.name} was run with {key}={a}, {other.name} with {key}={b}; "
                                 "runs of different protocol parameters are not merged")
    for other in bundles[1:]:
        a, b = arm_set(first), arm_set(other)
        if a != b:
            raise MergeError(f"{first.name} holds runs over the arm set {a!r}, {other.name} over {b!r} "
                             "(iapo-gym leaderboard --rules); runs of different arm sets are not merged")
    sources: dict[tuple[str, str], tuple[str, str]] = {}
    for bundle in bundles:
        for agent in bundle.manifest["agents"]:
            agent_key = (str(agent["name"]), json.dumps(agent["params"], sort_keys=True))
            digest = str(agent["source"]["sha256"])
            seen = sources.setdefault(agent_key, (digest, bundle.name))
            if seen[0] != digest:
                raise MergeError(f"agent {agent['spec']!r} has source digest {seen[0][:12]}... in {seen[1]} but "
                                 f"{digest[:12]}... in {bundle.name}: its code differs, so its runs are not merged")


def merge_results(bundles: Sequence[Bundle]) -> tuple[list[RunResult], list[TaskInfo], int]:
    """The union of the bundles' runs with duplicates checked and dropped: (runs, task infos, duplicates)."""
    if not bundles:
        raise MergeError("nothing to merge")
    _check_protocol(bundles)
    by_key: dict[tuple[str, str, str, int, int], tuple[RunResult, str]] = {}
    tables: dict[tuple[str, int], tuple[str, str]] = {}
    duplicates = 0
    for bundle in bundles:
        for r in bundle.results:
            table = tables.setdefault((r.task, r.run), (r.table_sha256, bundle.name))
            if table[0] != r.table_sha256:
                raise MergeError(f"run {run_name(r)}: table digest {r.table_sha256[:12]}... in {bundle.name} but "
                                 f"{table[0][:12]}... in {table[1]} (task {r.task!r} run {r.run} used different tables)")
            seen = by_key.get(r.key)
            if seen is None:
                by_key[r.key] = (r, bundle.name)
                continue
            other, where = seen
            differ = [f for f in COMPUTED if getattr(r, f) != getattr(other, f)]
            if other.label != r.label:
                differ.append("label")
            if differ:
                detail = ", ".join(f"{f} {getattr(other, f)!r} vs {getattr(r, f)!r}"[:160] for f in differ)
                raise MergeError(f"run {run_name(r)} disagrees between {where} and {bundle.name}: {detail}")
            duplicates += 1
    results = [v[0] for _, v in sorted(by_key.items())]
    try:
        check_unique_labels([AgentSpec(r.agent, json.loads(r.params), r.label) for r in results])
    except ValueError as exc:
        raise MergeError(f"{', '.join(b.name for b in bundles)}: {exc}") from None
    infos: dict[tuple[str, str], TaskInfo] = {}
    for bundle in bundles:
        for info in bundle.tasks:
            infos.setdefault((info.task, info.table_sha256), info)
    return results, list(infos.values()), duplicates


def merge(sources: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Merge result folders and bundle files into the new folder ``out_dir`` (written atomically:
    a failure leaves nothing behind). Returns counts: inputs, runs, duplicates."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MergeError(f"--out {out} exists and is not empty; merge writes a new folder")
    try:
        bundles = [load_source(s) for s in sources]
    except BundleError as exc:
        raise MergeError(str(exc)) from None
    results, infos, duplicates = merge_results(bundles)
    online, online_duplicates, batch_size = _merge_online(bundles)
    provenance = [entry for b in bundles for entry in provenance_entries(b)]
    protocol = bundles[0].manifest["protocol"]
    fraction = next((b.manifest["protocol"]["train_fraction"] for b in bundles
                     if b.manifest["protocol"]["train_fraction"] is not None), None)
    with atomic_directory(out) as tmp:  # an empty --out is replaced
        with ResultStore(tmp) as store:
            store.claim_meta("root_seed", str(protocol["root_seed"]))
            if fraction is not None:
                store.claim_meta("train_fraction", repr(float(fraction)))
            store.claim_meta("arm_set", arm_set(bundles[0]))
            store.add(results, infos)
        if online:
            with OnlineStore(tmp) as online_store:
                online_store.claim_meta("online_batch_size", str(batch_size))
                online_store.add_online(online, infos)
        (tmp / PROVENANCE).write_text(json.dumps({"inputs": provenance}, indent=1, sort_keys=True) + "\n")
    return {"inputs": len(bundles), "runs": len(results) + len(online), "duplicates": duplicates + online_duplicates}


def _merge_online(bundles: Sequence[Bundle]) -> tuple[list[OnlineRunResult], int, int | None]:
    """The inputs' online runs merged (``submit.online.merge_online``): (runs, duplicates, batch size); inputs of
    different batch sizes are refused, as different root seeds are."""
    sizes = {b.name: b.manifest["online"]["batch_size"] for b in bundles if "online" in b.manifest}
    if len(set(sizes.values())) > 1:
        raise MergeError(f"online runs of different batch sizes ({', '.join(f'{k}: {v}' for k, v in sizes.items())}) "
                         "are not merged")
    try:
        online, duplicates = merge_online([(b.name, b.extra.get("online") or []) for b in bundles])
    except ValueError as exc:
        raise MergeError(str(exc)) from None
    return online, duplicates, next(iter(sizes.values()), None)
