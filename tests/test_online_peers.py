"""benchmarks/online_peers.py: Vowpal Wabbit and MABWiser run the online protocol through ``run_online`` with the real
libraries, choose only available arms, repeat for a seed and learn."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.online import OnlineAgentBase, OnlineEnv, Requests, run_online

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
    lines, arms = agent._example(0, np.arange(2))
    assert lines[0].startswith("shared |S w0:") and "wcost:" in lines[0]
    assert len(lines) == 1 + len(arms) == 1 + 2 * agent.grid.size
    assert lines[1].startswith("|A p0 n:1 ncost:")
