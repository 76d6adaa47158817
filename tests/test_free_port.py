"""The tests' ``free_port``: no port is handed out twice, in one process or across the processes of a machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.llm_server import _claim, free_port

ROOT = Path(__file__).resolve().parent.parent


def test_a_port_another_process_was_handed_is_not_handed_out_here() -> None:
    """A second process's ``free_port`` claims its port: this process may not claim it (the race of two suites run
    side by side, where the kernel hands a released port to the second before the first binds it)."""
    done = subprocess.run([sys.executable, "-c", "from tests.llm_server import free_port; print(free_port())"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    other = int(done.stdout.strip())
    assert not _claim(other)
    mine = {free_port() for _ in range(20)}
    assert len(mine) == 20 and other not in mine and not any(_claim(p) for p in mine)
