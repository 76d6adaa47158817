"""``iapo-gym optimize TARGET --agent AGENT --budget B --out DIR``: train one agent, check it, write a policy file.

TARGET is a collection spec (a live endpoint, ``.toml``/``.json``), a task name or an ``.h5`` table.
On a table the run is the leaderboard's run ``--run`` (default 0) under root seed ``--seed``: the
same split, env seed and agent seed (``runner.run_setup``, ``runner.agent_seed_for``), so the policy
is bit for bit the one the leaderboard's run with that agent, seed and budget gives, and its test
values are exact. On a live endpoint the agent trains on ``IAPO-Live-v0`` through the response cache
(a rerun is answered from it) under the spec's spending cap; ``--check K`` then spends K completions
on held-out test queries for a Monte Carlo estimate per context with its standard error.
With ``--rules`` (a table target) the agent trains on the env with stopping rules as arms (``rule_arms``) and
the policy file carries each context's rule (docs/deploy.md, "Stopping rules").
Writes ``DIR/policy.json`` (docs/deploy.md) and ``DIR/report.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from iapo_gym.atomic import atomic_write_text
from iapo_gym.leaderboard.run.specs import AgentSpec, parse_agent_spec, resolve_task
from iapo_gym.llm.prices import spend_report
from iapo_gym.policyfile import PolicyFile, describe
from iapo_gym.progress import Progress
from iapo_gym.rules import rule_label
from iapo_gym.seeding import derive_rng, derive_seed

CHECK_KEY = "iapo_gym.optimize.check"
DRAWN_KEY = "iapo_gym.optimize.early_stop"
#: Votes simulated per context for the completions a majority vote draws with early stopping (table target).
DRAWN_SAMPLES = 20_000
DRAWN_SEED = 0  # live target: the votes simulated from the estimates


class OptimizeError(RuntimeError):
    """The run could not produce a policy (budget broken, spending cap reached, bad target)."""


@dataclass
class OptimizeResult:
    """What ``optimize`` wrote and spent."""

    policy: PolicyFile
    policy_path: Path
    report_path: Path
    spend: dict[str, Any] = field(default_factory=dict)


class _Bar:
    """The shared ``Progress`` over the budget, fed by polling a counter (the env is never wrapped: results stay
    identical)."""

    def __init__(self, total: int, read: Any, enabled: bool) -> None:
        self.read, self._stop = read, threading.Event()
        self.progress: Progress | None = None
        if enabled:
            self.progress = Progress(total, sys.stderr, unit="completions", interval=5.0)
            self.thread = threading.Thread(target=self._poll, daemon=True)
            self.thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            self._show()

    def _show(self) -> None:
        assert self.progress is not None
        self.progress.update(max(0, int(self.read()) - self.progress.done), "training")

    def close(self) -> None:
        if self.progress is not None:
            self._stop.set()
            self.thread.join()
            self._show()
            self.progress.close()


def is_spec_path(target: str) -> bool:
    """A collection spec: a ``.toml`` or ``.json`` file."""
    return Path(target).suffix.lower() in (".toml", ".json")


def optimize(target: str, agent: str | AgentSpec, budget: int, out: str | Path, *, seed: int = 0, run: int = 0,
             check: int | None = None, spec: str | None = None, cache: str | None = None,
             progress: bool = False, rules: bool = False) -> OptimizeResult:
    """Train ``agent`` on ``target`` within ``budget`` completions and write ``out/policy.json`` and ``out/report.md``.

    ``rules``: the arms include the stopping rules (a table target; the env's ``rule_arms``), and the policy
    file carries the rule the agent chose per context."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1 (completions), got {budget!r}")
    if run < 0:
        raise ValueError(f"run must be >= 0, got {run}")
    agent_spec = agent if isinstance(agent, AgentSpec) else parse_agent_spec(agent)
    out = Path(out)
    if is_spec_path(target):
        if spec is not None:
            raise ValueError("--spec is for a table target; a live target is its own spec")
        if rules:
            raise ValueError("--rules is for a table target: on a live endpoint the agents choose among (prompt, N) "
                             "only")
        pf, spend = _live(target, agent_spec, budget, out, seed, run, check or 0, cache, progress)
    else:
        if check:
            raise ValueError("--check is for a live target; on a table the check is exact")
        pf, spend = _table(target, agent_spec, budget, seed, run, spec, progress, rules)
    out.mkdir(parents=True, exist_ok=True)
    policy_path = pf.save(out / "policy.json")
    report_path = atomic_write_text(out / "report.md", render_report(pf) + spend_report(pf, target))
    return OptimizeResult(pf, policy_path, report_path, spend)


