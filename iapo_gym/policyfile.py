"""The policy file: a learned IAPO policy as one versioned JSON document, ready to serve without a table.

It holds per context the chosen prompt (with its full template or chat messages) and N, the
aggregator with its answer extractor or scorer, how the policy was learned and its estimated
value. The document is checked against ``policy.schema.json`` (shipped in this package), then
for consistency (every context's prompt exists, N <= n_max, one weight per objective), and its
``sha256`` field must match the canonical JSON of the rest: a hand-edited or truncated file is
refused with a ``PolicyFileError`` naming the problem. The checksum guards integrity, not
authenticity: whoever can write the file can recompute it.

This module uses environments, tables and specs by their attributes only, so that
``iapo_gym.policy.Policy.save``/``load`` can use it without importing the oracle.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iapo_gym import schemas
from iapo_gym.atomic import atomic_write_text

FORMAT = "iapo-gym-policy"
VERSION = 2
#: Versions this release reads: version 1 files lack ``arm_estimates`` (they answer their contexts' weights only).
READS = (1, 2)
#: The largest n_max whose arms a file's ``arm_estimates`` may rate (the ratings hold N_max values per prompt).
MAX_RATED_N = 4096
SCHEMA_FILE = "policy.schema.json"


class PolicyFileError(ValueError):
    """A policy file is malformed, inconsistent or was modified after it was written."""


@dataclass(frozen=True)
class PolicyPrompt:
    """A prompt of the policy: ``template`` (completions API) or chat ``messages``, or its id only."""

    id: str
    template: str | None = None
    messages: tuple[tuple[str, str], ...] = ()

    @property
    def servable(self) -> bool:
        """Whether the prompt's text is known (a prompt known by id only cannot be rendered)."""
        return self.template is not None or bool(self.messages)

    def to_dict(self) -> dict[str, Any]:
        """The prompt as stored in the file."""
        out: dict[str, Any] = {"id": self.id}
        if self.template is not None:
            out["template"] = self.template
        elif self.messages:
            out["messages"] = [{"role": r, "content": c} for r, c in self.messages]
        return out


@dataclass(frozen=True)
class PolicyRule:
    """A context's stopping rule as stored (docs/deploy.md, "Stopping rules"): its ``name`` and ``params`` as
    ``iapo_gym.rules`` names them (``margin``, ``{"m": 2}``), and for a Best-of-N ``threshold`` the context's ``tau``,
    the utility at which a completion stops the draws (a number: the served rule has no table to take a quantile of).
    No rule, or ``fixed``, draws all N."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    tau: float | None = None

    def __hash__(self) -> int:  # a context (frozen, hashable) holds its rule: hash the parameters as items
        return hash((self.name, tuple(sorted(self.params.items())), self.tau))

    def make(self) -> Any:
        """The ``iapo_gym.rules`` rule (``ValueError`` for an unknown name or bad parameters)."""
        from iapo_gym.rules import make_rule

        return make_rule(self.name, dict(self.params))

    @property
    def fixed(self) -> bool:
        """Whether the rule draws all N (``fixed``)."""
        return self.name == "fixed"

    def to_dict(self) -> dict[str, Any]:
        """The rule as stored in the file and shown in a response's ``iapo`` object."""
        out: dict[str, Any] = {"name": self.name, "params": dict(self.params)}
        if self.tau is not None:
            out["tau"] = self.tau
        return out


