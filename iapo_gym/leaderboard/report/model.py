"""What a report shows, computed from the stored runs (``Report``) and looked up by the writers in ``write``."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iapo_gym.leaderboard.report.stats import (
    DEFAULT_ALPHA,
    PairwiseRow,
    RankRow,
    SummaryRow,
    pairwise,
    rank_agents,
    summarize,
)
from iapo_gym.leaderboard.run.store import ResultStore, RunResult, TaskInfo


@dataclass
class Report:
    """Everything a report shows, computed from the stored runs."""

    results: list[RunResult]
    tasks: dict[str, TaskInfo]
    summary: list[SummaryRow]
    pairs: list[PairwiseRow]
    ranking: list[RankRow]
    test: str
    correction: str
    alpha: float
    meta: dict[str, Any]


def build_report(out_dir: str | Path, test: str = "wilcoxon", correction: str = "holm",
                 alpha: float = DEFAULT_ALPHA, tasks: Sequence[str] | None = None) -> Report:
    """Read ``out_dir``'s results and compute summary, pairwise tests and ranking."""
    with ResultStore(out_dir, create=False) as store:
        results = store.results()
        all_infos = store.tasks()
        infos = {t.task: t for t in all_infos}
        meta: dict[str, Any] = {"root_seed": store.get_meta("root_seed"), "train_fraction": store.get_meta("train_fraction"),
                "database": display_path(store.path)}
    if tasks:
        wanted = set(tasks)
        results = [r for r in results if r.task in wanted]
    summary = summarize(results)
    pairs = pairwise(results, test, correction, alpha)
    meta["versions"] = sorted({r.version for r in results})
    meta["n_runs"] = len(results)
    meta["checksums"] = {t: sorted({r.table_sha256 for r in results if r.task == t}) for t in sorted({r.task for r in results})}
    shapes: dict[str, set[tuple[int, int, tuple[str, ...]]]] = defaultdict(set)
    for info in all_infos:
        shapes[info.task].add((info.n_prompts, info.n_max, info.context_names))
    #: Tasks whose runs' tables differ in prompts, N_max or contexts (generated level ranges): no per-context policy view.
    meta["mixed_shapes"] = sorted(task for task, seen in shapes.items() if len(seen) > 1)
    #: Per task run over (p, N, stopping rule) (``--rules``): its rules' labels, rule 0 first; absent: (p, N) arms.
    meta["rules"] = {r.task: json.loads(r.arm_set) for r in results if r.arm_set is not None}
    return Report(results, infos, summary, pairs, rank_agents(summary, pairs), test, correction, alpha, meta)


def file_stem(task: str) -> str:
    """A task name as a file-name part: characters other than letters, digits, ``_``, ``.`` and ``-`` become ``_``
    (``generated:bon_shape:1000000-1000099`` -> ``generated_bon_shape_1000000-1000099``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", task)


def display_path(path: str | Path) -> str:
    """How a report names a file: relative to the current directory when inside it, else by its name
    only (never the absolute path of the machine that made it)."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return resolved.name


ArmCounts = list[Counter[tuple[int, ...]]]


def modal_arms(results: Sequence[RunResult], task: str, label: str, budget: int) -> tuple[ArmCounts, ArmCounts]:
    """Per context, counters of the chosen arms and of the test-optimal arms over the runs: (p, N), or (p, N, rule)
    in runs over stopping rules."""
    chosen: ArmCounts = []
    optimal: ArmCounts = []
    for r in results:
        if r.task != task or r.label != label or r.budget != budget:
            continue
        arms, best = json.loads(r.arms), json.loads(r.optimal_arms)
        while len(chosen) < len(arms):
            chosen.append(Counter())
            optimal.append(Counter())
        for c, (arm, opt) in enumerate(zip(arms, best, strict=True)):
            chosen[c][tuple(int(x) for x in arm)] += 1
            optimal[c][tuple(int(x) for x in opt)] += 1
    return chosen, optimal


def labels_by_rank(report: Report, task: str) -> list[str]:
    """The task's agent labels, best first."""
    return [r.label for r in report.ranking if r.task == task]


def budgets_of(report: Report, task: str) -> list[int]:
    """The budgets with results for ``task``, ascending."""
    return sorted({s.budget for s in report.summary if s.task == task})


def cells_by_label(report: Report, task: str) -> dict[str, list[SummaryRow]]:
    """Summary rows of ``task`` grouped by agent label, each list sorted by budget."""
    out: dict[str, list[SummaryRow]] = defaultdict(list)
    for s in report.summary:
        if s.task == task:
            out[s.label].append(s)
    for rows in out.values():
        rows.sort(key=lambda s: s.budget)
    return out


def optimal_means(report: Report, task: str) -> tuple[float, float]:
    """The task's optimal and train-optimal test ACR, each the mean over its summary rows (for the dashed lines)."""
    cells = [s for s in report.summary if s.task == task]
    return (sum(s.optimal_acr_mean for s in cells) / len(cells),
            sum(s.train_optimal_acr_mean for s in cells) / len(cells))
