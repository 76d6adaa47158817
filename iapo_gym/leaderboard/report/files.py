"""The report's file formats, shared by the paper protocol's report (``write``) and the online one (``online``):
CSV rows of a dataclass, JSON without non-finite numbers."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any


def jsonable(value: Any) -> Any:
    """``value`` with every non-finite float (nan, inf) as None, in nested dicts, lists and tuples: JSON has no nan."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_csv(path: Path, rows: Sequence[Any], cls: type) -> None:
    """``rows`` (instances of the dataclass ``cls``) as CSV at ``path``: a header of its field names, a row each."""
    names = [f.name for f in fields(cls)]
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(names)
        for row in rows:
            writer.writerow([getattr(row, n) for n in names])
