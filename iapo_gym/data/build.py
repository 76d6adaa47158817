"""Build an outcome table from samples: your own completion logs (``docs/log-format.md``), lm-evaluation-harness
logs (``iapo_gym.data.lmeval``) and columnar sample sets (``iapo_gym.data.columns``).

Every reader hands ``SampleAccumulator`` batches of samples (one entry per completion); the accumulator
keeps only counts per (prompt, query, outcome), so a build holds one batch plus the distinct outcomes
and the finished table, whatever the number of rows (``docs/data.md`` states the bound). Majority vote
keeps, per query, the most frequent answers over all prompts plus an "other" bucket (the paper: top 4 +
other), always keeping the gold answer. Best-of-N keeps the distribution of objective vectors: exact, on
a grid (the paper: 0.5) or in quantile bins. The per-prompt cost is the mean token count, scaled so the
most expensive prompt costs ``cost_scale``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from iapo_gym.seeding import derive_rng
from iapo_gym.tables import MAX_TABLE_BYTES, TEST, TRAIN, OutcomeTable, TableError
from iapo_gym.tasks.contexts import COST_WEIGHTS_BON, bon_grid_contexts, mv_cost_contexts

#: Seed key of the stored split drawn when the samples name none.
SPLIT_KEY = "iapo_gym.data.build.split"
DEFAULT_COST_SCALE = 0.01
#: Rows per batch the readers hand the accumulator (the part of a build's memory that grows with it).
DEFAULT_BATCH_ROWS = 65_536
#: Cells of the histogram that places quantile-bin edges (edges are cell boundaries).
QUANTILE_CELLS = 4096
_NO_ANSWER = -1


class LogFormatError(ValueError):
    """Samples are malformed; the message names the file and the line or row."""


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


# ---- one batch of samples, as every reader hands it over ------------------------------------------------


Codes = tuple[Sequence[str] | np.ndarray, np.ndarray]
"""Batch-local categorical values: the distinct values (answers: texts or their digests, ``answer_digests``) and each
row's index into them (-1: none)."""


@dataclass
class SampleBatch:
    """Samples of one batch, one entry per completion, already checked by the reader.

    ``rows`` gives each entry's place for error messages (a line or row number in ``origin``).
    """

    origin: str
    rows: np.ndarray  # (n,) int64 line or row numbers
    prompts: Codes
    queries: Codes
    tokens: np.ndarray | None = None  # (n,) float64 >= 0; None: no token counts
    answers: Codes | None = None  # mv: index -1 = no answer
    golds: Codes | None = None  # mv
    scores: np.ndarray | None = None  # bon: (n, K) float64, finite
    splits: Codes | None = None  # values "train" / "test"
    samples: np.ndarray | None = None  # (n,) int64 sample index within its (prompt, query), |index| < 2**20
    unit: str = "line"  # what ``rows`` count: "line" (text files) or "row" (columnar files)
    items: np.ndarray | None = None  # (n,) int64 place in its row's list (list-shaped sample sets)

    def __len__(self) -> int:
        """Number of completions."""
        return int(self.rows.size)

    def where(self, i: int) -> str:
        """``origin:line`` (or ``origin: row N``) of entry ``i``."""
        if self.unit == "line":
            return f"{self.origin}:{int(self.rows[i])}"
        item = "" if self.items is None else f", list item {int(self.items[i])}"
        return f"{self.origin}: {self.unit} {int(self.rows[i])}{item}"


def codes_of(values: Sequence[Any]) -> Codes:
    """Distinct values in order of first appearance and each entry's index (None: -1)."""
    order: dict[Any, int] = {}
    idx = np.fromiter((-1 if v is None else order.setdefault(v, len(order)) for v in values), dtype=np.int64,
                      count=len(values))
    return list(order), idx


class _Interner:
    """Global codes of categorical values (prompts, queries, answers) in order of first appearance."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.first_row: list[int] = []  # global row of first appearance (answers: as an answer)

    def map(self, codes: Codes, row0: int | None = None) -> np.ndarray:
        """Global codes of a batch's entries; ``row0`` (the batch's first global row) records first appearances."""
        values, idx = codes
        local = np.empty(len(values), dtype=np.int64)
        for j, v in enumerate(values):
            code = self.index.setdefault(v, len(self.index))
            local[j] = code
            if code == len(self.first_row):
                self.first_row.append(-1)
        glob = np.where(idx >= 0, local[np.maximum(idx, 0)] if len(values) else -1, -1)
        if row0 is not None and len(values):
            seen = np.flatnonzero(idx >= 0)
            firsts, at = np.unique(idx[seen], return_index=True)
            for j, pos in zip(firsts.tolist(), seen[at].tolist(), strict=True):
                if self.first_row[local[j]] < 0:
                    self.first_row[local[j]] = row0 + pos
        return glob

    @property
    def values(self) -> tuple[str, ...]:
        """The distinct values, by code."""
        return tuple(self.index)

    def __len__(self) -> int:
        """Number of distinct values."""
        return len(self.index)


#: Bytes of the digest that stands for an answer: 128 bits of BLAKE2b of its UTF-8 text.
ANSWER_DIGEST_BYTES = 16


def answer_digests(values: Iterable[str | bytes | memoryview]) -> np.ndarray:
    """The 128-bit BLAKE2b digests of answers (texts, or their UTF-8 bytes), as a numpy ``S16`` array."""
    import hashlib

    out = [hashlib.blake2b(v.encode("utf-8", "surrogatepass") if isinstance(v, str) else v,
                           digest_size=ANSWER_DIGEST_BYTES).digest() for v in values]
    return np.array(out, dtype=f"S{ANSWER_DIGEST_BYTES}")


class _AnswerDigests:
    """Global codes of answers in order of first appearance, keyed by a 128-bit BLAKE2b digest of each answer's
    text, not by the text: 32 bytes per distinct answer (digest, code, first row), whatever the answers' length.

    Two distinct answers share a digest with probability below n^2 / 2^129 for n distinct answers (under
    3e-27 for a million); majority vote needs only answer equality, so that is the only approximation.
    The texts of gold answers are kept (one per query) for error messages.
    """

    def __init__(self) -> None:
        self.keys = np.empty(0, dtype=f"S{ANSWER_DIGEST_BYTES}")  # sorted digests
        self.codes = np.empty(0, dtype=np.int64)  # the code of each sorted digest
        self.first = np.empty(0, dtype=np.int64)  # by code: global row of first appearance as an answer, -1 none
        self.texts: dict[int, str] = {}

    def map(self, codes: Codes, row0: int | None = None, keep_text: bool = False) -> np.ndarray:
        """Global codes of a batch's entries; ``row0`` (the batch's first global row) records first appearances.

        The batch's distinct values are answer texts or already their digests (``answer_digests``: a
        columnar reader digests the text in its Arrow buffers, without making Python strings).
        """
        values, idx = codes
        if not len(values):
            return np.full(idx.shape, -1, dtype=np.int64)
        digest = values if isinstance(values, np.ndarray) and values.dtype.kind == "S" else answer_digests(values)
        pos = np.searchsorted(self.keys, digest)
        found = (pos < self.keys.size) & (self.keys[np.minimum(pos, max(self.keys.size - 1, 0))] == digest) \
            if self.keys.size else np.zeros(digest.size, dtype=bool)
        local = np.empty(digest.size, dtype=np.int64)
        local[found] = self.codes[pos[found]]
        new = np.flatnonzero(~found)
        if new.size:  # distinct values of one batch have distinct digests (barring a collision: then one answer)
            fresh, first_of = np.unique(digest[new], return_index=True)
            order = np.argsort(new[first_of], kind="stable")  # codes in order of first appearance in the batch
            code_of = np.empty(fresh.size, dtype=np.int64)
            code_of[order] = np.arange(self.first.size, self.first.size + fresh.size)
            local[new] = code_of[np.searchsorted(fresh, digest[new])]
            at = np.searchsorted(self.keys, fresh)
            self.keys = np.insert(self.keys, at, fresh)
            self.codes = np.insert(self.codes, at, code_of)
            self.first = np.concatenate([self.first, np.full(fresh.size, -1, dtype=np.int64)])
        if keep_text:
            for j, v in enumerate(values):
                self.texts.setdefault(int(local[j]), v)
        glob = np.where(idx >= 0, local[np.maximum(idx, 0)], -1)
        if row0 is not None:
            seen = np.flatnonzero(idx >= 0)
            firsts, at_row = np.unique(idx[seen], return_index=True)
            code = local[firsts]
            unset = self.first[code] < 0
            self.first[code[unset]] = row0 + seen[at_row][unset]
        return glob

    def text(self, code: int) -> str:
        """A gold answer's text."""
        return self.texts.get(code, f"<answer {code}>")

    @property
    def first_row(self) -> np.ndarray:
        """By code: the global row where each answer first appeared as an answer (-1: only as a gold answer)."""
        return self.first

    @property
    def nbytes(self) -> int:
        """Bytes held: the digests, codes and first rows (the gold texts are one per query)."""
        return int(self.keys.nbytes + self.codes.nbytes + self.first.nbytes)

    def __len__(self) -> int:
        """Number of distinct answers."""
        return int(self.first.size)


