"""The ``iapo-gym data`` commands: output a script can rely on, and exit codes 0 / 1 / 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iapo_gym.cli import main
from iapo_gym.tables import read_table


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("IAPO_GYM_CACHE", str(path))
    return path


def test_list_json_reports_every_known_table(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"math", "commonsense_qa", "helpful_harmless", "summarization", "synthetic_bernoulli_release"}
    assert rows["math"]["table"] is None and rows["math"]["release_size"] == 319794
    assert rows["math"]["source"].endswith("/1a6de0bb29c1e141bcf6283b06023677389cd87f/data/MATH_final.pkl")


def test_import_then_list_and_show(math_release: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "import", str(math_release)]) == 0
    assert capsys.readouterr().out.strip() == str(cache / "math.h5")
    assert main(["data", "list"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("math "))
    assert "present" in line and str(cache / "math.h5") in line
    assert main(["data", "show", "math", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["table"]["n_prompts"] == 25 and shown["table"]["n_test"] == 64
    assert shown["oracle"]["test"]["optimal_acr"] == pytest.approx(0.8625, abs=5e-4)
    assert shown["oracle"]["train_optimal_on_test"] == pytest.approx(0.8510, abs=5e-4)
    assert shown["oracle"]["test"]["best_n1_acr"] == pytest.approx(0.7817, abs=5e-4)


def test_failures_exit_1_with_a_message(tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "fetch", "math"]) == 1  # offline in tests
    assert "downloads are off" in capsys.readouterr().err
    assert main(["data", "show", "math"]) == 1
    assert "iapo-gym data fetch math" in capsys.readouterr().err
    assert main(["data", "import", str(tmp_path / "missing.pkl")]) == 1
    assert "no such release file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n')
    assert main(["data", "build", str(bad), "--aggregator", "mv"]) == 1
    assert "bad.jsonl:1: missing field 'query'" in capsys.readouterr().err
    assert not cache.exists()


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data"]) == 2
    assert main(["data", "fetch"]) == 2
    assert main(["data", "fetch", "math", "--all"]) == 2
    with pytest.raises(SystemExit) as info:
        main(["data", "build", "log.jsonl", "--aggregator", "median"])
    assert info.value.code == 2


def test_build_command_writes_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log.jsonl"
    rows = [{"prompt": p, "query": f"q{q}", "scores": {"a": 0.1 * q, "b": -0.2 * p}, "tokens": 10 + p}
            for p in range(2) for q in range(5)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "t.h5"
    assert main(["data", "build", str(log), "--aggregator", "bon", "--out", str(out), "--n-max", "4"]) == 0
    table = read_table(out)
    assert table.task == "log" and table.n_max == 4 and table.aggregator == "bon"
    assert main(["data", "show", str(out)]) == 0
    assert "exact oracle" in capsys.readouterr().out
