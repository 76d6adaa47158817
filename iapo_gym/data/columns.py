"""Columnar sample sets (Parquet, Arrow IPC, CSV, JSON lines) with one row per sample, read through pyarrow.

Rows are streamed in record batches of at most ``batch_rows`` rows; each batch is checked and handed
to ``iapo_gym.data.build.SampleAccumulator``, so a file of millions of rows builds in bounded memory.
The column mapping for the two common shapes is in ``docs/data.md``. Needs ``pyarrow`` (extra
``[samples]``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from iapo_gym.data.build import (
    DEFAULT_BATCH_ROWS,
    BuildOptions,
    Codes,
    LogFormatError,
    SampleBatch,
    answer_digests,
    answer_text,
    build_from_batches,
)
from iapo_gym.tables import OutcomeTable

if TYPE_CHECKING:
    import pyarrow as pa

#: File suffixes read as each columnar format.
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow",
           ".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}
#: Bytes of text per read block of CSV and JSON lines (about a batch of short rows).
TEXT_BLOCK_BYTES = 4 << 20


#: The documented naming pattern of Best-of-N score columns taken without --score-col: ``score_<objective>``.
SCORE_PREFIX = "score_"
#: Samples per row assumed when reading a list-column file whose metadata does not say (rows read at a time).
LIST_ROWS_GUESS = 256


@dataclass(frozen=True)
class ColumnMap:
    """Which column holds what. ``sample``, ``tokens`` and ``split`` are optional: used when present ("" = none).

    Majority vote reads ``answer`` and ``gold``, or ``correct`` (a boolean or 0/1 column: each sample is
    the gold answer or one wrong answer). Best-of-N reads the ``scores`` columns, one objective each
    (default: the columns named ``score_<objective>``; no other column is ever taken as an objective).
    In the list shape (one row per (prompt, query) with a list of samples) the per-sample columns
    (answer, correct, scores, tokens, sample) hold a list per row; one score column holding a list of
    score lists per row gives one objective per position, named by ``objectives`` (default
    ``<column>[0]``, ``<column>[1]``, ...).
    """

    prompt: str = "prompt"
    query: str = "query"
    sample: str = "sample"
    answer: str = "answer"
    gold: str = "gold"
    correct: str | None = None
    scores: tuple[str, ...] = ()
    tokens: str = "tokens"
    split: str = "split"
    objectives: tuple[str, ...] = ()


def source_format(source: str | os.PathLike[str], fmt: str = "auto") -> str:
    """``log``, ``columns`` or ``lm-eval``: ``fmt`` unless "auto", else by the source: a folder holding a
    ``results_*.json`` (or no Parquet file) or a ``results_*.json`` is an lm-eval run; another folder, or a glob,
    Parquet shards; ``.jsonl`` / ``.json`` / ``.ndjson`` a completion log; another known suffix a sample set."""
    if fmt != "auto":
        return str(fmt)
    path = Path(source)
    if path.is_dir():
        if any(path.rglob("results_*.json")) or not any(path.rglob("*.parquet")):
            return "lm-eval"
        return "columns"
    if not path.exists() and any(ch in str(source) for ch in "*?["):
        return "columns"
    if path.name.startswith("results_") and path.suffix == ".json":
        return "lm-eval"
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        return "log"
    if path.suffix.lower() in FORMATS:
        return "columns"
    raise ValueError(f"{source}: cannot tell its format from its name; give --format log, columns or lm-eval")


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise LogFormatError("reading Parquet, Arrow, CSV or JSON-lines sample sets needs pyarrow: "
                             "pip install \"iapo-gym[samples]\"") from None
    return pyarrow


def sample_format(path: str | os.PathLike[str]) -> str:
    """The columnar format of ``path`` by its suffix; ``LogFormatError`` for an unknown one."""
    fmt = FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise LogFormatError(f"{path}: unknown sample-set format {Path(path).suffix!r}; expected one of "
                             f"{', '.join(sorted(FORMATS))}")
    return fmt


def record_batches(path: Path, fmt: str, columns: Sequence[str] | None, batch_rows: int,
                   text_columns: Sequence[str] = ()) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The file's schema and its record batches of at most ``batch_rows`` rows (only ``columns`` when given).

    A CSV file's ``text_columns`` are read as text, whatever they look like (ids and answers stay as written).
    """
    pa = _pyarrow()
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(path, pre_buffer=False)  # pre-buffering keeps every column chunk read so far
            return pf.schema_arrow, pf.iter_batches(batch_size=batch_rows, columns=list(columns) if columns else None)
        if fmt == "arrow":
            source = pa.memory_map(str(path))
            try:
                reader = pa.ipc.open_file(source)
                batches: Iterator[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
            return reader.schema, _sliced(batches, columns, batch_rows)
        if fmt in ("csv", "tsv"):
            import pyarrow.csv as pcsv

            convert = pcsv.ConvertOptions(column_types={c: pa.string() for c in text_columns},
                                          include_columns=list(columns) if columns else None,
                                          strings_can_be_null=True)
            reader = pcsv.open_csv(path, read_options=pcsv.ReadOptions(block_size=TEXT_BLOCK_BYTES),
                                   parse_options=pcsv.ParseOptions(delimiter="\t" if fmt == "tsv" else ","),
                                   convert_options=convert)
            return reader.schema, _sliced(iter(reader), columns, batch_rows)
        import pyarrow.json as pjson

        reader = pjson.open_json(path, read_options=pjson.ReadOptions(block_size=TEXT_BLOCK_BYTES))
        return reader.schema, _sliced(iter(reader), columns, batch_rows)
    except (OSError, pa.ArrowException) as exc:
        raise LogFormatError(f"{path}: cannot read it as {fmt}: {exc}") from None


def _sliced(batches: Iterator[pa.RecordBatch], columns: Sequence[str] | None,
            batch_rows: int) -> Iterator[pa.RecordBatch]:
    """Record batches cut to at most ``batch_rows`` rows (zero-copy slices), only ``columns`` when given."""
    for batch in batches:
        if columns:
            batch = batch.select(list(columns))
        for start in range(0, batch.num_rows, batch_rows):
            yield batch.slice(start, batch_rows)


# ---- one arrow column as the accumulator's arrays -----------------------------------------------------


def _first_null(col: pa.Array) -> int | None:
    if col.null_count == 0:
        return None
    import pyarrow.compute as pc

    return int(np.flatnonzero(pc.is_null(col).to_numpy(zero_copy_only=False))[0])


def _is_list(t: pa.DataType) -> bool:
    pa = _pyarrow()
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))


