"""The JSON Schemas shipped in the package, and one way to check a document against them.

The collection spec (``iapo_gym/llm/spec.schema.json``), the policy file (``iapo_gym/policy.schema.json``)
and a bundle's manifest (``iapo_gym/leaderboard/submit/bundle-schema.json``) are checked here alike:
the validator of the schema's own ``$schema`` draft, built once; of several errors, the shallowest
is reported (a missing table before a bad value inside another), then the first in path order; a
field is named as ``endpoints[0].model``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from importlib import resources
from typing import Any


@cache
def load(package: str, name: str) -> dict[str, Any]:
    """The schema file ``name`` shipped in ``package`` (e.g. ``"iapo_gym.llm"``, ``"spec.schema.json"``)."""
    loaded: dict[str, Any] = json.loads(resources.files(package).joinpath(name).read_text(encoding="utf-8"))
    return loaded


@cache
def validator(package: str, name: str) -> Any:
    """The jsonschema validator of that schema, for the draft its ``$schema`` names; the schema itself is checked."""
    import jsonschema  # imported on the first check: a plain gym.make never needs it

    schema = load(package, name)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def errors(package: str, name: str, doc: Any) -> list[Any]:
    """Every way ``doc`` breaks the schema, the one to report first: shallowest, then in path order."""
    found = list(validator(package, name).iter_errors(doc))
    return sorted(found, key=lambda e: (len(e.absolute_path), [str(p) for p in e.absolute_path]))


def dotted(path: Iterable[Any]) -> str:
    """``endpoints[0].model`` from a JSON path (keys and list indices)."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
