"""``iapo-gym serve POLICY --upstream SPEC``: a policy file as an OpenAI-compatible endpoint (docs/deploy.md)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; exit 1 when the policy, the spec or the key cannot be used."""
    from iapo_gym.deploy.router import Router
    from iapo_gym.llm.spec import SpecError
    from iapo_gym.policyfile import PolicyFileError

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            print(f"iapo-gym serve: error: --api-key-env names the variable {args.api_key_env!r}, which is not set "
                  "or empty", file=sys.stderr)
            return 1
    try:
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"iapo-gym serve: error: {exc}; install the server with pip install \"iapo-gym[serve]\"", file=sys.stderr)
        return 1
    from iapo_gym.deploy.limits import RateBudget, ServeLimits, parse_rate
    from iapo_gym.deploy.server import create_app, serve

    try:
        router = Router(args.policy, args.upstream, seed=args.seed, early_stop=not args.no_early_stop)
        limits = ServeLimits(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                             deadline=args.deadline, max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                             upstream_retries=args.upstream_retries, cors_origins=tuple(args.cors_origin or ()))
        budget = RateBudget([parse_rate(r) for r in args.rate or ()], router.spec.budget.price_per_1k_tokens)
        create_app(router, limits=limits, budget=budget)  # checks the budget against the policy's largest request
    except (PolicyFileError, SpecError, ValueError) as exc:
        print(f"iapo-gym serve: error: {exc}", file=sys.stderr)
        return 1

    stream: Any
    if args.access_log == "-":
        stream = sys.stdout
    elif args.access_log:
        stream = open(args.access_log, "a", encoding="utf-8")  # noqa: SIM115 (open for the server's lifetime)
    else:
        stream = None
    try:
        serve(router, host=args.host, port=args.port, api_key=api_key, access_log=stream,
              graceful_timeout=args.graceful_timeout, limits=limits, budget=budget)
    finally:
        if stream is not None and stream is not sys.stdout:
            stream.close()
    return 0


def add_commands(subparsers: Any) -> None:
    """Add the ``serve`` command to the ``iapo-gym`` parser."""
    from iapo_gym.deploy.limits import ServeLimits as ServeLimitsDefaults

    p = subparsers.add_parser(
        "serve", help="serve a policy file as an OpenAI-compatible endpoint",
        description="Apply a learned policy per request: the context's prompt around the caller's content, N "
                    "completions from the upstream, aggregated (majority vote or Best-of-N) as the tables do. "
                    "Endpoints /v1/chat/completions, /v1/completions, /v1/models, /health (docs/deploy.md).")
    p.add_argument("policy", help="policy file written by iapo-gym optimize (DIR/policy.json)")
    p.add_argument("--upstream", required=True, help="collection spec naming the upstream endpoint, model, sampling "
                   "and retries; its key goes only to its own host, as in collect (docs/collect.md); its [budget] "
                   "caps a collection and does not apply here (see --rate)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key-env", help="environment variable holding the key callers must send "
                   "(Authorization: Bearer ...); without it, no key is asked")
    p.add_argument("--access-log", help="file to append JSON-lines access records to ('-': stdout)")
    p.add_argument("--seed", type=int, default=0, help="root seed of the majority-vote tie breaks (default 0)")
    p.add_argument("--no-early-stop", action="store_true",
                   help="draw all N completions of a majority vote in one wave (default: stop once the vote is decided, "
                        "the same answer from fewer completions)")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds to let requests in flight finish after SIGTERM/SIGINT (default 30)")
    d = ServeLimitsDefaults()
    p.add_argument("--rate", action="append", metavar="UNIT/WINDOW=LIMIT",
                   help="the serving budget, repeatable: requests/minute=600, tokens/day=2e6 (upstream completion "
                        "tokens), cost/day=5 (with the spec's budget.price_per_1k_tokens); 429 with Retry-After past "
                        "it (default: none)")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"larger request bodies get 413 (default {d.max_body_bytes})")
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help=f"longer rendered prompts get 400 (default {d.max_prompt_chars})")
    p.add_argument("--deadline", type=float, default=d.deadline,
                   help=f"seconds one request may take in all, N completions and retries included; 504 after "
                        f"(default {d.deadline:g})")
    p.add_argument("--max-concurrency", type=int, default=d.max_concurrency,
                   help=f"requests answered at once, each with its own N upstream calls (default {d.max_concurrency})")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help=f"requests waiting for a slot; more get 503 with Retry-After (default {d.max_queue})")
    p.add_argument("--upstream-retries", type=int, default=d.upstream_retries,
                   help=f"retries of one failed or timed-out upstream call, at most the spec's endpoint.max_retries "
                        f"(default {d.upstream_retries})")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="let browser pages of ORIGIN call the server (repeatable; '*' for any); default: no CORS")
    p.set_defaults(func=cmd_serve)
