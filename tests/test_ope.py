"""``iapo-gym evaluate-log``'s estimators against exact values on simulated traffic (docs/deploy.md, "Logging,
feedback and off-policy evaluation").

The traffic: requests of Synthetic-Bernoulli's contexts, each served an arm drawn by a known stochastic logging
policy, its N completions drawn from the table's outcome distribution of a random query, the majority vote (ties
broken uniformly) giving the feedback true/false, written through ``OutcomeLog`` (real SQLite files) and read
back as ``evaluate-log`` reads them. The table's exact oracle gives the candidate's true value per context and
overall (the logged context frequencies weighting the exact Q of its arms).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.data import load_task_table
from iapo_gym.ope import evaluate, row_utility
from iapo_gym.oracle import q_table
from iapo_gym.outcome_log import LogError, LogRow, OutcomeLog, new_response_id, read_log
from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyPrompt

TABLE = load_task_table("synthetic_bernoulli", instance=0)
Q = q_table(TABLE)  # exact (C, P, N_max) over every query
UNIT = TABLE.cost_matrix().mean(axis=1)  # the cost per completion Q's cost term uses
NAMES = ("low", "mid", "high")
#: The logging policy: per context three arms (prompt index, N) and their probabilities.
LOGGING = {0: ([(1, 9), (14, 5), (3, 1)], [0.5, 0.3, 0.2]),
           1: ([(14, 5), (1, 3), (3, 1)], [0.4, 0.4, 0.2]),
           2: ([(3, 1), (14, 3), (1, 1)], [0.6, 0.25, 0.15])}
#: Candidates: per context one arm the logging policy serves with some probability.
CANDIDATES = {"a": {0: (14, 5), 1: (3, 1), 2: (1, 1)}, "b": {0: (3, 1), 1: (14, 5), 2: (14, 3)},
              "c": {0: (1, 9), 1: (1, 3), 2: (3, 1)}}


def _candidate(arms: dict[int, tuple[int, int]]) -> PolicyFile:
    prompts = tuple(PolicyPrompt(str(p)) for p in TABLE.prompts)
    return PolicyFile(task="synthetic_bernoulli", aggregator="mv", api=None, n_max=TABLE.n_max,
                      objectives=("correct",), scorer=None, sampling=None, prompts=prompts,
                      contexts=tuple(PolicyContext(NAMES[c], (1.0,), float(TABLE.context_weights[c, -1]), 1 / 3,
                                                   str(TABLE.prompts[p]), n) for c, (p, n) in arms.items()),
                      learned={"agent": "test"}, estimate={"method": None})


def _simulate(folder: Path, requests: int, seed: int, *, recorded: dict[int, list[float]] | None = None) -> None:
    """``requests`` logged requests drawn by the logging policy; ``recorded``: other propensities to write down
    (a logger that gets them wrong) in place of the true ones."""
    rng = np.random.default_rng(seed)
    ctx = rng.integers(3, size=requests)
    pick = np.stack([rng.choice(3, size=requests, p=LOGGING[c][1]) for c in range(3)])
    k = pick[ctx, np.arange(requests)]
    p = np.array([LOGGING[c][0][j][0] for c, j in zip(ctx, k, strict=True)])
    n = np.array([LOGGING[c][0][j][1] for c, j in zip(ctx, k, strict=True)])
    q = rng.integers(TABLE.n_queries, size=requests)
    counts = rng.multinomial(n, TABLE.probs[p, q])  # (requests, M): the votes of the N completions
    top = counts == counts.max(axis=1, keepdims=True)
    tie = rng.random(requests) * top.sum(axis=1)  # uniform among the tied buckets
    winner = np.argmax(np.cumsum(top, axis=1) > tie[:, None], axis=1)
    correct = winner == TABLE.gold[q]
    props = recorded or {c: LOGGING[c][1] for c in LOGGING}
    log = OutcomeLog(folder, {"aggregator": "mv", "objectives": ["correct"]}, flush_ms=20, batch=4096)
    try:
        for i in range(requests):
            c = int(ctx[i])
            log.record(LogRow(id=new_response_id("cmpl-", 1e9 + i), time=1e9 + i, context=NAMES[c],
                              weights=tuple(float(w) for w in TABLE.context_weights[c]),
                              prompt=str(TABLE.prompts[p[i]]), n=int(n[i]), rule=None, drawn=int(n[i]),
                              propensity=props[c][int(k[i])],
                              outcomes={"aggregator": "mv", "answers": [], "votes": [], "tied": [], "chosen": 0},
                              prompt_tokens=0, completion_tokens=0, cost=None, unit_cost=float(UNIT[p[i]]),
                              query=None, reward=bool(correct[i]), reward_time=None))
    finally:
        log.close()


def _exact(arms: dict[int, tuple[int, int]], freq: np.ndarray) -> tuple[np.ndarray, float]:
    per = np.array([Q[c, p, n - 1] for c, (p, n) in sorted(arms.items())])
    return per, float(freq @ per)


def _read(folder: Path) -> tuple[list[LogRow], np.ndarray]:
    """The log's rows, and the share of each context among them."""
    _, rows = read_log(folder)
    kept = list(rows)
    names = [r.context for r in kept]
    return kept, np.array([names.count(n) for n in NAMES], dtype=np.float64) / len(names)


