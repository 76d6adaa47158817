"""``iapo-gym leaderboard --rules``: runs over the arm set (prompt, N, stopping rule), scored against the enlarged
ceiling, recorded in rows and bundles, verified exactly; runs without ``--rules`` unchanged."""

from __future__ import annotations

import io
import json
import re
import shlex
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iapo_gym import IAPOEnv, Policy
from iapo_gym.cli import main
from iapo_gym.leaderboard.run.runner import run_setup, run_sweep
from iapo_gym.leaderboard.run.specs import parse_agent_spec, resolve_task
from iapo_gym.leaderboard.run.store import ResultStore, RunResult
from iapo_gym.leaderboard.submit.bundle import read_bundle, write_bundle
from iapo_gym.leaderboard.submit.merge import MergeError, merge
from iapo_gym.leaderboard.submit.verify import verify_bundle
from iapo_gym.oracle import acr_from_q, greedy_policy, q_table
from iapo_gym.rules import default_rules, rule_label
from iapo_gym.tables import write_table
from tests.conftest import tiny_mv_table

REPO = Path(__file__).resolve().parents[1]
HERE = "tests.test_leaderboard_rules"
GREEDY = "tests.leaderboard_toy_agents:Greedy@greedy"
BUDGETS = [30, 120]
RUNS = 3


class FixedRule:
    """The arm (prompt, N, rule) in every context; no training. Records whether its env's arm set had rules."""

    seen_rule_arms: list[bool] = []

    def __init__(self, prompt: int = 0, n: int = 6, rule: int = 1) -> None:
        """The arm to return."""
        self.arm = (prompt, n, rule)

    def train(self, env: Any, budget: int) -> Policy:
        """Spend nothing; return the arm everywhere."""
        base = env.unwrapped
        FixedRule.seen_rule_arms.append(bool(base.rule_arms))
        return Policy(tuple(self.arm for _ in range(base.n_contexts)))


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small majority-vote table on disk (five answers, N_max 8: rules change the optimum) and its task."""
    folder = tmp_path_factory.mktemp("rules_tables")
    path = write_table(tiny_mv_table(seed=5, n_prompts=3, n_queries=40, n_buckets=5, n_max=8), folder / "mv5.h5")
    return {"path": str(path), "ref": resolve_task(str(path)), "tmp": folder}


def _sweep(out: Path, task: dict[str, Any], agents: list[str], rules: bool, seed: int = 0) -> Any:
    specs = [parse_agent_spec(a) for a in agents]
    return run_sweep(out, [task["ref"]], specs, BUDGETS, RUNS, root_seed=seed, log=io.StringIO(), bar=False,
                     rules=rules)


def _rows(out: Path) -> list[RunResult]:
    with ResultStore(out, create=False) as store:
        return store.results()


@pytest.fixture(scope="module")
def sweeps(task: dict[str, Any]) -> dict[str, Path]:
    """The same sweep over the paper's arms and over the rules (a rule-unaware and a rule-choosing agent)."""
    fixed, rules = task["tmp"] / "fixed", task["tmp"] / "rules"
    assert not _sweep(fixed, task, [GREEDY], rules=False).failures
    FixedRule.seen_rule_arms.clear()
    summary = _sweep(rules, task, [GREEDY, f"{HERE}:FixedRule:prompt=1,n=7,rule=2@margin2"], rules=True)
    assert not summary.failures and summary.added == 2 * len(BUDGETS) * RUNS
    assert FixedRule.seen_rule_arms == [True] * len(BUDGETS) * RUNS  # the agents trained on rule_arms envs
    return {"fixed": fixed, "rules": rules}


def test_rules_runs_record_the_arm_set_and_score_against_the_enlarged_ceiling(task: dict[str, Any],
                                                                               sweeps: dict[str, Path]) -> None:
    labels = [rule_label(r) for r in default_rules("mv")]
    fixed = {(r.label, r.budget, r.run): r for r in _rows(sweeps["fixed"])}
    rows = _rows(sweeps["rules"])
    raised = 0
    for r in rows:
        assert r.arm_set is not None and json.loads(r.arm_set) == labels
        arms, optimal = np.array(json.loads(r.arms)), np.array(json.loads(r.optimal_arms))
        assert arms.shape == optimal.shape == (3, 3)  # (p, N, rule) per context, rule 0 written too
        # the exact test ACR over q_table(rules=True) on this run's split, and the optimum over (p, N, rule)
        run_table = run_setup(task["ref"], r.run).run_table
        q4 = q_table(run_table, run_table.split_indices("test"), rules=True)
        probs = run_table.context_probs
        assert r.acr == acr_from_q(q4, arms, probs)
        assert r.acr == IAPOEnv(table=run_table).evaluate(Policy(tuple(map(tuple, arms))), "test")
        best = greedy_policy(q4)
        assert optimal.tolist() == [list(t) for t in best.triples]
        assert r.optimal_acr == float(probs @ q4.reshape(3, -1).max(axis=1))
        assert r.regret == r.optimal_acr - r.acr and r.regret >= 0
        if r.label == "margin2":
            assert arms.tolist() == [[1, 7, 2]] * 3
            continue
        # a rule-unaware agent: the same policy, draws and ACR as without rules; only the ceiling rises
        base = fixed[(r.label, r.budget, r.run)]
        assert arms[:, 2].tolist() == [0, 0, 0] and arms[:, :2].tolist() == json.loads(base.arms)
        assert (r.acr, r.budget_spent, r.train_optimal_acr >= base.train_optimal_acr) == (base.acr, base.budget_spent, True)
        assert r.optimal_acr >= base.optimal_acr and r.regret >= base.regret
        raised += r.optimal_acr > base.optimal_acr
    assert raised > 0  # on this table some stopping rule beats every fixed N


