"""The leaderboard's online protocol (``iapo-gym leaderboard --protocol online``): its sweep is exact, resumable
and bit-identical whatever the workers; its report holds every checkpoint and the paired statistics; its bundles
verify and a tampered number is caught."""

from __future__ import annotations

import csv
import json
import math
import os
import shlex
import shutil
import sqlite3
import zipfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agents.online import make_online
from iapo_gym.cli import main
from iapo_gym.leaderboard.report.online import REPORTED, online_report, reported_indices
from iapo_gym.leaderboard.report.stats import adjust_pvalues, paired_test
from iapo_gym.leaderboard.report.write import write_report
from iapo_gym.leaderboard.run.online import (
    OnlineRunResult,
    online_env_seed,
    parse_online_spec,
    read_online,
    run_online_sweep,
)
from iapo_gym.leaderboard.run.specs import resolve_task
from iapo_gym.leaderboard.submit.bundle import read_bundle, sha256_bytes, write_bundle
from iapo_gym.leaderboard.submit.merge import MergeError, merge
from iapo_gym.leaderboard.submit.verify import verify_bundle
from iapo_gym.online import OnlineEnv, checkpoints, run_online
from iapo_gym.tables import read_table
from tests.conftest import kill_sweep_midway

REPO = Path(__file__).resolve().parents[1]
AGENTS = ("ucb", "thompson", "etc_auto:budget=150@etc_auto")
HORIZON = 300



def _sweep(out: Path, tables: dict[str, str], **kwargs: Any) -> Any:
    tasks = [resolve_task(tables["mv"]), resolve_task(tables["bon"])]
    agents = [parse_online_spec(a) for a in AGENTS]
    return run_online_sweep(out, tasks, agents, ["stationary", "arrival"], [HORIZON], 2,
                            log=open(os.devnull, "w"), **kwargs)  # noqa: SIM115


def _comparable(rows: list[OnlineRunResult]) -> list[dict[str, Any]]:
    """Everything but the wall time."""
    return [{k: v for k, v in asdict(r).items() if k != "seconds"} for r in rows]


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory, tables: dict[str, str]) -> Path:
    """One online sweep in this process: 2 tables x 2 schedules x 2 runs x 3 agents."""
    out = tmp_path_factory.mktemp("online") / "one"
    summary = _sweep(out, tables)
    assert summary.added == 24 and not summary.failures
    return out


# ---- the runs are exact, and the same whatever the workers -------------------------------------------------------


def test_a_stored_curve_is_run_online_of_the_derived_seed(swept: Path, tables: dict[str, str]) -> None:
    rows = read_online(swept)
    assert len(rows) == 24
    r = next(x for x in rows if x.agent == "ucb" and x.schedule == "arrival" and x.run == 1 and "tiny_bon" in x.task)
    assert r.env_seed == online_env_seed(0, r.task, 0, 1) and r.batch_size == 16
    env = OnlineEnv(table=read_table(tables["bon"]), schedule="arrival", horizon=HORIZON)
    direct = run_online(env, make_online("ucb"), seed=r.env_seed, batch_size=16)
    assert r.checkpoint_array().tolist() == checkpoints(HORIZON).tolist() and len(r.checkpoint_array()) == 100
    assert r.curve_array().tolist() == direct.cumulative_regret.tolist()  # bit for bit
    assert r.regret == float(np.cumsum(direct.regret)[-1]) == r.curve_array()[-1]
    # agents of a (level, run) share the env's draws (common random numbers); runs differ
    same = [x for x in rows if (x.task, x.schedule, x.run) == (r.task, r.schedule, r.run)]
    assert len({x.env_seed for x in same}) == 1 and len(same) == 3
    assert len({x.env_seed for x in rows if x.task == r.task}) == 2


def test_two_workers_and_dask_give_the_same_rows(swept: Path, tables: dict[str, str], tmp_path: Path) -> None:
    distributed = pytest.importorskip("distributed")
    assert _sweep(tmp_path / "two", tables, jobs=2).added == 24
    clean = _comparable(read_online(swept))
    assert _comparable(read_online(tmp_path / "two")) == clean
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        _sweep(tmp_path / "dask", tables, scheduler=cluster.scheduler_address)
    assert _comparable(read_online(tmp_path / "dask")) == clean


def test_a_rerun_skips_done_runs_and_the_batch_size_is_the_folders(swept: Path, tables: dict[str, str]) -> None:
    summary = _sweep(swept, tables)
    assert (summary.added, summary.skipped) == (0, 24)
    with pytest.raises(ValueError, match="online_batch_size=16, not 4"):
        _sweep(swept, tables, batch_size=4)


