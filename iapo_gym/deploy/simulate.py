"""``iapo-gym simulate TABLE``: an outcome table as an OpenAI-compatible upstream (docs/simulate.md).

The server answers ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``n``, ``seed``, ``max_tokens``,
``stop``, ``stream`` and ``usage`` honoured) with completions drawn from the table, so ``collect``, ``optimize``
and ``serve`` run against it at zero token cost, and the expected utility of whatever they do is known exactly
from the table. Its collection spec (``spec_document``, written by ``iapo-gym simulate TABLE --write-spec``)
names the mapping both ways:

- a request's prompt is matched against the spec's templates (the longest template that matches wins), which
  gives the table's prompt (by id) and the query text; the query text names a query of the table by the spec's
  ``queries`` file, and any other text goes to a query of ``split`` by its SHA-256;
- majority vote: answer bucket m of query q is the text ``ANSWER_FORMATS[extractor]`` of its label, which the
  spec's extractor reads back: the spec's gold answer for the gold bucket, and for the others the candidates
  (the integers 0, 1, 2, ... or the ``choice`` letters) in order, skipping the gold answer (tables store no
  answer text, so the labels are these deterministic ones);
- Best-of-N: each completion carries its id ``[iapo-sim P:Q:M]`` (table indices) and ``POST /v1/reward``, the
  spec's ``scorer.reward_url``, answers ``{"scores": {objective: atoms[P, Q, M, k]}}`` for it;
- usage: a completion of (p, q) has ``round(cost[p, q] / scale * TOKENS_AT_MAX)`` completion tokens (``scale``
  the largest mean cost of a prompt over the queries), at most the request's ``max_tokens``; the prompt has
  ceil(UTF-8 bytes / 4) tokens. The spec's ``build.cost_scale`` (or, for a table whose cost has a unit, its
  prices) turns the tokens back into the table's costs.

Draws: request t (its number among the completion requests answered, from 0) takes its outcomes from
``derive_rng(seed, SIM_KEY, "request", t)``, or with a ``seed`` in the request from ``derive_rng(seed, SIM_KEY,
"seed", request seed, p, q)``: the same seed and prompt give the same completions (within a schedule segment).
A schedule (``iapo_gym.online.schedule``: ``drift``, ``arrival``) applies by t: request t is drawn from the
table of the segment holding t (the last one past the horizon); a prompt that has not arrived is refused.

The HTTP layer is ``serve``'s (``iapo_gym.deploy.app``: the Host check, single headers, the body's size and
time; ``iapo_gym.deploy.connections``: the connection bounds under uvicorn); it binds 127.0.0.1 by default.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from iapo_gym.atomic import atomic_write_bytes
from iapo_gym.deploy.app import JSON, answered_hosts, host_refusal, read_body, starlette_app
from iapo_gym.deploy.limits import ServeLimits
from iapo_gym.deploy.params import RequestError
from iapo_gym.deploy.stream import cut
from iapo_gym.llm.scoring import make_extractor
from iapo_gym.llm.spec import Spec, load_spec
from iapo_gym.online.schedule import Schedule, build_schedule
from iapo_gym.seeding import derive_rng
from iapo_gym.tables import OutcomeTable, read_table

__all__ = ["ANSWER_FORMATS", "MAX_N", "REWARD_PATH", "SCHEDULES", "SIM_KEY", "TOKENS_AT_MAX", "SimulateApp",
           "SimulateError", "Simulator", "load_simulated_table", "prompt_template", "query_text",
           "spec_document", "write_spec", "in_memory_spec", "schedule_of"]

#: The key of every draw's generator (``derive_rng(seed, SIM_KEY, ...)``).
SIM_KEY = "iapo_gym.deploy.simulate"
#: Completion tokens of a completion of the dearest prompt (on average over its queries).
TOKENS_AT_MAX = 1000
#: The largest ``n`` of one request (at least the table's N_max).
MAX_N = 128
#: The reward endpoint of a Best-of-N table (the spec's ``scorer.reward_url``).
REWARD_PATH = "/v1/reward"
#: The schedules that apply to an upstream (``context_shift`` changes the callers' mix, not the upstream).
SCHEDULES = ("stationary", "drift", "arrival")
#: The text of a majority-vote completion whose answer is ``{}``, by the spec's extractor.
ANSWER_FORMATS = {"last_number": "The answer is {}.", "boxed": "The answer is \\boxed{{{}}}.",
                  "choice": "The answer is ({}).", "regex": "{}"}
#: A Best-of-N completion's id: the table's prompt, query and atom indices.
COMPLETION_ID = re.compile(r"\[iapo-sim (\d+):(\d+):(\d+)\]")
#: Request fields read; the sampling ones a table cannot apply are accepted and have no effect.
FIELDS = frozenset({"model", "prompt", "messages", "n", "seed", "max_tokens", "max_completion_tokens", "stop",
                    "stream", "stream_options", "temperature", "top_p", "frequency_penalty", "presence_penalty",
                    "user", "logprobs", "echo", "best_of", "suffix"})
_MESSAGE_SEP, _ROLE_SEP = "\x1e", "\x1f"  # a chat's messages as one text, to match against the templates


class SimulateError(ValueError):
    """A table, spec or option ``simulate`` cannot use; the message names it and what was expected."""


# ---- the table and its spec ----------------------------------------------------------------------------------
def load_simulated_table(text: str) -> OutcomeTable:
    """The table ``TABLE`` names: an ``.h5`` file, ``generated:FAMILY:LEVEL`` or a task name."""
    if text.strip().lower().startswith("generated:"):
        from iapo_gym.tasks.generated import FamilyError, check_level, level_table

        _, family, level = (text.strip().split(":", 2) + ["", ""])[:3]
        try:
            return level_table(family, check_level(int(level)))
        except (ValueError, FamilyError) as exc:
            raise SimulateError(f"TABLE {text!r}: {exc} (expected generated:FAMILY:LEVEL, e.g. "
                                "generated:mv_categorical:2)") from None
    path = Path(os.path.expanduser(text))
    if path.suffix in (".h5", ".hdf5") or path.is_file():
        return read_table(path)
    from iapo_gym.data import load_task_table

    return load_task_table(text)


def prompt_template(prompt_id: str) -> str:
    """The written spec's template of a prompt (completions API)."""
    return f"[{prompt_id}] {{query}}\nAnswer:"


