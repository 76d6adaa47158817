"""The JSON Schemas shipped in the package, and one way to check a document against them and say what is wrong.

The collection spec (``iapo_gym/llm/spec.schema.json``), the policy file (``iapo_gym/policy.schema.json``)
and a bundle's manifest (``iapo_gym/leaderboard/submit/bundle-schema.json``) are checked here alike:
the validator of the schema's own ``$schema`` draft, built once; of several errors, the shallowest
is reported (a missing table before a bad value inside another), then the first in path order, in
one format (``message``): the file, the field (named as ``endpoints[0].model``), what it must be and
the value it has, e.g. ``spec.toml: field 'endpoint.timeout' must be a finite number > 0, got 0``.
What a field must be is its ``description`` where the schema says its descriptions are written so
(``"x-expected": "description"``, the spec's), else what the failed keyword asks (``an integer``,
``one of 'mv', 'bon'``, ``a number >= 0``, ...). The value of a field marked ``"x-secret"`` is never shown.
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


def check(package: str, name: str, doc: Any, where: str, error: type[Exception]) -> None:
    """Raise ``error`` with ``message`` of the first problem (and how many more there are) when ``doc``
    breaks the schema ``name`` of ``package``; ``where`` names the file."""
    found = errors(package, name, doc)
    if found:
        more = f" ({len(found) - 1} more problem(s))" if len(found) > 1 else ""
        raise error(message(package, name, where, found[0]) + more)


def shown(value: Any) -> str:
    """A value as an error message shows it: its repr, cut to 120 characters."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """A subschema with its local ``$ref`` followed (``#/$defs/name``), its own keywords winning."""
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = schema
        for part in ref[2:].split("/"):
            target = target[part]
        base, own = _resolve(schema, target), {k: v for k, v in node.items() if k != "$ref"}
        merged = {**base, **own}
        if "properties" in base and "properties" in own:  # a table adding fields to the ones it refers to
            merged["properties"] = {**base["properties"], **own["properties"]}
        return merged
    return node


_TYPES = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
          "object": "an object", "array": "a list", "null": "null"}
_BOUNDS = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}


def _expected(kind: str, value: Any) -> str | None:
    """What the failed keyword ``kind`` (with its value in the schema) asks of a value; None for the others."""
    if kind == "type":
        return " or ".join(_TYPES.get(t, t) for t in ([value] if isinstance(value, str) else value))
    if kind == "enum":
        return "one of " + ", ".join(shown(v) for v in value)
    if kind == "const":
        return shown(value)
    if kind in _BOUNDS:
        return f"a number {_BOUNDS[kind]} {value}"
    if kind in ("minLength", "maxLength"):
        return f"a string of {'at least' if kind == 'minLength' else 'at most'} {value} character(s)"
    if kind == "pattern":
        return f"a string matching {value!r}"
    if kind in ("minItems", "maxItems"):
        return f"a list of {'at least' if kind == 'minItems' else 'at most'} {value} item(s)"
    if kind == "uniqueItems":
        return "a list of distinct items"
    return None


def message(package: str, name: str, where: str, error: Any) -> str:
    """One line for the jsonschema ``error`` of a document ``where`` checked against the schema ``name`` of
    ``package``: ``{where}: field 'a.b[0]' must be {what}, got {value}`` (``is missing``, ``is not a known field
    (expected one of ...)``); see the module's docstring for what ``{what}`` is."""
    schema = load(package, name)
    path = list(error.absolute_path)
    kind = error.validator
    if kind == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        return f"{where}: field {dotted([*path, missing[0]])!r} is missing"
    node = _resolve(schema, error.schema) if isinstance(error.schema, dict) else {}
    if kind in ("additionalProperties", "unevaluatedProperties"):
        known = sorted(set(node.get("properties", {})))
        extra = sorted(k for k in error.instance if k not in known)
        return (f"{where}: field {dotted([*path, extra[0]])!r} is not a known field "
                f"(expected one of {', '.join(known)})")
    field = f"field {dotted(path)!r}" if path else "the document"
    if kind == "not" and isinstance(error.validator_value, dict) and set(error.validator_value) == {"required"}:
        names = ", ".join(map(repr, error.validator_value["required"]))
        return f"{where}: {field} must not have {names} (a rule of {name} between fields)"
    what = node.get("description") if schema.get("x-expected") == "description" else None
    what = what or _expected(kind, error.validator_value)
    if what is None:  # jsonschema's own words, with the value cut as ``shown`` cuts it
        text, whole = error.message, repr(error.instance)
        text = shown(error.instance) + text[len(whole):] if text.startswith(whole) else text
        return f"{where}: {field}: {text[:300]}"
    if node.get("x-secret"):
        return f"{where}: {field} must be {what}"
    return f"{where}: {field} must be {what}, got {shown(error.instance)}"


def dotted(path: Iterable[Any]) -> str:
    """``endpoints[0].model`` from a JSON path (keys and list indices)."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
