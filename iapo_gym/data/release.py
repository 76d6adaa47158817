"""Safe reading of the official IAPO release pickles and their conversion to outcome tables.

The release files are pickles of the authors' environment objects. They are never loaded
with plain ``pickle.load``: a restricted unpickler admits only numpy array and dtype
reconstruction, numpy's random-generator state, plain containers and the known record
classes, which come back as inert attribute records (no code of the authors' runs).
Any other global is refused with ``ReleaseError`` before anything is called.
"""

from __future__ import annotations

import collections
import importlib
import io
import math
import os
import pickle
import pickletools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from iapo_gym.data.build import describe_contexts
from iapo_gym.data.registry import ReleaseEntry
from iapo_gym.tables import TEST, TRAIN, OutcomeTable, TableError, write_table
from iapo_gym.tasks.contexts import bon_grid_contexts, mv_cost_contexts

#: The environment classes of the release, by the module path the pickles name.
ENV_CLASSES = {
    ("Envs.catMV.catMV", "CategoricalMVEnv"),
    ("Envs.catBoN.catBoN", "CategoricalBoNEnv"),
    ("Envs.synthBernoulli.synthBernoulli", "SyntheticBernoulliEnv"),
}
#: Small record classes (contexts) allowed in any of the authors' ``Envs.*`` modules.
CONTEXT_CLASSES = {"CostContext", "Context"}
RELEASE_REPO = "IAPO-AAAI25/IAPO-PSST"
RELEASE_COMMIT = "1a6de0bb29c1e141bcf6283b06023677389cd87f"
RELEASE_LICENSE = "see https://github.com/IAPO-AAAI25/IAPO-PSST (the authors' release)"


class ReleaseError(ValueError):
    """A release file is unsafe, malformed or of an unknown kind."""


class ReleaseRecord:
    """An inert stand-in for one of the authors' objects: attributes only, no behaviour."""

    __record_class__ = "ReleaseRecord"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Keep constructor arguments (if a pickle calls the class) as plain data."""
        self.__dict__["_args"] = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        """Store the pickled state: a dict of attributes, or (dict, slots) pairs, or anything else."""
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            for part in state:
                if isinstance(part, dict):
                    self.__dict__.update({str(k): v for k, v in part.items()})
        elif isinstance(state, dict):
            self.__dict__.update({str(k): v for k, v in state.items()})
        else:
            self.__dict__["_state"] = state

    def __repr__(self) -> str:
        """Class path and attribute names (arrays are not printed)."""
        return f"<{self.__record_class__} record: {', '.join(sorted(self.__dict__))}>"


_RECORD_TYPES: dict[str, type[ReleaseRecord]] = {}


def _record_type(module: str, name: str) -> type[ReleaseRecord]:
    key = f"{module}.{name}"
    if key not in _RECORD_TYPES:
        _RECORD_TYPES[key] = type(name, (ReleaseRecord,), {"__record_class__": key, "__module__": __name__})
    return _RECORD_TYPES[key]


def _multiarray(name: str) -> Callable[..., Any]:
    """numpy's ``multiarray.<name>``: ``numpy._core`` in numpy 2, ``numpy.core`` in numpy 1."""
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            found = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        if callable(found):
            return found
    raise ReleaseError(f"this numpy ({np.__version__}) has no multiarray.{name}")


_NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray")
_SAFE_BUILTINS: dict[tuple[str, str], Any] = {
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("numpy", "dtype"): np.dtype,
}
_RNG_CTORS = {"__generator_ctor", "__bit_generator_ctor", "__randomstate_ctor"}
#: Bit-generator classes newer numpy pickles name directly (read as inert records too).
_BIT_GENERATORS = {
    ("numpy.random._pcg64", "PCG64"), ("numpy.random._pcg64", "PCG64DXSM"), ("numpy.random._mt19937", "MT19937"),
    ("numpy.random._philox", "Philox"), ("numpy.random._sfc64", "SFC64"), ("numpy.random.bit_generator", "SeedSequence"),
    ("numpy.random.bit_generator", "__pyx_unpickle_SeedSequence"),
}


class _NdarrayRef:
    """``numpy.ndarray`` as a release pickle names it: the array type handed to ``_reconstruct``
    (which then makes a real ndarray), never called to allocate by itself."""


