"""Deployment policies: a plain table from context index to arm (prompt, N) and stopping rule r (0: fixed N)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union, cast

Arm = tuple[int, int]
PolicyLike = Union["Policy", Mapping[int, Sequence[int]], Sequence[Sequence[int]], Callable[[int], Sequence[int]]]


class PolicyError(ValueError):
    """Policy JSON that is not ``{"arms": [[prompt, N], ...], "rules": [r, ...]}`` ("rules" optional); the message
    names the source and the field."""


@dataclass(frozen=True)
class Policy:
    """An IAPO policy pi: context index -> (prompt index, N) and a stopping rule index; JSON-serializable, callable.

    ``rules[c]`` indexes the env's stopping rules (``IAPOEnv.rules``; 0 is fixed N, the paper's arm). ``arms`` may
    also be given as triples (p, N, r). ``rules`` defaults to 0 in every context, so a policy of the paper's arms is
    written and compared as before.
    """

    arms: tuple[Arm, ...]
    rules: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Normalise every arm to a pair of Python ints and ``rules`` to one int >= 0 per context."""
        arms, rules = [], list(self.rules)
        if rules and len(rules) != len(self.arms):
            raise ValueError(f"policy has {len(rules)} rules for {len(self.arms)} arms; expected one per context")
        for c, arm in enumerate(self.arms):
            if len(arm) == 3 and not self.rules:
                rules.append(int(arm[2]))
            elif len(arm) != 2:
                raise ValueError(f"policy arm for context {c} must be (prompt, N) or (prompt, N, rule), got {arm!r}")
            arms.append((int(arm[0]), int(arm[1])))
        if not rules:
            rules = [0] * len(arms)
        if len(rules) != len(arms):
            raise ValueError("policy arms must be all pairs (prompt, N) or all triples (prompt, N, rule)")
        for c, r in enumerate(rules):
            if isinstance(r, bool) or int(r) != r or int(r) < 0:
                raise ValueError(f"policy rule for context {c} must be an integer >= 0, got {r!r}")
        object.__setattr__(self, "arms", tuple(arms))
        object.__setattr__(self, "rules", tuple(int(r) for r in rules))

    def __call__(self, context: int) -> Arm:
        """The arm (p, N) chosen in context ``context`` (its rule: ``rule``)."""
        return self.arms[int(context)]

    def rule(self, context: int) -> int:
        """The stopping rule index chosen in context ``context`` (0: fixed N)."""
        return self.rules[int(context)]

    @property
    def has_rules(self) -> bool:
        """True when some context stops by a rule other than fixed N."""
        return any(self.rules)

    @property
    def triples(self) -> tuple[tuple[int, int, int], ...]:
        """(p, N, r) per context."""
        return tuple((p, n, r) for (p, n), r in zip(self.arms, self.rules, strict=True))

    def __len__(self) -> int:
        return len(self.arms)

    def to_json(self) -> str:
        """JSON text ``{"arms": [[p, N], ...]}``, plus ``"rules": [r, ...]`` when a context has a rule other than 0."""
        doc: dict[str, Any] = {"arms": [list(a) for a in self.arms]}
        if self.has_rules:
            doc["rules"] = list(self.rules)
        return json.dumps(doc)

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
        rules = data.get("rules", [0] * len(arms))
        if not (isinstance(rules, list) and len(rules) == len(arms)
                and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 1 << 31 for r in rules)):
            raise PolicyError(f"{source}: field 'rules' must be a list of {len(arms)} rule indices >= 0 (one per arm), "
                              f"got {rules!r}"[:300])
        return cls(tuple((a[0], a[1]) for a in arms), tuple(rules))

    def save(self, path: str | os.PathLike[str], source: Any, *, spec: Any = None,
             learned: Mapping[str, Any] | None = None, estimate: Mapping[str, Any] | None = None) -> Path:
        """Write the deployable policy file (docs/deploy.md) for this policy, learned on env ``source``.

        ``spec``: the collection spec that gives the prompts' texts and the scorer (a live env's own
        by default; a table alone has prompt ids only, and such a file cannot be served). An env with
        an exact oracle adds the exact test values; ``learned`` and ``estimate`` are stored as given.
        Each context's stopping rule (``rules``, indices into the source's ``rules``) is written as its ``rule``.
        """
        from iapo_gym.policyfile import describe

        arms = self.triples if self.has_rules else self.arms
        return describe(arms, source, spec=spec, learned=learned, estimate=estimate).save(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Policy:
        """The policy of a policy file, after checking it (schema, consistency, checksum), with each context's
        stopping rule as its index in the aggregator's family (``iapo_gym.rules.default_rules``).

        ``iapo_gym.deploy.load_policy`` gives the whole document (prompts, contexts, estimates).
        """
        from iapo_gym.policyfile import load_policy

        pf = load_policy(path)
        return cls(pf.arms, pf.rule_indices())

    @classmethod
    def coerce(cls, policy: PolicyLike, n_contexts: int) -> Policy:
        """A Policy from a Policy, a {context: arm} mapping, a list of arms or a callable."""
        if isinstance(policy, Policy):
            if len(policy) != n_contexts:
                raise ValueError(f"policy has {len(policy)} arms, expected one per context ({n_contexts})")
            return policy
        elif isinstance(policy, Mapping):
            missing = [c for c in range(n_contexts) if c not in policy]
            if missing:
                raise ValueError(f"policy has no arm for contexts {missing[:5]} (expected all of 0..{n_contexts - 1})")
            arms: tuple[tuple[int, ...], ...] = tuple(tuple(policy[c]) for c in range(n_contexts))
        elif callable(policy):
            arms = tuple(tuple(policy(c)) for c in range(n_contexts))
        else:
            arms = tuple(tuple(a) for a in policy)
        result = cls(cast(tuple[Arm, ...], arms))  # pairs, or triples (p, N, r) that __post_init__ splits
        if len(result) != n_contexts:
            raise ValueError(f"policy has {len(result)} arms, expected one per context ({n_contexts})")
        return result
