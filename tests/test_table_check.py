"""Table files from others are read in a child process first: a corrupt HDF5 file that makes the
HDF5 C library crash or loop becomes a TableError naming the file, and this process goes on.

The two fixtures are byte-level corruptions of small synthetic tables (tests/conftest.py) found by
the hdf5_table_bytes fuzzer: read in this process, one crashed it with a segmentation fault and the
other never returned.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from iapo_gym.cli import main
from iapo_gym.tables import TableError, check_table_file, read_table, write_table
from tests.conftest import tiny_mv_table

FIXTURES = Path(__file__).parent / "fixtures"
CRASHES = FIXTURES / "corrupt_crashes_hdf5.h5"
HANGS = FIXTURES / "corrupt_hangs_hdf5.h5"


def test_a_valid_table_passes(tmp_path: Path) -> None:
    path = write_table(tiny_mv_table(seed=1, n_queries=6), tmp_path / "ok.h5")
    check_table_file(path)
    assert read_table(path).probs.shape[1] == 6


def test_a_file_that_crashes_hdf5_is_refused_here(tmp_path: Path) -> None:
    with pytest.raises(TableError, match="corrupt_crashes_hdf5.h5") as info:
        check_table_file(CRASHES, timeout=30)
    assert "crashed" in str(info.value) or "not a readable" in str(info.value)


def test_a_file_that_hangs_hdf5_is_refused_within_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(TableError, match="corrupt_hangs_hdf5.h5") as info:
        check_table_file(HANGS, timeout=3)
    assert time.monotonic() - start < 20
    assert "did not finish within 3 s" in str(info.value) or "not a readable" in str(info.value)


def test_a_cleanly_refused_file_keeps_the_readers_message(tmp_path: Path) -> None:
    bad = tmp_path / "empty.h5"
    bad.write_bytes(b"not an hdf5 file at all")
    with pytest.raises(TableError, match="empty.h5"):
        check_table_file(bad)
    with pytest.raises(TableError, match="no such table file"):
        check_table_file(tmp_path / "absent.h5")


def test_data_check_and_show_refuse_corrupt_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write_table(tiny_mv_table(seed=2, n_queries=4), tmp_path / "good.h5")
    assert main(["data", "check", str(good)]) == 0
    assert "ok: " in capsys.readouterr().out
    assert main(["data", "check", str(good), str(CRASHES), "--timeout", "30"]) == 1
    out = capsys.readouterr().out
    assert "NOT A VALID TABLE" in out and "corrupt_crashes_hdf5.h5" in out
    assert main(["data", "show", str(CRASHES)]) != 0
    assert "corrupt_crashes_hdf5.h5" in capsys.readouterr().err
