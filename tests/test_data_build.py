"""Tables built from completion logs: bucketing, binning, cost normalisation, malformed lines."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.data.build import LogFormatError, build_bon_table, build_mv_table
from iapo_gym.tables import read_table


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _mv_rows() -> list[dict]:
    rows = []
    # query q1 (gold "1"): global counts 3:2, 4:2, 1:1, 2:1, 5:1 -> with top_k=2 the gold "1" displaces "4"
    for prompt, answers, tokens in (("a", ["1", "2"], 10), ("b", ["3", "3", "4", "4", "5", None], 30)):
        rows += [{"prompt": prompt, "query": "q1", "answer": a, "gold": "1", "tokens": tokens} for a in answers]
    rows += [{"prompt": "a", "query": "q2", "answer": "7", "gold": 7, "tokens": 10},
             {"prompt": "b", "query": "q2", "answer": 7.0, "gold": "7", "tokens": 30}]
    return rows


def test_mv_buckets_keep_top_answers_and_gold(tmp_path: Path) -> None:
    table = build_mv_table(_write(tmp_path / "log.jsonl", _mv_rows()), top_k=2, test_fraction=0.5)
    assert table.probs.shape == (2, 2, 3) and table.prompts == ("a", "b") and table.queries == ("q1", "q2")
    # q1 buckets: "3" (2 votes), gold "1" (kept although "4" has more votes), other
    np.testing.assert_allclose(table.probs[0, 0], [0.0, 0.5, 0.5])
    np.testing.assert_allclose(table.probs[1, 0], [2 / 6, 0.0, 4 / 6])
    assert table.gold[0] == 1
    # q2: 7, 7.0 and "7" are one answer
    np.testing.assert_allclose(table.probs[:, 1, 0], 1.0)
    assert table.gold[1] == 0
    np.testing.assert_allclose(table.cost, [0.01 / 3, 0.01])  # mean tokens 10 vs 30, scaled to max 0.01
    assert sorted(table.split.tolist()) == [0, 1]


def test_mv_top_k_default_and_split_from_log(tmp_path: Path) -> None:
    rows = _mv_rows()
    for r in rows:
        r["split"] = "test" if r["query"] == "q2" else "train"
    table = build_mv_table(_write(tmp_path / "log.jsonl", rows), cost_scale=1.0)
    assert table.n_atoms == 5
    np.testing.assert_array_equal(table.split, [0, 1])
    # q1 with top 4: "3", "4", then gold "1" ahead of "2" and "5" (equal counts: first seen wins)
    np.testing.assert_allclose(table.probs[1, 0], [2 / 6, 2 / 6, 0.0, 0.0, 2 / 6])
    assert table.gold[0] == 2
    np.testing.assert_allclose(table.cost, [1 / 3, 1.0])


def test_bon_grid_binning_and_empirical_distribution(tmp_path: Path) -> None:
    rows = []
    for q in ("x", "y"):
        for p, scores in (("p0", [(0.1, -0.9), (0.2, -1.0), (0.9, 0.3)]), ("p1", [(0.6, 0.6), (0.6, 0.6)])):
            rows += [{"prompt": p, "query": q, "scores": {"helpful": h, "harmless": s}, "tokens": 5} for h, s in scores]
    log = _write(tmp_path / "log.jsonl", rows)
    table = build_bon_table(log, test_fraction=0.5)
    assert table.objective_names == ("helpful", "harmless") and table.n_contexts == 27
    # p0: (0.1,-0.9) and (0.2,-1.0) both bin to (0.0, -1.0); (0.9, 0.3) -> (1.0, 0.5)
    atoms, probs = table.atoms[0, 0], table.probs[0, 0]
    got = {tuple(a): p for a, p in zip(atoms.tolist(), probs.tolist(), strict=True) if p > 0}
    assert got == pytest.approx({(0.0, -1.0): 2 / 3, (1.0, 0.5): 1 / 3})
    assert table.probs[1, 0].max() == pytest.approx(1.0)  # p1: one atom, padded with zero-probability copies
    exact = build_bon_table(log, grid=None, test_fraction=0.5)
    assert exact.n_atoms == 3 and np.count_nonzero(exact.probs[0, 0]) == 3


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "not valid JSON"),
    ('["a"]', "must be a JSON object"),
    ('{"prompt": "a", "query": "q1", "answer": "1", "gold": "1"}', "missing field 'tokens'"),
    ('{"prompt": "a", "query": "q1", "answer": "1", "gold": "2", "tokens": 3}', "gold answer '2' of query 'q1' differs"),
    ('{"prompt": "a", "query": "q1", "answer": "1", "gold": "1", "tokens": -1}', "'tokens' must be a number >= 0"),
    ('{"prompt": true, "query": "q1", "answer": "1", "gold": "1", "tokens": 1}', "'prompt' must be a string or an integer"),
])
def test_malformed_line_names_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "log.jsonl"
    good = json.dumps({"prompt": "a", "query": "q1", "answer": "1", "gold": "1", "tokens": 3})
    path.write_text(f"{good}\n\n{good}\n{line}\n")
    with pytest.raises(LogFormatError, match=f"log.jsonl:4: .*{message}"):
        build_mv_table(path, test_fraction=0.0)


def test_missing_pair_and_mixed_objectives_are_reported(tmp_path: Path) -> None:
    rows = [{"prompt": "a", "query": "q1", "answer": "1", "gold": "1", "tokens": 1},
            {"prompt": "b", "query": "q2", "answer": "1", "gold": "1", "tokens": 1}]
    with pytest.raises(LogFormatError, match="no completion of prompt 'a' on query 'q2'"):
        build_mv_table(_write(tmp_path / "a.jsonl", rows))
    bon = [{"prompt": "a", "query": "q", "scores": {"u": 1}, "tokens": 1},
           {"prompt": "a", "query": "q", "scores": {"v": 1}, "tokens": 1}]
    with pytest.raises(LogFormatError, match=r"b.jsonl:2: objectives \['v'\] differ"):
        build_bon_table(_write(tmp_path / "b.jsonl", bon))


def test_example_builds_a_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    example = Path(__file__).resolve().parents[1] / "examples" / "build_table_from_logs.py"
    runpy.run_path(str(example), run_name="__main__")
    mv, bon = read_table(tmp_path / "my_mv.h5"), read_table(tmp_path / "my_bon.h5")
    assert mv.aggregator == "mv" and mv.n_atoms == 5 and bon.aggregator == "bon"