class _KeyedCounts:
    """Counts (and optional integer sums) per integer key row, merged lazily: distinct keys, not rows, are kept."""

    def __init__(self, n_cols: int, n_vals: int) -> None:
        self.keys = np.empty((0, n_cols), dtype=np.int64)
        self.vals = np.empty((0, n_vals), dtype=np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_rows = 0

    def add(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Add rows of keys with their values; merged when the pending rows outgrow the merged ones."""
        self._pending.append(_reduce(keys, vals))
        self._pending_rows += self._pending[-1][0].shape[0]
        if self._pending_rows >= max(self.keys.shape[0], DEFAULT_BATCH_ROWS):
            self.merge()

    def merge(self) -> None:
        """Fold the pending rows into the merged, sorted, distinct keys."""
        if self._pending:
            self.keys, self.vals = _reduce(np.concatenate([self.keys, *(k for k, _ in self._pending)]),
                                           np.concatenate([self.vals, *(v for _, v in self._pending)]))
            self._pending, self._pending_rows = [], 0

    @property
    def nbytes(self) -> int:
        """Bytes held (merged and pending)."""
        return int(self.keys.nbytes + self.vals.nbytes + sum(k.nbytes + v.nbytes for k, v in self._pending))


def _reduce(keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct key rows, sorted (first column first), with the values of equal rows summed."""
    if keys.shape[0] == 0:
        return keys, vals
    order = np.lexsort(keys.T[::-1])
    keys, vals = keys[order], vals[order]
    starts = np.flatnonzero(np.concatenate([[True], np.any(keys[1:] != keys[:-1], axis=1)]))
    return keys[starts], np.add.reduceat(vals, starts, axis=0)


def _grow(arr: np.ndarray, n: int, fill: int) -> np.ndarray:
    if arr.size >= n:
        return arr
    return np.concatenate([arr, np.full(max(n, 2 * arr.size) - arr.size, fill, dtype=arr.dtype)])


def _ordered_bits(values: np.ndarray) -> np.ndarray:
    """Order-preserving int64 keys of finite float64 values (-0.0 and 0.0 are one key)."""
    bits = np.ascontiguousarray(values + 0.0).view(np.int64)  # + 0.0 turns -0.0 into 0.0
    return bits ^ ((bits >> 63) & np.int64(0x7FFFFFFFFFFFFFFF))


def _bits_values(keys: np.ndarray) -> np.ndarray:
    """The float64 values of ``_ordered_bits`` keys (the same flip undoes it)."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    return (keys ^ ((keys >> 63) & np.int64(0x7FFFFFFFFFFFFFFF))).view(np.float64)


@dataclass(frozen=True)
class Binning:
    """How Best-of-N scores become atoms: exact vectors, a grid, or quantile bins (``edges`` per objective)."""

    grid: float | None = 0.5
    edges: tuple[np.ndarray, ...] | None = None  # quantile bins: the inner edges of each objective
    values: tuple[np.ndarray, ...] | None = None  # quantile bins: each bin's atom value, per objective

    def describe(self) -> str:
        """How the atoms were made, for the table's provenance."""
        if self.edges is not None:
            return f"quantile bins ({', '.join(str(e.size + 1) for e in self.edges)} per objective)"
        return f"grid {self.grid}" if self.grid is not None else "exact objective vectors"


class SampleAccumulator:
    """Counts per (prompt, query, outcome) from batches of samples: the one place a table's distributions come from.

    Holds the distinct keys (at most prompts x queries x outcomes of 8 bytes per key column), per-prompt
    token sums, per-query gold and split, and per-pair sample-index checks: never the rows themselves.
    """

    def __init__(self, aggregator: str, *, binning: Binning | None = None, max_bytes: int = MAX_TABLE_BYTES) -> None:
        """``aggregator`` "mv" or "bon"; ``binning`` for bon (default: the paper's 0.5 grid)."""
        if aggregator not in ("mv", "bon"):
            raise ValueError(f"aggregator must be 'mv' or 'bon', got {aggregator!r}")
        self.aggregator = aggregator
        self.binning = binning or Binning()
        self.max_bytes = max_bytes
        self.prompts, self.queries = _Interner(), _Interner()
        self.answers = _AnswerDigests()
        self.objective_names: tuple[str, ...] = ()
        self.rows = 0
        self.token_sum = np.zeros(0)
        self.token_rows = np.zeros(0, dtype=np.int64)
        self.has_tokens: bool | None = None
        self.gold = np.zeros(0, dtype=np.int64)  # per query: answer code, -1 unknown
        self.gold_where: dict[int, str] = {}
        self.split = np.zeros(0, dtype=np.int64)  # per query: TRAIN/TEST, -1 unknown
        self.split_where: dict[int, str] = {}
        self.any_split = False
        self.sample_low: int | None = None  # the lowest sample index seen (0 or 1 in a well-formed set)
        self.sample_seen: dict[int, np.ndarray] = {}  # per prompt: (queries, indices) bool cells of the indices seen
        self.sample_where: dict[int, np.ndarray] = {}  # per prompt: the same cells' batch row (for messages)
        self.outcomes: _KeyedCounts | None = None

    # ---- adding a batch -------------------------------------------------------------------------------
    def add(self, batch: SampleBatch, objective_names: Sequence[str] = ()) -> None:
        """Count one batch (its entries already checked by the reader; cross-batch rules are checked here)."""
        n = len(batch)
        if n == 0:
            return
        p = self.prompts.map(batch.prompts)
        q = self.queries.map(batch.queries)
        n_q = len(self.queries)
        self._tokens(batch, p)
        self._per_query(batch, q, n_q)
        if batch.samples is not None:
            self._samples(batch, p, q)
        if self.aggregator == "mv":
            if batch.answers is None or batch.golds is None:
                raise LogFormatError(f"{batch.origin}: majority vote needs each completion's answer and gold answer")
            a = self.answers.map(batch.answers, row0=self.rows)
            g = self.answers.map(batch.golds, keep_text=True)
            self._gold(batch, q, g, n_q)
            keys = np.column_stack([p, q, a])
        else:
            if batch.scores is None:
                raise LogFormatError(f"{batch.origin}: Best-of-N needs each completion's scores")
            names = tuple(objective_names)
            if not self.objective_names:
                self.objective_names = names
            elif names != self.objective_names:
                raise LogFormatError(f"{batch.origin}: objectives {list(names)} differ from {list(self.objective_names)}")
            keys = np.column_stack([p, q, self._atom_keys(batch.scores, batch)])
        if self.outcomes is None:
            self.outcomes = _KeyedCounts(keys.shape[1], 1)
        self.outcomes.add(keys, np.ones((n, 1), dtype=np.int64))
        self.rows += n
        held = self.outcomes.nbytes + self.sample_bytes + self.answers.nbytes
        if held > self.max_bytes:
            raise LogFormatError(f"{batch.where(n - 1)}: the distinct (prompt, query, outcome) counts so far take "
                                 f"{held} bytes, more than the limit of {self.max_bytes} (counted: the keys "
                                 f"{self.outcomes.nbytes}, the answers' digests {self.answers.nbytes}, the sample-index "
                                 f"cells {self.sample_bytes}); "
                                 + ("use a coarser --grid or --quantile-bins" if self.aggregator == "bon"
                                    else "fewer distinct answers (normalize them) or fewer queries"))

    def _tokens(self, batch: SampleBatch, p: np.ndarray) -> None:
        has = batch.tokens is not None
        if self.has_tokens is None:
            self.has_tokens = has
        elif self.has_tokens != has:
            raise LogFormatError(f"{batch.where(0)}: token counts are given for some completions and not others")
        n_p = len(self.prompts)
        self.token_sum = _grow(self.token_sum, n_p, 0)
        self.token_rows = _grow(self.token_rows, n_p, 0)
        if has:
            assert batch.tokens is not None
            self.token_sum[:n_p] += np.bincount(p, weights=batch.tokens, minlength=n_p)
        self.token_rows[:n_p] += np.bincount(p, minlength=n_p)

    def _consistent(self, batch: SampleBatch, q: np.ndarray, value: np.ndarray, store: np.ndarray,
                    wheres: dict[int, str], describe: Callable[[int], str], what: str) -> np.ndarray:
        """Record one value per query; the first entry that differs from the query's first value raises, naming both."""
        uq, first = np.unique(q, return_index=True)
        known = store[uq]
        reference = np.where(known >= 0, known, value[first])
        expected = reference[np.searchsorted(uq, q)]
        wrong = np.flatnonzero(value != expected)
        if wrong.size:
            i = int(wrong[0])
            j = int(np.searchsorted(uq, q[i]))
            there = wheres[int(uq[j])] if known[j] >= 0 else batch.where(int(first[j]))
            raise LogFormatError(f"{batch.where(i)}: {what} {describe(int(value[i]))} of query "
                                 f"{self.queries.values[int(q[i])]!r} differs from {describe(int(expected[i]))} "
                                 f"at {there}")
        for j in np.flatnonzero(known < 0).tolist():
            wheres[int(uq[j])] = batch.where(int(first[j]))
        store[uq] = reference
        return store

    def _per_query(self, batch: SampleBatch, q: np.ndarray, n_q: int) -> None:
        self.gold = _grow(self.gold, n_q, -1)
        self.split = _grow(self.split, n_q, -1)
        if batch.splits is None:
            return
        values, idx = batch.splits
        bad = [v for v in values if v not in ("train", "test")]
        if bad:
            i = int(np.flatnonzero(idx == list(values).index(bad[0]))[0])
            raise LogFormatError(f"{batch.where(i)}: field 'split' must be 'train' or 'test', got {bad[0]!r}")
        lookup = np.array([TEST if v == "test" else TRAIN for v in values], dtype=np.int64)
        given = idx >= 0
        if not given.any():
            return
        self.any_split = True
        sub = SampleBatch(batch.origin, batch.rows[given], batch.prompts, batch.queries)
        self._consistent(sub, q[given], lookup[idx[given]], self.split, self.split_where,
                         lambda s: repr("test" if s == TEST else "train"), "split")

    def _gold(self, batch: SampleBatch, q: np.ndarray, g: np.ndarray, n_q: int) -> None:
        if np.any(g < 0):
            raise LogFormatError(f"{batch.where(int(np.flatnonzero(g < 0)[0]))}: the gold answer is missing")
        self._consistent(batch, q, g, self.gold, self.gold_where, lambda a: repr(self.answers.text(a)), "gold answer")

    @property
    def sample_bytes(self) -> int:
        """Bytes of the sample-index cells: one byte per (prompt, query, index) up to the largest index and query."""
        return int(sum(m.nbytes for m in self.sample_seen.values()))

    def _samples(self, batch: SampleBatch, p: np.ndarray, q: np.ndarray) -> None:
        """Mark each entry's (prompt, query, sample index) cell; a cell marked twice is a repeated sample."""
        assert batch.samples is not None
        s = batch.samples
        bad = np.flatnonzero((s < 0) | (s >= 2**20))
        if bad.size:
            i = int(bad[0])
            raise LogFormatError(f"{batch.where(i)}: sample index {int(s[i])} is out of range (0 <= index < 2**20)")
        lowest = int(s.min())
        self.sample_low = lowest if self.sample_low is None else min(self.sample_low, lowest)
        n_q = len(self.queries)
        order = np.argsort(p, kind="stable")
        bounds = np.flatnonzero(np.diff(p[order])) + 1
        for group in np.split(order, bounds):  # one group per prompt of the batch (prompts are few)
            prompt = int(p[group[0]])
            qs, ss = q[group], s[group]
            seen = self.sample_seen.get(prompt, np.zeros((0, 0), dtype=bool))
            rows, cols = max(n_q, seen.shape[0]), max(int(ss.max()) + 1, seen.shape[1])
            if rows > seen.shape[0] or cols > seen.shape[1]:
                rows = rows if rows <= seen.shape[0] else max(rows, 2 * seen.shape[0])
                cols = cols if cols <= seen.shape[1] else max(cols, 2 * seen.shape[1])
                grow = rows * cols - seen.size
                if self.sample_bytes + grow > self.max_bytes:
                    i = int(group[np.argmax(ss)])
                    raise LogFormatError(f"{batch.where(i)}: sample index {int(s[i])} would need {rows * cols} bytes "
                                         f"of sample-index cells for prompt {self.prompts.values[prompt]!r} alone, more "
                                         f"than the limit of {self.max_bytes}; the sample column numbers the samples "
                                         "of each (prompt, query) from 0 or 1 (--sample-col '' ignores it)")
                grown = np.zeros((rows, cols), dtype=bool)
                grown[:seen.shape[0], :seen.shape[1]] = seen
                seen = self.sample_seen[prompt] = grown
            cell = qs * seen.shape[1] + ss
            flat = seen.reshape(-1)
            uniq, first, count = np.unique(cell, return_index=True, return_counts=True)
            twice = np.flatnonzero((count > 1) | flat[uniq])
            if twice.size:
                j = int(twice[0])
                at = np.flatnonzero(cell == uniq[j])
                i = int(group[at[-1]] if count[j] > 1 else group[at[0]])
                raise LogFormatError(f"{batch.where(i)}: sample {int(s[i])} of prompt {self.prompts.values[prompt]!r} "
                                     f"on query {self.queries.values[int(q[i])]!r} appears twice "
                                     f"(also at {batch.where(int(group[at[0]])) if count[j] > 1 else 'an earlier row'})")
            flat[uniq] = True

    def _atom_keys(self, scores: np.ndarray, batch: SampleBatch) -> np.ndarray:
        b = self.binning
        if b.edges is not None:
            if scores.shape[1] != len(b.edges):
                raise LogFormatError(f"{batch.origin}: {scores.shape[1]} scores per completion, quantile edges "
                                     f"for {len(b.edges)}")
            return np.column_stack([np.searchsorted(edges, scores[:, k], side="right")
                                    for k, edges in enumerate(b.edges)]).astype(np.int64)
        if b.grid is not None:
            cells = np.round(scores / b.grid)
            if np.any(np.abs(cells) >= 2.0**62):
                i = int(np.flatnonzero(np.any(np.abs(cells) >= 2.0**62, axis=1))[0])
                raise LogFormatError(f"{batch.where(i)}: score {scores[i].tolist()} is too large for grid {b.grid}")
            return cells.astype(np.int64)
        return _ordered_bits(scores)

    def _atom_values(self, keys: np.ndarray) -> np.ndarray:
        b = self.binning
        if b.values is not None:
            return np.column_stack([b.values[k][keys[:, k]] for k in range(keys.shape[1])])
        if b.grid is not None:
            return keys.astype(np.float64) * b.grid
        return _bits_values(keys)

    # ---- the table ------------------------------------------------------------------------------------
    def finish(self, task: str, *, n_max: int = 32, top_k: int = 4, cost_scale: float = DEFAULT_COST_SCALE,
               test_fraction: float = 0.2, seed: int = 0, attrs: dict[str, Any] | None = None,
               origin: str = "samples", contexts: ContextSet | None = None) -> OutcomeTable:
        """The outcome table of everything added (``top_k`` for mv); every (prompt, query) pair needs a completion."""
        if self.outcomes is None or self.rows == 0:
            raise LogFormatError(f"{origin}: no completions")
        self.outcomes.merge()
        keys, counts = self.outcomes.keys, self.outcomes.vals[:, 0]
        n_p, n_q = len(self.prompts), len(self.queries)
        pair = keys[:, 0] * n_q + keys[:, 1]
        pair_count = np.bincount(pair, weights=counts, minlength=n_p * n_q).astype(np.int64).reshape(n_p, n_q)
        if np.any(pair_count == 0):
            p, q = (int(i) for i in np.argwhere(pair_count == 0)[0])
            raise LogFormatError(f"{origin}: no completion of prompt {self.prompts.values[p]!r} on query "
                                 f"{self.queries.values[q]!r}; every (prompt, query) pair needs at least one "
                                 f"({int((pair_count == 0).sum())} pairs are missing)")
        self._check_samples(origin, pair_count)
        common: dict[str, Any] = {
            "task": task, "cost": self._cost(cost_scale, origin), "n_max": n_max,
            "prompts": self.prompts.values, "queries": self.queries.values,
            "split": self._split(test_fraction, seed, origin),
            "attrs": {**(attrs or {}), "completions": self.rows},
        }
        if self.aggregator == "mv":
            if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
                raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
            probs, gold = self._mv(keys, counts, pair_count, top_k)
            weights, names, cprobs = mv_cost_contexts()
            common["attrs"]["contexts_source"] = f"{describe_contexts(weights, cprobs)}: the paper's low/mid/high"
            if contexts is not None:
                weights, names, cprobs = self._chosen(contexts, ("correct",), common["attrs"])
            return OutcomeTable(aggregator="mv", probs=probs, gold=gold, context_weights=weights, context_names=names,
                                context_probs=cprobs, objective_names=("correct",), **common)
        probs, atoms = self._bon(keys, counts, pair_count)
        k = len(self.objective_names)
        weights, names, cprobs = bon_contexts(k)
        common["attrs"]["contexts_source"] = f"{describe_contexts(weights, cprobs)}: " + (
            "the paper's 27 Best-of-N weightings" if k == 2 else f"equal weights 1/{k} at each of the paper's cost weights")
        if contexts is not None:
            weights, names, cprobs = self._chosen(contexts, self.objective_names, common["attrs"])
        return OutcomeTable(aggregator="bon", probs=probs, atoms=atoms, context_weights=weights, context_names=names,
                            context_probs=cprobs, objective_names=self.objective_names, **common)

    @staticmethod
    def _chosen(contexts: ContextSet, objectives: Sequence[str],
                attrs: dict[str, Any]) -> tuple[np.ndarray, tuple[str, ...], np.ndarray]:
        """The user's contexts, checked against the table's objectives; ``attrs`` records where they came from."""
        if contexts.n_objectives != len(objectives):
            raise LogFormatError(f"{contexts.source}: its contexts weigh {contexts.n_objectives} objective(s), the "
                                 f"table has {len(objectives)}: {list(objectives)}")
        attrs["contexts_source"] = f"{describe_contexts(contexts.weights, contexts.probs)}: {contexts.source}"
        return contexts.weights, contexts.names, contexts.probs

    def _guard(self, n_p: int, n_q: int, n_m: int, per_atom: int) -> None:
        """Refuse a table whose dense arrays (P x Q x M x values per atom, 8 bytes each) pass ``max_bytes``."""
        need = n_p * n_q * n_m * per_atom * 8
        if need > self.max_bytes:
            hint = "use a coarser --grid or --quantile-bins" if self.aggregator == "bon" else "use a smaller --top-k"
            raise LogFormatError(f"the table would hold {n_p} prompts x {n_q} queries x {n_m} atoms x {per_atom} "
                                 f"values = {need} bytes, more than the limit of {self.max_bytes}; {hint}")

    def _mv(self, keys: np.ndarray, counts: np.ndarray, pair_count: np.ndarray,
            top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """Buckets per query: the ``top_k`` most frequent answers (gold always kept) + "other"; probs and gold."""
        n_p, n_q = pair_count.shape
        n_m, other = top_k + 1, top_k
        self._guard(n_p, n_q, n_m, 1)
        p, q, a = keys[:, 0], keys[:, 1], keys[:, 2]
        valid = a != _NO_ANSWER
        n_a = max(len(self.answers), 1)
        gold_code = self.gold[:n_q]
        # votes per (query, answer) over all prompts; one zero-count key per query guarantees a gold row
        qa = np.concatenate([q[valid] * n_a + a[valid], np.arange(n_q) * n_a + gold_code])
        ukeys, inverse = np.unique(qa, return_inverse=True)
        ucount = np.bincount(inverse, weights=np.concatenate([counts[valid], np.zeros(n_q)]),
                             minlength=ukeys.size).astype(np.int64)
        row_q, row_a = ukeys // n_a, ukeys % n_a
        first = np.asarray(self.answers.first_row, dtype=np.int64)[row_a]
        first = np.where(first < 0, np.iinfo(np.int64).max, first)  # gold never given as an answer: last
        order = np.lexsort((first, -ucount, row_q))  # by query, then most votes, then first seen as an answer
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
        key_bucket = np.full(keys.shape[0], other, dtype=np.int64)
        key_bucket[valid] = bucket[np.searchsorted(ukeys, q[valid] * n_a + a[valid])]
        votes = np.bincount((p * n_q + q) * n_m + key_bucket, weights=counts, minlength=n_p * n_q * n_m)
        return votes.reshape(n_p, n_q, n_m) / pair_count[:, :, None], gold

    def _bon(self, keys: np.ndarray, counts: np.ndarray, pair_count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Atoms per (prompt, query): its distinct (binned) vectors, padded with zero-probability copies of its first."""
        n_p, n_q = pair_count.shape
        k = len(self.objective_names)
        pair = keys[:, 0] * n_q + keys[:, 1]  # keys are sorted by prompt, then query
        start = np.searchsorted(pair, np.arange(n_p * n_q))
        slot = np.arange(keys.shape[0]) - start[pair]
        n_m = int(slot.max()) + 1
        self._guard(n_p, n_q, n_m, k + 1)
        values = self._atom_values(keys[:, 2:])
        atoms = np.repeat(values[start][:, None, :], n_m, axis=1)  # padding repeats each pair's first atom
        atoms[pair, slot] = values
        probs = np.zeros((n_p * n_q, n_m))
        probs[pair, slot] = counts / pair_count.reshape(-1)[pair]
        return probs.reshape(n_p, n_q, n_m), atoms.reshape(n_p, n_q, n_m, k)

    def _check_samples(self, origin: str, pair_count: np.ndarray) -> None:
        """Each pair's sample indices must be exactly the set b, b + 1, ..., b + n - 1 (b the lowest index seen,
        0 or 1): no index is repeated (refused when added), so the set is right exactly when every marked cell
        lies in b..b + n - 1, n the pair's number of completions."""
        if self.sample_low is None:
            return
        b = self.sample_low
        n_q = pair_count.shape[1]
        for prompt in sorted(self.sample_seen):
            seen = self.sample_seen[prompt][:n_q]
            n = pair_count[prompt, :seen.shape[0]]
            idx = np.arange(seen.shape[1])
            expected = (idx[None, :] >= b) & (idx[None, :] < b + n[:, None])
            wrong = np.flatnonzero(np.any(seen != expected, axis=1) | (seen.sum(axis=1) != n))
            if wrong.size:
                q = int(wrong[0])
                got = np.flatnonzero(seen[q])
                shown = ", ".join(str(x) for x in got[:8]) + (", ..." if got.size > 8 else "")
                raise LogFormatError(f"{origin}: the {int(n[q])} sample indices of prompt {self.prompts.values[prompt]!r} "
                                     f"on query {self.queries.values[q]!r} are not {b}..{b + int(n[q]) - 1} once each "
                                     f"(they are {{{shown}}}; a missing or misnumbered sample; {wrong.size} queries of "
                                     "this prompt are affected)")
        missing = [p for p in range(pair_count.shape[0]) if p not in self.sample_seen]
        if missing:
            raise LogFormatError(f"{origin}: prompt {self.prompts.values[missing[0]]!r} has no sample indices while "
                                 "others do; give them for every completion or none")

    def _cost(self, cost_scale: float, origin: str) -> np.ndarray:
        if not (math.isfinite(cost_scale) and cost_scale >= 0):
            raise ValueError(f"cost_scale must be a finite number >= 0, got {cost_scale!r}")
        n_p = len(self.prompts)
        if not self.has_tokens:
            return np.full(n_p, float(cost_scale))  # no token counts: every prompt costs the same
        mean = self.token_sum[:n_p] / self.token_rows[:n_p]
        top = mean.max()
        if top <= 0:
            raise LogFormatError(f"{origin}: every token count is 0, so no cost can be derived")
        return cost_scale * mean / top

    def _split(self, test_fraction: float, seed: int, origin: str) -> np.ndarray | None:
        n_q = len(self.queries)
        if self.any_split:
            split = self.split[:n_q]
            if np.any(split < 0):
                missing = self.queries.values[int(np.flatnonzero(split < 0)[0])]
                raise LogFormatError(f"{origin}: some completions give a 'split' but query {missing!r} has none; "
                                     "give it for every query or none")
            return split.astype(np.uint8)
        if not 0.0 <= test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction!r}")
        if test_fraction == 0.0:
            return None
        n_test = int(round(test_fraction * n_q))
        if n_test < 1 or n_test >= n_q:
            raise LogFormatError(f"{origin}: test_fraction {test_fraction} of its {n_q} queries leaves no train or "
                                 "no test query; use --test-fraction 0 (no stored split) or give more queries")
        split = np.full(n_q, TRAIN, dtype=np.uint8)
        split[derive_rng(seed, SPLIT_KEY).permutation(n_q)[:n_test]] = TEST
        return split


def bon_contexts(n_objectives: int) -> tuple[np.ndarray, tuple[str, ...], np.ndarray]:
    """The paper's 27 weight triples for two objectives; for K != 2, equal weights 1/K at each cost weight."""
    if n_objectives == 2:
        return bon_grid_contexts()
    weights = np.array([[1.0 / n_objectives] * n_objectives + [-wc] for wc in COST_WEIGHTS_BON])
    names = tuple(f"equal,cost={wc:.1f}" for wc in COST_WEIGHTS_BON)
    return weights, names, np.full(len(names), 1.0 / len(names))


@dataclass(frozen=True)
class ContextSet:
    """User contexts for a built table: weights (C, K + 1) with the cost weight last (<= 0), names, probabilities,
    and where they came from (said in the table's ``contexts_source``)."""

    weights: np.ndarray
    names: tuple[str, ...]
    probs: np.ndarray
    source: str

    @property
    def n_objectives(self) -> int:
        """K: the objective weights per context."""
        return int(self.weights.shape[1] - 1)


#: Fields of one context in a contexts file, as the policy file names them.
CONTEXT_FIELDS = ("name", "objective_weights", "cost_weight", "probability")


def parse_contexts(doc: Any, where: str) -> ContextSet:
    """The contexts of ``{"contexts": [{"name", "objective_weights", "cost_weight", "probability"}, ...]}``.

    Names distinct and non-empty, the same number (>= 1) of finite objective weights for every context,
    a finite cost weight <= 0, probabilities >= 0 summing to 1 (to within 1e-9). ``LogFormatError`` names the
    field and the value otherwise.
    """
    if not isinstance(doc, dict) or set(doc) != {"contexts"} or not isinstance(doc["contexts"], list):
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise LogFormatError(f"{where}: expected one key 'contexts' holding a list of contexts, got {got}")
    items = doc["contexts"]
    if not items:
        raise LogFormatError(f"{where}: 'contexts' is empty; give at least one context")
    weights: list[list[float]] = []
    names: list[str] = []
    probs: list[float] = []
    for i, item in enumerate(items):
        at = f"{where}: contexts[{i}]"
        if not isinstance(item, dict):
            raise LogFormatError(f"{at} must be an object with fields {list(CONTEXT_FIELDS)}, got {item!r}")
        if set(item) != set(CONTEXT_FIELDS):
            missing, extra = sorted(set(CONTEXT_FIELDS) - set(item)), sorted(set(item) - set(CONTEXT_FIELDS))
            raise LogFormatError(f"{at}: expected exactly the fields {list(CONTEXT_FIELDS)}"
                                 + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else ""))
        name, ow, wc, prob = (item[k] for k in CONTEXT_FIELDS)
        if not isinstance(name, str) or not name.strip():
            raise LogFormatError(f"{at}.name must be a non-empty string, got {name!r}")
        if name in names:
            raise LogFormatError(f"{at}.name repeats context name {name!r}")
        if not isinstance(ow, list) or not ow or not all(_finite_number(w) for w in ow):
            raise LogFormatError(f"{at}.objective_weights must be a non-empty list of finite numbers, got {ow!r}")
        if weights and len(ow) != len(weights[0]) - 1:
            raise LogFormatError(f"{at}.objective_weights has {len(ow)} weights, contexts[0] has "
                                 f"{len(weights[0]) - 1}: every context weighs the same objectives")
        if not _finite_number(wc) or wc > 0:
            raise LogFormatError(f"{at}.cost_weight must be a finite number <= 0 (cost counts against utility), "
                                 f"got {wc!r}")
        if not _finite_number(prob) or prob < 0:
            raise LogFormatError(f"{at}.probability must be a finite number >= 0, got {prob!r}")
        weights.append([float(w) + 0.0 for w in ow] + [float(wc) + 0.0])
        names.append(name)
        probs.append(float(prob))
    total = math.fsum(probs)
    if abs(total - 1.0) > 1e-9:
        raise LogFormatError(f"{where}: the context probabilities sum to {total!r}, expected 1")
    return ContextSet(np.array(weights, dtype=np.float64), tuple(names), np.array(probs, dtype=np.float64),
                      f"the contexts file {where}")


def load_contexts(path: str | os.PathLike[str]) -> ContextSet:
    """A contexts file (JSON, or TOML for a ``.toml`` suffix) as ``parse_contexts`` reads it."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LogFormatError(f"cannot read contexts file {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
        if path.suffix.lower() == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # Python 3.10: the same parser, published as tomli
                import tomli as tomllib

            doc: Any = tomllib.loads(text)
        else:
            doc = json.loads(text, parse_constant=lambda c: float("nan"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        kind = "TOML" if path.suffix.lower() == ".toml" else "JSON"
        raise LogFormatError(f"{path}: not a valid {kind} contexts file ({str(exc)[:200]})") from None
    return parse_contexts(doc, path.name)


def describe_contexts(weights: np.ndarray, probs: np.ndarray) -> str:
    """``C contexts, K objectives, cost weights {...}, uniform|not uniform``: a one-line account of a context set."""
    k = weights.shape[1] - 1
    uniform = "uniform" if np.allclose(probs, probs[0], rtol=0, atol=1e-12) else "not uniform"
    costs = ", ".join(f"{0.0 - c:g}" for c in sorted(set(weights[:, -1].tolist()), reverse=True))
    return f"{weights.shape[0]} contexts over {k} objective{'s' if k != 1 else ''}, cost weights {costs}, {uniform}"


# ---- quantile bins ---------------------------------------------------------------------------------------


def quantile_binning(make_batches: Callable[[], Iterator[tuple[SampleBatch, Sequence[str]]]], bins: int) -> Binning:
    """``bins`` bins per objective with edges at its score quantiles, found in two streamed passes.

    Pass one finds each objective's range, pass two its histogram over ``QUANTILE_CELLS`` equal cells;
    the inner edges are the cell boundaries where the cumulative share first reaches 1/bins, 2/bins, ...
    (so a quantile is placed to within one cell, range / 4096). Edges that coincide (many equal scores)
    merge, giving fewer bins. A bin's atom value is the mean score of its cells (each cell at its centre,
    weighted by its count): integer counts, so the same whatever the batches.
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 2:
        raise ValueError(f"quantile bins must be an integer >= 2, got {bins!r}")
    lo: np.ndarray | None = None
    hi: np.ndarray | None = None
    for batch, _ in make_batches():
        if batch.scores is None or len(batch) == 0:
            continue
        blo, bhi = batch.scores.min(axis=0), batch.scores.max(axis=0)
        lo = blo if lo is None else np.minimum(lo, blo)
        hi = bhi if hi is None else np.maximum(hi, bhi)
    if lo is None or hi is None:
        raise LogFormatError("no scores to place quantile bins on")
    width = np.where(hi > lo, (hi - lo) / QUANTILE_CELLS, 1.0)
    hist = np.zeros((lo.size, QUANTILE_CELLS), dtype=np.int64)
    for batch, _ in make_batches():
        if batch.scores is None or len(batch) == 0:
            continue
        cell = np.clip(((batch.scores - lo) / width).astype(np.int64), 0, QUANTILE_CELLS - 1)
        for k in range(lo.size):
            hist[k] += np.bincount(cell[:, k], minlength=QUANTILE_CELLS)
    edges, values = [], []
    for k in range(lo.size):
        cum = np.cumsum(hist[k])
        targets = cum[-1] * np.arange(1, bins) / bins
        cells = np.searchsorted(cum, targets, side="left") + 1  # the boundary after the cell reaching the target
        cells = np.unique(cells[cells < QUANTILE_CELLS])
        edges.append(lo[k] + cells * width[k])
        bin_of_cell = np.searchsorted(cells, np.arange(QUANTILE_CELLS), side="right")
        centre = lo[k] + (np.arange(QUANTILE_CELLS) + 0.5) * width[k]
        mass = np.bincount(bin_of_cell, weights=hist[k], minlength=cells.size + 1)
        total = np.bincount(bin_of_cell, weights=hist[k] * centre, minlength=cells.size + 1)
        middle = np.bincount(bin_of_cell, weights=centre, minlength=cells.size + 1) / np.bincount(
            bin_of_cell, minlength=cells.size + 1)
        values.append(np.where(mass > 0, total / np.maximum(mass, 1), middle))
    return Binning(grid=None, edges=tuple(edges), values=tuple(values))


