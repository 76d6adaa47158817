"""Data layer: finding, fetching, importing and loading the tables of every task.

``load_task_table(task)`` opens a task's table: a synthetic family's generated (and cached) instance,
or a data-backed task's file found by ``resolve_table``.

``resolve_table(spec)`` looks in ``$IAPO_GYM_DATA`` (a converted ``<name>.h5`` or the raw
release file), the repository's ``data/``, the user cache (tables, then verified release
files under ``<cache>/release``), and finally downloads the official file, verifies it and
converts it into the cache. Presence always means a verified file, never an existing folder.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from iapo_gym import paths
from iapo_gym.data.registry import RegistryError, ReleaseEntry, entry_for_task
from iapo_gym.exact import stored
from iapo_gym.paths import DATA_ENV, OFFLINE_ENV, cache_dir
from iapo_gym.tables import OutcomeTable, TableError, read_attributes, read_metadata, read_table, write_table
from iapo_gym.tasks import GENERATOR_VERSION, TaskSpec, get_task
from iapo_gym.tasks.synthetic import GENERATORS

if TYPE_CHECKING:
    from iapo_gym.data.download import ChecksumError, DownloadError

__all__ = [
    "ChecksumError", "DownloadError", "MissingTableError", "RegistryError", "build_table", "check_table_file",
    "data_folders", "ensure_table", "load_synthetic", "load_task_table", "local_status", "rebuild_hint",
    "resolve_table", "synthetic_cache_path",
]

logger = logging.getLogger(__name__)


class MissingTableError(FileNotFoundError):
    """A data-backed task's table is nowhere in the lookup path."""


