"""The leaderboard sweep: protocol, seeds, resumability, parallel and Dask backends, CLI, report."""

from __future__ import annotations

import json
import multiprocessing
import os
import sqlite3
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import iapo_gym.data
from iapo_gym.cli import main
from iapo_gym.data import MissingTableError
from iapo_gym.env import IAPOEnv
from iapo_gym.leaderboard import (
    ResultStore,
    RunResult,
    SweepSummary,
    parse_agent_spec,
    resolve_task,
    run_sweep,
    table_checksum,
    write_report,
)
from iapo_gym.leaderboard.run import store as store_module
from iapo_gym.leaderboard.run.specs import AgentSpec
from iapo_gym.policy import Policy
from iapo_gym.seeding import derive_seed
from iapo_gym.tables import read_table
from tests.conftest import kill_sweep_midway

REPO = Path(__file__).resolve().parents[1]
TOY = "tests.leaderboard_toy_agents"



def _comparable(results: list[RunResult]) -> list[dict[str, object]]:
    """Everything but the wall-clock training time."""
    return [{k: v for k, v in asdict(r).items() if k != "train_seconds"} for r in results]


def _stored(out: Path) -> list[RunResult]:
    with ResultStore(out, create=False) as store:
        return store.results()


def _sweep(out: Path, tables: dict[str, str], **kwargs: Any) -> SweepSummary:
    tasks = [resolve_task(tables["mv"]), resolve_task(tables["bon"])]
    agents = [parse_agent_spec(f"{TOY}:Greedy"), parse_agent_spec(f"{TOY}:Greedy:pulls=8@greedy8")]
    return run_sweep(out, tasks, agents, [6, 30], 3, log=open(os.devnull, "w"), **kwargs)  # noqa: SIM115


# ---- specs -----------------------------------------------------------------------------------


def test_agent_spec_syntax() -> None:
    assert parse_agent_spec("uniform") == AgentSpec("uniform", {}, "uniform")
    spec = parse_agent_spec("psst_topk:k=4,rho=0.2")
    assert (spec.name, spec.params, spec.label) == ("psst_topk", {"k": 4, "rho": 0.2}, "psst_topk[k=4,rho=0.2]")
    assert spec.params_json == '{"k":4,"rho":0.2}'
    spec = parse_agent_spec(f"{TOY}:Fixed:prompt=1,n=2@fixed")
    assert (spec.name, spec.params, spec.label) == (f"{TOY}:Fixed", {"prompt": 1, "n": 2}, "fixed")
    assert parse_agent_spec(spec.spec) == spec
    assert parse_agent_spec(f"{TOY}:Greedy").label == "Greedy"
    assert parse_agent_spec("psst_topk:flag=true,name=abc").params == {"flag": True, "name": "abc"}


