"""Outcome tables: the one in-memory form and the one HDF5 schema of every IAPO task.

A table holds, per (prompt, query), a categorical distribution over outcome atoms.
Best-of-N (``"bon"``) atoms are objective vectors; majority-vote (``"mv"``) atoms are
answer buckets with one gold bucket per query.  Everything the environment, the oracle
and the agents know about a task comes from here; the schema is documented in
``docs/table-format.md``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import h5py  # every environment reads a table file; imported with the package, not on the first gym.make
import numpy as np

from iapo_gym.atomic import atomic_path
from iapo_gym.exact import EXACT_VERSION, ExactReward, attach, exact_digest, exact_reward, stored, task_reward_fits

SCHEMA_VERSION = 2
#: Schema versions this release can read (Minari's ``supported_dataset_versions``).
#: Version 1 files lack the stored exact tensor (group ``exact``); it is computed on first use.
SUPPORTED_SCHEMA_VERSIONS = (1, 2)
PROB_TOLERANCE = 1e-6
AGGREGATORS = ("bon", "mv")
#: Refuse table files whose datasets' declared sizes add up past this, before reading any array:
#: reading a table holds about this much at most (a million prompt-query pairs of 16 atoms are 0.13 GB).
MAX_TABLE_BYTES = 4 << 30
#: The largest N_max a table may have (a 32-bit count; the paper's tables use 32 to 128).
MAX_N_MAX = (1 << 31) - 1
Aggregator = Literal["bon", "mv"]
TRAIN, TEST = 0, 1
_Schema = TypeVar("_Schema", bound="TableSchema")


class TableError(ValueError):
    """A table (in memory or on disk) breaks a rule of the schema."""


@dataclass(frozen=True, eq=False, kw_only=True)
class TableSchema:
    """An IAPO task without its outcome distributions: shapes, contexts, cost, atoms, gold and split.

    What the env, the utilities and the agents need of a task; a live endpoint has only this (its
    outcome distributions are unknown), a table (``OutcomeTable``) adds ``probs``. Shapes use P
    prompts, Q queries, M atoms, K objectives, C contexts.
    """

    task: str
    aggregator: Aggregator
    cost: np.ndarray  # (P,) or (P, Q) per-completion cost, >= 0
    n_max: int
    context_weights: np.ndarray  # (C, K + 1); the last weight multiplies the cost
    context_names: tuple[str, ...]
    context_probs: np.ndarray  # (C,)
    objective_names: tuple[str, ...]  # (K,)
    shape: tuple[int, int, int] = (0, 0, 0)  # (P, Q, M)
    atoms: np.ndarray | None = None  # bon: (P, Q, M, K) objective vectors
    gold: np.ndarray | None = None  # mv: (Q,) gold bucket per query
    prompts: tuple[str, ...] = ()
    queries: tuple[str, ...] = ()
    split: np.ndarray | None = None  # (Q,) uint8, TRAIN=0 / TEST=1
    attrs: dict[str, Any] = field(default_factory=dict)  # provenance: source, license, build
    cost_unit: str | None = None  # the unit of ``cost`` (a currency per completion); None: normalized, unitless
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, init=False)  # derived arrays

    def __post_init__(self) -> None:
        """Coerce arrays to canonical dtypes, fill default ids, then validate."""
        set_ = object.__setattr__
        set_(self, "cost", np.ascontiguousarray(self.cost, dtype=np.float64))
        set_(self, "context_weights", np.ascontiguousarray(self.context_weights, dtype=np.float64))
        set_(self, "context_probs", np.ascontiguousarray(self.context_probs, dtype=np.float64))
        if self.atoms is not None:
            set_(self, "atoms", np.ascontiguousarray(self.atoms, dtype=np.float64))
        if self.gold is not None:
            set_(self, "gold", np.ascontiguousarray(self.gold, dtype=np.int64))
        if self.split is not None:
            set_(self, "split", np.ascontiguousarray(self.split, dtype=np.uint8))
        set_(self, "n_max", int(self.n_max))
        set_(self, "shape", tuple(int(n) for n in self.shape))
        set_(self, "context_names", tuple(str(n) for n in self.context_names))
        set_(self, "objective_names", tuple(str(n) for n in self.objective_names))
        if len(self.shape) == 3:
            if not self.prompts:
                set_(self, "prompts", tuple(f"p{i}" for i in range(self.shape[0])))
            if not self.queries:
                set_(self, "queries", tuple(f"q{i}" for i in range(self.shape[1])))
        set_(self, "prompts", tuple(str(p) for p in self.prompts))
        set_(self, "queries", tuple(str(q) for q in self.queries))
        validate(self)

    # ---- shape helpers -------------------------------------------------------------
    @property
    def n_prompts(self) -> int:
        """Number of prompts P."""
        return self.shape[0]

    @property
    def n_queries(self) -> int:
        """Number of queries Q (train and test together)."""
        return self.shape[1]

    @property
    def n_atoms(self) -> int:
        """Number of outcome atoms M per (prompt, query)."""
        return self.shape[2]

    @property
    def n_objectives(self) -> int:
        """Number of task objectives K (the cost is not counted)."""
        return len(self.objective_names)

    @property
    def n_contexts(self) -> int:
        """Number of contexts C."""
        return int(self.context_weights.shape[0])

    def cost_matrix(self) -> np.ndarray:
        """Per-completion cost as a (P, Q) array, whichever form is stored."""
        if self.cost.ndim == 1:
            return np.broadcast_to(self.cost[:, None], (self.n_prompts, self.n_queries))
        return self.cost

    def split_indices(self, split: str) -> np.ndarray:
        """Query indices of ``"train"``, ``"test"`` or ``"all"`` (no stored split: all queries)."""
        if split == "all" or self.split is None:
            if split not in ("train", "test", "all"):
                raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
            return np.arange(self.n_queries)
        if split == "train":
            return np.flatnonzero(self.split == TRAIN)
        if split == "test":
            return np.flatnonzero(self.split == TEST)
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")

    def with_split(self: _Schema, split: np.ndarray | None) -> _Schema:
        """The same table with another stored split (validated); derived caches are shared."""
        new = replace(self, split=split)
        object.__setattr__(new, "_cache", self._cache)
        return new

    def metadata(self) -> dict[str, Any]:
        """A JSON-friendly summary (what ``read_metadata`` returns for a file)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "task": self.task,
            "aggregator": self.aggregator,
            "n_prompts": self.n_prompts,
            "n_queries": self.n_queries,
            "n_atoms": self.n_atoms,
            "n_max": self.n_max,
            "n_contexts": self.n_contexts,
            "objective_names": list(self.objective_names),
            "context_names": list(self.context_names),
            "has_split": self.split is not None,
            **({"cost_unit": self.cost_unit} if self.cost_unit is not None else {}),
            **{k: _jsonable(v) for k, v in self.attrs.items()},
        }