@dataclass(frozen=True)
class PolicyContext:
    """One user context: its weights, probability, chosen (prompt id, N), stopping rule and estimated value."""

    name: str
    objective_weights: tuple[float, ...]
    cost_weight: float
    probability: float
    prompt: str
    n: int
    value: float | None = None
    stderr: float | None = None
    optimal: float | None = None
    completions: int | None = None
    expected_drawn: float | None = None  # mv: completions a request draws on average with early stopping
    rule: PolicyRule | None = None  # None: fixed N (draw all N, or a majority vote's lossless early stop)
    exact_drawn: float | None = None  # an exact oracle's expected completions under the rule (no lossless stop)
    exact_cost: float | None = None  # and their expected cost (the term the cost weight multiplies)

    @property
    def weights(self) -> tuple[float, ...]:
        """Objective weights followed by the cost weight (the env's observation)."""
        return (*self.objective_weights, self.cost_weight)

    def to_dict(self) -> dict[str, Any]:
        """The context as stored in the file."""
        value: dict[str, Any] = {"mean": self.value, "stderr": self.stderr, "optimal": self.optimal}
        if self.completions is not None:
            value["completions"] = self.completions
        if self.expected_drawn is not None:
            value["expected_drawn"] = self.expected_drawn
        if self.exact_drawn is not None:
            value["exact_drawn"] = self.exact_drawn
        if self.exact_cost is not None:
            value["exact_cost"] = self.exact_cost
        out = {"name": self.name, "objective_weights": list(self.objective_weights), "cost_weight": self.cost_weight,
               "probability": self.probability, "prompt": self.prompt, "n": self.n, "value": value}
        if self.rule is not None:
            out["rule"] = self.rule.to_dict()
        return out


@dataclass(frozen=True)
class PolicyFile:
    """A deployable policy (see the module docstring); ``arms`` is the (prompt index, N) of each context.

    ``prompts`` lists every prompt of the task in the table's order, so ``arms`` index them as the
    table does and ``Policy.load`` gives back the trained policy.
    """

    task: str
    aggregator: str
    api: str | None
    n_max: int
    objectives: tuple[str, ...]
    scorer: dict[str, Any] | None
    sampling: dict[str, Any] | None
    prompts: tuple[PolicyPrompt, ...]
    contexts: tuple[PolicyContext, ...]
    learned: dict[str, Any] = field(default_factory=dict)
    estimate: dict[str, Any] = field(default_factory=lambda: {"method": None})
    iapo_gym_version: str = ""
    arm_estimates: dict[str, Any] | None = None  # per prompt the training pulls (iapo_gym.deploy.estimates)

    def __post_init__(self) -> None:
        """Fill the writer's version and check that the document is consistent."""
        if not self.iapo_gym_version:
            from iapo_gym._version import __version__

            object.__setattr__(self, "iapo_gym_version", __version__)
        _check_consistent(self, "policy")

    @property
    def arms(self) -> tuple[tuple[int, int], ...]:
        """(prompt index into ``prompts``, N) per context: the table form of the policy."""
        index = {p.id: i for i, p in enumerate(self.prompts)}
        return tuple((index[c.prompt], c.n) for c in self.contexts)

    @property
    def has_rules(self) -> bool:
        """Whether some context stops by a rule other than fixed N."""
        return any(c.rule is not None and not c.rule.fixed for c in self.contexts)

    def rule_indices(self) -> tuple[int, ...]:
        """Each context's rule as its index in its aggregator's rule family (``iapo_gym.rules.default_rules``; 0:
        fixed N), as ``Policy.rules`` holds it; a rule outside the family raises ``PolicyFileError``."""
        if all(c.rule is None for c in self.contexts):
            return (0,) * len(self.contexts)
        from iapo_gym.rules import default_rules

        family = default_rules(self.aggregator)
        out = []
        for c in self.contexts:
            rule = c.rule.make() if c.rule is not None else family[0]
            if rule not in family:
                raise PolicyFileError(f"context {c.name!r}: its rule {c.rule.to_dict() if c.rule else None} is not in "
                                      f"the {self.aggregator} rule family {[r.name + str(r.params()) for r in family]} "
                                      "that Policy.rules indexes (serve applies it all the same)")
            out.append(family.index(rule))
        return tuple(out)

    def prompt(self, prompt_id: str) -> PolicyPrompt:
        """The prompt with id ``prompt_id``."""
        for p in self.prompts:
            if p.id == prompt_id:
                return p
        raise KeyError(prompt_id)

    def to_dict(self) -> dict[str, Any]:
        """The document without its checksum."""
        return {"format": FORMAT, "version": VERSION, "iapo_gym_version": self.iapo_gym_version, "task": self.task,
                "aggregator": self.aggregator, "api": self.api, "n_max": self.n_max, "objectives": list(self.objectives),
                "scorer": self.scorer, "sampling": self.sampling, "prompts": [p.to_dict() for p in self.prompts],
                "contexts": [c.to_dict() for c in self.contexts], "learned": self.learned, "estimate": self.estimate,
                **({"arm_estimates": self.arm_estimates} if self.arm_estimates is not None else {})}

    @functools.cached_property
    def sha256(self) -> str:
        """The checksum its file carries (the canonical JSON of ``to_dict``): the policy's identity, as ``serve``
        reports the policy it serves (computed once)."""
        return _digest(self.to_dict())

    def to_json(self) -> str:
        """The file's text: the document with its ``sha256``, indented for reading."""
        doc = self.to_dict()
        doc["sha256"] = _digest(doc)
        return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the file atomically (``iapo_gym.atomic``); returns the path."""
        path = Path(path)
        text = self.to_json()
        load_text(text, str(path))  # what is written must read back
        return atomic_write_text(path, text)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PolicyFile:
        """Read and check a policy file (schema, consistency, checksum)."""
        return load_policy(path)


# ---- reading -------------------------------------------------------------------------------------------


def schema() -> dict[str, Any]:
    """The JSON Schema of the policy file (``iapo_gym/policy.schema.json``)."""
    return schemas.load("iapo_gym", SCHEMA_FILE)


def _digest(doc: Mapping[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def load_policy(path: str | os.PathLike[str]) -> PolicyFile:
    """Read and check the policy file at ``path``; a ``PolicyFileError`` says what is wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyFileError(f"cannot read policy file {path}: {exc}") from None
    return load_text(text, str(path))


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


