"""The tuning rule of research/bench_challenger.py: choosing a candidate from one or several tuning stores."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_challenger import select

from iapo_gym.leaderboard.run.store import ResultStore, RunResult

TRAIN_OPTIMAL, PSST_ACR, TOPK_ACR = 0.6, 0.5, 0.4  # PSST is the better reference: regret 0.1


def _store(path: Path, acrs: dict[str, float], runs: int = 5, budget: int = 3000) -> str:
    """A tuning store of one task and budget: PSST, PSST+K4 and each candidate at a constant test ACR."""
    labels = {"psst": PSST_ACR, "psst+K4": TOPK_ACR, **acrs}
    rows = [RunResult(task="t", table_sha256="0", agent=label, params="{}", label=label, budget=budget, run=run,
                      root_seed=0, split_seed=None, env_seed=0, agent_seed=0, acr=acr, optimal_acr=0.7,
                      train_optimal_acr=TRAIN_OPTIMAL, regret=0.7 - acr, arms="[]", optimal_arms="[]",
                      train_seconds=0.01, budget_spent=budget, version="test")
            for label, acr in labels.items() for run in range(runs)]
    with ResultStore(path) as store:
        store.add(rows)
    return str(path)


def test_select_averages_the_share_removed_over_the_tuning_stores(tmp_path: Path) -> None:
    """A removes 60 % of PSST's regret on seed 1 and 20 % on seed 2, B 50 % on both: seed 1 alone picks A,
    the two seeds together pick B (mean 40 % against 50 %)."""
    first = _store(tmp_path / "s1", {"A": 0.56, "B": 0.55})
    second = _store(tmp_path / "s2", {"A": 0.52, "B": 0.55})
    best, scores = select([first], ["A", "B"], ["t"], [3000])
    assert best == "A" and scores["A"] == pytest.approx(0.6)
    best, scores = select([first, second], ["A", "B"], ["t"], [3000])
    assert best == "B"
    assert scores == pytest.approx({"A": 0.4, "B": 0.5})


def test_select_refuses_a_candidate_missing_from_a_store(tmp_path: Path) -> None:
    first = _store(tmp_path / "s1", {"A": 0.56, "B": 0.55})
    second = _store(tmp_path / "s2", {"A": 0.52})
    with pytest.raises(SystemExit, match="'B' lacks tuning runs in .*s2"):
        select([first, second], ["A", "B"], ["t"], [3000])


def test_floor_rule_scores_a_candidate_by_its_worst_cell(tmp_path: Path) -> None:
    """Two tasks in two stores: A removes 90 % on task u and 30 % on task t, B 55 % on both (each the
    same in both stores): the mean rule picks A (60 % against 55 %), the floor rule B (30 % against 55 %)."""
    stores = []
    for name in ("s1", "s2"):
        path = tmp_path / name
        _store(path, {"A": 0.53, "B": 0.555})  # task "t"
        with ResultStore(path) as store:
            rows = store.results()
        store_rows = [RunResult(**{**row.__dict__, "task": "u",
                                   "acr": {"A": 0.59, "B": 0.555}.get(row.label, row.acr)}) for row in rows]
        with ResultStore(path) as store:
            store.add(store_rows)
        stores.append(str(path))
    best, scores = select(stores, ["A", "B"], ["t", "u"], [3000])
    assert best == "A" and scores == pytest.approx({"A": 0.6, "B": 0.55})
    best, scores = select(stores, ["A", "B"], ["t", "u"], [3000], rule="floor")
    assert best == "B" and scores == pytest.approx({"A": 0.3, "B": 0.55})
    with pytest.raises(ValueError, match="rule must be 'mean' or 'floor', got 'median'"):
        select(stores, ["A", "B"], ["t", "u"], [3000], rule="median")