@dataclass(frozen=True, eq=False, kw_only=True)
class OutcomeTable(TableSchema):
    """Categorical outcome distributions of one IAPO task, with its contexts and costs (the schema plus ``probs``).

    ``shape`` is that of ``probs`` (set from it).
    """

    probs: np.ndarray  # (P, Q, M) float64, rows sum to 1
    shape: tuple[int, int, int] = field(default=(0, 0, 0), init=False)

    def __post_init__(self) -> None:
        """Coerce ``probs``, take the shape from it, then as ``TableSchema``."""
        object.__setattr__(self, "probs", np.ascontiguousarray(self.probs, dtype=np.float64))
        if self.probs.ndim == 3:
            object.__setattr__(self, "shape", self.probs.shape)
        super().__post_init__()


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _fail(where: str, message: str) -> None:
    raise TableError(f"{where}: {message}")


def _validate_probs(probs: np.ndarray, where: str) -> None:
    """The rules of dataset ``probs``: shape (P, Q, M), finite, non-negative, rows summing to 1."""
    if probs.ndim != 3 or 0 in probs.shape:
        _fail(where, f"dataset 'probs' must have shape (P, Q, M) with P, Q, M >= 1, got {probs.shape}")
    if not np.all(np.isfinite(probs)):
        _fail(where, "dataset 'probs' holds NaN or infinite values")
    if np.any(probs < 0):
        idx = tuple(int(i) for i in np.argwhere(probs < 0)[0])
        _fail(where, f"dataset 'probs' holds a negative probability {float(probs[idx])!r} at {idx}")
    sums = probs.sum(axis=2)
    bad = np.abs(sums - 1.0) > PROB_TOLERANCE
    if np.any(bad):
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        total = float(sums[idx])
        _fail(where, f"dataset 'probs' row {idx} (prompt, query) sums to {total!r}, not 1 (tolerance {PROB_TOLERANCE})")


