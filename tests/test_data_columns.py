"""Columnar sample sets (Parquet, Arrow, CSV, JSON lines) built into tables: streamed batches, exact contents, binning."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.cli import main
from iapo_gym.data.build import BuildOptions, LogFormatError, quantile_binning
from iapo_gym.oracle import q_table
from iapo_gym.tables import OutcomeTable, read_table

pa = pytest.importorskip("pyarrow", reason="columnar sample sets need pyarrow (pip install \"iapo-gym[samples]\")")
pq = pytest.importorskip("pyarrow.parquet")
from iapo_gym.data.columns import ColumnMap, build_columns_table, column_batches  # noqa: E402


def sample_rows(seed: int = 0, n_prompts: int = 3, n_queries: int = 12, per_pair: int = 9) -> dict[str, list]:
    """One row per sample: answers among a few integers (gold = query % 4), correctness, two reward scores, tokens."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = collections.defaultdict(list)
    for p in range(n_prompts):
        for q in range(n_queries):
            for s in range(per_pair):
                answer = int(rng.integers(0, 6)) if rng.random() < 0.9 else None
                rows["prompt"].append(f"prompt-{p}")
                rows["query"].append(f"q{q}")
                rows["sample"].append(s)
                rows["answer"].append(answer)
                rows["gold"].append(q % 4)
                rows["is_correct"].append(answer == q % 4)
                rows["helpful"].append(float(rng.normal(0.2 * p, 0.6)))
                rows["harmless"].append(float(rng.normal(-0.1 * q / n_queries, 0.4)))
                rows["tokens"].append(int(rng.integers(20, 200)) + 50 * p)
    order = rng.permutation(len(rows["prompt"]))  # a file is in no particular order
    return {k: [v[i] for i in order] for k, v in rows.items()}


def write(rows: dict[str, list], path: Path) -> Path:
    table = pa.table(rows)
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=50)
    elif path.suffix == ".arrow":
        import pyarrow.feather as feather

        feather.write_feather(table, path, chunksize=70)
    elif path.suffix == ".csv":
        import pyarrow.csv as pcsv

        pcsv.write_csv(table, path)
    else:
        lines = (json.dumps(dict(zip(rows, vals, strict=True))) + "\n" for vals in zip(*rows.values(), strict=True))
        path.write_text("".join(lines))
    return path


