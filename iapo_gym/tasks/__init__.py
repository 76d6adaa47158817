"""The six tasks of the paper: names, ids, aggregators and release files (their tables are found by ``iapo_gym.data``)."""

from __future__ import annotations

from dataclasses import dataclass

#: The version of the table generators (``tasks.synthetic``, ``tasks.generated``): bumped whenever one of them
#: gives another table for some instance or level. Recorded in every generated table's attributes, part of the
#: synthetic tables' cache file names and of a bundle's record of the generated tasks it ran.
GENERATOR_VERSION = 1


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
