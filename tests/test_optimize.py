"""``iapo-gym optimize``: bit for bit the leaderboard's run on a table; live: cached reruns and a served round trip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from iapo_gym import Policy
from iapo_gym.cli import main
from iapo_gym.data import load_task_table
from iapo_gym.deploy import load_policy
from iapo_gym.leaderboard.run.runner import run_sweep
from iapo_gym.leaderboard.run.specs import parse_agent_spec, resolve_task
from iapo_gym.leaderboard.run.store import ResultStore
from iapo_gym.tables import write_table
from tests.llm_server import (
    free_port,
    llama_server,  # noqa: F401 (fixture)
    proxy,  # noqa: F401 (fixture)
    proxy_stats,
    stop,
    tiny_model,  # noqa: F401 (fixture)
    write_spec,
)


def _leaderboard_rows(out: Path) -> dict[tuple[str, int, int], tuple[list[list[int]], float, float]]:
    with ResultStore(out) as store:
        rows = store.results()
    return {(r.agent, r.budget, r.run): (json.loads(r.arms), r.acr, r.regret) for r in rows}


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["synthetic", "table file"])
def test_optimize_on_a_table_is_the_leaderboard_run(kind: str, tmp_path: Path) -> None:
    if kind == "synthetic":  # instance r per run, stored split
        target = "synthetic_bernoulli"
    else:  # a table file: the leaderboard resplits it per run with a derived seed
        target = str(write_table(load_task_table("synthetic_categorical", instance=2), tmp_path / "cat.h5"))
    agents, budget, seed = ["auto", "ucb", "psst"], 2000, 3
    run_sweep(tmp_path / "lb", [resolve_task(target)], [parse_agent_spec(a) for a in agents], [budget], runs=2,
              root_seed=seed, log=open(tmp_path / "lb.log", "w"), bar=False)  # noqa: SIM115
    rows = _leaderboard_rows(tmp_path / "lb")
    policies = set()
    for agent in agents:
        for run in (0, 1):
            out = tmp_path / f"{agent}-{run}"
            assert main(["optimize", target, "--agent", agent, "--budget", str(budget), "--out", str(out),
                         "--seed", str(seed), "--run", str(run), "--quiet"]) == 0
            pf = load_policy(out / "policy.json")
            arms, acr, regret = rows[(agent, budget, run)]
            assert [list(a) for a in Policy.load(out / "policy.json").arms] == arms
            assert pf.estimate["acr"] == acr and pf.estimate["regret"] == regret  # exact, same float operations
            assert pf.learned["seed"] == seed and pf.learned["run"] == run and pf.learned["completions"] <= budget
            report = (out / "report.md").read_text(encoding="utf-8")
            assert f"regret {regret:.6f}" in report and "exact" in report
            policies.add(json.dumps(arms))
    assert len(policies) > 1  # the comparison is not between identical trivial policies


def test_optimize_refuses_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["optimize", "synthetic_bernoulli", "--agent", "nosuchagent", "--budget", "10", "--out",
                 str(tmp_path)]) == 1
    assert "unknown agent 'nosuchagent'" in capsys.readouterr().err
    assert main(["optimize", "synthetic_bernoulli", "--budget", "0", "--out", str(tmp_path)]) == 1
    assert "budget must be an integer >= 1" in capsys.readouterr().err
    assert main(["optimize", "synthetic_bernoulli", "--budget", "100", "--check", "50", "--out", str(tmp_path)]) == 1
    assert "--check is for a live target" in capsys.readouterr().err
    assert not (tmp_path / "policy.json").exists()


def test_optimize_a_collected_table_with_its_spec_is_servable(tmp_path: Path, llama_server: int) -> None:  # noqa: F811
    from iapo_gym.deploy import Router
    from iapo_gym.llm.collect import collect
    from iapo_gym.llm.spec import load_spec

    spec_path = write_spec(tmp_path, llama_server, n_max=3, sampling={"temperature": 0.9, "max_tokens": 4})
    result = collect(load_spec(spec_path), tmp_path / "coll", progress=False)
    assert result.table is not None
    out = tmp_path / "opt"
    assert main(["optimize", str(result.table), "--agent", "uniform", "--budget", "60", "--out", str(out),
                 "--spec", str(spec_path), "--quiet"]) == 0
    pf = load_policy(out / "policy.json")
    assert [p.template for p in pf.prompts] == ["Q: {query}\nA:", "{query} ->"]
    assert pf.scorer == {"extractor": "regex", "pattern": r"\A\s*(\S)", "choices": "ABCDE"}
    assert pf.sampling == {"max_tokens": 4, "temperature": 0.9, "seed": 1} and pf.estimate["method"] == "exact"
    assert Router(pf, spec_path).policy is pf  # servable: texts and scorer are there
    assert "Serve it" in (out / "report.md").read_text(encoding="utf-8")



def test_optimize_live_then_serve_round_trip(tmp_path: Path, proxy: int) -> None:  # noqa: F811
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from tests.deploy_helpers import start_serve

    queries = [{"id": f"q{i}", "text": f"{i} + {i} =", "gold": str(2 * i)[0]} for i in range(10)]
    spec = write_spec(tmp_path, proxy, n_max=3, queries=queries, sampling={"temperature": 0.9, "max_tokens": 4},
                      endpoint={"concurrency": 8}, extra={"build": {"test_fraction": 0.3}})
    out = tmp_path / "opt"
    args = ["optimize", str(spec), "--budget", "120", "--check", "60", "--out", str(out),  # the default agent: auto
            "--quiet", "--seed", "4"]
    start = proxy_stats(proxy)
    assert main(args) == 0
    first = proxy_stats(proxy)
    assert first["posts"] > start["posts"]
    pf = load_policy(out / "policy.json")
    assert pf.learned["target_kind"] == "live" and pf.learned["completions"] <= 120
    assert pf.learned["requests"] > 0 and pf.learned["check"]["requests"] > 0
    assert pf.learned["requests"] + pf.learned["check"]["requests"] == first["posts"] - start["posts"]
    est = pf.estimate
    assert est["method"] == "monte_carlo" and est["split"] == "test" and est["stderr"] >= 0
    assert est["completions"] <= 60 and 1 <= est["queries"] <= 3
    assert all(c.value is not None and c.completions for c in pf.contexts)
    # every training completion is kept as the arm estimates; per context the completions drawn with early stopping
    assert pf.arm_estimates is not None and pf.arm_estimates["completions"] == pf.learned["completions"]
    assert all(c.expected_drawn is None or 1 <= c.expected_drawn <= c.n for c in pf.contexts)
    assert sum(c.probability * c.value for c in pf.contexts if c.value is not None) == pytest.approx(est["acr"])
    assert pf.prompt("plain").template == "Q: {query}\nA:" and pf.scorer is not None
    first_text = (out / "policy.json").read_text(encoding="utf-8")
    # a rerun is answered from the response cache: not one request, the same policy
    assert main(args) == 0
    assert proxy_stats(proxy)["posts"] == first["posts"]
    assert load_policy(out / "policy.json").arms == pf.arms
    assert json.loads(first_text)["estimate"] == load_policy(out / "policy.json").estimate
    # serve it: each context gets the policy's prompt and N, and the upstream sees N completions
    port = free_port()
    serve = start_serve(out / "policy.json", spec, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for c in pf.contexts:
            before = proxy_stats(proxy)
            resp = client.completions.create(model=f"iapo/{c.name}", prompt="7 + 7 =")
            after = proxy_stats(proxy)
            iapo = resp.model_extra["iapo"]
            assert (iapo["context"], iapo["prompt"], iapo["n"]) == (c.name, c.prompt, c.n)
            # N is a cap: the vote stops once decided, and the upstream saw exactly the completions drawn
            assert after["choices"] - before["choices"] == iapo["drawn"] <= c.n
            assert iapo["route"] == {"by": "context"}
    finally:
        stop(serve)
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "Monte Carlo ACR" in report and "95% interval" in report
    assert np.isfinite(est["acr"])
