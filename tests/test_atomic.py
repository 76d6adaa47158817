"""The one atomic write (iapo_gym.atomic): whole or old, never a part, nothing left on failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from iapo_gym.atomic import atomic_directory, atomic_path, atomic_write_bytes, atomic_write_text


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_write_replaces_the_file_with_the_permissions_open_gives(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.json"
    assert atomic_write_bytes(target, b"old") == target  # the folder is created
    assert atomic_write_text(target, "new \u00e9") == target
    assert target.read_bytes() == "new \u00e9".encode()
    plain = tmp_path / "plain"
    plain.write_bytes(b"")  # what open(path, "w") gives under this process's umask (not mkstemp's 0600)
    assert target.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    assert _names(target.parent) == ["f.json"]


def test_a_failure_mid_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "table.h5"
    target.write_bytes(b"old content")
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".table.h5.") and tmp.is_file()
        tmp.write_bytes(b"half of the new")
        raise RuntimeError("disk full")
    assert target.read_bytes() == b"old content"
    assert _names(tmp_path) == ["table.h5"]


def test_two_writers_get_distinct_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "f"
    with atomic_path(target) as a, atomic_path(target) as b:
        assert a != b
        a.write_bytes(b"a")
        b.write_bytes(b"b")
    assert target.read_bytes() == b"a"  # the outer block commits last
    assert _names(tmp_path) == ["f"]


def test_a_failing_table_write_keeps_the_old_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import iapo_gym.tables as tables
    from tests.conftest import tiny_mv_table

    table = tiny_mv_table(seed=1, n_prompts=3, n_queries=8)
    path = tables.write_table(table, tmp_path / "t.h5")
    before = path.read_bytes()

    def broken(_table: object) -> str:  # fails after h5py has written the datasets into the temporary file
        raise OSError("disk full")

    monkeypatch.setattr(tables, "exact_digest", broken)
    with pytest.raises(OSError, match="disk full"):
        tables.write_table(tiny_mv_table(seed=2, n_prompts=3, n_queries=8), path)
    assert path.read_bytes() == before and _names(tmp_path) == ["t.h5"]
    with h5py.File(path, "r") as f:  # still a whole, readable table
        assert f["probs"].shape[0] == 3


_READER = r"""
import sys, time
path, size, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
reads = bad = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    with open(path, "rb") as f:
        data = f.read()
    reads += 1
    if len(data) != size or data.count(data[:1]) != size:
        bad += 1
print(reads, bad)
"""


def test_a_concurrent_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    size = 1 << 20
    target = tmp_path / "f"
    atomic_write_bytes(target, b"a" * size)
    reader = subprocess.Popen([sys.executable, "-c", _READER, str(target), str(size), "1.5"],
                              stdout=subprocess.PIPE, text=True)
    writes = 0
    while reader.poll() is None:
        atomic_write_bytes(target, bytes([97 + writes % 26]) * size)  # each version one repeated byte
        writes += 1
    reads, bad = map(int, reader.communicate()[0].split())
    assert writes > 3 and reads > 3
    assert bad == 0
    assert _names(tmp_path) == ["f"]


_KILLED = r"""
import sys, time
from iapo_gym.atomic import atomic_path
with atomic_path(sys.argv[1]) as tmp, open(tmp, "wb") as f:
    f.write(b"partial new content")
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
"""


def test_a_writer_killed_mid_write_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "policy.json"
    target.write_bytes(b"old")
    child = subprocess.Popen([sys.executable, "-c", _KILLED, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "writing\n"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    assert target.read_bytes() == b"old"
    left = [n for n in _names(tmp_path) if n != "policy.json"]  # the documented leftover of a SIGKILL
    assert len(left) == 1 and left[0].startswith(".policy.json.") and left[0].endswith(".tmp")


def test_a_folder_is_swapped_in_whole(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("old")
    with pytest.raises(ValueError, match="plot failed"), atomic_directory(site) as tmp:
        (tmp / "index.html").write_text("half")
        raise ValueError("plot failed")
    assert (site / "index.html").read_text() == "old" and _names(tmp_path) == ["site"]
    with atomic_directory(site) as tmp:
        (tmp / "index.html").write_text("new")
        assert (site / "index.html").read_text() == "old"  # the old site is served while the new one is built
    assert _names(site) == ["index.html"] and (site / "index.html").read_text() == "new"
    assert _names(tmp_path) == ["site"]
    fresh = tmp_path / "new" / "out"
    with atomic_directory(fresh) as tmp:
        (tmp / "a").write_text("x")
    assert _names(fresh) == ["a"] and _names(fresh.parent) == ["out"]
