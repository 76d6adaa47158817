"""Fetching and resolving tables: a local HTTP server, checksums, dropped connections, locks, corrupt files."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pytest

import iapo_gym.data as data
from iapo_gym.data import ChecksumError, DownloadError, MissingTableError, resolve_table
from iapo_gym.data.download import fetch_release, git_blob_id, release_dir, verify_release_file
from iapo_gym.data.registry import RELEASE_URL_ENV, ReleaseEntry, entries, get_entry
from iapo_gym.tables import TableError, read_table, write_table
from iapo_gym.tasks import TaskSpec, get_task
from tests.conftest import tiny_mv_table
from tests.test_data_release import write_mv_release

FILE = "tiny_final.pkl"


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves ``/good/<file>`` (the bytes), ``/bad/<file>`` (other bytes), ``/drop/<file>`` (cut off midway)."""

    payload = b""
    requests: list[str] = []
    delay = 0.0

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        type(self).requests.append(self.path)
        mode = self.path.strip("/").split("/")[0]
        body = self.payload if mode != "bad" else self.payload[::-1]
        if not self.path.endswith(FILE):
            self.send_error(404)
            return
        time.sleep(self.delay)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if mode == "drop":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        """Keep the test output quiet."""


@pytest.fixture
def release_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small release-format MV pickle written by the test."""
    path = tmp_path / "src" / FILE
    path.parent.mkdir()
    write_mv_release(path, monkeypatch)
    return path


class Server(NamedTuple):
    url: str
    handler: type[_Handler]


@pytest.fixture
def server(release_file: Path) -> Iterator[Server]:
    """An HTTP server on 127.0.0.1 serving the release file; yields its base address and handler class."""
    handler = type("Handler", (_Handler,), {"payload": release_file.read_bytes(), "requests": [], "delay": 0.0})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield Server(f"http://127.0.0.1:{httpd.server_address[1]}", handler)
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Downloads allowed, with a fresh cache; returns the cache folder."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("IAPO_GYM_OFFLINE", "0")
    monkeypatch.setenv("IAPO_GYM_CACHE", str(cache))
    return cache


def _entry(path: Path, with_sha: bool = True) -> ReleaseEntry:
    raw = path.read_bytes()
    return ReleaseEntry(name="tiny_mv", task="tiny_mv", file=FILE, aggregator="mv", git_blob=git_blob_id(path),
                        sha256=hashlib.sha256(raw).hexdigest() if with_sha else None,
                        size=len(raw) if with_sha else None, base_url="http://invalid.example")


def test_git_blob_id_matches_git(tmp_path: Path) -> None:
    path = tmp_path / "hello.txt"
    path.write_bytes(b"hello\n")
    assert git_blob_id(path) == "ce013625030ba8dba906f756967f9e9ca394464a"  # `git hash-object` of "hello\n"


def test_registry_pins_the_release_commit_and_knows_all_five_files() -> None:
    found = entries()
    files = {"MATH_final.pkl", "CQA_final.pkl", "HH_final.pkl", "Summarization_final.pkl", "SB_final.pkl"}
    assert {e.file for e in found} == files
    for e in found:
        assert len(e.git_blob) == 40 and "1a6de0bb29c1e141bcf6283b06023677389cd87f" in e.url()
    assert get_entry("cqa").name == "commonsense_qa" and get_entry("IAPO-MATH-v0").name == "math"
    with pytest.raises(ValueError, match="known tables"):
        get_entry("nope")


def test_registry_hashes_verify_the_shared_math_file(math_release: Path) -> None:
    verify_release_file(math_release, get_entry("math"))
    with pytest.raises(ChecksumError, match="git blob id"):
        verify_release_file(math_release, get_entry("cqa"))


def test_fetch_good_bytes(server: Server, release_file: Path, online: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RELEASE_URL_ENV, f"{server.url}/good")
    path = fetch_release(_entry(release_file))
    assert path == release_dir() / FILE and path.read_bytes() == release_file.read_bytes()
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")) == [FILE]


@pytest.mark.parametrize("with_sha", [True, False], ids=["sha256", "git-blob-only"])
def test_fetch_wrong_bytes_is_deleted(server: Server, release_file: Path, online: Path,
                                      monkeypatch: pytest.MonkeyPatch, with_sha: bool) -> None:
    monkeypatch.setenv(RELEASE_URL_ENV, f"{server.url}/bad")
    with pytest.raises(ChecksumError, match="deleted"):
        fetch_release(_entry(release_file, with_sha))
    folder = release_dir()
    assert not [p for p in folder.iterdir() if not p.name.endswith(".lock")]


def test_fetch_dropped_connection_leaves_nothing(server: Server, release_file: Path, online: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RELEASE_URL_ENV, f"{server.url}/drop")
    with pytest.raises(DownloadError, match="nothing was kept") as info:
        fetch_release(_entry(release_file, with_sha=False))
    assert not isinstance(info.value, ChecksumError)
    assert not [p for p in release_dir().iterdir() if not p.name.endswith(".lock")]


def test_offline_refuses_to_download_and_names_the_command(release_file: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IAPO_GYM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DownloadError, match=f"iapo-gym data import {FILE}"):
        fetch_release(_entry(release_file))
    with pytest.raises(MissingTableError, match=r"iapo-gym data fetch math.*IAPO_GYM_DATA"):
        resolve_table(get_task("math"))
    assert not (tmp_path / "cache").exists()  # looking never creates folders


def test_resolve_downloads_converts_and_reuses(server: Server, release_file: Path, online: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _entry(release_file)
    spec = TaskSpec("tiny_mv", "IAPO-TinyMV-v0", "Tiny", "mv", False, FILE)
    monkeypatch.setattr(data, "entry_for_task", lambda name: entry if name == "tiny_mv" else None)
    monkeypatch.setenv(RELEASE_URL_ENV, f"{server.url}/good")
    path = resolve_table(spec)
    assert path == online / "tiny_mv.h5"
    table = read_table(path)
    assert table.attrs["verified"] is True and table.attrs["source_git_blob"] == entry.git_blob
    monkeypatch.setenv("IAPO_GYM_OFFLINE", "1")  # the second call needs no network
    assert resolve_table(spec) == path


_CHILD = """
import json, sys
from iapo_gym.data import ensure_table
from iapo_gym.data.registry import ReleaseEntry
from iapo_gym.tables import read_table
path = ensure_table(ReleaseEntry(**json.loads(sys.argv[1])))
print(path, read_table(path).n_prompts)
"""


def test_two_processes_fetch_the_same_task(server: Server, release_file: Path, online: Path) -> None:
    entry = _entry(release_file)
    handler = server.handler
    handler.delay = 0.5  # keep the first download in flight while the second process starts
    env = {**os.environ, "IAPO_GYM_OFFLINE": "0", "IAPO_GYM_CACHE": str(online), RELEASE_URL_ENV: f"{server.url}/good"}
    arg = json.dumps(entry.__dict__)
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, arg], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.split() == [str(online / "tiny_mv.h5"), "4"]
    assert len(handler.requests) == 1  # the lock made the second process reuse the first one's download
    assert read_table(online / "tiny_mv.h5").n_prompts == 4
    leftovers = [p.name for p in online.rglob("*") if p.is_file() and ".tmp" in p.name or p.name.endswith(".part")]
    assert leftovers == []


def test_two_processes_import_the_same_file(release_file: Path, tmp_path: Path) -> None:
    dest = tmp_path / "tables"
    code = ("import sys; from iapo_gym.data.release import import_release; "
            "print(import_release(sys.argv[1], task='tiny', dest=sys.argv[2])[0])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(release_file), str(dest)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.strip() == str(dest / "tiny.h5")
    assert read_table(dest / "tiny.h5").n_prompts == 4
    assert sorted(p.name for p in dest.iterdir()) == [".tiny.lock", "tiny.h5"]


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 3])


def test_truncated_table_in_data_folder_names_path_and_rebuild_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "data"
    table = tiny_mv_table()
    path = write_table(table.__class__(**{**_fields(table), "task": "math"}), folder / "math.h5")
    _truncate(path)
    monkeypatch.setenv("IAPO_GYM_DATA", str(folder))
    with pytest.raises(TableError) as info:
        resolve_table(get_task("math"))
    message = str(info.value)
    assert str(path) in message and f"iapo-gym data import MATH_final.pkl --dest {folder}" in message


def test_truncated_table_in_cache_names_fetch_force(release_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("IAPO_GYM_CACHE", str(cache))
    path = write_table(replace(tiny_mv_table(), task="math"), cache / "math.h5")
    _truncate(path)
    with pytest.raises(TableError) as info:
        resolve_table(get_task("math"))
    assert str(path) in str(info.value) and "iapo-gym data fetch math --force" in str(info.value)


def test_wrong_release_file_in_data_folder_is_reported(release_file: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "MATH_final.pkl").write_bytes(release_file.read_bytes())  # right name, wrong bytes
    monkeypatch.setenv("IAPO_GYM_DATA", str(folder))
    monkeypatch.setenv("IAPO_GYM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ChecksumError, match=r"MATH_final\.pkl is not the official MATH_final\.pkl: size"):
        resolve_table(get_task("math"))
    assert not (tmp_path / "cache").exists()


def _fields(table: object) -> dict:
    import dataclasses

    return {f.name: getattr(table, f.name) for f in dataclasses.fields(table) if f.init}  # type: ignore[arg-type]
