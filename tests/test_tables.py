"""The HDF5 schema: round trips, metadata without arrays, and the validator's rules."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np
import pytest

from iapo_gym.exact import stored
from iapo_gym.tables import SCHEMA_VERSION, TableError, read_attributes, read_metadata, read_table, write_table
from tests.conftest import tiny_bon_table, tiny_mv_table


@pytest.mark.parametrize("make", [tiny_mv_table, tiny_bon_table])
def test_round_trip_is_exact(tmp_path: Path, make) -> None:
    table = make()
    path = write_table(table, tmp_path / "t.h5")
    back = read_table(path)
    for name in ("probs", "cost", "context_weights", "context_probs", "atoms", "gold", "split"):
        a, b = getattr(table, name), getattr(back, name)
        assert (a is None and b is None) or np.array_equal(a, b), name
    assert back.prompts == table.prompts and back.queries == table.queries
    assert back.context_names == table.context_names and back.objective_names == table.objective_names
    assert (back.task, back.aggregator, back.n_max) == (table.task, table.aggregator, table.n_max)


def test_metadata_reads_attributes_and_shapes(tmp_path: Path) -> None:
    table = replace(tiny_bon_table(), attrs={"source": "unit test", "license": "CC0"})
    meta = read_metadata(write_table(table, tmp_path / "t.h5"))
    assert meta["schema_version"] == SCHEMA_VERSION
    assert (meta["n_prompts"], meta["n_queries"], meta["n_atoms"]) == table.probs.shape
    assert meta["source"] == "unit test" and meta["license"] == "CC0"
    assert meta["objective_names"] == ["helpful", "harmless"]


def test_read_attributes_is_the_provenance_part_of_the_metadata(tmp_path: Path) -> None:
    path = write_table(replace(tiny_mv_table(), attrs={"verified": True, "source": "unit test"}), tmp_path / "t.h5")
    attributes, meta = read_attributes(path), read_metadata(path)
    assert attributes == {key: meta[key] for key in attributes}
    assert attributes["verified"] is True and attributes["has_exact"] and attributes["task"] == "tiny_mv"
    assert "n_prompts" not in attributes
    (tmp_path / "bad.h5").write_bytes(b"not hdf5")
    with pytest.raises(TableError, match="bad.h5"):
        read_attributes(tmp_path / "bad.h5")


def test_write_leaves_no_temporary_files(tmp_path: Path) -> None:
    write_table(tiny_mv_table(), tmp_path / "t.h5")
    assert [p.name for p in tmp_path.iterdir()] == ["t.h5"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: {"probs": t.probs * 1.01}, "sums to"),
        (lambda t: {"probs": np.where(t.probs == t.probs.max(), np.nan, t.probs)}, "NaN"),
        (lambda t: {"probs": t.probs + np.array([-1.0, 1.0, 0.0])}, "negative"),
        (lambda t: {"gold": np.full(t.n_queries, 7)}, "bucket 7"),
        (lambda t: {"cost": np.ones(5)}, "'cost'"),
        (lambda t: {"context_probs": np.array([0.5, 0.5, 0.5])}, "contexts/probs"),
        (lambda t: {"context_weights": np.ones((3, 3))}, "contexts/weights"),
        (lambda t: {"split": np.zeros(t.n_queries, dtype=np.uint8)}, "split"),
        (lambda t: {"n_max": 0}, "n_max"),
    ],
)
def test_validator_names_the_rule(change, message: str) -> None:
    table = tiny_mv_table()
    with pytest.raises(TableError, match=message):
        replace(table, **change(table))


def _mutate(path: Path, edit) -> None:
    with h5py.File(path, "r+") as f:
        edit(f)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: f.attrs.__setitem__("schema_version", 99), "unknown schema version 99"),
        (lambda f: f.__delitem__("gold"), "missing dataset 'gold'"),
        (lambda f: f.__delitem__("contexts/weights"), "missing dataset 'contexts/weights'"),
        (lambda f: f["probs"].__setitem__((0, 0, 0), -1.0), "negative"),
    ],
)
def test_bad_files_are_rejected_with_the_file_named(tmp_path: Path, edit, message: str) -> None:
    path = write_table(tiny_mv_table(), tmp_path / "t.h5")
    _mutate(path, edit)
    with pytest.raises(TableError, match=message) as info:
        read_table(path)
    assert str(path) in str(info.value)


def test_truncated_file_is_rejected(tmp_path: Path) -> None:
    path = write_table(tiny_bon_table(), tmp_path / "t.h5")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TableError, match="truncated or corrupted") as info:
        read_table(path)
    assert str(path) in str(info.value)


# ---- stored exact expectations (schema 2) ---------------------------------------------
def _fresh_reward(table):
    from iapo_gym.exact import expected_task_reward

    return expected_task_reward(replace(table))  # a copy with an empty cache: computed from scratch


@pytest.mark.parametrize("make", [tiny_mv_table, tiny_bon_table])
def test_stored_exact_tensor_is_loaded_and_equals_a_fresh_computation(tmp_path: Path, make) -> None:
    table = make()
    path = write_table(table, tmp_path / "t.h5")
    assert read_metadata(path)["has_exact"]
    back = read_table(path)
    assert stored(back) is not None  # nothing to compute on the first q_table
    np.testing.assert_array_equal(stored(back).reward, _fresh_reward(table))
    from iapo_gym.oracle import q_table

    np.testing.assert_array_equal(q_table(back, np.arange(4)), q_table(replace(table), np.arange(4)))


@pytest.mark.parametrize("make", [tiny_mv_table, tiny_bon_table])
def test_tampered_probabilities_ignore_the_stored_tensor_with_a_warning(tmp_path: Path, make) -> None:
    from iapo_gym.tables import TableWarning

    table = make()
    path = write_table(table, tmp_path / "t.h5")
    with h5py.File(path, "r+") as f:  # another distribution, rows still summing to 1
        f["probs"][...] = f["probs"][()][:, :, ::-1]
    with pytest.warns(TableWarning, match=r"t\.h5: ignoring the stored exact expectations: its digest does not match"):
        back = read_table(path)
    assert stored(back) is None
    expected = _fresh_reward(replace(table, probs=table.probs[:, :, ::-1],
                                     atoms=None if table.atoms is None else table.atoms))
    from iapo_gym.exact import expected_task_reward

    np.testing.assert_allclose(expected_task_reward(back), expected, rtol=0, atol=0)


def test_version_1_file_without_exact_group_still_reads_and_computes_on_first_use(tmp_path: Path) -> None:
    table = tiny_mv_table()
    path = write_table(table, tmp_path / "t.h5", exact=False)
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = 1
    meta = read_metadata(path)
    assert meta["schema_version"] == 1 and not meta["has_exact"]
    back = read_table(path)
    assert stored(back) is None
    from iapo_gym.exact import expected_task_reward

    np.testing.assert_array_equal(expected_task_reward(back), _fresh_reward(table))


def test_synthetic_cache_of_an_older_schema_is_upgraded_in_place(tmp_path: Path, monkeypatch) -> None:
    from iapo_gym.data import load_synthetic, synthetic_cache_path

    monkeypatch.setenv("IAPO_GYM_CACHE", str(tmp_path))
    load_synthetic("synthetic_bernoulli", 3)
    path = synthetic_cache_path("synthetic_bernoulli", 3)
    old = read_table(path)
    write_table(old, path, exact=False)
    assert not read_metadata(path)["has_exact"]
    upgraded = load_synthetic("synthetic_bernoulli", 3)
    assert read_metadata(path)["has_exact"]
    np.testing.assert_array_equal(stored(upgraded).reward, _fresh_reward(old))
    assert stored(load_synthetic("synthetic_bernoulli", 3)) is not None
