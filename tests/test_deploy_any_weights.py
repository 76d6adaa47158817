"""Weights no context has: the arm the policy's own estimates rate best, re-derived independently; refusals; old files."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.cli import main
from iapo_gym.deploy import ContextError, Router, load_policy
from iapo_gym.deploy.router import RatedContext
from iapo_gym.env import IAPOEnv
from iapo_gym.leaderboard.run.runner import DEFAULT_TRAIN_FRACTION, run_setup
from iapo_gym.leaderboard.run.specs import resolve_task
from iapo_gym.policyfile import PolicyFile, PolicyFileError, PolicyPrompt, load_text
from iapo_gym.tables import OutcomeTable
from tests.llm_server import free_port, write_spec

pytest.importorskip("openai")


def _servable(pf: PolicyFile) -> PolicyFile:
    """A table target's policy with prompt texts and a scorer, so a Router takes it (no request is sent here)."""
    scorer = {"extractor": "last_number"} if pf.aggregator == "mv" else {
        "callable": "tests.llm_scorer:score", "reward_url": None, "objectives": list(pf.objectives), "grid": None,
        "score_range": None}
    return dataclasses.replace(pf, prompts=tuple(PolicyPrompt(p.id, p.id + " {query}") for p in pf.prompts),
                               api="completions", scorer=scorer)


def _plug_in(pf: PolicyFile, prompt: str, n: int, weights: list[float]) -> float:
    """The plug-in utility of arm (prompt, n), computed by the exact oracle of a one-prompt table whose outcome
    distributions are the stored completions' empirical ones per query (an independent path to the same number)."""
    assert pf.arm_estimates is not None
    e = next(e for e in pf.arm_estimates["prompts"] if e["id"] == prompt)
    groups = e["queries"]
    width = len(e["outcomes"]) if pf.aggregator == "bon" else max(len(row) for row in groups)
    counts = np.zeros((1, len(groups), width))
    for q, row in enumerate(groups):
        for a, k in enumerate(row):
            counts[0, q, a] += k
    common = dict(task="t", probs=counts / counts.sum(axis=2, keepdims=True), cost=np.full((1, len(groups)), e["cost"]),
                  n_max=pf.n_max, context_weights=np.array([weights]), context_names=("w",), context_probs=np.ones(1),
                  prompts=(prompt,), queries=tuple(f"q{i}" for i in range(len(groups))),
                  objective_names=pf.objectives)
    if pf.aggregator == "mv":
        table = OutcomeTable(aggregator="mv", gold=np.zeros(len(groups), np.int64), **common)
    else:
        atoms = np.broadcast_to(np.asarray(e["outcomes"], dtype=np.float64), (1, len(groups), width, len(pf.objectives)))
        table = OutcomeTable(aggregator="bon", atoms=np.ascontiguousarray(atoms), **common)
    return float(IAPOEnv(table=table).q_table("test")[0, 0, n - 1])


def _by_hand(pf: PolicyFile, weights: list[float]) -> tuple[str, int, float]:
    """The two learned contexts nearest in direction (weights over the sum of absolute objective weights), and of their
    arms the one with the better plug-in utility (the nearer on a tie)."""
    def unit(w: Sequence[float]) -> np.ndarray:
        return np.asarray(w) / np.abs(np.asarray(w[:-1])).sum()

    near = sorted(pf.contexts, key=lambda c: float(((unit(c.weights) - unit(weights)) ** 2).sum()))[:2]
    rated = [(_plug_in(pf, c.prompt, c.n, weights), -k, c) for k, c in enumerate(near)]
    u, _, c = max(rated, key=lambda r: (r[0], r[1]))
    return c.prompt, c.n, u


