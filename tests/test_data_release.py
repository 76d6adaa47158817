"""Safe import of the official release format: restricted unpickling, MV/BoN/SB conversion, MATH figures."""

from __future__ import annotations

import os
import pickle
import sys
import types
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import iapo_gym  # noqa: F401  (registers the environments)
from iapo_gym.data.release import ReleaseError, import_release, load_release_objects, read_release
from iapo_gym.oracle import acr_from_q, greedy_policy, q_table
from iapo_gym.tables import read_table
from iapo_gym.tasks.contexts import bon_grid_contexts, mv_cost_contexts


def _fake_module(monkeypatch: pytest.MonkeyPatch, dotted: str, **classes: type) -> None:
    """Register ``dotted`` (and its parents) in sys.modules holding ``classes``, as the authors' code would."""
    parts = dotted.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = sys.modules[dotted]
    for cls_name, cls in classes.items():
        cls.__module__ = dotted
        cls.__qualname__ = cls_name
        monkeypatch.setattr(module, cls_name, cls, raising=False)


def write_bon_release(path: Path, monkeypatch: pytest.MonkeyPatch, seed: int = 0, n_envs: int = 1) -> list[dict]:
    """Write a release-format BoN pickle (fake ``Envs.catBoN.catBoN`` classes); returns each env's arrays."""
    CategoricalBoNEnv = type("CategoricalBoNEnv", (), {})
    Context = type("Context", (), {})
    _fake_module(monkeypatch, "Envs.catBoN.catBoN", CategoricalBoNEnv=CategoricalBoNEnv, Context=Context)
    rng = np.random.default_rng(seed)
    envs, arrays = [], []
    weights, _, _ = bon_grid_contexts()
    for _ in range(n_envs):
        env = CategoricalBoNEnv()
        a = {
            "outcome_vectors_train": rng.choice(np.arange(-1, 1.01, 0.5), size=(3, 5, 4, 2)),
            "outcome_probs_train": rng.dirichlet(np.ones(4), size=(3, 5)),
            "outcome_vectors_test": rng.choice(np.arange(-1, 1.01, 0.5), size=(3, 2, 3, 2)),
            "outcome_probs_test": rng.dirichlet(np.ones(3), size=(3, 2)),
            "cost_per_prompt": rng.uniform(0.01, 0.05, 3),
        }
        env.__dict__.update(a)
        env.N_max = 8
        env.context_distribution = np.full(27, 1 / 27)
        env._contexts = []
        for w in weights:
            ctx = Context()
            ctx.weights = tuple(w)
            env._contexts.append(ctx)
        env.rng = np.random.default_rng(1)
        envs.append(env)
        arrays.append(a)
    path.write_bytes(pickle.dumps(envs, protocol=4))
    return arrays


def write_mv_release(path: Path, monkeypatch: pytest.MonkeyPatch, seed: int = 0, **extra: object) -> dict:
    """Write a small release-format MV pickle (fake ``Envs.catMV.catMV`` classes); returns its arrays."""
    CategoricalMVEnv = type("CategoricalMVEnv", (), {})
    CostContext = type("CostContext", (), {})
    _fake_module(monkeypatch, "Envs.catMV.catMV", CategoricalMVEnv=CategoricalMVEnv, CostContext=CostContext)
    rng = np.random.default_rng(seed)
    env = CategoricalMVEnv()
    a = {
        "cat_probs": rng.dirichlet(np.ones(3), size=(4, 6)),
        "answers": rng.integers(0, 3, 6),
        "cat_probs_te": rng.dirichlet(np.ones(3), size=(4, 2)),
        "answers_te": rng.integers(0, 3, 2),
        "cost_per_prompt": rng.uniform(0.005, 0.01, 4),
    }
    env.__dict__.update(a)
    env.N_max = 6
    env.cost_coeffs = {"low": 0.0, "mid": 0.2, "high": 1.0}
    env.context_distribution = np.full(3, 1 / 3)
    env._contexts = []
    for level, coeff in env.cost_coeffs.items():
        ctx = CostContext()
        ctx.level, ctx.weights = level, (1.0, -coeff)
        env._contexts.append(ctx)
    env.prompts = list(range(4))
    env.rng = np.random.default_rng(3)
    env.__dict__.update(extra)
    path.write_bytes(pickle.dumps([env], protocol=4))
    return a