def _is_number(t: pa.DataType) -> bool:
    pa = _pyarrow()
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _is_scalar_value(t: pa.DataType) -> bool:
    """Text, a number, a boolean or null: what an id or an answer may be (dictionary-encoded or not)."""
    pa = _pyarrow()
    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t) or _is_number(t)
                or getattr(pa.types, "is_string_view", lambda _: False)(t))


def _categorical(col: pa.Array, name: str, norm: Callable[[Any, str], str | None], at: Callable[[int], str],
                 expected: str = "text or numbers") -> Codes:
    """Distinct normalized values of a column (in order of first appearance) and each row's index (None: -1)."""
    pa = _pyarrow()
    if not _is_scalar_value(col.type):
        raise LogFormatError(f"{at(0)}: column {name!r} holds {col.type}, expected {expected}")
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    encoded = col.dictionary_encode()
    raw = encoded.dictionary.to_pylist()
    idx = encoded.indices.to_numpy(zero_copy_only=False)
    idx = np.where(np.isnan(idx), -1, idx).astype(np.int64) if idx.dtype.kind == "f" else idx.astype(np.int64)
    first = np.full(len(raw), -1, dtype=np.int64)
    valid = np.flatnonzero(idx >= 0)
    uniq, pos = np.unique(idx[valid], return_index=True)
    first[uniq] = valid[pos]
    values: dict[str, int] = {}
    remap = np.empty(len(raw) + 1, dtype=np.int64)
    remap[-1] = -1
    for j, v in enumerate(raw):
        text = norm(v, at(int(first[j])))
        remap[j] = -1 if text is None else values.setdefault(text, len(values))
    return list(values), remap[idx]


#: The characters ``str.strip()`` removes (Unicode whitespace): answers are trimmed alike in every reader.
WHITESPACE = "".join(chr(c) for c in range(0x3001) if chr(c).isspace())