def query_text(query_id: str) -> str:
    """The written spec's text of a query."""
    return f"Question {query_id}?"


def _candidates(extractor: str, choices: str) -> list[str]:
    """The deterministic answer labels, in order: letters for ``choice``, else the integers 0, 1, 2, ..."""
    return list(choices) if extractor == "choice" else [str(i) for i in range(4096)]


def _token_counts(table: OutcomeTable) -> tuple[np.ndarray, float]:
    """Completion tokens per (prompt, query) and the cost ``scale`` that ``TOKENS_AT_MAX`` stands for."""
    cost = np.asarray(table.cost_matrix(), dtype=np.float64)
    scale = float(cost.mean(axis=1).max())
    if scale <= 0:
        return np.ones(cost.shape, dtype=np.int64), 0.0
    return np.rint(cost / scale * TOKENS_AT_MAX).astype(np.int64), scale


def spec_document(table: OutcomeTable, *, host: str = "127.0.0.1", port: int = 8080, api: str = "completions",
                  extractor: str = "last_number", model: str | None = None,
                  queries_file: str = "queries.jsonl") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The collection spec of the simulated upstream of ``table`` and the rows of its queries file.

    The endpoint is ``http://HOST:PORT/v1`` with ``use_n = "yes"``; one prompt per table prompt (completions API:
    ``prompt_template``; chat: a system message naming the prompt, the query as the user's message); the table's
    queries (``query_text``, the gold answer's label, the table's split); the table's contexts; majority vote:
    ``extractor``; Best-of-N: ``reward_url`` at ``REWARD_PATH``, the objectives, exact scores (``grid = false``)
    and their range. ``build.top_k`` keeps every answer bucket, and the costs come back through
    ``build.cost_scale`` (or prices, for a table whose cost has a unit).
    """
    if api not in ("completions", "chat"):
        raise SimulateError(f"--api must be 'completions' or 'chat', got {api!r}")
    if extractor not in ANSWER_FORMATS:
        raise SimulateError(f"--extractor must be one of {list(ANSWER_FORMATS)}, got {extractor!r}")
    tokens, scale = _token_counts(table)
    task = re.sub(r"[^A-Za-z0-9._-]+", "-", table.task).strip("-._") or "simulated"
    endpoint: dict[str, Any] = {"base_url": f"http://{host}:{port}/v1", "model": model or f"iapo-sim/{task}",
                                "api": api, "use_n": "yes", "concurrency": 8, "max_retries": 2}
    doc: dict[str, Any] = {"task": f"sim-{task}", "aggregator": table.aggregator, "n_max": table.n_max,
                           "endpoint": endpoint,
                           "sampling": {"max_tokens": int(max(tokens.max(), 1)), "temperature": 1.0, "seed": 0}}
    if api == "completions":
        doc["prompts"] = [{"id": p, "template": prompt_template(p)} for p in table.prompts]
    else:
        doc["prompts"] = [{"id": p, "messages": [{"role": "system", "content": f"You answer as prompt {p}."},
                                                 {"role": "user", "content": "{query}"}]} for p in table.prompts]
    doc["queries"] = {"path": queries_file}
    if table.aggregator == "mv":
        doc["scorer"] = {"extractor": extractor}
        if extractor == "regex":
            doc["scorer"]["pattern"] = r"(-?\d+)"
        doc["build"] = {"top_k": max(1, table.n_atoms - 1)}
    else:
        assert table.atoms is not None
        low, high = float(table.atoms.min()), float(table.atoms.max())
        doc["scorer"] = {"reward_url": f"http://{host}:{port}{REWARD_PATH}", "objectives": list(table.objective_names),
                         "grid": False, "score_range": [low, high if high > low else low + 1.0]}
        doc["build"] = {}
    if table.cost_unit is not None and scale > 0:
        doc["currency"] = table.cost_unit
        endpoint.update(input_price_per_million=0.0, output_price_per_million=scale * 1e6 / TOKENS_AT_MAX)
    else:
        doc["build"]["cost_scale"] = scale
    if table.split is None:
        doc["build"]["test_fraction"] = 0.0
    doc["contexts"] = [{"name": name, "objective_weights": [float(w) for w in weights[:-1]],
                        "cost_weight": min(float(weights[-1]), 0.0) + 0.0, "probability": float(prob)}
                       for name, weights, prob in zip(table.context_names, table.context_weights,
                                                      table.context_probs, strict=True)]
    candidates = _candidates(extractor, "ABCDE")
    rows: list[dict[str, Any]] = []
    for q, qid in enumerate(table.queries):
        row: dict[str, Any] = {"id": qid, "text": query_text(qid)}
        if table.aggregator == "mv":
            assert table.gold is not None
            if table.n_atoms > len(candidates):
                raise SimulateError(f"the extractor {extractor!r} has {len(candidates)} answer labels, but the table "
                                    f"has {table.n_atoms} answer buckets; use --extractor last_number")
            row["gold"] = candidates[int(table.gold[q])]
        if table.split is not None:
            row["split"] = "test" if int(table.split[q]) else "train"
        rows.append(row)
    return doc, rows


def write_spec(path: str | os.PathLike[str], table: OutcomeTable, **options: Any) -> tuple[Path, Path]:
    """Write ``spec_document(table, **options)`` as JSON to ``path`` and its queries beside it
    (``<stem>.queries.jsonl``), each atomically; returns both paths."""
    path = Path(path)
    if path.suffix.lower() != ".json":
        raise SimulateError(f"--write-spec writes a JSON spec; give a path ending in .json, got {str(path)!r}")
    queries = path.with_name(path.stem + ".queries.jsonl")
    doc, rows = spec_document(table, queries_file=queries.name, **options)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(queries, "".join(json.dumps(r) + "\n" for r in rows).encode())
    atomic_write_bytes(path, (json.dumps(doc, indent=1) + "\n").encode())
    return path, queries


def in_memory_spec(table: OutcomeTable, host: str, port: int, **options: Any) -> Spec:
    """The spec ``write_spec`` would write, parsed (and so checked) by the spec's own reader; its messages name it
    as that spec (the temporary file is gone)."""
    with tempfile.TemporaryDirectory(prefix="iapo-sim-") as folder:
        spec = load_spec(write_spec(Path(folder) / "spec.json", table, host=host, port=port, **options)[0])
    return replace(spec, path=Path("<the spec of --write-spec>"))


# ---- the simulated model -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Template:
    prompt: int  # the table's prompt index
    pattern: re.Pattern[str]
    literal: int  # characters outside the placeholders: the longer, the more specific


def _compile(text: str, prompt: int) -> _Template:
    parts = text.split("{query}")  # the first placeholder catches the query, the others repeat it
    body = re.escape(parts[0]) + "(?P<q>.*)" + re.escape(parts[1]) + "".join("(?P=q)" + re.escape(p)
                                                                            for p in parts[2:])
    return _Template(prompt, re.compile(body, re.S), sum(len(p) for p in parts))


def _chat_key(messages: list[tuple[str, str]]) -> str:
    return _MESSAGE_SEP.join(f"{role}{_ROLE_SEP}{content}" for role, content in messages)


@dataclass
class Drawn:
    """One request's draws: the table's prompt and query, the schedule segment, the outcomes, the texts."""

    request: int
    segment: int
    prompt: int
    query: int
    outcomes: np.ndarray
    texts: list[str]
    completion_tokens: list[int]


class Simulator:
    """A table as a model: the spec's templates and queries map a request to (prompt, query); draws follow the
    module docstring."""

    def __init__(self, table: OutcomeTable, spec: Spec, *, schedule: Schedule | None = None, seed: int = 0,
                 split: str = "all") -> None:
        """Check that ``spec`` names this table's prompts and queries; raise ``SimulateError`` naming what does
        not fit."""
        where = str(spec.path)
        if spec.aggregator != table.aggregator:
            raise SimulateError(f"{where}: the spec's aggregator is {spec.aggregator!r}, the table's "
                                f"{table.aggregator!r}")
        if len(spec.endpoints) > 1:
            raise SimulateError(f"{where}: the spec names {len(spec.endpoints)} endpoints; a simulated upstream is "
                                "one endpoint (one table)")
        if table.aggregator == "bon" and spec.scorer.reward_url is None:
            raise SimulateError(f"{where}: a Best-of-N table is scored by its reward endpoint; the spec's scorer "
                                f"must name reward_url (http://HOST:PORT{REWARD_PATH})")
        self.table, self.spec, self.schedule, self.seed = table, spec, schedule, int(seed)
        self.model = spec.endpoint.model
        self.api = spec.endpoint.api
        prompt_index = {pid: i for i, pid in enumerate(table.prompts)}
        templates: list[_Template] = []
        for prompt in spec.prompts:
            if prompt.id not in prompt_index:
                raise SimulateError(f"{where}: prompt {prompt.id!r} is not a prompt of the table "
                                    f"({len(table.prompts)} prompts, e.g. {table.prompts[0]!r})")
            p = prompt_index[prompt.id]
            text = prompt.text if prompt.text is not None else _chat_key(list(prompt.messages))
            templates.append(_compile(text, p))
        self.templates = sorted(templates, key=lambda t: -t.literal)
        query_index = {qid: q for q, qid in enumerate(table.queries)}
        self.query_of: dict[str, int] = {}
        gold_text: dict[int, str] = {}
        for query in spec.queries:
            if query.id not in query_index:
                raise SimulateError(f"{where}: query {query.id!r} is not a query of the table "
                                    f"({len(table.queries)} queries, e.g. {table.queries[0]!r})")
            q = query_index[query.id]
            self.query_of[query.text] = q
            if query.gold is not None:
                gold_text[q] = query.gold
        self.split = table.split_indices(split)
        self.tokens, _ = _token_counts(table)
        self.labels: dict[int, list[str]] = {}
        self._gold_text = gold_text
        if table.aggregator == "mv":
            extractor = spec.scorer.extractor or "last_number"
            self.answer_format = ANSWER_FORMATS[extractor]
            self.extract = make_extractor(spec.scorer)
            self.candidates = _candidates(extractor, spec.scorer.choices)
            for q in range(table.n_queries):  # every label is checked now: a mapping that fails, fails at startup
                self.labels_of(q)
        self._cdf: dict[int, np.ndarray] = {}
        self.requests = 0

    # ---- the mapping ---------------------------------------------------------------------------------
    def labels_of(self, q: int) -> list[str]:
        """The answer label of each bucket of query ``q`` (module docstring), checked against the extractor."""
        found = self.labels.get(q)
        if found is not None:
            return found
        assert self.table.gold is not None
        gold = int(self.table.gold[q])
        gold_text = self._gold_text.get(q)
        if gold_text is None:
            gold_text = self.candidates[gold] if gold < len(self.candidates) else str(gold)
        others = iter(c for c in self.candidates if c != gold_text)
        labels = []
        for m in range(self.table.n_atoms):
            label = gold_text if m == gold else next(others, None)
            if label is None:
                raise SimulateError(f"the extractor {self.spec.scorer.extractor!r} has too few answer labels for "
                                    f"the {self.table.n_atoms} buckets of query {self.table.queries[q]!r}")
            read = self.extract(self.answer_format.format(label))
            if read != label:
                raise SimulateError(f"{self.spec.path}: the extractor {self.spec.scorer.extractor!r} reads {read!r} "
                                    f"from the completion {self.answer_format.format(label)!r}, not the answer "
                                    f"{label!r} of query {self.table.queries[q]!r}; use an extractor that reads it "
                                    "(last_number, boxed, choice)")
            labels.append(label)
        self.labels[q] = labels
        return labels

    def bucket_of(self, q: int, answer: str | None) -> int | None:
        """The bucket of query ``q`` whose label is ``answer`` (None: no bucket has it)."""
        labels = self.labels_of(q)
        return labels.index(answer) if answer in labels else None

    def match(self, prompt: str | list[tuple[str, str]]) -> tuple[int, int]:
        """The table's (prompt, query) of a request's prompt text (a string) or chat messages (role, content)."""
        if isinstance(prompt, str):
            if self.api == "chat":
                raise RequestError(400, "this simulator's spec uses the chat API: POST /v1/chat/completions with "
                                        "messages", "wrong_api", "prompt")
            text = prompt
        elif self.api == "chat":
            text = _chat_key(prompt)
        elif len(prompt) == 1 and prompt[0][0] == "user":  # one user message holding a completions template
            text = prompt[0][1]
        else:
            raise RequestError(400, "this simulator's spec uses the completions API: send one user message holding "
                                    "the rendered template, or POST /v1/completions", "invalid_messages", "messages")
        for template in self.templates:
            found = template.pattern.fullmatch(text)
            if found is not None:
                return template.prompt, self.query_index(found.group("q"))
        raise RequestError(400, f"the prompt matches none of the {len(self.templates)} templates of this simulator's "
                                "spec (iapo-gym simulate TABLE --write-spec SPEC.json writes them)", "unknown_prompt",
                           "messages" if not isinstance(prompt, str) else "prompt")

    def query_index(self, text: str) -> int:
        """The table's query of a query text: the spec's query with this text, else a query of the split chosen by
        the text's SHA-256."""
        q = self.query_of.get(text)
        if q is not None:
            return q
        digest = int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "little")
        return int(self.split[digest % len(self.split)])

    # ---- the draws -----------------------------------------------------------------------------------
    def segment_at(self, t: int) -> int:
        """The schedule's segment of request ``t`` (the last one past the horizon; 0 without a schedule)."""
        if self.schedule is None:
            return 0
        return self.schedule.segment_at(min(t, self.schedule.horizon - 1))

    def probs(self, segment: int) -> np.ndarray:
        """The (P, Q, M) outcome distributions of a segment."""
        if self.schedule is None:
            return self.table.probs
        return self.schedule.table_at(self.table, segment).probs

    def _cumulative(self, segment: int) -> np.ndarray:
        found = self._cdf.get(segment)
        if found is None:
            found = self._cdf[segment] = np.cumsum(self.probs(segment), axis=2)
        return found

    def draw(self, p: int, q: int, n: int, seed: int | None, max_tokens: int | None) -> Drawn:
        """Request number ``self.requests``'s ``n`` completions of (p, q); refused (400) when p has not arrived."""
        t = self.requests
        segment = self.segment_at(t)
        if self.schedule is not None and not bool(self.schedule.segments[segment].available[p]):
            arrives = int(self.schedule.arrival[p])
            raise RequestError(400, f"prompt {self.table.prompts[p]!r} is not available at request {t}: it arrives at "
                                    f"request {arrives} (schedule {self.schedule.kind!r})", "prompt_not_available",
                               "prompt")
        self.requests += 1
        rng = derive_rng(self.seed, SIM_KEY, "request", t) if seed is None else \
            derive_rng(self.seed, SIM_KEY, "seed", seed % (1 << 64), p, q)
        cdf = self._cumulative(segment)[p, q]
        outcomes = np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"), self.table.n_atoms - 1)
        if self.table.aggregator == "mv":
            labels = self.labels_of(q)
            texts = [self.answer_format.format(labels[m]) for m in outcomes]
        else:
            texts = [f"Completion {m} of prompt {self.table.prompts[p]} [iapo-sim {p}:{q}:{m}]" for m in outcomes]
        tokens = int(self.tokens[p, q])
        used = tokens if max_tokens is None else min(tokens, max_tokens)
        return Drawn(t, segment, p, q, outcomes, texts, [used] * n)

    def scores(self, completion: str) -> dict[str, float]:
        """A Best-of-N completion's objective scores, by the id it carries."""
        found = COMPLETION_ID.findall(completion)
        if not found:
            raise RequestError(400, "the completion carries no id [iapo-sim P:Q:M] of this simulator", "unknown_completion",
                               "completion")
        p, q, m = (int(x) for x in found[-1])
        n_p, n_q, n_m = self.table.shape
        if not (p < n_p and q < n_q and m < n_m):
            raise RequestError(400, f"the completion id [iapo-sim {p}:{q}:{m}] is outside this table's "
                                    f"{n_p} prompts x {n_q} queries x {n_m} outcomes", "unknown_completion",
                               "completion")
        assert self.table.atoms is not None
        vector = self.table.atoms[p, q, m]
        return {name: float(v) for name, v in zip(self.table.objective_names, vector, strict=True)}

    def describe(self) -> dict[str, Any]:
        """The table, the model name and the schedule's segments (``GET /health``)."""
        out: dict[str, Any] = {"task": self.table.task, "aggregator": self.table.aggregator, "model": self.model,
                               "api": self.api, "requests": self.requests}
        if self.schedule is not None:
            s = self.schedule
            out["schedule"] = {"kind": s.kind, "horizon": s.horizon, "params": s.params, "segments": [
                {"start": g.start, "stop": g.stop, "weight": g.weight,
                 "available": [self.table.prompts[i] for i in np.flatnonzero(g.available)]} for g in s.segments],
                "drifting": [self.table.prompts[i] for i in np.flatnonzero(s.drifting)]}
        return out


