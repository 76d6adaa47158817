"""How the package compiles a kernel with numba: one decorator for the core's kernels and the agents'.

``njit`` compiles with ``cache=True`` (the machine code is kept on disk beside the module, so a new
process does not compile again) and ``error_model="numpy"`` (x / 0 gives inf or nan as numpy does,
instead of raising, so a kernel and its numpy reference agree on degenerate rows). No kernel is
parallel or uses fastmath: results do not depend on the thread count (docs/agents.md, "Reproducible
across thread counts").
"""

from __future__ import annotations

from typing import Any

import numba

__all__ = ["njit"]


def njit(fn: Any) -> Any:
    """``fn`` compiled by numba, cached on disk, with numpy's error model (module docstring)."""
    return numba.njit(cache=True, error_model="numpy")(fn)