def same_table(a: OutcomeTable, b: OutcomeTable) -> None:
    """Bit-identical arrays, ids and costs."""
    for name in ("probs", "atoms", "gold", "cost", "split", "context_weights", "context_probs"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or np.array_equal(x, y), name
    assert a.prompts == b.prompts and a.queries == b.queries and a.objective_names == b.objective_names


BUILDS = {
    "mv answers": ("mv", ColumnMap(), BuildOptions()),
    "mv correctness": ("mv", ColumnMap(correct="is_correct"), BuildOptions(top_k=1)),
    "bon grid": ("bon", ColumnMap(scores=("helpful", "harmless")), BuildOptions()),
    "bon exact": ("bon", ColumnMap(scores=("helpful", "harmless")), BuildOptions(grid=None)),
    "bon quantiles": ("bon", ColumnMap(scores=("helpful", "harmless")), BuildOptions(quantile_bins=5)),
}


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_multi_batch_build_equals_single_batch_build(tmp_path: Path, build: str) -> None:
    aggregator, mapping, options = BUILDS[build]
    path = write(sample_rows(), tmp_path / "samples.parquet")
    one = build_columns_table(path, aggregator, options, mapping, batch_rows=10**6)
    assert len(list(column_batches(path, aggregator, mapping, batch_rows=7))) == -(-324 // 7)
    many = build_columns_table(path, aggregator, options, mapping, batch_rows=7)
    same_table(one, many)
    assert one.attrs["completions"] == many.attrs["completions"] == 3 * 12 * 9


@pytest.mark.parametrize("suffix", [".arrow", ".csv", ".jsonl"])
def test_every_format_gives_the_parquet_table(tmp_path: Path, suffix: str) -> None:
    rows = sample_rows(seed=1)
    reference = build_columns_table(write(rows, tmp_path / "s.parquet"), "bon", BuildOptions(),
                                    ColumnMap(scores=("helpful", "harmless")))
    other = build_columns_table(write(rows, tmp_path / f"s{suffix}"), "bon", BuildOptions(),
                                ColumnMap(scores=("helpful", "harmless")), batch_rows=40,
                                fmt="jsonl" if suffix == ".jsonl" else None)
    same_table(reference, other)
    mv_ref = build_columns_table(tmp_path / "s.parquet", "mv", BuildOptions(top_k=6))
    mv = build_columns_table(tmp_path / f"s{suffix}", "mv", BuildOptions(top_k=6), batch_rows=40)
    same_table(mv_ref, mv)


def test_majority_vote_counts_match_the_rows(tmp_path: Path) -> None:
    """With room for every answer, each (prompt, query)'s buckets are its answer counts; no answer is 'other'."""
    rows = sample_rows(seed=2)
    table = build_columns_table(write(rows, tmp_path / "s.parquet"), "mv", BuildOptions(top_k=6, test_fraction=0.0))
    counts: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    for p, q, a, t in zip(rows["prompt"], rows["query"], rows["answer"], rows["tokens"], strict=True):
        counts[(p, q)][a] += 1
        tokens[p].append(t)
    for (p, q), c in counts.items():
        pi, qi = table.prompts.index(p), table.queries.index(q)
        probs = table.probs[pi, qi] * 9
        assert probs[-1] == pytest.approx(c[None])  # no answer falls into "other"
        assert sorted(np.round(probs[:-1]).astype(int).tolist()) == sorted([0] * (6 - len(c) + (None in c))
                                                                         + [n for a, n in c.items() if a is not None])
        assert probs[table.gold[qi]] == pytest.approx(c[int(q[1:]) % 4])
    mean = np.array([np.mean(tokens[p]) for p in table.prompts])
    np.testing.assert_allclose(table.cost, 0.01 * mean / mean.max(), rtol=1e-15)
    correct = build_columns_table(tmp_path / "s.parquet", "mv", BuildOptions(top_k=1, test_fraction=0.0),
                                  ColumnMap(correct="is_correct"))
    assert correct.n_atoms == 2 and np.all(correct.gold == 0)
    for (p, q), c in counts.items():
        assert correct.probs[correct.prompts.index(p), correct.queries.index(q), 0] * 9 == pytest.approx(c[int(q[1:]) % 4])


@pytest.mark.parametrize("binning", ["grid", "quantiles"])
def test_binning_moves_exact_values_by_at_most_its_bound(tmp_path: Path, binning: str) -> None:
    """Every exact Q(c, p, N) of the binned table lies within sum_k |w_k| * h_k of the unbinned one, h_k the
    largest distance a score moves (grid: G/2; quantile bins: the widest bin)."""
    path = write(sample_rows(seed=3), tmp_path / "s.parquet")
    mapping = ColumnMap(scores=("helpful", "harmless"))
    exact = build_columns_table(path, "bon", BuildOptions(grid=None, n_max=6), mapping)
    if binning == "grid":
        binned = build_columns_table(path, "bon", BuildOptions(grid=0.5, n_max=6), mapping)
        h = np.array([0.25, 0.25])
    else:
        binned = build_columns_table(path, "bon", BuildOptions(quantile_bins=4, n_max=6), mapping)
        found = quantile_binning(lambda: column_batches(path, "bon", mapping), 4)
        assert found.edges is not None and all(e.size == 3 for e in found.edges)
        scores = np.column_stack([pq.read_table(path)[c].to_numpy() for c in ("helpful", "harmless")])
        h = np.array([np.diff(np.concatenate([[scores[:, k].min()], e, [scores[:, k].max()]])).max()
                      for k, e in enumerate(found.edges)])
        for k, e in enumerate(found.edges):  # edge j: the first histogram-cell boundary with j/4 of the scores below
            cell = (scores[:, k].max() - scores[:, k].min()) / 4096
            below = (scores[:, k][None, :] < e[:, None]).sum(axis=1)
            below_one_cell_earlier = (scores[:, k][None, :] < e[:, None] - cell).sum(axis=1)
            target = scores.shape[0] * np.array([0.25, 0.5, 0.75])
            assert np.all(below >= target) and np.all(below_one_cell_earlier < target)
    assert np.count_nonzero(binned.probs) < np.count_nonzero(exact.probs)  # atoms merged
    bound = np.abs(exact.context_weights[:, :2]) @ h
    gap = np.abs(q_table(binned) - q_table(exact)).max(axis=(1, 2))
    assert np.all(gap <= bound + 1e-12)
    assert gap.max() > 0  # binning does change the values


def test_bad_rows_are_named(tmp_path: Path) -> None:
    rows = sample_rows(seed=4, n_prompts=2, n_queries=3, per_pair=4)
    base = dict(rows)
    bad = dict(base, prompt=[None] + base["prompt"][1:])
    with pytest.raises(LogFormatError, match=r"b1.parquet: row 1: column 'prompt' is empty"):
        build_columns_table(write(bad, tmp_path / "b1.parquet"), "mv")
    bad = dict(base, helpful=base["helpful"][:5] + [float("nan")] + base["helpful"][6:])
    with pytest.raises(LogFormatError, match=r"b2.parquet: row 6: column 'helpful' must be finite"):
        build_columns_table(write(bad, tmp_path / "b2.parquet"), "bon", mapping=ColumnMap(scores=("helpful",)))
    with pytest.raises(LogFormatError, match=r"no column 'reward' \(score\); the columns are \['prompt'"):
        build_columns_table(tmp_path / "b2.parquet", "bon", mapping=ColumnMap(scores=("reward",)))
    dup = {k: v + v[:1] for k, v in base.items()}  # one sample twice
    with pytest.raises(LogFormatError, match=r"row 25: sample 2 of prompt 'prompt-0' on query 'q2' appears twice"):
        build_columns_table(write(dup, tmp_path / "b3.parquet"), "mv", batch_rows=5)
    gold = dict(base, gold=list(base["gold"]))
    i = base["query"].index("q1", 10)
    gold["gold"][i] = 3
    first = base["query"].index("q1") + 1
    with pytest.raises(LogFormatError, match=fr"row {i + 1}: gold answer '3' of query 'q1' differs from '1' at .*row {first}"):
        build_columns_table(write(gold, tmp_path / "b4.parquet"), "mv", batch_rows=3)
    keep = [i for i, (p, q) in enumerate(zip(base["prompt"], base["query"], strict=True)) if (p, q) != ("prompt-1", "q2")]
    missing = {k: [v[i] for i in keep] for k, v in base.items()}
    with pytest.raises(LogFormatError, match=r"no completion of prompt 'prompt-1' on query 'q2'; .* \(1 pairs are missing\)"):
        build_columns_table(write(missing, tmp_path / "b5.parquet"), "mv")


def test_memory_guards_refuse_counts_and_tables_past_the_limit(tmp_path: Path) -> None:
    """The running counts and the dense table (P x Q x M x (K + 1) values) are both held to ``max_bytes``."""
    from iapo_gym.data.build import SampleAccumulator

    mapping = ColumnMap(scores=("helpful", "harmless"))
    path = write(sample_rows(seed=5), tmp_path / "s.parquet")
    acc = SampleAccumulator("bon", binning=None, max_bytes=4000)
    with pytest.raises(LogFormatError, match=r"s.parquet: row \d+: the distinct \(prompt, query, outcome\) counts so "
                                             r"far take \d+ bytes, more than the limit of 4000 \(counted: the keys \d+, "
                                             r"the answers' digests 0, the sample-index cells \d+\); use a coarser --grid"):
        for batch, names in column_batches(path, "bon", mapping, batch_rows=50):
            acc.add(batch, names)
    # one pair with 60 distinct atoms pads every pair to 60: few distinct counts, a large dense table
    rows: dict[str, list] = collections.defaultdict(list)
    for p in range(3):
        for q in range(12):
            for s in range(60 if (p, q) == (0, 0) else 1):
                rows["prompt"].append(f"p{p}")
                rows["query"].append(f"q{q}")
                rows["helpful"].append(float(s))
                rows["harmless"].append(0.0)
    path = write(dict(rows), tmp_path / "wide.parquet")
    acc = SampleAccumulator("bon", max_bytes=20000)
    for batch, names in column_batches(path, "bon", mapping):
        acc.add(batch, names)
    with pytest.raises(LogFormatError, match=r"the table would hold 3 prompts x 12 queries x 60 atoms x 3 values = "
                                             r"51840 bytes, more than the limit of 20000; use a coarser --grid"):
        acc.finish("wide")
    acc = SampleAccumulator("bon", max_bytes=51840)
    for batch, names in column_batches(path, "bon", mapping):
        acc.add(batch, names)
    assert acc.finish("wide", test_fraction=0.0).n_atoms == 60  # at the limit: built


def test_cli_builds_both_shapes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(sample_rows(seed=6), tmp_path / "runs.parquet")
    out = tmp_path / "rm.h5"
    assert main(["data", "build", str(path), "--aggregator", "bon", "--score-col", "helpful", "--score-col", "harmless",
                 "--out", str(out), "--batch-rows", "100"]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == f"{out}: 3 prompts x 12 queries x {read_table(out).n_atoms} atoms (bon), 324 completions"
    assert "27 contexts over 2 objectives" in printed.err
    table = read_table(out)
    assert table.objective_names == ("helpful", "harmless") and table.attrs["source"] == "sample set runs.parquet"
    out = tmp_path / "cov.h5"
    assert main(["data", "build", str(path), "--aggregator", "mv", "--correct-col", "is_correct", "--out", str(out)]) == 0
    assert read_table(out).n_atoms == 2
    assert main(["data", "build", str(path), "--aggregator", "bon", "--score-col", "nope"]) == 1
    assert "no column 'nope'" in capsys.readouterr().err


def test_documented_sample_set_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two commands of docs/data.md, as written, on files with their column names."""
    import re
    import shlex

    text = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```\n(iapo-gym data build (?:samples|scored)\.parquet.*?)\n```", text, re.S)
    assert len(blocks) == 2
    rows = sample_rows(seed=7)
    write({"model": rows["prompt"], "problem_id": rows["query"], "sample_idx": rows["sample"],
           "is_correct": rows["is_correct"]}, tmp_path / "samples.parquet")
    write({"prompt": rows["prompt"], "query": rows["query"], "helpfulness_rm": rows["helpful"],
           "harmlessness_rm": rows["harmless"], "completion_tokens": rows["tokens"]}, tmp_path / "scored.parquet")
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        args = shlex.split(block.replace("\\\n", " "))
        assert args[:3] == ["iapo-gym", "data", "build"]
        assert main(args[1:]) == 0
    assert read_table(tmp_path / "samples.h5").n_atoms == 2
    assert read_table(tmp_path / "scored.h5").objective_names == ("helpfulness_rm", "harmlessness_rm")


def test_json_lines_read_as_a_log_or_as_a_sample_set_give_one_table(tmp_path: Path) -> None:
    """A flat .jsonl is read as iapo-gym's completion log by default and as a sample set with --format columns:
    two readers, one builder, the same table."""
    path = write(sample_rows(seed=8), tmp_path / "flat.jsonl")
    assert main(["data", "build", str(path), "--aggregator", "mv", "--out", str(tmp_path / "log.h5")]) == 0
    assert main(["data", "build", str(path), "--format", "columns", "--aggregator", "mv", "--batch-rows", "50",
                 "--out", str(tmp_path / "columns.h5")]) == 0
    log, columns = read_table(tmp_path / "log.h5"), read_table(tmp_path / "columns.h5")
    same_table(log, columns)
    assert log.attrs["source"] == "completion log flat.jsonl" and columns.attrs["source"] == "sample set flat.jsonl"
