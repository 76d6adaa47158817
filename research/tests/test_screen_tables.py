"""research/screen_tables.py: common random numbers per level, a regret of 0 once the train-optimal policy is found, and
the pairing of two runs through a saved file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from screen_tables import level_regrets, main


def test_screen_tables_pairs_the_specs_and_measures_train_regret() -> None:
    regrets = level_regrets("shape6", 0, 90, [300, 200_000], ["auto@a", "auto@b", "psst"])
    assert regrets.shape == (2, 3, 2)
    np.testing.assert_array_equal(regrets[:, 0], regrets[:, 1])  # same seeds, same policies
    assert (regrets[0] >= -1e-12).all()  # nothing beats the train-optimal policy on the train split
    assert regrets[0, 0, 1] < 1e-3 and regrets[0, 2, 1] < 1e-3  # 200,000 completions find the train optimum


def test_screen_tables_pairs_a_saved_run_and_refuses_one_of_other_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--out saves the per-level regrets (those of ``level_regrets``; with --jobs 2 the same); --against pairs a run
    with them, the gain 0 on every level when the code is the same, and refuses a file run with other arguments,
    naming both."""
    saved = tmp_path / "before.json"
    args = ["screen_tables.py", "auto", "--kind", "shape6", "--levels", "2", "--budgets", "300"]
    monkeypatch.setattr(sys, "argv", [*args, "--out", str(saved)])
    main()
    regrets = json.loads(saved.read_text(encoding="utf-8"))["regrets"]
    np.testing.assert_array_equal(regrets, [level_regrets("shape6", level, 90, [300], ["auto"]) for level in (0, 1)])
    in_workers = tmp_path / "workers.json"  # --jobs: the same regrets from worker processes
    monkeypatch.setattr(sys, "argv", [*args, "--jobs", "2", "--out", str(in_workers)])
    main()
    assert json.loads(in_workers.read_text(encoding="utf-8"))["regrets"] == regrets
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", [*args, "--against", str(saved)])
    main()
    out = capsys.readouterr().out
    assert out.count("| auto | +0.00000 ± 0.00000 (0/0) |") == 2  # train and test regret
    monkeypatch.setattr(sys, "argv", [*args[:-1], "400", "--against", str(saved)])
    with pytest.raises(SystemExit, match=r"'budgets': \[300\].*'budgets': \[400\]"):
        main()
