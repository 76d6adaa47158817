"""Shared fixtures: an isolated cache per session, small tables, the release file path."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.tables import OutcomeTable, write_table
from iapo_gym.tasks.synthetic import random_mv_table

RELEASE_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "iapo-release"
MATH_RELEASE = RELEASE_DIR / "MATH_final.pkl"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the modules that hold a test marked ``heavy`` first, each module's tests still together and in order.

    pytest-xdist's load scheduling (the README's ``-n 2``) hands the tests out in collection order, so a long test
    collected late leaves one worker running it alone at the end. The long tests are the ``heavy`` ones; starting
    their modules first lets the short ones fill in around them. Keeping each module whole keeps its module-scoped
    fixtures (a sweep, a server) built once per worker.
    """
    heavy_modules = {getattr(item, "module", None) for item in items if item.get_closest_marker("heavy") is not None}
    items.sort(key=lambda item: getattr(item, "module", None) not in heavy_modules)  # stable: the order within each group is kept


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep every test's generated tables out of the user's cache and data folders."""
    os.environ["IAPO_GYM_CACHE"] = str(tmp_path_factory.mktemp("iapo-cache"))
    os.environ.pop("IAPO_GYM_DATA", None)
    os.environ["IAPO_GYM_OFFLINE"] = "1"


@pytest.fixture(params=["jit", "numpy"])
def sequential_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the sequential baselines' compiled loop and with IAPO_GYM_JIT=0 (their numpy loop)."""
    monkeypatch.setenv("IAPO_GYM_JIT", "1" if request.param == "jit" else "0")
    return str(request.param)


@pytest.fixture
def math_release() -> Path:
    """Path of the official MATH release file; skips where ../shared is absent."""
    if not MATH_RELEASE.is_file():
        pytest.skip(f"official MATH release not found at {MATH_RELEASE} (../shared is absent on this machine)")
    return MATH_RELEASE


def tiny_mv_table(seed: int = 0, n_prompts: int = 3, n_queries: int = 10, n_buckets: int = 3, n_max: int = 6) -> OutcomeTable:
    """A small random majority-vote table with a stored split."""
    return random_mv_table(seed, n_prompts, n_queries, n_buckets, n_max, task="tiny_mv")


