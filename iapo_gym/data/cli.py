"""The ``iapo-gym data`` commands: list, fetch, import, show, build.

Exit codes: 0 success, 1 a failure the command reports on stderr (``error: ...``), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from iapo_gym.tables import TableError


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _errors() -> tuple[type[BaseException], ...]:
    from iapo_gym.data import MissingTableError
    from iapo_gym.data.build import LogFormatError
    from iapo_gym.data.download import DownloadError
    from iapo_gym.data.registry import RegistryError
    from iapo_gym.data.release import ReleaseError

    return (DownloadError, RegistryError, ReleaseError, LogFormatError, MissingTableError, TableError, OSError, ValueError)


def _guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except _errors() as exc:
            return _fail(str(exc))

    return run


def cmd_list(args: argparse.Namespace) -> int:
    """Print every known table: source, present or absent, size, verified."""
    from iapo_gym.data import local_status
    from iapo_gym.data.registry import entries

    rows = [local_status(e) for e in entries()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'NAME':<28} {'TABLE':<8} {'RELEASE FILE':<14} {'SIZE':>10}  WHERE / SOURCE")
    for r in rows:
        table = "present" if r["table"] and r["table_ok"] else ("BROKEN" if r["table"] else "absent")
        release = ("verified" if r["release_verified"] else "MISMATCH") if r["release"] else "absent"
        size = r["release_size"]
        print(f"{r['name']:<28} {table:<8} {release:<14} {size if size is not None else '?':>10}  "
              f"{r['table'] or r['release'] or r['source']}")
        if r["table"] or r["release"]:
            print(f"{'':<64}source: {r['source']}")
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    """Download (if needed), verify and convert the named tables into the cache."""
    from iapo_gym.data import ensure_table
    from iapo_gym.data.registry import entries, get_entry

    if args.all == bool(args.tasks):
        print("error: give TASK names or --all (not both)", file=sys.stderr)
        return 2
    chosen = list(entries()) if args.all else [get_entry(t) for t in args.tasks]
    failed = 0
    for entry in chosen:
        try:
            path = ensure_table(entry, force=args.force)
        except _errors() as exc:
            failed += 1
            _fail(f"{entry.name}: {exc}")
            continue
        print(f"{entry.name}: {path}")
    return 1 if failed else 0


def cmd_import(args: argparse.Namespace) -> int:
    """Convert a release file to HDF5 tables (safe unpickling), in --dest or the cache."""
    from iapo_gym.data.registry import entry_for_file
    from iapo_gym.data.release import import_release
    from iapo_gym.tables import read_metadata

    path = Path(args.file)
    if not path.is_file():
        return _fail(f"no such release file: {path}")
    out = import_release(path, task=args.task, dest=args.dest, paper_contexts=args.paper_contexts)
    meta = read_metadata(out[0])
    entry = entry_for_file(path)
    for p in out:
        print(p)
        # stdout stays one path per line for scripts; which contexts each table has goes to stderr
        print(f"{p}: contexts: {read_metadata(p).get('contexts_source', 'not recorded')}", file=sys.stderr)
    if entry is not None and not meta.get("verified"):
        print(f"warning: {path} does not match the registry's hashes for the official {entry.file}; "
              "imported anyway, marked unverified", file=sys.stderr)
    return 0


def _load_for_show(name: str) -> Any:
    from iapo_gym.data import load_task_table
    from iapo_gym.tables import check_table_file, read_table

    if Path(name).suffix == ".h5" or Path(name).is_file():
        check_table_file(name)  # a file given by path may come from anyone: a corrupt one must not hang us
        return read_table(name)
    return load_task_table(name)


def cmd_check(args: argparse.Namespace) -> int:
    """Read each table file in a child process, so a corrupt file cannot hang or crash this one."""
    from iapo_gym.tables import TableError, check_table_file, read_metadata

    bad = 0
    for file in args.files:
        try:
            check_table_file(file, timeout=args.timeout)
        except TableError as exc:
            print(f"NOT A VALID TABLE: {exc}")
            bad += 1
            continue
        meta = read_metadata(file)
        print(f"ok: {file}: task {meta['task']!r}, {meta['n_prompts']} prompts, {meta['n_queries']} queries, "
              f"N_max {meta['n_max']}")
    return 1 if bad else 0


def cmd_show(args: argparse.Namespace) -> int:
    """Print a table's shape, contexts and its exact optimal policy and ACR per split."""
    from iapo_gym.data.summary import format_summary, oracle_summary, table_summary

    table = _load_for_show(args.task)
    oracle = oracle_summary(table)
    if args.json:
        print(json.dumps({"table": table_summary(table), "oracle": oracle}, indent=2, default=str))
    else:
        print(format_summary(table, oracle))
    return 0


