"""``ServedLog``: what the online agent keeps of the requests it served, against a list of the pulls logged."""

from __future__ import annotations

import numpy as np

from agents.online.served_log import ServedLog
from iapo_gym import Pulls


def _random_batch(rng: np.random.Generator, size: int, contexts: int) -> tuple[np.ndarray, Pulls, np.ndarray]:
    ns = rng.integers(1, 6, size)
    pulls = Pulls.of(rng.integers(0, 5, size), ns, rng.integers(0, 40, size), rng.integers(0, 7, int(ns.sum())))
    return rng.integers(0, 10_000, size), pulls, rng.normal(size=(size, contexts))


def _rows(steps: np.ndarray, pulls: Pulls, utilities: np.ndarray) -> list[tuple[object, ...]]:
    """One tuple per pull: its step, prompt, N, query, atoms and utilities."""
    return [(int(steps[i]), int(pulls.prompts[i]), int(pulls.ns[i]), int(pulls.queries[i]),
             tuple(pulls.atoms[pulls.offsets[i]:pulls.offsets[i + 1]].tolist()), tuple(utilities[i].tolist()))
            for i in range(len(pulls))]


def test_the_log_reads_what_was_logged_in_order_and_earlier_reads_never_change() -> None:
    """Batches, single requests, ``keep`` and ``clear`` in a random order: each read is the reference list of the
    pulls still logged, its offsets the running sum of its Ns; every view read before holds what it held."""
    rng = np.random.default_rng(0)
    contexts = 3
    log, reference = ServedLog(), []
    reads: list[tuple[list[tuple[object, ...]], tuple[np.ndarray, Pulls, np.ndarray]]] = []
    for _ in range(400):
        action = rng.choice(["batch", "one", "one", "keep", "clear"], p=[0.35, 0.25, 0.25, 0.1, 0.05])
        if action == "batch":
            steps, pulls, utilities = _random_batch(rng, int(rng.integers(0, 90)), contexts)
            log.add(steps, pulls, utilities)
            reference += _rows(steps, pulls, utilities)
        elif action == "one":
            steps, pulls, utilities = _random_batch(rng, 1, contexts)
            log.add_one(int(steps[0]), int(pulls.prompts[0]), int(pulls.ns[0]), int(pulls.queries[0]), pulls.atoms,
                        utilities[0])
            reference += _rows(steps, pulls, utilities)
        elif action == "keep" and reference:
            mask = rng.random(len(reference)) < 0.7
            log.keep(mask)
            reference = [row for row, kept in zip(reference, mask, strict=True) if kept]
        elif action == "clear":
            log.clear()
            reference = []
        assert bool(log) == bool(reference)
        if reference:
            steps, pulls = log.read()
            utilities = log.utilities()
            assert _rows(steps, pulls, utilities) == reference
            assert pulls.offsets[0] == 0 and np.array_equal(np.diff(pulls.offsets), pulls.ns)
            assert pulls.completions == pulls.atoms.size
            reads.append((list(reference), (steps, pulls, utilities)))
    assert len(reads) > 100
    for expected, view in reads:  # appends, keeps and clears after a read left it as it was
        assert _rows(*view) == expected


def test_an_empty_log_reads_no_pull() -> None:
    log = ServedLog()
    steps, pulls = log.read()
    assert not log and steps.size == 0 and len(pulls) == 0 and pulls.completions == 0
    assert log.utilities().shape[0] == 0
