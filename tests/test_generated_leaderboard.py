"""Generated tasks in the leaderboard protocol: one level per run index, bundles that rebuild them, verify, the site."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iapo_gym.cli import main
from iapo_gym.leaderboard.report.model import file_stem
from iapo_gym.leaderboard.run.runner import run_sweep
from iapo_gym.leaderboard.run.specs import parse_agent_spec, resolve_task, table_checksum
from iapo_gym.leaderboard.run.store import ResultStore
from iapo_gym.leaderboard.submit.bundle import read_bundle, write_bundle
from iapo_gym.leaderboard.submit.verify import verify_bundle
from iapo_gym.tasks.generated import FamilyError, level_table

RANGE = "generated:mv_binary:1000002-1000004"
SINGLE = "generated:bon_flat:7"


def test_task_syntax_and_errors() -> None:
    ranged = resolve_task(RANGE)
    assert ranged.name == RANGE and ranged.synthetic and ranged.levels == (1_000_002, 1_000_004)
    assert ranged.run_count(200) == 3
    assert resolve_task("generated:mv_binary:1000002:1000004").name == RANGE  # A:B is the same range
    single = resolve_task(SINGLE)
    assert not single.synthetic and single.run_count(5) == 5 and single.levels == (7, 7)
    assert table_checksum(single.load(3)) == table_checksum(level_table("bon_flat", 7))
    with pytest.raises(FamilyError, match="families: "):
        resolve_task("generated:nope:0-3")
    with pytest.raises(FamilyError, match="held out"):
        resolve_task("generated:bon_flat:20000-20005")
    with pytest.raises(FamilyError, match="generated:FAMILY:LEVELS"):
        resolve_task("generated:bon_flat")
    with pytest.raises(ValueError, match="run 3 does not exist"):
        ranged.load(3)


def test_sweep_bundle_verify_and_site_on_generated_tasks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lb"
    agents = [parse_agent_spec("psst"), parse_agent_spec("tests.leaderboard_toy_agents:Greedy")]
    summary = run_sweep(out, [resolve_task(RANGE), resolve_task(SINGLE)], agents, [400], runs=2, log=None, bar=False)
    assert not summary.failures and summary.added == (3 + 2) * 2
    with ResultStore(out) as store:
        rows = store.results()
    ranged = [r for r in rows if r.task == RANGE]
    assert sorted({r.run for r in ranged}) == [0, 1, 2]
    for r in ranged:  # run r is level first + r with its stored split
        assert r.split_seed is None
        assert r.table_sha256 == table_checksum(level_table("mv_binary", 1_000_002 + r.run))
        assert r.budget_spent <= r.budget
    single = [r for r in rows if r.task == SINGLE]
    assert {r.table_sha256 for r in single} == {table_checksum(level_table("bon_flat", 7))}
    assert len({r.split_seed for r in single}) == 2 and None not in {r.split_seed for r in single}  # resplit per run

    bundle_path = write_bundle(out, tmp_path / "gen.iapo.zip")
    manifest = read_bundle(bundle_path).manifest
    entries = {t["name"]: t for t in manifest["tasks"]}
    assert entries[RANGE]["generated"] == {"family": "mv_binary", "levels": [1_000_002, 1_000_004],
                                           "one_level_per_run": True, "generator_version": 1}
    assert entries[SINGLE]["generated"]["one_level_per_run"] is False
    outcome = verify_bundle(bundle_path, sample=None, seed=3)
    assert outcome.ok and len(outcome.checks) == len(rows), outcome.table_problems

    assert main(["report", str(out), "--html", "--quiet"]) == 0
    site = (out / "report" / "site" / "index.html").read_text()
    for task in (RANGE, SINGLE):
        assert (out / "report" / f"pairwise_{file_stem(task)}.png").is_file()
        assert f"assets/acr_vs_budget_{file_stem(task)}.png" in site
    assert ":" not in file_stem(RANGE)
    capsys.readouterr()


def test_leaderboard_command_refuses_unknown_families(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["leaderboard", "--tasks", "generated:bon_shap:1000000-1000009", "--agents", "psst",
                 "--budgets", "300", "--out", str(tmp_path / "x"), "--no-table"])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown generated family 'bon_shap'" in err and "bon_shape" in err
    assert not json.dumps(err).count("Traceback")