def validate(table: TableSchema, where: str = "table") -> None:
    """Check every rule of the schema (and of ``probs`` for a table); raise ``TableError`` naming the dataset and rule."""
    if table.aggregator not in AGGREGATORS:
        _fail(where, f"aggregator must be one of {AGGREGATORS}, got {table.aggregator!r}")
    if isinstance(table, OutcomeTable):
        _validate_probs(table.probs, where)
    elif len(table.shape) != 3 or min(table.shape) < 1:
        _fail(where, f"the schema's shape must be (P, Q, M) with P, Q, M >= 1, got {table.shape}")
    n_p, n_q, n_m = table.shape
    if not 1 <= table.n_max <= MAX_N_MAX:
        _fail(where, f"attribute 'n_max' must be in [1, {MAX_N_MAX}], got {table.n_max}")
    cost = table.cost
    if cost.shape not in ((n_p,), (n_p, n_q)):
        _fail(where, f"dataset 'cost' must have shape ({n_p},) or ({n_p}, {n_q}), got {cost.shape}")
    if not np.all(np.isfinite(cost)) or np.any(cost < 0):
        _fail(where, "dataset 'cost' must be finite and >= 0")
    if table.cost_unit is not None and (not isinstance(table.cost_unit, str) or not table.cost_unit.strip()):
        _fail(where, f"the cost unit (dataset 'cost', attribute 'unit') must be a non-empty string, "
                     f"got {table.cost_unit!r}")
    k = len(table.objective_names)
    weights = table.context_weights
    if weights.ndim != 2 or weights.shape[1] != k + 1 or weights.shape[0] < 1:
        _fail(where, f"dataset 'contexts/weights' must have shape (C, {k + 1}) for {k} objectives plus cost, got {weights.shape}")
    if not np.all(np.isfinite(weights)):
        _fail(where, "dataset 'contexts/weights' holds NaN or infinite values")
    n_c = weights.shape[0]
    if len(table.context_names) != n_c:
        _fail(where, f"dataset 'contexts/names' has {len(table.context_names)} names for {n_c} contexts")
    cprobs = table.context_probs
    if cprobs.shape != (n_c,) or not np.all(np.isfinite(cprobs)) or np.any(cprobs < 0):
        _fail(where, f"dataset 'contexts/probs' must be {n_c} finite non-negative numbers, got {cprobs!r}")
    if abs(float(cprobs.sum()) - 1.0) > PROB_TOLERANCE:
        _fail(where, f"dataset 'contexts/probs' sums to {float(cprobs.sum())!r}, not 1")
    if len(table.prompts) != n_p:
        _fail(where, f"dataset 'prompts' has {len(table.prompts)} entries for {n_p} prompts")
    if len(table.queries) != n_q:
        _fail(where, f"dataset 'queries' has {len(table.queries)} entries for {n_q} queries")
    if table.aggregator == "bon":
        if table.atoms is None:
            _fail(where, "missing dataset 'atoms' (required for aggregator 'bon')")
        assert table.atoms is not None
        if table.atoms.shape != (n_p, n_q, n_m, k):
            _fail(where, f"dataset 'atoms' must have shape {(n_p, n_q, n_m, k)}, got {table.atoms.shape}")
        if not np.all(np.isfinite(table.atoms)):
            _fail(where, "dataset 'atoms' holds NaN or infinite values")
    else:
        if table.gold is None:
            _fail(where, "missing dataset 'gold' (required for aggregator 'mv')")
        assert table.gold is not None
        if k != 1:
            _fail(where, f"aggregator 'mv' has exactly one objective (correctness), got {k}")
        if table.gold.shape != (n_q,):
            _fail(where, f"dataset 'gold' must have shape ({n_q},), got {table.gold.shape}")
        out = (table.gold < 0) | (table.gold >= n_m)
        if np.any(out):
            i = int(np.flatnonzero(out)[0])
            _fail(where, f"dataset 'gold' query {i} names bucket {int(table.gold[i])}, outside [0, {n_m})")
    if table.split is not None:
        if table.split.shape != (n_q,):
            _fail(where, f"dataset 'split' must have shape ({n_q},), got {table.split.shape}")
        if np.any(table.split > TEST):
            _fail(where, "dataset 'split' must hold only 0 (train) and 1 (test)")
        if not np.any(table.split == TRAIN) or not np.any(table.split == TEST):
            _fail(where, "dataset 'split' must give at least one train and one test query")