def test_the_true_value_falls_in_the_dr_interval_in_most_seeds_and_dr_is_tighter_than_ips(tmp_path: Path) -> None:
    seeds, covered, widths = 12, {k: 0 for k in CANDIDATES}, {k: [] for k in CANDIDATES}
    per_context_covered = per_context_total = 0
    for seed in range(seeds):
        folder = tmp_path / f"log{seed}"
        _simulate(folder, 3000, seed)
        rows, freq = _read(folder)
        for name, arms in CANDIDATES.items():
            per_context, overall, counts = evaluate(rows, _candidate(arms))
            assert {k: counts[k] for k in ("used", "unrated", "uncovered")} == {"used": 3000, "unrated": 0, "uncovered": 0}
            per_true, true = _exact(arms, freq)
            assert overall.dr is not None and overall.ips is not None
            covered[name] += overall.dr.covers(true)
            widths[name].append((overall.dr.high - overall.dr.low) / (overall.ips.high - overall.ips.low))
            for e in per_context:
                assert e.dr is not None
                per_context_covered += e.dr.covers(per_true[NAMES.index(e.name)])
                per_context_total += 1
    # a 95 % interval: in at least 9 of 12 seeds for each candidate (binomial: P(< 9 | 0.95) < 0.002)
    assert all(v >= 9 for v in covered.values()), covered
    assert per_context_covered >= 0.85 * per_context_total, (per_context_covered, per_context_total)
    # the plug-in model removes most of the reward's variance: DR's interval is narrower than IPS's
    assert all(np.median(w) < 0.8 for w in widths.values()), {k: np.median(v) for k, v in widths.items()}


def test_a_wrong_propensity_makes_ips_miss(tmp_path: Path) -> None:
    """The logger writes 0.5 where context 0's arm (3, 1) was served with probability 0.2 and context 2's (1, 1)
    with 0.15: IPS then weighs those rows 2 instead of 5 or 6.7 and misses the true value."""
    wrong = {0: [0.3, 0.2, 0.5], 1: [0.4, 0.4, 0.2], 2: [0.6, 0.25, 0.5]}
    arms = {0: (3, 1), 1: (3, 1), 2: (1, 1)}
    missed_wrong = missed_right = 0
    for seed in range(6):
        for recorded, is_wrong in ((wrong, True), (None, False)):
            folder = tmp_path / f"log{seed}-{is_wrong}"
            _simulate(folder, 3000, 100 + seed, recorded=recorded)
            rows, freq = _read(folder)
            _, overall, _ = evaluate(rows, _candidate(arms))
            _, true = _exact(arms, freq)
            assert overall.ips is not None
            if is_wrong:
                missed_wrong += not overall.ips.covers(true)
            else:
                missed_right += not overall.ips.covers(true)
    assert missed_wrong == 6 and missed_right <= 2, (missed_wrong, missed_right)


def test_the_logging_policy_value_and_context_without_support(tmp_path: Path) -> None:
    _simulate(tmp_path / "log", 1500, 7)
    rows, freq = _read(tmp_path / "log")
    logging_true = sum(freq[c] * sum(pr * Q[c, p, n - 1] for (p, n), pr in zip(*LOGGING[c], strict=True))
                       for c in range(3))
    arms = {0: (14, 5), 1: (3, 1), 2: (20, 7)}  # context high's arm was never served
    per_context, overall, _ = evaluate(rows, _candidate(arms))
    assert overall.logged.covers(logging_true), (overall.logged, logging_true)
    high = next(e for e in per_context if e.name == "high")
    assert high.support == 0 and high.dr is None and high.ips is None
    assert overall.dr is None  # the candidate's value over all contexts needs every one
    assert all(e.dr is not None for e in per_context if e.name != "high")


def test_rows_without_utility_and_missing_costs_are_named() -> None:
    row = LogRow(id="cmpl-1", time=0.0, context="mid", weights=(1.0, -0.2), prompt="p", n=3, rule=None, drawn=2,
                 propensity=1.0, outcomes={"aggregator": "mv", "chosen": 0}, prompt_tokens=0, completion_tokens=0,
                 cost=None, unit_cost=None, query=None, reward=None, reward_time=None)
    assert row_utility(row, {}) is None  # a vote without feedback has no utility
    rated = LogRow(**{**row.__dict__, "reward": True})
    with pytest.raises(LogError, match="--cost p=VALUE"):
        row_utility(rated, {})
    assert row_utility(rated, {"p": 0.01}) == pytest.approx(1.0 - 0.2 * 3 * 0.01)
    bon = LogRow(**{**row.__dict__, "weights": (0.3, 0.7, 0.0), "outcomes": {"aggregator": "bon", "chosen": 1,
                                                                            "scores": [0.1, 0.4]}})
    assert row_utility(bon, {}) == pytest.approx(0.4)  # the served completion's weighted score
    vector = LogRow(**{**bon.__dict__, "reward": [1.0, 0.5]})
    assert row_utility(vector, {}) == pytest.approx(0.3 + 0.35)


def test_the_command_prints_and_writes_the_estimates(tmp_path: Path) -> None:
    _simulate(tmp_path / "log", 600, 3)
    policy = _candidate(CANDIDATES["a"]).save(tmp_path / "candidate.json")
    out = tmp_path / "ope.json"
    run = subprocess.run([sys.executable, "-m", "iapo_gym.cli", "evaluate-log", str(tmp_path / "log"), "--policy",
                          str(policy), "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "DR" in run.stdout and "overall" in run.stdout
    doc = json.loads(out.read_text())
    assert doc["counts"]["used"] == 600 and {c["context"] for c in doc["contexts"]} == set(NAMES)
    _, rows = read_log(tmp_path / "log")
    _, overall, _ = evaluate(rows, _candidate(CANDIDATES["a"]))
    assert overall.dr is not None and doc["overall"]["dr"]["value"] == pytest.approx(overall.dr.value)
    bad = subprocess.run([sys.executable, "-m", "iapo_gym.cli", "evaluate-log", str(tmp_path / "nothing"), "--policy",
                          str(policy)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "does not exist" in bad.stderr