@pytest.mark.parametrize("bad, message", [
    ("no_such_agent", "unknown agent"),
    ("psst_topk:k4", "cannot import|must look like"),
    ("psst_topk:k=1,k=2", "given twice"),
    ("no_such_module_xyz:Agent", "cannot import"),
    ("", "empty agent spec"),
    ("psst@", "empty label"),
])
def test_agent_spec_errors(bad: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_agent_spec(bad)


def test_task_resolution_and_missing_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_task("IAPO-MATH-v0").name == "math"
    assert resolve_task("synthetic_bernoulli").synthetic
    with pytest.raises(ValueError, match="does not exist"):
        resolve_task(str(tmp_path / "nope.h5"))
    def missing(spec: object) -> None:
        raise MissingTableError("no table for task 'math'; `iapo-gym data import MATH_final.pkl`")

    monkeypatch.setattr(iapo_gym.data, "resolve_table", missing)
    log = tmp_path / "log.txt"
    with log.open("w") as fh:
        summary = run_sweep(tmp_path / "out", [resolve_task("math")], [parse_agent_spec(f"{TOY}:Fixed")], [5], 1, log=fh)
    assert summary.skipped_tasks == ["math"] and summary.added == 0
    assert "skipping task 'math'" in log.read_text() and "iapo-gym data import MATH_final.pkl" in log.read_text()
    assert main(["leaderboard", "--tasks", "math", "--agents", f"{TOY}:Fixed", "--out", str(tmp_path / "cli")]) == 1


# ---- the protocol ----------------------------------------------------------------------------


def test_rows_follow_the_protocol(tmp_path: Path, tables: dict[str, str]) -> None:
    _sweep(tmp_path, tables)
    rows = _stored(tmp_path)
    assert len(rows) == 2 * 2 * 2 * 3  # tasks x agents x budgets x runs
    base = {name: read_table(path) for name, path in (("tiny_mv", tables["mv"]), ("tiny_bon", tables["bon"]))}
    for r in rows:
        assert r.split_seed == derive_seed(0, "split", r.task, r.run)
        assert r.env_seed == derive_seed(0, "env", r.task, r.run)
        assert r.table_sha256 == table_checksum(base[r.task])
        assert 0 < r.budget_spent <= r.budget
        env = IAPOEnv(table=base[r.task])
        env.resplit(0.8, r.split_seed)
        policy = Policy(tuple(tuple(a) for a in json.loads(r.arms)))
        assert r.acr == pytest.approx(env.evaluate(policy, "test"), abs=1e-12)
        assert r.optimal_acr == pytest.approx(env.evaluate(env.optimal_policy("test"), "test"), abs=1e-12)
        assert r.train_optimal_acr == pytest.approx(env.evaluate(env.optimal_policy("train"), "test"), abs=1e-12)
        assert r.regret == pytest.approx(r.optimal_acr - r.acr) and r.regret >= -1e-12
    # Pairing: one split and one env stream per (task, run), whatever the agent or budget.
    by_run: dict[tuple[str, int], set[tuple[int | None, int]]] = {}
    for r in rows:
        by_run.setdefault((r.task, r.run), set()).add((r.split_seed, r.env_seed))
    assert all(len(v) == 1 for v in by_run.values())
    assert len({next(iter(v)) for v in by_run.values()}) == len(by_run)
    # The agent seed depends on the agent, not on the budget.
    seeds: dict[tuple[str, int, str], set[int]] = {(r.task, r.run, r.label): set() for r in rows}
    for r in rows:
        seeds[(r.task, r.run, r.label)].add(r.agent_seed)
    assert all(len(s) == 1 for s in seeds.values())


def test_one_and_two_workers_give_identical_results_and_resume_is_a_no_op(tmp_path: Path, tables: dict[str, str]) -> None:
    _sweep(tmp_path / "one", tables, jobs=1)
    _sweep(tmp_path / "two", tables, jobs=2)
    assert _comparable(_stored(tmp_path / "one")) == _comparable(_stored(tmp_path / "two"))
    again = _sweep(tmp_path / "one", tables, jobs=1)
    assert again.added == 0 and again.skipped == again.planned == 24
    assert len(_stored(tmp_path / "one")) == 24


def test_partial_db_resumes_to_the_same_results(tmp_path: Path, tables: dict[str, str]) -> None:
    _sweep(tmp_path / "full", tables)
    full = _stored(tmp_path / "full")
    with ResultStore(tmp_path / "part") as store:  # a sweep that stopped after some rows
        store.claim_meta("root_seed", "0")
        store.claim_meta("train_fraction", "0.8")
        store.add(full[::3])
    summary = _sweep(tmp_path / "part", tables)
    assert summary.skipped == len(full[::3])
    assert _comparable(_stored(tmp_path / "part")) == _comparable(full)


def test_other_seed_in_same_directory_is_refused(tmp_path: Path, tables: dict[str, str]) -> None:
    _sweep(tmp_path, tables)
    with pytest.raises(ValueError, match="root_seed=0, not 1"):
        _sweep(tmp_path, tables, root_seed=1)


def test_overspending_and_crashing_agents_are_failures_not_rows(tmp_path: Path, tables: dict[str, str]) -> None:
    agents = [parse_agent_spec(f"{TOY}:Overspender"), parse_agent_spec(f"{TOY}:Fixed:prompt=1,n=3"),
              parse_agent_spec(f"{TOY}:Fixed:prompt=99@bad_arm")]
    summary = run_sweep(tmp_path, [resolve_task(tables["mv"])], agents, [4], 2, log=open(os.devnull, "w"))  # noqa: SIM115
    messages = {f.label: f.message for f in summary.failures}
    assert "BudgetExceededError" in messages["Overspender"] and "5 completions with a budget of 4" in messages["Overspender"]
    assert "outside prompts" in messages["bad_arm"]
    rows = _stored(tmp_path)
    assert {r.label for r in rows} == {"Fixed[prompt=1,n=3]"}
    assert all(r.budget_spent == 0 and json.loads(r.arms)[0] == [1, 3] for r in rows)


def test_synthetic_tasks_use_instance_r_for_run_r(tmp_path: Path) -> None:
    import gymnasium as gym

    summary = run_sweep(tmp_path, [resolve_task("synthetic_bernoulli")], [parse_agent_spec(f"{TOY}:Fixed")], [10], 2,
                        log=open(os.devnull, "w"))  # noqa: SIM115
    assert summary.added == 2
    rows = _stored(tmp_path)
    assert rows[0].table_sha256 != rows[1].table_sha256
    for r in rows:
        assert r.split_seed is None
        env = gym.make("IAPO-SyntheticBernoulli-v0", instance=r.run).unwrapped
        assert isinstance(env, IAPOEnv)
        assert r.table_sha256 == table_checksum(env.table)
        assert r.acr == pytest.approx(env.evaluate(Policy(((0, 1),) * env.n_contexts), "test"), abs=1e-12)


# ---- interruption, concurrency, Dask --------------------------------------------------------


@pytest.mark.heavy
def test_kill_minus_9_then_rerun_equals_a_clean_sweep(tmp_path: Path, tables: dict[str, str]) -> None:
    args = ["leaderboard", "--tasks", tables["mv"], "--agents", f"{TOY}:Sleepy:delay=0.02", "--budgets", "6", "30",
            "--runs", "40", "--no-table"]
    stopped_at = kill_sweep_midway(args, tmp_path / "killed", "runs", 10, REPO)
    assert 10 <= stopped_at < 80, "the sweep should have been killed mid-way"
    assert stopped_at % 2 == 0  # whole (task, run) units only: one transaction per unit
    assert main([*args, "--out", str(tmp_path / "killed")]) == 0
    assert main([*args, "--out", str(tmp_path / "clean")]) == 0
    killed, clean = _stored(tmp_path / "killed"), _stored(tmp_path / "clean")
    assert len(killed) == 80
    assert _comparable(killed) == _comparable(clean)


def _writer(out: str, rows: list[RunResult], barrier: Any) -> None:
    barrier.wait()
    with ResultStore(out) as store:
        for i in range(0, len(rows), 3):
            store.add(rows[i:i + 3])


def test_concurrent_writers_neither_lose_nor_duplicate_rows(tmp_path: Path) -> None:
    proto = RunResult("t", "sha", "a", "{}", "a", 10, 0, 0, None, 1, 2, 0.5, 0.6, 0.6, 0.1, "[]", "[]", 0.0, 10, "0")
    rows = [replace(proto, run=i, acr=i / 100) for i in range(60)]
    ResultStore(tmp_path).close()
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), part, barrier))
             for part in (rows[:40], rows[20:], rows[::-1])]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    stored = _stored(tmp_path)
    assert sorted(r.run for r in stored) == list(range(60))