def tiny_bon_table(seed: int = 0, n_prompts: int = 3, n_queries: int = 10, n_atoms: int = 4, n_max: int = 6) -> OutcomeTable:
    """A small random Best-of-N table (2 objectives, 4 contexts) with a stored split."""
    rng = np.random.default_rng(seed)
    split = np.zeros(n_queries, dtype=np.uint8)
    split[: max(1, n_queries // 5)] = 1
    return OutcomeTable(
        task="tiny_bon", aggregator="bon",
        probs=rng.dirichlet(np.ones(n_atoms), size=(n_prompts, n_queries)),
        atoms=rng.integers(-2, 3, size=(n_prompts, n_queries, n_atoms, 2)).astype(float),
        cost=rng.uniform(0.01, 0.1, (n_prompts, n_queries)), n_max=n_max,
        context_weights=np.array([[0.2, 0.8, -0.1], [0.8, 0.2, -0.1], [0.5, 0.5, -1.0], [0.9, 0.1, -0.5]]),
        context_names=("a", "b", "c", "d"), context_probs=np.array([0.1, 0.2, 0.3, 0.4]),
        objective_names=("helpful", "harmless"), split=split,
    )


def query_shifted_bon_table(shift_sd: float = 1.5) -> tuple[OutcomeTable, np.ndarray]:
    """A Best-of-N table where every query adds one offset to both objectives of every prompt's
    outcomes (a prompt's distribution is otherwise the same on every query), and the offsets."""
    base = tiny_bon_table(seed=4, n_prompts=3, n_queries=20, n_atoms=4, n_max=6)
    shift = np.random.default_rng(9).normal(0.0, shift_sd, base.n_queries)
    atoms = np.repeat(base.atoms[:, :1], base.n_queries, axis=1) + shift[None, :, None, None]
    return dataclasses.replace(base, probs=np.repeat(base.probs[:, :1], base.n_queries, axis=1), atoms=atoms), shift


def shape_bon_table(seed: int = 0, n_prompts: int = 6, n_queries: int = 50, n_max: int = 32,
                    n_objectives: int = 1) -> OutcomeTable:
    """A Best-of-N table whose queries differ in the *shape* of every prompt's score distribution, not by a
    shift: on each query a prompt's scores on a 13-point grid are a discretised normal whose mean and spread
    are the prompt's own times query factors (each query widens or narrows, and moves, the prompts' spreads
    differently); prompts trade a high mean for a high spread, so N decides the best. 80/20 stored split,
    3 cost contexts per objective weighting, costs uniform in [0.01, 0.05]."""
    rng = np.random.default_rng(seed)
    grid = np.linspace(-3.0, 3.0, 13)
    mean = rng.uniform(-0.5, 0.8, n_prompts)
    spread = np.clip(0.9 - mean + rng.normal(0.0, 0.2, n_prompts), 0.2, 2.0)
    q_mean, q_spread = rng.normal(0.0, 0.5, (n_queries, n_objectives)), rng.lognormal(0.0, 0.5, (n_queries, n_objectives))
    inter = rng.normal(0.0, 0.3, (n_prompts, n_queries, n_objectives))
    mu = mean[:, None, None] * q_spread + inter + 0.0 * q_mean[None]
    sd = spread[:, None, None] / q_spread[None] ** 0.5
    logits = -0.5 * ((grid - mu[..., None]) / sd[..., None]) ** 2
    marg = np.exp(logits - logits.max(axis=-1, keepdims=True))
    marg /= marg.sum(axis=-1, keepdims=True)  # (P, Q, K, 13)
    if n_objectives == 1:
        probs, atoms = marg[:, :, 0], np.broadcast_to(grid[:, None], (n_prompts, n_queries, grid.size, 1))
        weights = np.array([[1.0, -0.1], [1.0, -0.5], [1.0, -1.0]])
    else:
        probs = (marg[:, :, 0, :, None] * marg[:, :, 1, None, :]).reshape(n_prompts, n_queries, -1)
        pts = np.stack(np.meshgrid(grid, grid, indexing="ij"), axis=-1).reshape(-1, 2)
        atoms = np.broadcast_to(pts, (n_prompts, n_queries) + pts.shape)
        weights = np.array([[w, 1.0 - w, -c] for c in (0.1, 1.0) for w in (0.2, 0.5, 0.8)])
    split = np.zeros(n_queries, dtype=np.uint8)
    split[rng.permutation(n_queries)[: n_queries // 5]] = 1
    return OutcomeTable(
        task="shape_bon", aggregator="bon", probs=probs, atoms=np.ascontiguousarray(atoms, dtype=float),
        cost=rng.uniform(0.01, 0.05, n_prompts), n_max=n_max, context_weights=weights,
        context_names=tuple(f"c{i}" for i in range(weights.shape[0])),
        context_probs=np.full(weights.shape[0], 1.0 / weights.shape[0]),
        objective_names=tuple(f"o{k}" for k in range(n_objectives)), split=split,
    )


def rows_in(db: Path, table: str) -> int:
    """Rows of ``table`` in the results database ``db`` (0 before the file or the table exists)."""
    import sqlite3

    if not db.is_file():
        return 0
    conn = sqlite3.connect(db, timeout=30)
    try:
        return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
    except sqlite3.OperationalError:  # the table is created with the first unit
        return 0
    finally:
        conn.close()


def kill_sweep_midway(args: list[str], out: Path, table: str, at_least: int, repo: Path) -> int:
    """Start ``iapo-gym`` ``args`` --out ``out`` as a process, kill it with -9 once ``table`` has ``at_least`` rows
    (or after 60 s, or when it ends), and return the rows it left."""
    import signal
    import subprocess
    import sys
    import time

    command = [sys.executable, "-m", "iapo_gym.cli", *args, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db = out / "results.sqlite"
    deadline = time.monotonic() + 60
    while rows_in(db, table) < at_least and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return rows_in(db, table)


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two tiny task tables on disk (a majority-vote and a Best-of-N one), for the leaderboard's tests."""
    folder = tmp_path_factory.mktemp("tables")
    mv, bon = folder / "tiny_mv.h5", folder / "tiny_bon.h5"
    write_table(tiny_mv_table(n_queries=30), mv)
    write_table(tiny_bon_table(n_queries=30), bon)
    return {"mv": str(mv), "bon": str(bon)}


def uses_avx512_kernels() -> bool:
    """Whether numpy dispatches its float64 exp and log to its AVX-512 kernels on this CPU (its X86_V4 features,
    found and not disabled by NPY_DISABLE_CPU_FEATURES); elsewhere it calls the C library's."""
    from numpy._core._multiarray_umath import __cpu_features__

    return bool(__cpu_features__.get("X86_V4", False))
