"""The six tasks of the paper: names, ids, and where each task's table comes from."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from iapo_gym.exact import stored
from iapo_gym.paths import cache_dir
from iapo_gym.tables import OutcomeTable, TableError, read_table, write_table
from iapo_gym.tasks.synthetic import GENERATOR_VERSION, GENERATORS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskSpec:
    """A registered task: its short name, Gymnasium id, aggregator and table source."""

    name: str
    env_id: str
    title: str
    aggregator: str
    synthetic: bool
    release_file: str | None = None  # file name in the official IAPO release

    @property
    def table_file(self) -> str:
        """File name of the task's HDF5 table in a data directory."""
        return f"{self.name}.h5"


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("synthetic_bernoulli", "IAPO-SyntheticBernoulli-v0", "Synthetic-Bernoulli", "mv", True, "SB_final.pkl"),
        TaskSpec("math", "IAPO-MATH-v0", "MATH", "mv", False, "MATH_final.pkl"),
        TaskSpec("commonsense_qa", "IAPO-CommonsenseQA-v0", "CommonsenseQA", "mv", False, "CQA_final.pkl"),
        TaskSpec("synthetic_categorical", "IAPO-SyntheticCategorical-v0", "Synthetic-Categorical", "bon", True),
        TaskSpec("helpful_harmless", "IAPO-HelpfulHarmless-v0", "Helpful-Harmless", "bon", False, "HH_final.pkl"),
        TaskSpec("summarization", "IAPO-Summarization-v0", "Summarization", "bon", False, "Summarization_final.pkl"),
    )
}


class MissingTableError(FileNotFoundError):
    """A data-backed task's table is nowhere in the lookup path."""


def task_names(spec: TaskSpec) -> tuple[str, ...]:
    """Every accepted name of ``spec``, normalised: short name, Gymnasium id, its middle part, title, release stem."""
    def norm(text: str) -> str:
        return text.lower().replace("-", "_")

    names = [spec.name, norm(spec.env_id), norm(spec.env_id.split("-")[1]), norm(spec.title)]
    if spec.release_file:
        names.append(norm(spec.release_file.removesuffix(".pkl")))
    return tuple(names)


def get_task(name: str) -> TaskSpec:
    """The TaskSpec for any accepted name (case-insensitive): ``helpful_harmless``, ``IAPO-HelpfulHarmless-v0``,
    ``HelpfulHarmless``, ``Helpful-Harmless`` or the release file stem ``HH_final``; else ValueError listing them."""
    key = str(name).strip().lower().replace("-", "_")
    for spec in TASKS.values():
        if key in task_names(spec):
            return spec
    known = "; ".join(f"{s.name} ({s.env_id})" for s in TASKS.values())
    raise ValueError(f"unknown task {name!r}; known tasks: {known}")


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
    from iapo_gym.data import rebuild_hint, resolve_table
    from iapo_gym.data.registry import entry_for_task

    found = resolve_table(spec)
    try:
        return read_table(found)
    except TableError as exc:  # damage inside a dataset: say how to rebuild the file
        raise TableError(f"{exc}; {rebuild_hint(found, entry_for_task(spec.name))}") from None
