"""``iapo-gym collect SPEC [--out DIR] [--dry-run]``: collect a table from an OpenAI-compatible endpoint (docs/collect.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

#: Exit status when an endpoint stopped answering (refused or dropped connections, timeouts) and the
#: run stopped early: everything received is kept, and the same command resumes.
EXIT_UNREACHABLE = 3


def dry_run(spec: Any, out: str) -> None:
    """Print what a run would contact and send, without sending anything: hosts and key variable NAMES."""
    from pathlib import Path

    print(f"iapo-gym collect --dry-run: {spec.path}; nothing is sent")
    for endpoint, route in zip(spec.endpoints, spec.llm_routes(), strict=True):
        price = (f"; {endpoint.input_price_per_million:g} input, {endpoint.output_price_per_million:g} output "
                 f"{spec.currency} per million tokens" if endpoint.priced else "")
        print(f"  {route.describe()}; model {endpoint.model!r}{price}")
    reward = spec.reward_route()
    if reward is not None:
        print(f"  {reward.describe()}")
    total = len(spec.prompts) * len(spec.queries) * spec.n_max
    log = Path(out) / f"{spec.task}.jsonl"
    done = log.read_bytes().count(b"\n") if log.exists() else 0  # read only: a dry run changes nothing
    arms = (f"{len(spec.endpoints)} endpoints x {len(spec.templates)} prompts = {len(spec.prompts)} arms"
            if len(spec.endpoints) > 1 else f"{len(spec.prompts)} prompts")
    print(f"  {arms} x {len(spec.queries)} queries x N_max {spec.n_max} = {total} completions, "
          f"{done} already in {log}")


def cmd_collect(args: argparse.Namespace) -> int:
    """Run (or resume) a collection; exit 0 when the table is written, 1 on a reported failure, 3 if unreachable."""
    from iapo_gym.data.build import LogFormatError
    from iapo_gym.llm.client import EndpointError
    from iapo_gym.llm.collect import collect
    from iapo_gym.llm.spec import SpecError, load_spec

    try:
        spec = load_spec(args.spec)
        out = args.out or spec.task
        if args.dry_run:
            dry_run(spec, out)
            return 0
        contexts = None
        if args.contexts:
            from iapo_gym.data.build import load_contexts

            contexts = load_contexts(args.contexts)
        result = collect(spec, out, progress=not args.quiet, contexts=contexts)
    except (SpecError, EndpointError, LogFormatError, ImportError, ValueError) as exc:
        print(f"iapo-gym collect: error: {exc}", file=sys.stderr)
        return 1
    cost = result.tokens * spec.budget.price_per_1k_tokens / 1000.0
    print(f"{result.total}/{result.expected} completions in {result.log} ({result.new} new, {result.cached} from the "
          f"cache); {result.requests} requests, {result.retries} retries, {result.tokens} completion tokens"
          + (f", cost {cost:.4f}" if spec.budget.price_per_1k_tokens else "")
          + (f", {result.prompt_tokens} prompt tokens, spent {result.spend:.6f} {spec.currency}"
             if result.spend is not None else "")
          + (f"; reward endpoint: {result.reward_requests} requests, {result.reward_retries} retries"
             if result.reward_requests else ""))
    if result.unreachable:
        print(f"iapo-gym collect: stopped: {result.unreachable}. {result.total} of {result.expected} completions are "
              f"kept in {result.log}; run the same command again to resume once the endpoint answers",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    if result.budget_exhausted:
        print(f"iapo-gym collect: stopped: {result.budget_exhausted}; raise the cap and run the same command "
              "again to resume", file=sys.stderr)
        return 1
    if result.table is None:
        print("iapo-gym collect: the log is incomplete; run the same command again to resume", file=sys.stderr)
        return 1
    print(f"table written: {result.table}")
    return 0


def add_commands(subparsers: Any) -> None:
    """Add the ``collect`` command to the ``iapo-gym`` parser."""
    p = subparsers.add_parser("collect", help="collect a table from OpenAI-compatible LLM endpoints",
                              description="Sample N_max completions per (prompt, query) from the spec's endpoint "
                                          "(per (endpoint, prompt) arm and query when it names several), "
                                          "log them (docs/log-format.md) and build the table. Running it again on "
                                          "the same --out folder resumes. OPENAI_BASE_URL overrides the spec's "
                                          "endpoint; which key goes where is in docs/collect.md ('What is sent "
                                          "where'), and --dry-run prints it. Exit status: 0 table written, 1 error "
                                          "or stopped by the spending cap, 3 an endpoint is unreachable (the same "
                                          "command resumes).")
    p.add_argument("spec", help="collection spec, .toml or .json (docs/collect.md)")
    p.add_argument("--out", help="output folder for the log, the table and the response cache (default: ./TASK)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--contexts", metavar="FILE",
                   help="the table's contexts, a JSON or TOML file as data build --contexts takes (docs/data.md); "
                        "default: the spec's [[contexts]], else the paper's")
    p.add_argument("--dry-run", action="store_true",
                   help="send nothing: print every host that would be contacted and the NAME of the key variable "
                        "it would get (never the value), and how many completions are left")
    p.set_defaults(func=cmd_collect)
