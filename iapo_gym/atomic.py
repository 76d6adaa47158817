"""Writing a file atomically: a reader sees the old file or the whole new one, never a part of it.

Every file iapo-gym writes whole (tables, policy files, bundles, downloads, manifests, verify records,
reports) goes through ``atomic_path``: the content goes to a temporary file of a unique name beside
the target (``.NAME.<random>.tmp``), is flushed to the disk (fsync), renamed over the target
(``os.replace``, atomic within one file system) and the folder's new entry is flushed too, so that
after a crash or a power loss the target holds the old content or the new, whole. Any exception
before the rename deletes the temporary file and leaves the old target as it was. Only a process
killed outright (SIGKILL) mid-write leaves its hidden ``.NAME.<random>.tmp`` behind (and the old
target intact): nothing of the process runs then to delete it. Outputs of several files (a merged
results folder, the static site) are built in a temporary folder and swapped in whole
(``atomic_directory``).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: How often a temporary name is drawn again when it is taken (2**48 names: taken only by chance).
_ATTEMPTS = 100


def _sibling(path: Path, suffix: str) -> Path:
    """A hidden name beside ``path`` drawn at random: ``.NAME.<12 hex digits><suffix>``."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}{suffix}")


def _reserve(path: Path, directory: bool = False) -> Path:
    """A new empty file (or folder) beside ``path`` with a name no other writer holds, created with the
    permissions ``open(path, "w")`` (``os.mkdir``) would give: 0666 (0777) less the umask. ``tempfile``'s
    0600 (0700) would hide a shared table, policy file or site from the other users of a folder."""
    for _ in range(_ATTEMPTS):
        tmp = _sibling(path, ".tmp")
        try:
            if directory:
                os.mkdir(tmp, 0o777)
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name beside {path} after {_ATTEMPTS} attempts")


def _fsync(path: Path, directory: bool = False) -> None:
    """Flush the file (or the folder's entries) at ``path`` to the disk."""
    if directory and os.name != "posix":  # a folder cannot be opened for fsync on Windows; its rename is durable
        return
    fd = os.open(path, os.O_RDONLY if directory else os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """The temporary path to write the new content of ``path`` to, committed over ``path`` on leaving.

    For writers that open a file themselves (h5py, zipfile, a downloader): the yielded path exists,
    empty, in ``path``'s folder (created if missing); write it whole, close it, and leave the block.
    Leaving normally fsyncs it, renames it over ``path`` and fsyncs the folder; an exception deletes it
    and re-raises, leaving ``path`` as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _reserve(path)
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent, directory=True)


@contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A new empty folder to fill in place of the folder ``path``, swapped in whole on leaving.

    For outputs of several files (a merged results folder, the static site): the yielded folder is
    a hidden sibling of ``path``. Leaving normally moves the old ``path`` (if any) aside, renames the
    new folder to ``path`` and only then deletes the old one (put back if the rename fails); an
    exception deletes the new folder and leaves ``path`` as it was. A reader may find no ``path``
    between the two renames, never a part of either folder. Its files are not flushed one by one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _reserve(path, directory=True)
    try:
        yield tmp
        old = _sibling(path, ".old")
        if path.exists():
            os.replace(path, old)  # kept until the new folder is in place
        try:
            os.replace(tmp, path)
        except BaseException:
            if old.exists():
                os.replace(old, path)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    _fsync(path.parent, directory=True)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (``atomic_path``); returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically as UTF-8 (``atomic_path``); returns the path."""
    return atomic_write_bytes(path, text.encode("utf-8"))
