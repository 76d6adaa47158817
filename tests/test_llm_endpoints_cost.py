"""docs/deploy.md's "Cost weight from a spend target": every number of its worked example, recomputed with the exact
oracle on a two-model table whose cost is money, and the spend per request that optimize's report gives."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.env import IAPOEnv
from iapo_gym.llm.prices import cost_weight, spend_per_request, spend_report
from iapo_gym.llm.spec import tomllib
from iapo_gym.policyfile import describe
from iapo_gym.tables import OutcomeTable, read_table, write_table

DOC = Path(__file__).resolve().parent.parent / "docs" / "deploy.md"


def section() -> str:
    text = DOC.read_text(encoding="utf-8")
    return text.split("## Cost weight from a spend target", 1)[1].split("\n## ", 1)[0]


def rows(text: str, first: str) -> list[list[str]]:
    """The cells of the markdown table whose header starts with ``| first |``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first} |"))
    out = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        out.append([cell.strip() for cell in line.strip("|").split("|")])
    return out


def example_table(arms: list[list[str]], contexts: list[list[str]], n_queries: int = 5) -> OutcomeTable:
    """A majority-vote table of the doc's arms: every query's gold answer has the arm's accuracy, cost in USD."""
    accuracy = np.array([float(r[1]) for r in arms])
    probs = np.empty((len(arms), n_queries, 2))
    probs[:, :, 0] = accuracy[:, None]
    probs[:, :, 1] = 1.0 - accuracy[:, None]
    weights = np.array([[1.0, cost_weight(float(c[1]))] for c in contexts])
    return OutcomeTable(task="two-models", aggregator="mv", probs=probs, gold=np.zeros(n_queries, dtype=np.int64),
                        cost=np.array([float(r[2]) for r in arms]), cost_unit="USD", n_max=1,
                        prompts=tuple(r[0] for r in arms), objective_names=("correct",), context_weights=weights,
                        context_names=tuple(c[0] for c in contexts), context_probs=np.full(len(contexts), 0.5))


def test_the_worked_example_of_deploy_md_is_what_the_exact_oracle_gives(tmp_path: Path) -> None:
    text = section()
    arms, contexts = rows(text, "arm"), rows(text, "context")
    assert [r[0] for r in arms] == ["small/direct", "large/direct"] and len(contexts) == 2
    table = example_table(arms, contexts)
    env = IAPOEnv(table=table)  # no stored split: every query is in both
    q = env.q_table("test")  # (contexts, prompts, N): the exact expected utility (no stored split: all queries)
    for c, row in enumerate(contexts):
        name, value, weight, u_small, u_large, chosen, spend = row
        assert float(weight) == cost_weight(float(value)) == table.context_weights[c, 1]
        assert q[c, 0, 0] == pytest.approx(float(u_small), abs=5e-13)
        assert q[c, 1, 0] == pytest.approx(float(u_large), abs=5e-13)
        assert table.prompts[int(np.argmax(q[c, :, 0]))] == chosen
        # the spend per request of the chosen arm, as optimize's report computes it
        pf = describe([(int(np.argmax(q[i, :, 0])), 1) for i in range(len(contexts))], table)
        assert spend_per_request(pf, table.cost)[c] == pytest.approx(float(spend), rel=1e-12)
    # the break-even value of a unit of accuracy, and its value per point
    extra_cost = table.cost[1] - table.cost[0]
    extra_accuracy = float(arms[1][1]) - float(arms[0][1])
    stated = re.search(r"costs ([\d.]+) USD more per request for ([\d.]+) more accuracy, so it is\s+worth it when "
                       r"V >= [\d.]+ / [\d.]+ = ([\d.]+) USD per unit of accuracy \(([\d.]+) USD per point\)", text)
    assert stated is not None
    assert float(stated.group(1)) == pytest.approx(extra_cost, rel=1e-12)
    assert float(stated.group(2)) == pytest.approx(extra_accuracy, rel=1e-12)
    assert float(stated.group(3)) == pytest.approx(extra_cost / extra_accuracy, abs=5e-6)
    assert float(stated.group(4)) == pytest.approx(extra_cost / extra_accuracy / 100, abs=5e-8)
    # the spec's [[contexts]] block states the same cost weights
    block = re.search(r"```toml\n(.*?)```", text, re.S)
    assert block is not None
    stated_contexts = tomllib.loads(block.group(1))["contexts"]
    assert [(c["name"], cost_weight(c["value_per_quality"])) for c in stated_contexts] == \
        [(r[0], float(r[2])) for r in contexts]

    # optimize's report section on this table, written and read back with its cost unit
    path = write_table(table, tmp_path / "two-models.h5")
    assert read_table(path).cost_unit == "USD"
    report = spend_report(pf, str(path))
    assert "in USD" in report
    assert "| thrifty | small/direct | 1 | 2e-05 | 2e-05 |" in report
    assert "| quality | large/direct | 1 | 0.0004 | 0.0004 |" in report
    assert "Over the contexts' distribution: 0.00021 USD per request." in report


def test_optimize_on_a_synthetic_task_reports_the_spend_of_its_run_instance(tmp_path: Path) -> None:
    from iapo_gym.data import load_task_table
    from iapo_gym.leaderboard.optimize import optimize

    result = optimize("synthetic_bernoulli", "uniform", 300, tmp_path / "out", seed=0, run=1)
    table = load_task_table("synthetic_bernoulli", instance=1)  # run 1 trains on instance 1
    cost = table.cost_matrix().mean(axis=1)
    index = {p: i for i, p in enumerate(table.prompts)}
    report = result.report_path.read_text(encoding="utf-8")
    assert "in normalized cost units" in report
    for c in result.policy.contexts:
        assert f"| {c.name} | {c.prompt} | {c.n} | {cost[index[c.prompt]]:.6g} | {c.n * cost[index[c.prompt]]:.6g} |" \
            in report