# ---- HDF5 ------------------------------------------------------------------------------
def write_table(table: OutcomeTable, path: str | os.PathLike[str], *, exact: bool = True) -> Path:
    """Write ``table`` to ``path`` atomically (``iapo_gym.atomic``: a reader never sees a part of it).

    With ``exact`` (default) the exact expected task-reward tensor is stored too (group ``exact``,
    with its digest), so a fresh process evaluates without recomputing it; not when it exceeds
    ``iapo_gym.exact.TENSOR_LIMIT_BYTES`` (then ``q_table`` streams it per use).
    """
    tensor: ExactReward | None = None
    if exact and (stored(table) is not None or task_reward_fits(table)):  # too large: computed per use, streamed
        tensor = exact_reward(table)
    path = Path(path)
    with atomic_path(path) as tmp_name:
        str_dt = h5py.string_dtype("utf-8")
        with h5py.File(tmp_name, "w") as f:
            f.attrs["schema_version"] = SCHEMA_VERSION
            f.attrs["task"] = table.task
            f.attrs["aggregator"] = table.aggregator
            f.attrs["n_max"] = table.n_max
            for key, value in table.attrs.items():
                f.attrs[f"prov_{key}"] = value
            f.create_dataset("probs", data=table.probs, compression="gzip", shuffle=True)
            cost = f.create_dataset("cost", data=table.cost)
            if table.cost_unit is not None:
                cost.attrs["unit"] = table.cost_unit
            f.create_dataset("objective_names", data=list(table.objective_names), dtype=str_dt)
            f.create_dataset("prompts", data=list(table.prompts), dtype=str_dt)
            f.create_dataset("queries", data=list(table.queries), dtype=str_dt)
            g = f.create_group("contexts")
            g.create_dataset("weights", data=table.context_weights)
            g.create_dataset("names", data=list(table.context_names), dtype=str_dt)
            g.create_dataset("probs", data=table.context_probs)
            if table.atoms is not None:
                f.create_dataset("atoms", data=table.atoms, compression="gzip", shuffle=True)
            if table.gold is not None:
                f.create_dataset("gold", data=table.gold)
            if table.split is not None:
                f.create_dataset("split", data=table.split)
            if tensor is not None:
                e = f.create_group("exact")
                e.attrs["version"] = EXACT_VERSION
                e.attrs["digest"] = exact_digest(table)
                e.create_dataset("task_reward", data=tensor.reward)
                if tensor.context_index is not None:
                    e.create_dataset("context_index", data=tensor.context_index)
    return path


REQUIRED_DATASETS = ("probs", "cost", "objective_names", "prompts", "queries",
                     "contexts/weights", "contexts/names", "contexts/probs")


def _open(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"no outcome table at {path}")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise TableError(f"{path}: not a readable HDF5 outcome table (truncated or corrupted?): {exc}") from exc


