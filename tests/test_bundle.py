"""Result bundles, merge and verify on tiny real sweeps: round trips, tampering caught, bad input refused."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import sqlite3
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iapo_gym.cli import main
from iapo_gym.leaderboard.report.model import display_path
from iapo_gym.leaderboard.run.runner import run_sweep
from iapo_gym.leaderboard.run.specs import parse_agent_spec, resolve_task
from iapo_gym.leaderboard.run.store import ResultStore
from iapo_gym.leaderboard.submit.bundle import (
    BUNDLE_SCHEMA_VERSION,
    MANIFEST,
    RESULTS,
    BundleError,
    read_bundle,
    sha256_bytes,
    validate_manifest,
    write_bundle,
)
from iapo_gym.leaderboard.submit.merge import MergeError, merge
from iapo_gym.leaderboard.submit.verify import verify_bundle
from iapo_gym.tables import read_table, write_table
from tests.conftest import tiny_mv_table

SCHEMA = Path(__file__).resolve().parents[1] / "iapo_gym" / "leaderboard" / "submit" / "bundle-schema.json"
TOY_SOURCE = '''"""A toy agent defined outside the repository."""
from tests.leaderboard_toy_agents import Greedy


class Toy(Greedy):
    """Greedy with a few pulls."""
'''
BUDGETS = [30, 120]
RUNS = 3


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A small .h5 table task, a toy agent module on sys.path, and a sweep over both."""
    table_path = write_table(tiny_mv_table(seed=3, n_queries=12), tmp_path / "tiny.h5")
    module = f"toyagent_{tmp_path.name.replace('-', '_')}"
    source = tmp_path / "agents_src" / f"{module}.py"
    source.parent.mkdir()
    source.write_text(TOY_SOURCE)
    monkeypatch.syspath_prepend(str(source.parent))
    agents = [parse_agent_spec(f"{module}:Toy@toy"), parse_agent_spec("tests.leaderboard_toy_agents:Fixed:n=2@fixed")]
    tasks = [resolve_task(str(table_path)), resolve_task("synthetic_bernoulli")]
    return {"tmp": tmp_path, "table": table_path, "source": source, "agents": agents, "tasks": tasks,
            "tables": {"tiny": str(table_path)}}


def sweep(s: dict[str, Any], out: Path, agents: list[Any] | None = None, seed: int = 0) -> Path:
    summary = run_sweep(out, s["tasks"], agents or s["agents"], BUDGETS, RUNS, root_seed=seed, log=io.StringIO(), bar=False)
    assert not summary.failures and summary.added > 0
    return out


@pytest.mark.parametrize("suffix", [".iapo.zip", ".iapo.tar.gz"])
def test_round_trip(setup: dict[str, Any], suffix: str) -> None:
    out = sweep(setup, setup["tmp"] / "out")
    path = write_bundle(out, setup["tmp"] / f"b{suffix}")
    bundle = read_bundle(path)
    with ResultStore(out, create=False) as store:
        assert bundle.results == store.results()
        assert sorted(bundle.tasks, key=lambda t: (t.task, t.table_sha256)) == \
            sorted(store.tasks(), key=lambda t: (t.task, t.table_sha256))
    m = bundle.manifest
    assert m["schema_version"] == BUNDLE_SCHEMA_VERSION and m["protocol"]["root_seed"] == 0
    assert m["protocol"]["budgets"] == BUDGETS and m["n_results"] == 2 * 2 * 2 * RUNS
    tasks = {t["name"]: t for t in m["tasks"]}
    assert len(tasks["tiny"]["table_sha256"]) == 1 and len(tasks["synthetic_bernoulli"]["table_sha256"]) == RUNS
    assert tasks["tiny"]["release_git_blob"] is None
    toy = next(a for a in m["agents"] if a["label"] == "toy")
    assert set(toy["source"]["modules"]) == {setup["source"].stem}
    assert toy["source"]["modules"][setup["source"].stem] == sha256_bytes(setup["source"].read_bytes())
    # a merged folder re-bundles to the same runs
    merged = setup["tmp"] / "merged"
    merge([path], merged)
    assert read_bundle(write_bundle(merged, setup["tmp"] / "again.zip")).results == bundle.results


