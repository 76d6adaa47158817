"""benchmarks/where_lost.py: its phases add up to the regret the leaderboard stored for the same agent and runs."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.cli import main as cli_main
from iapo_gym.leaderboard.run.store import ResultStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from where_lost import vote_variance, where_lost  # noqa: E402

SPEC = "plugin_anytime:kappa=4.0@pa"


def _row(markdown_row: str) -> list[str]:
    return [cell.strip() for cell in markdown_row.strip().strip("|").split("|")]


def test_where_lost_books_the_stored_regret_to_phases(tmp_path: Path) -> None:
    """A rerun with the leaderboard's seeds trains the same policies, so its phases' losses add up to the
    stored mean regret against the train-optimal policy; some loss falls in the tail's first round."""
    out = tmp_path / "store"
    assert cli_main(["leaderboard", "--tasks", "synthetic_bernoulli", "--agents", SPEC, "--budgets", "1500",
                     "--runs", "3", "--seed", "5", "--out", str(out), "--no-table"]) == 0
    with ResultStore(out, create=False) as store:
        stored = float(np.mean([r.train_optimal_acr - r.acr for r in store.results()]))
    row = _row(where_lost("synthetic_bernoulli", 5, 1500, 3, SPEC))
    assert row[:3] == ["synthetic_bernoulli", "1500", "3"]
    assert float(row[3]) == pytest.approx(stored, abs=1e-4)
    phases = {cell.rsplit(" (", 1)[0].rsplit(" ", 1)[0]: float(cell.rsplit(" (", 1)[0].rsplit(" ", 1)[1])
              for cell in row[4:]}
    assert sum(phases.values()) == pytest.approx(stored, abs=5e-4)
    assert set(phases) >= {"whole steps", "tail round 1"}, phases
    with pytest.raises(ValueError, match="plugin_anytime"):
        where_lost("synthetic_bernoulli", 5, 1500, 1, "psst")


def test_vote_variance_splits_one_vote_and_skips_best_of_n() -> None:
    """A Bernoulli table's within-pair part is positive and below one vote's variance (at most 1/4);
    Best-of-N has no gold answer."""
    row = _row(vote_variance("synthetic_bernoulli", 0))
    total, within = float(row[1]), float(row[2].split()[0])
    assert 0.0 < within < total <= 0.25
    assert "not majority vote" in vote_variance("synthetic_categorical", 0)
