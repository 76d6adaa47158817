"""Generated task families: determinism across processes, valid tables, exact oracle = Monte Carlo, errors, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import iapo_gym
from iapo_gym.cli import main
from iapo_gym.leaderboard.run.specs import table_checksum
from iapo_gym.oracle import exact_acr, monte_carlo_acr
from iapo_gym.tables import read_table, validate
from iapo_gym.tasks.generated import (
    HELD_OUT_LEVELS,
    TUNING_LEVELS,
    FamilyError,
    families,
    level_params,
    level_table,
    parse_levels,
)

REPO = Path(__file__).resolve().parents[1]
SAMPLE_LEVELS = (0, 1, 2, 3, 9_999, 1_000_000, 1_000_001)
#: The first six families, whose size ranges these tests state; the others: tests/test_generated_families.py.
SIX = ("mv_categorical", "mv_binary", "math_like", "bon_shift", "bon_shape", "bon_flat")
_DIGEST_CHILD = (
    "import json, sys\n"
    "from iapo_gym.leaderboard.run.specs import table_checksum\n"
    "from iapo_gym.tasks.generated import level_table\n"
    "print(json.dumps({f: table_checksum(level_table(f, int(sys.argv[1]))) for f in sys.argv[2:]}))\n"
)


def test_families_are_named_and_at_least_the_required_ones() -> None:
    names = families()
    assert {"mv_categorical", "mv_binary", "bon_shift", "bon_shape", "bon_flat"} <= set(names)
    assert len(set(names)) == len(names)


def test_a_level_has_the_same_digest_in_two_fresh_processes() -> None:
    digests = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _DIGEST_CHILD, "1000003", *families()], capture_output=True,
                              text=True, check=True, cwd=REPO)
        digests.append(json.loads(done.stdout))
    assert digests[0] == digests[1]
    here = {f: table_checksum(level_table(f, 1_000_003)) for f in families()}
    assert here == digests[0]
    assert len(set(here.values())) == len(here)  # families differ
    assert table_checksum(level_table("bon_shape", 1_000_004)) != here["bon_shape"]  # levels differ


@pytest.mark.parametrize("family", SIX)
def test_sampled_levels_pass_the_validator_and_stay_in_the_stated_ranges(family: str) -> None:
    for level in SAMPLE_LEVELS:
        table = level_table(family, level)
        validate(table)
        assert 4 <= table.n_prompts <= 64 and 8 <= table.n_max <= 64
        n_train = table.split_indices("train").size
        assert 20 <= n_train <= 1000 and table.split_indices("test").size >= 5
        assert table.attrs["family"] == family and table.attrs["level"] == level
        params = json.loads(table.attrs["params"])
        assert params["n_prompts"] == table.n_prompts and params["n_max"] == table.n_max
        if table.aggregator == "mv":
            assert 2 <= table.n_atoms <= 10
        else:
            assert table.atoms is not None and 0.0 <= table.atoms.min() and table.atoms.max() <= 1.0
            assert 1 <= table.n_objectives <= 3


@pytest.mark.parametrize("family", SIX)
def test_exact_oracle_agrees_with_monte_carlo(family: str) -> None:
    for level in (5, 1_000_005):
        table = level_table(family, level)
        rng = np.random.default_rng(level)
        arms = [(int(rng.integers(table.n_prompts)), int(rng.integers(1, table.n_max + 1)))
                for _ in range(table.n_contexts)]
        test = table.split_indices("test")
        exact = exact_acr(table, arms, test)
        mc, se = monte_carlo_acr(table, arms, test, 20_000, np.random.default_rng(7))
        assert abs(mc - exact) <= 4.5 * se + 1e-9, (family, level, exact, mc, se)


def test_bad_family_and_levels_are_refused_with_what_exists() -> None:
    with pytest.raises(FamilyError, match="families: mv_categorical, mv_binary"):
        level_table("nope", 0)
    with pytest.raises(FamilyError, match=r"0-9999 \(tuning\) and 1000000-1999999 \(held out\)"):
        level_table("bon_shape", 10_000)
    with pytest.raises(FamilyError, match="must be an integer"):
        level_table("bon_shape", 1.5)  # type: ignore[arg-type]
    with pytest.raises(FamilyError, match="mix tuning and held-out"):
        parse_levels("9999:1000000")
    with pytest.raises(FamilyError, match="below the first"):
        parse_levels("5:3")
    assert parse_levels("3") == range(3, 4) and parse_levels("0:9") == range(10)
    assert parse_levels("1000000-1000099") == range(1_000_000, 1_000_100)
    assert TUNING_LEVELS.stop <= HELD_OUT_LEVELS.start


def test_gym_make_builds_a_level() -> None:
    env = gym.make("IAPO-Generated-v0", family="mv_binary", level=3)
    base = iapo_gym.base_env(env)
    assert table_checksum(base.table) == table_checksum(level_table("mv_binary", 3))
    obs, _ = env.reset(seed=0)
    _, reward, *_ = env.step((0, 1))
    assert np.isfinite(reward)
    with pytest.raises(FamilyError, match="families:"):
        gym.make("IAPO-Generated-v0", family="bogus", level=0)
    with pytest.raises(FamilyError, match="needs family=NAME and level=K"):
        gym.make("IAPO-Generated-v0")


def test_data_generate_writes_ordinary_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "generate", "bon_flat", "--levels", "2:3", "--out", str(tmp_path)]) == 0
    for level in (2, 3):
        table = read_table(tmp_path / f"bon_flat-{level}.h5")
        assert table_checksum(table) == table_checksum(level_table("bon_flat", level))
        assert level_params("bon_flat", level) == json.loads(table.attrs["params"])
    assert main(["data", "generate", "bon_flatt", "--levels", "0", "--out", str(tmp_path)]) == 1
    assert "families: " in capsys.readouterr().err
    assert main(["data", "generate", "bon_flat", "--levels", "20000", "--out", str(tmp_path)]) == 1
    assert "held out" in capsys.readouterr().err


def _best_prompts(table) -> tuple[int, int]:
    """The best prompt at N = 1 and at N_max on the train split, costs left out."""
    from iapo_gym.oracle import q_table

    train = table.split_indices("train")
    q = q_table(table, train)[0]
    mean_cost = table.cost_matrix()[:, train].mean(axis=1)
    reward = q - table.context_weights[0, -1] * mean_cost[:, None] * np.arange(1, table.n_max + 1)[None, :]
    return int(np.argmax(reward[:, 0])), int(np.argmax(reward[:, -1]))


@pytest.mark.parametrize("family", [f for f in SIX if f != "math_like"])
def test_some_levels_have_a_prompt_that_wins_at_one_and_loses_at_large_n(family: str) -> None:
    def cheap(t) -> bool:  # exact in well under a second
        return t.n_prompts * t.n_queries * t.n_atoms <= 40_000 and t.n_prompts * t.n_queries * t.n_atoms * t.n_max ** 2 <= 3e7

    small = [lv for lv in range(80) if cheap(level_table(family, lv))]
    reversed_ = sum(a != b for a, b in (_best_prompts(level_table(family, lv)) for lv in small[:12]))
    assert reversed_ >= 2, (family, small[:12])


def test_readme_shows_a_generated_task_in_three_lines() -> None:
    readme = (REPO / "README.md").read_text()
    block = next(b for b in readme.split("```python")[1:] if "IAPO-Generated-v0" in b).split("```")[0]
    lines = [line for line in block.strip().splitlines() if line.strip() and not line.startswith(("import", "from"))]
    assert len(lines) == 3
    import agents

    namespace: dict[str, object] = {"gym": gym, "iapo_gym": iapo_gym, "agents": agents}  # imported above it
    exec(compile(block, "README.md", "exec"), namespace)  # the README's own code


MATH_RELEASE = REPO / ".." / "shared" / "iapo-release" / "MATH_final.pkl"


@pytest.mark.skipif(not MATH_RELEASE.is_file(), reason="the MATH release file is not at ../shared/iapo-release/")
@pytest.mark.heavy
def test_math_like_is_calibrated_to_math() -> None:
    from iapo_gym.data.release import read_release
    from iapo_gym.tasks.generated import mv_statistics

    math_stats = mv_statistics(read_release(MATH_RELEASE, task="math")[0])
    levels = [mv_statistics(level_table("math_like", level)) for level in range(6)]
    tolerance = {"answers": 0.4, "prompt_acc_min": 0.2, "query_acc_p10": 0.15}
    for key, target in math_stats.items():
        median = float(np.median([s[key] for s in levels]))
        assert abs(median - target) <= tolerance.get(key, 0.06), (key, median, target)


def test_the_docs_example_runs_as_written() -> None:
    text = (REPO / "docs" / "tasks.md").read_text()
    block = next(b for b in text.split("```python")[1:] if "IAPO-Generated-v0" in b).split("```")[0]
    namespace: dict[str, object] = {}
    exec(compile(block, "docs/tasks.md", "exec"), namespace)  # the docs' own code
    assert namespace["table"].attrs["family"] == "math_like"  # type: ignore[attr-defined]
