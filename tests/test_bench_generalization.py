"""benchmarks/bench_generalization.py: the share of baseline regret removed, the significance count, worker-count independence."""

from __future__ import annotations

import csv
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.leaderboard.run.specs import parse_agent_spec
from iapo_gym.leaderboard.run.store import RunResult

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_generalization", REPO / "benchmarks" / "bench_generalization.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_generalization"] = module
    spec.loader.exec_module(module)
    return module


def _row(task: str, agent: str, budget: int, run: int, regret: float) -> RunResult:
    spec = parse_agent_spec(agent)
    return RunResult(task=task, table_sha256="0" * 64, agent=spec.name, params=spec.params_json, label=spec.label,
                     budget=budget, run=run, root_seed=0, split_seed=run, env_seed=0, agent_seed=0, acr=0.5 - regret,
                     optimal_acr=0.6, train_optimal_acr=0.5, regret=0.1 + regret, arms="[]", optimal_arms="[]",
                     train_seconds=0.01, budget_spent=budget, version="test")


def test_share_removed_and_worse_levels_are_counted_as_defined() -> None:
    bench = _bench()
    rng = np.random.default_rng(0)
    rows = []
    levels = [0, 1, 2, 3]
    for level in levels:
        task = bench.task_name("bon_flat", level)
        for run in range(10):
            psst = 0.02 + 0.001 * rng.random()
            rows.append(_row(task, bench.PSST, 1000, run, psst))
            rows.append(_row(task, bench.PSST_K4, 1000, run, 0.01 if level else 0.04))  # the better baseline, but level 0
            # "good" halves the better baseline's regret on every level; "bad" is worse than PSST on levels 0 and 1
            rows.append(_row(task, "uniform@good", 1000, run, 0.5 * min(0.01 if level else 0.04, psst)))
            rows.append(_row(task, "ucb@bad", 1000, run, psst + (0.01 if level < 2 else -0.001)))
    agents = [parse_agent_spec(a) for a in (bench.PSST, bench.PSST_K4, "uniform@good", "ucb@bad")]
    cells, level_rows = bench.analyse(rows, agents, ["bon_flat"], levels, [1000])
    by = {c.agent: c for c in cells}
    good, bad = by["good"], by["bad"]
    assert good.n_levels == 4 and good.n_worse_than_psst == 0
    assert good.median_share_removed == pytest.approx(0.5, abs=0.03)
    assert good.ci_low <= good.median_share_removed <= good.ci_high
    assert bad.n_worse_than_psst == 2 and bad.share_worse_than_psst == 0.5  # 10 one-sided pairs: p = 0.002, Holm x4
    assert by["psst+K4"].median_share_removed == pytest.approx(0.0)  # the baseline itself on levels 1-3
    worse_levels = sorted(r.level for r in level_rows if r.agent == "bad" and r.worse_than_psst)
    assert worse_levels == [0, 1]
    adjusted = [r.p_vs_psst_holm for r in level_rows if r.agent == "bad"]
    raw = [r.p_vs_psst for r in level_rows if r.agent == "bad"]
    assert all(a >= p for a, p in zip(adjusted, raw, strict=True)) and not any(math.isnan(a) for a in adjusted)


def _read(path: Path, drop: str | None = None) -> list[dict[str, str]]:
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    for row in rows:
        row.pop(drop or "", None)
    return rows


def test_a_small_run_writes_its_outputs_and_does_not_depend_on_the_worker_count(tmp_path: Path) -> None:
    bench = _bench()
    common = ["--families", "bon_flat", "mv_binary", "--levels", "0:1", "--budgets", "300", "--resplits", "3",
              "--agents", "psst", "tests.leaderboard_toy_agents:Greedy"]
    assert bench.main([*common, "--jobs", "1", "--out", str(tmp_path / "one")]) == 0
    assert bench.main([*common, "--jobs", "2", "--out", str(tmp_path / "two")]) == 0
    for name in ("generalization.md", "generalization.csv", "levels.csv", "generalization.png"):
        assert (tmp_path / "one" / name).is_file()
    assert _read(tmp_path / "one" / "levels.csv") == _read(tmp_path / "two" / "levels.csv")
    one = _read(tmp_path / "one" / "generalization.csv", drop="mean_train_seconds")
    assert one == _read(tmp_path / "two" / "generalization.csv", drop="mean_train_seconds")
    assert {r["agent"] for r in one} == {"psst", "psst+K4", "Greedy"} and len(one) == 2 * 3
    md = (tmp_path / "one" / "generalization.md").read_text()
    assert "| bon_flat |" in md and "| mv_binary |" in md