@pytest.mark.heavy
def test_kill_minus_9_then_rerun_equals_a_clean_sweep(tmp_path: Path, tables: dict[str, str]) -> None:
    args = ["leaderboard", "--protocol", "online", "--tasks", tables["mv"], "--agents", "ucb",
            "tests.leaderboard_toy_agents:SleepyOnline:delay=0.05", "--schedule", "stationary", "arrival",
            "--horizon", "200", "--runs", "15", "--no-table"]
    stopped_at = kill_sweep_midway(args, tmp_path / "killed", "online_runs", 6, REPO)
    assert 6 <= stopped_at < 60, "the sweep should have been killed mid-way"
    assert stopped_at % 2 == 0  # whole (level, schedule, horizon, run) units only: one transaction per unit
    assert main([*args, "--out", str(tmp_path / "killed")]) == 0
    assert main([*args, "--out", str(tmp_path / "clean")]) == 0
    killed, clean = read_online(tmp_path / "killed"), read_online(tmp_path / "clean")
    assert len(killed) == 60
    assert _comparable(killed) == _comparable(clean)


# ---- the report ----------------------------------------------------------------------------------------------------


def test_the_report_has_every_checkpoint_the_paired_tests_and_the_curves(swept: Path, tmp_path: Path) -> None:
    written = write_report(swept, tmp_path / "report", html=True)
    rows = read_online(swept)
    assert not (tmp_path / "report" / "leaderboard.md").exists()  # no paper runs: no paper files
    # every checkpoint's mean is the mean of the stored curves there
    with written["online_summary_csv"].open() as fh:
        summary = list(csv.DictReader(fh))
    cell = [r for r in rows if r.schedule == "arrival" and r.agent == "thompson" and "tiny_mv" in r.task]
    mine = [s for s in summary if s["label"] == "thompson" and s["schedule"] == "arrival" and "tiny_mv" in s["task"]]
    assert [int(s["checkpoint"]) for s in mine] == checkpoints(HORIZON).tolist()
    curves = np.array([r.curve_array() for r in cell])
    assert [float(s["regret_mean"]) for s in mine] == curves.mean(axis=0).tolist()
    # the paired tests against etc_auto, Holm-corrected over the agents at each reported checkpoint
    report = online_report(swept)
    assert report is not None and report.baseline == "etc_auto"
    points = checkpoints(HORIZON)
    k = reported_indices(points)[-1]
    assert len(reported_indices(points)) == len(REPORTED) and points[k] == HORIZON
    cell_rows = [r for r in rows if r.schedule == "stationary" and "tiny_bon" in r.task]
    base = {(r.level, r.run): r.curve_array()[k] for r in cell_rows if r.label == "etc_auto"}
    tests = {}
    for label in ("thompson", "ucb"):
        mine_k = {(r.level, r.run): r.curve_array()[k] for r in cell_rows if r.label == label}
        keys = sorted(mine_k)
        tests[label] = paired_test([mine_k[x] for x in keys], [base[x] for x in keys])
    adjusted = adjust_pvalues([tests["thompson"].p_value, tests["ucb"].p_value], "holm")
    pairs = {p.label: p for p in report.pairs if p.schedule == "stationary" and "tiny_bon" in p.task
             and p.checkpoint == HORIZON}
    assert set(pairs) == {"thompson", "ucb"}
    for label, p_adj in zip(("thompson", "ucb"), adjusted, strict=True):
        assert pairs[label].median_diff == tests[label].median_diff
        assert pairs[label].p_adjusted == pytest.approx(p_adj, nan_ok=True)
        # less regret (+1) is a test leaning negative (label - baseline), when significant
        assert pairs[label].winner == (-tests[label].direction if p_adj < 0.05 else 0)
    markdown = written["markdown"].read_text()
    assert f"regret at {HORIZON}" in markdown and f"vs etc_auto at {HORIZON}" in markdown
    for task in {r.task for r in rows}:
        assert written[f"regret_curves_{task}"].stat().st_size > 10_000  # a drawn figure
    site = written["html"].read_text()
    assert site.count('data-protocol="online"') == 2 and "regret_curves_" in site
    assert (written["html"].parent / "assets").glob("regret_curves_*.png")
    # another baseline by label
    other = online_report(swept, baseline="ucb")
    assert other is not None and {p.label for p in other.pairs} == {"thompson", "etc_auto"}