def _nbytes(shape: Any, dtype: Any) -> int:
    """Bytes an array of ``shape`` and ``dtype`` would take (shape as numpy accepts it)."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ReleaseError(f"array shape {shape!r} is not a tuple of non-negative integers")
    return math.prod(dims) * np.dtype(dtype).itemsize


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only an allow-list of globals and refuses the rest.

    No single array, scalar or bytearray it builds may be larger than ``max_bytes`` (the file's own
    size when read by ``load_release_objects``: genuine data is stored in the file, so a request for
    more is an allocation bomb).
    """

    def __init__(self, file: Any, *, max_bytes: int) -> None:
        """Read from ``file``; refuse allocations past ``max_bytes``."""
        super().__init__(file)
        self.max_bytes = max_bytes

    def _bound(self, nbytes: int, what: str) -> None:
        if nbytes > self.max_bytes:
            raise ReleaseError(f"refusing to allocate {what} of {nbytes} bytes, more than the file's "
                               f"{self.max_bytes} bytes")

    def _reconstruct(self, subtype: Any, shape: Any, dtype: Any) -> Any:
        if subtype is not _NdarrayRef:
            raise ReleaseError(f"numpy _reconstruct of {subtype!r}: only numpy.ndarray is allowed")
        self._bound(_nbytes(shape, dtype), "an array")
        return _multiarray("_reconstruct")(np.ndarray, shape, dtype)

    def _scalar(self, dtype: Any, *args: Any) -> Any:
        self._bound(np.dtype(dtype).itemsize, "a scalar")
        return _multiarray("scalar")(dtype, *args)

    def _bytearray(self, *args: Any) -> bytearray:
        if args and isinstance(args[0], int):
            self._bound(args[0], "a bytearray")
        return bytearray(*args)

    def find_class(self, module: str, name: str) -> Any:
        """The object for ``module.name`` if allowed; ``ReleaseError`` otherwise (nothing is imported)."""
        if module in _NUMPY_MODULES and name == "_reconstruct":
            return self._reconstruct
        if module in _NUMPY_MODULES and name == "scalar":
            return self._scalar
        if (module, name) == ("numpy", "ndarray"):
            return _NdarrayRef
        if (module, name) == ("builtins", "bytearray"):
            return self._bytearray
        if (module, name) in _SAFE_BUILTINS:
            return _SAFE_BUILTINS[(module, name)]
        if module == "numpy.dtypes" and name.endswith("DType") and name.isidentifier():
            import numpy.dtypes

            found = getattr(numpy.dtypes, name, None)
            if isinstance(found, type) and issubclass(found, np.dtype):
                return found
        if (module == "numpy.random._pickle" and name in _RNG_CTORS) or (module, name) in _BIT_GENERATORS:
            # The authors' random generators are bookkeeping: read them as inert records.
            return _record_type(module, name)
        if (module, name) in ENV_CLASSES or (module.startswith("Envs.") and name in CONTEXT_CLASSES):
            return _record_type(module, name)
        raise ReleaseError(
            f"refusing to load global {module}.{name}: release files may only hold numpy arrays, numpy "
            f"random-generator state and the IAPO record classes ({', '.join(sorted(m + '.' + n for m, n in ENV_CLASSES))}, "
            f"Context, CostContext); this file is not a genuine IAPO release or was tampered with"
        )


