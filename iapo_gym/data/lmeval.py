"""lm-evaluation-harness ``--log_samples`` output as samples: one task (or task variant) per prompt.

lm-eval writes, per run, ``results_<date>.json`` and one ``samples_<task>_<date>.jsonl`` per task, in
``<output_path>/<model>/``. Each samples line is one document of one filter: ``doc_id``, ``target``,
``resps`` (the raw responses: one list per request, of ``repeats`` strings for a ``generate_until``
task) and ``filtered_resps`` (the filter's output). Here the document is the query, each of the
``repeats`` responses a completion, its answer the raw response or the filter's per-sample answer, and
``target`` the gold answer (majority vote). The task's config hash and the model go into the table's
provenance. Format: ``docs/data.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from iapo_gym.data.build import (
    DEFAULT_BATCH_ROWS,
    BuildOptions,
    LogFormatError,
    SampleBatch,
    answer_text,
    build_from_batches,
    codes_of,
    jsonl_objects,
)
from iapo_gym.tables import OutcomeTable

_RESULTS = re.compile(r"^results_(?P<date>.+)\.json$")


@dataclass(frozen=True)
class LmEvalRun:
    """One lm-eval run: its results file, the samples file of each chosen task, and the results' fields."""

    results_path: Path
    samples: dict[str, Path]  # task -> samples_<task>_<date>.jsonl, in table prompt order
    results: dict[str, Any]

    def task_provenance(self, filter_name: dict[str, str], answers: str) -> dict[str, Any]:
        """Per task: the sha256 of its config (without the run's ``metadata``), lm-eval's task hash, the filter."""
        configs = self.results.get("configs", {})
        hashes = self.results.get("task_hashes", {})
        out = {}
        for task in self.samples:
            config = {k: v for k, v in configs.get(task, {}).items() if k != "metadata"}
            out[task] = {"config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
                         .hexdigest() if config else None,
                         "task_hash": hashes.get(task), "answers": answers,
                         "filter": filter_name.get(task) if answers == "filtered" else None}
        return out

    def model(self) -> str:
        """The model's name and lm-eval model type, as the results file gives them (no model arguments)."""
        name = self.results.get("model_name")
        kind = (self.results.get("config") or {}).get("model")
        return f"{name} ({kind})" if kind else str(name)


def find_run(source: str | os.PathLike[str], tasks: Sequence[str] | None = None) -> LmEvalRun:
    """The run in ``source``: a ``results_<date>.json`` file, or a folder holding exactly one (lm-eval's
    ``<output_path>/<model>/``, or ``<output_path>`` with one model folder); ``tasks`` selects tasks."""
    source = Path(source)
    if source.is_dir():
        found = sorted(source.glob("results_*.json")) or sorted(source.glob("*/results_*.json"))
        if not found:
            raise LogFormatError(f"{source}: no lm-eval results_<date>.json here or one folder down "
                                 "(run lm-eval with --output_path and --log_samples)")
        if len(found) > 1:
            raise LogFormatError(f"{source}: {len(found)} lm-eval runs ({', '.join(str(f) for f in found[:5])}); "
                                 "give the results_<date>.json of the one to build")
        source = found[0]
    match = _RESULTS.match(source.name)
    if not match or not source.is_file():
        raise LogFormatError(f"{source}: not an lm-eval results_<date>.json file")
    try:
        results = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise LogFormatError(f"{source}: not a readable lm-eval results file ({str(exc)[:200]})") from None
    if not isinstance(results, dict):
        raise LogFormatError(f"{source}: an lm-eval results file holds a JSON object")
    date = match["date"]
    logged = {p.name[len("samples_"):-len(f"_{date}.jsonl")]: p
              for p in source.parent.glob(f"samples_*_{date}.jsonl")}
    if not logged:
        raise LogFormatError(f"{source}: no samples_<task>_{date}.jsonl beside it; run lm-eval with --log_samples")
    chosen = list(tasks) if tasks else sorted(logged)
    missing = [t for t in chosen if t not in logged]
    if missing:
        raise LogFormatError(f"{source}: no samples of task(s) {missing} in this run (it logged {sorted(logged)})")
    return LmEvalRun(results_path=source, samples={t: logged[t] for t in chosen}, results=results)


def _filters(path: Path) -> list[str]:
    """The filter names a samples file logs, in order of first appearance."""
    names: dict[str, None] = {}
    with path.open(encoding="utf-8") as handle:
        for _, _, rec in jsonl_objects(handle, path, LogFormatError):
            names.setdefault(str(rec.get("filter")), None)
    return list(names)


def choose_filters(run: LmEvalRun, filter_name: str | None) -> dict[str, str]:
    """Each task's filter: ``filter_name``, or the task's only one; several without a choice is an error."""
    chosen = {}
    for task, path in run.samples.items():
        names = _filters(path)
        if filter_name is not None:
            if filter_name not in names:
                raise LogFormatError(f"{path}: task {task!r} logs no filter {filter_name!r} (it logs {names})")
            chosen[task] = filter_name
        elif len(names) == 1:
            chosen[task] = names[0]
        else:
            raise LogFormatError(f"{path}: task {task!r} logs {len(names)} filters {names}; choose one with "
                                 "--lm-eval-filter")
    return chosen


