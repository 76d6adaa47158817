"""research/trim_readings.py: the train-optimal and the chosen prompt's readings, read for the right prompts."""

from __future__ import annotations

import numpy as np
from screen_tables import level_table
from trim_readings import trim_readings

from iapo_gym.oracle import greedy_policy, q_table


def test_trim_readings_reads_the_optimal_and_the_chosen_prompt() -> None:
    """Tuning level ``bon_shift`` 118 at 10K: the first record is the train-optimal prompt's (from the table, not from
    the agent), a second one only where `auto` chose another prompt, the chosen one last; the chosen prompt was live
    when the tail began (the tail only trims); and each record is read for its own prompt: its queries with at least
    N draws fall with N from all its seen queries, and its N = 1 estimate is within 0.02 of that prompt's own true
    value on the queries it saw (at 10K each has several draws per query, so its N = 1 estimate is near its
    seen-query mean whether or not `auto` picks the optimal prompt)."""
    records = trim_readings("family:bon_shift", 118, 90, 10_000, 0)
    table = level_table("family:bon_shift", 118, 90)[0]
    optimal = int(greedy_policy(q_table(table, table.split_indices("train"))).arms[0][0])
    assert records[0]["prompt"] == optimal and records[0]["role"] == "optimal"
    assert len(records) in (1, 2) and records[-1]["live_at_tail"]
    if len(records) == 2:
        assert records[1]["role"] == "chosen" and records[1]["prompt"] != optimal
    for record in records:
        reached = np.array([row[4] for row in record["rows"]])
        assert reached[0] == record["queries_seen"] > 0 and (np.diff(reached) <= 0).all()
        assert record["completions"] >= 2 * record["queries_seen"]  # two draws per (prompt, query) at least
        n, estimate, on_seen, _, _ = record["rows"][0]
        assert n == 1 and abs(estimate - on_seen) < 0.02
