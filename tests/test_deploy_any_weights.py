"""Weights no context has: the arm the policy's own estimates rate best, re-derived independently; refusals; old files."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.cli import main
from iapo_gym.deploy import ContextError, Router, load_policy
from iapo_gym.deploy.router import RatedContext
from iapo_gym.policyfile import PolicyFile, PolicyFileError, PolicyPrompt, load_text
from tests.llm_server import free_port, write_spec

pytest.importorskip("openai")


def _servable(pf: PolicyFile) -> PolicyFile:
    """A table target's policy with prompt texts and a scorer, so a Router takes it (no request is sent here)."""
    scorer = {"extractor": "last_number"} if pf.aggregator == "mv" else {
        "callable": "tests.llm_scorer:score", "reward_url": None, "objectives": list(pf.objectives), "grid": None,
        "score_range": None}
    return dataclasses.replace(pf, prompts=tuple(PolicyPrompt(p.id, p.id + " {query}") for p in pf.prompts),
                               api="completions", scorer=scorer)


def _by_hand(pf: PolicyFile, weights: list[float], min_blocks: int) -> tuple[str, int, float]:
    """The best arm re-derived with plain Python from the stored pulls: per arm the mean over its disjoint N-blocks of
    the vote credit (1/t if the gold answer 0 is among the t most voted) or of the best weighted objective vector."""
    best: tuple[float, str, int] | None = None
    est = pf.arm_estimates
    assert est is not None
    for e in est["prompts"]:
        for n in range(1, pf.n_max + 1):
            values = []
            for pull in e["pulls"]:
                for b in range(len(pull) // n):
                    block = pull[b * n:(b + 1) * n]
                    if pf.aggregator == "mv":
                        counts = Counter(block)
                        top = max(counts.values())
                        tied = [a for a, v in counts.items() if v == top]
                        values.append(1.0 / len(tied) if 0 in tied else 0.0)
                    else:
                        values.append(max(sum(w * o for w, o in zip(weights[:-1], e["outcomes"][i], strict=True))
                                          for i in block))
            if len(values) < max(1, min_blocks):
                continue
            reward = sum(values) / len(values) * (weights[0] if pf.aggregator == "mv" else 1.0)
            utility = reward + weights[-1] * n * e["cost"]
            if best is None or utility > best[0] + 1e-12:
                best = (utility, e["id"], n)
    assert best is not None
    return best[1], best[2], best[0]


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
    assert sum(len(pull) for e in est["prompts"] for pull in e["pulls"]) == est["completions"]
    router = Router(_servable(pf), write_spec(tmp_path, free_port(), aggregator=pf.aggregator))
    for c in pf.contexts:  # a context's own weights: its learned arm
        got = router.resolve(list(c.weights))
        assert got is c and not isinstance(got, RatedContext)
    for weights in between:
        assert not any(np.allclose(c.weights, weights, rtol=1e-9, atol=0) for c in pf.contexts)
        got = router.resolve(weights)
        assert isinstance(got, RatedContext)
        prompt, n, utility = _by_hand(pf, weights, router._min_blocks)
        assert (got.prompt, got.n) == (prompt, n)
        assert got.route["estimated_utility"] == pytest.approx(utility, abs=1e-12)
        assert got.route["by"] == "estimated_utility" and got.route["nearest_context"] in {c.name for c in pf.contexts}
        assert list(got.weights) == weights


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
    long_pull = json.loads(json.dumps(pf.arm_estimates))
    long_pull["prompts"][0]["pulls"].append([0] * (pf.n_max + 1))
    with pytest.raises(PolicyFileError, match="above n_max"):
        dataclasses.replace(pf, arm_estimates=long_pull)
