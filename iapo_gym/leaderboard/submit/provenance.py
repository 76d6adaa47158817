"""Where a results folder's runs came from: the inputs a merge recorded and the verify records of bundle files.

A merge writes ``provenance.json`` (every merged input's manifest and verify status), ``iapo-gym verify`` writes
``BUNDLE.verify.json`` beside a bundle, and the report's site shows both. This is the one module that the report
and the submission code (bundle, merge, verify) share.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from iapo_gym.leaderboard.submit.bundle import Bundle, BundleError, load

PROVENANCE = "provenance.json"


class ProvenanceError(ValueError):
    """A ``provenance.json`` that cannot be read; the message names the file and the fault."""


def verify_record_path(bundle_path: str | os.PathLike[str]) -> Path:
    """Where ``iapo-gym verify`` records its outcome for a bundle: ``BUNDLE.verify.json`` beside it."""
    p = Path(bundle_path)
    return p.with_name(p.name + ".verify.json")


def read_verify_record(bundle: Bundle) -> dict[str, Any] | None:
    """The verify record of a bundle file, if one exists beside it and is about this very file."""
    if bundle.sha256 is None:
        return None
    path = verify_record_path(bundle.source)
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or record.get("bundle_sha256") != bundle.sha256:
        return None
    return record


def read_provenance(out_dir: str | os.PathLike[str]) -> list[dict[str, Any]] | None:
    """The inputs recorded in ``out_dir/provenance.json`` by a merge (None if there is none)."""
    path = Path(out_dir) / PROVENANCE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProvenanceError(f"{path} is not JSON ({exc})") from None
    inputs = data.get("inputs") if isinstance(data, dict) else None
    if not isinstance(inputs, list):
        raise ProvenanceError(f"{path} has no list 'inputs'")
    return inputs


def provenance_entries(bundle: Bundle) -> list[dict[str, Any]]:
    """What a report shows about where ``bundle``'s runs came from (a merged folder: its own inputs)."""
    carried = bundle.extra.get("provenance")
    if carried:
        return list(carried)
    manifest = {k: v for k, v in bundle.manifest.items() if k != "files"}
    kind = "bundle" if bundle.sha256 else "folder"
    return [{"name": bundle.name, "kind": kind, "sha256": bundle.sha256, "manifest": manifest,
             "verify": read_verify_record(bundle)}]


def load_source(source: str | os.PathLike[str]) -> Bundle:
    """A bundle file, or a results folder collected as if bundled, carrying the inputs a merge recorded in it."""
    bundle = load(source)
    if Path(source).is_dir():
        bundle.extra["provenance"] = read_provenance(source)
    return bundle


def site_provenance(out_dir: str | Path) -> list[dict[str, Any]]:
    """The inputs merged into ``out_dir`` (provenance.json), or the folder itself described as a bundle."""
    merged = read_provenance(out_dir)
    if merged:
        return merged
    try:
        return provenance_entries(load_source(out_dir))
    except BundleError as exc:
        return [{"name": Path(out_dir).name, "kind": "folder", "sha256": None, "manifest": None,
                 "verify": None, "error": str(exc)}]
