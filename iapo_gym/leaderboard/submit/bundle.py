"""Result bundles: one archive with a sweep's runs and the provenance needed to trust and re-run them.

A bundle (``NAME.iapo.zip`` or ``NAME.iapo.tar.gz``) holds exactly three members:

- ``manifest.json``  the provenance (schema ``bundle-schema.json`` beside this module, ``BUNDLE_SCHEMA_VERSION``):
  software versions, protocol parameters (root seed, train fraction, budgets, runs), per task its
  table digests (``table_checksum``) and the release file's git blob id, per agent its spec,
  parameters and a sha256 of its source modules, and the sha256 of the two other members;
- ``results.jsonl``  one ``RunResult`` per line, as stored in ``results.sqlite``;
- ``tasks.jsonl``    one ``TaskInfo`` per line.

Bundles are read in memory, never extracted: members with unsafe names (``../x``, absolute
paths), unknown members, a newer schema version or digests that do not match are refused.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import math
import os
import platform
import sys
import tarfile
import time
import zipfile
import zlib
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

import numpy as np

from iapo_gym import schemas
from iapo_gym._version import __version__
from iapo_gym.atomic import atomic_path
from iapo_gym.data.download import file_hashes
from iapo_gym.leaderboard.run.online import OnlineRunResult, read_online
from iapo_gym.leaderboard.run.specs import AgentSpec
from iapo_gym.leaderboard.run.store import DB_NAME, ResultStore, RunResult, TaskInfo
from iapo_gym.leaderboard.submit.online import ONLINE_MEMBER, ONLINE_SCHEMA_VERSION, online_jsonl, online_manifest

BUNDLE_FORMAT = "iapo-gym-bundle"
#: Version of the manifest schema this iapo-gym writes and the newest it reads.
BUNDLE_SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
RESULTS = "results.jsonl"
TASKS = "tasks.jsonl"
MEMBERS = (MANIFEST, RESULTS, TASKS)
SUFFIXES = (".zip", ".tar.gz", ".tgz")
#: Refuse members larger than this (a bundle of 10^6 runs is about 1 GB).
MAX_MEMBER_BYTES = 2 << 30
#: Refuse bundles whose members' declared sizes add up past this, before reading any: the most a
#: bundle's members take in memory while being read (the archive reader holds them all at once).
MAX_BUNDLE_BYTES = 3 << 30
#: Refuse archives with more entries than this (a bundle has three files, and maybe folders).
MAX_MEMBERS = 64


class BundleError(ValueError):
    """A bundle that cannot be read or trusted; the message names the file and the cause."""


@dataclass
class Bundle:
    """A sweep's runs with their provenance: read from a bundle file or collected from a results folder."""

    manifest: dict[str, Any]
    results: list[RunResult]
    tasks: list[TaskInfo]
    source: str  # the bundle file or folder it came from (as given)
    sha256: str | None = None  # of the bundle file (None for a folder)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The file or folder name (not the machine's path)."""
        return Path(self.source).name


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


# ---- agent sources ---------------------------------------------------------------------------


def agent_class(name: str) -> type:
    """The class of a registered agent name or a ``module:Class`` path."""
    from agents.base import REGISTRY, load_class

    return load_class(REGISTRY[name][0] if name in REGISTRY else name)


def _source_modules(cls: type) -> list[ModuleType]:
    """The modules whose code defines the agent: the class's module, those of its base classes in the
    same top-level package, and every module of that package they reference (transitively)."""
    packages = {cls.__module__.split(".")[0]}
    roots = [sys.modules[k.__module__] for k in inspect.getmro(cls)
             if k.__module__ in sys.modules and k.__module__.split(".")[0] in packages]
    seen: dict[str, ModuleType] = {}
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module.__name__ in seen or not getattr(module, "__file__", None):
            continue
        seen[module.__name__] = module
        for value in list(vars(module).values()):
            ref = value if isinstance(value, ModuleType) else sys.modules.get(getattr(value, "__module__", "") or "")
            if isinstance(ref, ModuleType) and ref.__name__.split(".")[0] in packages and ref.__name__ not in seen:
                todo.append(ref)
    return [seen[k] for k in sorted(seen)]


