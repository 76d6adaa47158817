"""Where tables live: the lookup order of data directories, created only when written to."""

from __future__ import annotations

import os
from pathlib import Path

from iapo_gym._version import __version__

DATA_ENV = "IAPO_GYM_DATA"
CACHE_ENV = "IAPO_GYM_CACHE"
OFFLINE_ENV = "IAPO_GYM_OFFLINE"


def repo_data_dir() -> Path:
    """The repository's ``data/`` folder (next to the package in a source checkout)."""
    return Path(__file__).resolve().parent.parent / "data"


def cache_dir() -> Path:
    """The user cache for converted and generated tables: ``$IAPO_GYM_CACHE`` or the OS cache, versioned."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    # what pooch.os_cache("iapo-gym") returns (pooch>=1.7 is built on platformdirs), without
    # importing pooch's downloaders (about 50 ms) when a table is only read
    import platformdirs

    return Path(platformdirs.user_cache_dir("iapo-gym")) / __version__


def offline() -> bool:
    """True when ``IAPO_GYM_OFFLINE`` forbids downloads."""
    return os.environ.get(OFFLINE_ENV, "").strip().lower() not in ("", "0", "false", "no")
