"""The one progress reporter: plain lines off a terminal (first, throttled, last), the ETA from this session's pace."""

from __future__ import annotations

import io
import re

from iapo_gym.progress import Progress, format_seconds


def test_plain_lines_first_throttled_and_last() -> None:
    out = io.StringIO()  # not a TTY: log lines, no bar
    progress = Progress(10, out, interval=3600.0, unit="runs")
    for i in range(10):
        progress.update(1, f"unit {i}")
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # the first update and the last; the rest fall inside the interval
    assert re.fullmatch(r"\[1/10 runs\] unit 0; elapsed \d+s, ETA \d+s", lines[0])
    assert re.fullmatch(r"\[10/10 runs\] unit 9; elapsed \d+s, ETA 0s", lines[1])


def test_a_resumed_job_counts_from_where_it_was_and_refreshes_without_progress() -> None:
    out = io.StringIO()
    progress = Progress(100, out, interval=0.0, unit="completions logged", initial=40)
    progress.update(0, "2 in flight")  # nothing new yet: the ETA is unknown, not computed from the earlier 40
    progress.update(10, "3 of them from the cache")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[40/100 completions logged] 2 in flight; elapsed") and lines[0].endswith("ETA ?")
    assert lines[1].startswith("[50/100 completions logged] 3 of them from the cache; elapsed")
    assert progress.done == 50


def test_format_seconds() -> None:
    assert [format_seconds(s) for s in (3.4, 125, 3723, float("nan"))] == ["3s", "2m05s", "1h02m03s", "?"]