# ---- completion logs (docs/log-format.md) ----------------------------------------------------------------


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


def answer_text(value: Any, key: str, where: str, allow_null: bool) -> str | None:
    """An answer as compared: trimmed text, integers and integral floats alike (``7``, ``7.0``, ``"7"``); None = no answer."""
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


def _log_batches(path: Path, aggregator: str, batch_rows: int) -> Iterator[tuple[SampleBatch, Sequence[str]]]:
    """Batches of a completion log (docs/log-format.md), each line checked; errors name the line."""
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise LogFormatError(f"cannot read log {path}: {exc}") from exc
    names: tuple[str, ...] = ()
    cols: dict[str, list[Any]] = {}

    def flush() -> tuple[SampleBatch, Sequence[str]]:
        batch = SampleBatch(
            origin=str(path), rows=np.asarray(cols["line"], dtype=np.int64), prompts=codes_of(cols["prompt"]),
            queries=codes_of(cols["query"]), tokens=np.asarray(cols["tokens"], dtype=np.float64),
            splits=codes_of(cols["split"]) if any(s is not None for s in cols["split"]) else None)
        if aggregator == "mv":
            batch.answers, batch.golds = codes_of(cols["answer"]), codes_of(cols["gold"])
        else:
            batch.scores = np.asarray(cols["scores"], dtype=np.float64).reshape(len(cols["line"]), len(names))
        return batch, names

    with handle:
        for lineno, where, rec in jsonl_objects(handle, path, LogFormatError):
            if not cols:
                cols = {k: [] for k in ("line", "prompt", "query", "tokens", "answer", "gold", "scores", "split")}
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
                cols["gold"].append(answer_text(rec["gold"], "gold", where, allow_null=False))
                cols["answer"].append(answer_text(rec["answer"], "answer", where, allow_null=True))
            else:
                names = _scores(rec, names, cols["scores"], where)
            split = rec.get("split")
            if split is not None and split not in ("train", "test"):
                raise LogFormatError(f"{where}: field 'split' must be 'train' or 'test', got {split!r}")
            cols["split"].append(split)
            cols["prompt"].append(_ident(rec["prompt"], "prompt", where))
            cols["query"].append(query)
            cols["tokens"].append(float(tokens))
            cols["line"].append(lineno)
            if len(cols["line"]) >= batch_rows:
                yield flush()
                cols = {}
    if cols:
        yield flush()