def _train(env: Any, agent_spec: AgentSpec, agent_seed: int, budget: int, meter: Any,
           progress: bool) -> tuple[Any, float, dict[str, Any]]:
    """Train the agent on ``env`` within ``budget``; the policy, the seconds and the arm estimates of its draws.

    The env's completion source is wrapped for the run by a recorder (whatever the agent), so every
    completion drawn is kept for the policy file's ``arm_estimates``.
    """
    from iapo_gym.deploy.estimates import RecordingSource, build_arm_estimates
    from iapo_gym.leaderboard.run.runner import BudgetExceededError, build_agent

    agent = build_agent(agent_spec, agent_seed)
    bar = _Bar(budget, meter, progress)
    recorder = RecordingSource(env.source)
    train_queries = env.queries()
    env.source = recorder
    start = time.perf_counter()
    try:
        policy = agent.train(env, budget)
    finally:
        env.source = recorder.inner
        bar.close()
    seconds = time.perf_counter() - start
    if meter() > budget:
        raise BudgetExceededError(f"agent {agent_spec.label!r} drew {meter()} completions with a budget of {budget}")
    return policy, seconds, build_arm_estimates(env.table, *recorder.pulls(), train_queries)


def _table(target: str, agent_spec: AgentSpec, budget: int, seed: int, run: int, spec_path: str | None,
           progress: bool, rules: bool = False) -> tuple[PolicyFile, dict[str, Any]]:
    """The leaderboard's run ``run`` of the task, trained and described exactly."""
    from iapo_gym.deploy.estimates import simulate_drawn
    from iapo_gym.env import IAPOEnv
    from iapo_gym.leaderboard.run.runner import DEFAULT_TRAIN_FRACTION, agent_seed_for, run_setup
    from iapo_gym.leaderboard.run.specs import task_available
    from iapo_gym.oracle import policy_arms

    task = resolve_task(target)
    why = task_available(task)
    if why is not None:
        raise OptimizeError(why)
    setup = run_setup(task, run, seed, DEFAULT_TRAIN_FRACTION)
    env = IAPOEnv(table=setup.run_table, rule_arms=rules)
    env.reset(seed=setup.env_seed)
    agent_seed = agent_seed_for(seed, task.name, run, agent_spec)
    policy, seconds, estimates = _train(env, agent_spec, agent_seed, budget, lambda: env.completions_drawn, progress)
    arms = policy_arms(policy, setup.run_table)
    spec = None
    if spec_path is not None:
        from iapo_gym.llm.spec import load_spec

        spec = load_spec(spec_path)
    spend = {"completions": env.completions_drawn, "requests": 0, "tokens": 0, "price": 0.0}
    learned = {"agent": agent_spec.spec, "seed": seed, "run": run, "budget": budget, "target": task.name,
               "target_kind": "table", "table_sha256": setup.checksum, "model": None, **spend,
               "seconds": round(seconds, 3), "split_seed": setup.split_seed, "env_seed": setup.env_seed,
               "agent_seed": agent_seed, **({"rule_arms": True} if rules else {})}
    pf = describe(arms.tolist(), env, spec=spec, learned=learned)
    drawn = None
    if setup.run_table.aggregator == "mv":
        chosen = [c.rule.make() if c.rule is not None else None for c in pf.contexts]
        drawn = simulate_drawn(setup.run_table, arms[:, :2], env.queries("test"), DRAWN_SAMPLES,
                               derive_seed(seed, DRAWN_KEY, task.name, run), chosen if any(chosen) else None)
    pf = _with_estimates(pf, estimates, drawn)
    est = dict(pf.estimate, any_weights=any_weights_check(pf, setup.run_table))
    return dataclasses.replace(pf, estimate=est), spend