def load_text(text: str, where: str = "policy") -> PolicyFile:
    """Parse and check the text of a policy file (``where`` names it in errors)."""
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # also nesting too deep and integers of over 4300 digits
        raise PolicyFileError(f"{where}: not a valid JSON policy file ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PolicyFileError(f"{where}: not an iapo-gym policy file (expected \"format\": \"{FORMAT}\", "
                              f"got {doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r})")
    if isinstance(doc.get("version"), bool) or doc.get("version") not in READS:
        raise PolicyFileError(f"{where}: policy file version {doc.get('version')!r} is not supported by this "
                              f"iapo-gym (it reads versions {', '.join(map(str, READS))}); use the release that "
                              "wrote it")
    schemas.check("iapo_gym", SCHEMA_FILE, doc, where, PolicyFileError)
    try:
        digest = _digest(doc)
    except (ValueError, UnicodeEncodeError) as exc:  # 1e999 parsed as infinity, a lone surrogate escape
        raise PolicyFileError(f"{where}: holds a value JSON cannot carry ({exc})") from None
    if doc["sha256"] != digest:
        raise PolicyFileError(f"{where}: the checksum does not match the content: the file was modified after it "
                              "was written (write policies with iapo-gym optimize or Policy.save, not by hand)")
    try:
        return PolicyFile(
            task=doc["task"], aggregator=doc["aggregator"], api=doc["api"], n_max=doc["n_max"],
            objectives=tuple(doc["objectives"]), scorer=doc["scorer"], sampling=doc["sampling"],
            prompts=tuple(PolicyPrompt(p["id"], p.get("template"),
                                       tuple((m["role"], m["content"]) for m in p.get("messages", ())))
                          for p in doc["prompts"]),
            contexts=tuple(PolicyContext(c["name"], tuple(float(w) for w in c["objective_weights"]),
                                         float(c["cost_weight"]), float(c["probability"]), c["prompt"], int(c["n"]),
                                         c["value"]["mean"], c["value"]["stderr"], c["value"]["optimal"],
                                         c["value"].get("completions"), c["value"].get("expected_drawn"),
                                         _rule_of(c.get("rule")), c["value"].get("exact_drawn"),
                                         c["value"].get("exact_cost"))
                           for c in doc["contexts"]),
            learned=doc["learned"], estimate=doc["estimate"], iapo_gym_version=doc["iapo_gym_version"],
            arm_estimates=doc.get("arm_estimates"))
    except PolicyFileError as exc:
        raise PolicyFileError(f"{where}: {exc}") from None
    except OverflowError as exc:  # an integer weight or probability beyond the float range
        raise PolicyFileError(f"{where}: a number of a context is out of range ({exc})") from None


def _rule_of(doc: Mapping[str, Any] | None) -> PolicyRule | None:
    """A context's ``rule`` field as read (the schema checked its shape; ``_check_rule`` its meaning)."""
    if doc is None:
        return None
    tau = doc.get("tau")
    return PolicyRule(doc["name"], dict(doc["params"]), None if tau is None else float(tau))


def _check_rule(pf: PolicyFile, c: PolicyContext, fail: Any) -> None:
    """The context's stopping rule is a rule of the policy's aggregator with valid parameters, and a Best-of-N
    threshold carries its finite tau (and only a threshold has one)."""
    from iapo_gym.rules import BON_RULES, MV_RULES, Threshold

    rule = c.rule
    assert rule is not None
    try:
        made = rule.make()
    except ValueError as exc:
        fail(f"context {c.name!r}: field 'rule' ({rule.to_dict()}): {exc}")
    kinds = {type(r) for r in (MV_RULES if pf.aggregator == "mv" else BON_RULES)}
    if type(made) not in kinds:
        fail(f"context {c.name!r}: field 'rule.name' {rule.name!r} is not a stopping rule of the {pf.aggregator} "
             f"aggregator (its rules: {sorted(k.name for k in kinds)})")
    if isinstance(made, Threshold):
        if rule.tau is None or not math.isfinite(rule.tau):
            fail(f"context {c.name!r}: field 'rule.tau' must be a finite number for a threshold rule (the utility at "
                 f"which a completion stops the draws), got {rule.tau!r}")
    elif rule.tau is not None:
        fail(f"context {c.name!r}: field 'rule.tau' is for a Best-of-N threshold rule only, not {rule.name!r}")


def _check_consistent(pf: PolicyFile, where: str) -> None:
    """Cross-field rules the schema cannot state."""
    def fail(message: str) -> None:
        raise PolicyFileError(message)

    if pf.aggregator not in ("mv", "bon"):
        fail(f"aggregator must be 'mv' or 'bon', got {pf.aggregator!r}")
    if pf.n_max < 1:
        fail(f"n_max must be >= 1, got {pf.n_max}")
    ids = [p.id for p in pf.prompts]
    if len(set(ids)) != len(ids):
        fail(f"prompt ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    kinds = {("completions" if p.template is not None else "chat") for p in pf.prompts if p.servable}
    if len(kinds) > 1:
        fail("prompts mix templates (completions API) and chat messages; one policy uses one API")
    if kinds and pf.api not in kinds:
        fail(f"api is {pf.api!r} but the prompts are written for the {kinds.pop()} API")
    for p in pf.prompts:
        if p.template is not None and "{query}" not in p.template:
            fail(f"prompt {p.id!r}: the template has no {{query}} placeholder")
        if p.messages and not any("{query}" in c for _, c in p.messages):
            fail(f"prompt {p.id!r}: no message has the {{query}} placeholder")
    if pf.scorer is not None:
        if pf.aggregator == "mv" and "extractor" not in pf.scorer:
            fail("a majority-vote policy's scorer must name an answer extractor")
        if pf.aggregator == "bon" and "extractor" in pf.scorer:
            fail("a Best-of-N policy's scorer must be a callable or a reward_url, not an extractor")
        if pf.aggregator == "bon" and (pf.scorer.get("callable") is None) == (pf.scorer.get("reward_url") is None):
            fail("a Best-of-N policy's scorer needs exactly one of 'callable' and 'reward_url'")
    names = [c.name for c in pf.contexts]
    if len(set(names)) != len(names):
        fail(f"context names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    total = 0.0
    for c in pf.contexts:
        if c.prompt not in ids:
            fail(f"context {c.name!r} uses prompt {c.prompt!r}, which is not among the prompts {ids}")
        if not 1 <= c.n <= pf.n_max:
            fail(f"context {c.name!r} has N = {c.n}, expected 1..{pf.n_max}")
        if len(c.objective_weights) != len(pf.objectives):
            fail(f"context {c.name!r} has {len(c.objective_weights)} objective weights, expected one per objective "
                 f"{list(pf.objectives)}")
        numbers = (*c.objective_weights, c.cost_weight, c.probability)
        if not all(math.isfinite(x) for x in numbers):
            fail(f"context {c.name!r} has a weight or probability that is not finite: {numbers}")
        if c.rule is not None:
            _check_rule(pf, c, fail)
        total += c.probability
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        fail(f"context probabilities sum to {total}, expected 1")
    if pf.arm_estimates is not None:
        _check_arm_estimates(pf, ids, fail)


def _check_arm_estimates(pf: PolicyFile, ids: list[str], fail: Any) -> None:
    """Every estimated prompt is a prompt of the policy, once; each query counts some completions, one per outcome."""
    if pf.n_max > MAX_RATED_N:
        fail(f"arm_estimates: n_max {pf.n_max} is above {MAX_RATED_N}, too large to rate arms by")
    seen: set[str] = set()
    for e in pf.arm_estimates["prompts"] if pf.arm_estimates else ():
        pid = e.get("id")
        if pid not in ids or pid in seen:
            fail(f"arm_estimates: prompt {pid!r} is not a prompt of the policy {ids}, or is listed twice")
        seen.add(pid)
        if not math.isfinite(e["cost"]):
            fail(f"arm_estimates: prompt {pid!r} has a cost that is not finite")
        outcomes = e.get("outcomes")
        if (outcomes is None) != (pf.aggregator == "mv"):
            fail(f"arm_estimates: prompt {pid!r}: outcomes are listed for Best-of-N policies only")
        if outcomes is not None and any(len(o) != len(pf.objectives) or not all(math.isfinite(x) for x in o)
                                        for o in outcomes):
            fail(f"arm_estimates: prompt {pid!r}: each outcome needs {len(pf.objectives)} finite objective scores")
        for row in e["queries"]:
            if sum(row) < 1:
                fail(f"arm_estimates: prompt {pid!r} lists a query with no completion")
            if outcomes is not None and len(row) != len(outcomes):
                fail(f"arm_estimates: prompt {pid!r} has a query with {len(row)} counts for its {len(outcomes)} "
                     "outcomes")


# ---- writing from a trained policy ---------------------------------------------------------------------


def describe(arms: Sequence[Sequence[int]], source: Any, *, spec: Any = None, learned: Mapping[str, Any] | None = None,
             estimate: Mapping[str, Any] | None = None, context_values: Sequence[Mapping[str, Any]] | None = None,
             exact: bool = True) -> PolicyFile:
    """The policy file of ``arms`` (one (prompt index, N) or (prompt index, N, rule index) per context) learned on
    ``source``; a rule index r > 0 indexes the source's stopping rules (``IAPOEnv.rules``, else the aggregator's
    family) and is written as the context's ``rule``, with its tau for a Best-of-N threshold.

    ``source`` is the env the policy was trained on (an ``IAPOEnv``, a ``LiveEnv``, or a wrapper),
    or its ``OutcomeTable``. ``spec`` (a collection ``Spec``; a ``LiveEnv``'s own by default)
    supplies the prompt texts, the scorer and the sampling; its prompt ids must be the table's.
    Without an explicit ``estimate``, an env whose completion source has an exact oracle (and
    ``exact=True``) gives the exact test-split values; a live env gives none (``iapo-gym optimize --check K`` measures them).
    """
    env = getattr(source, "unwrapped", source)
    table = getattr(env, "table", env)
    for attr in ("context_weights", "context_names", "context_probs", "prompts", "n_max", "aggregator"):
        if not hasattr(table, attr):
            raise TypeError(f"describe needs an env or OutcomeTable as source, got {type(source).__name__}")
    if spec is None:
        spec = getattr(env, "llm_spec", None)
    n_c = len(table.context_names)
    if any(len(a) not in (2, 3) for a in arms):
        raise ValueError(f"policy arms must be (prompt, N) or (prompt, N, rule), got {list(arms)[:5]}")
    pairs = [(int(a[0]), int(a[1])) for a in arms]
    rule_index = [int(a[2]) if len(a) == 3 else 0 for a in arms]
    if len(pairs) != n_c:
        raise ValueError(f"the policy has {len(pairs)} arms, the source has {n_c} contexts")
    for c, (p, n) in enumerate(pairs):
        if not (0 <= p < len(table.prompts) and 1 <= n <= table.n_max):
            raise ValueError(f"policy arm {(p, n)} for context {c} is outside prompts [0, {len(table.prompts)}) x "
                             f"N [1, {table.n_max}]")
    rules = _rules_of(env, table, rule_index)
    prompts, api, scorer, sampling = _prompts_from(table, spec)
    values: list[dict[str, Any]] = [dict(v) for v in context_values] if context_values is not None else \
        [{} for _ in range(n_c)]
    est: dict[str, Any] = dict(estimate) if estimate is not None else {"method": None}
    if estimate is None and exact and getattr(getattr(env, "source", None), "exact", False):  # its oracle answers
        est, values = exact_estimate(env, [(p, n, r) for (p, n), r in zip(pairs, rule_index, strict=True)]
                                     if any(rule_index) else pairs)
    weights = table.context_weights
    contexts = tuple(
        PolicyContext(name=str(table.context_names[c]), objective_weights=tuple(float(w) + 0.0 for w in weights[c, :-1]),
                      cost_weight=float(weights[c, -1]) + 0.0, probability=float(table.context_probs[c]),
                      prompt=str(table.prompts[pairs[c][0]]), n=pairs[c][1], value=_num(values[c].get("mean")),
                      stderr=_num(values[c].get("stderr")), optimal=_num(values[c].get("optimal")),
                      completions=values[c].get("completions"), rule=rules[c],
                      exact_drawn=_num(values[c].get("drawn")), exact_cost=_num(values[c].get("cost")))
        for c in range(n_c))
    return PolicyFile(task=str(table.task), aggregator=str(table.aggregator), api=api, n_max=int(table.n_max),
                      objectives=tuple(str(o) for o in table.objective_names), scorer=scorer, sampling=sampling,
                      prompts=tuple(prompts), contexts=contexts,
                      learned=dict(learned or {}), estimate=est)


def _rules_of(env: Any, table: Any, rule_index: Sequence[int]) -> list[PolicyRule | None]:
    """Each context's ``PolicyRule`` (None for rule 0, fixed N) from its index into the env's stopping rules, with
    the context's tau for a Best-of-N threshold (``iapo_gym.rules.context_thresholds``, as the env's steps use)."""
    if not any(rule_index):
        return [None] * len(rule_index)
    from iapo_gym.rules import Threshold, context_thresholds, default_rules

    family = tuple(getattr(env, "rules", None) or default_rules(str(table.aggregator)))
    bad = [(c, r) for c, r in enumerate(rule_index) if not 0 <= r < len(family)]
    if bad:
        raise ValueError(f"policy rule {bad[0][1]} for context {bad[0][0]} is outside the source's stopping rules "
                         f"[0, {len(family)})")
    taus = context_thresholds(table, family)[0] if any(isinstance(r, Threshold) for r in family) else None
    out: list[PolicyRule | None] = []
    for c, r in enumerate(rule_index):
        rule = family[r]
        tau = float(taus[c, r]) if taus is not None and isinstance(rule, Threshold) else None
        out.append(None if r == 0 else PolicyRule(rule.name, rule.params(), tau))
    return out


def _num(value: Any) -> float | None:
    return None if value is None else float(value)


def _prompts_from(table: Any, spec: Any) -> tuple[list[PolicyPrompt], str | None, dict[str, Any] | None,
                                                  dict[str, Any] | None]:
    """The prompts (with texts when a spec gives them), the API, the scorer and the sampling."""
    if spec is None:
        return [PolicyPrompt(str(p)) for p in table.prompts], None, None, None
    spec_ids = [p.id for p in spec.prompts]
    if list(spec_ids) != [str(p) for p in table.prompts]:
        raise ValueError(f"the spec's prompts {spec_ids} are not the table's {list(table.prompts)} (same ids, same "
                         "order): give the spec the table was collected with")
    if spec.aggregator != table.aggregator:
        raise ValueError(f"the spec's aggregator {spec.aggregator!r} is not the table's {table.aggregator!r}")
    prompts = [PolicyPrompt(p.id, p.text, tuple(p.messages)) for p in spec.prompts]
    sc = spec.scorer
    if spec.aggregator == "mv":
        scorer: dict[str, Any] = {"extractor": sc.extractor, "choices": sc.choices}
        if sc.pattern is not None:
            scorer["pattern"] = sc.pattern
    else:
        scorer = {"callable": sc.callable, "reward_url": sc.reward_url, "objectives": list(sc.objectives),
                  "grid": sc.grid, "score_range": list(sc.score_range) if sc.score_range is not None else None}
    return prompts, spec.endpoint.api, scorer, json.loads(json.dumps(spec.sampling.as_dict()))


def exact_estimate(env: Any, arms: Sequence[Sequence[int]], split: str = "test") -> tuple[dict[str, Any],
                                                                                         list[dict[str, Any]]]:
    """Exact test ACR, optimal ACR and regret of ``arms`` from ``env.q_table(split)``, and per-context values.

    Arms (p, N, r) with a stopping rule: the values and the optimum are over the arms with rules
    (``env.q_table(split, rules=True)``), and each context's value also gives ``drawn`` and ``cost``, the exact
    expected completions its arm draws under its rule and their expected cost (``iapo_gym.oracle.expected_cost``).
    """
    import numpy as np

    table = env.table
    index = np.asarray(arms, dtype=np.int64)
    index = index.reshape(len(index), -1) if index.size else index.reshape(0, 2)
    with_rules = index.shape[1] == 3
    q = np.asarray(env.q_table(split, rules=True) if with_rules else env.q_table(split))
    rows = np.arange(q.shape[0])
    chosen = q[rows, index[:, 0], index[:, 1] - 1, index[:, 2]] if with_rules else q[rows, index[:, 0], index[:, 1] - 1]
    top = q.reshape(q.shape[0], -1).max(axis=1)
    acr, best = float(np.dot(table.context_probs, chosen)), float(np.dot(table.context_probs, top))
    values, optimal = [float(v) for v in chosen], [float(v) for v in top]
    where = split if table.split is not None else "all"
    est = {"method": "exact", "split": where, "acr": acr, "stderr": 0.0, "optimal_acr": best, "regret": best - acr,
           "queries": int(len(env.queries(split)))}
    out: list[dict[str, Any]] = [{"mean": v, "stderr": 0.0, "optimal": o} for v, o in zip(values, optimal, strict=True)]
    if with_rules:
        arm = (rows, index[:, 0], index[:, 1] - 1, index[:, 2])
        drawn = np.asarray(env.expected_drawn(split))[arm]
        cost = np.asarray(env.expected_cost(split))[arm]
        for v, d, k in zip(out, drawn, cost, strict=True):
            v.update(drawn=float(d), cost=float(k))
    return est, out
