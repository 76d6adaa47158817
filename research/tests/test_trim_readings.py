"""research/trim_readings.py: the train-optimal and the chosen prompt's readings, read for the right prompts."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "research"))
from trim_readings import trim_readings  # noqa: E402


def test_trim_readings_reads_the_optimal_and_the_chosen_prompt() -> None:
    """Tuning level ``bon_shift`` 118 at 10K, where `auto` picks another prompt than the train-optimal 17: the optimal
    record comes first and is the better on the train split at N_max, the chosen prompt was live when the tail
    began (the tail only trims), and each N = 1 estimate is within 0.02 of its own prompt's true value on the
    queries it saw (0.52 and 0.77: a reading of the other prompt would be off by 0.25)."""
    optimal, chosen = trim_readings("family:bon_shift", 118, 90, 10_000, 0)
    assert (optimal["role"], chosen["role"]) == ("optimal", "chosen")
    assert optimal["prompt"] != chosen["prompt"]
    assert optimal["rows"][-1][3] > chosen["rows"][-1][3]
    assert chosen["live_at_tail"]
    for record in (optimal, chosen):
        n, estimate, on_seen, _, reached = record["rows"][0]
        assert n == 1 and abs(estimate - on_seen) < 0.02 and reached == record["queries_seen"]
