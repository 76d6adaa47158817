"""Stopping rules deployed (issue 52, "Deploy"): the policy file carries each context's rule, ``optimize --rules``
writes it, ``serve`` applies it.

Real parts: the exact oracle of the synthetic tables, the header-echoing upstream (tests/echo_upstream.py, a real
HTTP server whose answers come in a known order) behind a ``Router`` and behind ``iapo-gym serve`` as a process, the
scorer of the Best-of-N tests (tests/llm_scorer.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iapo_gym import IAPOEnv, Policy
from iapo_gym.cli import main
from iapo_gym.data import load_task_table
from iapo_gym.deploy import PolicyFileError, Router, load_policy
from iapo_gym.oracle import expected_cost, greedy_policy
from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyRule
from iapo_gym.rules import context_thresholds
from iapo_gym.tables import OutcomeTable
from tests.deploy_helpers import bon_policy, get_json, mv_policy, post_json, start_serve
from tests.echo_upstream import EchoUpstream
from tests.llm_server import free_port, stop, write_spec


class OracleRules:
    """An agent that returns the exact optimum over (p, N, rule) on the env's training split (``greedy_policy`` of
    ``q_table("train", rules=True)``): a policy with rules wherever they pay. It draws one completion of every
    prompt (the policy file's per-arm estimates need some)."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed

    def train(self, env: Any, budget: int) -> Policy:
        """The greedy policy over the arms with rules (the env must have ``rule_arms``)."""
        base = env.unwrapped
        assert base.rule_arms
        base.pull(np.arange(base.table.n_prompts), np.ones(base.table.n_prompts, dtype=np.int64))
        return greedy_policy(base.q_table("train", rules=True))


def _rule_env(task: str) -> IAPOEnv:
    """The env with rule arms of ``synthetic_bernoulli`` (majority vote), or of a part of ``synthetic_categorical``
    (Best-of-N: 6 prompts, 96 queries, 9 contexts, N_max 16, so that its exact thresholds' tensors take little time)."""
    table = load_task_table(task, instance=0)
    if task == "synthetic_categorical":
        p, q, c = [2, 11, 18, 5, 7, 25], 96, [0, 4, 8, 9, 13, 17, 18, 22, 26]
        assert table.atoms is not None and table.split is not None and table.cost.ndim == 1
        table = OutcomeTable(task="part", aggregator="bon", probs=table.probs[p, :q], atoms=table.atoms[p, :q],
                             cost=table.cost[p], n_max=16, context_weights=table.context_weights[c],
                             context_names=tuple(table.context_names[i] for i in c),
                             context_probs=np.full(len(c), 1.0 / len(c)), objective_names=table.objective_names,
                             prompts=tuple(table.prompts[i] for i in p), queries=table.queries[:q],
                             split=table.split[:q])
    return IAPOEnv(table=table, rule_arms=True)


# ---- the policy file ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["synthetic_bernoulli", "synthetic_categorical"])  # majority vote, Best-of-N
def test_a_policy_with_rules_round_trips_with_exact_values(task: str, tmp_path: Path) -> None:
    env = _rule_env(task)
    policy = greedy_policy(env.q_table("test", rules=True))
    assert policy.has_rules and 0 in policy.rules  # rules in some contexts, fixed N in others
    path = policy.save(tmp_path / "policy.json", env)
    assert Policy.load(path) == policy
    pf = load_policy(path)
    q4, drawn = env.q_table("test", rules=True), env.expected_drawn("test")
    table = env.table
    assert isinstance(table, OutcomeTable)
    cost = expected_cost(table, env.queries("test"))
    taus = context_thresholds(table, env.rules)[0]
    for c, ((p, n, r), ctx) in enumerate(zip(policy.triples, pf.contexts, strict=True)):
        if r == 0:
            assert ctx.rule is None
        else:
            assert ctx.rule is not None and ctx.rule.make() == env.rules[r]
            assert (ctx.rule.name, ctx.rule.params) == (env.rules[r].name, env.rules[r].params())
            # a Best-of-N threshold carries the context's tau, the number the env's steps compare with
            assert ctx.rule.tau == (taus[c, r] if env.table.aggregator == "bon" else None)
        assert ctx.value == q4[c, p, n - 1, r] and ctx.optimal == q4[c].max()
        assert ctx.exact_drawn == drawn[c, p, n - 1, r] and ctx.exact_cost == cost[c, p, n - 1, r]
        # a rule saves completions in expectation, fixed N draws N
        assert ctx.exact_drawn is not None and (ctx.exact_drawn < n) == (r != 0)
    assert pf.estimate["acr"] == pytest.approx(env.evaluate(policy), abs=1e-12)
    assert pf.estimate["regret"] == pytest.approx(0.0, abs=1e-12)  # the optimum over the arms with rules
    # the same arms without their rules: no rule and no exact_* field in the file, as before rules existed
    plain = Policy(policy.arms).save(tmp_path / "plain.json", env)
    doc = json.loads(plain.read_text(encoding="utf-8"))
    assert all("rule" not in c and set(c["value"]) == {"mean", "stderr", "optimal"} for c in doc["contexts"])
    assert Policy.load(plain) == Policy(policy.arms) and not Policy.load(plain).has_rules


def _resign(path: Path, edit: Any) -> Path:
    """The file with ``edit(doc)`` applied and its checksum recomputed (an edit that only the checks can refuse)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    edit(doc)
    body = {k: v for k, v in doc.items() if k != "sha256"}
    doc["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"),
                                              ensure_ascii=False).encode()).hexdigest()
    out = path.with_name("edited.json")
    out.write_text(json.dumps(doc), encoding="utf-8")
    return out


def _with_rule(pf: PolicyFile, rule: PolicyRule | None, context: int = 0) -> PolicyFile:
    contexts = list(pf.contexts)
    contexts[context] = dataclasses.replace(contexts[context], rule=rule)
    return dataclasses.replace(pf, contexts=tuple(contexts))


@pytest.mark.parametrize(("aggregator", "rule", "message"), [
    ("mv", PolicyRule("median", {}), r"context 'low': field 'rule' .*unknown stopping rule 'median'"),
    ("mv", PolicyRule("margin", {"m": 0}), r"context 'low': field 'rule' .*m must be an integer >= 1, got 0"),
    ("mv", PolicyRule("margin", {"m": 2.5}), r"m must be an integer >= 1, got 2.5"),
    ("mv", PolicyRule("margin", {"level": 0.9}), r"stopping rule 'margin' takes the parameters \['m'\]"),
    ("mv", PolicyRule("posterior", {"level": 0.4}), r"level must be a number in \(0.5, 1\), got 0.4"),
    ("mv", PolicyRule("margin", {"m": 2}, tau=0.5), r"field 'rule.tau' is for a Best-of-N threshold rule only"),
    ("mv", PolicyRule("threshold", {"q": 0.5}, tau=0.5), r"field 'rule.name' 'threshold' is not a stopping rule of "
                                                         r"the mv aggregator"),
    ("bon", PolicyRule("threshold", {"q": 0.5}), r"context 'long': field 'rule.tau' must be a finite number for a "
                                                 r"threshold rule"),
    ("bon", PolicyRule("threshold", {"q": 0.5}, tau=float("inf")), r"field 'rule.tau' must be a finite number"),
    ("bon", PolicyRule("margin", {"m": 2}), r"field 'rule.name' 'margin' is not a stopping rule of the bon"),
])
def test_bad_rules_are_refused_naming_the_field(aggregator: str, rule: PolicyRule, message: str) -> None:
    pf = mv_policy() if aggregator == "mv" else bon_policy()
    with pytest.raises(PolicyFileError, match=message):
        _with_rule(pf, rule)


def test_bad_rules_in_a_file_are_refused_on_load(tmp_path: Path) -> None:
    path = _with_rule(mv_policy(), PolicyRule("margin", {"m": 2})).save(tmp_path / "policy.json")
    assert load_policy(path).contexts[0].rule == PolicyRule("margin", {"m": 2})

    def unknown(doc: dict[str, Any]) -> None:
        doc["contexts"][0]["rule"]["name"] = "median"

    with pytest.raises(PolicyFileError, match=r"field 'contexts\[0\]\.rule\.name' must be one of .*got 'median'"):
        load_policy(_resign(path, unknown))

    def bad_param(doc: dict[str, Any]) -> None:
        doc["contexts"][0]["rule"]["params"] = {"m": 0}

    with pytest.raises(PolicyFileError, match=r"edited\.json: context 'low': field 'rule' .*m must be an integer >= 1"):
        load_policy(_resign(path, bad_param))

    def no_params(doc: dict[str, Any]) -> None:
        del doc["contexts"][0]["rule"]["params"]

    with pytest.raises(PolicyFileError, match=r"field 'contexts\[0\]\.rule\.params' is missing"):
        load_policy(_resign(path, no_params))
    # a valid rule outside the env's family: serve applies it, but Policy (rule indices) cannot hold it
    wide = _with_rule(mv_policy(), PolicyRule("margin", {"m": 7})).save(tmp_path / "wide.json")
    with pytest.raises(PolicyFileError, match=r"context 'low': its rule .*margin.* is not in the mv rule family"):
        Policy.load(wide)


# ---- serve applies the rule ---------------------------------------------------------------------------------
def _mv_rules_policy() -> PolicyFile:
    """Three contexts on one prompt: margin(m=2) with N = 8, posterior(level=0.95) and fixed N, both N = 12."""
    return PolicyFile(
        task="tiny", aggregator="mv", api="completions", n_max=12, objectives=("correct",),
        scorer={"extractor": "last_number", "choices": "ABCDE"}, sampling=None,
        prompts=(mv_policy().prompt("plain"),),
        contexts=(PolicyContext("margin", (1.0,), -0.5, 0.4, "plain", 8, rule=PolicyRule("margin", {"m": 2})),
                  PolicyContext("posterior", (1.0,), -0.2, 0.3, "plain", 12,
                                rule=PolicyRule("posterior", {"level": 0.95})),
                  PolicyContext("fixed", (1.0,), 0.0, 0.3, "plain", 12)),
        learned={"agent": "test"}, estimate={"method": None})


#: The answers in upstream order, one request per context in turn, and where each request must stop (by hand):
#: margin(m=2): after 1 2 1 1 the leader is 2 ahead (4 drawn, waves of 2 and 2: each the margin still missing);
#: posterior(0.95): P(Bin(v1 + v2 + 1, 1/2) <= v1) first reaches 0.95 at (v1, v2) = (6, 1) (9/256 left), 7 drawn
#: (waves 4, 3: all to the leader from (0, 0) and (3, 1)); fixed N = 12: the vote is decided once the lead exceeds
#: the completions left, 7 - 1 > 4 after 8 (waves 7, 1). The votes after each stop would change nothing: the
#: script holds no more for that request.
SCRIPT = {"margin": (["1", "2", "1", "1"], 4, [2, 2]),
          "posterior": (["1", "2", "1", "1", "1", "1", "1"], 7, [4, 3]),
          "fixed": (["1", "2", "1", "1", "1", "1", "1", "1"], 8, [7, 1])}


def test_serve_stops_where_the_rule_says_and_charges_only_what_it_drew(tmp_path: Path) -> None:
    answers = [a for texts, _, _ in SCRIPT.values() for a in texts]
    with EchoUpstream(answers=answers) as up:
        spec = write_spec(tmp_path, 0, endpoint={"base_url": up.url, "max_retries": 0}, n_max=12,
                          sampling={"max_tokens": 4})
        policy = _mv_rules_policy().save(tmp_path / "policy.json")
        port = free_port()
        serve = start_serve(policy, spec, port, extra=["--rate", "tokens/day=100000", "--rate", "requests/day=1000",
                                                        "--upstream-retries", "0"])
        try:
            status, models = get_json(port, "/v1/models")
            assert status == 200
            shown = {m["id"]: m["iapo"].get("rule") for m in models["data"]}
            assert shown == {"iapo/margin": {"name": "margin", "params": {"m": 2}},
                             "iapo/posterior": {"name": "posterior", "params": {"level": 0.95}}, "iapo/fixed": None}
            waves: list[int] = []
            for context, (texts, drawn, sizes) in SCRIPT.items():
                before = len(up.bodies)
                status, body, _ = post_json(port, "/v1/completions",
                                            json.dumps({"model": f"iapo/{context}", "prompt": "1 + 1 ="}).encode())
                assert status == 200, body
                info = body["iapo"]
                assert info["drawn"] == drawn == len(texts) and info["answers"] == texts and body["choices"][0]["text"] == "1"
                assert info["rule"] == (shown[f"iapo/{context}"] or {"name": "fixed", "params": {}})
                assert info["n"] == (8 if context == "margin" else 12)
                sent = [b.get("n", 1) for b in up.bodies[before:]]
                assert sent == sizes  # the waves, as the upstream saw them: exactly the completions drawn
                waves += sent
                assert body["usage"]["completion_tokens"] == drawn  # one character each
            status, health = get_json(port, "/health")
            budget = health["budget"]
            # the budget settled at what was drawn: the upstream's requests and its reported tokens, nothing reserved
            prompt_words = len("Q: 1 + 1 =\nA:".split())
            assert budget["requests/day"]["upstream"] == len(waves) == len(up.bodies)
            assert budget["tokens/day"]["used"] == sum(waves) + prompt_words * len(waves) == 19 + 6 * prompt_words
            assert budget["requests/day"]["reserved"] == 0 and budget["tokens/day"]["reserved"] == 0
        finally:
            stop(serve)


def _bon_rules_policy(tau: float) -> PolicyFile:
    pf = bon_policy(n=6)
    return _with_rule(pf, PolicyRule("threshold", {"q": 0.9}, tau=tau))


#: Best-of-N, context "long" (weights 0.9 length, 0.1 digits; scores on a 0.5 grid): "ab" weighs -1.0, ten letters
#: -0.1, twenty letters 0.8, twenty digits 1.0.
TEXTS = ["ab", "abcdefghij", "abcdefghijklmnopqrst", "01234567890123456789", "ab", "ab"]


@pytest.mark.parametrize(("wave", "drawn", "sizes", "chosen"), [(1, 3, [1, 1, 1], 2), (2, 4, [2, 2], 3)])
def test_best_of_n_threshold_stops_at_the_first_completion_reaching_tau(tmp_path: Path, wave: int, drawn: int,
                                                                        sizes: list[int], chosen: int) -> None:
    """tau 0.5: the third completion (0.8) is the first to reach it. Waves of 1 stop there, and it is returned;
    waves of 2 draw the fourth too (same wave) and return the best of the four."""
    with EchoUpstream(answers=TEXTS) as up:
        spec = write_spec(tmp_path, 0, aggregator="bon", endpoint={"base_url": up.url, "max_retries": 0}, n_max=6,
                          scorer={"callable": "tests.llm_scorer:score", "objectives": ["length", "digits"],
                                  "grid": 0.5, "score_range": [-1.0, 1.0]})
        with Router(_bon_rules_policy(0.5), spec, bon_wave=wave) as router:
            routed = router.complete("q", "long")
            assert router.spent["requests"] == len(sizes)
        assert [b.get("n", 1) for b in up.bodies] == sizes
        info = routed.info()
        assert info["drawn"] == routed.n == drawn and info["n"] == 6
        assert info["rule"] == {"name": "threshold", "params": {"q": 0.9}, "tau": 0.5}
        assert info["scores"] == pytest.approx([-1.0, -0.1, 0.8, 1.0][:drawn])
        assert routed.chosen == chosen and routed.text == TEXTS[chosen]
        # no completion reaches tau 1.5: all N are drawn, the best returned, as fixed N would
        up.turn, up.bodies[:] = 0, []
        with Router(_bon_rules_policy(1.5), spec, bon_wave=wave) as router:
            routed = router.complete("q", "long")
        assert routed.n == 6 and sum(b.get("n", 1) for b in up.bodies) == 6 and routed.chosen == 3


def test_bad_bon_wave_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, free_port(), aggregator="bon",
                      scorer={"callable": "tests.llm_scorer:score", "objectives": ["length", "digits"], "grid": 0.5,
                              "score_range": [-1.0, 1.0]})
    with pytest.raises(ValueError, match="bon_wave must be an integer >= 1 .*got 0"):
        Router(_bon_rules_policy(0.5), spec, bon_wave=0)
    policy = _bon_rules_policy(0.5).save(tmp_path / "policy.json")
    assert main(["serve", str(policy), "--upstream", str(spec), "--bon-wave", "0"]) == 1
    assert "bon_wave must be an integer >= 1" in capsys.readouterr().err


# ---- optimize --rules ---------------------------------------------------------------------------------------
def test_optimize_with_rules_writes_rules_that_serve_applies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``optimize --rules`` on a table: the env has the rule arms, the policy file the agent's rules with their
    exact values, and a Router loads it and stops each context's vote where its rule says."""
    table = load_task_table("synthetic_bernoulli", instance=0)
    with EchoUpstream(answers=["7"]) as up:  # every completion answers 7: a rule stops as early as it can
        prompts = [{"id": str(p), "template": f"{p}: {{query}} ="} for p in table.prompts]
        spec = write_spec(tmp_path, 0, endpoint={"base_url": up.url, "max_retries": 0}, n_max=table.n_max,
                          scorer={"extractor": "last_number"}, extra={"prompts": prompts})
        out = tmp_path / "out"
        agent = f"{__name__}:OracleRules"
        assert main(["optimize", "synthetic_bernoulli", "--agent", agent, "--budget", "64", "--out", str(out),
                     "--spec", str(spec), "--rules", "--quiet"]) == 0
        pf = load_policy(out / "policy.json")
        policy = Policy.load(out / "policy.json")
        assert policy.has_rules and pf.learned["rule_arms"] is True
        env = _rule_env("synthetic_bernoulli")
        assert [c.rule.make() if c.rule else env.rules[0] for c in pf.contexts] == [env.rules[r] for r in policy.rules]
        for c, r in zip(pf.contexts, policy.rules, strict=True):
            assert c.exact_drawn is not None and c.expected_drawn is not None
            if r:  # serve also stops a decided vote: on average no more than the rule alone (simulated, 20,000 votes)
                assert c.expected_drawn <= c.exact_drawn + 0.1
            else:
                assert c.exact_drawn == c.n
        report = (out / "report.md").read_text(encoding="utf-8")
        assert "stopping rule" in report and "margin(m=" in report
        with Router(out / "policy.json", spec) as router:
            for c in pf.contexts:
                routed = router.complete("2 + 5", c.name)
                # unanimous votes: margin(m) stops after m, posterior(level) once 1 - 2^-(k + 1) >= level, the
                # lossless stop once k > N - k
                rule_stop = c.n
                if c.rule is not None and c.rule.name == "margin":
                    rule_stop = c.rule.params["m"]
                elif c.rule is not None:
                    rule_stop = next(k for k in range(1, 99) if 1 - 2.0 ** -(k + 1) >= c.rule.params["level"])
                assert routed.n == min(rule_stop, c.n // 2 + 1, c.n), (c.name, c.rule)
                assert routed.info()["rule"] == (c.rule.to_dict() if c.rule else {"name": "fixed", "params": {}})
    assert main(["optimize", str(spec), "--agent", agent, "--budget", "64", "--out", str(tmp_path / "live"),
                 "--rules", "--quiet"]) == 1
    assert "--rules is for a table target" in capsys.readouterr().err
