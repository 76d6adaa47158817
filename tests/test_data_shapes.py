"""Sample sets in the shapes they are published in: list columns (one row per (prompt, query)), Parquet shards,
tables in memory (pyarrow, Hugging Face ``datasets``), with named objectives, chosen contexts and exact checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.cli import main
from iapo_gym.data.build import BuildOptions, LogFormatError, load_contexts
from iapo_gym.oracle import q_table
from iapo_gym.tables import OutcomeTable, read_table

pa = pytest.importorskip("pyarrow", reason="columnar sample sets need pyarrow (pip install \"iapo-gym[samples]\")")
pq = pytest.importorskip("pyarrow.parquet")
from iapo_gym.data import build_table  # noqa: E402
from iapo_gym.data.columns import ColumnMap, build_columns_table  # noqa: E402

N_PROMPTS, N_QUERIES = 3, 10


def published(seed: int = 0, samples: tuple[int, int] = (5, 12)) -> dict[str, list]:
    """The repeated-sampling shape: one row per (model, problem), with the samples' answers, correctness flags,
    per-sample token counts and per-sample score lists of three reward models, in a random row order."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {k: [] for k in ("model", "problem", "gold", "samples", "is_corrects", "tokens",
                                             "rm_a", "rm_b", "rewards")}
    for p in range(N_PROMPTS):
        for q in range(N_QUERIES):
            n = int(rng.integers(*samples))
            answers = [None if rng.random() < 0.1 else str(int(rng.integers(0, 5))) for _ in range(n)]
            gold = str(q % 5)
            scores = rng.normal(0.1 * p, 0.7, size=(n, 3)).round(3)
            rows["model"].append(f"model-{p}")
            rows["problem"].append(f"problem-{q}")
            rows["gold"].append(gold)
            rows["samples"].append(answers)
            rows["is_corrects"].append([a == gold for a in answers])
            rows["tokens"].append([int(t) for t in rng.integers(10, 300, n) + 40 * p])
            rows["rm_a"].append(scores[:, 0].tolist())
            rows["rm_b"].append(scores[:, 1].tolist())
            rows["rewards"].append(scores.tolist())
    order = rng.permutation(len(rows["model"]))
    return {k: [v[i] for i in order] for k, v in rows.items()}


def exploded(rows: dict[str, list]) -> dict[str, list]:
    """The same samples one row per sample (long format), rows in the list file's order, sample = list position."""
    out: dict[str, list] = {k: [] for k in ("model", "problem", "gold", "sample", "answer", "is_correct", "tokens",
                                            "rm_a", "rm_b", "rm_c")}
    for i in range(len(rows["model"])):
        for s, answer in enumerate(rows["samples"][i]):
            out["model"].append(rows["model"][i])
            out["problem"].append(rows["problem"][i])
            out["gold"].append(rows["gold"][i])
            out["sample"].append(s)
            out["answer"].append(answer)
            out["is_correct"].append(rows["is_corrects"][i][s])
            out["tokens"].append(rows["tokens"][i][s])
            for k, name in enumerate(("rm_a", "rm_b", "rm_c")):
                out[name].append(rows["rewards"][i][s][k])
    return out


def parquet(rows: dict[str, list], path: Path, row_group_size: int = 7) -> Path:
    pq.write_table(pa.table(rows), path, row_group_size=row_group_size)
    return path


