"""Columnar sample sets (Parquet, Arrow IPC, CSV, JSON lines) with one row per sample, read through pyarrow.

Rows are streamed in record batches of at most ``batch_rows`` rows; each batch is checked and handed
to ``iapo_gym.data.build.SampleAccumulator``, so a file of millions of rows builds in bounded memory.
The column mapping for the two common shapes is in ``docs/data.md``. Needs ``pyarrow`` (extra
``[samples]``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from iapo_gym.data.build import (
    DEFAULT_BATCH_ROWS,
    BuildOptions,
    Codes,
    LogFormatError,
    SampleBatch,
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


@dataclass(frozen=True)
class ColumnMap:
    """Which column holds what. ``sample``, ``tokens`` and ``split`` are optional: used when present.

    Majority vote reads ``answer`` and ``gold``, or ``correct`` (a boolean or 0/1 column: each sample is
    the gold answer or one wrong answer). Best-of-N reads the ``scores`` columns, one objective each
    (default: every numeric or boolean column not mapped to anything else).
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


def _categorical(col: pa.Array, name: str, norm: Callable[[Any, str], str | None], at: Callable[[int], str]) -> Codes:
    """Distinct normalized values of a column (in order of first appearance) and each row's index (None: -1)."""
    pa = _pyarrow()
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


def _ident(value: Any, where: str, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise LogFormatError(f"{where}: column {name!r} must hold strings or integers, got {value!r}")
    text = str(value).strip()
    if not text:
        raise LogFormatError(f"{where}: column {name!r} is empty")
    return text


def _numbers(col: pa.Array, name: str, at: Callable[[int], str]) -> np.ndarray:
    """A numeric or boolean column as finite float64 (booleans 0/1); a null or non-finite value names its row."""
    pa = _pyarrow()
    null = _first_null(col)
    if null is not None:
        raise LogFormatError(f"{at(null)}: column {name!r} is empty (null)")
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type)):
        raise LogFormatError(f"{at(0)}: column {name!r} must hold numbers, it holds {col.type}")
    values = col.cast(pa.float64()).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise LogFormatError(f"{at(int(bad[0]))}: column {name!r} must be finite, got {values[bad[0]]!r}")
    return values


@dataclass
class _Plan:
    """The columns a build reads, resolved against the file's schema."""

    read: list[str]
    scores: tuple[str, ...]
    sample: str | None
    tokens: str | None
    split: str | None


def _plan(schema: pa.Schema, mapping: ColumnMap, aggregator: str, where: str) -> _Plan:
    pa = _pyarrow()
    have = list(schema.names)

    def need(column: str, role: str) -> str:
        if column not in have:
            raise LogFormatError(f"{where}: no column {column!r} ({role}); the columns are {have}")
        return column

    def optional(column: str) -> str | None:
        return column if column in have else None

    read = [need(mapping.prompt, "prompt"), need(mapping.query, "query")]
    sample, tokens, split = optional(mapping.sample), optional(mapping.tokens), optional(mapping.split)
    scores: tuple[str, ...] = ()
    if aggregator == "mv":
        if mapping.correct is not None:
            read.append(need(mapping.correct, "correct"))
        else:
            read += [need(mapping.answer, "answer"), need(mapping.gold, "gold answer")]
    else:
        taken = {mapping.prompt, mapping.query, mapping.sample, mapping.tokens, mapping.split}
        if mapping.scores:
            scores = tuple(need(c, "score") for c in mapping.scores)
        else:
            scores = tuple(f.name for f in schema if f.name not in taken and (
                pa.types.is_integer(f.type) or pa.types.is_floating(f.type) or pa.types.is_boolean(f.type)))
            if not scores:
                raise LogFormatError(f"{where}: no numeric score columns besides {sorted(taken & set(have))}; "
                                     f"name them with --score-col (the columns are {have})")
        read += list(scores)
    read += [c for c in (sample, tokens, split) if c is not None]
    return _Plan(read=list(dict.fromkeys(read)), scores=scores, sample=sample, tokens=tokens, split=split)