def test_dask_local_cluster_matches_local_workers(tmp_path: Path, tables: dict[str, str]) -> None:
    distributed = pytest.importorskip("distributed")
    _sweep(tmp_path / "local", tables, jobs=1)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cluster:
        _sweep(tmp_path / "dask", tables, scheduler=cluster.scheduler_address)
    assert _comparable(_stored(tmp_path / "dask")) == _comparable(_stored(tmp_path / "local"))


# ---- command line and report -----------------------------------------------------------------


def test_cli_prints_table_and_report_writes_files(tmp_path: Path, tables: dict[str, str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = main(["leaderboard", "--tasks", tables["mv"], tables["bon"], "--agents", f"{TOY}:Greedy",
                 f"{TOY}:Fixed:prompt=1@fixed", "--budgets", "6", "30", "--runs", "6", "--jobs", "2", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "## tiny_mv" in printed and "| 1 |" in printed and "T=30" in printed
    assert main(["report", str(out), "--quiet", "--correction", "bh"]) == 0
    report = out / "report"
    data = json.loads((report / "leaderboard.json").read_text())
    assert data["correction"] == "bh" and {r["label"] for r in data["ranking"]} == {"Greedy", "fixed"}
    assert len(data["summary"]) == 2 * 2 * 2
    assert (report / "summary.csv").read_text().splitlines()[0].startswith("task,label,budget,n_runs,acr_mean")
    assert "most chosen (p, N)" in (report / "leaderboard.md").read_text()
    for name in ("acr_vs_budget.png", "pairwise_tiny_mv.png", "best_policy_tiny_bon.png"):
        assert (report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["leaderboard", "--tasks", "synthetic_bernoulli", "--agents", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown agent 'nope'" in capsys.readouterr().err
    assert main(["leaderboard", "--tasks", "synthetic_bernoulli", "--agents", f"{TOY}:Fixed", "--budgets", "0",
                 "--out", str(tmp_path)]) == 2
    assert "budgets must be integers >= 1" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "empty")]) == 1
    assert "no leaderboard results" in capsys.readouterr().err


def test_write_report_needs_results(tmp_path: Path) -> None:
    ResultStore(tmp_path).close()
    with pytest.raises(ValueError, match="no results"):
        write_report(tmp_path)


def test_unique_labels_enforced(tmp_path: Path, tables: dict[str, str]) -> None:
    agents = [parse_agent_spec(f"{TOY}:Fixed:prompt=0@x"), parse_agent_spec(f"{TOY}:Fixed:prompt=1@x")]
    with pytest.raises(ValueError, match="share the label 'x'"):
        run_sweep(tmp_path, [resolve_task(tables["mv"])], agents, [5], 1)


def test_every_row_records_version_and_positive_time(tmp_path: Path, tables: dict[str, str]) -> None:
    from iapo_gym import __version__

    _sweep(tmp_path, tables)
    rows = _stored(tmp_path)
    assert {r.version for r in rows} == {__version__}
    assert all(r.train_seconds > 0 for r in rows)
    assert np.isfinite([r.acr for r in rows]).all()


def test_a_failed_download_skips_the_task_with_its_message(monkeypatch) -> None:
    from iapo_gym.data.download import DownloadError
    from iapo_gym.leaderboard.run.specs import resolve_task, task_available

    def refuse(spec):
        raise DownloadError("download of https://example.invalid/x.pkl failed; nothing was kept")

    monkeypatch.setattr("iapo_gym.data.resolve_table", refuse)
    message = task_available(resolve_task("math"))
    assert message is not None and "skipping task 'math'" in message and "nothing was kept" in message


# ---- effective parameters --------------------------------------------------------------------


def test_every_run_records_the_agents_effective_parameters(tmp_path: Path, tables: dict[str, str]) -> None:
    import agents

    specs = [parse_agent_spec("psst_topk:k=2"), parse_agent_spec("ucb"), parse_agent_spec(f"{TOY}:Fixed:n=2@fixed")]
    summary = run_sweep(tmp_path, [resolve_task(tables["mv"])], specs, [40, 80], 2, log=open(os.devnull, "w"))  # noqa: SIM115
    assert not summary.failures
    rows = _stored(tmp_path)
    assert len(rows) == 3 * 2 * 2
    for r in rows:
        if r.agent == f"{TOY}:Fixed":
            assert r.effective_params is None  # an agent without params(): nothing to record
            continue
        recorded = json.loads(r.effective_params)
        expected = agents.make(r.agent, seed=r.agent_seed, **json.loads(r.params)).params()
        assert recorded == json.loads(json.dumps(expected)) and len(recorded) > len(json.loads(r.params))
    assert json.loads(next(r for r in rows if r.agent == "psst_topk").effective_params)["k"] == 2


def test_a_database_written_before_effective_params_opens_and_keeps_its_rows(tmp_path: Path,
                                                                             tables: dict[str, str]) -> None:
    _sweep(tmp_path / "new", tables)
    new = _stored(tmp_path / "new")
    old = tmp_path / "old"
    old.mkdir()
    with sqlite3.connect(old / "results.sqlite") as conn:  # the schema without the column, as released
        conn.executescript(store_module._SCHEMA.replace("    effective_params TEXT,\n", ""))
        conn.execute("INSERT INTO meta VALUES ('schema_version', '1')")
        fields = [f for f in store_module._RESULT_FIELDS if f != "effective_params"]
        conn.executemany(f"INSERT INTO runs ({', '.join(fields)}) VALUES ({', '.join('?' * len(fields))})",
                         [[getattr(r, f) for f in fields] for r in new[:5]])
        assert "effective_params" not in {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
    rows = _stored(old)
    assert rows == [replace(r, effective_params=None) for r in new[:5]]
    with ResultStore(old) as store:
        assert store.add(new) == len(new) - 5
    assert _stored(old)[5:] == [r for r in new if r.key not in {x.key for x in new[:5]}]