def _source_format(args: argparse.Namespace) -> str:
    """``log``, ``columns`` or ``lm-eval``: as given, else by the source (``iapo_gym.data.columns.source_format``)."""
    from iapo_gym.data.columns import source_format

    return source_format(args.source, args.format)


def build_report(table: Any, out: Path) -> list[str]:
    """What a build used, for its stderr: the objectives, the cost, what was counted, the contexts."""
    attrs = table.attrs
    lines = [f"{out}: objectives: {', '.join(table.objective_names)}"
             + (" (majority vote: correct = the most-voted answer is the gold one)" if table.aggregator == "mv" else "")]
    if "columns" in attrs:
        lines.append(f"{out}: columns: {attrs['columns']}")
    lines.append(f"{out}: cost: {attrs.get('cost_source', 'not recorded')}")
    lines.append(f"{out}: counted: {table.n_prompts} prompts, {table.n_queries} queries, {attrs['completions']} samples")
    lines.append(f"{out}: contexts: {attrs['contexts_source']}")
    return lines


def cmd_build(args: argparse.Namespace) -> int:
    """Build a table from samples (a completion log, a columnar sample set or an lm-eval run) and write it as HDF5."""
    from iapo_gym.data.build import BuildOptions, build_log_table, load_contexts
    from iapo_gym.data.servelog import is_serve_log
    from iapo_gym.tables import write_table

    fmt = "serve-log" if args.format == "serve-log" or (args.format == "auto" and is_serve_log(args.source)) else \
        _source_format(args)
    if args.gold and fmt != "serve-log":
        raise ValueError("--gold gives the gold answers of a serve outcome log's queries; this source is not one")
    aggregator = args.aggregator or ("mv" if fmt == "lm-eval" else None)
    if aggregator is None:
        print("error: give --aggregator mv or bon", file=sys.stderr)
        return 2
    if fmt == "lm-eval" and aggregator != "mv":
        raise ValueError("an lm-eval run gives answers and gold answers: build it with --aggregator mv")
    top_k = args.top_k if args.top_k is not None else (1 if args.correct_col else 4)
    options = BuildOptions(task=args.task, n_max=args.n_max, cost_scale=args.cost_scale,
                           test_fraction=args.test_fraction, seed=args.seed, top_k=top_k,
                           grid=None if args.no_grid else args.grid, quantile_bins=args.quantile_bins,
                           contexts=load_contexts(args.contexts) if args.contexts else None)
    if fmt == "serve-log":
        from iapo_gym.data.servelog import build_serve_log_table

        table = build_serve_log_table(args.source, aggregator, options, gold_file=args.gold, batch_rows=args.batch_rows)
    elif fmt == "lm-eval":
        from iapo_gym.data.lmeval import build_lm_eval_table

        table = build_lm_eval_table(args.source, options, tasks=args.lm_eval_task, filter_name=args.lm_eval_filter,
                                    answers=args.lm_eval_answers, batch_rows=args.batch_rows)
    elif fmt == "columns":
        from iapo_gym.data.columns import ColumnMap, build_columns_table

        mapping = ColumnMap(prompt=args.prompt_col, query=args.query_col, sample=args.sample_col,
                            answer=args.answer_col, gold=args.gold_col, correct=args.correct_col,
                            scores=tuple(args.score_col or ()), tokens=args.tokens_col, split=args.split_col,
                            objectives=tuple(args.objective or ()))
        table = build_columns_table(args.source, aggregator, options, mapping, batch_rows=args.batch_rows)
    else:
        table = build_log_table(args.source, aggregator, options, batch_rows=args.batch_rows)
    out = Path(args.out) if args.out else Path(f"{table.task}.h5")
    write_table(table, out)
    print(f"{out}: {table.n_prompts} prompts x {table.n_queries} queries x {table.n_atoms} atoms ({table.aggregator}), "
          f"{table.attrs['completions']} completions")
    for line in build_report(table, out):
        print(line, file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Write levels of a generated family as ordinary table files DIR/FAMILY-LEVEL.h5."""
    from iapo_gym.tables import write_table
    from iapo_gym.tasks.generated import get_family, level_table, parse_levels

    family = get_family(args.family).name
    levels = parse_levels(args.levels)
    out = Path(args.out)
    for level in levels:
        table = level_table(family, level)
        path = write_table(table, out / f"{family}-{level}.h5", exact=not args.no_exact)
        print(f"{path}: {table.n_prompts} prompts x {table.n_queries} queries x {table.n_atoms} atoms, "
              f"N_max {table.n_max} ({table.aggregator})")
    return 0


def add_commands(subparsers: Any) -> None:
    """Add the ``data`` command group to the ``iapo-gym`` parser."""
    data = subparsers.add_parser("data", help="list, fetch, import, show and build outcome tables",
                                 description="Outcome tables of the data-backed tasks.")
    sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    data.set_defaults(func=lambda args: (data.print_help(), 2)[1])

    p = sub.add_parser("list", help="known tables: source, present/absent, size, verified")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_guarded(cmd_list))

    p = sub.add_parser("fetch", help="download, verify and convert official tables into the cache")
    p.add_argument("tasks", nargs="*", metavar="TASK", help="table or task names (see `iapo-gym data list`)")
    p.add_argument("--all", action="store_true", help="every known table")
    p.add_argument("--force", action="store_true", help="convert again (and download again unless the file verifies)")
    p.set_defaults(func=_guarded(cmd_fetch))

    p = sub.add_parser("import", help="convert a release file (.pkl) to HDF5 tables, safely")
    p.add_argument("file", help="release file, e.g. MATH_final.pkl")
    p.add_argument("--task", help="table name (default: from the official file name)")
    p.add_argument("--dest", help="output folder (default: the user cache)")
    p.add_argument("--paper-contexts", action="store_true",
                   help="where a record's stored contexts are absent or unreadable, give its table the paper's "
                        "context set (said in the output) instead of refusing it")
    p.set_defaults(func=_guarded(cmd_import))

    p = sub.add_parser("show", help="a table's shape, contexts and exact optimal policy per split")
    p.add_argument("task", help="task name or path of an .h5 table")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_guarded(cmd_show))

    p = sub.add_parser("check", help="read table files in a child process (safe for files from others)")
    p.add_argument("files", nargs="+", help=".h5 table files")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a file may take to read (default 60)")
    p.set_defaults(func=_guarded(cmd_check))

    p = sub.add_parser("generate", help="write levels of a generated task family as .h5 tables (docs/tasks.md)",
                       description="Levels 0-9999 are for tuning, levels 1000000-1999999 are held out.")
    p.add_argument("family", help="family name (iapo_gym.tasks.generated.families())")
    p.add_argument("--levels", required=True, help="A, A:B or A-B (both ends included), e.g. 0:9")
    p.add_argument("--out", required=True, help="output folder; files are FAMILY-LEVEL.h5")
    p.add_argument("--no-exact", action="store_true", help="do not store the exact expectations (smaller files)")
    p.set_defaults(func=_guarded(cmd_generate))

    p = sub.add_parser("build", help="build a table from samples: a completion log, a columnar sample set "
                                     "(Parquet, Arrow, CSV, JSON lines) or an lm-eval --log_samples run",
                       description="Build a table from samples (docs/log-format.md, docs/data.md).")
    p.add_argument("source", help="completion log (.jsonl), sample set (.parquet, .arrow, .csv, ...), a folder or "
                                  "quoted glob of Parquet shards, or lm-eval output folder / results_<date>.json")
    p.add_argument("--format", choices=("auto", "log", "columns", "lm-eval", "serve-log"), default="auto",
                   help="how to read SOURCE (default auto: a folder with results_*.json, or results_*.json, is "
                        "lm-eval; a folder of .parquet files or a glob: Parquet shards; .jsonl/.json a completion "
                        "log; .parquet/.arrow/.feather/.csv/.tsv a sample set; a folder with outcomes.sqlite: the "
                        "outcome log of serve --log)")
    p.add_argument("--gold", metavar="FILE", help="serve outcome log, mv: the gold answers of queries no feedback "
                   "true named, as JSON Lines {\"query\": ..., \"gold\": ...}")
    p.add_argument("--aggregator", choices=("mv", "bon"), help="majority vote or Best-of-N (lm-eval: mv)")
    p.add_argument("--task", help="table name (default: the source's file stem)")
    p.add_argument("--out", help="output .h5 path (default: ./<task>.h5)")
    p.add_argument("--top-k", type=int, help="mv: answers kept per query besides 'other' (default 4; 1 with --correct-col)")
    p.add_argument("--grid", type=float, default=0.5, help="bon: bin objective scores to this spacing (default 0.5)")
    p.add_argument("--no-grid", action="store_true", help="bon: keep exact objective vectors")
    p.add_argument("--quantile-bins", type=int, metavar="B",
                   help="bon: B bins per objective at its score quantiles, instead of the grid")
    p.add_argument("--n-max", type=int, default=32, help="largest N (default 32)")
    p.add_argument("--cost-scale", type=float, default=0.01,
                   help="cost of the prompt with the most tokens per completion (default 0.01)")
    p.add_argument("--test-fraction", type=float, default=0.2,
                   help="share of queries in the stored test split when the samples give none (default 0.2; 0: no split)")
    p.add_argument("--seed", type=int, default=0, help="seed of that split (default 0)")
    p.add_argument("--batch-rows", type=int, default=65536,
                   help="samples counted per batch (default 65536; one row per sample: rows)")
    p.add_argument("--contexts", metavar="FILE",
                   help="the table's contexts from a JSON or TOML file {\"contexts\": [{\"name\", "
                        "\"objective_weights\", \"cost_weight\", \"probability\"}, ...]} (default: the paper's)")
    cols = p.add_argument_group("sample-set columns (--format columns)")
    for role, default in (("prompt", "prompt"), ("query", "query"), ("sample", "sample"), ("answer", "answer"),
                          ("gold", "gold"), ("tokens", "tokens"), ("split", "split")):
        optional = " ('' for none)" if role in ("sample", "tokens", "split") else ""
        cols.add_argument(f"--{role}-col", default=default, metavar="NAME",
                          help=f"column of the {role} (default {default!r}{optional})")
    cols.add_argument("--correct-col", metavar="NAME", help="mv: a true/false column of per-sample correctness, "
                                                            "instead of answer and gold")
    cols.add_argument("--score-col", action="append", metavar="NAME",
                      help="bon: a score column, one objective each (repeat; default: the columns named "
                           "score_<objective>; none is taken by its type)")
    cols.add_argument("--objective", action="append", metavar="NAME",
                      help="bon: the objectives' names, in order, of one --score-col holding a list of score lists "
                           "per row (repeat; default COLUMN[0], COLUMN[1], ...)")
    lm = p.add_argument_group("lm-eval runs (--format lm-eval)")
    lm.add_argument("--lm-eval-answers", choices=("filtered", "raw"), default="filtered",
                    help="each completion's answer: the task filter's per-sample answer (default) or the raw response")
    lm.add_argument("--lm-eval-filter", metavar="NAME", help="the filter whose answers to use (a task logging several)")
    lm.add_argument("--lm-eval-task", action="append", metavar="TASK", help="a task to use (repeat; default: all logged)")
    p.set_defaults(func=_guarded(cmd_build))