def load_release_objects(path: str | os.PathLike[str]) -> list[ReleaseRecord]:
    """The environment records of a release file, unpickled with the restricted unpickler."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ReleaseError(f"cannot read release file {path}: {exc}") from exc
    try:
        # Walk the opcodes first: pickletools reads each declared length without allocating it, so a
        # bytes opcode that claims gigabytes in a small file is refused before the C unpickler
        # allocates the whole claim up front.
        for _ in pickletools.genops(data):
            pass
    except Exception as exc:  # noqa: BLE001 (truncated or garbage opcode streams raise many kinds)
        raise ReleaseError(f"{path}: not a readable release pickle (truncated or corrupted?): "
                           f"{type(exc).__name__}: {str(exc)[:200]}") from None
    try:
        obj = RestrictedUnpickler(io.BytesIO(data), max_bytes=len(data)).load()
    except ReleaseError as exc:
        raise ReleaseError(f"{path}: {exc}") from None
    except Exception as exc:  # truncated or garbage pickles raise many kinds of errors
        raise ReleaseError(f"{path}: not a readable release pickle (truncated or corrupted?): "
                           f"{type(exc).__name__}: {exc}") from exc
    objects = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    envs = [o for o in objects if isinstance(o, ReleaseRecord) and _env_kind(o) is not None]
    if not envs or len(envs) != len(objects):
        kinds = sorted({getattr(o, "__record_class__", type(o).__name__) for o in objects})
        raise ReleaseError(f"{path}: expected a list of IAPO environment objects, found {kinds}")
    return envs


def _env_kind(obj: ReleaseRecord) -> str | None:
    name = obj.__record_class__.rsplit(".", 1)[-1]
    return {"CategoricalMVEnv": "mv", "CategoricalBoNEnv": "bon", "SyntheticBernoulliEnv": "sb"}.get(name)


def _array(obj: ReleaseRecord, name: str, ndim: int, where: str, dtype: Any = np.float64) -> np.ndarray:
    if name not in obj.__dict__:
        raise ReleaseError(f"{where}: missing attribute {name!r} (have {', '.join(sorted(obj.__dict__))})")
    try:
        arr = np.asarray(obj.__dict__[name], dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise ReleaseError(f"{where}: attribute {name!r} is not a numeric array: {exc}") from exc
    if arr.ndim != ndim:
        raise ReleaseError(f"{where}: attribute {name!r} must have {ndim} dimensions, got shape {arr.shape}")
    return arr


def _n_max(obj: ReleaseRecord, where: str) -> int:
    value = obj.__dict__.get("N_max")
    if value is None:
        raise ReleaseError(f"{where}: missing attribute 'N_max'")
    try:
        n_max = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ReleaseError(f"{where}: attribute 'N_max' must be an integer, got {value!r}") from None
    if n_max < 1:
        raise ReleaseError(f"{where}: attribute 'N_max' must be >= 1, got {n_max}")
    return n_max


def _split(n_train: int, n_test: int) -> np.ndarray:
    return np.concatenate([np.full(n_train, TRAIN, dtype=np.uint8), np.full(n_test, TEST, dtype=np.uint8)])


class _PaperContexts:
    """What to do when a record's stored contexts are absent or unreadable: refuse, or (when asked) use the paper's."""

    def __init__(self, allowed: bool) -> None:
        self.allowed = allowed

    def fallback(self, where: str, problem: str, paper: str) -> str:
        """The contexts-source note for a table given the paper's set, or ``ReleaseError`` when not asked to."""
        if not self.allowed:
            raise ReleaseError(f"{where}: {problem}, so the table's contexts are unknown; nothing was written. "
                               f"Fix the record, or pass --paper-contexts (Python: paper_contexts=True) "
                               f"to give the table {paper} instead")
        return f"{paper}, used because --paper-contexts was given ({problem})"


def _finite_vector(value: Any, what: str, where: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise ReleaseError(f"{where}: {what} is not a vector of numbers: {str(value)[:120]!r}") from None
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)):
        raise ReleaseError(f"{where}: {what} must be a non-empty vector of finite numbers, got {str(value)[:120]!r}")
    return arr


def _distribution(obj: ReleaseRecord, n_contexts: int, where: str) -> np.ndarray:
    """The record's ``context_distribution``: ``n_contexts`` non-negative numbers summing to 1."""
    if "context_distribution" not in obj.__dict__:
        raise ReleaseError(f"{where}: the record stores no 'context_distribution'")
    probs = _finite_vector(obj.__dict__["context_distribution"], "'context_distribution'", where)
    if probs.size != n_contexts or np.any(probs < 0) or abs(float(probs.sum()) - 1.0) > 1e-6:
        raise ReleaseError(f"{where}: 'context_distribution' must be {n_contexts} non-negative numbers summing "
                           f"to 1 (one per stored context), got {probs.tolist()}")
    return probs


def _context_weights(ctx: Any) -> Any:
    """The weight vector of one stored context: a ``Context``/``CostContext`` record's ``weights``, or the vector itself."""
    if isinstance(ctx, ReleaseRecord):
        if "weights" in ctx.__dict__:
            return ctx.__dict__["weights"]
        args = ctx.__dict__.get("_args", ())
        return args[-1] if args else None
    return ctx


