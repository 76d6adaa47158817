"""Build an outcome table from your own LLM logs: one JSON object per completion (``docs/log-format.md``).

Majority vote keeps, per query, the most frequent answers over all prompts plus an "other"
bucket (the paper: top 4 + other), always keeping the gold answer. Best-of-N keeps the
empirical distribution of objective vectors, or bins them on a grid (the paper: 0.5). The
per-prompt cost is the mean token count, scaled so the most expensive prompt costs ``cost_scale``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from iapo_gym.seeding import derive_rng
from iapo_gym.tables import TEST, TRAIN, OutcomeTable, TableError
from iapo_gym.tasks.contexts import COST_WEIGHTS_BON, bon_grid_contexts, mv_cost_contexts

#: Seed key of the stored split drawn when the log names none.
SPLIT_KEY = "iapo_gym.data.build.split"
DEFAULT_COST_SCALE = 0.01


class LogFormatError(ValueError):
    """A completion log is malformed; the message names the file and line."""


def jsonl_objects(lines: Iterable[str], name: str | os.PathLike[str],
                  error: type[Exception]) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line number, ``name:line``, record) of each non-blank line of a JSON Lines file.

    A line that is not a JSON object raises ``error`` naming the file and line.
    """
    numbered = enumerate(lines, start=1)
    lineno = 0
    while True:
        try:
            lineno, line = next(numbered)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            raise error(f"{name}: not UTF-8 text after line {lineno} ({exc.reason})") from None
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        except (ValueError, RecursionError) as exc:  # integers of over 4300 digits, nesting too deep
            raise error(f"{where}: not readable JSON ({str(exc)[:200]})") from None
        if not isinstance(rec, dict):
            raise error(f"{where}: each line must be a JSON object, got {type(rec).__name__}")
        yield lineno, where, rec


@dataclass
class _Log:
    """Parsed columns of a completion log (one entry per completion)."""

    path: Path
    prompts: list[str] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    answers: list[str | None] = field(default_factory=list)
    golds: list[str] = field(default_factory=list)
    scores: list[list[float]] = field(default_factory=list)
    objective_names: tuple[str, ...] = ()
    splits: dict[str, tuple[str, int]] = field(default_factory=dict)  # query -> (split, first line)


