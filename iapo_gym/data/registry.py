"""The registry of known tables (``registry.json`` in this package, shipped with it): release files, addresses, hashes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

#: Environment variable overriding the base address of the release files (tests point it at 127.0.0.1).
RELEASE_URL_ENV = "IAPO_GYM_RELEASE_URL"
REGISTRY_FILE = "registry.json"


class RegistryError(ValueError):
    """The registry file is missing or malformed, or names no such table."""


@dataclass(frozen=True)
class ReleaseEntry:
    """One known table: its name, task, release file and the hashes that verify the file."""

    name: str  # table name; the converted table is <name>.h5
    task: str  # iapo_gym.tasks short name
    file: str  # file name in the release
    aggregator: str
    git_blob: str  # sha1 of b"blob <size>\\0" + bytes, known for every file
    sha256: str | None = None
    size: int | None = None
    title: str = ""
    base_url: str = ""

    @property
    def table_file(self) -> str:
        """File name of the converted HDF5 table."""
        return f"{self.name}.h5"

    def url(self) -> str:
        """Download address: ``$IAPO_GYM_RELEASE_URL/<file>`` if set, else the pinned release address."""
        base = os.environ.get(RELEASE_URL_ENV) or self.base_url
        if not base:
            raise RegistryError(f"no download address for {self.file}: the registry gives no base_url "
                                f"and ${RELEASE_URL_ENV} is unset")
        return f"{base.rstrip('/')}/{self.file}"


def registry_path() -> Path:
    """Where the registry is read from: ``registry.json`` inside this package, so every install has it (not a search path)."""
    return Path(__file__).resolve().parent / REGISTRY_FILE


@lru_cache(maxsize=4)
def _load(path: str) -> tuple[dict[str, Any], tuple[ReleaseEntry, ...]]:
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RegistryError(f"the table registry {path} is missing: the installation is incomplete, reinstall iapo-gym") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise RegistryError(f"cannot read the table registry {path}: {exc}") from exc
    release = raw.get("release", {})
    entries = []
    for i, item in enumerate(raw.get("tables", [])):
        try:
            entries.append(ReleaseEntry(
                name=str(item["name"]), task=str(item["task"]), file=str(item["file"]),
                aggregator=str(item["aggregator"]), git_blob=str(item["git_blob"]).lower(),
                sha256=str(item["sha256"]).lower() if item.get("sha256") else None,
                size=int(item["size"]) if item.get("size") is not None else None,
                title=str(item.get("title", "")), base_url=str(release.get("base_url", "")),
            ))
        except (KeyError, TypeError, ValueError) as exc:
            raise RegistryError(f"{path}: table entry {i} is malformed ({exc!r}); "
                                "each needs name, task, file, aggregator, git_blob") from None
    return release, tuple(entries)


def entries() -> tuple[ReleaseEntry, ...]:
    """All known tables, in registry order."""
    return _load(str(registry_path()))[1]


def get_entry(name: str) -> ReleaseEntry:
    """The entry for a table name, task name or title, release file name or its stem ("cqa", "hh"), case-insensitive."""
    from iapo_gym.tasks import get_task

    key = name.strip().lower()
    for entry in entries():
        stem = entry.file.lower().removesuffix(".pkl")
        if key in (entry.name, entry.file.lower(), entry.title.lower(), stem, stem.removesuffix("_final")):
            return entry
    try:
        spec = get_task(name)
    except ValueError:
        spec = None
    if spec is not None:
        for entry in entries():
            if entry.name == spec.name:
                return entry
    raise RegistryError(f"no known table {name!r}; known tables: {', '.join(e.name for e in entries())}")


def entry_for_task(task: str) -> ReleaseEntry | None:
    """The entry whose converted table serves task ``task`` directly, or None."""
    for entry in entries():
        if entry.name == task:
            return entry
    return None


def entry_for_file(path: str | os.PathLike[str]) -> ReleaseEntry | None:
    """The entry of a release file, by its file name, or None."""
    name = Path(path).name
    for entry in entries():
        if entry.file == name:
            return entry
    return None