@contextmanager
def _reading(path: Path) -> Iterator[Any]:
    """The open file; any h5py failure inside (corrupted metadata) becomes a TableError naming the file."""
    try:
        with _open(path) as f:
            yield f
    except (TableError, FileNotFoundError):
        raise
    except Exception as exc:  # h5py raises RuntimeError, OSError, KeyError, ... on corrupted files
        raise TableError(f"{path}: not a readable HDF5 outcome table (truncated or corrupted?): "
                         f"{type(exc).__name__}: {str(exc)[:200]}") from None


def _check_version(path: Path, f: Any) -> int:
    if "schema_version" not in f.attrs:
        raise TableError(f"{path}: missing attribute 'schema_version'; not an iapo-gym outcome table")
    try:
        version = int(f.attrs["schema_version"])
    except (TypeError, ValueError, OverflowError, OSError) as exc:
        raise TableError(f"{path}: attribute 'schema_version' must be an integer: {exc}") from None
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise TableError(f"{path}: unknown schema version {version}; this iapo-gym reads {SUPPORTED_SCHEMA_VERSIONS}")
    return version


def _strings(ds: Any) -> tuple[str, ...]:
    return tuple(s.decode() if isinstance(s, bytes) else str(s) for s in ds[()])


def _attributes(path: Path, f: Any) -> dict[str, Any]:
    """Schema version, task, aggregator, whether the exact tensor is stored, and the provenance attributes."""
    version = _check_version(path, f)
    read = _read_fields(path, {
        "attribute 'task'": lambda: str(f.attrs["task"]),
        "attribute 'aggregator'": lambda: str(f.attrs["aggregator"]),
        "group 'exact'": lambda: "exact" in f,
        "provenance attributes": lambda: {k[5:]: _jsonable(v) for k, v in f.attrs.items() if k.startswith("prov_")},
    })
    return {"schema_version": version, "task": read["attribute 'task'"], "aggregator": read["attribute 'aggregator'"],
            "has_exact": read["group 'exact'"], **read["provenance attributes"]}