class _RunsCommand:
    """Unpickling this runs a shell command (the attack the restricted unpickler must stop)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_pickle_running_a_shell_command_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps([_RunsCommand(marker)]))
    pickle.loads(evil.read_bytes())  # plain pickle really would run the command ...
    assert marker.exists()
    marker.unlink()  # ... so the restricted loader is what keeps it from running below
    with pytest.raises(ReleaseError, match=r"refusing to load global (posix|nt|os)\.system"):
        read_release(evil)
    assert not marker.exists()
    with pytest.raises(ReleaseError, match="refusing"):
        import_release(evil, dest=tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_global_hidden_inside_a_record_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An allowed env record whose attribute smuggles a callable global is still refused."""
    sneaky = tmp_path / "sneaky.pkl"
    write_mv_release(sneaky, monkeypatch, rng=eval)  # pickled by reference as builtins.eval
    with pytest.raises(ReleaseError, match=r"builtins\.eval"):
        load_release_objects(sneaky)
    other = tmp_path / "other.pkl"
    write_mv_release(other, monkeypatch, helper=os.path.join)  # a function of an allowed-looking module
    with pytest.raises(ReleaseError, match=r"refusing to load global \w+path\.join"):
        load_release_objects(other)


def test_truncated_and_foreign_pickles_give_clear_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "MATH_final.pkl"
    write_mv_release(path, monkeypatch)
    cut = tmp_path / "cut.pkl"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ReleaseError, match="truncated or corrupted"):
        read_release(cut)
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"a": np.zeros(3)}))
    with pytest.raises(ReleaseError, match="expected a list of IAPO environment objects"):
        read_release(plain)


def test_mv_release_concatenates_train_and_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tiny_final.pkl"
    a = write_mv_release(path, monkeypatch)
    (table,) = read_release(path, task="tiny")
    np.testing.assert_array_equal(table.probs, np.concatenate([a["cat_probs"], a["cat_probs_te"]], axis=1))
    np.testing.assert_array_equal(table.gold, np.concatenate([a["answers"], a["answers_te"]]))
    np.testing.assert_array_equal(table.split, [0] * 6 + [1] * 2)
    np.testing.assert_array_equal(table.cost, a["cost_per_prompt"])
    weights, names, probs = mv_cost_contexts()
    np.testing.assert_array_equal(table.context_weights, weights)
    assert table.context_names == names and table.n_max == 6 and table.task == "tiny"
    assert table.prompts == ("p0", "p1", "p2", "p3")


def test_mv_release_with_other_cost_coeffs_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.pkl"
    write_mv_release(path, monkeypatch, cost_coeffs={"low": 0.0, "mid": 0.3, "high": 1.0})
    with pytest.raises(ReleaseError, match="cost_coeffs"):
        read_release(path)


def test_bon_release_written_by_the_test_goes_through_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "HH_final.pkl"
    arrays = write_bon_release(path, monkeypatch, n_envs=2)
    out = import_release(path, task="hh_test", dest=tmp_path / "tables")  # not the official bytes: a name of its own
    assert [p.name for p in out] == ["hh_test.h5", "hh_test-i1.h5"]
    for p, a in zip(out, arrays, strict=True):
        table = read_table(p)
        assert table.aggregator == "bon" and table.task == "hh_test"
        # train has 4 atoms, test 3: the test rows are padded with a zero-probability atom
        assert table.probs.shape == (3, 7, 4) and table.atoms is not None and table.atoms.shape == (3, 7, 4, 2)
        np.testing.assert_array_equal(table.atoms[:, :5], a["outcome_vectors_train"])
        np.testing.assert_array_equal(table.atoms[:, 5:, :3], a["outcome_vectors_test"])
        np.testing.assert_allclose(table.probs[:, 5:, 3], 0.0)
        np.testing.assert_array_equal(table.split, [0] * 5 + [1] * 2)
        assert table.n_contexts == 27 and table.context_weights[:, -1].max() < 0
        assert table.attrs["source_file"] == "HH_final.pkl" and table.attrs["verified"] is False
        # the padded atom never changes a utility: exact Q equals a direct brute-force expectation at N=1
        q = q_table(table, table.split_indices("test"))
        direct = np.einsum("pqm,pqmk,ck->cp", table.probs[:, 5:], table.atoms[:, 5:], table.context_weights[:, :2]) / 2
        np.testing.assert_allclose(q[:, :, 0], direct + table.context_weights[:, -1:] * table.cost[None, :], atol=1e-12)


