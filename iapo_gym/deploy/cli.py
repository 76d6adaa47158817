"""``iapo-gym serve POLICY --upstream SPEC``: a policy file as an OpenAI-compatible endpoint (docs/deploy.md)."""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import math
import os
import sys
from typing import Any


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; exit 1 when the policy, the spec, the key or an option cannot be used.

    The app is built by ``build_app`` once per process: here (the only process, or a check before the
    workers start), and with ``--workers K`` in each of the K worker processes from the arguments in
    ``WORKER_ARGS_ENV`` (no secret is in them: a worker reads the inbound key from ``--api-key-env``).
    """
    from iapo_gym.llm.spec import SpecError
    from iapo_gym.policyfile import PolicyFileError

    try:
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"iapo-gym serve: error: {exc}; install the server with pip install \"iapo-gym[serve]\"", file=sys.stderr)
        return 1
    from iapo_gym.deploy.connections import protocol
    from iapo_gym.deploy.server import run_server
    from iapo_gym.deploy.swap import ignore_hangup

    ignore_hangup()  # until the server listens for it (a policy swap): a SIGHUP while starting does not stop it
    try:
        if args.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {args.workers}")
        if getattr(args, "log", None) and args.workers > 1:
            raise ValueError("--log keeps one outcome log per process and folder: serve with --workers 1, or run "
                             "one serve per log folder")
        if getattr(args, "learn", False) and args.workers > 1:
            raise ValueError("--learn keeps its estimates and exploration budget in one process: serve with "
                             "--workers 1")
        _check_exposure(args)
        app = build_app(args, access_log=args.workers == 1)
        protocol(app.limits, args.http)  # the parser asked for is installed
    except (PolicyFileError, SpecError, ValueError) as exc:
        print(f"iapo-gym serve: error: {exc}", file=sys.stderr)
        return 1
    router = app.router
    print(f"iapo-gym serve: {len(router.contexts)} contexts of task {router.policy.task!r} on "
          f"http://{args.host}:{args.port}/v1 ({args.workers} process{'es' if args.workers > 1 else ''}; upstream "
          f"model{'s' if len(router.spec.endpoints) > 1 else ''} "
          f"{', '.join(repr(e.model) for e in router.spec.endpoints)})", file=sys.stderr, flush=True)
    stream = app.access.stream
    try:
        if args.workers == 1:
            run_server(app, host=args.host, port=args.port, limits=app.limits, graceful_timeout=args.graceful_timeout,
                       parser=args.http)
        else:
            os.environ[WORKER_ARGS_ENV] = json.dumps({k: v for k, v in vars(args).items() if k != "func"}, default=str)
            run_server(WORKER_APP, host=args.host, port=args.port, limits=app.limits,
                       graceful_timeout=args.graceful_timeout, workers=args.workers, parser=args.http)
    finally:
        if stream is not None and stream is not sys.stdout:
            stream.close()
    return 0


#: The environment variable carrying the parsed arguments (JSON, no secret) to ``--workers`` processes.
WORKER_ARGS_ENV = "IAPO_GYM_SERVE_ARGS"
#: uvicorn's import string of the app factory each worker process calls.
WORKER_APP = "iapo_gym.deploy.cli:worker_app"


def worker_app() -> Any:
    """The app of one ``--workers`` process: ``build_app`` of the arguments in ``WORKER_ARGS_ENV``. SIGHUP is ignored
    until the app listens for it (a policy swap, ``iapo_gym.deploy.swap``): a worker still starting reads the file."""
    from iapo_gym.deploy.swap import ignore_hangup

    ignore_hangup()
    return build_app(argparse.Namespace(**json.loads(os.environ[WORKER_ARGS_ENV])))


def build_app(args: argparse.Namespace, *, access_log: bool = True) -> Any:
    """The ``ServeApp`` of ``serve``'s parsed arguments: the router, the limits, the serving budget, the inbound
    key (read from the variable ``--api-key-env`` names) and, with ``access_log``, the access log opened for
    appending. Raises ValueError (or the policy's or spec's own error) naming what cannot be used."""
    from iapo_gym.deploy.limits import budget_from_args
    from iapo_gym.deploy.router import Router
    from iapo_gym.deploy.server import create_app

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise ValueError(f"--api-key-env names the variable {args.api_key_env!r}, which is not set or empty")
    admin_key = admin_key_from_args(args, api_key)
    router = Router(args.policy, args.upstream, seed=args.seed, early_stop=not args.no_early_stop,
                    bon_wave=args.bon_wave, rules=caller_rules(args))
    limits = limits_from_args(args)
    budget = budget_from_args(args, router)
    stream: Any = None
    if access_log and args.access_log == "-":
        stream = sys.stdout
    elif access_log and args.access_log:
        stream = open(args.access_log, "a", encoding="utf-8")  # noqa: SIM115 (open for the server's lifetime)
    learner, shadow = learner_from_args(args, router)  # before the log opens: the learner resumes from it
    outcomes = outcome_log_from_args(args, router)
    # create_app checks the budget against the policy's largest request
    app = create_app(router, api_key=api_key, access_log=stream, limits=limits, budget=budget, host=args.host,
                     outcomes=outcomes, log_queries=bool(getattr(args, "log_queries", False)), learner=learner,
                     shadow=shadow)
    from iapo_gym.deploy.swap import install

    install(app, args.policy, admin_key=admin_key, workers=args.workers)  # SIGHUP and POST /admin/policy
    return app


def admin_key_from_args(args: argparse.Namespace, api_key: str | None) -> str | None:
    """The admin key of ``POST /admin/policy``, read from the variable ``--admin-key-env`` names (None without it);
    ValueError when it is unset, empty or the inbound key (a caller must not be able to swap the policy)."""
    name = getattr(args, "admin_key_env", None)
    if not name:
        return None
    key = os.environ.get(name)
    if not key:
        raise ValueError(f"--admin-key-env names the variable {name!r}, which is not set or empty")
    if api_key is not None and hmac.compare_digest(key.encode(), api_key.encode()):
        raise ValueError(f"--admin-key-env names a variable ({name!r}) holding the inbound key of --api-key-env: the "
                         "admin key must differ (a caller must not be able to swap the policy)")
    return key


def learner_from_args(args: argparse.Namespace, router: Any) -> tuple[Any, Any]:
    """The ``ServeLearner`` of ``--learn`` (None without it; with ``--log``, resumed from the rows the log already
    holds) and the ``Shadow`` of ``--shadow`` (None without it); ValueError naming what cannot be used."""
    from iapo_gym.deploy.learn import ServeLearner, Shadow

    learn = bool(getattr(args, "learn", False))
    if not learn:
        for option, given in (("--explore-share", args.explore_share is not None),
                              ("--learn-reward", args.learn_reward is not None),
                              ("--learn-prior", args.learn_prior is not None),
                              ("--learn-half-life", args.learn_half_life is not None),
                              ("--learn-bonus", args.learn_bonus is not None),
                              ("--learn-spread", args.learn_spread is not None)):
            if given:
                raise ValueError(f"{option} needs --learn (the learner it configures)")
    if getattr(args, "shadow", None) and not args.log:
        raise ValueError("--shadow needs --log DIR (the candidate's arm is logged beside the served one)")
    shadow = Shadow(args.shadow, router.policy) if getattr(args, "shadow", None) else None
    if not learn:
        return None, shadow
    from iapo_gym.deploy.learn import (
        BUDGET_FILE,
        DEFAULT_BONUS,
        DEFAULT_EXPLORE_SHARE,
        DEFAULT_HALF_LIFE,
        DEFAULT_PRIOR_WEIGHT,
        DEFAULT_SPREAD,
    )

    reward = args.learn_reward or "agreement"
    if reward == "feedback" and not args.log:
        raise ValueError("--learn-reward feedback needs --log DIR (POST /v1/feedback joins rewards to its rows)")
    learner = ServeLearner(router.policy, seed=args.seed, reward=reward,
                           explore_share=DEFAULT_EXPLORE_SHARE if args.explore_share is None else args.explore_share,
                           prior_weight=DEFAULT_PRIOR_WEIGHT if args.learn_prior is None else args.learn_prior,
                           half_life=DEFAULT_HALF_LIFE if args.learn_half_life is None else args.learn_half_life,
                           bonus=DEFAULT_BONUS if args.learn_bonus is None else args.learn_bonus,
                           spread=DEFAULT_SPREAD if args.learn_spread is None else args.learn_spread,
                           extra_prompts=getattr(router, "new_prompts", ()),
                           budget_file=os.path.join(args.log, BUDGET_FILE) if args.log else None)
    if args.log:
        from iapo_gym.outcome_log import LogError, read_log

        try:
            _, rows = read_log(args.log)
        except LogError:  # no log yet: nothing to resume from but the budget file's reservation
            learner.resume([])
            return learner, shadow
        used = learner.resume(rows)
        print(f"iapo-gym serve: --learn resumed from {used} logged requests ({learner.explored} of "
              f"{learner.chosen} explored)", file=sys.stderr, flush=True)
    return learner, shadow


def outcome_log_from_args(args: argparse.Namespace, router: Any) -> Any:
    """The ``OutcomeLog`` of ``--log DIR`` and its ``--log-*`` options (None without ``--log``); ValueError (a
    ``LogError``) naming what cannot be used."""
    if not getattr(args, "log", None):
        if getattr(args, "log_queries", False):
            raise ValueError("--log-queries needs --log DIR (the outcome log the queries go to)")
        return None
    from iapo_gym.outcome_log import OutcomeLog

    policy = router.policy
    meta = {"aggregator": policy.aggregator, "objectives": list(policy.objectives), "task": policy.task,
            "policy": str(args.policy), "queries": bool(args.log_queries),
            "contexts": [c.to_dict() for c in policy.contexts]}
    return OutcomeLog(args.log, meta, flush_ms=args.log_flush_ms, batch=args.log_batch,
                      max_bytes=args.log_max_bytes, keep=args.log_keep)


def limits_from_args(args: argparse.Namespace) -> Any:
    """The ``ServeLimits`` of ``serve``'s parsed arguments (ValueError naming a bad value)."""
    from iapo_gym.deploy.limits import ServeLimits

    return ServeLimits(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                       deadline=args.deadline, max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                       upstream_retries=args.upstream_retries, cors_origins=tuple(args.cors_origin or ()),
                       allowed_hosts=tuple(args.allowed_host or ()), max_header_bytes=args.max_header_bytes,
                       header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                       keep_alive_timeout=args.keep_alive_timeout, max_connections=args.max_connections,
                       stall_after=args.stall_after)


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost may resolve anywhere
        return False