def stored_bon_contexts(obj: ReleaseRecord, n_objectives: int,
                        where: str) -> tuple[np.ndarray, tuple[str, ...], np.ndarray]:
    """A Best-of-N record's own contexts: ``_contexts`` weight vectors (w_1..w_K, w_cost <= 0) and their
    ``context_distribution``; ``ReleaseError`` saying what is absent or unreadable."""
    stored = obj.__dict__.get("_contexts")
    if not isinstance(stored, (list, tuple)) or not stored:
        what = "no '_contexts'" if stored is None else f"'_contexts' of type {type(stored).__name__}, not a list of contexts"
        raise ReleaseError(f"{where}: the record stores {what}")
    rows = []
    for i, ctx in enumerate(stored):
        w = _finite_vector(_context_weights(ctx), f"the weights of stored context {i}", where)
        if w.size != n_objectives + 1:
            raise ReleaseError(f"{where}: stored context {i} has {w.size} weights; its {n_objectives} objectives "
                               f"plus the cost need {n_objectives + 1}")
        if w[-1] > 0:
            raise ReleaseError(f"{where}: stored context {i} weighs the cost by {w[-1]:g}; a cost weight must be <= 0")
        rows.append(w)
    weights = np.stack(rows)
    probs = _distribution(obj, len(rows), where)
    names = tuple(_context_name(ctx, w) for ctx, w in zip(stored, weights, strict=True))
    return weights, names, probs


def _context_name(ctx: Any, weights: np.ndarray) -> str:
    """A stored context's own name (``name`` or ``level``), else its weights: ``w=(0.3,0.7),cost=0.5``."""
    if isinstance(ctx, ReleaseRecord):
        for key in ("name", "level"):
            if isinstance(ctx.__dict__.get(key), str) and ctx.__dict__[key]:
                return str(ctx.__dict__[key])
    return f"w=({','.join(f'{x:g}' for x in weights[:-1])}),cost={-weights[-1]:g}"


def _mv_contexts(obj: ReleaseRecord, where: str,
                 paper: _PaperContexts) -> tuple[np.ndarray, tuple[str, ...], np.ndarray, str]:
    """The paper's low/mid/high contexts, which a majority-vote record's ``cost_coeffs`` and
    ``context_distribution`` must repeat; absent or unreadable, they are used only when asked."""
    weights, names, cprobs = mv_cost_contexts()
    expected = {n: -float(w) for n, w in zip(names, weights[:, -1], strict=True)}
    paper_set = f"the paper's low/mid/high contexts (cost weights {', '.join(f'{v:g}' for v in expected.values())}, uniform)"
    coeffs = obj.__dict__.get("cost_coeffs")
    try:
        if not isinstance(coeffs, dict):
            raise ReleaseError(f"{where}: the record stores no 'cost_coeffs' dict (got {type(coeffs).__name__})")
        got = {str(k): float(v) for k, v in coeffs.items()}
        stored_probs = _distribution(obj, len(got), where)
    except (TypeError, ValueError, OverflowError) as exc:
        problem = (str(exc).removeprefix(f"{where}: ") if isinstance(exc, ReleaseError)
                   else f"its 'cost_coeffs' are unreadable ({exc})")
        return weights, names, cprobs, paper.fallback(where, problem, paper_set)
    if got != expected:
        raise ReleaseError(f"{where}: cost_coeffs {got} differ from the paper's {expected}; a majority-vote record "
                           "is imported with the paper's contexts only")
    if not np.allclose(stored_probs, cprobs, rtol=0, atol=1e-9):
        raise ReleaseError(f"{where}: context_distribution {stored_probs.tolist()} differs from the paper's uniform "
                           f"{cprobs.tolist()}; a majority-vote record is imported with the paper's contexts only")
    return weights, names, cprobs, f"the record's own, which are {paper_set}"


def _provenance(path: Path, index: int, kind: str) -> dict[str, Any]:
    return {
        "source": f"https://github.com/{RELEASE_REPO}/blob/{RELEASE_COMMIT}/data/{path.name}",
        "source_commit": RELEASE_COMMIT,
        "source_file": path.name,
        "source_index": index,
        "license": RELEASE_LICENSE,
        "build": f"iapo_gym.data.release.read_release ({kind} environment object {index} of {path.name})",
    }