def agent_source_digest(name: str) -> dict[str, Any]:
    """``{"sha256": combined, "modules": {module: sha256 of its file}}`` of an agent's source modules."""
    return source_digest(agent_class(name))


def source_digest(cls: type) -> dict[str, Any]:
    """``agent_source_digest`` of a class (the online protocol's agents are looked up by their own registry)."""
    modules = {}
    for module in _source_modules(cls):
        modules[module.__name__] = file_hashes(str(module.__file__))[1]
    combined = sha256_bytes(json.dumps(modules, sort_keys=True).encode())
    return {"sha256": combined, "modules": modules}


# ---- tables ----------------------------------------------------------------------------------


def _release_blob(task: str, digests: set[str]) -> str | None:
    """The git blob id of the release file the task's table here was converted from, if that table
    is the one the runs used (its digest is among ``digests``); None otherwise."""
    from iapo_gym.tasks import TASKS

    spec = TASKS.get(task)
    if spec is None or spec.synthetic:
        return None
    try:
        from iapo_gym.data import resolve_table
        from iapo_gym.leaderboard.run.specs import table_checksum
        from iapo_gym.tables import read_metadata, read_table

        path = resolve_table(spec)
        blob = read_metadata(path).get("source_git_blob")
        if not blob or table_checksum(read_table(path)) not in digests:
            return None
        return str(blob)
    except (OSError, ValueError, LookupError):
        return None


def _generated_entry(task: str) -> dict[str, Any] | None:
    """What rebuilds a generated task's levels: family, first and last level, generator version (None otherwise)."""
    from iapo_gym.leaderboard.run.specs import GENERATED_PREFIX, resolve_generated
    from iapo_gym.tasks import GENERATOR_VERSION

    if not task.startswith(GENERATED_PREFIX):
        return None
    try:
        ref = resolve_generated(task)
    except ValueError:
        return None
    assert ref.family is not None and ref.levels is not None
    return {"family": ref.family, "levels": list(ref.levels), "one_level_per_run": ref.synthetic,
            "generator_version": GENERATOR_VERSION}


# ---- building --------------------------------------------------------------------------------