@pytest.mark.heavy
@pytest.mark.parametrize(("task", "budget", "between"), [
    ("synthetic_bernoulli", 3000, [[1.0, -0.1], [1.0, -0.5], [1.0, -0.2000001], [2.0, -0.3], [0.5, -0.05]]),
    ("synthetic_categorical", 4000, [[0.25, 0.75, -0.3], [0.55, 0.45, -0.1], [1.0, 0.0, -0.7]]),
])
def test_weights_between_contexts_get_the_arm_the_estimates_rate_best(task: str, budget: int, between: list,
                                                                      tmp_path: Path) -> None:
    assert main(["optimize", task, "--agent", "auto", "--budget", str(budget), "--out", str(tmp_path / "p"),
                 "--quiet"]) == 0
    pf = load_policy(tmp_path / "p" / "policy.json")
    est = pf.arm_estimates
    assert est is not None and est["completions"] == pf.learned["completions"]
    assert sum(sum(row) for e in est["prompts"] for row in e["queries"]) == est["completions"]
    router = Router(_servable(pf), write_spec(tmp_path, free_port(), aggregator=pf.aggregator))
    for c in pf.contexts:  # a context's own weights: its learned arm
        got = router.resolve(list(c.weights))
        assert got is c and not isinstance(got, RatedContext)
    for weights in between:
        assert not any(np.allclose(c.weights, weights, rtol=1e-9, atol=0) for c in pf.contexts)
        got = router.resolve(weights)
        assert isinstance(got, RatedContext)
        prompt, n, utility = _by_hand(pf, weights)
        assert (got.prompt, got.n) == (prompt, n)
        assert got.route["estimated_utility"] == pytest.approx(utility, abs=1e-9)
        assert got.route["by"] == "estimated_utility" and got.route["nearest_context"] in {c.name for c in pf.contexts}
        assert list(got.weights) == weights
    # the report's exact check of weights midway between contexts: the arm served, evaluated by the table's oracle
    setup = run_setup(resolve_task(task), 0, 0, DEFAULT_TRAIN_FRACTION)
    rows = pf.estimate["any_weights"]
    assert rows and len(rows) == len(pf.contexts) - 1
    for row in rows:
        got = router.resolve(row["weights"])
        assert (got.prompt, got.n) == (row["prompt"], row["n"])
        probe = dataclasses.replace(setup.run_table, context_weights=np.array([row["weights"]]), context_names=("w",),
                                    context_probs=np.ones(1))
        q = IAPOEnv(table=probe).q_table("test")[0]
        index = [p.id for p in pf.prompts].index(row["prompt"])
        assert row["exact"] == q[index, row["n"] - 1] and row["optimal"] == q.max()
    assert "checked exactly on the test queries" in (tmp_path / "p" / "report.md").read_text()


def test_weights_outside_the_policy_are_refused_and_old_files_answer_their_contexts(tmp_path: Path) -> None:
    assert main(["optimize", "synthetic_bernoulli", "--agent", "uniform", "--budget", "600", "--out",
                 str(tmp_path / "p"), "--quiet"]) == 0
    pf = _servable(load_policy(tmp_path / "p" / "policy.json"))
    spec = write_spec(tmp_path, free_port())
    router = Router(pf, spec)
    for bad, why in (([1.0, 0.3], "cost weight 0.3 is positive"), ([-1.0, -0.2], "objective weight -1.0 for 'correct'"),
                     ([1.0, -0.2, 0.5], "must list 1 objective weight"), ([0.7], "give the cost weight too")):
        with pytest.raises(ContextError, match=why):
            router.resolve(bad)
    # a version 1 file (no arm_estimates) still loads and answers its contexts' weights, and only those
    doc = dataclasses.replace(pf, arm_estimates=None).to_dict()
    doc["version"] = 1
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    doc["sha256"] = hashlib.sha256(body.encode()).hexdigest()
    old = load_text(json.dumps(doc), "old.json")
    assert old.arm_estimates is None
    old_router = Router(old, spec)
    assert old_router.resolve([1.0, -0.2]).name == "mid"
    with pytest.raises(ContextError, match="carries no per-arm estimates"):
        old_router.resolve([1.0, -0.5])
    # version 1 cannot carry estimates; version 2 estimates must fit the policy
    doc1 = dict(doc, arm_estimates=pf.arm_estimates)
    body = json.dumps({k: v for k, v in doc1.items() if k != "sha256"}, sort_keys=True, separators=(",", ":"))
    doc1["sha256"] = hashlib.sha256(body.encode()).hexdigest()
    with pytest.raises(PolicyFileError, match="arm_estimates"):
        load_text(json.dumps(doc1))
    assert pf.arm_estimates is not None
    empty = json.loads(json.dumps(pf.arm_estimates))
    empty["prompts"][0]["queries"].append([0, 0])
    with pytest.raises(PolicyFileError, match="a query with no completion"):
        dataclasses.replace(pf, arm_estimates=empty)
    with pytest.raises(PolicyFileError, match="too large to rate"):
        dataclasses.replace(pf, n_max=10**6)