# ---- requests ------------------------------------------------------------------------------------------------
def _integer(body: Mapping[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(400, f"{name} must be an integer {bound}, got {value!r}", "invalid_value", name)
    return value


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(400, f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", "invalid_value",
                           name)


@dataclass
class SimRequest:
    """A request's model, prompt (text or chat messages) and the parameters the simulator applies."""

    model: str
    prompt: str | list[tuple[str, str]]
    n: int
    seed: int | None
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def read_sim_request(body: Any, chat: bool, max_n: int) -> SimRequest:
    """Check a completion request's body (400 naming the field and what was expected)."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}", "invalid_json")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise RequestError(400, f"unknown parameter {unknown[0]!r}; this simulator reads {', '.join(sorted(FIELDS))}",
                           "unknown_parameter", unknown[0])
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise RequestError(400, "model must be a non-empty string", "invalid_value", "model")
    prompt: str | list[tuple[str, str]]
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise RequestError(400, "messages must be a non-empty list of {role, content} objects with string "
                                    "content", "invalid_messages", "messages")
        prompt = [(m["role"], m["content"]) for m in messages]
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1:
            raw = raw[0]
        if not isinstance(raw, str):
            raise RequestError(400, "prompt must be a string (or a list of one string)", "invalid_prompt", "prompt")
        prompt = raw
    n = _integer(body, "n", 1, max_n) or 1
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(400, f"seed must be an integer, got {seed!r}", "invalid_value", "seed")
    max_tokens = _integer(body, "max_completion_tokens", 1) if chat else None
    max_tokens = _integer(body, "max_tokens", 1) if max_tokens is None else max_tokens
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    _number(body, "frequency_penalty", -2.0, 2.0)
    _number(body, "presence_penalty", -2.0, 2.0)
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else () if stop is None else None
    if stops is None or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise RequestError(400, f"stop must be a string or a list of at most 4 non-empty strings, got {stop!r}",
                           "invalid_value", "stop")
    for name, fine in (("logprobs", lambda v: v in (None, False, 0)), ("echo", lambda v: v in (None, False)),
                       ("best_of", lambda v: v is None or v == n), ("suffix", lambda v: v is None)):
        if not fine(body.get(name)):
            raise RequestError(400, f"{name} is not supported by this simulator (got {body.get(name)!r})",
                               "unsupported_parameter", name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise RequestError(400, f"stream must be true or false, got {stream!r}", "invalid_value", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(400, f"stream_options must be an object, got {options!r}", "invalid_value", "stream_options")
    return SimRequest(body["model"], prompt, n, seed, max_tokens, stops, bool(stream), bool((options or {}).get("include_usage")))


def prompt_tokens(prompt: str | list[tuple[str, str]]) -> int:
    """The prompt's tokens as the simulator reports them: ceil(UTF-8 bytes / 4) of its text (a chat's contents)."""
    text = prompt if isinstance(prompt, str) else "".join(content for _, content in prompt)
    return -(-len(text.encode("utf-8", "surrogatepass")) // 4)


class SimulateApp:
    """The simulated upstream's ASGI app: the routes of the module docstring behind ``serve``'s HTTP layer."""

    def __init__(self, simulator: Simulator, *, limits: ServeLimits | None = None, api_key: str | None = None,
                 host: str = "127.0.0.1", max_n: int | None = None) -> None:
        """``api_key``: the key callers must send (None: none); ``host``: the bound address (Host headers)."""
        self.sim = simulator
        self.limits = limits or ServeLimits()
        self.expected = api_key.encode() if api_key else None
        self.max_n = max(MAX_N, simulator.table.n_max) if max_n is None else max_n
        self.hosts = answered_hosts(host, self.limits.allowed_hosts)
        model = {"id": simulator.model, "object": "model", "created": 0, "owned_by": "iapo-gym-simulate"}
        self._model = model
        self._models_body = json.dumps({"object": "list", "data": [model]}).encode()
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.list_models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"])]
        if simulator.table.aggregator == "bon":
            routes.append(Route(REWARD_PATH, self.reward, methods=["POST"]))
        self.asgi = starlette_app(routes, lifespan=self.lifespan,
                                  host_refused=lambda headers, count: host_refusal(self.hosts, headers, count),
                                  cors_origins=(), preflight=lambda path: False,
                                  body_limit=min(self.limits.body_timeout, self.limits.deadline))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI entry point."""
        await self.asgi(scope, receive, send)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: object) -> AsyncIterator[None]:
        """Nothing to open: the table is in memory."""
        yield

    def _check_key(self, request: Request) -> None:
        if self.expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self.expected)):
            raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key this "
                                    "simulator was started with (--api-key-env)", "invalid_api_key")

    async def _json(self, request: Request) -> Any:
        self._check_key(request)
        content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != JSON:
            raise RequestError(415, "the request body must be JSON sent with 'Content-Type: application/json'",
                               "unsupported_media_type")
        raw = await read_body(request, self.limits.max_body_bytes)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:
            reason = str(exc)[:200] if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
            raise RequestError(400, f"the request body is not valid JSON ({reason})", "invalid_json") from None

    async def list_models(self, request: Request) -> Response:
        """``GET /v1/models``: the one model, the spec's."""
        self._check_key(request)
        return Response(self._models_body, media_type=JSON)

    async def get_model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``."""
        self._check_key(request)
        if request.path_params["model"] != self.sim.model:
            raise RequestError(404, f"the model {request.path_params['model']!r} does not exist here; this "
                                    f"simulator's model is {self.sim.model!r}", "model_not_found", "model")
        return Response(json.dumps(self._model).encode(), media_type=JSON)

    async def health(self, request: Request) -> Response:
        """``GET /health``: ``ok``, and to a caller with the key (any caller without ``--api-key-env``) the table,
        the requests answered and the schedule's segments."""
        try:
            self._check_key(request)
        except RequestError:
            return Response(b'{"status": "ok"}', media_type=JSON)
        return Response(json.dumps({"status": "ok", **self.sim.describe()}).encode(), media_type=JSON)

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._complete(request, False)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._complete(request, True)

    async def _complete(self, request: Request, chat: bool) -> Response:
        asked = read_sim_request(await self._json(request), chat, self.max_n)
        if asked.model != self.sim.model:
            raise RequestError(404, f"the model {asked.model!r} does not exist here; this simulator's model is "
                                    f"{self.sim.model!r}", "model_not_found", "model")
        p, q = self.sim.match(asked.prompt)
        drawn = self.sim.draw(p, q, asked.n, asked.seed, asked.max_tokens)
        choices = []
        for i, (text, tokens) in enumerate(zip(drawn.texts, drawn.completion_tokens, strict=True)):
            text, was_cut = cut(text, asked.stop)
            capped = asked.max_tokens is not None and tokens >= asked.max_tokens and \
                tokens < int(self.sim.tokens[p, q])
            finish = "length" if capped and not was_cut else "stop"
            choices.append((i, text, finish))
        usage = {"prompt_tokens": prompt_tokens(asked.prompt), "completion_tokens": sum(drawn.completion_tokens)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        kind = "chat.completion" if chat else "text_completion"
        ident = f"{'chatcmpl' if chat else 'cmpl'}-sim-{drawn.request}"
        sim = {"request": drawn.request, "segment": drawn.segment, "prompt": self.sim.table.prompts[p],
               "query": self.sim.table.queries[q], "outcomes": [int(m) for m in drawn.outcomes]}
        created = int(time.time())
        if asked.stream:
            return Response(self._events(chat, ident, created, choices, usage if asked.include_usage else None),
                            media_type="text/event-stream; charset=utf-8", headers={"cache-control": "no-cache"})
        if chat:
            out = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                    "logprobs": None} for i, text, finish in choices]
        else:
            out = [{"index": i, "text": text, "finish_reason": finish, "logprobs": None} for i, text, finish in choices]
        answer = {"id": ident, "object": kind, "created": created, "model": self.sim.model, "choices": out,
                  "usage": usage, "iapo_sim": sim}
        return Response(json.dumps(answer).encode(), media_type=JSON)

    def _events(self, chat: bool, ident: str, created: int, choices: list[tuple[int, str, str]],
                usage: dict[str, int] | None) -> bytes:
        """A streamed answer in the OpenAI chunk format: each choice's text with its finish reason, then the usage
        chunk (with ``stream_options.include_usage``), then ``[DONE]``."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        events = []
        for i, text, finish in choices:
            choice: dict[str, Any] = {"index": i, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["delta"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            events.append({"id": ident, "object": kind, "created": created, "model": self.sim.model,
                           "choices": [choice]})
        if usage is not None:
            events.append({"id": ident, "object": kind, "created": created, "model": self.sim.model, "choices": [],
                           "usage": usage})
        return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"

    async def reward(self, request: Request) -> Response:
        """``POST /v1/reward`` (Best-of-N): ``{"query", "completion"}`` -> ``{"scores": {objective: score}}``."""
        body = await self._json(request)
        if not isinstance(body, dict) or not isinstance(body.get("completion"), str):
            raise RequestError(400, "the body must be an object with the string 'completion' (and 'query')",
                               "invalid_value", "completion")
        return Response(json.dumps({"scores": self.sim.scores(body["completion"])}).encode(), media_type=JSON)


def schedule_of(kind: str | None, horizon: int | None, table: OutcomeTable) -> Schedule | None:
    """The ``--schedule`` over ``--horizon`` requests (None: the table throughout)."""
    if kind is None or kind == "stationary":
        return None
    if kind not in SCHEDULES:
        raise SimulateError(f"--schedule must be one of {list(SCHEDULES)}, got {kind!r} (context_shift changes the "
                            "callers' context mix, which is no part of an upstream)")
    if horizon is None:
        raise SimulateError(f"--schedule {kind} needs --horizon T: its change points are fractions of T requests")
    return build_schedule(kind, table, horizon)