def test_merge_of_halves_equals_whole(setup: dict[str, Any]) -> None:
    whole = sweep(setup, setup["tmp"] / "whole")
    first = sweep(setup, setup["tmp"] / "first", setup["agents"][:1])
    second = write_bundle(sweep(setup, setup["tmp"] / "second", setup["agents"][1:]), setup["tmp"] / "second.iapo.zip")
    out = setup["tmp"] / "merged"
    counts = merge([first, second, whole], out)  # the whole sweep overlaps both halves: duplicates checked
    assert counts["duplicates"] == counts["runs"]
    with ResultStore(out, create=False) as a, ResultStore(whole, create=False) as b:
        assert [dataclasses.replace(r, train_seconds=0.0) for r in a.results()] == \
            [dataclasses.replace(r, train_seconds=0.0) for r in b.results()]
        assert a.get_meta("root_seed") == "0" and a.get_meta("train_fraction") == b.get_meta("train_fraction")
    provenance = json.loads((out / "provenance.json").read_text())["inputs"]
    assert [p["name"] for p in provenance] == ["first", "second.iapo.zip", "whole"]
    with pytest.raises(MergeError, match="not empty"):
        merge([whole], out)


def test_merge_refuses_disagreement_and_mixed_protocols(setup: dict[str, Any]) -> None:
    a = sweep(setup, setup["tmp"] / "a")
    b = setup["tmp"] / "b"
    shutil.copytree(a, b)
    with sqlite3.connect(b / "results.sqlite") as conn:
        conn.execute("UPDATE runs SET acr = acr + 1e-9 WHERE task = 'tiny' AND label = 'toy' AND budget = 120 AND run = 1")
    with pytest.raises(MergeError, match=r"run tiny/toy budget=120 run=1 disagrees .*acr"):
        merge([a, b], setup["tmp"] / "out1")
    with sqlite3.connect(b / "results.sqlite") as conn:
        conn.execute("UPDATE runs SET acr = acr - 1e-9, table_sha256 = ? WHERE task = 'tiny' AND run = 2", ("0" * 64,))
    with pytest.raises(MergeError, match=r"run tiny/\S+ budget=\d+ run=2: table digest"):
        merge([a, b], setup["tmp"] / "out2")
    c = sweep(setup, setup["tmp"] / "c", seed=1)
    with pytest.raises(MergeError, match="root_seed=0.*root_seed=1"):
        merge([a, c], setup["tmp"] / "out3")
    assert not any(p.name.startswith(("out", ".out")) for p in setup["tmp"].iterdir())


def test_verify_all_match(setup: dict[str, Any]) -> None:
    path = write_bundle(sweep(setup, setup["tmp"] / "out"), setup["tmp"] / "b.iapo.zip")
    outcome = verify_bundle(path, None, seed=5, tables=setup["tables"])
    assert outcome.ok and len(outcome.checks) == outcome.total == 24
    sample = verify_bundle(path, 5, seed=5, tables=setup["tables"])
    again = verify_bundle(path, 5, seed=5, tables=setup["tables"])
    assert [c.run for c in sample.checks] == [c.run for c in again.checks] and len(sample.checks) == 5
    assert sample.ok and sample.sample_seed == 5