def _finite_number(value: Any) -> bool:
    """A JSON number (not a bool) that is finite as a float (integers past the float range are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _ident(value: Any, key: str, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise LogFormatError(f"{where}: field {key!r} must be a string or an integer, got {value!r}")
    text = str(value).strip()
    if not text:
        raise LogFormatError(f"{where}: field {key!r} is empty")
    return text


def _answer(value: Any, key: str, where: str, allow_null: bool) -> str | None:
    if value is None and allow_null:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        kinds = "a string, a number or null" if allow_null else "a string or a number"
        raise LogFormatError(f"{where}: field {key!r} must be {kinds}, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise LogFormatError(f"{where}: field {key!r} must be finite, got {value!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    text = str(value).strip()
    if not text:
        if allow_null:
            return None  # an empty extracted answer counts as no answer
        raise LogFormatError(f"{where}: field {key!r} is empty")
    return text


def read_log(path: str | os.PathLike[str], aggregator: str) -> _Log:
    """Parse and check a completion log for ``aggregator`` ("mv" or "bon"); errors name the line."""
    if aggregator not in ("mv", "bon"):
        raise ValueError(f"aggregator must be 'mv' or 'bon', got {aggregator!r}")
    log = _Log(Path(path))
    golds: dict[str, tuple[str, int]] = {}
    try:
        handle = log.path.open(encoding="utf-8")
    except OSError as exc:
        raise LogFormatError(f"cannot read log {log.path}: {exc}") from exc
    with handle:
        for lineno, where, rec in jsonl_objects(handle, log.path, LogFormatError):
            for key in ("prompt", "query", "tokens"):
                if key not in rec:
                    raise LogFormatError(f"{where}: missing field {key!r}")
            query = _ident(rec["query"], "query", where)
            tokens = rec["tokens"]
            if not _finite_number(tokens) or tokens < 0:
                raise LogFormatError(f"{where}: field 'tokens' must be a number >= 0, got {tokens!r}")
            if aggregator == "mv":
                if "answer" not in rec or "gold" not in rec:
                    raise LogFormatError(f"{where}: a majority-vote log line needs fields 'answer' and 'gold'")
                gold = _answer(rec["gold"], "gold", where, allow_null=False)
                assert gold is not None
                first = golds.setdefault(query, (gold, lineno))
                if first[0] != gold:
                    raise LogFormatError(f"{where}: gold answer {gold!r} of query {query!r} differs "
                                         f"from {first[0]!r} on line {first[1]}")
                log.answers.append(_answer(rec["answer"], "answer", where, allow_null=True))
                log.golds.append(gold)
            else:
                log.scores.append(_scores(rec, log, where))
            if "split" in rec:
                split = rec["split"]
                if split not in ("train", "test"):
                    raise LogFormatError(f"{where}: field 'split' must be 'train' or 'test', got {split!r}")
                seen = log.splits.setdefault(query, (split, lineno))
                if seen[0] != split:
                    raise LogFormatError(f"{where}: query {query!r} is in split {split!r} here but {seen[0]!r} on line {seen[1]}")
            log.prompts.append(_ident(rec["prompt"], "prompt", where))
            log.queries.append(query)
            log.tokens.append(float(tokens))
            log.lines.append(lineno)
    if not log.prompts:
        raise LogFormatError(f"{log.path}: the log holds no completions")
    return log


def _scores(rec: dict[str, Any], log: _Log, where: str) -> list[float]:
    scores = rec.get("scores")
    if not isinstance(scores, dict) or not scores:
        raise LogFormatError(f"{where}: a best-of-N log line needs field 'scores', an object of named objective scores")
    names = tuple(str(k) for k in scores)
    if not log.objective_names:
        log.objective_names = names
    elif set(names) != set(log.objective_names):
        raise LogFormatError(f"{where}: objectives {sorted(names)} differ from {sorted(log.objective_names)} on the first line")
    values = []
    for name in log.objective_names:
        v = scores[name]
        if not _finite_number(v):
            raise LogFormatError(f"{where}: score {name!r} must be a finite number, got {v!r}")
        values.append(float(v))
    return values


def _codes(values: list[str]) -> tuple[tuple[str, ...], np.ndarray]:
    """Ids in order of first appearance and each entry's index into them."""
    order: dict[str, int] = {}
    codes = np.fromiter((order.setdefault(v, len(order)) for v in values), dtype=np.int64, count=len(values))
    return tuple(order), codes


def _normalized_cost(log: _Log, p_idx: np.ndarray, n_prompts: int, cost_scale: float) -> np.ndarray:
    if not (math.isfinite(cost_scale) and cost_scale >= 0):
        raise ValueError(f"cost_scale must be a finite number >= 0, got {cost_scale!r}")
    tokens = np.asarray(log.tokens)
    mean = np.bincount(p_idx, weights=tokens, minlength=n_prompts) / np.bincount(p_idx, minlength=n_prompts)
    top = mean.max()
    if top <= 0:
        raise LogFormatError(f"{log.path}: every token count is 0, so no cost can be derived")
    return cost_scale * mean / top


def _split(log: _Log, query_ids: tuple[str, ...], test_fraction: float, seed: int) -> np.ndarray | None:
    if log.splits:
        missing = [q for q in query_ids if q not in log.splits]
        if missing:
            raise LogFormatError(f"{log.path}: some lines give a 'split' but query {missing[0]!r} has none; "
                                 "give it for every query or none")
        return np.array([TEST if log.splits[q][0] == "test" else TRAIN for q in query_ids], dtype=np.uint8)
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction!r}")
    if test_fraction == 0.0:
        return None
    n_q = len(query_ids)
    n_test = int(round(test_fraction * n_q))
    if n_test < 1 or n_test >= n_q:
        raise LogFormatError(f"{log.path}: test_fraction {test_fraction} of its {n_q} queries leaves no train or no test query; "
                         "use --test-fraction 0 (no stored split) or log more queries")
    split = np.full(n_q, TRAIN, dtype=np.uint8)
    split[derive_rng(seed, SPLIT_KEY).permutation(n_q)[:n_test]] = TEST
    return split