def test_default_runs_are_unchanged_and_a_folder_keeps_one_arm_set(task: dict[str, Any], sweeps: dict[str, Path]) -> None:
    for r in _rows(sweeps["fixed"]):
        assert r.arm_set is None and np.array(json.loads(r.arms)).shape == (3, 2)
        assert np.array(json.loads(r.optimal_arms)).shape == (3, 2)
    path = write_bundle(sweeps["fixed"], task["tmp"] / "fixed.iapo.zip")
    with zipfile.ZipFile(path) as zf:
        manifest = json.loads(zf.read("manifest.json"))
        rows = [json.loads(line) for line in zf.read("results.jsonl").decode().splitlines()]
    assert "arm_set" not in manifest["protocol"] and "rules" not in manifest["tasks"][0]
    assert all("arm_set" not in row for row in rows)
    with pytest.raises(ValueError, match="arm_set=fixed, not rules"):
        _sweep(sweeps["fixed"], task, [GREEDY], rules=True)
    with pytest.raises(ValueError, match="arm_set=rules, not fixed"):
        _sweep(sweeps["rules"], task, [GREEDY], rules=False)
    # a folder written before the arm set was recorded holds (p, N) runs: --rules is refused there too
    old = task["tmp"] / "old"
    old.mkdir()
    with sqlite3.connect(sweeps["fixed"] / "results.sqlite") as src, sqlite3.connect(old / "results.sqlite") as dst:
        src.backup(dst)
    with sqlite3.connect(old / "results.sqlite") as conn:
        assert conn.execute("DELETE FROM meta WHERE key = 'arm_set'").rowcount == 1
    with pytest.raises(ValueError, match="arm_set=fixed, not rules"):
        _sweep(old, task, [GREEDY], rules=True)
    # a policy that stops by a rule is outside the paper's arm set: a failed run, nothing stored
    summary = _sweep(task["tmp"] / "fixed_rule", task, [f"{HERE}:FixedRule@margin2"], rules=False)
    assert summary.added == 0 and len(summary.failures) == len(BUDGETS) * RUNS
    assert "stopping rules are arms only with --rules" in summary.failures[0].message


def test_bundle_records_the_arm_set_and_verify_recomputes_it(task: dict[str, Any], sweeps: dict[str, Path],
                                                               tmp_path: Path) -> None:
    path = write_bundle(sweeps["rules"], tmp_path / "rules.iapo.zip")
    bundle = read_bundle(path)  # checked against bundle-schema.json
    assert bundle.manifest["protocol"]["arm_set"] == "rules"
    assert bundle.manifest["tasks"][0]["rules"] == [rule_label(r) for r in default_rules("mv")]
    assert [r.arm_set for r in bundle.results] == [r.arm_set for r in _rows(sweeps["rules"])]
    outcome = verify_bundle(path, None, seed=3, tables={task["ref"].name: task["path"]})
    assert outcome.ok and len(outcome.checks) == 2 * len(BUDGETS) * RUNS
    with pytest.raises(MergeError, match="arm set"):
        merge([str(sweeps["rules"]), str(write_bundle(sweeps["fixed"], tmp_path / "fixed.iapo.zip"))], tmp_path / "m")


def _tampered(sweeps: dict[str, Path], tmp: Path, sql: str) -> Path:
    copy = tmp / "copy"
    copy.mkdir()
    with sqlite3.connect(sweeps["rules"] / "results.sqlite") as src, sqlite3.connect(copy / "results.sqlite") as dst:
        src.backup(dst)
    with sqlite3.connect(copy / "results.sqlite") as conn:
        assert conn.execute(sql).rowcount >= 1
    return write_bundle(copy, tmp / "tampered.iapo.zip")


@pytest.mark.parametrize("sql, note, n_bad", [
    # the rule of one context changed (margin(m=2) -> margin(m=3)), the rest of the row untouched
    ("UPDATE runs SET arms = '[[1, 7, 3], [1, 7, 2], [1, 7, 2]]' WHERE label = 'margin2' AND budget = 30 AND run = 1",
     "policy differs", 1),
    # the runs claim another arm set (a bundle holds one per task)
    ("UPDATE runs SET arm_set = '[\"fixed\", \"margin(m=9)\"]'", "arm set differs", 2 * len(BUDGETS) * RUNS),
    # a lower ceiling (less regret)
    ("UPDATE runs SET optimal_acr = optimal_acr - 0.001, regret = regret - 0.001 "
     "WHERE label = 'greedy' AND budget = 30 AND run = 2", "optimal ACR or regret differs", 1),
])
def test_verify_fails_on_a_tampered_rule_run(task: dict[str, Any], sweeps: dict[str, Path], tmp_path: Path,
                                             sql: str, note: str, n_bad: int) -> None:
    path = _tampered(sweeps, tmp_path, sql)
    outcome = verify_bundle(path, None, seed=3, tables={task["ref"].name: task["path"]})
    bad = [c for c in outcome.checks if not c.match]
    assert not outcome.ok and len(bad) == n_bad and all(note in c.note for c in bad)


