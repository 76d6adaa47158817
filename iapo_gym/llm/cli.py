"""``iapo-gym collect SPEC [--out DIR]``: collect a table from an OpenAI-compatible endpoint (docs/collect.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def cmd_collect(args: argparse.Namespace) -> int:
    """Run (or resume) a collection; exit 0 when the table is written, 1 on a reported failure."""
    from iapo_gym.data.build import LogFormatError
    from iapo_gym.llm.client import EndpointError
    from iapo_gym.llm.collect import collect
    from iapo_gym.llm.spec import SpecError, load_spec

    try:
        spec = load_spec(args.spec)
        out = args.out or spec.task
        result = collect(spec, out, progress=not args.quiet)
    except (SpecError, EndpointError, LogFormatError, ImportError, ValueError) as exc:
        print(f"iapo-gym collect: error: {exc}", file=sys.stderr)
        return 1
    cost = result.tokens * spec.budget.price_per_1k_tokens / 1000.0
    print(f"{result.total}/{result.expected} completions in {result.log} ({result.new} new, {result.cached} from the "
          f"cache); {result.requests} requests, {result.retries} retries, {result.tokens} completion tokens"
          + (f", cost {cost:.4f}" if spec.budget.price_per_1k_tokens else ""))
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
    p = subparsers.add_parser("collect", help="collect a table from an OpenAI-compatible LLM endpoint",
                              description="Sample N_max completions per (prompt, query) from the spec's endpoint, "
                                          "log them (docs/log-format.md) and build the table. Running it again on "
                                          "the same --out folder resumes. OPENAI_BASE_URL and OPENAI_API_KEY "
                                          "override the spec's endpoint and key.")
    p.add_argument("spec", help="collection spec, .toml or .json (docs/collect.md)")
    p.add_argument("--out", help="output folder for the log, the table and the response cache (default: ./TASK)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_collect)