def _check_exposure(args: argparse.Namespace) -> None:
    """Refuse to listen beyond loopback without an inbound key, unless ``--insecure-no-key`` (then warn)."""
    if is_loopback(args.host) or args.api_key_env:
        return
    if not args.insecure_no_key:
        raise ValueError(f"--host {args.host} listens beyond this machine, and without --api-key-env anyone who "
                         "reaches it spends the upstream's tokens: set --api-key-env VAR (callers then send "
                         "'Authorization: Bearer $VAR'), or pass --insecure-no-key to serve without a key")
    print(f"iapo-gym serve: warning: listening on {args.host} without an inbound key (--insecure-no-key): anyone "
          "who reaches this address can spend the upstream's tokens", file=sys.stderr, flush=True)


def caller_rules(args: argparse.Namespace) -> Any:
    """The ``CallerRules`` of ``--system-message``, ``--history`` and ``--accept`` (ValueError naming a bad one)."""
    from iapo_gym.deploy.params import CallerRules, parse_accept

    return CallerRules(system_message=args.system_message, history=args.history,
                       accept=tuple(parse_accept(a) for a in args.accept or ()))


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
                   "(Authorization: Bearer ...); without it, no key is asked (and --host must be a loopback address, "
                   "unless --insecure-no-key)")
    p.add_argument("--admin-key-env", help="environment variable holding the admin key of POST /admin/policy, which "
                   "re-reads the policy file and swaps it in as SIGHUP does (docs/deploy.md, 'Swapping the policy'); "
                   "it must differ from the inbound key; without it the route does not exist")
    p.add_argument("--insecure-no-key", action="store_true",
                   help="listen beyond loopback (--host 0.0.0.0 or another address) without --api-key-env: anyone "
                        "who reaches the address can spend tokens (a warning is printed)")
    p.add_argument("--allowed-host", action="append", metavar="NAME[:PORT]",
                   help="a Host header to answer besides the bound address and localhost, 127.0.0.1, [::1] (any "
                        "port); repeatable; others get 421 (docs/deploy.md, 'Hosts and keys')")
    p.add_argument("--http", choices=("auto", "httptools", "h11"), default="auto",
                   help="the HTTP parser: httptools (faster; the serve extra installs it), h11, or auto (httptools "
                        "when installed); the connection limits are the same with either (default auto)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes serving the one port (default 1); each has the limits below, and all share the "
                        "serving budget through --budget-store")
    p.add_argument("--access-log", help="file to append JSON-lines access records to ('-': stdout)")
    p.add_argument("--seed", type=int, default=0, help="root seed of the majority-vote tie breaks (default 0)")
    from iapo_gym.deploy.learn import (
        DEFAULT_BONUS,
        DEFAULT_EXPLORE_SHARE,
        DEFAULT_HALF_LIFE,
        DEFAULT_PRIOR_WEIGHT,
        DEFAULT_SPREAD,
    )
    from iapo_gym.outcome_log import DEFAULT_BATCH, DEFAULT_FLUSH_MS, DEFAULT_KEEP, DEFAULT_MAX_BYTES

    p.add_argument("--log", metavar="DIR", help="keep an outcome log of every answered request in DIR (SQLite; its "
                   "context, arm, propensity, outcomes, tokens, cost, response id; feedback joins it through POST "
                   "/v1/feedback; read by iapo-gym data build and iapo-gym evaluate-log). No keys; no query text "
                   "without --log-queries")
    p.add_argument("--log-queries", action="store_true", help="also log each request's query text (default: not)")
    p.add_argument("--log-flush-ms", type=float, default=DEFAULT_FLUSH_MS,
                   help=f"a logged row is committed (fsynced) at most this many ms after its answer: a kill -9 loses "
                        f"at most the rows of that time (default {DEFAULT_FLUSH_MS})")
    p.add_argument("--log-batch", type=int, default=DEFAULT_BATCH,
                   help=f"rows per commit at most (default {DEFAULT_BATCH})")
    p.add_argument("--log-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help=f"the current log file is rotated past this size (default {DEFAULT_MAX_BYTES})")
    p.add_argument("--log-keep", type=int, default=DEFAULT_KEEP,
                   help=f"rotated log files kept; older ones are deleted, and feedback for their ids gets 410 "
                        f"(default {DEFAULT_KEEP})")
    p.add_argument("--learn", action="store_true",
                   help="learn each context's arm (prompt, N) from the traffic: per-arm utility estimates warm-started "
                        "from the policy file's arm_estimates, updated as outcomes arrive (Best-of-N: the scores; "
                        "majority vote: see --learn-reward), the best one served, others explored within "
                        "--explore-share; with --log it resumes from the log (docs/deploy.md, 'Learning while "
                        "serving'); --workers 1 only")
    p.add_argument("--explore-share", type=float, metavar="SHARE",
                   help="with --learn, the share of requests that may be served another arm than the best estimated "
                        f"one, never exceeded over the requests served (default {DEFAULT_EXPLORE_SHARE:g})")
    p.add_argument("--learn-reward", choices=("agreement", "feedback"),
                   help="with --learn, what a majority vote learns from: agreement (the share of the completions "
                        "drawn that voted for the winner, at once; the default) or feedback (the reward of POST "
                        "/v1/feedback, when it arrives; needs --log)")
    p.add_argument("--learn-prior", type=float, metavar="W",
                   help=f"with --learn, observations the policy file's estimate of an arm counts as "
                        f"(default {DEFAULT_PRIOR_WEIGHT:g}; 0 ignores the file's estimates)")
    p.add_argument("--learn-half-life", type=float, metavar="REQUESTS",
                   help="with --learn, requests after which earlier evidence counts half, so that outcomes from before "
                        f"a drift fade (default {DEFAULT_HALF_LIFE:g}; inf never forgets)")
    p.add_argument("--learn-bonus", type=float, metavar="B",
                   help="with --learn, the exploration bound's width: an arm is explored while its estimate plus B "
                        "standard deviations / sqrt(its observations) is above the served arm's estimate "
                        f"(default {DEFAULT_BONUS:g})")
    p.add_argument("--learn-spread", type=float, metavar="SHARE",
                   help="with --learn, the share of the explored requests served an arm drawn uniformly from all "
                        "candidate arms instead of the most promising one, so that evaluate-log can judge any "
                        f"candidate on the log (default {DEFAULT_SPREAD:g}; 0: the most promising arm only)")
    p.add_argument("--shadow", metavar="CANDIDATE.json",
                   help="a candidate policy file: each request is logged (--log) with the arm the candidate would "
                        "have served, which is not served")
    p.add_argument("--no-early-stop", action="store_true",
                   help="draw all N completions of a majority vote in one wave (default: stop once the vote is decided, "
                        "the same answer from fewer completions); a context's stopping rule still applies")
    p.add_argument("--bon-wave", type=int, default=1, metavar="K",
                   help="completions per wave of a Best-of-N context whose stopping rule is a threshold: 1 stops at "
                        "the first completion that reaches its tau; K > 1 takes fewer round trips and may draw up to "
                        "K - 1 more (default 1)")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds to let requests in flight finish after SIGTERM/SIGINT (default 30)")
    d = ServeLimitsDefaults()
    p.add_argument("--rate", action="append", metavar="UNIT/WINDOW=LIMIT",
                   help="the serving budget, repeatable: UNIT requests (callers' and, separately, upstream HTTP "
                        "attempts), tokens (upstream prompt + completion) or cost (money at the spec's endpoint "
                        "prices); WINDOW minute, hour, day (sliding) or total; e.g. requests/minute=600, "
                        "tokens/day=2e6, cost/day=5. Shared by every process on --budget-store and kept across "
                        "restarts; 429 past it (default: none)")
    p.add_argument("--budget-store", metavar="URL",
                   help="where the serving budget's spend is kept: sqlite:///ABSOLUTE/PATH or a file path (processes "
                        "on one machine), redis://HOST:PORT/DB (processes on several machines); default "
                        "sqlite:///<the policy file's folder>/budget.sqlite")
    p.add_argument("--budget-name", metavar="NAME",
                   help="the deployment's key in the budget store: processes with one name share the budget "
                        "(default: the policy and spec file names and a digest of their absolute paths)")
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
    p.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes,
                   help=f"a larger request line plus headers gets 431 and the connection is closed "
                        f"(default {d.max_header_bytes})")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help=f"seconds from a request's first byte (or a connection's opening) to its last header; 408 and "
                        f"closed after (default {d.header_timeout:g})")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help=f"seconds to receive a request's body (within --deadline too); 408 and closed after "
                        f"(default {d.body_timeout:g})")
    p.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout,
                   help=f"seconds an idle keep-alive connection stays open (default {d.keep_alive_timeout:g})")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help=f"open connections per process; past it the oldest idle one is closed, or the new one when "
                        f"none is idle (default {d.max_connections})")
    p.add_argument("--stall-after", type=float, default=d.stall_after,
                   help=f"seconds a request may wait for the upstream with no answer from it meanwhile before "
                        f"/health says 503 upstream_stalled (default {d.stall_after:g})")
    p.add_argument("--system-message", choices=("refuse", "append", "as-context"), default="refuse",
                   help="a chat's system message: refuse (400, the default), append (after the policy's own system "
                        "text; before the prompt on the completions API) or as-context (before the query inside the "
                        "policy's template); the policy's prompt stays in force (docs/deploy.md, 'Chat front-ends')")
    p.add_argument("--history", choices=("refuse", "keep"), default="refuse",
                   help="a chat's earlier turns: refuse (400, the default) or keep (sent before the policy's "
                        "templated last user turn; as 'User: ...' / 'Assistant: ...' lines on the completions API)")
    p.add_argument("--accept", action="append", metavar="NAME=LOW:HIGH",
                   help="accept a sampling parameter (temperature, top_p, frequency_penalty, presence_penalty) from "
                        "callers within LOW..HIGH and send it upstream instead of the policy's; repeatable; default: "
                        "only the value the policy was learned with")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="let browser pages of ORIGIN call the server (repeatable; '*' for any); default: no CORS")
    p.set_defaults(func=cmd_serve)
    add_evaluate_log(subparsers)


