"""Benchmark: 1,000,000-sample Parquet sample sets built into tables, peak memory and time against the stated bound.

The script writes a seeded sample set (8 prompts x 5,000 queries x 25 samples: prompt, query, sample,
answer, gold, is_correct, two reward scores, tokens) in row groups, the same samples with free-text
answers (90 % distinct texts of 160 characters, the rest the gold answer's text) and the same samples
in the published list shape (one row per (prompt, query): list columns of answers, correctness,
tokens and per-sample [rm_1, rm_2] score lists), then builds each in a child process per build (so
each peak RSS is that build's own, Linux's VmHWM): majority vote on the answers, on per-sample
correctness, on the free-text answers and on the list of answers, Best-of-N on the two scores on the
0.5 grid, in 8 quantile bins and from the list of score lists, and the grid build with batches of
8,192 and of 262,144 rows. A baseline child runs every build once on 10,000-sample sets (the
interpreter and libraries loaded and warmed up); a reference child reads the whole file into memory
with ``pyarrow.parquet.read_table``. Each build's peak RSS above the baseline is compared with the
bound of ``docs/data.md``:

    BATCH_BYTES_PER_ROW x batch_rows + 64 x (key columns + 1) x distinct keys + 64 x distinct answers
        + 24 x P x Q x M x (K + 1) + 4 x P x Q x S

(one batch and its derived arrays; the distinct (prompt, query, outcome) counts, with room for a merge;
the answers' digests, codes and first rows, with room for an insert; the dense table and its
intermediates; the sample-index cells, S the largest index + 1). Then the grid build on 0.4, 1 and 4
million rows of the same prompts and queries: its peak stays flat while reading the file whole grows
with it. Medians of ``--repeats`` runs.
Run: ``nice -n 10 python benchmarks/bench_build.py`` (``--rows 100000`` for a quick look).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Bytes one row of a batch may cost while it is read and counted (arrow columns, codes, keys, sort copies).
BATCH_BYTES_PER_ROW = 1024
#: Bytes per key column (+ 1 for the count) of each distinct (prompt, query, outcome) key: the counts, their
#: merge (concatenation, sort order, sorted copies) and the finished table's per-key intermediates.
BYTES_PER_KEY_COLUMN = 64

#: name: (aggregator, column mapping, build options, sample set: "long" one row per sample, "free" the same
#: with free-text answers, "lists" one row per (prompt, query) with list columns)
BUILDS = {
    "mv answers": ("mv", {}, {}, "long"),
    "mv is_correct": ("mv", {"correct": "is_correct"}, {"top_k": 1}, "long"),
    "bon grid 0.5": ("bon", {"scores": ("rm_1", "rm_2")}, {}, "long"),
    "bon 8 quantile bins": ("bon", {"scores": ("rm_1", "rm_2")}, {"quantile_bins": 8}, "long"),
    "mv free-text answers (90% distinct)": ("mv", {}, {}, "free"),
    "mv list columns (answers)": ("mv", {"answer": "answers"}, {}, "lists"),
    "bon list of score lists, grid 0.5": ("bon", {"scores": ("rewards",)}, {}, "lists"),
}
#: Characters of a free-text answer (a short completion), the kind of answer that is nearly always distinct.
FREE_TEXT_CHARS = 160


def write_sample_set(path: Path, rows: int, n_prompts: int = 8, per_pair: int = 25, seed: int = 0,
                     shape: str = "long") -> tuple[int, int, int]:
    """A seeded sample set of ``rows`` samples in row groups of 50,000 samples (bounded memory); returns
    (P, Q, samples per pair). ``shape`` "free": 90 % of the answers are distinct free text (the rest the
    gold answer's text); "lists": the same samples one row per (prompt, query), answers, correctness,
    tokens and per-sample [rm_1, rm_2] score lists in list columns."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    n_queries = rows // (n_prompts * per_pair)
    rng = np.random.default_rng(seed)
    accuracy = rng.uniform(0.3, 0.8, n_prompts)
    length = rng.uniform(100, 600, n_prompts)
    difficulty = rng.normal(0, 1, n_queries)
    group = 50_000
    pairs_per_group = group // per_pair
    writer = None
    for start in range(0, n_prompts * n_queries, pairs_per_group):
        pair = np.arange(start, min(start + pairs_per_group, n_prompts * n_queries))
        p, q = np.repeat(pair // n_queries, per_pair), np.repeat(pair % n_queries, per_pair)
        n = p.size
        correct = rng.random(n) < accuracy[p] / (1 + np.exp(difficulty[q] - 0.5))
        wrong = rng.integers(1, 9, n)
        answer = np.where(correct, q % 97, (q % 97 + wrong) % 97)
        columns = {
            "prompt": pa.array([f"prompt-{i}" for i in range(n_prompts)]).take(pa.array(p)),
            "query": pa.array(np.char.add("q", q.astype(str))),
            "sample": np.tile(np.arange(per_pair), pair.size),
            "answer": answer, "gold": q % 97, "is_correct": correct,
            "rm_1": rng.normal(0.3 * accuracy[p] - 0.2 * difficulty[q], 0.5),
            "rm_2": rng.normal(-0.1 * p / n_prompts, 0.4),
            "tokens": np.maximum(1, rng.normal(length[p], 50)).astype(np.int64),
        }
        if shape == "free":  # raw completions: the gold answer's text for 10 %, otherwise a distinct text
            distinct = rng.random(n) < 0.9
            noise = pc.binary_join_element_wise(
                pa.array(np.char.add("The answer, after some reasoning, is ", rng.integers(0, 2**62, n).astype(str))),
                pa.array(["x" * (FREE_TEXT_CHARS - 60)] * n), ". ")
            gold_text = pa.array(np.char.add("The answer is ", (q % 97).astype(str)))
            columns["answer"] = pc.if_else(pa.array(distinct), noise, gold_text)
            columns["gold"] = gold_text
        if shape == "lists":
            offsets = pa.array(np.arange(0, n + 1, per_pair, dtype=np.int32))
            keep = np.arange(0, n, per_pair)

            def listed(values: object, offsets: object = offsets) -> object:
                return pa.ListArray.from_arrays(offsets, pa.array(values))

            columns = {
                "prompt": columns["prompt"].take(pa.array(keep)), "query": columns["query"].take(pa.array(keep)),
                "gold": (q % 97)[keep], "answers": listed(answer), "is_corrects": listed(correct),
                "tokens": listed(columns["tokens"]),
                "rewards": pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(
                    pa.array(np.column_stack([columns["rm_1"], columns["rm_2"]]).reshape(-1)), 2)),
            }
        batch = pa.table(columns)
        if writer is None:
            writer = pq.ParquetWriter(path, batch.schema)
        writer.write_table(batch, row_group_size=group if shape != "lists" else group // per_pair)
    assert writer is not None
    writer.close()
    return n_prompts, n_queries, per_pair


def child(mode: str, path: str, build: str, batch_rows: int) -> dict[str, object]:
    """One measured run in this (child) process: the figures as a JSON-friendly dict."""
    import pyarrow.parquet as pq

    from iapo_gym.data.build import BuildOptions
    from iapo_gym.data.columns import ColumnMap, build_columns_table

    start = time.perf_counter()
    out: dict[str, object] = {}
    if mode == "baseline":  # every build once on small sets: the libraries loaded and warmed up
        for aggregator, mapping, options, shape in BUILDS.values():
            small = Path(path) / f"small-{shape}.parquet"
            build_columns_table(small, aggregator, BuildOptions(**options), ColumnMap(**mapping))  # type: ignore[arg-type]
        out["rows"] = pq.ParquetFile(Path(path) / "small-long.parquet").metadata.num_rows
    elif mode == "read_table":
        out["rows"] = pq.read_table(path).num_rows
    else:
        aggregator, mapping, options, _ = BUILDS[build]
        table = build_columns_table(path, aggregator, BuildOptions(**options), ColumnMap(**mapping),  # type: ignore[arg-type]
                                    batch_rows=batch_rows)
        out.update(shape=list(table.probs.shape), k=table.n_objectives, aggregator=table.aggregator,
                   nonzero_atoms=int(np.count_nonzero(table.probs)), completions=table.attrs["completions"])
    out["seconds"] = time.perf_counter() - start
    out["peak_rss"] = peak_rss()
    return out


def peak_rss() -> int:
    """This process's peak resident set in bytes: Linux's VmHWM (the high-water mark of this program's own
    memory; ``ru_maxrss`` would also count the parent's, which Linux carries across fork and exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(mode: str, path: Path, build: str = "", batch_rows: int = 65536, repeats: int = 1) -> dict[str, object]:
    """Median seconds and peak RSS of ``repeats`` child runs."""
    runs = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, __file__, "--child", mode, str(path), build, str(batch_rows)],
                              capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    result = dict(runs[-1])
    result["seconds"] = statistics.median(float(r["seconds"]) for r in runs)
    result["peak_rss"] = statistics.median(int(r["peak_rss"]) for r in runs)
    return result


def distinct_keys(path: Path, build: str, result: dict[str, object]) -> tuple[int, int]:
    """The distinct (prompt, query, outcome) keys a build counts and its distinct answers: Best-of-N, its atoms
    of positive probability (no answers); majority vote, its distinct (prompt, query, answer) triples and
    answers (counted here from the file)."""
    if build.startswith("bon"):
        return int(result["nonzero_atoms"]), 0  # type: ignore[call-overload]
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    column = "is_correct" if "is_correct" in build else ("answers" if "list" in build else "answer")
    t = pq.read_table(path, columns=["prompt", "query", column])
    codes = [t[c].combine_chunks().dictionary_encode().indices.to_numpy().astype(np.int64) for c in ("prompt", "query")]
    outcome = t[column].combine_chunks()
    if "list" in build:
        parent = pc.list_parent_indices(outcome).to_numpy()
        codes = [c[parent] for c in codes]
        outcome = pc.list_flatten(outcome)
    outcome = outcome.dictionary_encode().indices.to_numpy().astype(np.int64)
    return int(np.unique(np.column_stack([codes[0], codes[1], outcome]), axis=0).shape[0]), int(outcome.max()) + 1


def bound(result: dict[str, object], keys: int, answers: int, batch_rows: int, samples: int) -> int:
    """The documented bound on a build's peak RSS above the baseline, for its table (``samples``: S, the largest
    sample index + 1)."""
    p, q, m = result["shape"]  # type: ignore[misc]
    k = int(result["k"])  # type: ignore[call-overload]
    mv = result["aggregator"] == "mv"
    key_cols, per_atom = (3, 1) if mv else (2 + k, k + 1)
    return (BATCH_BYTES_PER_ROW * batch_rows + BYTES_PER_KEY_COLUMN * (key_cols + 1) * keys + 64 * answers
            + 24 * p * q * m * per_atom + 4 * p * q * samples)


def main() -> None:
    """Write the sample set, run every build, print the table of figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scaling", type=int, nargs="*", default=[10, 25, 100],
                        help="samples per pair of the rows-scaling runs (default 10 25 100: 0.4M, 1M, 4M rows)")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "PATH", "BUILD", "BATCH_ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, path, build, batch_rows = args.child
        print(json.dumps(child(mode, path, build, int(batch_rows))))
        return
    with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
        path = Path(tmp) / "samples.parquet"
        t0 = time.perf_counter()
        n_p, n_q, per_pair = write_sample_set(path, args.rows)
        print(f"sample set: {n_p * n_q * per_pair:,} rows ({n_p} prompts x {n_q} queries x {per_pair} samples), "
              f"{path.stat().st_size / 2**20:.1f} MiB Parquet, written in {time.perf_counter() - t0:.1f} s")
        files = {"long": path}
        for shape in ("free", "lists"):
            files[shape] = Path(tmp) / f"samples-{shape}.parquet"
            write_sample_set(files[shape], args.rows, shape=shape)
        for shape in ("long", "free", "lists"):
            write_sample_set(Path(tmp) / f"small-{shape}.parquet", 10_000, shape=shape)
        base = measure("baseline", Path(tmp), repeats=args.repeats)
        whole = measure("read_table", path, repeats=args.repeats)
        mib = 2**20
        print(f"baseline (imports, every build once on 10,000 samples): peak RSS {base['peak_rss'] / mib:.0f} MiB")
        print(f"reading the whole file into memory (pyarrow.parquet.read_table): peak RSS "
              f"{whole['peak_rss'] / mib:.0f} MiB, +{(whole['peak_rss'] - base['peak_rss']) / mib:.0f} MiB over baseline")
        print()
        print(f"{'build':<36} {'batch rows':>10} {'table P x Q x M':>18} {'time s':>7} {'peak MiB':>9} "
              f"{'above base':>10} {'bound':>8}  under")
        runs = [(name, 65536) for name in BUILDS] + [("bon grid 0.5", 8192), ("bon grid 0.5", 262144)]
        for name, batch_rows in runs:
            source = files[BUILDS[name][3]]
            r = measure("build", source, name, batch_rows, repeats=args.repeats)
            above = int(r["peak_rss"]) - int(base["peak_rss"])  # type: ignore[call-overload]
            limit = bound(r, *distinct_keys(source, name, r), batch_rows, per_pair)
            shape = " x ".join(str(x) for x in r["shape"])  # type: ignore[attr-defined]
            print(f"{name:<36} {batch_rows:>10,} {shape:>18} {float(r['seconds']):>7.2f} "  # type: ignore[arg-type]
                  f"{int(r['peak_rss']) / mib:>9.0f} {above / mib:>10.0f} {limit / mib:>8.0f}  "  # type: ignore[call-overload]
                  f"{'yes' if above <= limit else 'NO'}")
            assert r["completions"] == n_p * n_q * per_pair
        print()
        print("rows scaling: the same 8 prompts x 5,000 queries, more samples per pair (bon grid 0.5, batches of 65,536)")
        print(f"{'samples per pair':>16} {'rows':>10} {'table P x Q x M':>18} {'time s':>7} {'peak MiB':>9} "
              f"{'above base':>10} {'read_table above base':>22}")
        for samples in args.scaling:
            scaled = Path(tmp) / f"samples-{samples}.parquet"
            write_sample_set(scaled, n_p * n_q * samples, per_pair=samples)
            r = measure("build", scaled, "bon grid 0.5", 65536, repeats=args.repeats)
            whole = measure("read_table", scaled, repeats=1)
            shape = " x ".join(str(x) for x in r["shape"])  # type: ignore[attr-defined]
            print(f"{samples:>16} {n_p * n_q * samples:>10,} {shape:>18} {float(r['seconds']):>7.2f} "  # type: ignore[arg-type]
                  f"{int(r['peak_rss']) / mib:>9.0f} {(int(r['peak_rss']) - int(base['peak_rss'])) / mib:>10.0f} "  # type: ignore[call-overload]
                  f"{(int(whole['peak_rss']) - int(base['peak_rss'])) / mib:>22.0f}")  # type: ignore[call-overload]
            scaled.unlink()


if __name__ == "__main__":
    main()