def _bench_online() -> Any:
    """benchmarks/bench_online.py as a module (benchmarks/ is not a package; its peers module sits beside it)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_online", REPO / "benchmarks" / "bench_online.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module


def test_the_goal_table_and_the_grid_figure_read_the_paired_report(swept: Path, tmp_path: Path) -> None:
    """bench_online's goal table: each cell's means at T are the report's, its verdicts the paired rows at T,
    and the counts add them up; the grid figure draws every cell and refuses a horizon without runs."""
    from iapo_gym.leaderboard.report.online import plot_regret_grid

    reports = [online_report(swept, baseline=b) for b in ("etc_auto", "thompson")]
    assert all(r is not None for r in reports)
    text = _bench_online().goal_markdown(reports, "ucb")
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(reports[0].cells()) == 4
    for row in rows:
        task = next(c[0] for c in reports[0].cells() if row[0].removeprefix("| ") in c[0])
        cell = (task, row[1], HORIZON)
        curves = reports[0].curves(cell)
        assert [float(x.replace(",", "")) for x in row[3:6]] == [
            round(float(curves[label][1][-1]), 1) for label in ("ucb", "etc_auto", "thompson")]
        for k in range(2):
            pair = next(p for p in reports[k].pairs if (p.task, p.schedule, p.horizon) == cell and p.label == "ucb"
                        and p.checkpoint == HORIZON)
            assert row[6 + k].startswith(f"{pair.mean_ratio:.2f}x, p {pair.p_adjusted:.2g}")
    stationary = sum(1 for r in rows if r[1] == "stationary" and "**more**" not in r[6])
    assert f"- stationary, against `etc_auto` (not significantly more regret): {stationary} of 2 cells" in text
    half = sum(1 for r in rows if r[1] == "arrival" and float(r[6].split("x")[0]) <= 0.5)
    assert f"- arrival, against `etc_auto` (at most half the regret): {half} of 2 cells" in text
    alone = online_report(swept, baseline="etc_auto", agents=["ucb", "etc_auto"])  # thompson's runs left out
    assert alone is not None and {r.label for r in alone.results} == {"ucb", "etc_auto"}
    assert {p.label for p in alone.pairs} == {"ucb"}
    # Holm over the one comparison per cell: the raw p; the report of all three agents corrects over two
    assert all(p.p_adjusted == p.p_value for p in alone.pairs if math.isfinite(p.p_value))
    assert any(p.p_adjusted > p.p_value for p in reports[0].pairs if p.p_value < 1.0)
    only = online_report(swept, baseline="etc_auto", schedules=["arrival"])
    assert only is not None and {c[1] for c in only.cells()} == {"arrival"} and {p.schedule for p in only.pairs} == {
        "arrival"} and [p for p in reports[0].pairs if p.schedule == "arrival"] == only.pairs
    figure = plot_regret_grid(reports[0], tmp_path / "grid.png")
    assert figure.stat().st_size > 20_000
    with pytest.raises(ValueError, match=r"no runs at horizon 7; it has \[300\]"):
        plot_regret_grid(reports[0], tmp_path / "none.png", horizon=7)
    assert not (tmp_path / "none.png").exists()

# ---- bundles, verify, merge --------------------------------------------------------------------------------------


def _retamper(bundle: Path, target: Path) -> None:
    """Rewrite ``bundle`` with one curve value changed in online.jsonl and the manifest's digest made to match
    (a well-formed bundle that lies about one number)."""
    with zipfile.ZipFile(bundle) as zf:
        members = {name: zf.read(name) for name in zf.namelist()}
    lines = members["online.jsonl"].decode().splitlines()
    row = json.loads(lines[0])
    curve = json.loads(row["curve"])
    curve[-1] += 1e-9
    row["curve"] = json.dumps(curve)
    lines[0] = json.dumps(row, sort_keys=True)
    members["online.jsonl"] = ("\n".join(lines) + "\n").encode()
    manifest = json.loads(members["manifest.json"])
    manifest["files"]["online.jsonl"] = sha256_bytes(members["online.jsonl"])
    members["manifest.json"] = json.dumps(manifest).encode()
    with zipfile.ZipFile(target, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def test_bundle_verifies_and_a_tampered_number_fails(swept: Path, tables: dict[str, str], tmp_path: Path) -> None:
    files = {"tiny_mv": tables["mv"], "tiny_bon": tables["bon"]}
    options = [arg for task, file in files.items() for arg in ("--table", f"{task}={file}")]
    path = write_bundle(swept, tmp_path / "online.iapo.zip")
    bundle = read_bundle(path)
    assert bundle.manifest["schema_version"] == 2 and bundle.results == []
    section = bundle.manifest["online"]
    assert (section["batch_size"], section["horizons"], section["schedules"]) == (16, [HORIZON], ["arrival", "stationary"])
    assert {a["spec"] for a in section["agents"]} == {"ucb", "thompson", "etc_auto:budget=150@etc_auto"}
    assert _comparable(bundle.extra["online"]) == _comparable(read_online(swept))
    outcome = verify_bundle(path, sample=None, seed=0, tables=files)
    assert outcome.ok and len(outcome.checks) == 24 and all(c.match for c in outcome.checks)
    sampled = verify_bundle(path, sample=5, seed=3, tables=files)
    assert sampled.ok and len(sampled.checks) == 5
    tampered = tmp_path / "tampered.iapo.zip"
    _retamper(path, tampered)
    outcome = verify_bundle(tampered, sample=None, seed=0, tables=files)
    assert not outcome.ok
    bad = [c for c in outcome.checks if not c.match]
    assert len(bad) == 1 and "curve" in bad[0].note and "regret" not in bad[0].note
    # the CLI: exit 0 on the true bundle, 1 on the tampered one
    assert main(["verify", str(path), "--sample", "3", "--seed", "1", "--no-record", *options]) == 0
    assert main(["verify", str(tampered), "--sample", "all", "--seed", "1", "--no-record", *options]) == 1
    # a changed digest without a matching manifest is refused on reading
    with zipfile.ZipFile(path) as zf:
        members = {name: zf.read(name) for name in zf.namelist()}
    members["online.jsonl"] = members["online.jsonl"].replace(b'"run": 0', b'"run": 7', 1)
    broken = tmp_path / "broken.iapo.zip"
    with zipfile.ZipFile(broken, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    with pytest.raises(ValueError, match="online.jsonl has sha256"):
        read_bundle(broken)


def test_merge_keeps_online_runs_once_and_refuses_a_disagreement(swept: Path, tmp_path: Path) -> None:
    path = write_bundle(swept, tmp_path / "online.iapo.zip")
    counts = merge([path, swept], tmp_path / "merged")
    assert (counts["runs"], counts["duplicates"]) == (24, 24)
    assert _comparable(read_online(tmp_path / "merged")) == _comparable(read_online(swept))
    tampered = tmp_path / "tampered.iapo.zip"
    _retamper(path, tampered)
    with pytest.raises(MergeError, match="disagrees between"):
        merge([path, tampered], tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_paper_bundles_do_not_change(swept: Path, tmp_path: Path) -> None:
    """A folder without online runs bundles as before: three members, schema version 1, no 'online'."""
    from iapo_gym.leaderboard.run.store import ResultStore, RunResult

    row = RunResult(task="t", table_sha256="0" * 64, agent="uniform", params="{}", label="uniform", budget=10, run=0,
                    root_seed=0, split_seed=1, env_seed=2, agent_seed=3, acr=0.5, optimal_acr=0.6,
                    train_optimal_acr=0.55, regret=0.1, arms="[[0, 1]]", optimal_arms="[[0, 1]]", train_seconds=0.1,
                    budget_spent=10, version="x")
    with ResultStore(tmp_path / "paper") as store:
        store.claim_meta("root_seed", "0")
        store.claim_meta("train_fraction", "0.8")
        store.add([row])
    path = write_bundle(tmp_path / "paper", tmp_path / "paper.iapo.zip")
    with zipfile.ZipFile(path) as zf:
        assert sorted(zf.namelist()) == ["manifest.json", "results.jsonl", "tasks.jsonl"]
        manifest = json.loads(zf.read("manifest.json"))
    assert manifest["schema_version"] == 1 and "online" not in manifest and "online.jsonl" not in manifest["files"]
    with sqlite3.connect(tmp_path / "paper" / "results.sqlite") as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "online_runs" not in tables


# ---- the command line --------------------------------------------------------------------------------------------


def test_cli_options_belong_to_their_protocol(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["leaderboard", "--horizon", "100", "--out", str(tmp_path / "x")]) == 2
    assert "--horizon belong(s) to the online protocol; add --protocol online" in capsys.readouterr().err
    assert main(["leaderboard", "--protocol", "online", "--budgets", "100", "--out", str(tmp_path / "x")]) == 2
    assert "--budgets belong(s) to the paper protocol" in capsys.readouterr().err
    assert main(["leaderboard", "--protocol", "online", "--tasks", "synthetic_categorical", "--agents", "nope",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "unknown agent 'nope'" in err and "etc_auto" in err and "ucb" in err
    assert main(["leaderboard", "--protocol", "online", "--tasks", "synthetic_categorical", "--schedule", "drift",
                 "--out", str(tmp_path / "x")]) == 2
    assert "task(s) synthetic_categorical are not generated levels" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_folder_of_both_protocols_reports_bundles_and_verifies_both(swept: Path, tables: dict[str, str],
                                                                      tmp_path: Path) -> None:
    from iapo_gym.leaderboard.run.runner import run_sweep
    from iapo_gym.leaderboard.run.specs import parse_agent_spec

    out = tmp_path / "both"
    shutil.copytree(swept, out)
    summary = run_sweep(out, [resolve_task(tables["mv"])], [parse_agent_spec("tests.leaderboard_toy_agents:Greedy")],
                        [6, 30], 2, log=open(os.devnull, "w"))  # noqa: SIM115
    assert summary.added == 4 and not summary.failures
    written = write_report(out, tmp_path / "report", html=True)
    assert written["markdown"].name == "leaderboard.md" and written["online_markdown"].name == "online.md"
    site = written["html"].read_text()
    assert 'data-protocol="online"' in site and "acr_vs_budget_" in site
    path = write_bundle(out, tmp_path / "both.iapo.zip")
    bundle = read_bundle(path)
    assert len(bundle.results) == 4 and len(bundle.extra["online"]) == 24
    files = {"tiny_mv": tables["mv"], "tiny_bon": tables["bon"]}
    outcome = verify_bundle(path, sample=3, seed=5, tables=files)
    assert outcome.ok and outcome.sample == 6 and outcome.total == 28
    assert sum(" online " in c.run for c in outcome.checks) == 3


def _doc_block(doc: str, marker: str) -> list[str]:
    """The commands of the first ```bash block of ``doc`` that contains ``marker`` (continuations joined)."""
    text = (REPO / doc).read_text(encoding="utf-8")
    for block in text.split("```bash\n")[1:]:
        body = block.split("```", 1)[0]
        if marker in body:
            return [line.split("  #")[0].strip() for line in body.replace("\\\n", " ").splitlines() if line.strip()]
    raise AssertionError(f"no bash block with {marker!r} in {doc}")


