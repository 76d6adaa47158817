"""Data layer: finding, fetching and importing the tables of the data-backed tasks."""

from __future__ import annotations

from pathlib import Path

from iapo_gym.paths import search_dirs
from iapo_gym.tasks import MissingTableError, TaskSpec, find_table


def resolve_table(spec: TaskSpec) -> Path:
    """The table file of a data-backed task, or MissingTableError saying how to get it."""
    found = find_table(spec)
    if found is not None:
        return found
    looked = ", ".join(str(d) for d in search_dirs())
    raise MissingTableError(
        f"no table for task {spec.name!r} ({spec.table_file}) in {looked}; import the official "
        f"release file with `iapo-gym data import {spec.release_file}` or pass path=..."
    )