def __getattr__(name: str) -> Any:
    """The download errors, imported on first use (a fresh ``gym.make`` of a local table never downloads)."""
    if name in ("ChecksumError", "DownloadError"):
        from iapo_gym.data import download

        return getattr(download, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_table(source: Any, aggregator: str, *, columns: Any = None, contexts: Any = None,
                batch_rows: int | None = None, fmt: str = "auto", **options: Any) -> OutcomeTable:
    """An outcome table from samples, without the command line (``docs/data.md``).

    ``source``: a completion log (``.jsonl``), a columnar sample set (``.parquet``, ``.arrow``, ``.csv``, ...),
    a folder or glob of Parquet shards, an lm-eval output folder, or a table in memory: a ``pyarrow.Table``,
    a Hugging Face ``datasets.Dataset`` or anything with ``to_arrow()``. ``columns`` an
    ``iapo_gym.data.columns.ColumnMap`` (sample sets), ``contexts`` a contexts file's path, its parsed
    ``{"contexts": [...]}`` or a ``ContextSet`` (default: the paper's), ``options`` the fields of
    ``iapo_gym.data.build.BuildOptions`` (``task``, ``n_max``, ``top_k``, ``grid``, ``quantile_bins``, ...).
    """
    from iapo_gym.data.build import (
        DEFAULT_BATCH_ROWS,
        BuildOptions,
        ContextSet,
        build_log_table,
        load_contexts,
        parse_contexts,
    )

    if aggregator not in ("mv", "bon"):
        raise ValueError(f"aggregator must be 'mv' or 'bon', got {aggregator!r}")
    if isinstance(contexts, (str, os.PathLike)):
        contexts = load_contexts(contexts)
    elif isinstance(contexts, dict):
        contexts = parse_contexts(contexts, "contexts")
    elif contexts is not None and not isinstance(contexts, ContextSet):
        raise TypeError(f"contexts must be a path, a dict or a ContextSet, got {type(contexts).__name__}")
    opts = BuildOptions(contexts=contexts, **options)
    rows = DEFAULT_BATCH_ROWS if batch_rows is None else batch_rows
    from iapo_gym.data.columns import build_columns_table, source_format

    kind = source_format(source, fmt) if isinstance(source, (str, os.PathLike)) else "columns"
    if kind == "log":
        return build_log_table(source, aggregator, opts, batch_rows=rows)
    if kind == "lm-eval":
        from iapo_gym.data.lmeval import build_lm_eval_table

        if aggregator != "mv":
            raise ValueError("an lm-eval run gives answers and gold answers: build it with aggregator 'mv'")
        return build_lm_eval_table(source, opts, batch_rows=rows)
    return build_columns_table(source, aggregator, opts, columns, batch_rows=rows)


def rebuild_hint(path: Path, entry: ReleaseEntry | None) -> str:
    """The command that rebuilds the table at ``path`` (for error messages)."""
    if entry is None:
        return f"rebuild it (e.g. `iapo-gym data build LOG.jsonl --out {path}`) or delete it"
    if path.parent == paths.cache_dir():
        return f"rebuild it with `iapo-gym data fetch {entry.name} --force`"
    return f"rebuild it with `iapo-gym data import {entry.file} --dest {path.parent}`"


def check_table_file(path: Path, spec_name: str, entry: ReleaseEntry | None = None) -> Path:
    """``path`` if it opens as an outcome table of task ``spec_name``; else ``TableError`` naming the rebuild command."""
    try:
        meta = read_metadata(path)
    except (TableError, OSError) as exc:
        raise TableError(f"{exc}; {rebuild_hint(path, entry)}") from None
    if meta["task"] != spec_name:
        raise TableError(f"{path} holds a table of task {meta['task']!r}, not {spec_name!r}; {rebuild_hint(path, entry)}")
    return path


def _cached_table_ok(path: Path, entry: ReleaseEntry) -> bool:
    """True when the cache already holds a readable table converted from the verified official file."""
    if not path.is_file():
        return False
    try:
        meta = read_attributes(path)  # a fresh gym.make pays for this open: the cheap reader
    except (TableError, OSError, KeyError):
        return False
    return (bool(meta.get("verified")) and meta.get("source_git_blob") == entry.git_blob and meta["task"] == entry.name
            and bool(meta.get("has_exact")))  # an older cache table (no stored exact tensor) is converted again


def ensure_table(entry: ReleaseEntry, raw: Path | None = None, force: bool = False) -> Path:
    """The cache's converted table of ``entry``, importing ``raw`` (or the cached/downloaded release file) if needed.

    Serialized by a file lock in the cache, so concurrent callers convert once and all succeed.
    """
    folder = paths.cache_dir()
    target = folder / entry.table_file
    if not force and _cached_table_ok(target, entry):
        return target  # converted from the verified official bytes: ``raw`` need not be read again
    from iapo_gym.data.download import fetch_release, folder_lock, verify_release_file
    from iapo_gym.data.release import import_release

    if raw is None:
        raw = fetch_release(entry)  # a verified copy in the cache is reused; offline is refused before any write
    else:
        verify_release_file(raw, entry)  # raises ChecksumError naming the mismatch, before anything is written
    with folder_lock(folder, f"{entry.name}.ensure"):  # outer lock; import_release takes the inner one
        if not force and _cached_table_ok(target, entry):
            return target
        written = import_release(raw, task=entry.name, dest=folder, entry=entry)
    return written[0]


def resolve_table(spec: TaskSpec) -> Path:
    """The table file of a data-backed task, fetched and converted if needed, or MissingTableError saying how to get it."""
    try:
        entry = entry_for_task(spec.name)
    except RegistryError:
        entry = None
    looked: list[str] = []
    for folder in data_folders():
        table = folder / spec.table_file
        looked.append(str(table))
        if table.is_file():
            return check_table_file(table, spec.name, entry)
        if entry is not None:
            raw = folder / entry.file
            looked.append(str(raw))
            if raw.is_file():
                return ensure_table(entry, raw=raw)
    cached = paths.cache_dir() / spec.table_file
    looked.append(str(cached))
    if cached.is_file():
        if entry is None or _cached_table_ok(cached, entry):
            return check_table_file(cached, spec.name, entry)
        check_table_file(cached, spec.name, entry)  # a corrupted cache table: say how to rebuild it
    if entry is None:
        raise MissingTableError(f"no table for task {spec.name!r} ({spec.table_file}); looked at {', '.join(looked)}; "
                                f"pass path=..., set ${DATA_ENV} to a folder holding {spec.table_file}, or build one "
                                f"from your own logs with `iapo-gym data build`")
    from iapo_gym.data.download import is_verified, release_dir

    cached_raw = release_dir() / entry.file
    if cached_raw.is_file() and is_verified(cached_raw, entry):
        return ensure_table(entry, raw=cached_raw)
    if paths.offline():
        raise MissingTableError(
            f"no table for task {spec.name!r}: looked at {', '.join(looked)} and downloads are off (${OFFLINE_ENV}=1). "
            f"Run `iapo-gym data fetch {entry.name}` (downloads {entry.url()}), or "
            f"`iapo-gym data import {entry.file}` with a copy of the file, or set ${DATA_ENV} to a folder holding "
            f"{entry.file} or {spec.table_file}, or pass path=..."
        )
    return ensure_table(entry)


def data_folders() -> list[Path]:
    """Folders searched for tables and release files before the cache: ``$IAPO_GYM_DATA``, then the repository's data/."""
    data_env = os.environ.get(DATA_ENV)
    return ([Path(data_env).expanduser()] if data_env else []) + [paths.repo_data_dir()]


def local_status(entry: ReleaseEntry) -> dict[str, object]:
    """Where ``entry``'s table and release file are on this machine and whether each checks out (reads, never writes)."""
    from iapo_gym.data.download import is_verified, release_dir

    table_path: Path | None = None
    table_ok = False
    for folder in [*data_folders(), paths.cache_dir()]:
        candidate = folder / entry.table_file
        if candidate.is_file():
            table_path = candidate
            try:
                table_ok = read_metadata(candidate)["task"] == entry.name
            except (TableError, OSError):
                table_ok = False
            break
    raw_path: Path | None = None
    for folder in [*data_folders(), release_dir()]:
        candidate = folder / entry.file
        if candidate.is_file():
            raw_path = candidate
            break
    return {
        "name": entry.name, "task": entry.task, "file": entry.file, "source": entry.url(),
        "table": str(table_path) if table_path else None, "table_ok": table_ok,
        "table_size": table_path.stat().st_size if table_path else None,
        "release": str(raw_path) if raw_path else None,
        "release_verified": bool(raw_path and is_verified(raw_path, entry)),
        "release_size": raw_path.stat().st_size if raw_path else entry.size,
    }


def synthetic_cache_path(name: str, instance: int) -> Path:
    """Where instance ``instance`` of a synthetic family is cached."""
    return cache_dir() / "synthetic" / f"{name}-gen{GENERATOR_VERSION}-i{instance}.h5"


def load_synthetic(name: str, instance: int = 0) -> OutcomeTable:
    """Instance ``instance`` of a synthetic family, from the cache or generated (and cached)."""
    if not isinstance(instance, int) or isinstance(instance, bool) or instance < 0:
        raise ValueError(f"instance must be an integer >= 0, got {instance!r}")
    path = synthetic_cache_path(name, instance)
    table: OutcomeTable | None = None
    if path.is_file():
        try:
            table = read_table(path)
        except TableError as exc:
            logger.warning("regenerating unreadable cached table %s: %s", path, exc)
        else:
            if stored(table) is not None:
                return table
            # a cache file without the stored exact tensor (or a stale one): store it now
    if table is None:
        table = GENERATORS[name](instance)
    try:
        write_table(table, path)
    except OSError as exc:  # a read-only cache only costs the regeneration next time
        logger.warning("could not cache %s: %s", path, exc)
    return table


def load_task_table(task: str, instance: int = 0, path: str | None = None) -> OutcomeTable:
    """The table of ``task``: explicit ``path``, else synthetic generation, else the data lookup."""
    spec = get_task(task)
    if path is not None:
        return read_table(path)
    if spec.synthetic:
        return load_synthetic(spec.name, instance)
    found = resolve_table(spec)
    try:
        return read_table(found)
    except TableError as exc:  # damage inside a dataset: say how to rebuild the file
        raise TableError(f"{exc}; {rebuild_hint(found, entry_for_task(spec.name))}") from None
