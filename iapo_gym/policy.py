"""Deployment policies: a plain table from context index to arm (prompt, N)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

Arm = tuple[int, int]
PolicyLike = Union["Policy", Mapping[int, Sequence[int]], Sequence[Sequence[int]], Callable[[int], Sequence[int]]]


@dataclass(frozen=True)
class Policy:
    """An IAPO policy pi: context index -> (prompt index, N); JSON-serializable and callable."""

    arms: tuple[Arm, ...]

    def __post_init__(self) -> None:
        """Normalise every arm to a pair of Python ints."""
        arms = []
        for c, arm in enumerate(self.arms):
            if len(arm) != 2:
                raise ValueError(f"policy arm for context {c} must be (prompt, N), got {arm!r}")
            arms.append((int(arm[0]), int(arm[1])))
        object.__setattr__(self, "arms", tuple(arms))

    def __call__(self, context: int) -> Arm:
        """The arm chosen in context ``context``."""
        return self.arms[int(context)]

    def __len__(self) -> int:
        return len(self.arms)

    def to_json(self) -> str:
        """JSON text ``{"arms": [[p, N], ...]}``."""
        return json.dumps({"arms": [list(a) for a in self.arms]})

    @classmethod
    def from_json(cls, text: str) -> Policy:
        """Inverse of ``to_json``."""
        data: Any = json.loads(text)
        return cls(tuple(tuple(a) for a in data["arms"]))

    def save(self, path: str | os.PathLike[str], source: Any, *, spec: Any = None,
             learned: Mapping[str, Any] | None = None, estimate: Mapping[str, Any] | None = None) -> Path:
        """Write the deployable policy file (docs/deploy.md) for this policy, learned on env ``source``.

        ``spec``: the collection spec that gives the prompts' texts and the scorer (a live env's own
        by default; a table alone has prompt ids only, and such a file cannot be served). An env with
        an exact oracle adds the exact test values; ``learned`` and ``estimate`` are stored as given.
        """
        from iapo_gym.policyfile import describe

        return describe(self.arms, source, spec=spec, learned=learned, estimate=estimate).save(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Policy:
        """The policy of a policy file, after checking it (schema, consistency, checksum).

        ``iapo_gym.deploy.load_policy`` gives the whole document (prompts, contexts, estimates).
        """
        from iapo_gym.policyfile import load_policy

        return cls(load_policy(path).arms)

    @classmethod
    def coerce(cls, policy: PolicyLike, n_contexts: int) -> Policy:
        """A Policy from a Policy, a {context: arm} mapping, a list of arms or a callable."""
        if isinstance(policy, Policy):
            arms = policy.arms
        elif isinstance(policy, Mapping):
            missing = [c for c in range(n_contexts) if c not in policy]
            if missing:
                raise ValueError(f"policy has no arm for contexts {missing[:5]} (expected all of 0..{n_contexts - 1})")
            arms = tuple(tuple(policy[c]) for c in range(n_contexts))  # type: ignore[misc]
        elif callable(policy):
            arms = tuple(tuple(policy(c)) for c in range(n_contexts))  # type: ignore[misc]
        else:
            arms = tuple(tuple(a) for a in policy)  # type: ignore[misc]
        result = cls(arms)
        if len(result) != n_contexts:
            raise ValueError(f"policy has {len(result)} arms, expected one per context ({n_contexts})")
        return result