def _read_fields(path: Path, readers: dict[str, Any]) -> dict[str, Any]:
    """Call each reader; any failure inside h5py or numpy becomes a TableError naming the file and field."""
    out = {}
    for name, read in readers.items():
        try:
            out[name] = read()
        except TableError:
            raise
        except Exception as exc:  # h5py and numpy raise many kinds on malformed files
            raise TableError(f"{path}: could not read {name} (truncated, corrupted or of the wrong type?): "
                             f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return out


def _check_sizes(path: Path, f: Any) -> None:
    """Refuse, before reading any array, a table whose datasets' declared sizes add up past MAX_TABLE_BYTES."""
    total = 0
    for name in (*REQUIRED_DATASETS, "atoms", "gold", "split", "exact/task_reward", "exact/context_index"):
        ds = f.get(name) if name.split("/")[0] in f else None
        if ds is None:
            continue
        if not isinstance(ds, h5py.Dataset):
            raise TableError(f"{path}: '{name}' must be a dataset, got {type(ds).__name__}")
        total += int(ds.size or 0) * max(int(ds.dtype.itemsize), 8)
    if total > MAX_TABLE_BYTES:
        raise TableError(f"{path}: its datasets declare {total} bytes, more than the limit of {MAX_TABLE_BYTES}")


def read_attributes(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``read_metadata`` without the shapes and names: the cheapest check of what a file holds (provenance)."""
    path = Path(path)
    with _reading(path) as f:
        return _attributes(path, f)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Attributes and shapes of a table file, without loading its arrays."""
    path = Path(path)
    with _reading(path) as f:
        meta = _attributes(path, f)
        for name in REQUIRED_DATASETS:
            if name not in f:
                raise TableError(f"{path}: missing dataset '{name}'")
        _read_fields(path, {"dataset sizes": lambda: _check_sizes(path, f)})
        shape = tuple(f["probs"].shape)
        if len(shape) != 3:
            raise TableError(f"{path}: dataset 'probs' must have shape (P, Q, M), got {shape}")
        meta.update({"n_prompts": int(shape[0]), "n_queries": int(shape[1]), "n_atoms": int(shape[2])})
        meta.update(_read_fields(path, {
            "n_max": lambda: int(f.attrs["n_max"]),
            "n_contexts": lambda: int(f["contexts/weights"].shape[0]),
            "objective_names": lambda: list(_strings(f["objective_names"])),
            "context_names": lambda: list(_strings(f["contexts/names"])),
            "has_split": lambda: "split" in f,
        }))
        unit = _read_fields(path, {"dataset 'cost' attribute 'unit'": lambda: f["cost"].attrs.get("unit")})
        if unit["dataset 'cost' attribute 'unit'"] is not None:
            meta["cost_unit"] = str(_jsonable(unit["dataset 'cost' attribute 'unit'"]))
    return meta


def read_table(path: str | os.PathLike[str]) -> OutcomeTable:
    """Read and validate a table file; errors name the file, the dataset and the rule."""
    path = Path(path)
    with _reading(path) as f:
        _check_version(path, f)
        for name in REQUIRED_DATASETS:
            if name not in f:
                raise TableError(f"{path}: missing dataset '{name}'")
        aggregator = _read_fields(path, {"attribute 'aggregator'": lambda: str(f.attrs.get("aggregator", ""))})[
            "attribute 'aggregator'"]
        if aggregator == "bon" and "atoms" not in f:
            raise TableError(f"{path}: missing dataset 'atoms' (required for aggregator 'bon')")
        if aggregator == "mv" and "gold" not in f:
            raise TableError(f"{path}: missing dataset 'gold' (required for aggregator 'mv')")
        _read_fields(path, {"dataset sizes": lambda: _check_sizes(path, f)})
        kwargs: dict[str, Any] = _read_fields(path, {
            "task": lambda: str(f.attrs["task"]),
            "n_max": lambda: int(f.attrs["n_max"]),
            "probs": lambda: np.asarray(f["probs"][()], dtype=np.float64),
            "cost": lambda: np.asarray(f["cost"][()], dtype=np.float64),
            "cost_unit": lambda: None if "unit" not in f["cost"].attrs else str(_jsonable(f["cost"].attrs["unit"])),
            "objective_names": lambda: _strings(f["objective_names"]),
            "prompts": lambda: _strings(f["prompts"]),
            "queries": lambda: _strings(f["queries"]),
            "context_weights": lambda: np.asarray(f["contexts/weights"][()], dtype=np.float64),
            "context_names": lambda: _strings(f["contexts/names"]),
            "context_probs": lambda: np.asarray(f["contexts/probs"][()], dtype=np.float64),
            "atoms": lambda: np.asarray(f["atoms"][()], dtype=np.float64) if "atoms" in f else None,
            "gold": lambda: _integers(f["gold"], np.int64) if "gold" in f else None,
            "split": lambda: _integers(f["split"], np.uint8) if "split" in f else None,
            "attrs": lambda: {k[5:]: _jsonable(v) for k, v in f.attrs.items() if k.startswith("prov_")},
        })
        kwargs["aggregator"] = aggregator
        exact = _read_fields(path, {"group 'exact'": lambda: _read_exact(f)})["group 'exact'"]
    try:
        table = OutcomeTable(**kwargs)
    except TableError as exc:
        raise TableError(f"{path}: {str(exc).removeprefix('table: ')}") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise TableError(f"{path}: not a valid outcome table: {type(exc).__name__}: {str(exc)[:200]}") from None
    if exact is not None:
        _attach_exact(table, path, *exact)
    return table


def _integers(ds: Any, dtype: Any) -> np.ndarray:
    """An integer dataset as ``dtype``; values it cannot hold exactly are refused, not wrapped around."""
    values = np.asarray(ds[()])
    if values.dtype.kind not in "iub":
        raise TypeError(f"expected integers, got dtype {values.dtype}")
    info = np.iinfo(dtype)
    if values.size and (values.min() < info.min or values.max() > info.max):
        raise ValueError(f"values outside [{info.min}, {info.max}]")
    return values.astype(dtype)


def _read_exact(f: Any) -> tuple[int, str, np.ndarray, np.ndarray | None] | None:
    """The stored exact group (version, digest, tensor, context index), or None when absent."""
    if "exact" not in f:
        return None
    e = f["exact"]
    index = e["context_index"][()] if "context_index" in e else None
    return int(e.attrs["version"]), str(_jsonable(e.attrs["digest"])), e["task_reward"][()], index


def _attach_exact(table: OutcomeTable, path: Path, version: int, digest: str, reward: np.ndarray,
                  index: np.ndarray | None) -> None:
    """Put a stored exact tensor into the table's cache if its version and digest check out; else warn."""
    bad_index = index is not None and (index.dtype.kind not in "iu" or bool(index.size and int(index.min()) < 0))
    n_rows = 1 if table.aggregator == "mv" else (
        int(index.max()) + 1 if index is not None and index.size and not bad_index else -1)
    expected_shape = (n_rows, table.n_prompts, table.n_queries, table.n_max)
    problem = None
    if bad_index or reward.dtype.kind != "f":
        problem = f"its context index ({None if index is None else index.dtype}) or tensor ({reward.dtype}) has the wrong type"
    elif version != EXACT_VERSION:
        problem = f"computed by exact version {version}, this iapo-gym computes version {EXACT_VERSION}"
    elif table.aggregator == "bon" and (index is None or index.shape != (table.n_contexts,)):
        problem = "its context index does not match the contexts"
    elif reward.shape != expected_shape:
        problem = f"its shape {reward.shape} does not match the table {expected_shape}"
    elif digest != exact_digest(table):
        problem = "its digest does not match the table's probabilities (the file was changed after it was written)"
    if problem is not None:
        warnings.warn(f"{path}: ignoring the stored exact expectations: {problem}; they are recomputed on first use. "
                      f"Rewrite the file (e.g. `iapo-gym data fetch TASK --force`) to store them again.",
                      TableWarning, stacklevel=3)
        return
    attach(table, ExactReward(reward, None if index is None else np.asarray(index, dtype=np.int64)))


class TableWarning(UserWarning):
    """A table file is usable but not as written (e.g. its stored exact expectations were ignored)."""


#: Seconds a child process may take to read a table file before the file is declared corrupt.
CHECK_TIMEOUT = 60.0
_CHECK_CHILD = (
    "import sys\n"
    "from iapo_gym.tables import TableError, read_metadata, read_table\n"
    "try:\n"
    "    read_metadata(sys.argv[1])\n"
    "    read_table(sys.argv[1])\n"
    "except TableError as exc:\n"
    "    print(exc, file=sys.stderr)\n"
    "    sys.exit(3)\n"
)


def check_table_file(path: str | os.PathLike[str], timeout: float = CHECK_TIMEOUT) -> None:
    """Read ``path`` (metadata, then the table) in a child process; raise ``TableError`` if it is not a valid table.

    For table files from others: a corrupted HDF5 file can make the HDF5 C library loop or crash,
    which no check in this process could catch. The child's hang (past ``timeout`` seconds) or
    crash becomes a ``TableError`` naming the file; a clean refusal keeps the reader's message.
    """
    path = Path(path)
    if not path.is_file():
        raise TableError(f"{path}: no such table file")
    try:
        done = subprocess.run([sys.executable, "-c", _CHECK_CHILD, str(path)], capture_output=True,
                              timeout=timeout, text=True, errors="replace")
    except subprocess.TimeoutExpired:
        raise TableError(f"{path}: reading the file did not finish within {timeout:g} s (the HDF5 library "
                         "loops on it): the file is corrupt") from None
    if done.returncode == 0:
        return
    message = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    if done.returncode == 3:
        raise TableError(message or f"{path}: not a valid table")
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        raise TableError(f"{path}: the HDF5 library crashed ({name}) reading the file: the file is corrupt")
    raise TableError(f"{path}: reading the file failed in a child process (exit status {done.returncode}"
                     + (f": {message}" if message else "") + ")")