def _mv_table(obj: ReleaseRecord, task: str, attrs: dict[str, Any], where: str, paper: _PaperContexts) -> OutcomeTable:
    train = _array(obj, "cat_probs", 3, where)
    test = _array(obj, "cat_probs_te", 3, where)
    gold_tr = _array(obj, "answers", 1, where, np.int64)
    gold_te = _array(obj, "answers_te", 1, where, np.int64)
    if train.shape[0] != test.shape[0] or train.shape[2] != test.shape[2]:
        raise ReleaseError(f"{where}: cat_probs {train.shape} and cat_probs_te {test.shape} disagree on prompts or buckets")
    if gold_tr.shape[0] != train.shape[1] or gold_te.shape[0] != test.shape[1]:
        raise ReleaseError(f"{where}: answers {gold_tr.shape} / answers_te {gold_te.shape} do not match the "
                           f"queries of cat_probs {train.shape} / cat_probs_te {test.shape}")
    cost = _array(obj, "cost_per_prompt", 1, where)
    weights, names, cprobs, source = _mv_contexts(obj, where, paper)
    attrs = {**attrs, "contexts_source": f"{describe_contexts(weights, cprobs)}: {source}"}
    n_p, n_tr, n_te = train.shape[0], train.shape[1], test.shape[1]
    return OutcomeTable(
        task=task, aggregator="mv", probs=np.concatenate([train, test], axis=1), cost=cost,
        n_max=_n_max(obj, where), context_weights=weights, context_names=names, context_probs=cprobs,
        objective_names=("correct",), gold=np.concatenate([gold_tr, gold_te]),
        prompts=_prompt_names(obj, n_p), queries=tuple(f"train{i}" for i in range(n_tr)) + tuple(f"test{i}" for i in range(n_te)),
        split=_split(n_tr, n_te), attrs=attrs,
    )


def _bon_table(obj: ReleaseRecord, task: str, attrs: dict[str, Any], where: str, paper: _PaperContexts) -> OutcomeTable:
    vec_tr = _array(obj, "outcome_vectors_train", 4, where)
    vec_te = _array(obj, "outcome_vectors_test", 4, where)
    pr_tr = _array(obj, "outcome_probs_train", 3, where)
    pr_te = _array(obj, "outcome_probs_test", 3, where)
    if vec_tr.shape[:3] != pr_tr.shape or vec_te.shape[:3] != pr_te.shape:
        raise ReleaseError(f"{where}: outcome vectors {vec_tr.shape}/{vec_te.shape} do not match "
                           f"outcome probs {pr_tr.shape}/{pr_te.shape}")
    if vec_tr.shape[0] != vec_te.shape[0] or vec_tr.shape[3] != vec_te.shape[3]:
        raise ReleaseError(f"{where}: train {vec_tr.shape} and test {vec_te.shape} outcome vectors "
                           "disagree on prompts or objectives")
    n_m = max(vec_tr.shape[2], vec_te.shape[2])  # pad the smaller atom axis with zero-probability atoms
    vec_tr, pr_tr = _pad_atoms(vec_tr, pr_tr, n_m)
    vec_te, pr_te = _pad_atoms(vec_te, pr_te, n_m)
    k = vec_tr.shape[3]
    try:
        weights, names, cprobs = stored_bon_contexts(obj, k, where)
        source = "the record's own"
    except ReleaseError as exc:
        weights, names, cprobs = bon_grid_contexts()
        paper_set = "the paper's 27 Best-of-N contexts (w1 in 0.1..0.9, w2 = 1 - w1, cost weight 0.1/0.5/1.0, uniform)"
        if k != weights.shape[1] - 1:
            raise ReleaseError(f"{exc}; the paper's Best-of-N contexts weigh 2 objectives, not this record's {k}, "
                               "so they cannot stand in for them") from None
        source = paper.fallback(where, str(exc).removeprefix(f"{where}: "), paper_set)
    attrs = {**attrs, "contexts_source": f"{describe_contexts(weights, cprobs)}: {source}"}
    cost = _array(obj, "cost_per_prompt", 1, where)
    n_p, n_tr, n_te = vec_tr.shape[0], vec_tr.shape[1], vec_te.shape[1]
    objective_names = obj.__dict__.get("objective_names")
    if not (isinstance(objective_names, (list, tuple)) and len(objective_names) == k):
        objective_names = tuple(f"objective_{i + 1}" for i in range(k))
    return OutcomeTable(
        task=task, aggregator="bon", probs=np.concatenate([pr_tr, pr_te], axis=1),
        atoms=np.concatenate([vec_tr, vec_te], axis=1), cost=cost, n_max=_n_max(obj, where),
        context_weights=weights, context_names=names, context_probs=cprobs, objective_names=tuple(objective_names),
        prompts=_prompt_names(obj, n_p), queries=tuple(f"train{i}" for i in range(n_tr)) + tuple(f"test{i}" for i in range(n_te)),
        split=_split(n_tr, n_te), attrs=attrs,
    )