def _answer_digests(col: pa.Array, name: str, at: Callable[[int], str]) -> Codes:
    """A text column of answers as their digests (``iapo_gym.data.build.answer_digests``) and each row's index:
    trimmed and deduplicated by pyarrow, each distinct answer hashed from the Arrow buffer, so a batch of free
    text makes no Python string per answer. Empty or null: no answer (-1). Other column types: ``_categorical``."""
    import pyarrow.compute as pc

    pa = _pyarrow()
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        return _categorical(col, name, lambda v, w: answer_text(v, name, w, allow_null=True), at,
                            "text or numbers per sample, or a list of them per row")
    encoded = pc.utf8_trim(col, characters=WHITESPACE).dictionary_encode()
    distinct = encoded.dictionary
    idx = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    if len(distinct) == 0:
        return np.empty(0, dtype="S16"), idx
    wide = pa.types.is_large_string(distinct.type)
    ends = np.frombuffer(distinct.buffers()[1], dtype=np.int64 if wide else np.int32)[
        distinct.offset:distinct.offset + len(distinct) + 1]
    empty = np.flatnonzero(ends[1:] == ends[:-1])  # "" (after trimming): no answer
    keep = np.flatnonzero(ends[1:] != ends[:-1])
    if empty.size:
        remap = np.full(len(distinct) + 1, -1, dtype=np.int64)
        remap[keep] = np.arange(keep.size)
        idx = remap[idx]
    data = memoryview(distinct.buffers()[2] or b"")
    starts, stops = ends[:-1][keep].tolist(), ends[1:][keep].tolist()
    return answer_digests(data[a:b] for a, b in zip(starts, stops, strict=True)), idx