def any_weights_check(pf: PolicyFile, table: Any) -> list[dict[str, Any]]:
    """Weights midway between consecutive contexts, the arm the policy's estimates rate best for each (as ``serve``
    chooses it), and its exact test utility against the best arm's and the nearest context's arm's."""
    from iapo_gym.deploy.estimates import ArmRatings, choose_arm, probe_weights
    from iapo_gym.env import IAPOEnv

    assert pf.arm_estimates is not None
    probes = probe_weights(pf.contexts)
    if probes.size == 0:
        return []
    ratings = ArmRatings(pf.arm_estimates, pf.aggregator, pf.n_max, pf.objectives)
    names = tuple(f"probe{i}" for i in range(len(probes)))
    probe_table = dataclasses.replace(table, context_weights=probes, context_names=names,
                                      context_probs=np.full(len(probes), 1.0 / len(probes)))
    q = IAPOEnv(table=probe_table).q_table("test")  # exact (probes, P, N_max)
    index = {p.id: i for i, p in enumerate(pf.prompts)}
    rows = []
    for i, w in enumerate(probes):
        chosen = choose_arm(ratings, pf.contexts, w)
        prompt, n = chosen["prompt"], chosen["n"]
        near = next(c for c in pf.contexts if c.name == chosen["nearest_context"])
        rows.append({"weights": [float(x) for x in w], "prompt": prompt, "n": n,
                     "exact": float(q[i, index[prompt], n - 1]), "optimal": float(q[i].max()),
                     "nearest_context": near.name, "nearest_exact": float(q[i, index[near.prompt], near.n - 1])})
    return rows


class _LiveMeter:
    """Completions drawn by a live env's pulls (cache hits included)."""

    def __init__(self) -> None:
        self.drawn = 0


def _live(target: str, agent_spec: AgentSpec, budget: int, out: Path, seed: int, run: int, check: int,
          cache: str | None, progress: bool) -> tuple[PolicyFile, dict[str, Any]]:
    """Train on the live endpoint through the cache, then check on held-out queries."""
    from iapo_gym.leaderboard.run.runner import agent_seed_for
    from iapo_gym.llm.collect import check_plan_fits
    from iapo_gym.llm.live import LiveEnv
    from iapo_gym.llm.spec import load_spec
    from iapo_gym.oracle import policy_arms

    spec = load_spec(target)
    check_plan_fits(spec, budget + check, f"optimize --budget {budget} --check {check} ({budget + check} completions)")
    meter = _LiveMeter()

    class MeteredLive(LiveEnv):
        def pull(self, prompts: np.ndarray, ns: np.ndarray, queries: np.ndarray | None = None) -> Any:
            pulls = super().pull(prompts, ns, queries)
            meter.drawn += int(np.asarray(ns).sum())
            return pulls

    cache_path = cache or spec.cache or out / "cache.sqlite"
    Path(cache_path).parent.mkdir(parents=True, exist_ok=True)
    env = MeteredLive(spec, cache=cache_path)
    try:
        split_note = "stored"
        if env.table.split is None:
            if spec.build.test_fraction > 0:
                env.resplit(1.0 - spec.build.test_fraction, derive_seed(seed, "split", spec.task, run))
                split_note = f"resplit, test fraction {spec.build.test_fraction}"
            else:
                split_note = "none (build.test_fraction = 0): the check uses the training queries"
        env.reset(seed=derive_seed(seed, "env", spec.task, run))
        agent_seed = agent_seed_for(seed, spec.task, run, agent_spec)
        policy, seconds, estimates = _train(env, agent_spec, agent_seed, budget, lambda: meter.drawn, progress)
        arms = policy_arms(policy, env.table)
        train = {"completions": meter.drawn, "requests": env.requests, "tokens": env.client.cap.tokens}
        estimate: dict[str, Any] = {"method": None}
        values: list[dict[str, Any]] = [{} for _ in range(env.n_contexts)]
        if check:
            estimate, values = live_check(env, arms, check, derive_seed(seed, CHECK_KEY, spec.task, run))
            estimate["split_note"] = split_note
        price = spec.budget.price_per_1k_tokens
        spend = {**train, "price": train["tokens"] * price / 1000.0}
        learned = {"agent": agent_spec.spec, "seed": seed, "run": run, "budget": budget, "target": spec.task,
                   "target_kind": "live", "table_sha256": None,
                   "model": ", ".join(e.model for e in spec.endpoints), **spend,
                   "seconds": round(seconds, 3), "agent_seed": agent_seed,
                   "check": {"completions": meter.drawn - train["completions"],
                             "requests": env.requests - train["requests"],
                             "tokens": env.client.cap.tokens - train["tokens"]}}
        pf = describe(arms.tolist(), env, spec=spec, learned=learned, estimate=estimate, context_values=values)
    finally:
        env.close()
    pf = _with_estimates(pf, estimates, None)
    return pf, spend


