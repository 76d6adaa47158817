"""A release-format record keeps its own contexts: read, checked, refused when absent unless asked for the paper's."""

from __future__ import annotations

import dataclasses
import itertools
import pickle
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.cli import main
from iapo_gym.data.release import ReleaseError, import_release, read_release
from iapo_gym.oracle import acr_from_q, greedy_policy, q_table
from iapo_gym.tables import read_table
from iapo_gym.tasks.contexts import bon_grid_contexts
from tests.test_data_release import _fake_module, write_mv_release

N_MAX = 3


def _bon_classes(monkeypatch: pytest.MonkeyPatch) -> tuple[type, type]:
    """The authors' record classes as they define them: Context is a frozen dataclass of a weight tuple."""
    env_cls = type("CategoricalBoNEnv", (), {})
    context_cls = dataclasses.make_dataclass("Context", [("weights", tuple)], frozen=True)
    _fake_module(monkeypatch, "Envs.catBoN.catBoN", CategoricalBoNEnv=env_cls, Context=context_cls)
    return env_cls, context_cls


def write_bon_record(path: Path, monkeypatch: pytest.MonkeyPatch, *, k: int, weights: np.ndarray | None,
                     distribution: np.ndarray | None, seed: int = 0) -> dict:
    """One release-format BoN record with ``k`` objectives and the given stored contexts (None: not stored)."""
    env_cls, context_cls = _bon_classes(monkeypatch)
    rng = np.random.default_rng(seed)
    grid = np.arange(-1, 1.01, 0.5)
    a = {
        "outcome_vectors_train": rng.choice(grid, size=(3, 4, 3, k)),
        "outcome_probs_train": rng.dirichlet(np.ones(3), size=(3, 4)),
        "outcome_vectors_test": rng.choice(grid, size=(3, 2, 3, k)),
        "outcome_probs_test": rng.dirichlet(np.ones(3), size=(3, 2)),
        "cost_per_prompt": rng.uniform(0.01, 0.2, 3),
    }
    env = env_cls()
    env.__dict__.update(a)
    env.N_max = N_MAX
    if weights is not None:
        env._contexts = [context_cls(tuple(float(x) for x in w)) for w in weights]
    if distribution is not None:
        env.context_distribution = np.asarray(distribution)
    env.rng = np.random.default_rng(1)
    path.write_bytes(pickle.dumps([env], protocol=4))
    return a


