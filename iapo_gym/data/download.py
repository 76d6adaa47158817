"""Downloading and verifying the official release files (pooch for transfer, sha256 and git blob ids).

A file counts as present only once verified: its git blob id (known for all five files)
and, where known, its sha256 and size must match the registry. Downloads go to a temporary
name and are renamed into place after verification, under a cross-process file lock.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from iapo_gym import paths
from iapo_gym.atomic import atomic_path
from iapo_gym.data.registry import ReleaseEntry
from iapo_gym.paths import OFFLINE_ENV

if TYPE_CHECKING:
    from filelock import FileLock

logger = logging.getLogger(__name__)
_CHUNK = 1 << 20


class DownloadError(RuntimeError):
    """A release file could not be downloaded (network, server or offline mode)."""


class ChecksumError(DownloadError):
    """A release file does not match the hashes in the registry."""


def release_dir() -> Path:
    """Where downloaded release files are kept: ``<cache>/release`` (created only when written)."""
    return paths.cache_dir() / "release"


def file_hashes(path: str | os.PathLike[str]) -> tuple[str, str, int]:
    """(git blob id, sha256, size) of a file, read once in chunks."""
    path = Path(path)
    size = path.stat().st_size
    blob = hashlib.sha1(b"blob %d\0" % size)
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            blob.update(chunk)
            sha.update(chunk)
    return blob.hexdigest(), sha.hexdigest(), size


def git_blob_id(path: str | os.PathLike[str]) -> str:
    """The git blob id of a file: sha1(b"blob <size>\\0" + bytes)."""
    return file_hashes(path)[0]


def verify_release_file(path: str | os.PathLike[str], entry: ReleaseEntry) -> None:
    """Raise ``ChecksumError`` naming the file and the hash that differs unless it matches ``entry``."""
    path = Path(path)
    if not path.is_file():
        raise ChecksumError(f"{path}: no such release file")
    blob, sha, size = file_hashes(path)
    problems = []
    if entry.size is not None and size != entry.size:
        problems.append(f"size {size} bytes, expected {entry.size}")
    if entry.sha256 is not None and sha != entry.sha256:
        problems.append(f"sha256 {sha}, expected {entry.sha256}")
    if blob != entry.git_blob:
        problems.append(f"git blob id {blob}, expected {entry.git_blob}")
    if problems:
        raise ChecksumError(f"{path} is not the official {entry.file}: " + "; ".join(problems))


def is_verified(path: str | os.PathLike[str], entry: ReleaseEntry) -> bool:
    """True when ``path`` is a file matching every known hash of ``entry``."""
    try:
        verify_release_file(path, entry)
    except ChecksumError:
        return False
    return True


def folder_lock(folder: Path, name: str) -> FileLock:
    """A cross-process lock named after ``name`` in ``folder`` (created if needed)."""
    from filelock import FileLock  # imported here: loading an already converted table takes no lock

    folder.mkdir(parents=True, exist_ok=True)
    return FileLock(str(folder / f".{name}.lock"))


def fetch_release(entry: ReleaseEntry, dest: str | os.PathLike[str] | None = None, force: bool = False) -> Path:
    """The verified release file of ``entry`` in ``dest`` (default ``release_dir()``), downloaded if needed.

    With ``force`` an existing file is downloaded again. Raises ``DownloadError`` (offline, network
    failure) or ``ChecksumError`` (wrong bytes; the download is deleted). Nothing partial is left behind.
    """
    folder = Path(dest) if dest is not None else release_dir()
    target = folder / entry.file
    if not force and target.is_file() and is_verified(target, entry):
        return target
    url = entry.url()
    if paths.offline():
        raise DownloadError(f"{entry.file} is needed from {url}, but downloads are off (${OFFLINE_ENV} is set); "
                            f"download it yourself and run `iapo-gym data import {entry.file}`")
    with folder_lock(folder, entry.file):
        if not force and target.is_file() and is_verified(target, entry):
            return target  # another process fetched it while we waited for the lock
        _download(entry, url, target)
    return target


def _download(entry: ReleaseEntry, url: str, target: Path) -> None:
    import pooch

    logger.info("downloading %s to %s", url, target)
    with atomic_path(target) as part:  # renamed into place only once verified; deleted on any failure
        try:
            pooch.HTTPDownloader(progressbar=False)(url, str(part), None)
        except Exception as exc:  # requests/urllib3 connection errors, HTTP errors, disk errors
            raise DownloadError(f"download of {url} failed ({type(exc).__name__}: {exc}); nothing was kept") from exc
        try:
            verify_release_file(part, entry)
        except ChecksumError as exc:
            raise ChecksumError(f"the download of {url} was deleted: {exc}") from None
