"""A Best-of-N scorer for the collector tests: two objectives from the completion text, in [-1, 1]."""

from __future__ import annotations


def score(completion: str, query: str) -> dict[str, float]:
    """``length``: longer completions score higher; ``digits``: the share of digit characters, centred."""
    n = len(completion)
    return {"length": min(n, 20) / 10.0 - 1.0, "digits": 2.0 * sum(ch.isdigit() for ch in completion) / max(n, 1) - 1.0}