def _to_batch(rb: pa.RecordBatch, row0: int, origin: str, mapping: ColumnMap, plan: _Plan,
              aggregator: str) -> SampleBatch:
    """One record batch as checked sample arrays; errors name the data row (1-based)."""
    n = rb.num_rows

    def at(i: int) -> str:
        return f"{origin}: row {row0 + i + 1}"

    def col(name: str) -> pa.Array:
        return rb.column(name)

    def ident(column: str) -> Codes:
        null = _first_null(col(column))
        if null is not None:
            raise LogFormatError(f"{at(null)}: column {column!r} is empty (null)")
        return _categorical(col(column), column, lambda v, w: _ident(v, w, column), at)

    batch = SampleBatch(origin=origin, rows=np.arange(row0 + 1, row0 + n + 1, dtype=np.int64),
                        prompts=ident(mapping.prompt), queries=ident(mapping.query), unit="row")
    if plan.tokens is not None:
        tokens = _numbers(col(plan.tokens), plan.tokens, at)
        if np.any(tokens < 0):
            raise LogFormatError(f"{at(int(np.flatnonzero(tokens < 0)[0]))}: column {plan.tokens!r} must be >= 0")
        batch.tokens = tokens
    if plan.sample is not None:
        samples = _numbers(col(plan.sample), plan.sample, at)
        if np.any(samples != np.round(samples)) or np.any(np.abs(samples) >= 2**20):
            i = int(np.flatnonzero((samples != np.round(samples)) | (np.abs(samples) >= 2**20))[0])
            raise LogFormatError(f"{at(i)}: column {plan.sample!r} must hold sample indices (integers below 2**20), "
                                 f"got {samples[i]!r}")
        batch.samples = samples.astype(np.int64)
    if plan.split is not None:
        batch.splits = _categorical(col(plan.split), plan.split,
                                    lambda v, w: None if v is None else str(v).strip(), at)
    if aggregator == "mv":
        if mapping.correct is not None:
            correct = _numbers(col(mapping.correct), mapping.correct, at)
            if np.any((correct != 0) & (correct != 1)):
                i = int(np.flatnonzero((correct != 0) & (correct != 1))[0])
                raise LogFormatError(f"{at(i)}: column {mapping.correct!r} must be true/false or 1/0, got {correct[i]!r}")
            batch.answers = (["correct", "wrong"], np.where(correct == 1, 0, 1).astype(np.int64))
            batch.golds = (["correct"], np.zeros(n, dtype=np.int64))
        else:
            batch.answers = _categorical(col(mapping.answer), mapping.answer,
                                         lambda v, w: answer_text(v, mapping.answer, w, allow_null=True), at)
            null = _first_null(col(mapping.gold))
            if null is not None:
                raise LogFormatError(f"{at(null)}: column {mapping.gold!r} is empty (null)")
            batch.golds = _categorical(col(mapping.gold), mapping.gold,
                                       lambda v, w: answer_text(v, mapping.gold, w, allow_null=False), at)
    else:
        batch.scores = np.column_stack([_numbers(col(c), c, at) for c in plan.scores]) if plan.scores else None
    return batch


def column_batches(path: str | os.PathLike[str], aggregator: str, mapping: ColumnMap | None = None,
                   batch_rows: int = DEFAULT_BATCH_ROWS,
                   fmt: str | None = None) -> Iterator[tuple[SampleBatch, Sequence[str]]]:
    """The sample batches of a columnar file (format by suffix unless ``fmt``), with the objective names."""
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
        raise ValueError(f"batch_rows must be an integer >= 1, got {batch_rows!r}")
    path = Path(path)
    mapping = mapping or ColumnMap()
    fmt = fmt or sample_format(path)
    if not path.is_file():
        raise LogFormatError(f"no such sample set: {path}")
    schema, _ = record_batches(path, fmt, None, 1)
    plan = _plan(schema, mapping, aggregator, str(path))
    text = [c for c in (mapping.prompt, mapping.query, mapping.answer, mapping.gold, plan.split) if c in plan.read]
    _, batches = record_batches(path, fmt, plan.read, batch_rows, text)
    pa = _pyarrow()
    row0 = 0
    try:
        for rb in batches:
            yield _to_batch(rb, row0, str(path), mapping, plan, aggregator), plan.scores
            row0 += rb.num_rows
    except pa.ArrowException as exc:  # a CSV or JSON block that does not parse, a corrupt Parquet page
        raise LogFormatError(f"{path}: unreadable after row {row0}: {exc}") from None


def build_columns_table(path: str | os.PathLike[str], aggregator: str, options: BuildOptions | None = None,
                        mapping: ColumnMap | None = None, batch_rows: int = DEFAULT_BATCH_ROWS,
                        fmt: str | None = None) -> OutcomeTable:
    """An outcome table from a columnar sample set, streamed in batches of ``batch_rows`` rows."""
    if aggregator not in ("mv", "bon"):
        raise ValueError(f"aggregator must be 'mv' or 'bon', got {aggregator!r}")
    path = Path(path)
    fmt = fmt or sample_format(path)
    return build_from_batches(lambda: column_batches(path, aggregator, mapping, batch_rows, fmt), aggregator,
                              options or BuildOptions(), default_task=path.stem,
                              source=f"sample set {path.name}", how=f"{fmt} sample set")