def test_cli_rules_run_and_report_name_the_arm_set(task: dict[str, Any], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    code = main(["leaderboard", "--tasks", task["path"], "--agents", GREEDY, f"{HERE}:FixedRule@margin2",
                 "--budgets", "30", "--runs", "2", "--rules", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "Arm set: (prompt, N, stopping rule) with the rules fixed, margin(m=2)" in text
    assert main(["report", str(out), "--no-plots", "--quiet", "--html"]) == 0
    report = (out / "report" / "leaderboard.md").read_text()
    assert "optimum and the regret are over this enlarged arm set" in report
    assert "most chosen (p, N, rule)" in report
    assert re.search(r"\| \(\d+, \d+, (fixed|margin\(m=\d\)|posterior\(level=0\.\d+\))\) \|", report)
    site = (out / "report" / "site" / "index.html").read_text()
    assert "Arm set: (prompt, N, stopping rule) with the rules fixed, margin(m=2)" in site


def _block_after(doc: str, heading: str, lang: str) -> str:
    """The first ```lang block after ``heading`` in docs/``doc``."""
    text = (REPO / "docs" / doc).read_text(encoding="utf-8")
    start = text.index(heading)
    match = re.compile(rf"^```{lang}\n(.*?)^```", re.S | re.M).search(text, start)
    assert match is not None
    return match.group(1)


def test_the_docs_rules_commands_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """docs/leaderboard.md's ``--rules`` commands (in a scratch folder) and docs/environment.md's rule_arms block."""
    commands = [line for line in _block_after("leaderboard.md", "## Stopping rules as arms", "sh").splitlines()
                if line.strip()]
    assert [c.split()[:2] for c in commands] == [["iapo-gym", "leaderboard"]] * 2 + [["iapo-gym", "bundle"],
                                                                                   ["iapo-gym", "verify"]]
    monkeypatch.chdir(tmp_path)
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, command
    assert "verified: 4 of 4 runs match exactly" in capsys.readouterr().out
    rules, fixed = _rows(tmp_path / "results" / "rules"), _rows(tmp_path / "results" / "fixed")
    assert len(rules) == len(fixed) == 16 and all(r.arm_set for r in rules) and not any(r.arm_set for r in fixed)
    assert all(r.optimal_acr >= f.optimal_acr for r, f in zip(rules, fixed, strict=True))
    scope: dict[str, Any] = {}
    block = _block_after("environment.md", "### The enlarged arm set", "python")
    exec(compile(block, "docs/environment.md", "exec"), scope)  # noqa: S102
    env, best = scope["env"], scope["best"]
    assert env.rule_arms and len(best.triples) == env.n_contexts
    assert env.evaluate(best, "test") > env.evaluate(env.optimal_policy("test"), "test")  # rules help on this level


@pytest.mark.heavy
def test_bench_rules_agents_part_pairs_the_two_arm_sets(tmp_path: Path) -> None:
    """benchmarks/bench_rules.py --part agents: its paired gain is the difference of the two sweeps' rows, a rerun
    reuses them, and a changed agent source is refused."""
    out = tmp_path / "bench"
    argv = [sys.executable, str(REPO / "benchmarks" / "bench_rules.py"), "--part", "agents", "--families", "mv_binary",
            "--levels", "3", "--seeds", "0", "--agents", "psst", "--budgets", "400", "--out", str(out)]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert first.returncode == 0, first.stderr[-2000:]
    fixed, rules = _rows(out / "fixed-seed0"), _rows(out / "rules-seed0")
    assert len(fixed) == len(rules) == 3 and all(r.arm_set for r in rules) and not any(f.arm_set for f in fixed)
    assert [(f.env_seed, f.agent_seed) for f in fixed] == [(r.env_seed, r.agent_seed) for r in rules]  # paired
    gain = np.mean([r.acr - f.acr for f, r in zip(fixed, rules, strict=True)])
    line = next(x for x in first.stdout.splitlines() if x.startswith("| mv_binary | psst | 400 | 3 |"))
    assert line.split(" | ")[7].startswith(f"{gain:+.4f}")
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0 and "3 of 3 runs already in" in again.stderr and line in again.stdout
    sources = json.loads((out / "agent_sources.json").read_text())
    (out / "agent_sources.json").write_text(json.dumps({**sources, "psst": "0" * 64}))
    changed = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert changed.returncode != 0 and "the source of psst changed" in changed.stderr