def cmd_evaluate_log(args: argparse.Namespace) -> int:
    """``iapo-gym evaluate-log LOG --policy CANDIDATE``: IPS, SNIPS and DR per context and overall (``iapo_gym.ope``);
    exit 1 when the log or the policy cannot be read or evaluated."""
    from iapo_gym.ope import evaluate, format_report
    from iapo_gym.outcome_log import LogError, read_log
    from iapo_gym.policyfile import PolicyFileError, load_policy

    try:
        costs = {}
        for item in args.cost or ():
            prompt, sep, value = item.partition("=")
            try:
                costs[prompt] = float(value)
            except ValueError:
                sep = ""
            if not sep or not prompt or not math.isfinite(costs[prompt]) or costs[prompt] < 0:
                raise ValueError(f"--cost takes PROMPT=VALUE with a number >= 0, got {item!r}")
        candidate = load_policy(args.policy)
        meta, rows = read_log(args.log)
        if meta.get("aggregator") != candidate.aggregator or list(meta.get("objectives", ())) != \
                list(candidate.objectives):
            raise ValueError(f"the log was served by a {meta.get('aggregator')} policy of objectives "
                             f"{meta.get('objectives')}, the candidate {args.policy} is {candidate.aggregator} of "
                             f"{list(candidate.objectives)}")
        per_context, overall, counts = evaluate(rows, candidate, costs=costs)
    except (LogError, PolicyFileError, ValueError) as exc:
        print(f"iapo-gym evaluate-log: error: {exc}", file=sys.stderr)
        return 1
    print(format_report(per_context, overall, counts))
    if args.json:
        from iapo_gym.atomic import atomic_path

        doc = {"log": str(args.log), "policy": str(args.policy), "counts": counts,
               "contexts": [e.to_dict() for e in per_context], "overall": overall.to_dict()}
        with atomic_path(args.json) as tmp:
            tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