def same_table(a: OutcomeTable, b: OutcomeTable) -> None:
    """Bit-identical arrays, ids, costs and contexts."""
    for name in ("probs", "atoms", "gold", "cost", "split", "context_weights", "context_probs"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or (x.dtype == y.dtype and np.array_equal(x, y)), name
    assert a.prompts == b.prompts and a.queries == b.queries and a.objective_names == b.objective_names
    assert a.context_names == b.context_names and a.attrs["completions"] == b.attrs["completions"]


LONG = ColumnMap(prompt="model", query="problem", sample="sample")
SHAPES = {  # name: (aggregator, list-shape mapping, long-format mapping, options)
    "mv answers": ("mv", ColumnMap(prompt="model", query="problem", answer="samples"), LONG, BuildOptions(top_k=3)),
    "mv correctness": ("mv", ColumnMap(prompt="model", query="problem", correct="is_corrects"),
                       ColumnMap(prompt="model", query="problem", correct="is_correct"), BuildOptions(top_k=1)),
    "bon score lists": ("bon", ColumnMap(prompt="model", query="problem", scores=("rm_a", "rm_b")),
                        ColumnMap(prompt="model", query="problem", scores=("rm_a", "rm_b")), BuildOptions(grid=None)),
    "bon list of score lists": ("bon", ColumnMap(prompt="model", query="problem", scores=("rewards",),
                                                 objectives=("rm_a", "rm_b", "rm_c")),
                                ColumnMap(prompt="model", query="problem", scores=("rm_a", "rm_b", "rm_c")),
                                BuildOptions(grid=0.25)),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_list_columns_build_the_long_format_table_bit_for_bit(tmp_path: Path, shape: str) -> None:
    aggregator, lists, long, options = SHAPES[shape]
    rows = published(seed=1)
    list_file = parquet(rows, tmp_path / "lists.parquet")
    long_file = parquet(exploded(rows), tmp_path / "long.parquet", row_group_size=50)
    reference = build_columns_table(long_file, aggregator, options, long)
    for batch_rows in (10**6, 20, 3):  # a batch of 3 samples cuts every list row into several
        built = build_columns_table(list_file, aggregator, options, lists, batch_rows=batch_rows)
        same_table(reference, built)
    assert "sample index = list position" in built.attrs["columns"]


def test_list_columns_exact_values(tmp_path: Path) -> None:
    """Independent of the builder: majority vote on correctness flags gives each pair's share of correct samples;
    Best-of-N on exact score lists gives Q(c, p, 1) = mean over queries of the mean sample utility minus cost."""
    rows = published(seed=2)
    path = parquet(rows, tmp_path / "lists.parquet")
    mv = build_columns_table(path, "mv", BuildOptions(top_k=1, test_fraction=0.0),
                             ColumnMap(prompt="model", query="problem", correct="is_corrects"))
    for i in range(len(rows["model"])):
        p, q = mv.prompts.index(rows["model"][i]), mv.queries.index(rows["problem"][i])
        assert mv.probs[p, q, 0] == pytest.approx(np.mean(rows["is_corrects"][i]), abs=1e-15)
    tokens = {m: np.mean(np.concatenate([t for mm, t in zip(rows["model"], rows["tokens"], strict=True) if mm == m]))
              for m in set(rows["model"])}
    top = max(tokens.values())
    np.testing.assert_allclose(mv.cost, [0.01 * tokens[m] / top for m in mv.prompts], rtol=1e-15)
    bon = build_columns_table(path, "bon", BuildOptions(grid=None, test_fraction=0.0, n_max=2),
                              ColumnMap(prompt="model", query="problem", scores=("rewards",)))
    assert bon.objective_names == ("rewards[0]", "rewards[1]", "rewards[2]")
    q1 = q_table(bon)[:, :, 0]
    expected = np.zeros_like(q1)
    for c, w in enumerate(bon.context_weights):
        for p, model in enumerate(bon.prompts):
            per_query = [np.mean(np.asarray(rows["rewards"][i]) @ w[:3]) for i in range(len(rows["model"]))
                         if rows["model"][i] == model]
            expected[c, p] = np.mean(per_query) + w[3] * bon.cost[p]
    np.testing.assert_allclose(q1, expected, rtol=0, atol=1e-12)


def test_a_file_mixing_both_shapes_is_refused(tmp_path: Path) -> None:
    rows = published(seed=3)
    rows["tokens"] = [int(np.sum(t)) for t in rows["tokens"]]  # one total per row beside lists of samples
    path = parquet(rows, tmp_path / "mixed.parquet")
    mapping = ColumnMap(prompt="model", query="problem", answer="samples")
    with pytest.raises(LogFormatError, match=r"mixed.parquet: the file mixes both shapes: column\(s\) \['samples'\] "
                                             r"hold a list of samples per row, column\(s\) \['tokens'\] one value per row"):
        build_columns_table(path, "mv", mapping=mapping)
    table = build_columns_table(path, "mv", mapping=ColumnMap(**{**mapping.__dict__, "tokens": ""}))
    assert table.attrs["cost_source"].startswith("none given")
    rows = published(seed=3)
    rows["rewards"] = [r[:-1] + [r[-1][:2]] for r in rows["rewards"]]  # the last sample of each row: 2 scores of 3
    path = parquet(rows, tmp_path / "ragged.parquet")
    with pytest.raises(LogFormatError, match=r"ragged.parquet: row 1, list item \d+: column 'rewards' gives 2 scores "
                                             r"for this sample and 3 for the first"):
        build_columns_table(path, "bon", mapping=ColumnMap(prompt="model", query="problem", scores=("rewards",)))
    rows = published(seed=3)
    rows["is_corrects"] = rows["is_corrects"][:-1] + [rows["is_corrects"][-1][:-1]]
    path = parquet(rows, tmp_path / "short.parquet")
    n = len(rows["model"])
    with pytest.raises(LogFormatError, match=fr"short.parquet: row {n}: column 'tokens' lists (\d+) samples, column "
                                             r"'is_corrects' (?!\1)\d+; each list holds the same samples of the row"):
        build_columns_table(path, "mv", mapping=ColumnMap(prompt="model", query="problem", correct="is_corrects"))


def test_wrong_types_name_the_column_the_row_and_the_type(tmp_path: Path) -> None:
    """The messages the issue found misleading, each replaced by one naming the column, the row and the cause."""
    rows = published(seed=4)
    strings = dict(rows, is_corrects=[["yes" if c else "no" for c in r] for r in rows["is_corrects"]])
    with pytest.raises(LogFormatError, match=r"s.parquet: row 1, list item 0: column 'is_corrects' holds list<element: string>, "
                                             r"expected true/false or 1/0 per sample"):
        build_columns_table(parquet(strings, tmp_path / "s.parquet"), "mv",
                            mapping=ColumnMap(prompt="model", query="problem", correct="is_corrects"))
    nested = dict(rows, samples=[[[a] for a in r] for r in rows["samples"]])
    with pytest.raises(LogFormatError, match=r"n.parquet: row 1, list item 0: column 'samples' holds list<element: "
                                             r"string>, expected text or numbers per sample"):
        build_columns_table(parquet(nested, tmp_path / "n.parquet"), "mv",
                            mapping=ColumnMap(prompt="model", query="problem", answer="samples"))
    long = exploded(rows)
    import pyarrow.csv as pcsv

    columns = {k: long[k] for k in ("model", "problem", "answer", "gold", "tokens", "rm_a")}
    columns["verdict"] = ["good" if c else "bad" for c in long["is_correct"]]
    pcsv.write_csv(pa.table(columns), tmp_path / "long.csv")
    with pytest.raises(LogFormatError, match=r"long.csv: Best-of-N needs its objectives named: give --score-col NAME "
                                             r"for each \(repeat\), or name the columns score_<objective>; no column is "
                                             r"taken as an objective by its type \(candidates: \[.*'rm_a'\]"):
        build_columns_table(tmp_path / "long.csv", "bon", mapping=ColumnMap(prompt="model", query="problem"))
    with pytest.raises(LogFormatError, match=r"long.csv: row 1: column 'verdict' holds string, expected numbers \(a "
                                             r"Best-of-N score"):
        build_columns_table(tmp_path / "long.csv", "bon",
                            mapping=ColumnMap(prompt="model", query="problem", scores=("rm_a", "verdict")))
    # the answer column is read as text only where it is the answer: as a score it is a number
    ok = build_columns_table(tmp_path / "long.csv", "bon",
                             mapping=ColumnMap(prompt="model", query="problem", scores=("rm_a", "gold")))
    assert ok.objective_names == ("rm_a", "gold")


def test_score_columns_by_the_documented_pattern(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --score-col only score_<objective> columns are objectives; a file with none is refused (exit 1),
    never built on its numeric columns."""
    long = exploded(published(seed=5))
    rows = {"prompt": long["model"], "query": long["problem"], "score_helpful": long["rm_a"],
            "score_harmless": long["rm_b"], "temperature": [0.7] * len(long["model"]), "completion_tokens": long["tokens"]}
    table = build_columns_table(parquet(rows, tmp_path / "named.parquet"), "bon")
    assert table.objective_names == ("score_helpful", "score_harmless")
    unnamed = {"prompt": rows["prompt"], "query": rows["query"], "helpful": rows["score_helpful"],
               "temperature": rows["temperature"], "completion_tokens": rows["completion_tokens"]}
    out = tmp_path / "never.h5"
    assert main(["data", "build", str(parquet(unnamed, tmp_path / "unnamed.parquet")), "--aggregator", "bon",
                 "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "unnamed.parquet: Best-of-N needs its objectives named" in err
    assert "candidates: ['helpful', 'temperature', 'completion_tokens']" in err and not out.exists()


def test_sample_indices_are_checked_as_sets(tmp_path: Path) -> None:
    """0..7 with {1, 5, 6} replaced by {2, 3, 7} keeps the count, the sum and the sum of squares: refused all the same;
    so is a misnumbered pair (0, 1, 3) and a pair starting above the file's lowest index."""
    def rows(indices: dict[tuple[int, int], list[int]]) -> dict[str, list]:
        out: dict[str, list] = {"prompt": [], "query": [], "sample": [], "correct": []}
        for (p, q), idx in indices.items():
            for s in idx:
                out["prompt"].append(f"p{p}")
                out["query"].append(f"q{q}")
                out["sample"].append(s)
                out["correct"].append(s % 2 == 0)
        return out

    good = {(p, q): list(range(8)) for p in range(2) for q in range(2)}
    mapping, options = ColumnMap(correct="correct"), BuildOptions(top_k=1, test_fraction=0.0)
    assert build_columns_table(parquet(rows(good), tmp_path / "good.parquet"), "mv", options, mapping).n_atoms == 2
    fooled = [0, 2, 3, 2, 4, 3, 7, 7]  # {1, 5, 6} -> {2, 3, 7}
    assert (len(fooled), sum(fooled), sum(s * s for s in fooled)) == (8, sum(range(8)), sum(s * s for s in range(8)))
    with pytest.raises(LogFormatError, match=r"dup.parquet: row 12: sample 2 of prompt 'p0' on query 'q1' appears twice"):
        build_columns_table(parquet(rows({**good, (0, 1): fooled}), tmp_path / "dup.parquet"), "mv", options, mapping)
    with pytest.raises(LogFormatError, match=r"gap.parquet: the 3 sample indices of prompt 'p1' on query 'q0' are not "
                                             r"0..2 once each \(they are \{0, 1, 3\}"):
        build_columns_table(parquet(rows({**good, (1, 0): [0, 1, 3]}), tmp_path / "gap.parquet"), "mv", options,
                            mapping, batch_rows=5)
    with pytest.raises(LogFormatError, match=r"are not 0..7 once each \(they are \{1, 2, 3, 4, 5, 6, 7, 8\}"):
        build_columns_table(parquet(rows({**good, (1, 1): list(range(1, 9))}), tmp_path / "shift.parquet"), "mv",
                            options, mapping)


def test_parquet_shards_build_the_single_file_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    long = exploded(published(seed=6))
    single = parquet(long, tmp_path / "all.parquet")
    folder = tmp_path / "shards"
    (folder / "zz").mkdir(parents=True)
    n = len(long["model"])
    cuts = [0, n // 3, n // 2, n]
    for j, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        where = folder / ("zz" if j == 2 else "") / f"shard-{j:02d}.parquet"  # in path order: the shard order
        parquet({k: v[a:b] for k, v in long.items()}, where)
    mapping = ColumnMap(prompt="model", query="problem", scores=("rm_a", "rm_b"))
    reference = build_columns_table(single, "bon", BuildOptions(), mapping)
    same_table(reference, build_columns_table(folder, "bon", BuildOptions(), mapping, batch_rows=11))
    same_table(reference, build_columns_table(f"{folder}/**/shard-*.parquet", "bon", BuildOptions(), mapping))
    out = tmp_path / "shards.h5"
    assert main(["data", "build", str(folder), "--aggregator", "bon", "--prompt-col", "model", "--query-col", "problem",
                 "--score-col", "rm_a", "--score-col", "rm_b", "--out", str(out)]) == 0
    same_table(reference, read_table(out))
    assert "3 Parquet shards" in read_table(out).attrs["source"]
    capsys.readouterr()
    parquet({"model": ["m"], "problem": ["x"], "rm_a": ["text"], "rm_b": [1.0], "sample": [0]},
            folder / "shard-99.parquet")
    assert main(["data", "build", str(folder), "--aggregator", "bon", "--prompt-col", "model", "--query-col", "problem",
                 "--score-col", "rm_a", "--score-col", "rm_b"]) == 1
    assert "shard-99.parquet: column 'rm_a' holds string, the first shard shard-00.parquet double" in \
        capsys.readouterr().err


def test_tables_in_memory_without_a_file(tmp_path: Path) -> None:
    """A Hugging Face datasets.Dataset built from a dict (no hub) and a pyarrow table give the file's table."""
    datasets = pytest.importorskip("datasets", reason="the Hugging Face datasets package is not installed")
    rows = published(seed=7)
    mapping = ColumnMap(prompt="model", query="problem", answer="samples")
    reference = build_columns_table(parquet(rows, tmp_path / "lists.parquet"), "mv", BuildOptions(), mapping)
    same_table(reference, build_table(datasets.Dataset.from_dict(rows), "mv", columns=mapping))
    same_table(reference, build_table(pa.table(rows), "mv", columns=mapping, batch_rows=9))
    built = build_table(pa.table(rows), "mv", columns=mapping)
    assert built.task == "samples" and built.attrs["source"] == "sample set: Table in memory"
    with pytest.raises(TypeError, match=r"expected a path, a pyarrow Table, a datasets.Dataset .* got list"):
        build_table([1, 2], "mv")


CONTEXTS_JSON = {"contexts": [
    {"name": "careful", "objective_weights": [0.8, 0.2], "cost_weight": -0.5, "probability": 0.25},
    {"name": "thrifty", "objective_weights": [0.3, 0.7], "cost_weight": -2.0, "probability": 0.75},
]}
CONTEXTS_TOML = """
[[contexts]]
name = "careful"
objective_weights = [0.8, 0.2]
cost_weight = -0.5
probability = 0.25

[[contexts]]
name = "thrifty"
objective_weights = [0.3, 0.7]
cost_weight = -2.0
probability = 0.75
"""


def test_contexts_file_for_every_route(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ctx.json").write_text(json.dumps(CONTEXTS_JSON))
    (tmp_path / "ctx.toml").write_text(CONTEXTS_TOML)
    from_json, from_toml = load_contexts(tmp_path / "ctx.json"), load_contexts(tmp_path / "ctx.toml")
    np.testing.assert_array_equal(from_json.weights, [[0.8, 0.2, -0.5], [0.3, 0.7, -2.0]])
    np.testing.assert_array_equal(from_json.weights, from_toml.weights)
    assert from_json.names == ("careful", "thrifty") and from_json.probs.tolist() == [0.25, 0.75]
    long = exploded(published(seed=8))
    path = parquet(long, tmp_path / "scored.parquet")
    out = tmp_path / "t.h5"
    assert main(["data", "build", str(path), "--aggregator", "bon", "--prompt-col", "model", "--query-col", "problem",
                 "--score-col", "rm_a", "--score-col", "rm_b", "--contexts", str(tmp_path / "ctx.toml"),
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{out}: objectives: rm_a, rm_b\n" in err
    assert f"{out}: cost: column 'tokens': mean per completion of each prompt" in err
    assert f"{out}: counted: 3 prompts, 10 queries, {len(long['model'])} samples\n" in err
    assert (f"{out}: contexts: 2 contexts over 2 objectives, cost weights 0.5, 2, not uniform: the contexts file "
            "ctx.toml") in err
    table = read_table(out)
    np.testing.assert_array_equal(table.context_weights, from_toml.weights)
    assert table.context_names == ("careful", "thrifty") and table.context_probs.tolist() == [0.25, 0.75]
    assert main(["data", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "contexts    2: 2 contexts over 2 objectives" in shown and "careful" in shown and "thrifty" in shown
    assert "\ncost_source column 'tokens': mean per completion of each prompt" in shown
    assert "\ncolumns     one row per sample; prompt 'model', query 'problem', scores 'rm_a', 'rm_b'" in shown
    # majority vote weighs one objective: a two-weight context set is refused, naming both counts
    assert main(["data", "build", str(path), "--aggregator", "mv", "--prompt-col", "model", "--query-col", "problem",
                 "--contexts", str(tmp_path / "ctx.json")]) == 1
    assert "ctx.json: its contexts weigh 2 objective(s), the table has 1: ['correct']" in capsys.readouterr().err
    mv_ctx = {"contexts": [{"name": "all", "objective_weights": [1.0], "cost_weight": -0.3, "probability": 1.0}]}
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"prompt": m, "query": q, "answer": a, "gold": g, "tokens": t}) + "\n"
                           for m, q, a, g, t in zip(long["model"], long["problem"], long["answer"], long["gold"],
                                                    long["tokens"], strict=True)))
    built = build_table(log, "mv", contexts=mv_ctx)
    assert built.context_names == ("all",) and built.attrs["contexts_source"].endswith("the contexts file contexts")


@pytest.mark.parametrize(("doc", "message"), [
    ({"contexts": []}, r"'contexts' is empty"),
    ({"context": []}, r"expected one key 'contexts'"),
    ({"contexts": [{"name": "a", "objective_weights": [1], "cost_weight": -1, "probability": 0.6}]},
     r"the context probabilities sum to 0.6, expected 1"),
    ({"contexts": [{"name": "a", "objective_weights": [1], "cost_weight": 0.5, "probability": 1}]},
     r"contexts\[0\].cost_weight must be a finite number <= 0"),
    ({"contexts": [{"name": "a", "objective_weights": [1], "cost_weight": -1}]},
     r"contexts\[0\]: expected exactly the fields .*; missing \['probability'\]"),
    ({"contexts": [{"name": "a", "objective_weights": [1, 0], "cost_weight": -1, "probability": 0.5},
                   {"name": "b", "objective_weights": [1], "cost_weight": -1, "probability": 0.5}]},
     r"contexts\[1\].objective_weights has 1 weights, contexts\[0\] has 2"),
    ({"contexts": [{"name": "a", "objective_weights": [1], "cost_weight": -1, "probability": 0.5},
                   {"name": "a", "objective_weights": [1], "cost_weight": -1, "probability": 0.5}]},
     r"contexts\[1\].name repeats context name 'a'"),
    ({"contexts": [{"name": "a", "objective_weights": ["x"], "cost_weight": -1, "probability": 1}]},
     r"contexts\[0\].objective_weights must be a non-empty list of finite numbers"),
])
def test_bad_contexts_files_are_refused(tmp_path: Path, doc: dict, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(LogFormatError, match=r"bad.json: " + message):
        load_contexts(path)


def test_documented_contexts_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/data.md's contexts file and command, as written."""
    import re
    import shlex

    text = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text(encoding="utf-8")
    toml = re.search(r"```toml\n# my-contexts.toml\n(.*?)```", text, re.S)
    command = re.search(r"```\n(iapo-gym data build rated\.parquet [^\n]*--contexts my-contexts\.toml[^\n]*)\n```", text)
    assert toml and command
    (tmp_path / "my-contexts.toml").write_text(toml.group(1))
    long = exploded(published(seed=9))
    parquet({"prompt": long["model"], "query": long["problem"], "helpfulness_rm": long["rm_a"],
             "harmlessness_rm": long["rm_b"], "completion_tokens": long["tokens"]}, tmp_path / "rated.parquet")
    monkeypatch.chdir(tmp_path)
    args = shlex.split(command.group(1))
    assert main(args[1:]) == 0
    table = read_table(tmp_path / "rated.h5")
    assert table.attrs["contexts_source"].endswith("the contexts file my-contexts.toml")
    assert abs(table.context_probs.sum() - 1.0) < 1e-12


def test_long_builds_report_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Past PROGRESS_AFTER seconds a build reports the samples counted (plain lines when not on a terminal),
    over every pass (quantile bins read the samples three times)."""
    from iapo_gym.data import build as build_module

    monkeypatch.setattr(build_module, "PROGRESS_AFTER", 0.0)
    long = exploded(published(seed=10))
    path = parquet(long, tmp_path / "s.parquet")
    n = len(long["model"])
    build_columns_table(path, "bon", BuildOptions(quantile_bins=3),
                        ColumnMap(prompt="model", query="problem", scores=("rm_a", "rm_b")), batch_rows=n // 4 + 1)
    err = capsys.readouterr().err
    assert f"/{3 * n} samples]" in err and f"[{3 * n}/{3 * n} samples]" in err


def test_documented_list_column_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/data.md's list-column command and Python example, as written."""
    import re
    import shlex

    text = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text(encoding="utf-8")
    command = re.search(r"```\n(iapo-gym data build repeated\.parquet [^\n]*)\n```", text)
    code = re.search(r"```python\n(import datasets\n.*?)```", text, re.S)
    assert command and code
    rows = published(seed=11)
    parquet({"model": rows["model"], "problem_id": rows["problem"], "is_corrects": rows["is_corrects"],
             "num_tokens": rows["tokens"]}, tmp_path / "repeated.parquet")
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(command.group(1))[1:]) == 0
    table = read_table(tmp_path / "repeated.h5")
    i = rows["model"].index("model-0")
    p, q = table.prompts.index("model-0"), table.queries.index(rows["problem"][i])
    assert table.probs[p, q, 0] == np.mean(rows["is_corrects"][i])
    pytest.importorskip("datasets", reason="the Hugging Face datasets package is not installed")
    scope: dict = {}
    exec(compile(code.group(1), "docs/data.md", "exec"), scope)  # noqa: S102
    np.testing.assert_array_equal(scope["table"].probs[:, 0, :2], [[2 / 3, 1 / 3], [1.0, 0.0]])


def test_free_text_answers_are_compared_by_digest_like_the_log_reader(tmp_path: Path) -> None:
    """Text answers are trimmed (Python's whitespace) and digested from the Arrow buffers; empty means no answer:
    the same table as the completion-log reader, which digests Python strings."""
    from iapo_gym.data.build import ANSWER_DIGEST_BYTES, SampleAccumulator, answer_digests

    variants = ["  The answer is 7.\n", "The answer is 7.", "\u3000The answer is 7.\x85", "", "   ", None,
                "The answer is 8.", "the answer is 7.", "Die Antwort ist 7 — sicher."]
    rng = np.random.default_rng(12)
    rows: dict[str, list] = {"prompt": [], "query": [], "answer": [], "gold": [], "tokens": []}
    for p in range(2):
        for q in range(6):
            for _ in range(7):
                rows["prompt"].append(f"p{p}")
                rows["query"].append(f"q{q}")
                rows["answer"].append(variants[int(rng.integers(len(variants)))])
                rows["gold"].append("The answer is 7.")
                rows["tokens"].append(int(rng.integers(5, 50)))
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(dict(zip(rows, v, strict=True))) + "\n" for v in zip(*rows.values(), strict=True)))
    reference = build_table(log, "mv", top_k=3, test_fraction=0.0)
    columnar = build_table(parquet(rows, tmp_path / "s.parquet"), "mv", top_k=3, test_fraction=0.0, batch_rows=10)
    same_table(reference, columnar)
    counts = np.zeros((2, 6))  # independent: how many answers of each pair are the gold one after str.strip()
    for p, q, a in zip(rows["prompt"], rows["query"], rows["answer"], strict=True):
        counts[int(p[1]), int(q[1])] += a is not None and a.strip() == "The answer is 7."
    gold = columnar.probs[:, np.arange(6), columnar.gold]  # (prompts, queries)
    np.testing.assert_allclose(gold, counts / 7, rtol=1e-15)
    acc = SampleAccumulator("mv")
    assert answer_digests(["x"]).dtype.itemsize == ANSWER_DIGEST_BYTES
    acc.answers.map((["a" * 10_000, "b"], np.array([0, 1, 0])), row0=0)
    assert acc.answers.nbytes == 2 * (ANSWER_DIGEST_BYTES + 16)  # what is kept does not grow with the text


def test_the_memory_guard_counts_the_answers_digests(tmp_path: Path) -> None:
    """Distinct free-text answers are what a majority-vote build keeps besides its keys: the guard counts them."""
    from iapo_gym.data.build import SampleAccumulator
    from iapo_gym.data.columns import column_batches

    rows = {"prompt": ["p"] * 400, "query": [f"q{i % 4}" for i in range(400)],
            "answer": [f"a long, distinct free-text answer number {i} " * 20 for i in range(400)],
            "gold": ["a long, distinct free-text answer number 0 " * 20] * 400}
    path = parquet(rows, tmp_path / "free.parquet")
    acc = SampleAccumulator("mv", max_bytes=20_000)
    with pytest.raises(LogFormatError, match=r"free.parquet: row \d+: the distinct \(prompt, query, outcome\) counts so "
                                             r"far take \d+ bytes, more than the limit of 20000 \(counted: the keys "
                                             r"\d+, the answers' digests [1-9]\d+, the sample-index cells 0\)"):
        for batch, names in column_batches(path, "mv", batch_rows=50):
            acc.add(batch, names)
    assert len(acc.answers) <= 400 and acc.answers.nbytes == 32 * len(acc.answers)  # 16 + 8 + 8, never the text


def test_a_sample_column_of_global_row_ids_is_refused_before_it_takes_memory(tmp_path: Path) -> None:
    from iapo_gym.data.build import SampleAccumulator
    from iapo_gym.data.columns import column_batches

    rows = {"prompt": ["p"] * 40, "query": [f"q{i % 4}" for i in range(40)], "sample": [i * 50_000 for i in range(40)],
            "correct": [i % 3 == 0 for i in range(40)]}
    path = parquet(rows, tmp_path / "ids.parquet")
    acc = SampleAccumulator("mv", max_bytes=1 << 20)
    with pytest.raises(LogFormatError, match=r"ids.parquet: row \d+: sample index \d+ would need \d+ bytes of "
                                             r"sample-index cells for prompt 'p' alone, more than the limit of 1048576"):
        for batch, names in column_batches(path, "mv", ColumnMap(correct="correct"), batch_rows=8):
            acc.add(batch, names)
    assert acc.sample_bytes <= 1 << 20
    table = build_columns_table(path, "mv", BuildOptions(top_k=1, test_fraction=0.0),
                                ColumnMap(correct="correct", sample=""))
    assert table.attrs["completions"] == 40 and "sample" not in table.attrs["columns"].split(";")[1]