def _pair_index(log: _Log) -> tuple[tuple[str, ...], tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]:
    """Prompt and query ids, per-completion codes, and completion counts per (prompt, query); every pair must occur."""
    prompt_ids, p_idx = _codes(log.prompts)
    query_ids, q_idx = _codes(log.queries)
    n_p, n_q = len(prompt_ids), len(query_ids)
    counts = np.bincount(p_idx * n_q + q_idx, minlength=n_p * n_q).reshape(n_p, n_q)
    if np.any(counts == 0):
        p, q = (int(i) for i in np.argwhere(counts == 0)[0])
        raise LogFormatError(f"{log.path}: no completion of prompt {prompt_ids[p]!r} on query {query_ids[q]!r}; "
                             f"every (prompt, query) pair needs at least one ({int((counts == 0).sum())} pairs are missing)")
    return prompt_ids, query_ids, p_idx, q_idx, counts


def _provenance(log: _Log, how: str) -> dict[str, Any]:
    return {"source": f"completion log {log.path.name}", "license": "as the log's owner decides",
            "build": f"iapo_gym.data.build ({how})"}


def build_mv_table(path: str | os.PathLike[str], task: str | None = None, top_k: int = 4, n_max: int = 32,
                   cost_scale: float = DEFAULT_COST_SCALE, test_fraction: float = 0.2, seed: int = 0) -> OutcomeTable:
    """A majority-vote table from a log: per query the ``top_k`` most frequent answers (always including gold) + "other"."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    log = read_log(path, "mv")
    prompt_ids, query_ids, p_idx, q_idx, counts = _pair_index(log)
    n_p, n_q, n_m = len(prompt_ids), len(query_ids), top_k + 1
    other = top_k
    vocab, a_idx = _codes([a if a is not None else "" for a in log.answers] + log.golds)
    n_a = len(vocab)
    n = len(log.answers)
    valid = np.array([a is not None for a in log.answers])
    gold_code = np.full(n_q, -1, dtype=np.int64)
    gold_code[q_idx] = a_idx[n:]
    a_idx = a_idx[:n]
    # Global answer counts per (query, answer); one extra key per query guarantees a gold row.
    keys = np.concatenate([q_idx[valid] * n_a + a_idx[valid], np.arange(n_q) * n_a + gold_code])
    ukeys, ucount = np.unique(keys, return_counts=True)
    ucount[np.searchsorted(ukeys, np.arange(n_q) * n_a + gold_code)] -= 1
    row_q, row_a = ukeys // n_a, ukeys % n_a
    order = np.lexsort((row_a, -ucount, row_q))  # by query, then most votes, then first-seen answer
    start = np.searchsorted(row_q[order], np.arange(n_q))
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size) - start[row_q[order]]
    is_gold = row_a == gold_code[row_q]
    gold_rank = np.empty(n_q, dtype=np.int64)
    gold_rank[row_q[is_gold]] = rank[is_gold]
    keep = ((rank < top_k) & ~((gold_rank[row_q] >= top_k) & (rank == top_k - 1))) | is_gold
    kept_sorted = keep[order]
    bucket_sorted = np.cumsum(kept_sorted) - 1
    group_start = np.concatenate([[0], np.cumsum(kept_sorted)])[start]
    bucket = np.full(ukeys.size, other, dtype=np.int64)
    bucket[order[kept_sorted]] = (bucket_sorted - group_start[row_q[order]])[kept_sorted]
    gold = bucket[np.searchsorted(ukeys, np.arange(n_q) * n_a + gold_code)]
    comp_bucket = np.full(n, other, dtype=np.int64)
    comp_bucket[valid] = bucket[np.searchsorted(ukeys, q_idx[valid] * n_a + a_idx[valid])]
    votes = np.bincount((p_idx * n_q + q_idx) * n_m + comp_bucket, minlength=n_p * n_q * n_m).reshape(n_p, n_q, n_m)
    probs = votes / counts[:, :, None]
    weights, names, cprobs = mv_cost_contexts()
    return OutcomeTable(
        task=task or log.path.stem, aggregator="mv", probs=probs,
        cost=_normalized_cost(log, p_idx, n_p, cost_scale), n_max=n_max,
        context_weights=weights, context_names=names, context_probs=cprobs, objective_names=("correct",),
        gold=gold, prompts=prompt_ids, queries=query_ids, split=_split(log, query_ids, test_fraction, seed),
        attrs={**_provenance(log, f"mv, top {top_k} answers + other, cost scale {cost_scale}"),
               "completions": n},
    )


def bon_contexts(n_objectives: int) -> tuple[np.ndarray, tuple[str, ...], np.ndarray]:
    """The paper's 27 weight triples for two objectives; for K != 2, equal weights 1/K at each cost weight."""
    if n_objectives == 2:
        return bon_grid_contexts()
    weights = np.array([[1.0 / n_objectives] * n_objectives + [-wc] for wc in COST_WEIGHTS_BON])
    names = tuple(f"equal,cost={wc:.1f}" for wc in COST_WEIGHTS_BON)
    return weights, names, np.full(len(names), 1.0 / len(names))