def test_synthetic_bernoulli_release_becomes_two_bucket_mv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    SyntheticBernoulliEnv = type("SyntheticBernoulliEnv", (), {})
    _fake_module(monkeypatch, "Envs.synthBernoulli.synthBernoulli", SyntheticBernoulliEnv=SyntheticBernoulliEnv)
    rng = np.random.default_rng(5)
    env = SyntheticBernoulliEnv()
    env.success_probs = {t: rng.uniform(0.1, 0.9, (4, n)) for t, n in (("easy", 3), ("medium", 2), ("hard", 2))}
    env.success_probs_test = {t: rng.uniform(0.1, 0.9, (4, 1)) for t in ("easy", "medium", "hard")}
    env.cost_per_prompt = rng.uniform(0.01, 0.03, 4)
    env.cost_coeffs = {"low": 0.0, "mid": 0.2, "high": 1.0}
    env.context_distribution = np.full(3, 1 / 3)  # the authors' class always stores both
    env.N_max = 32
    path = tmp_path / "SB_final.pkl"
    path.write_bytes(pickle.dumps([env, env]))
    tables = read_release(path)
    assert len(tables) == 2 and tables[0].task == "synthetic_bernoulli_release"
    t = tables[0]
    assert t.n_atoms == 2 and np.all(t.gold == 1)
    np.testing.assert_allclose(t.probs[:, :3, 1], env.success_probs["easy"])
    np.testing.assert_allclose(t.probs[:, 7:, 1], np.concatenate(list(env.success_probs_test.values()), axis=1))
    np.testing.assert_array_equal(t.split, [0] * 7 + [1] * 3)
    assert t.queries[0] == "train0-easy" and t.queries[-1] == "test2-hard"


# ---- the official MATH file --------------------------------------------------------------
def test_math_release_matches_the_independent_figures(math_release: Path, tmp_path: Path) -> None:
    (path,) = import_release(math_release, dest=tmp_path)
    table = read_table(path)
    assert table.probs.shape == (25, 316, 5) and int((table.split == 1).sum()) == 64
    assert table.attrs["verified"] is True
    train, test = table.split_indices("train"), table.split_indices("test")
    q_train, q_test = q_table(table, train), q_table(table, test)
    best = greedy_policy(q_test)
    assert acr_from_q(q_test, np.array(best.arms), table.context_probs) == pytest.approx(0.8625, abs=5e-4)
    train_opt = greedy_policy(q_train)
    assert acr_from_q(q_test, np.array(train_opt.arms), table.context_probs) == pytest.approx(0.8510, abs=5e-4)
    best_n1 = greedy_policy(q_test[:, :, :1])
    assert all(n == 1 for _, n in best_n1.arms)
    assert acr_from_q(q_test, np.array(best_n1.arms), table.context_probs) == pytest.approx(0.7817, abs=5e-4)


def test_gym_make_math_after_import(math_release: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IAPO_GYM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="iapo-gym data fetch math"):
        gym.make("IAPO-MATH-v0")
    import_release(math_release)
    env = gym.make("IAPO-MATH-v0")
    assert env.unwrapped.n_prompts == 25
    assert env.unwrapped.evaluate(env.unwrapped.optimal_policy("test"), "test") == pytest.approx(0.8625, abs=5e-4)


def test_gym_make_math_from_iapo_gym_data_without_any_command(math_release: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "MATH_final.pkl").symlink_to(math_release)
    monkeypatch.setenv("IAPO_GYM_DATA", str(data))
    monkeypatch.setenv("IAPO_GYM_CACHE", str(tmp_path / "cache"))
    assert os.environ["IAPO_GYM_OFFLINE"] == "1"
    env = gym.make("IAPO-MATH-v0")
    obs, info = env.reset(seed=0)
    assert obs.shape == (2,) and env.unwrapped.n_max == 32
    assert (tmp_path / "cache" / "math.h5").is_file()  # converted once into the cache
    assert not any(p.suffix == ".h5" for p in data.iterdir())  # the user's folder is left untouched
