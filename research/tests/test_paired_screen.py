"""research/paired_screen.py: common random numbers, whatever the number of worker processes."""

from __future__ import annotations

import numpy as np
from paired_screen import report, screen

SPECS = ["plugin_anytime@a", "plugin_anytime@b", "plugin_anytime:pretest=0.0@c", "psst@d"]


def test_paired_screen_shares_the_draws_and_ignores_the_worker_count() -> None:
    """Two specs with the same settings get the same regrets run by run (one agent seed per run); a
    variant with another prior differs somewhere; one or two workers give the same array."""
    one = screen("synthetic_bernoulli", 3, 3, [2000, 1000], SPECS, jobs=1)
    assert one.shape == (3, 4, 2)
    np.testing.assert_array_equal(one[:, 0], one[:, 1])
    assert not np.array_equal(one[:, 0], one[:, 2])
    assert np.isfinite(one).all()
    np.testing.assert_array_equal(one, screen("synthetic_bernoulli", 3, 3, [1000, 2000], SPECS, jobs=2))
    text = report(one, [1000, 2000], SPECS)
    assert "| b | +0.00000 ± 0.00000 (+0 %) | +0.00000 ± 0.00000 (+0 %) |" in text