def build_bon_table(path: str | os.PathLike[str], task: str | None = None, grid: float | None = 0.5, n_max: int = 32,
                    cost_scale: float = DEFAULT_COST_SCALE, test_fraction: float = 0.2, seed: int = 0) -> OutcomeTable:
    """A Best-of-N table from a log: the empirical distribution of objective vectors, binned on ``grid`` if given."""
    if grid is not None and not (math.isfinite(grid) and grid > 0):
        raise ValueError(f"grid must be a number > 0 or None (no binning), got {grid!r}")
    log = read_log(path, "bon")
    prompt_ids, query_ids, p_idx, q_idx, counts = _pair_index(log)
    n_p, n_q, k = len(prompt_ids), len(query_ids), len(log.objective_names)
    scores = np.asarray(log.scores, dtype=np.float64)
    if grid is not None:
        scores = np.round(scores / grid) * grid
    pair = p_idx * n_q + q_idx
    rows, inverse, atom_count = np.unique(np.column_stack([pair.astype(np.float64), scores]), axis=0,
                                          return_inverse=True, return_counts=True)
    del inverse
    row_pair = rows[:, 0].astype(np.int64)  # rows are sorted by pair first
    start = np.searchsorted(row_pair, np.arange(n_p * n_q))
    slot = np.arange(rows.shape[0]) - start[row_pair]
    n_m = int(slot.max()) + 1
    atoms = np.repeat(rows[start, 1:][:, None, :], n_m, axis=1)  # padding repeats each pair's first atom
    atoms[row_pair, slot] = rows[:, 1:]
    probs = np.zeros((n_p * n_q, n_m))
    probs[row_pair, slot] = atom_count / counts.reshape(-1)[row_pair]
    weights, names, cprobs = bon_contexts(k)
    how = f"bon, grid {grid}" if grid is not None else "bon, exact objective vectors"
    return OutcomeTable(
        task=task or log.path.stem, aggregator="bon", probs=probs.reshape(n_p, n_q, n_m),
        atoms=atoms.reshape(n_p, n_q, n_m, k), cost=_normalized_cost(log, p_idx, n_p, cost_scale), n_max=n_max,
        context_weights=weights, context_names=names, context_probs=cprobs, objective_names=log.objective_names,
        prompts=prompt_ids, queries=query_ids, split=_split(log, query_ids, test_fraction, seed),
        attrs={**_provenance(log, f"{how}, cost scale {cost_scale}"), "completions": len(log.prompts)},
    )


def build_table(path: str | os.PathLike[str], aggregator: str, **options: Any) -> OutcomeTable:
    """``build_mv_table`` or ``build_bon_table`` by ``aggregator``."""
    if aggregator not in ("mv", "bon"):
        raise ValueError(f"aggregator must be 'mv' or 'bon', got {aggregator!r}")
    build = build_mv_table if aggregator == "mv" else build_bon_table
    try:
        return build(path, **options)
    except TableError as exc:  # e.g. token counts so large that the costs overflow
        raise LogFormatError(f"{path}: the table built from this log is invalid: {exc}") from None