def _scores(rec: dict[str, Any], names: tuple[str, ...], out: list[float], where: str) -> tuple[str, ...]:
    scores = rec.get("scores")
    if not isinstance(scores, dict) or not scores:
        raise LogFormatError(f"{where}: a best-of-N log line needs field 'scores', an object of named objective scores")
    got = tuple(str(k) for k in scores)
    if not names:
        names = got
    elif set(got) != set(names):
        raise LogFormatError(f"{where}: objectives {sorted(got)} differ from {sorted(names)} on the first line")
    for name in names:
        v = scores[name]
        if not _finite_number(v):
            raise LogFormatError(f"{where}: score {name!r} must be a finite number, got {v!r}")
        out.append(float(v))
    return names


# ---- building ------------------------------------------------------------------------------------------


@dataclass
class BuildOptions:
    """What every build takes besides its samples (the CLI's --n-max, --cost-scale, ...)."""

    task: str | None = None
    n_max: int = 32
    cost_scale: float = DEFAULT_COST_SCALE
    test_fraction: float = 0.2
    seed: int = 0
    top_k: int = 4  # mv
    grid: float | None = 0.5  # bon; None = exact vectors
    quantile_bins: int | None = None  # bon; overrides grid
    contexts: ContextSet | None = None  # None: the paper's (see ``bon_contexts``, ``mv_cost_contexts``)
    progress: bool | None = None  # a progress bar past PROGRESS_AFTER seconds; None: on a terminal only
    extra_attrs: dict[str, Any] = field(default_factory=dict)


