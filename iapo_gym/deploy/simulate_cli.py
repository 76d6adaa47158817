"""``iapo-gym simulate TABLE``: an outcome table as an OpenAI-compatible upstream (``iapo_gym.deploy.simulate``,
docs/simulate.md); the server's modules are imported when the command runs."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def cmd_simulate(args: argparse.Namespace) -> int:
    """Write the spec (``--write-spec``) or serve the table until interrupted; exit 1 naming what cannot be used."""
    from iapo_gym.deploy.cli import is_loopback
    from iapo_gym.deploy.limits import ServeLimits
    from iapo_gym.deploy.simulate import (
        SimulateApp,
        SimulateError,
        Simulator,
        in_memory_spec,
        load_simulated_table,
        schedule_of,
        write_spec,
    )
    from iapo_gym.llm.spec import SpecError, load_spec
    from iapo_gym.online.schedule import ScheduleError
    from iapo_gym.tables import TableError

    try:
        table = load_simulated_table(args.table)
        options = {"api": args.api, "extractor": args.extractor, "model": args.model}
        if args.write_spec:
            spec_path, queries = write_spec(args.write_spec, table, host=args.host, port=args.port, **options)
            print(f"iapo-gym simulate: wrote {spec_path} and {queries}", file=sys.stderr)
            return 0
        if not is_loopback(args.host) and not args.api_key_env and not args.insecure_no_key:
            raise SimulateError(f"--host {args.host} listens beyond this machine: set --api-key-env VAR (callers "
                                "then send 'Authorization: Bearer $VAR'), or pass --insecure-no-key")
        api_key = None
        if args.api_key_env:
            api_key = os.environ.get(args.api_key_env)
            if not api_key:
                raise SimulateError(f"--api-key-env names the variable {args.api_key_env!r}, which is not set or empty")
        spec = load_spec(args.spec) if args.spec else in_memory_spec(table, args.host, args.port, **options)
        schedule = schedule_of(args.schedule, args.horizon, table)
        sim = Simulator(table, spec, schedule=schedule, seed=args.seed, split=args.split)
        limits = ServeLimits(max_body_bytes=args.max_body_bytes, max_header_bytes=args.max_header_bytes,
                             header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                             keep_alive_timeout=args.keep_alive_timeout, max_connections=args.max_connections,
                             allowed_hosts=tuple(args.allowed_host or ()))
        app = SimulateApp(sim, limits=limits, api_key=api_key, host=args.host)
    except (SimulateError, SpecError, ScheduleError, TableError, FileNotFoundError, ValueError) as exc:
        print(f"iapo-gym simulate: error: {exc}", file=sys.stderr)
        return 1
    from iapo_gym.deploy.server import run_server

    n_p, n_q, n_m = table.shape
    note = ""
    if schedule is not None:
        cuts = ", ".join(f"{g.start} (weight {g.weight:.3g})" if schedule.kind == "drift" else str(g.start)
                         for g in schedule.segments[1:])
        note = f"; schedule {schedule.kind} over {schedule.horizon} requests, segments from request {cuts or 'none'}"
    print(f"iapo-gym simulate: table {table.task!r} ({n_p} prompts x {n_q} queries x {n_m} outcomes, "
          f"{table.aggregator}) as model {sim.model!r} on http://{args.host}:{args.port}/v1{note}", file=sys.stderr,
          flush=True)
    run_server(app, host=args.host, port=args.port, limits=limits, graceful_timeout=args.graceful_timeout,  # type: ignore[arg-type]
               parser=args.http)
    return 0


def add_commands(subparsers: Any) -> None:
    """Add the ``simulate`` command to the ``iapo-gym`` parser."""
    from iapo_gym.deploy.limits import ServeLimits

    d = ServeLimits()
    p = subparsers.add_parser(
        "simulate", help="serve an outcome table as an OpenAI-compatible upstream",
        description="Answer /v1/completions and /v1/chat/completions with completions drawn from an outcome table "
                    "(n, seed, usage honoured), with a reward endpoint for Best-of-N; --write-spec writes the "
                    "collection spec that collect, optimize and serve use to call it (docs/simulate.md).")
    p.add_argument("table", help="an .h5 table, generated:FAMILY:LEVEL or a task name")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080); also the port the written spec names")
    p.add_argument("--write-spec", metavar="SPEC.json",
                   help="write the simulator's collection spec (and SPEC.queries.jsonl beside it) and exit")
    p.add_argument("--spec", help="serve the mapping of this spec (one written by --write-spec, possibly edited) "
                   "instead of the one --write-spec would write")
    p.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="the API of the written spec's prompts (default completions)")
    p.add_argument("--extractor", choices=("last_number", "boxed", "choice", "regex"), default="last_number",
                   help="majority vote: the written spec's answer extractor (default last_number)")
    p.add_argument("--model", help="the model name (default iapo-sim/<task>)")
    p.add_argument("--schedule", choices=("stationary", "drift", "arrival", "context_shift"),
                   help="apply the table's online schedule by request count (docs/online.md; drift needs a generated "
                        "level; context_shift is refused)")
    p.add_argument("--horizon", type=int, help="the schedule's horizon T in requests")
    p.add_argument("--seed", type=int, default=0, help="root seed of the draws (default 0)")
    p.add_argument("--split", choices=("all", "train", "test"), default="all",
                   help="the queries a query text the spec does not list goes to, by its SHA-256 (default all)")
    p.add_argument("--api-key-env", help="environment variable holding the key callers must send")
    p.add_argument("--insecure-no-key", action="store_true", help="listen beyond loopback without --api-key-env")
    p.add_argument("--allowed-host", action="append", metavar="NAME[:PORT]",
                   help="a Host header to answer besides the bound address and localhost's names (repeatable)")
    p.add_argument("--http", choices=("auto", "httptools", "h11"), default="auto", help="the HTTP parser (as serve)")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"larger request bodies get 413 (default {d.max_body_bytes})")
    p.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes,
                   help=f"larger request heads get 431 (default {d.max_header_bytes})")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help=f"seconds for a request's head; 408 after (default {d.header_timeout:g})")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help=f"seconds for a request's body; 408 after (default {d.body_timeout:g})")
    p.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout,
                   help=f"seconds an idle connection stays open (default {d.keep_alive_timeout:g})")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help=f"open connections; past it the oldest idle one is closed (default {d.max_connections})")
    p.add_argument("--graceful-timeout", type=float, default=5.0,
                   help="seconds requests in flight may take to finish after SIGTERM (default 5)")
    p.set_defaults(func=cmd_simulate)
