"""research/tune_online.py: the grid's combinations, tuning levels only, one line per setting with its means."""

from __future__ import annotations

import sys

import pytest
import tune_online


def test_grid_runs_every_combination_on_tuning_levels(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert tune_online.parse_grid(["width=0.05,0.1", "entry_n=2"]) == {"width": [0.05, 0.1], "entry_n": [2]}
    monkeypatch.setattr(sys, "argv", ["tune_online.py", "--grid", "width=0.0,0.05", "--fixed", "budget=0",
                                      "--families", "bon_shift", "--levels", "5", "--horizon", "300",
                                      "--schedules", "stationary"])
    tune_online.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "'width': 0.0" in lines[0] and "'width': 0.05" in lines[1]
    assert all("'budget': 0" in line and "stationary=" in line for line in lines)
    monkeypatch.setattr(sys, "argv", ["tune_online.py", "--levels", "1000000"])
    with pytest.raises(SystemExit, match="tuning levels only"):
        tune_online.main()