def _pad_atoms(vectors: np.ndarray, probs: np.ndarray, n_m: int) -> tuple[np.ndarray, np.ndarray]:
    extra = n_m - probs.shape[2]
    if extra == 0:
        return vectors, probs
    vectors = np.concatenate([vectors, np.repeat(vectors[:, :, :1], extra, axis=2)], axis=2)
    probs = np.concatenate([probs, np.zeros(probs.shape[:2] + (extra,))], axis=2)
    return vectors, probs


def _sb_table(obj: ReleaseRecord, task: str, attrs: dict[str, Any], where: str, paper: _PaperContexts) -> OutcomeTable:
    parts: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    labels: dict[str, list[str]] = {"train": [], "test": []}
    for split_name, attr in (("train", "success_probs"), ("test", "success_probs_test")):
        tiers = obj.__dict__.get(attr)
        if not isinstance(tiers, dict) or not tiers:
            raise ReleaseError(f"{where}: attribute {attr!r} must be a dict tier -> (P, X) array, got {type(tiers).__name__}")
        for tier, values in tiers.items():
            arr = np.asarray(values, dtype=np.float64)
            if arr.ndim != 2:
                raise ReleaseError(f"{where}: {attr}[{tier!r}] must be a (P, X) array, got shape {arr.shape}")
            parts[split_name].append(arr)
            labels[split_name].extend(f"{split_name}{len(labels[split_name]) + j}-{tier}" for j in range(arr.shape[1]))
    try:
        success = np.concatenate(parts["train"] + parts["test"], axis=1)
    except ValueError as exc:
        raise ReleaseError(f"{where}: success-probability arrays disagree on the number of prompts: {exc}") from None
    if np.any((success < 0) | (success > 1)) or not np.all(np.isfinite(success)):
        raise ReleaseError(f"{where}: success probabilities must lie in [0, 1]")
    n_tr = sum(a.shape[1] for a in parts["train"])
    n_te = sum(a.shape[1] for a in parts["test"])
    weights, names, cprobs, source = _mv_contexts(obj, where, paper)
    attrs = {**attrs, "contexts_source": f"{describe_contexts(weights, cprobs)}: {source}"}
    cost = _array(obj, "cost_per_prompt", 1, where)
    return OutcomeTable(
        task=task, aggregator="mv", probs=np.stack([1.0 - success, success], axis=2), cost=cost,
        n_max=_n_max(obj, where), context_weights=weights, context_names=names, context_probs=cprobs,
        objective_names=("correct",), gold=np.ones(success.shape[1], dtype=np.int64),
        prompts=_prompt_names(obj, success.shape[0]), queries=tuple(labels["train"] + labels["test"]),
        split=_split(n_tr, n_te), attrs=attrs,
    )


def _prompt_names(obj: ReleaseRecord, n_prompts: int) -> tuple[str, ...]:
    prompts = obj.__dict__.get("prompts")
    if isinstance(prompts, (list, tuple)) and len(prompts) == n_prompts and all(isinstance(p, (str, int)) for p in prompts):
        return tuple(p if isinstance(p, str) else f"p{p}" for p in prompts)
    return tuple(f"p{i}" for i in range(n_prompts))


def table_name_for_file(path: str | os.PathLike[str]) -> str | None:
    """The registry's table name for a release file, by its official file name, or None."""
    from iapo_gym.data.registry import RegistryError, entry_for_file

    try:
        entry = entry_for_file(path)
    except RegistryError:
        return None
    return entry.name if entry is not None else None