def numeric_stack() -> dict[str, Any]:
    """What a run's floating-point results can depend on beyond iapo-gym, numpy and Python: the numba version
    (it compiles the agents' kernels) and each loaded BLAS (vendor, version and the CPU kernel it chose: a product
    may round by the kernel): those numpy and scipy load, both loaded first, so that every process lists the same.
    ``verify`` names a difference in them where a run does not match."""
    from importlib.metadata import version

    import scipy.linalg  # noqa: F401  (loads scipy's BLAS)
    from threadpoolctl import threadpool_info

    blas = sorted({(str(lib.get("internal_api")), str(lib.get("version")), str(lib.get("architecture")))
                   for lib in threadpool_info() if lib.get("user_api") == "blas"})
    return {"numba": version("numba"),
            "blas": [{"vendor": vendor, "version": ver, "architecture": arch} for vendor, ver, arch in blas]}


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def build_manifest(results: list[RunResult], tasks: list[TaskInfo], meta: dict[str, str | None],
                   files: dict[str, str], online: list[OnlineRunResult] | None = None) -> dict[str, Any]:
    """The provenance of ``results`` (see the module docstring); ``files`` maps member name -> sha256.

    ``online``: the folder's online runs (``submit.online``): the manifest gains their ``online`` section and
    schema version 2; a folder of online runs only records no train fraction (null) and no paper runs."""
    if not results and not online:
        raise BundleError("no runs to bundle")
    if meta.get("root_seed") is None or (results and meta.get("train_fraction") is None):
        raise BundleError("the results database records no root seed or train fraction")
    infos = {t.task: t for t in tasks}
    task_entries = []
    for task in sorted({r.task for r in results}):
        rows = [r for r in results if r.task == task]
        digests = sorted({r.table_sha256 for r in rows})
        info = infos.get(task)
        synthetic = all(r.split_seed is None for r in rows)
        entry: dict[str, Any] = {
            "name": task, "title": info.title if info else task, "synthetic": synthetic,
            "table_sha256": digests, "release_git_blob": _release_blob(task, set(digests)),
            "runs": sorted({r.run for r in rows}), "budgets": sorted({r.budget for r in rows}), "n_results": len(rows),
        }
        generated = _generated_entry(task)
        if generated is not None:
            entry["generated"] = generated
        arm_sets = {r.arm_set for r in rows}
        if len(arm_sets) > 1:
            raise BundleError(f"task {task!r} has runs over different arm sets ({', '.join(sorted(map(str, arm_sets)))}); "
                              "a bundle holds one arm set per task")
        if rows[0].arm_set is not None:
            entry["rules"] = json.loads(rows[0].arm_set)
        task_entries.append(entry)
    agent_entries = []
    for name, params, label in sorted({(r.agent, r.params, r.label) for r in results}):
        spec = AgentSpec(name, json.loads(params), label)
        try:
            source = agent_source_digest(name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise BundleError(f"cannot read the source of agent {spec.spec!r}: {exc}") from None
        agent_entries.append({"name": name, "params": spec.params, "label": label, "spec": spec.spec, "source": source})
    fraction = None if meta.get("train_fraction") is None else float(str(meta["train_fraction"]))
    protocol: dict[str, Any] = {"root_seed": int(str(meta["root_seed"])), "train_fraction": fraction,
                                "budgets": sorted({r.budget for r in results}), "runs": len({r.run for r in results})}
    if any(r.arm_set is not None for r in results):
        if not all(r.arm_set is not None for r in results):
            raise BundleError("the runs mix the paper's (p, N) arms and (p, N, rule) arms; bundle each arm set apart")
        protocol["arm_set"] = "rules"  # absent: the paper's (p, N) (manifests of such runs are unchanged)
    manifest = {
        "format": BUNDLE_FORMAT, "schema_version": BUNDLE_SCHEMA_VERSION, "created_at": _utc_now(),
        "software": {"iapo_gym": __version__, "python": platform.python_version(), "numpy": np.__version__,
                     "platform": platform.platform(terse=True), "result_versions": sorted({r.version for r in results}),
                     **numeric_stack()},
        "protocol": protocol,
        "n_results": len(results), "tasks": task_entries, "agents": agent_entries, "files": files,
    }
    if online:
        try:
            manifest["online"] = online_manifest(online, tasks, meta, source_digest)
        except ValueError as exc:
            raise BundleError(str(exc)) from None
        manifest["schema_version"] = ONLINE_SCHEMA_VERSION
    return manifest


def _result_row(r: RunResult) -> dict[str, Any]:
    """A run as a results.jsonl row; ``arm_set`` only in a run over rules (rows of (p, N) runs are unchanged)."""
    row = asdict(r)
    if row["arm_set"] is None:
        del row["arm_set"]
    return row


def _results_jsonl(results: list[RunResult]) -> bytes:
    return "".join(json.dumps(_result_row(r), sort_keys=True) + "\n" for r in results).encode()


def _tasks_jsonl(tasks: list[TaskInfo]) -> bytes:
    return "".join(json.dumps(asdict(t), sort_keys=True) + "\n" for t in tasks).encode()


def collect(out_dir: str | os.PathLike[str]) -> Bundle:
    """The runs of a results folder with a freshly built manifest (what ``bundle`` would write)."""
    with ResultStore(out_dir, create=False) as store:
        results = store.results()
        tasks = store.tasks()
        meta = {"root_seed": store.get_meta("root_seed"), "train_fraction": store.get_meta("train_fraction"),
                "online_batch_size": store.get_meta("online_batch_size")}
    online = read_online(out_dir)
    files = {RESULTS: sha256_bytes(_results_jsonl(results)), TASKS: sha256_bytes(_tasks_jsonl(tasks))}
    if online:
        files[ONLINE_MEMBER] = sha256_bytes(online_jsonl(online))
    bundle = Bundle(build_manifest(results, tasks, meta, files, online), results, tasks, str(out_dir))
    if online:
        bundle.extra["online"] = online
    return bundle


def archive_kind(path: str | os.PathLike[str]) -> str:
    """``"zip"`` or ``"tar"`` from the file name; a ValueError names the expected suffixes."""
    name = Path(path).name.lower()
    if name.endswith(".zip"):
        return "zip"
    if name.endswith((".tar.gz", ".tgz")):
        return "tar"
    raise BundleError(f"bundle name {Path(path).name!r} must end in .zip or .tar.gz (e.g. NAME.iapo.zip)")


def write_bundle(out_dir: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Bundle the results folder ``out_dir`` into ``target`` (.zip or .tar.gz), written atomically."""
    kind = archive_kind(target)
    bundle = collect(out_dir)
    members = {MANIFEST: json.dumps(bundle.manifest, indent=1, sort_keys=True).encode() + b"\n",
               RESULTS: _results_jsonl(bundle.results), TASKS: _tasks_jsonl(bundle.tasks)}
    if bundle.extra.get("online"):
        members[ONLINE_MEMBER] = online_jsonl(bundle.extra["online"])
    target = Path(target)
    with atomic_path(target) as tmp, tmp.open("wb") as fh:
        if kind == "zip":
            with zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_DEFLATED) as zf:
                for name, data in members.items():
                    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                    info.compress_type = zipfile.ZIP_DEFLATED
                    zf.writestr(info, data)
        else:
            with tarfile.open(fileobj=fh, mode="w:gz") as tf:
                for name, data in members.items():
                    tinfo = tarfile.TarInfo(name)
                    tinfo.size = len(data)
                    tinfo.mode = 0o644
                    tf.addfile(tinfo, io.BytesIO(data))
    return target


# ---- reading ---------------------------------------------------------------------------------


def _check_member_name(path: Path, name: str) -> None:
    pure = PurePosixPath(name.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or (len(name) > 1 and name[1] == ":"):
        raise BundleError(f"{path.name}: refusing unsafe member name {name!r} (absolute or containing '..')")


def _check_sizes(path: Path, sizes: list[tuple[str, int]]) -> None:
    """Refuse, before anything is decompressed, too many members or declared sizes past the limits."""
    if len(sizes) > MAX_MEMBERS:
        raise BundleError(f"{path.name}: {len(sizes)} or more members, more than the limit of {MAX_MEMBERS}")
    total = 0
    for name, size in sizes:
        if size > MAX_MEMBER_BYTES:
            raise BundleError(f"{path.name}: member {name!r} is {size} bytes, more than the limit of {MAX_MEMBER_BYTES}")
        total += size
    if total > MAX_BUNDLE_BYTES:
        raise BundleError(f"{path.name}: members add up to {total} bytes, more than the limit of {MAX_BUNDLE_BYTES}")


def _read_zip_member(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """A deflated (or stored) member, inflated 64 KiB at a time: zipfile stops at the declared size, so a
    member whose header understates it takes no more memory than declared (a whole-member read would
    inflate each compressed chunk in one go, and bzip2 or lzma whole blocks of any size)."""
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise BundleError(f"{path.name}: member {info.filename!r} uses compression method {info.compress_type}; "
                          "bundles are deflated (or stored)")
    chunks = []
    with zf.open(info) as fh:
        while chunk := fh.read(1 << 16):
            chunks.append(chunk)
    return b"".join(chunks)


def _read_members(path: Path) -> dict[str, bytes]:
    """The members of a bundle file, read in memory after checking their names, kinds, count and sizes."""
    kind = archive_kind(path)
    out: dict[str, bytes] = {}
    try:
        if kind == "zip":
            with zipfile.ZipFile(path) as zf:
                infos = zf.infolist()
                for info in infos:
                    _check_member_name(path, info.filename)
                _check_sizes(path, [(i.filename, i.file_size) for i in infos])
                _check_member_set(path, [i.filename for i in infos if not i.is_dir()])
                for info in infos:
                    if not info.is_dir():
                        out[info.filename] = _read_zip_member(path, zf, info)
        else:
            with tarfile.open(path, mode="r:gz") as tf:
                tinfos: list[tarfile.TarInfo] = []
                for tinfo in tf:  # lazily: each header is checked before the next one is decompressed
                    _check_member_name(path, tinfo.name)
                    if not (tinfo.isfile() or tinfo.isdir()):
                        raise BundleError(f"{path.name}: refusing member {tinfo.name!r}: not a regular file")
                    tinfos.append(tinfo)
                    _check_sizes(path, [(t.name, t.size) for t in tinfos])
                _check_member_set(path, [t.name for t in tinfos if t.isfile()])
                for tinfo in tinfos:
                    if tinfo.isfile():
                        fh = tf.extractfile(tinfo)
                        assert fh is not None
                        out[tinfo.name] = fh.read()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, tarfile.TarError, EOFError, OSError, zlib.error,
            NotImplementedError, RuntimeError) as exc:  # RuntimeError: an encrypted zip member
        if isinstance(exc, FileNotFoundError):
            raise BundleError(f"no bundle at {path}") from None
        raise BundleError(f"{path.name} is not a readable {kind} archive (truncated or corrupt?): {exc}") from None
    return out


def _check_member_set(path: Path, names: list[str]) -> None:
    if MANIFEST not in names:
        raise BundleError(f"{path.name} is not an iapo-gym bundle: it has no {MANIFEST} "
                          f"(members: {', '.join(sorted(names)[:5]) or 'none'})")
    unknown = sorted(set(names) - set(MEMBERS) - {ONLINE_MEMBER})
    if unknown:
        raise BundleError(f"{path.name}: unexpected member(s) {', '.join(map(repr, unknown))}; "
                          f"a bundle holds only {', '.join(MEMBERS)}")
    missing = [m for m in MEMBERS if m not in names]
    if missing:
        raise BundleError(f"{path.name}: missing member(s) {', '.join(missing)}")
    if len(names) != len(set(names)):
        raise BundleError(f"{path.name}: duplicate member names")


#: The manifest's JSON Schema, shipped in the package (the one copy; docs/leaderboard.md links to it).
SCHEMA_FILE = "bundle-schema.json"


def validate_manifest(manifest: Any, where: str = "bundle") -> dict[str, Any]:
    """Check the manifest against ``bundle-schema.json``; a BundleError names the first bad field and what was expected.

    A manifest of a newer schema version than this iapo-gym knows is refused with that said, before the schema.
    """
    if not isinstance(manifest, dict):
        raise BundleError(f"{where}: {MANIFEST} must hold a JSON object")
    fmt = manifest.get("format")
    if fmt != BUNDLE_FORMAT:
        raise BundleError(f"{where} is not an iapo-gym bundle: manifest format {fmt!r}, expected {BUNDLE_FORMAT!r}")
    version = manifest.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > ONLINE_SCHEMA_VERSION:
        raise BundleError(f"{where}: manifest schema version {version} is newer than this iapo-gym "
                          f"({__version__}) reads (up to {ONLINE_SCHEMA_VERSION}); upgrade iapo-gym")
    schemas.check("iapo_gym.leaderboard.submit", SCHEMA_FILE, manifest, f"{where}: {MANIFEST}", BundleError)
    return manifest


def _row_value(kind: str, value: Any) -> tuple[bool, Any]:
    """(whether ``value`` is of the declared field type ``kind``, the value as stored)."""
    if kind in ("int | None", "str | None") and value is None:
        return True, None
    if kind in ("int", "int | None"):
        return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < (1 << 63), value
    if kind == "float":
        try:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        except OverflowError:  # an integer beyond the float range
            ok = False
        return ok, float(value) if ok else value
    if kind == "tuple[str, ...]":
        ok = isinstance(value, list) and all(isinstance(v, str) and _utf8(v) for v in value)
        return ok, tuple(value) if ok else value
    return isinstance(value, str) and _utf8(value), value


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape
        return False
    return True


#: Row fields written only when set (``_result_row``), with the rows that have them.
_WRITTEN_WHEN_SET = {"arm_set": "runs over stopping rules (--rules)"}


def _parse_rows(where: str, member: str, data: bytes, cls: type) -> list[Any]:
    """The rows of a JSON-lines member: each has every field of ``cls`` (those with a default may be absent:
    bundles written before them still read)."""
    kinds = {f.name: str(f.type) for f in fields(cls)}
    names = set(kinds)
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    rows = []
    for lineno, line in enumerate(data.decode("utf-8", errors="strict").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise BundleError(f"{where}: {member} line {lineno} is not JSON ({exc})") from None
        if not isinstance(obj, dict) or not required <= set(obj) <= names:
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            older = names - required - set(_WRITTEN_WHEN_SET)
            optional = f" (optional: {sorted(older)})" if older else ""
            also = "".join(f"; {what} also have {name!r}" for name, what in _WRITTEN_WHEN_SET.items() if name in names)
            raise BundleError(f"{where}: {member} line {lineno} must have the fields {sorted(required)}{optional}, "
                              f"got {got}{also}")
        for name in list(obj):
            kind = kinds[name]
            ok, obj[name] = _row_value(kind, obj[name])
            if not ok:
                raise BundleError(f"{where}: {member} line {lineno} field {name!r} must be {kind} "
                                  f"(finite, 64-bit, UTF-8), got {obj[name]!r}"[:300])
        if cls is RunResult:
            try:
                params = json.loads(obj["params"])
            except (ValueError, RecursionError):
                params = None
            if not isinstance(params, dict):
                raise BundleError(f"{where}: {member} line {lineno} field 'params' must be a JSON object, "
                                  f"got {obj['params']!r}"[:300])
        rows.append(cls(**obj))
    return rows


def read_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Read and check a bundle file (never extracted); a BundleError says what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise BundleError(f"no bundle file at {path}")
    members = _read_members(path)
    where = path.name
    try:
        manifest = json.loads(members[MANIFEST])
    except (ValueError, RecursionError) as exc:  # also bad UTF-8 and integers of over 4300 digits
        raise BundleError(f"{where}: {MANIFEST} is not JSON ({exc})") from None
    validate_manifest(manifest, where)
    for member in (RESULTS, TASKS):
        digest = sha256_bytes(members[member])
        if digest != manifest["files"][member]:
            raise BundleError(f"{where}: {member} has sha256 {digest}, but the manifest records "
                              f"{manifest['files'][member]} (the member was changed after bundling)")
    try:
        results = _parse_rows(where, RESULTS, members[RESULTS], RunResult)
        tasks = _parse_rows(where, TASKS, members[TASKS], TaskInfo)
    except UnicodeDecodeError as exc:
        raise BundleError(f"{where}: a member is not UTF-8 text ({exc})") from None
    if len(results) != manifest["n_results"]:
        raise BundleError(f"{where}: {RESULTS} has {len(results)} runs, the manifest says {manifest['n_results']}")
    bundle = Bundle(manifest, results, tasks, str(path), file_hashes(path)[1])
    _read_online(where, manifest, members, bundle)
    return bundle


def _read_online(where: str, manifest: dict[str, Any], members: dict[str, bytes], bundle: Bundle) -> None:
    """Check and parse the member ``online.jsonl`` into ``bundle.extra["online"]`` (``submit.online``): present
    exactly when the manifest has an ``online`` section, its digest the manifest's, its rows as many as it says."""
    section = manifest.get("online")
    if (section is None) != (ONLINE_MEMBER not in members) or (section is None) != (ONLINE_MEMBER not in manifest["files"]):
        raise BundleError(f"{where}: the manifest's 'online' section, its files entry and the member {ONLINE_MEMBER} "
                          "must be present together")
    if section is None:
        if not bundle.results:
            raise BundleError(f"{where}: the bundle holds no runs")
        return
    digest = sha256_bytes(members[ONLINE_MEMBER])
    if digest != manifest["files"][ONLINE_MEMBER]:
        raise BundleError(f"{where}: {ONLINE_MEMBER} has sha256 {digest}, but the manifest records "
                          f"{manifest['files'][ONLINE_MEMBER]} (the member was changed after bundling)")
    try:
        rows = _parse_rows(where, ONLINE_MEMBER, members[ONLINE_MEMBER], OnlineRunResult)
    except UnicodeDecodeError as exc:
        raise BundleError(f"{where}: a member is not UTF-8 text ({exc})") from None
    if len(rows) != section["n_results"]:
        raise BundleError(f"{where}: {ONLINE_MEMBER} has {len(rows)} runs, the manifest says {section['n_results']}")
    bundle.extra["online"] = rows


def load(source: str | os.PathLike[str]) -> Bundle:
    """A bundle file, or a results folder (``DIR`` holding results.sqlite) collected as if bundled."""
    path = Path(source)
    if path.is_dir():
        if not (path / DB_NAME).is_file():
            raise BundleError(f"{path} is a folder without {DB_NAME}: not a leaderboard results folder")
        return collect(path)
    return read_bundle(path)
