"""benchmarks/online_peers.py: Vowpal Wabbit and MABWiser run the online protocol through ``run_online`` with the real
libraries, choose only available arms, repeat for a seed and learn; the adapters' fast paths are bit-identical to
the plain library calls (pyvw's ``Workspace.predict`` / ``learn`` on the lines, MABWiser's ``partial_fit``); both
run through the leaderboard's runner (``module:Class`` agent specs) with the same rows whatever ``--jobs``, and bad
online agent specs are refused."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iapo_gym.leaderboard.run.online import parse_online_spec, read_online, run_online_sweep
from iapo_gym.leaderboard.run.specs import resolve_task
from iapo_gym.online import OnlineAgentBase, OnlineEnv, Requests, Served, run_online

REPO = Path(__file__).resolve().parents[1]


def _peers():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("online_peers", REPO / "benchmarks" / "online_peers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["online_peers"] = module
    spec.loader.exec_module(module)
    return module


class Uniform(OnlineAgentBase):
    """Uniform over the available prompts at N on the peers' grid."""

    def start(self, env: OnlineEnv, seed: int) -> None:
        super().start(env, seed)
        self.grid = _peers().n_grid(env.table.n_max)

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        live = np.flatnonzero(requests.available)
        return live[self.rng.integers(live.size, size=len(requests))], self.grid[
            self.rng.integers(self.grid.size, size=len(requests))]


@pytest.mark.parametrize("name,library", [("vw", "vowpalwabbit"), ("mabwiser", "mabwiser")])
def test_peer_runs_the_protocol_with_the_real_library(name: str, library: str) -> None:
    try:
        __import__(library)
    except ImportError:
        pytest.skip(f"{library} is not installed (pip install {library}); the peer adapter needs it")
    peers = _peers()
    env = OnlineEnv(family="mv_binary", level=6, schedule="arrival", horizon=1_500)
    first = run_online(env, peers.PEERS[name](), seed=3, batch_size=8)  # the env refuses any unavailable prompt
    again = run_online(env, peers.PEERS[name](), seed=3, batch_size=8)
    assert np.array_equal(first.regret, again.regret)  # seeded: the same run
    assert np.isfinite(first.regret).all() and first.completions > 1_500
    uniform = run_online(env, Uniform(), seed=3, batch_size=8)
    assert first.regret[-500:].mean() < 0.7 * uniform.regret[-500:].mean()  # it learned something


def test_vw_examples_carry_the_documented_features() -> None:
    pytest.importorskip("vowpalwabbit", reason="vowpalwabbit is not installed; the VW adapter needs it")
    peers = _peers()
    env = OnlineEnv(family="bon_shift", level=5, horizon=10)
    agent = peers.VowpalWabbit()
    agent.start(env, 0)
    assert "--cb_explore_adf" in agent.arguments(0) and "--epsilon 0.05" in agent.arguments(0)
    available = np.zeros(env.table.n_prompts, dtype=bool)
    available[[0, 2]] = True
    block = agent.arm_block(available)
    lines = agent.example_text(1, block).split("\n")
    assert lines[0].startswith("shared |S w0:") and "wcost:" in lines[0]
    assert len(lines) == 1 + 2 * agent.grid.size and block.prompts.tolist() == [0] * agent.grid.size + [2] * agent.grid.size
    assert lines[1].startswith("|A p0 n:1 ncost:") and lines[1 + agent.grid.size].startswith("|A p2 n:1 ncost:")
    k = agent.grid.size + 1  # prompt 2 at the grid's second N
    labelled = agent.example_text(1, block, (k, "0:-0.5:0.25")).split("\n")
    assert labelled[1 + k] == f"0:-0.5:0.25 |A p2 n:{agent.grid[1]} " + lines[1 + k].split(f"n:{agent.grid[1]} ")[1]
    assert labelled[:1 + k] + labelled[2 + k:] == lines[:1 + k] + lines[2 + k:]  # only the chosen arm's line


class _PyvwReference:
    """The VW adapter's choices and updates through pyvw's public ``Workspace.predict`` / ``learn`` on the lines
    (as the adapter first did): the reference the direct calls must reproduce bit for bit."""

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        agent: Any = self
        block = agent._block = agent.arm_block(requests.available)
        ks = np.empty(len(requests), dtype=np.int64)
        agent._chosen = []
        for i, c in enumerate(requests.contexts.tolist()):
            pmf = np.asarray(agent.vw.predict(agent.example_text(c, block).split("\n")), dtype=np.float64)
            pmf = pmf / pmf.sum()
            ks[i] = min(int(np.searchsorted(np.cumsum(pmf), agent.rng.random(), side="right")), pmf.size - 1)
            agent._chosen.append((c, int(ks[i]), float(pmf[ks[i]])))
        return block.prompts[ks], block.ns[ks]

    def update_batch(self, requests: Requests, served: Served) -> None:
        agent: Any = self
        for (c, k, prob), reward in zip(agent._chosen, served.rewards.tolist(), strict=True):
            agent.vw.learn(agent.example_text(c, agent._block, (k, f"0:{-reward:.6g}:{prob:.6g}")).split("\n"))
        agent._chosen = []


def test_vw_direct_calls_match_pyvw_predict_and_learn() -> None:
    pytest.importorskip("vowpalwabbit", reason="vowpalwabbit is not installed; the VW adapter needs it")
    peers = _peers()
    reference = type("Reference", (_PyvwReference, peers.VowpalWabbit), {})
    env = OnlineEnv(family="mv_binary", level=6, schedule="arrival", horizon=400)  # the available set changes
    for batch_size in (1, 16):
        fast = run_online(env, peers.VowpalWabbit(), seed=11, batch_size=batch_size)
        slow = run_online(env, reference(), seed=11, batch_size=batch_size)
        assert np.array_equal(fast.regret, slow.regret) and fast.completions == slow.completions