def read_release(path: str | os.PathLike[str], task: str | None = None, *,
                 paper_contexts: bool = False) -> list[OutcomeTable]:
    """One validated OutcomeTable per environment object in the release file at ``path``.

    ``task`` names the tables (default: from the official file name, else the file stem). Each
    table has its record's own contexts (weights and distribution); a record whose contexts are
    absent or unreadable is refused, unless ``paper_contexts`` asks for the paper's set instead
    (recorded in the table's ``contexts`` attribute). A majority-vote record's contexts must be the
    paper's low/mid/high.
    """
    path = Path(path)
    envs = load_release_objects(path)
    name = task or table_name_for_file(path) or path.stem
    tables = []
    for i, obj in enumerate(envs):
        kind = _env_kind(obj)
        where = f"{path} (object {i}, {obj.__record_class__})"
        attrs = _provenance(path, i, kind or "?")
        build = {"mv": _mv_table, "bon": _bon_table, "sb": _sb_table}[kind or "mv"]
        try:
            tables.append(build(obj, name, attrs, where, _PaperContexts(paper_contexts)))
        except ReleaseError:
            raise
        except TableError as exc:
            raise ReleaseError(f"{where}: the converted table is invalid: {exc}") from None
        except (TypeError, ValueError, OverflowError) as exc:  # attributes of the wrong kind deep inside
            raise ReleaseError(f"{where}: malformed environment object: {type(exc).__name__}: {str(exc)[:200]}") from None
    return tables


def table_file_names(task: str, count: int) -> list[str]:
    """HDF5 file names for ``count`` tables of ``task``: ``task.h5`` for the first, ``task-i1.h5``, ... for the rest."""
    return [f"{task}.h5" if i == 0 else f"{task}-i{i}.h5" for i in range(count)]


def import_release(path: str | os.PathLike[str], task: str | None = None,
                   dest: str | os.PathLike[str] | None = None, *, entry: ReleaseEntry | None = None,
                   paper_contexts: bool = False) -> list[Path]:
    """Convert a release file to HDF5 tables in ``dest`` (default: the user cache); returns the paths.

    The file's git blob id and sha256 are recorded in the tables' provenance, with whether they
    match ``entry`` (default: the registry's entry for the file name). Writes are atomic and
    serialized by a file lock, so concurrent imports of the same task leave one valid table.
    ``paper_contexts`` as in ``read_release``.
    """
    from iapo_gym import paths
    from iapo_gym.data.download import file_hashes, folder_lock
    from iapo_gym.data.registry import RegistryError, entry_for_file

    path = Path(path)
    if entry is None:
        try:
            entry = entry_for_file(path)
        except RegistryError:
            entry = None
    name = task or (entry.name if entry is not None else None) or path.stem
    registered, official = _registered_name(name)
    if registered is not None:  # any accepted form of a registered task writes that task's one file
        name, entry = registered, official
    blob, sha, _ = file_hashes(path)
    verified = bool(entry is not None and blob == entry.git_blob and (entry.sha256 in (None, sha)))
    if registered is not None and not verified:
        raise ReleaseError(_unofficial_message(path, name, entry))
    tables = read_release(path, name, paper_contexts=paper_contexts)
    extra = {"source_git_blob": blob, "source_sha256": sha, "verified": verified}
    folder = Path(dest) if dest is not None else paths.cache_dir()
    out: list[Path] = []
    with folder_lock(folder, name):
        for table, fname in zip(tables, table_file_names(name, len(tables)), strict=True):
            table = replace(table, attrs={**table.attrs, **extra})
            out.append(write_table(table, folder / fname))
    return out


def _registered_name(name: str) -> tuple[str | None, ReleaseEntry | None]:
    """The short name of the registered task ``name`` names (any accepted form) and its release entry;
    (None, None) when ``name`` is a name of its own."""
    from iapo_gym.data.registry import RegistryError, entry_for_task
    from iapo_gym.tasks import get_task

    try:
        spec = get_task(name)
    except ValueError:
        return None, None
    try:
        return spec.name, entry_for_task(spec.name)
    except RegistryError:
        return spec.name, None


def _unofficial_message(path: Path, name: str, entry: ReleaseEntry | None) -> str:
    """Why a file cannot be imported under a registered task's name, and how to use it instead."""
    from iapo_gym.tasks import TASKS

    spec = TASKS[name]
    what = (f"is not the official release file of task {name!r} ({entry.file}, git blob {entry.git_blob})"
            if entry is not None else f"cannot be imported as task {name!r}: its table is generated, not imported")
    own = f"my_{name}"
    return (f"{path} {what}; a table under a registered task's name must be the official one, so nothing was "
            f"written. Import it under a name of its own (`iapo-gym data import {path} --task {own}`) and open "
            f"it with `gym.make({spec.env_id!r}, path=<folder>/{own}.h5)` (or `--tasks <folder>/{own}.h5` "
            f"in the leaderboard)")
