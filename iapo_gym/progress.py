"""One progress reporter for every long command (a sweep, ``optimize``, ``collect``).

On a terminal it is a tqdm bar with ETA; elsewhere (a log file, a pipe) plain lines, at most one
every ``interval`` seconds, so logs stay readable.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO


def format_seconds(seconds: float) -> str:
    """``1h02m03s``, ``2m03s`` or ``3s``; ``?`` when unknown."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """Progress of ``total`` units (runs, completions): a tqdm bar on a terminal, plain log lines otherwise."""

    def __init__(self, total: int, stream: TextIO | None = None, bar: bool | None = None, interval: float = 5.0,
                 unit: str = "runs", initial: int = 0) -> None:
        """``bar=None`` picks the bar when ``stream`` is a TTY and tqdm is installed; ``initial`` units were done
        before (a resumed job: the ETA counts only this session's pace)."""
        self.total, self.done, self.initial = total, initial, initial
        self.stream = stream if stream is not None else sys.stderr
        self.start = self.last = time.monotonic()
        self.interval = interval
        self.unit = unit
        self._bar: Any = None
        if bar is None:
            bar = bool(getattr(self.stream, "isatty", lambda: False)())
        if bar:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, initial=initial, unit=unit, file=self.stream,
                                 dynamic_ncols=True, smoothing=0.05)

    def update(self, n: int, note: str = "") -> None:
        """``n`` more units done (0: only refresh); ``note`` says what is going on."""
        self.done += n
        if self._bar is not None:
            self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)
            if n == 0:
                self._bar.refresh()
            return
        now = time.monotonic()
        first = self.done - self.initial == n and n > 0
        if now - self.last < self.interval and self.done < self.total and not first:
            return
        self.last = now
        elapsed = now - self.start
        pace = (self.done - self.initial) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / pace if pace > 0 else float("nan")
        note = f" {note};" if note else ""
        print(f"[{self.done}/{self.total} {self.unit}]{note} elapsed {format_seconds(elapsed)}, ETA {format_seconds(eta)}",
              file=self.stream, flush=True)

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()
