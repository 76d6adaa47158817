"""How ``iapo-gym leaderboard`` runs a sweep of either protocol (the paper's, ``cli``; the online one, ``online_cli``):
the sweep itself, its errors and interruption, the summary line, the table and the report, in one place."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def check_scheduler(scheduler: str | None) -> None:
    """A ValueError unless ``scheduler`` is None, ``local`` or an address with a scheme (``tcp://host:8786``)."""
    if scheduler and scheduler != "local" and "://" not in scheduler:
        raise ValueError(f"--scheduler must be 'local' or an address like tcp://host:8786, got {scheduler!r}")


def run_sweep_command(out: str, sweep: Callable[[], tuple[Any, Sequence[Any]]], noun: str,
                      table: Callable[[Sequence[Any]], str | None] | None,
                      report: Callable[[], dict[str, Path]] | None) -> int:
    """Run ``sweep`` (resolving its tasks and agents, then running; it returns the summary and the tasks) and say
    what it did: the exit code of ``iapo-gym leaderboard``.

    ``noun`` names the runs in the summary line; ``table`` (None with ``--no-table``) gives the ranked table of the
    tasks' results, or None when there is none; ``report`` (with ``--report``) writes the report. Both are called
    only when some run is done. Bad input (ValueError, RuntimeError) exits 2, an interruption 130 (finished runs
    are kept), no task with a table here 1, a failed run 1.
    """
    try:
        summary, tasks = sweep()
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished runs are saved in {out}; rerun the same command to continue", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError) as exc:
        print(f"iapo-gym leaderboard: error: {exc}", file=sys.stderr)
        return 2
    if len(summary.skipped_tasks) == len(tasks):
        print("iapo-gym leaderboard: error: none of the tasks has a table here (see above)", file=sys.stderr)
        return 1
    print(f"{summary.added} {noun} added, {summary.skipped} already done, {len(summary.failures)} failed "
          f"in {summary.seconds:.1f} s; results in {out}/results.sqlite", file=sys.stderr)
    if summary.added + summary.skipped:
        text = table(tasks) if table is not None else None
        if text:
            print(text)
        if report is not None:
            written = report()
            print(f"report written to {written['markdown'].parent}", file=sys.stderr)
    return 1 if summary.failures else 0
