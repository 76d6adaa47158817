"""One name per task: every accepted form resolves to the same task and table file, everywhere."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from iapo_gym.cli import main
from iapo_gym.data.registry import get_entry
from iapo_gym.env import IAPOEnv
from iapo_gym.leaderboard.run.specs import resolve_task
from iapo_gym.tables import read_metadata, write_table
from iapo_gym.tasks import TASKS, get_task
from tests.conftest import tiny_bon_table
from tests.test_data_release import write_bon_release, write_mv_release

HH_FORMS = ["IAPO-HelpfulHarmless-v0", "HelpfulHarmless", "helpful_harmless", "HH_final", "Helpful-Harmless",
            "iapo-helpfulharmless-V0", "HELPFULHARMLESS", "HELPFUL_HARMLESS", "hh_FINAL", " HelpfulHarmless "]
MATH_FORMS = ["IAPO-MATH-v0", "MATH", "math", "MATH_final", "Math_Final", "iapo-math-v0"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("IAPO_GYM_CACHE", str(path))
    return path


@pytest.mark.parametrize("spec", list(TASKS.values()), ids=list(TASKS))
def test_every_form_of_every_task_names_that_task(spec) -> None:
    middle = spec.env_id.split("-")[1]
    forms = [spec.name, spec.env_id, middle, spec.title, spec.name.upper(), spec.env_id.lower(), middle.lower()]
    if spec.release_file:
        stem = spec.release_file.removesuffix(".pkl")
        forms += [stem, stem.lower(), stem.upper()]
    for form in forms:
        assert get_task(form) is spec, form
        assert get_task(form).table_file == f"{spec.name}.h5"


@pytest.mark.parametrize("form", HH_FORMS)
def test_helpful_harmless_forms(form: str) -> None:
    assert get_task(form).name == "helpful_harmless"
    assert get_entry(form).name == "helpful_harmless"  # what `data fetch` resolves
    assert resolve_task(form).name == "helpful_harmless"  # what `leaderboard --tasks` resolves


def test_unknown_names_are_refused_with_the_known_ones(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"unknown task 'Helpfull'; known tasks: .*helpful_harmless \(IAPO-HelpfulHarmless-v0\)"):
        get_task("Helpfull")
    with pytest.raises(ValueError, match="known tasks: synthetic_bernoulli"):
        resolve_task("SyntheticBernoulliX")
    assert main(["data", "show", "nosuch"]) == 1
    err = capsys.readouterr().err
    assert "unknown task 'nosuch'" in err and all(name in err for name in TASKS)
    assert main(["data", "fetch", "nosuch"]) == 1
    assert "no known table 'nosuch'; known tables: math, commonsense_qa" in capsys.readouterr().err


def test_gym_make_and_every_form_read_the_same_table_file(tmp_path: Path, cache: Path, monkeypatch) -> None:
    folder = tmp_path / "data"
    table = replace(tiny_bon_table(), task="helpful_harmless")
    write_table(table, folder / "helpful_harmless.h5")
    monkeypatch.setenv("IAPO_GYM_DATA", str(folder))
    made = gym.make("IAPO-HelpfulHarmless-v0").unwrapped
    np.testing.assert_array_equal(made.table.probs, table.probs)
    for form in HH_FORMS:
        env = IAPOEnv(task=form)
        np.testing.assert_array_equal(env.table.probs, table.probs)
        assert env.table.task == "helpful_harmless"


@pytest.mark.parametrize("form", MATH_FORMS)
def test_import_show_under_every_form_use_the_one_file(form: str, math_release: Path, cache: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "import", str(math_release), "--task", form]) == 0
    assert capsys.readouterr().out.strip() == str(cache / "math.h5")
    assert [p.name for p in cache.glob("*.h5")] == ["math.h5"]
    assert main(["data", "show", form, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["table"]["n_prompts"] == 25


def test_unofficial_file_under_a_registered_name_is_refused(tmp_path: Path, cache: Path, monkeypatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "HH_format.pkl"
    write_bon_release(fake, monkeypatch)
    for form in ("HelpfulHarmless", "helpful_harmless", "IAPO-HelpfulHarmless-v0", "HH_final"):
        assert main(["data", "import", str(fake), "--task", form]) == 1
        err = capsys.readouterr().err
        assert f"{fake} is not the official release file of task 'helpful_harmless' (HH_final.pkl" in err
        assert "nothing was written" in err and "--task my_helpful_harmless" in err
        assert "gym.make('IAPO-HelpfulHarmless-v0', path=<folder>/my_helpful_harmless.h5)" in err
    assert not list(cache.glob("*.h5")) if cache.exists() else True
    # the way the message names works, and gym.make reads the file through path=
    assert main(["data", "import", str(fake), "--task", "my_helpful_harmless"]) == 0
    written = Path(capsys.readouterr().out.strip())
    assert written == cache / "my_helpful_harmless.h5" and read_metadata(written)["verified"] is False
    env = gym.make("IAPO-HelpfulHarmless-v0", path=str(written)).unwrapped
    assert env.table.task == "my_helpful_harmless" and env.n_contexts == read_metadata(written)["n_contexts"]


def test_copy_named_like_the_official_file_is_refused_too(tmp_path: Path, cache: Path, monkeypatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "MATH_final.pkl"  # the official name, other bytes
    write_mv_release(fake, monkeypatch)
    assert main(["data", "import", str(fake), "--dest", str(tmp_path / "out")]) == 1
    assert "is not the official release file of task 'math' (MATH_final.pkl" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    synthetic = main(["data", "import", str(fake), "--task", "SyntheticCategorical"])
    assert synthetic == 1
    assert "cannot be imported as task 'synthetic_categorical': its table is generated" in capsys.readouterr().err


def test_leaderboard_budgets_accept_commas_and_spaces(tmp_path: Path, cache: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from iapo_gym.leaderboard.run.store import ResultStore

    out = tmp_path / "lb"
    args = ["leaderboard", "--tasks", "SyntheticBernoulli", "--agents", "uniform", "--runs", "1", "--out", str(out)]
    assert main([*args, "--budgets", "100,200", "300"]) == 0
    with ResultStore(out, create=False) as store:
        budgets = {r.budget for r in store.results()}
    assert budgets == {100, 200, 300}
    with pytest.raises(SystemExit) as info:
        main([*args, "--budgets", "100;200"])
    assert info.value.code == 2
    assert "budget '100;200' is not an integer or a comma-separated list of integers" in capsys.readouterr().err