class _PlainPartialFit:
    """MABWiser's ``partial_fit`` over every arm (as the adapter first did): the reference of its faster update."""

    def update_batch(self, requests: Requests, served: Served) -> None:
        agent: Any = self
        decisions = served.pulls.prompts * agent.grid.size + np.searchsorted(agent.grid, served.pulls.ns)
        contexts = agent.features[requests.contexts]
        if agent.fitted:
            agent.mab.partial_fit(decisions, served.rewards, contexts)
        else:
            agent.mab.fit(decisions, served.rewards, contexts)
            agent.fitted = True


def test_mabwiser_fit_of_the_pulled_arms_matches_partial_fit_over_every_arm() -> None:
    pytest.importorskip("mabwiser", reason="mabwiser is not installed; the MABWiser adapter needs it")
    peers = _peers()
    reference = type("Reference", (_PlainPartialFit, peers.MABWiserLinUCB), {})
    env = OnlineEnv(family="mv_binary", level=6, schedule="arrival", horizon=400)
    fast = run_online(env, peers.MABWiserLinUCB(), seed=11, batch_size=8)
    slow = run_online(env, reference(), seed=11, batch_size=8)
    assert np.array_equal(fast.regret, slow.regret) and fast.completions == slow.completions


# ---- through the leaderboard's runner ----------------------------------------------------------------------------


def _rows(out: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in asdict(r).items() if k != "seconds"} for r in read_online(out)]


def test_peers_run_through_the_leaderboard_runner_whatever_the_jobs(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for library in ("vowpalwabbit", "mabwiser"):
        pytest.importorskip(library, reason=f"{library} is not installed (pip install {library}); the peers need it")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # as bench_online.py does; workers inherit sys.path
    agents = [parse_online_spec(a) for a in ("online_peers:VowpalWabbit@vw",
                                             "online_peers:MABWiserLinUCB:alpha=0.5@linucb")]
    tasks = [resolve_task("generated:mv_binary:1000000-1000001")]
    log = open(os.devnull, "w")  # noqa: SIM115
    for jobs in (1, 2):
        summary = run_online_sweep(tmp_path / f"jobs{jobs}", tasks, agents, ["stationary", "arrival"], [300], 1,
                                   jobs=jobs, log=log, bar=False)
        assert summary.added == 8 and not summary.failures, summary.failures
    one, two = _rows(tmp_path / "jobs1"), _rows(tmp_path / "jobs2")
    assert one == two
    assert {(r["agent"], r["label"]) for r in one} == {("online_peers:VowpalWabbit", "vw"),
                                                        ("online_peers:MABWiserLinUCB", "linucb")}
    assert all(r["regret"] > 0 for r in one) and len({r["regret"] for r in one}) == 8
    effective = {r["label"]: r["effective_params"] for r in one}
    assert '"vowpalwabbit": "' in effective["vw"] and '"alpha": 0.5' in effective["linucb"]
    # the stored run is the adapter's own run_online of the runner's seeds
    row = next(r for r in read_online(tmp_path / "jobs1") if r.label == "vw" and r.schedule == "arrival")
    env = OnlineEnv(family="mv_binary", level=row.level, schedule="arrival", horizon=300)
    assert run_online(env, _peers().VowpalWabbit(), seed=row.env_seed, batch_size=row.batch_size).cumulative_regret[
        -1] == row.regret
    again = run_online_sweep(tmp_path / "jobs1", tasks, agents, ["stationary", "arrival"], [300], 1, log=log, bar=False)
    assert again.added == 0 and again.skipped == 8  # resumable: nothing re-run


@pytest.mark.parametrize("spec,expected", [
    ("no_such_module_here:Agent", "cannot import module 'no_such_module_here'"),
    ("agents.online.ucb:NoSuchClass", "has no attribute 'NoSuchClass'"),
    ("agents.online:make_online", "is not a class"),
    ("agents.psst:PSST", "a class without start, choose_batch, update_batch"),
    ("agents.online.ucb:ContextUCB:nonsense=1", "does not take these parameters"),
    ("ucb:nonsense=1", "does not take these parameters"),
    ("agents.online.ucb:ContextUCB:seed=1", "'seed' is derived by the leaderboard"),
    ("ucb:seed=1", "'seed' is derived by the leaderboard"),
    ("a:b:c:d", "must be 'name'"),
    ("no_such_agent", "unknown agent 'no_such_agent'"),
])
def test_bad_online_agent_specs_are_refused_with_a_clear_error(spec: str, expected: str) -> None:
    with pytest.raises(ValueError, match="(?s)" + expected.replace("(", r"\(").replace(")", r"\)")) as caught:
        parse_online_spec(spec)
    assert spec.split(":")[0] in str(caught.value)  # the error names the bad spec


def test_an_import_path_outside_the_packages_needs_its_folder_on_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    sys.modules.pop("online_peers", None)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != REPO / "benchmarks"])
    with pytest.raises(ValueError, match="PYTHONPATH=benchmarks"):
        parse_online_spec("online_peers:VowpalWabbit@vw")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = parse_online_spec("online_peers:VowpalWabbit:epsilon=0.1@vw")
    assert (spec.name, spec.params, spec.label) == ("online_peers:VowpalWabbit", {"epsilon": 0.1}, "vw")