def _with_estimates(pf: PolicyFile, estimates: dict[str, Any], drawn: np.ndarray | None) -> PolicyFile:
    """The policy file with its arm estimates, and per majority-vote context the completions expected with early
    stopping (and its stopping rule): ``drawn`` (simulated on a table's distributions) or else the mean over the
    arm's training blocks."""
    from iapo_gym.deploy.estimates import ArmRatings

    if pf.aggregator == "mv":
        ratings = ArmRatings(estimates, pf.aggregator, pf.n_max, pf.objectives)
        contexts = tuple(dataclasses.replace(c, expected_drawn=float(drawn[i]) if drawn is not None
                                             else ratings.drawn(c.prompt, c.n, DRAWN_SAMPLES, DRAWN_SEED))
                         for i, c in enumerate(pf.contexts))
        pf = dataclasses.replace(pf, contexts=contexts)
    return dataclasses.replace(pf, arm_estimates=estimates)


def live_check(env: Any, arms: np.ndarray, completions: int, seed: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Monte Carlo values of ``arms`` from about ``completions`` completions on the env's test queries.

    Every distinct arm gets the same number m of pulls, each on a test query (without repetition
    while there are enough); a context's value is the mean utility under its own weights of its arm's
    pulls. The overall ACR sums, per arm, the probability-weighted utilities of the contexts using it,
    so contexts sharing an arm (hence pulls) are counted with their covariance in the standard error.
    """
    arms = np.asarray(arms, dtype=np.int64)
    distinct, arm_of = np.unique(arms, axis=0, return_inverse=True)
    arm_of = arm_of.reshape(-1)
    per_round = int(distinct[:, 1].sum())
    m = completions // per_round
    if m < 2:
        raise ValueError(f"--check {completions} is too small: the policy's {len(distinct)} distinct arms need "
                         f"at least 2 x {per_round} = {2 * per_round} completions for a standard error")
    pool = env.queries("test")
    rng = derive_rng(seed)
    order = np.concatenate([rng.permutation(pool) for _ in range(-(-m // pool.size))])[:m]
    prompts = np.repeat(distinct[:, 0], m)
    ns = np.repeat(distinct[:, 1], m)
    queries = np.tile(order, len(distinct))
    pulls = env.pull(prompts, ns, queries)
    utils = env.utilities(pulls)  # (C, len(distinct) * m)
    probs = env.table.context_probs
    values: list[dict[str, Any]] = []
    for c in range(arms.shape[0]):
        u = utils[c, arm_of[c] * m:(arm_of[c] + 1) * m]
        values.append({"mean": float(u.mean()), "stderr": float(u.std(ddof=1) / math.sqrt(m)), "optimal": None,
                       "completions": int(m * distinct[arm_of[c], 1])})
    acr, var = 0.0, 0.0
    for a in range(len(distinct)):
        users = np.flatnonzero(arm_of == a)
        weighted = (probs[users, None] * utils[users, a * m:(a + 1) * m]).sum(axis=0)
        acr += float(weighted.mean())
        var += float(weighted.var(ddof=1) / m)
    split = "test" if env.table.split is not None else "all"
    est = {"method": "monte_carlo", "split": split, "acr": acr, "stderr": math.sqrt(var), "optimal_acr": None,
           "regret": None, "completions": int(m * per_round), "queries": int(np.unique(order).size)}
    return est, values


def render_report(pf: PolicyFile) -> str:
    """``report.md``: how the policy was learned, what it spent, and per context prompt, N and estimated utility."""
    ln, est = pf.learned, pf.estimate
    lines = [f"# Policy for {pf.task}", ""]
    lines.append(f"Agent `{ln.get('agent')}`, seed {ln.get('seed')}, run {ln.get('run')}, budget {ln.get('budget')} "
                 f"completions, on the {ln.get('target_kind')} target `{ln.get('target')}`"
                 + (f" (model `{ln['model']}`)" if ln.get("model") else "") + f"; aggregator {pf.aggregator}.")
    lines.append("")
    lines.append(f"Training spend: {ln.get('completions')} completions, {ln.get('requests')} requests, "
                 f"{ln.get('tokens')} completion tokens, price {ln.get('price', 0.0):.4f}; "
                 f"{ln.get('seconds')} s.")
    if ln.get("check"):
        ck = ln["check"]
        lines.append(f"Check spend: {ck['completions']} completions, {ck['requests']} requests, "
                     f"{ck['tokens']} completion tokens.")
    lines.append("")
    if est.get("method") == "exact":
        lines.append(f"Exact test ACR {est['acr']:.6f} (optimal {est['optimal_acr']:.6f}, regret {est['regret']:.6f}) "
                     f"on {est.get('queries')} {est.get('split')} queries.")
    elif est.get("method") == "monte_carlo":
        lo, hi = est["acr"] - 1.96 * est["stderr"], est["acr"] + 1.96 * est["stderr"]
        lines.append(f"Monte Carlo ACR {est['acr']:.4f} +- {est['stderr']:.4f} (95% interval {lo:.4f} .. {hi:.4f}) "
                     f"from {est.get('completions')} completions on {est.get('queries')} {est.get('split')} queries"
                     + (f"; split: {est['split_note']}" if est.get("split_note") else "") + ".")
    else:
        lines.append("Not checked (a live target: give --check K to estimate it on held-out queries).")
    mv, ruled = pf.aggregator == "mv", pf.has_rules
    lines += ["", "| context | objective weights | cost weight | prompt | N | estimated utility | 95% interval | "
                  "optimal | check completions |" + (" completions with early stop |" if mv else "")
              + (" stopping rule | exact completions under the rule |" if ruled else ""),
              "|---|---|---|---|---:|---:|---|---:|---:|" + ("---:|" if mv else "") + ("---|---:|" if ruled else "")]
    for c in pf.contexts:
        if c.value is None:
            value, interval = "-", "-"
        elif est.get("method") == "exact":
            value, interval = f"{c.value:.6f}", "exact"
        else:
            se = c.stderr or 0.0
            value = f"{c.value:.4f}"
            interval = f"{c.value - 1.96 * se:.4f} .. {c.value + 1.96 * se:.4f}"
        optimal = "-" if c.optimal is None else f"{c.optimal:.6f}"
        weights = ", ".join(f"{w:g}" for w in c.objective_weights)
        drawn = "" if not mv else (" - |" if c.expected_drawn is None else f" {c.expected_drawn:.2f} |")
        if ruled:
            rule = c.rule.make() if c.rule is not None else None
            label = "fixed" if rule is None else rule_label(rule)
            if c.rule is not None and c.rule.tau is not None:
                label += f", tau {c.rule.tau:g}"
            drawn += f" {label} | " + ("-" if c.exact_drawn is None else f"{c.exact_drawn:.2f}") + " |"
        lines.append(f"| {c.name} | {weights} | {c.cost_weight:g} | {c.prompt} | {c.n} | {value} | {interval} | "
                     f"{optimal} | {c.completions if c.completions is not None else '-'} |{drawn}")
    lines.append("")
    if mv:
        how = ("simulated from the table's distributions on the test queries" if ln.get("target_kind") == "table"
               else "simulated from the training completions' distributions per query")
        lines.append("A majority vote stops drawing once no remaining completion can change its winner (the same "
                     "answer as all N): N is a cap; the " + ("column \"completions with early stop\"" if ruled else
                                                              "last column") +
                     f" is the completions a request draws on average ({how}).")
        lines.append("")
    if ruled:
        lines.append("A context with a stopping rule draws its completions in waves and stops where the rule says "
                     "(docs/rules.md), N being the cap; the last column is the exact expected completions under the "
                     "rule alone" + (" (serve also stops a decided vote, so it may draw fewer)." if mv else "."))
        lines.append("")
    if pf.arm_estimates is not None:
        lines.append(f"The file keeps the {pf.arm_estimates['completions']} training completions as per-arm estimates: "
                     "`serve` rates weights that no context has by them (docs/deploy.md, \"Any weights\").")
        lines.append("")
    probes = est.get("any_weights") or []
    if probes:
        regret = sum(r["optimal"] - r["exact"] for r in probes) / len(probes)
        near = sum(r["optimal"] - r["nearest_exact"] for r in probes) / len(probes)
        lines += [f"Weights midway between consecutive contexts, with the arm `serve` gives them, checked exactly on the "
                  f"test queries (mean regret {regret:.6f}; the nearest context's arm: {near:.6f}):", "",
                  "| weights | arm | exact utility | optimal | nearest context | its arm's exact utility |",
                  "|---|---|---:|---:|---|---:|"]
        for r in probes:
            weights = ", ".join(f"{x:g}" for x in r["weights"])
            lines.append(f"| {weights} | {r['prompt']}, N = {r['n']} | {r['exact']:.6f} | {r['optimal']:.6f} | "
                         f"{r['nearest_context']} | {r['nearest_exact']:.6f} |")
        lines.append("")
    if any(not pf.prompt(c.prompt).servable for c in pf.contexts):
        lines.append("The prompts are known by id only (a table without its collection spec): give `--spec` to make "
                     "the policy servable.")
    else:
        lines.append("Serve it: `iapo-gym serve policy.json --upstream SPEC` (docs/deploy.md).")
    return "\n".join(lines) + "\n"


def cmd_optimize(args: argparse.Namespace) -> int:
    """Run ``optimize``; exit 0 with the policy written, 1 on a reported failure."""
    from iapo_gym.llm.client import BudgetExhausted, EndpointError
    from iapo_gym.llm.spec import SpecError
    from iapo_gym.policyfile import PolicyFileError

    try:
        result = optimize(args.target, args.agent, args.budget, args.out, seed=args.seed, run=args.run,
                          check=args.check, spec=args.spec, cache=args.cache, progress=not args.quiet,
                          rules=args.rules)
    except BudgetExhausted as exc:
        print(f"iapo-gym optimize: stopped: {exc}; raise the spec's cap and run the same command again (what was "
              "answered is in the response cache)", file=sys.stderr)
        return 1
    except (OptimizeError, SpecError, EndpointError, PolicyFileError, ValueError, ImportError, RuntimeError) as exc:
        print(f"iapo-gym optimize: error: {exc}", file=sys.stderr)
        return 1
    pf = result.policy
    est = pf.estimate
    print(f"policy written: {result.policy_path} ({len(pf.contexts)} contexts); report: {result.report_path}")
    if est.get("method") == "exact":
        print(f"exact test ACR {est['acr']:.6f}, regret {est['regret']:.6f}")
    elif est.get("method") == "monte_carlo":
        print(f"Monte Carlo ACR {est['acr']:.4f} +- {est['stderr']:.4f}")
    sp = result.spend
    print(f"spent {sp.get('completions')} completions, {sp.get('requests')} requests, {sp.get('tokens')} completion "
          "tokens in training")
    return 0


def add_commands(subparsers: Any) -> None:
    """Add the ``optimize`` command to the ``iapo-gym`` parser."""
    p = subparsers.add_parser(
        "optimize", help="learn a policy on a table or a live endpoint and write DIR/policy.json",
        description="Train one agent within B completions on TARGET (a collection spec for a live endpoint, a task "
                    "name or an .h5 table), check the policy (exact on a table, --check K completions on held-out "
                    "queries live) and write DIR/policy.json and DIR/report.md (docs/deploy.md).")
    p.add_argument("target", help="collection spec (.toml/.json: live endpoint), task name or .h5 table")
    p.add_argument("--agent", default="auto", help="agent spec as the leaderboard takes it (default: auto)")
    p.add_argument("--budget", type=int, required=True, help="training budget in completions")
    p.add_argument("--out", required=True, help="output folder for policy.json and report.md")
    p.add_argument("--check", type=int, default=None, metavar="K",
                   help="live target: completions to spend on held-out test queries to estimate the policy")
    p.add_argument("--seed", type=int, default=0, help="root seed, as the leaderboard's --seed (default 0)")
    p.add_argument("--run", type=int, default=0, help="the leaderboard run to reproduce on a table (default 0)")
    p.add_argument("--spec", help="table target: the collection spec it was collected with (prompt texts, scorer), "
                                  "needed to serve the policy")
    p.add_argument("--cache", help="live target: response cache file (default: the spec's cache, else DIR/cache.sqlite)")
    p.add_argument("--rules", action="store_true",
                   help="table target: stopping rules are arms too (the env's rule_arms); the policy file carries the "
                        "rule the agent chose per context, and serve applies it (docs/rules.md)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_optimize)