@pytest.mark.heavy
def test_the_leaderboard_docs_online_commands_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = _doc_block("docs/leaderboard.md", "--protocol online")
    assert [c.split()[:2] for c in commands] == [["iapo-gym", "leaderboard"], ["iapo-gym", "report"],
                                                 ["iapo-gym", "bundle"], ["iapo-gym", "verify"]]
    monkeypatch.chdir(tmp_path)
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, command
    assert len(read_online(tmp_path / "results" / "online")) == 24
    assert (tmp_path / "results" / "online" / "report" / "site" / "index.html").is_file()
    record = json.loads((tmp_path / "online.iapo.zip.verify.json").read_text())
    assert record["status"] == "verified" and record["matched"] == 6


@pytest.mark.heavy
def test_the_online_site_in_chromium(swept: Path, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    from tests.test_html_site import chrome

    index = write_report(swept, tmp_path / "report", html=True)["html"]
    driver = chrome()
    try:
        driver.get(index.as_uri())
        sections = driver.find_elements(By.CSS_SELECTOR, "section[data-protocol=online]")
        assert sorted(s.get_attribute("data-task") for s in sections) == sorted({r.task for r in read_online(swept)})
        images = driver.find_elements(By.TAG_NAME, "img")
        assert len(images) == 2 and all("Cumulative exact regret" in (img.get_attribute("alt") or "") for img in images)
        assert all(driver.execute_script("return arguments[0].naturalWidth", img) > 0 for img in images)
        table = sections[0].find_elements(By.CSS_SELECTOR, "table.sortable")[0]
        headers = table.find_elements(By.CSS_SELECTOR, "thead th")
        last = [h.text for h in headers].index(f"Regret at {HORIZON}")

        def column() -> list[float]:
            return [float(tr.find_elements(By.CSS_SELECTOR, "td, th")[last].get_attribute("data-sort"))
                    for tr in table.find_elements(By.CSS_SELECTOR, "tbody tr")]

        assert column() == sorted(column())  # ranked by regret at T
        headers[last].find_element(By.TAG_NAME, "button").click()
        headers[last].find_element(By.TAG_NAME, "button").click()
        assert column() == sorted(column(), reverse=True) and headers[last].get_attribute("aria-sort") == "descending"
        assert [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")] == []
    finally:
        driver.quit()