def _own_contexts(k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Context weights unlike the paper's (k objectives + a cost weight <= 0) and a non-uniform distribution."""
    rng = np.random.default_rng(100 + seed)
    weights = np.column_stack([rng.uniform(-0.5, 1.0, (5, k)), -rng.uniform(0.0, 3.0, 5)])
    probs = rng.dirichlet(np.ones(5))
    return weights, probs


def brute_force_q(vectors: np.ndarray, probs: np.ndarray, cost: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Q[c, p, N-1] by enumerating every N-tuple of atoms (no sorting, no CDF): the mean over queries of
    E[max_i w.o(y_i)] + w_cost * N * cost_p."""
    n_p, n_q, n_m, _ = vectors.shape
    q = np.zeros((weights.shape[0], n_p, N_MAX))
    for c, w in enumerate(weights):
        for p in range(n_p):
            for n in range(1, N_MAX + 1):
                total = 0.0
                for x in range(n_q):
                    util = vectors[p, x] @ w[:-1]
                    for draw in itertools.product(range(n_m), repeat=n):
                        total += np.prod(probs[p, x, list(draw)]) * max(util[list(draw)])
                q[c, p, n - 1] = total / n_q + w[-1] * n * cost[p]
    return q


@pytest.mark.parametrize("k", [2, 3])
def test_record_imports_with_exactly_its_own_contexts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    weights, dist = _own_contexts(k, seed=k)
    path = tmp_path / f"own{k}.pkl"
    a = write_bon_record(path, monkeypatch, k=k, weights=weights, distribution=dist, seed=k)
    (out,) = import_release(path, task=f"own{k}", dest=tmp_path / "tables")
    table = read_table(out)
    np.testing.assert_array_equal(table.context_weights, weights)
    np.testing.assert_array_equal(table.context_probs, dist)
    assert table.n_objectives == k and table.n_contexts == 5
    assert table.attrs["contexts_source"].startswith(f"5 contexts over {k} objectives")
    assert table.attrs["contexts_source"].endswith("not uniform: the record's own")
    # the exact oracle of the stored test split against an enumeration computed here
    expected = brute_force_q(a["outcome_vectors_test"], a["outcome_probs_test"], a["cost_per_prompt"], weights)
    q = q_table(table, table.split_indices("test"))
    np.testing.assert_allclose(q, expected, rtol=0, atol=1e-12)
    best = greedy_policy(q)
    optimum = float(dist @ expected.reshape(5, -1).max(axis=1))
    assert acr_from_q(q, np.array(best.arms), table.context_probs) == pytest.approx(optimum, abs=1e-12)
    # and the train split the same way
    train = brute_force_q(a["outcome_vectors_train"], a["outcome_probs_train"], a["cost_per_prompt"], weights)
    np.testing.assert_allclose(q_table(table, table.split_indices("train")), train, rtol=0, atol=1e-12)


def test_absent_contexts_are_refused_unless_the_paper_set_is_asked_for(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "bare.pkl"
    write_bon_record(path, monkeypatch, k=2, weights=None, distribution=None)
    with pytest.raises(ReleaseError, match=r"stores no '_contexts'.*nothing was written.*--paper-contexts"):
        import_release(path, task="bare", dest=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (table,) = read_release(path, task="bare", paper_contexts=True)
    weights, names, probs = bon_grid_contexts()
    np.testing.assert_array_equal(table.context_weights, weights)
    assert table.context_names == names
    assert "the paper's 27 Best-of-N contexts" in table.attrs["contexts_source"]
    assert "because --paper-contexts was given (the record stores no '_contexts')" in table.attrs["contexts_source"]


@pytest.mark.parametrize(("weights", "dist", "message"), [
    (np.array([[0.5, 0.5, -0.1], [0.2, 0.8]], dtype=object), np.array([0.5, 0.5]), "stored context 1"),
    (np.array([[0.5, 0.5, -0.1], [0.2, 0.8, -0.5]]), None, "no 'context_distribution'"),
    (np.array([[0.5, 0.5, -0.1], [0.2, 0.8, -0.5]]), np.array([0.7, 0.7]), "summing to 1"),
    (np.array([[0.5, 0.5, 0.1], [0.2, 0.8, -0.5]]), np.array([0.5, 0.5]), "cost weight must be <= 0"),
    (np.array([[0.5, 0.5, -0.1, 0.0], [0.2, 0.8, -0.5, 0.0]]), np.array([0.5, 0.5]), "need 3"),
])
def test_unreadable_contexts_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weights: np.ndarray,
                                         dist: np.ndarray | None, message: str) -> None:
    path = tmp_path / "bad.pkl"
    write_bon_record(path, monkeypatch, k=2, weights=list(weights), distribution=dist)  # type: ignore[arg-type]
    with pytest.raises(ReleaseError, match=message):
        read_release(path, task="bad")
    (table,) = read_release(path, task="bad", paper_contexts=True)  # two objectives: the paper's set fits
    assert table.n_contexts == 27 and "--paper-contexts was given" in table.attrs["contexts_source"]


def test_three_objectives_without_contexts_cannot_take_the_papers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "k3.pkl"
    write_bon_record(path, monkeypatch, k=3, weights=None, distribution=None)
    with pytest.raises(ReleaseError, match="weigh 2 objectives, not this record's 3"):
        read_release(path, task="k3", paper_contexts=True)


def test_majority_vote_record_contexts_are_checked_and_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = tmp_path / "mv.pkl"
    write_mv_release(good, monkeypatch)
    (table,) = read_release(good, task="mv")
    assert table.attrs["contexts_source"] == ("3 contexts over 1 objective, cost weights 0, 0.2, 1, uniform: the "
                                              "record's own, which are the paper's low/mid/high contexts (cost "
                                              "weights 0, 0.2, 1, uniform)")
    skewed = tmp_path / "skewed.pkl"
    write_mv_release(skewed, monkeypatch, context_distribution=np.array([0.5, 0.25, 0.25]))
    with pytest.raises(ReleaseError, match=r"context_distribution \[0.5, 0.25, 0.25\] differs from the paper's"):
        read_release(skewed)
    bare = tmp_path / "bare.pkl"
    write_mv_release(bare, monkeypatch, cost_coeffs=None)
    with pytest.raises(ReleaseError, match="no 'cost_coeffs' dict.*--paper-contexts"):
        read_release(bare)
    (table,) = read_release(bare, paper_contexts=True)
    assert "used because --paper-contexts was given" in table.attrs["contexts_source"]


def test_import_and_show_say_which_contexts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    weights, dist = _own_contexts(3, seed=7)
    path = tmp_path / "rec.pkl"
    write_bon_record(path, monkeypatch, k=3, weights=weights, distribution=dist)
    dest = tmp_path / "tables"
    assert main(["data", "import", str(path), "--task", "rec", "--dest", str(dest)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(dest / "rec.h5")  # stdout: one path per line, for scripts
    assert f"{dest / 'rec.h5'}: contexts: 5 contexts over 3 objectives" in err and "the record's own" in err
    assert main(["data", "show", str(dest / "rec.h5")]) == 0
    shown = capsys.readouterr().out
    assert "contexts    5: 5 contexts over 3 objectives" in shown and "not uniform: the record's own" in shown
    bare = tmp_path / "bare.pkl"
    write_bon_record(bare, monkeypatch, k=2, weights=None, distribution=None)
    assert main(["data", "import", str(bare), "--task", "bare", "--dest", str(dest)]) == 1
    assert "--paper-contexts" in capsys.readouterr().err and not (dest / "bare.h5").exists()
    assert main(["data", "import", str(bare), "--task", "bare", "--dest", str(dest), "--paper-contexts"]) == 0
    assert "used because --paper-contexts was given" in capsys.readouterr().err