def test_verify_catches_tampered_result(setup: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    out = sweep(setup, setup["tmp"] / "out")
    with sqlite3.connect(out / "results.sqlite") as conn:
        conn.execute("UPDATE runs SET acr = acr + 0.01, regret = regret - 0.01 "
                     "WHERE task = 'synthetic_bernoulli' AND label = 'toy' AND budget = 30 AND run = 2")
    path = write_bundle(out, setup["tmp"] / "b.iapo.zip")
    outcome = verify_bundle(path, None, seed=0, tables=setup["tables"])
    bad = [c for c in outcome.checks if not c.match]
    assert [c.run for c in bad] == ["synthetic_bernoulli/toy budget=30 run=2"] and "differs by -0.01" in bad[0].note
    code = main(["verify", str(path), "--sample", "all", "--table", f"tiny={setup['table']}"])
    text = capsys.readouterr().out
    assert code == 1 and "MISMATCH synthetic_bernoulli/toy budget=30 run=2" in text and "FAILED: 23 of 24" in text
    record = json.loads(Path(str(path) + ".verify.json").read_text())
    assert record["status"] == "FAILED" and record["bundle_sha256"] == read_bundle(path).sha256


def test_verify_catches_tampered_table(setup: dict[str, Any]) -> None:
    path = write_bundle(sweep(setup, setup["tmp"] / "out"), setup["tmp"] / "b.iapo.zip")
    table = read_table(setup["table"])
    probs = table.probs.copy()
    probs[1, 4] = np.roll(probs[1, 4], 1)  # still a distribution, one query's probabilities changed
    write_table(dataclasses.replace(table, probs=probs), setup["table"])
    outcome = verify_bundle(path, None, seed=0, tables=setup["tables"])
    assert not outcome.ok and len(outcome.table_problems) == RUNS
    assert all(p.startswith("task 'tiny' run") and "table digest here" in p for p in outcome.table_problems)
    assert all(c.match for c in outcome.checks if c.run.startswith("synthetic_bernoulli/"))


def test_verify_catches_tampered_agent_source(setup: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    path = write_bundle(sweep(setup, setup["tmp"] / "out"), setup["tmp"] / "b.iapo.zip")
    setup["source"].write_text(TOY_SOURCE + "\n# tuned after the results were made\n")
    outcome = verify_bundle(path, 3, seed=0, tables=setup["tables"])
    module = setup["source"].stem
    assert outcome.agent_problems == [f"agent '{module}:Toy@toy': source differs from the bundle's (module(s) {module})"]
    assert not outcome.ok
    code = main(["verify", str(path), "--sample", "2", "--seed", "1", "--table", f"tiny={setup['table']}", "--no-record"])
    assert code == 1 and f"AGENT SOURCE DIFFERS: agent '{module}:Toy@toy'" in capsys.readouterr().out


# ---- bad input -------------------------------------------------------------------------------


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


@pytest.fixture
def good_bundle(setup: dict[str, Any]) -> Path:
    return write_bundle(sweep(setup, setup["tmp"] / "out"), setup["tmp"] / "good.iapo.zip")


def test_bad_bundles_refused(setup: dict[str, Any], good_bundle: Path) -> None:
    tmp = setup["tmp"]
    data = good_bundle.read_bytes()
    cases = {}
    (tmp / "truncated.zip").write_bytes(data[: len(data) // 2])
    cases["truncated.zip"] = "not a readable zip archive"
    _zip(tmp / "foreign.zip", {"README.txt": b"hello", "data.csv": b"a,b\n"})
    cases["foreign.zip"] = "not an iapo-gym bundle: it has no manifest.json"
    members = _members(good_bundle)
    manifest = json.loads(members[MANIFEST])
    _zip(tmp / "newer.zip", {**members, MANIFEST: json.dumps({**manifest, "schema_version": 99}).encode()})
    cases["newer.zip"] = "schema version 99 is newer than this iapo-gym"
    _zip(tmp / "traversal.zip", {**members, "../x": b"evil"})
    cases["traversal.zip"] = "unsafe member name '../x'"
    _zip(tmp / "absolute.zip", {**members, "/tmp/evil": b"evil"})
    cases["absolute.zip"] = "unsafe member name '/tmp/evil'"
    changed = members[RESULTS].replace(b'"acr": 0.', b'"acr": 1.', 1)
    _zip(tmp / "edited.zip", {**members, RESULTS: changed})
    cases["edited.zip"] = "results.jsonl has sha256 .* changed after bundling"
    broken = {**manifest, "agents": [{**manifest["agents"][0], "source": {**manifest["agents"][0]["source"], "sha256": "xyz"}}]}
    _zip(tmp / "badfield.zip", {**members, MANIFEST: json.dumps(broken).encode()})
    cases["badfield.zip"] = (r"badfield\.zip: manifest\.json: field 'agents\[0\]\.source\.sha256' must be a string "
                             r"matching '\^\[0-9a-f\]\{64\}\$', got 'xyz'$")
    cases["bundle.rar"] = "must end in .zip or .tar.gz"
    (tmp / "bundle.rar").write_bytes(data)
    before = sorted(p.name for p in tmp.parent.iterdir())
    for name, message in cases.items():
        with pytest.raises(BundleError, match=message):
            read_bundle(tmp / name)
        out = tmp / f"merged_{name.replace('.', '_')}"
        with pytest.raises(MergeError, match=message):
            merge([tmp / name], out)
        assert not out.exists()
        assert main(["verify", str(tmp / name), "--no-record"]) == 1
    assert sorted(p.name for p in tmp.parent.iterdir()) == before  # nothing written beside tmp ("../x")
    assert not Path("/tmp/evil").exists() and not (tmp / "x").exists()
    assert not any(p.name.startswith((".merged", "merged")) for p in tmp.iterdir())


def test_tar_traversal_refused(setup: dict[str, Any], good_bundle: Path) -> None:
    import tarfile

    path = setup["tmp"] / "evil.iapo.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, data in {**_members(good_bundle), "../../x": b"evil"}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleError, match=r"unsafe member name '\.\./\.\./x'"):
        read_bundle(path)


# ---- the schema and the report's paths --------------------------------------------------------


def test_written_manifests_follow_the_packaged_schema(good_bundle: Path) -> None:
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    assert BUNDLE_SCHEMA_VERSION in schema["properties"]["schema_version"]["enum"]
    manifest = read_bundle(good_bundle).manifest
    jsonschema.validate(manifest, schema)
    bad = {**manifest, "tasks": [{**manifest["tasks"][0], "table_sha256": ["nothex"]}]}
    with pytest.raises(BundleError) as err:  # the one message format of the three file schemas
        validate_manifest(bad, "b.zip")
    assert str(err.value) == "b.zip: manifest.json: field 'tasks[0].table_sha256[0]' must be a string matching " \
                             "'^[0-9a-f]{64}$', got 'nothex'"
    missing = {k: v for k, v in manifest.items() if k != "protocol"}
    with pytest.raises(BundleError, match=r"^bundle: manifest\.json: field 'protocol' is missing$"):
        validate_manifest(missing)
    with pytest.raises(BundleError, match=r"^bundle: manifest\.json: field 'n_results' must be an integer, got 'x'"):
        validate_manifest({**manifest, "n_results": "x"})


def test_display_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "inner").mkdir()
    monkeypatch.chdir(tmp_path)
    assert display_path(tmp_path / "inner" / "results.sqlite") == "inner/results.sqlite"
    assert display_path("/elsewhere/run/results.sqlite") == "results.sqlite"


def test_merge_refuses_changed_agent_source_and_cli(setup: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """Two bundles whose agent code differs are not merged; the CLI paths of bundle/merge/report --html work."""
    out = sweep(setup, setup["tmp"] / "out")
    first = setup["tmp"] / "first.iapo.tar.gz"
    assert main(["bundle", str(out), "-o", str(first)]) == 0
    setup["source"].write_text(TOY_SOURCE + "\n# changed\n")
    second = write_bundle(out, setup["tmp"] / "second.iapo.zip")
    module = setup["source"].stem
    assert main(["leaderboard", "merge", str(first), str(second), "--out", str(setup["tmp"] / "m")]) == 1
    assert f"agent '{module}:Toy@toy' has source digest" in capsys.readouterr().err
    assert not (setup["tmp"] / "m").exists()
    assert main(["leaderboard", "merge", str(second), str(out), "--out", str(setup["tmp"] / "m")]) == 0
    assert main(["report", str(setup["tmp"] / "m"), "--html", "--no-plots", "--quiet"]) == 0
    index = setup["tmp"] / "m" / "report" / "site" / "index.html"
    html = index.read_text()
    assert "second.iapo.zip" in html and "not verified" in html and 'id="task-tiny"' in html


def test_runs_carry_effective_params_and_bundles_without_them_still_read_and_verify(setup: dict[str, Any],
                                                                                   good_bundle: Path) -> None:
    members = _members(good_bundle)
    rows = [json.loads(line) for line in members["results.jsonl"].decode().splitlines()]
    assert all("effective_params" in row for row in rows)  # the toy agents have no params(): null
    stripped = "".join(json.dumps({k: v for k, v in row.items() if k != "effective_params"}, sort_keys=True) + "\n"
                       for row in rows).encode()
    manifest = json.loads(members["manifest.json"])
    manifest["files"]["results.jsonl"] = sha256_bytes(stripped)
    old = _zip(setup["tmp"] / "old.iapo.zip", {**members, "results.jsonl": stripped,
                                                "manifest.json": json.dumps(manifest).encode()})
    bundle = read_bundle(old)
    assert [r.effective_params for r in bundle.results] == [None] * len(rows)
    assert [dataclasses.replace(r, effective_params=None) for r in read_bundle(good_bundle).results] == bundle.results
    outcome = verify_bundle(old, 6, seed=1, tables=setup["tables"])
    assert outcome.ok and len(outcome.checks) == 6
    extra = "".join(json.dumps({**row, "surplus": 1}, sort_keys=True) + "\n" for row in rows).encode()
    manifest["files"]["results.jsonl"] = sha256_bytes(extra)
    bad = _zip(setup["tmp"] / "extra.iapo.zip", {**members, "results.jsonl": extra,
                                                  "manifest.json": json.dumps(manifest).encode()})
    with pytest.raises(BundleError, match=r"optional: \['effective_params'\]\), got .*'surplus'"):
        read_bundle(bad)
