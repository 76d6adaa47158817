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


class PolicyError(ValueError):
    """Policy JSON that is not ``{"arms": [[prompt, N], ...]}``; the message names the source and the field."""


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
    def from_json(cls, text: str | bytes, source: str = "policy JSON") -> Policy:
        """Inverse of ``to_json``; malformed text raises ``PolicyError`` naming ``source`` (a file name) and the field."""
        try:
            data: Any = json.loads(text)
        except (ValueError, RecursionError) as exc:  # also bad UTF-8, too deep, integers of over 4300 digits
            raise PolicyError(f"{source}: not valid JSON ({str(exc)[:200]})") from None
        arms = data.get("arms") if isinstance(data, dict) else None
        if not isinstance(arms, list):
            raise PolicyError(f"{source}: field 'arms' must be a list of [prompt, N] pairs, got {arms!r}"[:300])
        for c, arm in enumerate(arms):
            if not (isinstance(arm, list) and len(arm) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63 for x in arm)
                    and arm[1] >= 1):
                raise PolicyError(f"{source}: field 'arms[{c}]' must be [prompt index >= 0, N >= 1], got {arm!r}"[:300])
        return cls(tuple((a[0], a[1]) for a in arms))

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