def _strings(value: Any, what: str, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise LogFormatError(f"{where}: {what} must be a non-empty list of strings, got {str(value)[:120]}")
    return value


def lm_eval_batches(run: LmEvalRun, filters: dict[str, str], answers: str = "filtered",
                    batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[tuple[SampleBatch, Sequence[str]]]:
    """Batches of completions of every chosen task's documents (one batch never spans two files)."""
    if answers not in ("raw", "filtered"):
        raise ValueError(f"answers must be 'raw' or 'filtered', got {answers!r}")
    doc_hash: dict[str, tuple[str, str]] = {}
    for task, path in run.samples.items():
        cols: dict[str, list[Any]] = {k: [] for k in ("row", "query", "answer", "gold", "tokens", "sample")}
        handle = path.open(encoding="utf-8")
        with handle:
            for lineno, where, rec in jsonl_objects(handle, path, LogFormatError):
                if str(rec.get("filter")) != filters[task]:
                    continue
                _doc(rec, task, where, doc_hash, answers, lineno, cols)
                if len(cols["row"]) >= batch_rows:
                    yield _batch(path, task, cols), ()
                    cols = {k: [] for k in cols}
        if cols["row"]:
            yield _batch(path, task, cols), ()


def _doc(rec: dict[str, Any], task: str, where: str, doc_hash: dict[str, tuple[str, str]], answers: str,
         lineno: int, cols: dict[str, list[Any]]) -> None:
    """Check one samples line and append its completions to ``cols``."""
    for key in ("doc_id", "target", "resps", "filtered_resps"):
        if key not in rec:
            raise LogFormatError(f"{where}: missing field {key!r} (not an lm-eval --log_samples line?)")
    doc_id = rec["doc_id"]
    if isinstance(doc_id, bool) or not isinstance(doc_id, (int, str)):
        raise LogFormatError(f"{where}: field 'doc_id' must be an integer, got {doc_id!r}")
    query = str(doc_id)
    if isinstance(rec.get("doc_hash"), str):
        seen = doc_hash.setdefault(query, (rec["doc_hash"], where))
        if seen[0] != rec["doc_hash"]:
            raise LogFormatError(f"{where}: doc_id {query} of task {task!r} is another document than at {seen[1]} "
                                 "(its doc_hash differs): the tasks must share one dataset")
    resps, filtered = rec["resps"], rec["filtered_resps"]
    if not isinstance(resps, list) or len(resps) != 1:
        raise LogFormatError(f"{where}: 'resps' holds {len(resps) if isinstance(resps, list) else resps!r} requests "
                             "per document; only a generate_until task (one request, `repeats` responses) gives "
                             "completions")
    raw = _strings(resps[0], "'resps'[0]", where)
    if answers == "raw":
        given: list[Any] = raw
    else:
        if not isinstance(filtered, list) or len(filtered) != 1 or not isinstance(filtered[0], list):
            raise LogFormatError(f"{where}: the filter keeps one answer per document, not one per sample "
                                 f"(filtered_resps {str(filtered)[:80]}); use a filter without take_first or "
                                 "majority_vote, or --lm-eval-answers raw")
        given = filtered[0]
        if len(given) != len(raw):
            raise LogFormatError(f"{where}: {len(given)} filtered answers for {len(raw)} responses")
    gold = answer_text(rec["target"], "target", where, allow_null=False)
    for i, (text, answer) in enumerate(zip(raw, given, strict=True)):
        cols["row"].append(lineno)
        cols["query"].append(query)
        cols["answer"].append(answer_text(answer, "answer", where, allow_null=True) if answer is not None else None)
        cols["gold"].append(gold)
        cols["tokens"].append(float(len(text)))
        cols["sample"].append(i)


def _batch(path: Path, task: str, cols: dict[str, list[Any]]) -> SampleBatch:
    n = len(cols["row"])
    return SampleBatch(origin=str(path), rows=np.asarray(cols["row"], dtype=np.int64), prompts=([task], np.zeros(n, np.int64)),
                       queries=codes_of(cols["query"]), tokens=np.asarray(cols["tokens"]), answers=codes_of(cols["answer"]),
                       golds=codes_of(cols["gold"]), samples=np.asarray(cols["sample"], dtype=np.int64))


def build_lm_eval_table(source: str | os.PathLike[str], options: BuildOptions | None = None, *,
                        tasks: Sequence[str] | None = None, filter_name: str | None = None,
                        answers: str = "filtered", batch_rows: int = DEFAULT_BATCH_ROWS) -> OutcomeTable:
    """A majority-vote table from an lm-eval run (``find_run``): each task a prompt, each document a query."""
    run = find_run(source, tasks)
    filters = choose_filters(run, filter_name) if answers == "filtered" else {
        task: _filters(path)[0] for task, path in run.samples.items()}
    options = options or BuildOptions()
    options = BuildOptions(**{**options.__dict__, "extra_attrs": {
        **options.extra_attrs,
        "lm_eval_results": run.results_path.name,
        "lm_eval_version": str(run.results.get("lm_eval_version")),
        "lm_eval_model": run.model(),
        "lm_eval_tasks": json.dumps(run.task_provenance(filters, answers), sort_keys=True),
    }})
    return build_from_batches(lambda: lm_eval_batches(run, filters, answers, batch_rows), "mv", options,
                              default_task=run.results_path.parent.name or "lm_eval",
                              source=f"lm-eval run {run.results_path.name}",
                              how=f"lm-eval --log_samples, {answers} answers, cost = response characters",
                              cost_from="response length in characters")