#: Seconds a build runs before it shows progress (on a terminal: a tqdm bar; elsewhere a line every 5 s).
PROGRESS_AFTER = 2.0


def _with_progress(batches: Iterator[tuple[SampleBatch, Sequence[str]]], total: int | None, passes: int, done: int,
                   state: dict[str, Any], bar: bool | None) -> Iterator[tuple[SampleBatch, Sequence[str]]]:
    """``batches``, reporting the samples counted once the build has run ``PROGRESS_AFTER`` seconds (total known)."""
    import time

    from iapo_gym.progress import Progress

    for item in batches:
        yield item
        state["done"] = state.get("done", done) + len(item[0])
        if total is None or bar is False:
            continue
        if state.get("progress") is None and time.monotonic() - state["start"] >= PROGRESS_AFTER:
            state["progress"] = Progress(total * passes, bar=bar, unit="samples", initial=0)
            state["progress"].update(state["done"], "reading")
        elif state.get("progress") is not None:
            state["progress"].update(len(item[0]), f"pass {done // max(total, 1) + 1} of {passes}")


def build_from_batches(make_batches: Callable[[], Iterator[tuple[SampleBatch, Sequence[str]]]], aggregator: str,
                       options: BuildOptions, *, default_task: str, source: str, how: str,
                       max_bytes: int = MAX_TABLE_BYTES, cost_from: str = "token counts",
                       total_samples: int | None = None) -> OutcomeTable:
    """The table of a stream of sample batches (``make_batches`` is called once, or three times for quantile bins).

    ``cost_from`` says what the cost signal is (recorded as the table's ``cost_source``); ``total_samples``,
    when known, lets a long build show its progress.
    """
    import time

    passes = 3 if aggregator == "bon" and options.quantile_bins is not None else 1
    state: dict[str, Any] = {"start": time.monotonic(), "calls": 0}

    def tracked() -> Iterator[tuple[SampleBatch, Sequence[str]]]:
        done = state["calls"] * (total_samples or 0)
        state["calls"] += 1
        return _with_progress(make_batches(), total_samples, passes, done, state, options.progress)

    binning = None
    try:
        if aggregator == "bon":
            if options.quantile_bins is not None:
                binning = quantile_binning(tracked, options.quantile_bins)
            else:
                if options.grid is not None and not (math.isfinite(options.grid) and options.grid > 0):
                    raise ValueError(f"grid must be a number > 0 or None (no binning), got {options.grid!r}")
                binning = Binning(grid=options.grid)
        acc = SampleAccumulator(aggregator, binning=binning, max_bytes=max_bytes)
        for batch, names in tracked():
            acc.add(batch, names)
    finally:
        if state.get("progress") is not None:
            state["progress"].close()
    if aggregator == "mv":
        how = f"{how}; mv, top {options.top_k} answers + other"
    else:
        assert binning is not None
        how = f"{how}; bon, {binning.describe()}"
    attrs = {"source": source, "license": "as the samples' owner decides",
             "build": f"iapo_gym.data.build ({how}, cost scale {options.cost_scale}"
                      f"{'' if acc.has_tokens else ', no token counts: equal costs'})",
             "cost_source": (f"{cost_from}: mean per completion of each prompt, scaled so the largest is "
                             f"{options.cost_scale:g}") if acc.has_tokens else
             f"none given: every prompt costs {options.cost_scale:g}",
             **options.extra_attrs}
    try:
        return acc.finish(options.task or default_task, n_max=options.n_max, top_k=options.top_k,
                          cost_scale=options.cost_scale, test_fraction=options.test_fraction, seed=options.seed,
                          attrs=attrs, origin=source, contexts=options.contexts)
    except TableError as exc:  # e.g. token counts so large that the costs overflow
        raise LogFormatError(f"{source}: the table built from these samples is invalid: {exc}") from None