def _ident(value: Any, where: str, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise LogFormatError(f"{where}: column {name!r} must hold strings or integers, got {value!r}")
    text = str(value).strip()
    if not text:
        raise LogFormatError(f"{where}: column {name!r} is empty")
    return text


def _numbers(col: pa.Array, name: str, at: Callable[[int], str], role: str = "numbers",
             declared: pa.DataType | None = None) -> np.ndarray:
    """A numeric or boolean column as finite float64 (booleans 0/1); a wrong type, a null or a non-finite value
    names the column and the row (``declared``: the column's type in the file, when ``col`` is its flattened list)."""
    pa = _pyarrow()
    if not _is_number(col.type):
        raise LogFormatError(f"{at(0)}: column {name!r} holds {declared or col.type}, expected {role}")
    null = _first_null(col)
    if null is not None:
        raise LogFormatError(f"{at(null)}: column {name!r} is empty (null)")
    values = col.cast(pa.float64()).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise LogFormatError(f"{at(int(bad[0]))}: column {name!r} must be finite, got {values[bad[0]]!r}")
    return values


@dataclass
class _Plan:
    """The columns a build reads, resolved against the schema, and the shape: ``lists`` are the per-sample
    columns holding a list per row (empty: one row per sample)."""

    read: list[str]
    scores: tuple[str, ...]
    sample: str | None
    tokens: str | None
    split: str | None
    lists: tuple[str, ...] = ()
    nested_scores: str | None = None  # one column holding a list of score lists per row

    @property
    def text(self) -> list[str]:
        """Columns a CSV file must read as text (ids and answers stay as written)."""
        return [c for c in self.read if c not in self.scores and c not in (self.sample, self.tokens)]


def _plan(schema: pa.Schema, mapping: ColumnMap, aggregator: str, where: str) -> _Plan:
    have = list(schema.names)

    def need(column: str, role: str) -> str:
        if column not in have:
            raise LogFormatError(f"{where}: no column {column!r} ({role}); the columns are {have}")
        return column

    def optional(column: str) -> str | None:
        return column if column and column in have else None

    read = [need(mapping.prompt, "prompt"), need(mapping.query, "query")]
    sample, tokens, split = optional(mapping.sample), optional(mapping.tokens), optional(mapping.split)
    scores: tuple[str, ...] = ()
    per_sample: list[str] = []
    per_row = [mapping.prompt, mapping.query]
    if aggregator == "mv":
        if mapping.correct is not None:
            per_sample.append(need(mapping.correct, "correct"))
        else:
            per_sample.append(need(mapping.answer, "answer"))
            per_row.append(need(mapping.gold, "gold answer"))
    else:
        if mapping.scores:
            scores = tuple(need(c, "score") for c in mapping.scores)
        else:
            scores = tuple(c for c in have if c.startswith(SCORE_PREFIX))
            if not scores:
                numeric = [f.name for f in schema if f.name not in (mapping.prompt, mapping.query, sample, tokens)
                           and (_is_number(f.type) or _is_list(f.type))]
                raise LogFormatError(f"{where}: Best-of-N needs its objectives named: give --score-col NAME for each "
                                     f"(repeat), or name the columns {SCORE_PREFIX}<objective>; no column is taken as "
                                     f"an objective by its type (candidates: {numeric}; the columns are {have})")
        per_sample += list(scores)
    if split is not None:
        per_row.append(split)
    per_sample += [c for c in (tokens, sample) if c is not None]
    read += per_sample + per_row[2:]
    lists = tuple(c for c in dict.fromkeys(per_sample) if _is_list(schema.field(c).type))
    for c in per_row:
        if _is_list(schema.field(c).type):
            raise LogFormatError(f"{where}: column {c!r} holds {schema.field(c).type}, expected one value per row "
                                 "(a prompt, query, gold answer or split is the same for every sample of a row)")
    nested = None
    if lists:
        scalars = [c for c in dict.fromkeys(per_sample) if c not in lists]
        if scalars:
            raise LogFormatError(f"{where}: the file mixes both shapes: column(s) {list(lists)} hold a list of samples "
                                 f"per row, column(s) {scalars} one value per row; give every per-sample column as a "
                                 "list (one row per (prompt, query)) or none (one row per sample)"
                                 + ("; a column you do not mean can be dropped with --tokens-col '' or "
                                    "--sample-col ''" if set(scalars) & {tokens, sample} else ""))
        nested = next((c for c in scores if _is_list(schema.field(c).type.value_type)), None)
        if nested is not None and len(scores) > 1:
            raise LogFormatError(f"{where}: column {nested!r} holds a list of score lists per row (one objective per "
                                 f"position); give it as the only --score-col, not with {[c for c in scores if c != nested]}")
    if mapping.objectives and nested is None:
        raise LogFormatError(f"{where}: objective names are for one column holding a list of score lists per row; "
                             "the objectives here are the score columns themselves")
    return _Plan(read=list(dict.fromkeys(read)), scores=scores, sample=sample, tokens=tokens, split=split,
                 lists=lists, nested_scores=nested)


def _list_lengths(rb: pa.RecordBatch, plan: _Plan, at: Callable[[int], str]) -> np.ndarray:
    """Samples per row of a list-shaped batch; every list column must give each row the same number."""
    import pyarrow.compute as pc

    lengths: np.ndarray | None = None
    for c in plan.lists:
        col = rb.column(c)
        null = _first_null(col)
        if null is not None:
            raise LogFormatError(f"{at(null)}: column {c!r} is null; a row holds a list of its samples")
        n = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
        if lengths is None:
            lengths, first = n, c
        elif np.any(n != lengths):
            i = int(np.flatnonzero(n != lengths)[0])
            raise LogFormatError(f"{at(i)}: column {c!r} lists {int(n[i])} samples, column {first!r} "
                                 f"{int(lengths[i])}; each list holds the same samples of the row")
    assert lengths is not None
    return lengths


def _to_batch(rb: pa.RecordBatch, row0: int, origin: str, mapping: ColumnMap, plan: _Plan,
              aggregator: str) -> tuple[SampleBatch, tuple[str, ...]]:
    """One record batch as checked sample arrays, with the objective names; errors name the data row (1-based)
    and, in the list shape, the item of its list (0-based)."""
    import pyarrow.compute as pc

    n_rows = rb.num_rows

    def at(i: int) -> str:
        return f"{origin}: row {row0 + i + 1}"

    parent: np.ndarray | None = None
    if plan.lists:
        lengths = _list_lengths(rb, plan, at)
        parent = pc.list_parent_indices(rb.column(plan.lists[0])).to_numpy(zero_copy_only=False).astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        position = np.arange(parent.size, dtype=np.int64) - starts[parent]

        def at_item(i: int) -> str:
            return f"{origin}: row {row0 + int(parent[i]) + 1}, list item {int(position[i])}"
    n = n_rows if parent is None else int(parent.size)

    def per_row(name: str) -> pa.Array:
        return rb.column(name)

    def per_sample(name: str) -> tuple[pa.Array, Callable[[int], str]]:
        col = rb.column(name)
        if parent is None:
            return col, at
        return pc.list_flatten(col), at_item

    def expand(codes: Codes) -> Codes:
        return codes if parent is None else (codes[0], codes[1][parent])

    def ident(column: str) -> Codes:
        null = _first_null(per_row(column))
        if null is not None:
            raise LogFormatError(f"{at(null)}: column {column!r} is empty (null)")
        return expand(_categorical(per_row(column), column, lambda v, w: _ident(v, w, column), at,
                                   "strings or integers"))

    rows = np.arange(row0 + 1, row0 + n_rows + 1, dtype=np.int64)
    batch = SampleBatch(origin=origin, rows=rows if parent is None else rows[parent],
                        prompts=ident(mapping.prompt), queries=ident(mapping.query), unit="row")
    if parent is not None:
        batch.items = position
    if plan.tokens is not None:
        col, where = per_sample(plan.tokens)
        tokens = _numbers(col, plan.tokens, where, "token counts (numbers >= 0)", rb.schema.field(plan.tokens).type)
        if np.any(tokens < 0):
            raise LogFormatError(f"{where(int(np.flatnonzero(tokens < 0)[0]))}: column {plan.tokens!r} must be >= 0")
        batch.tokens = tokens
    if parent is not None:
        batch.samples = position if plan.sample is None else None
    if plan.sample is not None:
        col, where = per_sample(plan.sample)
        samples = _numbers(col, plan.sample, where, "sample indices (integers)", rb.schema.field(plan.sample).type)
        if np.any(samples != np.round(samples)) or np.any(np.abs(samples) >= 2**20):
            i = int(np.flatnonzero((samples != np.round(samples)) | (np.abs(samples) >= 2**20))[0])
            raise LogFormatError(f"{where(i)}: column {plan.sample!r} must hold sample indices (integers below 2**20), "
                                 f"got {samples[i]!r}")
        batch.samples = samples.astype(np.int64)
    if plan.split is not None:
        batch.splits = expand(_categorical(per_row(plan.split), plan.split,
                                           lambda v, w: None if v is None else str(v).strip(), at, "'train' or 'test'"))
    names = plan.scores
    if aggregator == "mv":
        if mapping.correct is not None:
            col, where = per_sample(mapping.correct)
            correct = _numbers(col, mapping.correct, where, "true/false or 1/0 per sample (a boolean or numeric "
                               "column, or a list of them per row)", rb.schema.field(mapping.correct).type)
            if np.any((correct != 0) & (correct != 1)):
                i = int(np.flatnonzero((correct != 0) & (correct != 1))[0])
                raise LogFormatError(f"{where(i)}: column {mapping.correct!r} must be true/false or 1/0, "
                                     f"got {correct[i]!r}")
            batch.answers = (["correct", "wrong"], np.where(correct == 1, 0, 1).astype(np.int64))
            batch.golds = (["correct"], np.zeros(n, dtype=np.int64))
        else:
            col, where = per_sample(mapping.answer)
            declared = rb.schema.field(mapping.answer).type
            if not _is_scalar_value(col.type):
                raise LogFormatError(f"{where(0)}: column {mapping.answer!r} holds {col.type}, expected text or "
                                     "numbers per sample, or a list of them per row"
                                     + (f" (the column is {declared})" if parent is not None else ""))
            batch.answers = _answer_digests(col, mapping.answer, where)
            null = _first_null(per_row(mapping.gold))
            if null is not None:
                raise LogFormatError(f"{at(null)}: column {mapping.gold!r} is empty (null)")
            batch.golds = expand(_categorical(per_row(mapping.gold), mapping.gold,
                                              lambda v, w: answer_text(v, mapping.gold, w, allow_null=False), at,
                                              "text or numbers (one gold answer per row)"))
    elif plan.nested_scores is not None:
        c = plan.nested_scores
        col, where = per_sample(c)  # one score list per sample
        null = _first_null(col)
        if null is not None:
            raise LogFormatError(f"{where(null)}: column {c!r} holds null for a sample's score list")
        k = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
        if k.size and (k.min() != k.max() or k[0] < 1):
            i = int(np.flatnonzero(k != k[0])[0]) if k.min() != k.max() else 0
            raise LogFormatError(f"{where(i)}: column {c!r} gives {int(k[i])} scores for this sample and {int(k[0])} "
                                 "for the first; each sample's score list holds one score per objective")
        width = int(k[0]) if k.size else len(mapping.objectives)
        flat = _numbers(pc.list_flatten(col), c, lambda j: where(j // max(width, 1)), "numbers (a list of score lists "
                        "per row, one score per objective)", rb.schema.field(c).type)
        names = mapping.objectives or tuple(f"{c}[{j}]" for j in range(width))
        if len(names) != width:
            raise LogFormatError(f"{at(0)}: column {c!r} gives {width} scores per sample, the objective names are "
                                 f"{list(names)}")
        batch.scores = flat.reshape(n, width)
    else:
        columns = []
        for c in plan.scores:
            col, where = per_sample(c)
            columns.append(_numbers(col, c, where, "numbers (a Best-of-N score, one objective; booleans as 0/1)",
                                    rb.schema.field(c).type))
        batch.scores = np.column_stack(columns) if columns else None
    return batch, names


# ---- where record batches come from: a file, a folder or glob of Parquet shards, a table in memory -------


@dataclass
class Source:
    """Record batches of a sample set, with its schema, row count (when cheap to know) and how to name it.

    ``parts`` are (name, open) pairs: ``open(columns, rows, text_columns)`` gives that part's batches of
    at most ``rows`` rows; row numbers in errors restart in each part (a shard is named with its rows).
    """

    name: str
    kind: str
    schema: pa.Schema
    parts: list[tuple[str, Callable[[list[str], int, list[str]], Iterator[pa.RecordBatch]]]]
    rows: int | None = None
    leaf_counts: Callable[[str], int | None] | None = None


def _parquet_leaves(files: Sequence[Path]) -> Callable[[str], int | None]:
    """Values stored under a list column in the files' Parquet metadata (its items, for a list of scalars)."""
    import pyarrow.parquet as pq

    def count(column: str) -> int | None:
        total = 0
        for f in files:
            meta = pq.ParquetFile(f).metadata
            leaf = [j for j in range(meta.num_columns)
                    if meta.row_group(0).column(j).path_in_schema.split(".")[0] == column] if meta.num_row_groups else []
            if len(leaf) != 1:
                return None
            total += sum(meta.row_group(g).column(leaf[0]).num_values for g in range(meta.num_row_groups))
        return total

    return count


def file_source(path: Path, fmt: str) -> Source:
    """A single file (format by suffix)."""
    if not path.is_file():
        raise LogFormatError(f"no such sample set: {path}")
    schema, _ = record_batches(path, fmt, None, 1)
    rows = None
    leaves = None
    if fmt == "parquet":
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(path).metadata.num_rows
        leaves = _parquet_leaves([path])

    def open_(columns: list[str], n: int, text: list[str]) -> Iterator[pa.RecordBatch]:
        return record_batches(path, fmt, columns, n, text)[1]

    return Source(str(path), fmt, schema, [(str(path), open_)], rows, leaves)


def shards_source(spec: str | os.PathLike[str]) -> Source:
    """A folder (searched recursively) or a glob of Parquet shards, read one shard after another in path order
    (``pyarrow.dataset`` finds them and checks that their schemas agree)."""
    import glob as globbing

    arrow = _pyarrow()
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    text = str(spec)
    if Path(text).is_dir():
        files = sorted(p for p in Path(text).rglob("*") if p.is_file() and p.suffix.lower() in (".parquet", ".pq")
                       and not any(part.startswith((".", "_")) for part in p.relative_to(text).parts))
    else:
        files = sorted(Path(p) for p in globbing.glob(text, recursive=True) if Path(p).is_file())
    if not files:
        raise LogFormatError(f"{text}: no Parquet shards (*.parquet) found there")
    try:
        dataset = ds.dataset([str(f) for f in files], format="parquet")
        schema = dataset.schema
        for f in files:
            own = pq.read_schema(f)
            for name in own.names:
                if not own.field(name).type.equals(schema.field(name).type):
                    raise LogFormatError(f"{f}: column {name!r} holds {own.field(name).type}, the first shard "
                                         f"{files[0].name} {schema.field(name).type}; every shard needs one schema")
        rows = int(dataset.count_rows())
    except (OSError, arrow.ArrowException) as exc:
        raise LogFormatError(f"{text}: cannot read the shards as a Parquet dataset: {exc}") from None

    def opener(f: Path) -> Callable[[list[str], int, list[str]], Iterator[pa.RecordBatch]]:
        return lambda columns, n, _text: record_batches(f, "parquet", columns, n)[1]

    return Source(f"{text} ({len(files)} Parquet shards)", "parquet shards", schema,
                  [(str(f), opener(f)) for f in files], rows, _parquet_leaves(files))


def table_source(data: Any, name: str | None = None) -> Source:
    """A table in memory: a ``pyarrow.Table`` or ``RecordBatch``, a Hugging Face ``datasets.Dataset`` (through
    ``with_format("arrow")``, no copy of an unshuffled one), or anything with ``to_arrow()`` (e.g. polars)."""
    arrow = _pyarrow()
    kind = type(data).__name__
    if isinstance(data, arrow.RecordBatch):
        data = arrow.Table.from_batches([data])
    elif not isinstance(data, arrow.Table):
        if callable(getattr(data, "with_format", None)):
            data = data.with_format("arrow")[:]
        elif callable(getattr(data, "to_arrow", None)):
            data = data.to_arrow()
        if not isinstance(data, arrow.Table):
            raise TypeError(f"expected a path, a pyarrow Table, a datasets.Dataset or an object with to_arrow(), "
                            f"got {kind}")
    table = data
    import pyarrow.compute as pc

    def open_(columns: list[str], n: int, _text: list[str]) -> Iterator[pa.RecordBatch]:
        return iter(table.select(columns).to_batches(max_chunksize=n))

    def leaves(column: str) -> int | None:
        col = table.column(column)
        return int(pc.sum(pc.list_value_length(col)).as_py() or 0) if _is_list(col.type) else None

    label = name or f"{kind} in memory"
    return Source(label, kind, table.schema, [(label, open_)], table.num_rows, leaves)


def open_source(source: Any, fmt: str | None = None) -> Source:
    """The ``Source`` of a path (a file, a folder of Parquet shards, a glob) or of a table in memory."""
    if isinstance(source, Source):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir() or (not path.exists() and any(ch in str(source) for ch in "*?[")):
            return shards_source(source)
        return file_source(path, fmt or sample_format(path))
    return table_source(source)


def _rows_per_read(source: Source, plan: _Plan, batch_rows: int) -> int:
    """Rows to read at a time: ``batch_rows`` (one row per sample) or, in the list shape, about ``batch_rows``
    samples' worth of rows (from the Parquet metadata, else ``LIST_ROWS_GUESS`` samples per row)."""
    if not plan.lists:
        return batch_rows
    leaves = source.leaf_counts(plan.lists[0]) if source.leaf_counts else None
    if leaves and source.rows:
        return max(1, int(batch_rows * source.rows // max(leaves, 1)))
    return max(1, batch_rows // LIST_ROWS_GUESS)


def _by_samples(rb: pa.RecordBatch, plan: _Plan, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """A list-shaped record batch cut into slices of at most ``batch_rows`` samples (at least one row each)."""
    import pyarrow.compute as pc

    if not plan.lists or rb.num_rows == 0:
        yield rb
        return
    lengths = pc.fill_null(pc.list_value_length(rb.column(plan.lists[0])), 0).to_numpy(zero_copy_only=False)
    ends = np.cumsum(lengths)
    start = 0
    while start < rb.num_rows:
        base = ends[start - 1] if start else 0
        stop = max(start + 1, int(np.searchsorted(ends, base + batch_rows, side="right")))
        yield rb.slice(start, stop - start)
        start = stop


def column_batches(path: Any, aggregator: str, mapping: ColumnMap | None = None,
                   batch_rows: int = DEFAULT_BATCH_ROWS,
                   fmt: str | None = None) -> Iterator[tuple[SampleBatch, Sequence[str]]]:
    """The sample batches of a sample set (a file, format by suffix unless ``fmt``; a folder or glob of Parquet
    shards; a table in memory), with the objective names. A batch holds at most ``batch_rows`` samples."""
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
        raise ValueError(f"batch_rows must be an integer >= 1, got {batch_rows!r}")
    mapping = mapping or ColumnMap()
    source = open_source(path, fmt)
    plan = _plan(source.schema, mapping, aggregator, source.name)
    yield from _plan_batches(source, plan, mapping, aggregator, batch_rows)


def _plan_batches(source: Source, plan: _Plan, mapping: ColumnMap, aggregator: str,
                  batch_rows: int) -> Iterator[tuple[SampleBatch, Sequence[str]]]:
    pa = _pyarrow()
    per_read = _rows_per_read(source, plan, batch_rows)
    for name, open_ in source.parts:
        row0 = 0
        try:
            for rb in open_(plan.read, per_read, plan.text):
                for piece in _by_samples(rb, plan, batch_rows):
                    yield _to_batch(piece, row0, name, mapping, plan, aggregator)
                    row0 += piece.num_rows
        except pa.ArrowException as exc:  # a CSV or JSON block that does not parse, a corrupt Parquet page
            raise LogFormatError(f"{name}: unreadable after row {row0}: {exc}") from None


def describe_columns(plan: _Plan, mapping: ColumnMap, aggregator: str) -> str:
    """Which column gave what, for the table's provenance and the build's report."""
    roles = [f"prompt {mapping.prompt!r}", f"query {mapping.query!r}"]
    if aggregator == "mv":
        roles += [f"correct {mapping.correct!r}"] if mapping.correct else [f"answer {mapping.answer!r}",
                                                                          f"gold {mapping.gold!r}"]
    elif plan.nested_scores:
        roles.append(f"scores {plan.nested_scores!r} (a list of score lists per row)")
    else:
        roles.append("scores " + ", ".join(repr(c) for c in plan.scores))
    roles += [f"{r} {c!r}" for r, c in (("tokens", plan.tokens), ("sample", plan.sample), ("split", plan.split)) if c]
    shape = (f"one row per (prompt, query), samples listed in {', '.join(repr(c) for c in plan.lists)}"
             + ("" if plan.sample else ", sample index = list position")) if plan.lists else "one row per sample"
    return f"{shape}; " + ", ".join(roles)


def build_columns_table(path: Any, aggregator: str, options: BuildOptions | None = None,
                        mapping: ColumnMap | None = None, batch_rows: int = DEFAULT_BATCH_ROWS,
                        fmt: str | None = None) -> OutcomeTable:
    """An outcome table from a sample set, streamed in batches of at most ``batch_rows`` samples: a columnar file,
    a folder or glob of Parquet shards, or a table in memory (pyarrow, ``datasets.Dataset``)."""
    if aggregator not in ("mv", "bon"):
        raise ValueError(f"aggregator must be 'mv' or 'bon', got {aggregator!r}")
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
        raise ValueError(f"batch_rows must be an integer >= 1, got {batch_rows!r}")
    mapping = mapping or ColumnMap()
    source = open_source(path, fmt)
    plan = _plan(source.schema, mapping, aggregator, source.name)
    options = options or BuildOptions()
    if isinstance(path, (str, os.PathLike)):
        p = Path(path)
        task = p.stem if p.is_file() else (p.name if p.is_dir() else "samples")
        label = f"sample set {p.name}" if p.is_file() else f"sample set {source.name}"
    else:
        task, label = "samples", f"sample set: {source.name}"
    total = source.rows if not plan.lists else (source.leaf_counts(plan.lists[0]) if source.leaf_counts and
                                                plan.nested_scores != plan.lists[0] else None)
    options = replace(options, extra_attrs={"columns": describe_columns(plan, mapping, aggregator),
                                            **options.extra_attrs})
    return build_from_batches(lambda: _plan_batches(source, plan, mapping, aggregator, batch_rows), aggregator,
                              options, default_task=task, source=label, how=f"{source.kind} sample set",
                              cost_from=f"column {plan.tokens!r}" if plan.tokens else "token counts",
                              total_samples=total)