def add_evaluate_log(subparsers: Any) -> None:
    """Add the ``evaluate-log`` command to the ``iapo-gym`` parser."""
    p = subparsers.add_parser(
        "evaluate-log", help="estimate a policy file's utility from a serve outcome log (off-policy evaluation)",
        description="Estimate what a candidate policy would have earned on the requests of an outcome log (serve "
                    "--log), per context and overall: IPS, self-normalized IPS and doubly robust (a cross-fitted model; "
                    "on a Best-of-N log of serve --learn, a candidate arm observed from the first completions of "
                    "any logged arm of its prompt and a larger N), each with a 95%% normal interval, beside the "
                    "logging policy's own value "
                    "(docs/deploy.md, 'Logging, feedback and off-policy evaluation').")
    p.add_argument("log", help="the outcome log folder (serve --log DIR) or one of its .sqlite files")
    p.add_argument("--policy", required=True, help="the candidate policy file (policy.json)")
    p.add_argument("--cost", action="append", metavar="PROMPT=VALUE",
                   help="cost per completion of a prompt, in the unit of the cost weights, where the log has none "
                        "(the serving policy had no arm_estimates); repeatable")
    p.add_argument("--json", metavar="FILE", help="also write the estimates as JSON to FILE")
    p.set_defaults(func=cmd_evaluate_log)
