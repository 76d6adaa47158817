"""``iapo-gym data build LOGDIR``: an outcome table of the served arms from ``serve --log``'s outcome log.

Each logged completion is one sample (docs/log-format.md's fields, taken from the log):

- ``prompt``: the served arm's prompt id; ``query``: the request's query text, which the log holds only when
  serve ran with ``--log-queries`` (without it the build stops and says so: completions cannot be grouped by
  query otherwise);
- ``tokens``: the request's completion tokens divided by its completions drawn (the log keeps the request's
  total, not each completion's);
- majority vote: ``answer``, the completion's answer bucket as the vote counted it; ``gold``, the query's gold
  answer: the winner of a request whose feedback was ``true`` (or 1), or the answer ``--gold FILE`` gives (JSON
  Lines ``{"query": ..., "gold": ...}``). A query with neither stops the build, named, with the count of such
  queries: a ``false`` feedback says only what the gold answer is not, and nothing else is guessed;
- Best-of-N: ``scores``, each completion's objective vector as the scorer gave it (feedback is not needed).

A table needs every (prompt, query) pair served at least once: the accumulator refuses a query some served
prompt never answered, naming it (serve a fixed query set under each arm, or build from a log of such traffic).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from iapo_gym.data.build import (
    BuildOptions,
    LogFormatError,
    SampleBatch,
    answer_text,
    build_from_batches,
    codes_of,
    jsonl_objects,
)
from iapo_gym.outcome_log import CURRENT, LogError, read_log
from iapo_gym.tables import OutcomeTable

__all__ = ["build_serve_log_table", "is_serve_log", "read_gold"]


def is_serve_log(source: str | os.PathLike[str]) -> bool:
    """Whether ``source`` is an outcome log: a folder holding ``outcomes.sqlite`` or ``outcomes.N.sqlite``, or such a
    file."""
    path = Path(source)
    if path.is_dir():
        return (path / CURRENT).exists() or any(path.glob("outcomes.*.sqlite"))
    return path.suffix == ".sqlite" and path.name.startswith("outcomes.")


def read_gold(path: str | os.PathLike[str]) -> dict[str, str]:
    """Query text -> gold answer from a JSON Lines file of ``{"query": ..., "gold": ...}``."""
    out: dict[str, str] = {}
    try:
        handle = Path(path).open(encoding="utf-8")
    except OSError as exc:
        raise LogFormatError(f"cannot read --gold {path}: {exc}") from None
    with handle:
        for _, where, rec in jsonl_objects(handle, path, LogFormatError):
            if set(rec) != {"query", "gold"} or not isinstance(rec["query"], str):
                raise LogFormatError(f"{where}: a --gold line is {{\"query\": <the query text>, \"gold\": <the answer>}}")
            gold = answer_text(rec["gold"], "gold", where, allow_null=False)
            assert gold is not None
            if out.get(rec["query"], gold) != gold:
                raise LogFormatError(f"{where}: query {rec['query'][:80]!r} has two gold answers")
            out[rec["query"]] = gold
    return out


def _golds(rows: Iterable[Any], given: Mapping[str, str], origin: str) -> dict[str, str]:
    """Per query its gold answer: from feedback true on a request (its winner) and from ``given``; conflicts and
    queries without one stop the build."""
    gold = dict(given)
    source = {q: "--gold" for q in given}
    queries: set[str] = set()
    for row in rows:
        queries.add(_query(row, origin))
        if row.reward is True or (not isinstance(row.reward, (bool, list)) and row.reward == 1):
            winner = row.outcomes.get("winner")
            if winner is None:
                continue  # the winning bucket was "no answer": it tells nothing of the gold answer
            if gold.get(row.query, winner) != winner:
                raise LogFormatError(f"{origin}: query {row.query[:80]!r} has two gold answers: {gold[row.query]!r} "
                                     f"({source[row.query]}) and {winner!r} (feedback true on response {row.id})")
            gold[row.query] = winner
            source.setdefault(row.query, f"feedback true on response {row.id}")
    missing = sorted(queries - set(gold))
    if missing:
        raise LogFormatError(f"{origin}: {len(missing)} queries have no gold answer (no request of theirs got feedback "
                             f"true, and --gold does not name them), e.g. {missing[0][:80]!r}; give their gold "
                             "answers with --gold FILE (JSON Lines {\"query\": ..., \"gold\": ...})")
    return gold


def _query(row: Any, origin: str) -> str:
    if row.query is None:
        raise LogFormatError(f"{origin}: the log holds no query text (serve ran without --log-queries), and a table "
                             "groups completions by query; serve with --log-queries to build tables from its log")
    return str(row.query)


def _rows(path: str | os.PathLike[str], aggregator: str) -> tuple[dict[str, Any], Iterator[Any]]:
    try:
        meta, rows = read_log(path)
    except LogError as exc:
        raise LogFormatError(str(exc)) from None
    if meta.get("aggregator") != aggregator:
        raise LogFormatError(f"{path}: the log was served by a {meta.get('aggregator')} policy, not {aggregator}: "
                             f"build it with --aggregator {meta.get('aggregator')}")
    return meta, rows


def build_serve_log_table(path: str | os.PathLike[str], aggregator: str, options: BuildOptions,
                          gold_file: str | os.PathLike[str] | None = None,
                          batch_rows: int = 65_536) -> OutcomeTable:
    """The table of the served arms' outcomes in the outcome log at ``path`` (module docstring)."""
    origin = str(path)
    meta, first = _rows(path, aggregator)
    names = tuple(str(n) for n in meta.get("objectives", ()))
    given = read_gold(gold_file) if gold_file else {}
    gold = _golds(first, given, origin) if aggregator == "mv" else {}

    def batches() -> Iterator[tuple[SampleBatch, Sequence[str]]]:
        _, rows = _rows(path, aggregator)
        row_number = 0
        while True:
            part = list(itertools.islice(rows, batch_rows))
            if not part:
                if not row_number:
                    raise LogFormatError(f"{origin}: the log holds no request")
                return
            lines: list[int] = []
            prompts: list[str] = []
            queries: list[str] = []
            tokens: list[float] = []
            answers: list[str | None] = []
            golds: list[str] = []
            scores: list[float] = []
            for i, row in enumerate(part, start=row_number + 1):
                query = _query(row, origin)
                drawn = max(1, row.drawn)
                per = row.completion_tokens / drawn
                if aggregator == "mv":
                    values = row.outcomes.get("answers") or []
                    taken: list[Any] = [answer_text(a, "answer", f"{origin}: row {i}", allow_null=True)
                                        for a in values]
                    answers += taken
                    if query not in gold:
                        raise LogFormatError(f"{origin}: query {query[:80]!r} was logged while the build read the log; "
                                             "build again")
                    golds += [gold[query]] * len(taken)
                else:
                    vectors = row.outcomes.get("objective_scores") or []
                    for v in vectors:
                        scores.extend(float(x) for x in v)
                    taken = vectors
                count = len(taken)
                lines += [i] * count
                prompts += [row.prompt] * count
                queries += [query] * count
                tokens += [per] * count
            row_number += len(part)
            batch = SampleBatch(origin=origin, rows=np.asarray(lines, dtype=np.int64), prompts=codes_of(prompts),
                                queries=codes_of(queries), tokens=np.asarray(tokens, dtype=np.float64), unit="row")
            if aggregator == "mv":
                batch.answers, batch.golds = codes_of(answers), codes_of(golds)
            else:
                batch.scores = np.asarray(scores, dtype=np.float64).reshape(len(lines), len(names))
            yield batch, names

    return build_from_batches(batches, aggregator, options, default_task=Path(path).stem or "served",
                              source=f"serve outcome log {Path(path).name}", how="serve outcome log",
                              cost_from="completion tokens per completion drawn")
