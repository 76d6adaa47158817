"""research/screen_tables.py: common random numbers per level, and a regret of 0 once the train-optimal policy is found."""

from __future__ import annotations

import numpy as np
from screen_tables import level_regrets


def test_screen_tables_pairs_the_specs_and_measures_train_regret() -> None:
    regrets = level_regrets("shape6", 0, 90, [300, 200_000], ["auto@a", "auto@b", "psst"])
    assert regrets.shape == (2, 3, 2)
    np.testing.assert_array_equal(regrets[:, 0], regrets[:, 1])  # same seeds, same policies
    assert (regrets[0] >= -1e-12).all()  # nothing beats the train-optimal policy on the train split
    assert regrets[0, 0, 1] < 1e-3 and regrets[0, 2, 1] < 1e-3  # 200,000 completions find the train optimum