def build_log_table(path: str | os.PathLike[str], aggregator: str, options: BuildOptions,
                    batch_rows: int = DEFAULT_BATCH_ROWS) -> OutcomeTable:
    """A table from a completion log (docs/log-format.md), read in batches of ``batch_rows`` lines."""
    if aggregator not in ("mv", "bon"):
        raise ValueError(f"aggregator must be 'mv' or 'bon', got {aggregator!r}")
    path = Path(path)
    return build_from_batches(lambda: _log_batches(path, aggregator, batch_rows), aggregator, options,
                              default_task=path.stem, source=f"completion log {path.name}", how="completion log",
                              cost_from="field 'tokens'")


def build_mv_table(path: str | os.PathLike[str], task: str | None = None, top_k: int = 4, n_max: int = 32,
                   cost_scale: float = DEFAULT_COST_SCALE, test_fraction: float = 0.2, seed: int = 0) -> OutcomeTable:
    """A majority-vote table from a log: per query the ``top_k`` most frequent answers (always including gold) + "other"."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    return build_log_table(path, "mv", BuildOptions(task=task, top_k=top_k, n_max=n_max, cost_scale=cost_scale,
                                                    test_fraction=test_fraction, seed=seed))


def build_bon_table(path: str | os.PathLike[str], task: str | None = None, grid: float | None = 0.5, n_max: int = 32,
                    cost_scale: float = DEFAULT_COST_SCALE, test_fraction: float = 0.2, seed: int = 0,
                    quantile_bins: int | None = None) -> OutcomeTable:
    """A Best-of-N table from a log: the empirical distribution of objective vectors, binned on ``grid`` if given
    (or in ``quantile_bins`` bins per objective)."""
    return build_log_table(path, "bon", BuildOptions(task=task, grid=grid, quantile_bins=quantile_bins, n_max=n_max,
                                                     cost_scale=cost_scale, test_fraction=test_fraction, seed=seed))


def build_table(path: str | os.PathLike[str], aggregator: str, **options: Any) -> OutcomeTable:
    """``build_mv_table`` or ``build_bon_table`` by ``aggregator``."""
    if aggregator not in ("mv", "bon"):
        raise ValueError(f"aggregator must be 'mv' or 'bon', got {aggregator!r}")
    build = build_mv_table if aggregator == "mv" else build_bon_table
    return build(path, **options)
