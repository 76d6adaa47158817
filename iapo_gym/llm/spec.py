"""The collection spec: one TOML (or JSON) file naming the endpoints, prompts, queries, sampling, budget and scorer.

Everything is checked before any request is sent: first against ``spec.schema.json`` (shipped in
this package: the one statement of each field's type and range), then for the rules between
fields; a bad spec raises ``SpecError`` naming the file and the field. A spec names one
``[endpoint]`` or several ``[[endpoints]]``; its arms (``Spec.prompts``) are the (endpoint,
prompt) pairs. The API key is never part of the spec: the spec names the environment variable
that holds it, and ``Spec.llm_route``/``Spec.reward_route`` decide which variable's value goes to
which host.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from iapo_gym import schemas
from iapo_gym.data.build import BuildOptions, jsonl_objects

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

#: Extractors a majority-vote scorer may name.
EXTRACTORS = ("last_number", "boxed", "choice", "regex")
AGGREGATORS = ("mv", "bon")
APIS = ("completions", "chat")
SAMPLING_KEYS = ("temperature", "max_tokens", "top_p", "seed", "stop")
#: The host of the OpenAI API: the only endpoint a spec's own base_url may name that gets OPENAI_API_KEY.
OPENAI_HOST = "api.openai.com"
#: The spec's JSON Schema, shipped beside this module.
SCHEMA_FILE = "spec.schema.json"
#: The currency of the endpoints' prices when the spec names none.
DEFAULT_CURRENCY = "USD"


class SpecError(ValueError):
    """A collection spec is invalid; the message names the file and the field."""


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: an OpenAI-compatible server, and how hard to push it."""

    base_url: str
    model: str
    api_key_env: str | None = None
    api: str = "completions"
    concurrency: int = 4
    timeout: float = 60.0
    max_retries: int = 6
    backoff: float = 0.5
    max_backoff: float = 30.0
    use_n: str = "auto"  # "auto": try n, fall back to one request per completion; "yes"; "no"
    id: str = ""  # the endpoint's name in arm ids ("" for the single [endpoint] form)
    input_price_per_million: float | None = None  # price of a million prompt tokens (None: no prices)
    output_price_per_million: float | None = None  # price of a million completion tokens

    @property
    def priced(self) -> bool:
        """Whether the spec gives this endpoint's prices."""
        return self.input_price_per_million is not None and self.output_price_per_million is not None

    def price(self, prompt_tokens: Any, completion_tokens: Any) -> Any:
        """The money of completions with these token counts (numbers or numpy arrays), in the spec's currency."""
        if not self.priced:
            raise ValueError(f"endpoint {self.id or self.base_url!r} has no prices (input_price_per_million, "
                             "output_price_per_million)")
        assert self.input_price_per_million is not None and self.output_price_per_million is not None
        return (prompt_tokens * self.input_price_per_million
                + completion_tokens * self.output_price_per_million) / 1e6


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters sent with every request (seed per completion is derived from ``seed``)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The parameters as sent (and as keyed in the cache)."""
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.seed is not None:
            out["seed"] = self.seed
        if self.stop:
            out["stop"] = list(self.stop)
        return out


@dataclass(frozen=True)
class Budget:
    """The hard spending cap of one run: requests sent and completion tokens (None = no cap)."""

    max_requests: int | None = None
    max_tokens_total: int | None = None
    price_per_1k_tokens: float = 0.0


@dataclass(frozen=True)
class Prompt:
    """A prompt template: ``text`` for the completions API or chat ``messages``, with ``{query}``."""

    id: str
    text: str | None = None
    messages: tuple[tuple[str, str], ...] = ()
    endpoint: int = 0  # the arm's endpoint: an index into ``Spec.endpoints``

    def render(self, query: str) -> str | list[dict[str, str]]:
        """The request body's prompt (a string) or messages (a list), with the query filled in."""
        if self.text is not None:
            return self.text.replace("{query}", query)
        return [{"role": role, "content": content.replace("{query}", query)} for role, content in self.messages]


@dataclass(frozen=True)
class Query:
    """One query: its id, text and (majority vote) gold answer, optional stored split."""

    id: str
    text: str
    gold: str | None = None
    split: str | None = None


@dataclass(frozen=True)
class Scorer:
    """How completions become outcomes: an answer extractor (mv) or objective scores (bon)."""

    extractor: str | None = None
    pattern: str | None = None
    choices: str = "ABCDE"
    reward_url: str | None = None
    callable: str | None = None
    objectives: tuple[str, ...] = ()
    grid: float | None = BuildOptions.grid  # the table builder's --grid
    score_range: tuple[float, float] | None = None
    api_key_env: str | None = None  # the reward endpoint's own key variable (it never gets the LLM's key)


def origin(url: str) -> str:
    """``scheme://host:port`` of a URL (default ports filled in): the unit a key is issued for."""
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme, 0)
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"


@dataclass(frozen=True)
class Route:
    """Where one endpoint's requests go and which environment variable's value they carry as the key.

    ``key_env`` None: no ``Authorization`` header at all. ``why`` says which rule chose the key.
    """

    role: str  # "LLM endpoint" or "reward endpoint"
    url: str
    key_env: str | None
    why: str

    @property
    def origin(self) -> str:
        """``scheme://host:port`` of ``url``: a request elsewhere (a redirect) never gets the key."""
        return origin(self.url)

    def key(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The key's value now (None when no variable is named or it is unset or empty); never store it."""
        if self.key_env is None:
            return None
        return (os.environ if environ is None else environ).get(self.key_env) or None

    def describe(self, environ: Mapping[str, str] | None = None) -> str:
        """One line for ``--dry-run``: the host and the NAME of the key variable (never its value)."""
        if self.key_env is None:
            key = "no key"
        else:
            state = "set" if self.key(environ) else "NOT SET: no key is sent"
            key = f"key from ${self.key_env} ({state})"
        return f"{self.role}: {self.origin} ({self.url}), {key}; {self.why}"


@dataclass(frozen=True)
class Context:
    """A user context of the spec's tables and envs: objective weights, the cost weight (<= 0), its probability."""

    name: str
    objective_weights: tuple[float, ...]
    cost_weight: float
    probability: float


def cost_weight(value_per_quality: float) -> float:
    """The cost weight at which one unit of quality (the weighted objective score) is worth ``value_per_quality``.

    The utility ``quality + w_cost * N * cost`` prefers spending d more per request exactly when
    that buys more than ``d / value_per_quality`` of quality, so ``w_cost = -1 / value_per_quality``.
    """
    if isinstance(value_per_quality, bool) or not (math.isfinite(value_per_quality) and value_per_quality > 0):
        raise ValueError(f"value_per_quality must be a finite number > 0 (money per unit of quality), "
                         f"got {value_per_quality!r}")
    return -1.0 / float(value_per_quality)


@dataclass(frozen=True)
class Build:
    """Options passed to the table builder (``iapo_gym.data.build``), by default the builder's own."""

    top_k: int = BuildOptions.top_k
    cost_scale: float = BuildOptions.cost_scale
    test_fraction: float = BuildOptions.test_fraction
    seed: int = BuildOptions.seed


@dataclass(frozen=True)
class Spec:
    """A validated collection spec.

    ``prompts`` are the arms: with one endpoint the spec's prompts themselves; with several, every
    (endpoint, prompt) pair, endpoint-major, with id ``"<endpoint id>/<prompt id>"`` and
    ``Prompt.endpoint`` its endpoint's index. ``templates`` are the spec's own prompts. ``endpoint``
    is the endpoint this spec's client talks to (the first; ``for_endpoint`` picks another).
    """

    path: Path
    task: str
    aggregator: str
    n_max: int
    endpoint: Endpoint
    sampling: Sampling
    budget: Budget
    prompts: tuple[Prompt, ...]
    queries: tuple[Query, ...]
    scorer: Scorer
    build: Build = field(default_factory=Build)
    cache: Path | None = None
    live_cost: tuple[float, ...] | None = None
    endpoints: tuple[Endpoint, ...] = ()
    templates: tuple[Prompt, ...] = ()
    currency: str | None = None
    contexts: tuple[Context, ...] | None = None  # None: the task's default contexts

    def context_arrays(self) -> tuple[Any, tuple[str, ...], Any] | None:
        """The spec's ``[[contexts]]`` as (weights (C, K + 1), names, probabilities) numpy arrays, or None."""
        if self.contexts is None:
            return None
        import numpy as np

        weights = np.array([[*c.objective_weights, c.cost_weight] for c in self.contexts], dtype=np.float64)
        return weights, tuple(c.name for c in self.contexts), np.array([c.probability for c in self.contexts])

    def __post_init__(self) -> None:
        """A spec built with one endpoint and its prompts is the single-endpoint form."""
        if not self.endpoints:
            object.__setattr__(self, "endpoints", (self.endpoint,))
        if not self.templates:
            object.__setattr__(self, "templates", self.prompts)

    @property
    def priced(self) -> bool:
        """Whether every endpoint has prices, so costs are money (in ``currency``) rather than token counts."""
        return all(e.priced for e in self.endpoints)

    @property
    def cost_unit(self) -> str | None:
        """The unit of a completion's cost in the tables and envs of this spec: the currency, or None (normalized)."""
        return self.currency if self.priced else None

    def for_endpoint(self, index: int) -> Spec:
        """The spec whose ``endpoint`` (the one its client talks to) is ``endpoints[index]``."""
        return replace(self, endpoint=self.endpoints[index])

    def endpoint_of(self, prompt: Prompt) -> Endpoint:
        """The endpoint of an arm."""
        return self.endpoints[prompt.endpoint]

    def base_url(self, environ: Mapping[str, str] | None = None) -> str:
        """The endpoint: ``OPENAI_BASE_URL`` overrides the spec's ``base_url`` (single-endpoint specs only)."""
        env = os.environ if environ is None else environ
        return env.get("OPENAI_BASE_URL") or self.endpoint.base_url

    def llm_route(self, environ: Mapping[str, str] | None = None) -> Route:
        """Where LLM requests go and whose key they carry; a key only ever goes to the endpoint it was issued for.

        The variable the spec names (``endpoint.api_key_env``) wins. ``OPENAI_API_KEY`` is used only
        when the spec names none and the endpoint is the OpenAI API itself or came from
        ``OPENAI_BASE_URL`` in the same environment. A spec-named key is for the spec's host: if
        ``OPENAI_BASE_URL`` moves the requests to another host, that is refused (``SpecError``), as is
        ``OPENAI_BASE_URL`` with several endpoints (it cannot stand in for all of them).
        """
        env = os.environ if environ is None else environ
        ep = self.endpoint
        role = f"LLM endpoint {ep.id!r}" if len(self.endpoints) > 1 else "LLM endpoint"
        if len(self.endpoints) > 1 and env.get("OPENAI_BASE_URL"):
            raise SpecError(f"{self.path}: OPENAI_BASE_URL is set, but the spec names {len(self.endpoints)} endpoints "
                            "and one variable cannot replace them all; unset OPENAI_BASE_URL and give each "
                            "[[endpoints]] its base_url")
        url = self.base_url(env)
        from_env = bool(env.get("OPENAI_BASE_URL"))
        named = ep.api_key_env
        field = f"endpoints[{self.endpoints.index(ep)}].api_key_env" if len(self.endpoints) > 1 else \
            "endpoint.api_key_env"
        if named:
            if from_env and origin(url) != origin(ep.base_url):
                raise SpecError(f"{self.path}: OPENAI_BASE_URL ({origin(url)}) overrides endpoint.base_url "
                                f"({origin(ep.base_url)}), but the key in endpoint.api_key_env = {named!r} "
                                "is for the spec's host; unset OPENAI_BASE_URL, or remove api_key_env to send "
                                "OPENAI_API_KEY with it")
            return Route(role, url, named, f"the spec's {field}")
        if from_env:
            return Route(role, url, "OPENAI_API_KEY", "the endpoint came from OPENAI_BASE_URL")
        if (urlsplit(url).hostname or "").lower() == OPENAI_HOST:
            return Route(role, url, "OPENAI_API_KEY", f"the endpoint is the OpenAI API ({OPENAI_HOST})")
        return Route(role, url, None, f"the spec names no {field} and the endpoint is not "
                     "the OpenAI API, so OPENAI_API_KEY is not sent")

    def llm_routes(self, environ: Mapping[str, str] | None = None) -> tuple[Route, ...]:
        """The route of every endpoint, in the spec's order."""
        return tuple(self.for_endpoint(i).llm_route(environ) for i in range(len(self.endpoints)))

    def reward_route(self) -> Route | None:
        """The reward endpoint's route (Best-of-N with ``scorer.reward_url``): only ``scorer.api_key_env``, if named."""
        if self.scorer.reward_url is None:
            return None
        named = self.scorer.api_key_env
        return Route("reward endpoint", self.scorer.reward_url, named,
                     "the spec's scorer.api_key_env" if named else
                     "the spec names no scorer.api_key_env (a reward endpoint never gets an LLM key)")


def schema() -> dict[str, Any]:
    """The JSON Schema of the collection spec (``iapo_gym/llm/spec.schema.json``)."""
    return schemas.load("iapo_gym.llm", SCHEMA_FILE)


def _finite_everywhere(data: Any, where: str, path: tuple[Any, ...] = ()) -> None:
    """Refuse NaN and infinity anywhere (TOML and JSON both spell them; the schema's ranges cannot)."""
    if isinstance(data, float) and not math.isfinite(data):
        raise SpecError(f"{where}: field {schemas.dotted(path)!r} must be a finite number, got {data!r}")
    if isinstance(data, dict):
        for key, value in data.items():
            _finite_everywhere(value, where, (*path, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            _finite_everywhere(value, where, (*path, i))


def check_schema(data: Any, where: str) -> None:
    """Check a parsed spec against ``spec.schema.json``; a ``SpecError`` names the first bad field."""
    if not isinstance(data, dict):
        raise SpecError(f"{where}: the spec must be a table of settings, got {type(data).__name__}")
    _finite_everywhere(data, where)
    schemas.check("iapo_gym.llm", SCHEMA_FILE, data, where, SpecError)


def load_spec(path: str | os.PathLike[str]) -> Spec:
    """Read and validate a spec file (``.toml`` or ``.json``); relative paths resolve from its folder."""
    path = Path(path)
    where = str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError(f"cannot read spec {path}: {exc}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        except (ValueError, RecursionError) as exc:  # not UTF-8, integers of over 4300 digits, nesting too deep
            raise SpecError(f"{where}: not readable JSON ({str(exc)[:200]})") from None
    else:
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # TOMLDecodeError, not UTF-8, too deep, too many digits
            raise SpecError(f"{where}: not valid TOML ({str(exc)[:300]})") from None
    return parse_spec(data, path)


def _fail(where: str, dotted: str, message: str) -> None:
    raise SpecError(f"{where}: field {dotted!r} {message}")


def parse_spec(data: Any, path: Path) -> Spec:
    """Validate a parsed spec document; ``path`` anchors relative file names and error messages."""
    where = str(path)
    try:
        check_schema(data, where)
    except RecursionError:  # nesting deeper than the validator can follow
        raise SpecError(f"{where}: the spec is nested too deeply") from None
    task = data.get("task", path.stem)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", task):  # the default, the file's stem
        _fail(where, "task", f"must be letters, digits, '.', '_' or '-' (the file name {path.name!r} is not; "
                             "give task)")
    aggregator = data["aggregator"]
    endpoints = _endpoints(where, data)
    sampling = _sampling(data["sampling"])
    budget = _settings(Budget, data.get("budget", {}))
    templates = _prompts(where, data["prompts"], endpoints[0].api)
    if len(endpoints) > 1:
        prompts = tuple(Prompt(f"{e.id}/{t.id}", t.text, t.messages, endpoint=i)
                        for i, e in enumerate(endpoints) for t in templates)
    else:
        prompts = templates
    scorer = _scorer(where, data["scorer"], aggregator)
    try:
        queries = _queries(where, data["queries"], path.parent, aggregator)
    except SpecError as exc:  # a query file's own errors name that file; say which spec and field led there
        if where in str(exc):
            raise
        raise SpecError(f"{where}: field 'queries.path': {exc}") from None
    build = _settings(Build, data.get("build", {}))
    cache = data.get("cache")
    live_cost = data.get("live", {}).get("cost")
    if live_cost is not None:
        if len(live_cost) != len(prompts):
            what = f"arm ((endpoint, prompt) pair, {len(prompts)})" if len(endpoints) > 1 else \
                f"prompt ({len(prompts)})"
            _fail(where, "live.cost", f"must list one number >= 0 per {what}, got {live_cost!r}")
        live_cost = tuple(float(c) for c in live_cost)
    priced = [e.priced for e in endpoints]
    currency = data.get("currency")
    if any(priced):
        if not all(priced):
            bad = next(i for i, e in enumerate(endpoints) if not e.priced)
            half = next((e for e in endpoints if (e.input_price_per_million is None)
                         != (e.output_price_per_million is None)), None)
            name = f"endpoints[{bad}]" if "endpoints" in data else "endpoint"
            if half is not None:
                bad = endpoints.index(half)
                name = f"endpoints[{bad}]" if "endpoints" in data else "endpoint"
            _fail(where, name, "gives no price or half of one: give every endpoint both input_price_per_million "
                               "and output_price_per_million, or none of them (costs are then token counts)")
        currency = currency or DEFAULT_CURRENCY
    elif currency is not None:
        _fail(where, "currency", "names the unit of the endpoints' prices, but no endpoint gives "
                                 "input_price_per_million and output_price_per_million")
    contexts = _contexts(where, data["contexts"], aggregator, scorer) if "contexts" in data else None
    return Spec(path=path, task=task, aggregator=aggregator, n_max=data["n_max"], endpoint=endpoints[0],
                sampling=sampling, budget=budget, prompts=prompts, queries=queries, scorer=scorer, build=build,
                cache=(path.parent / cache) if cache else None, live_cost=live_cost, endpoints=endpoints,
                templates=templates, currency=currency, contexts=contexts)


def _contexts(where: str, items: list[dict[str, Any]], aggregator: str, scorer: Scorer) -> tuple[Context, ...]:
    """The ``[[contexts]]``: distinct names, one weight per objective, a cost weight, probabilities summing to 1."""
    k = 1 if aggregator == "mv" else len(scorer.objectives)
    given = ["probability" in item for item in items]
    if any(given) and not all(given):
        _fail(where, f"contexts[{given.index(False)}].probability", "is missing: give a probability for every "
                                                                    "context or for none (then they are uniform)")
    out: list[Context] = []
    for i, item in enumerate(items):
        name = f"contexts[{i}]"
        if any(c.name == item["name"] for c in out):
            _fail(where, f"{name}.name", f"repeats context name {item['name']!r}")
        if ("cost_weight" in item) == ("value_per_quality" in item):
            _fail(where, f"{name}.cost_weight", "or 'value_per_quality' must be given (exactly one of them)")
        if "objective_weights" in item:
            weights = tuple(float(w) for w in item["objective_weights"])
            if k and len(weights) != k:
                _fail(where, f"{name}.objective_weights", f"must list one weight per objective ({k}), got "
                                                          f"{list(weights)}")
        elif k:
            weights = (1.0 / k,) * k
        else:
            _fail(where, f"{name}.objective_weights", "is needed: the scorer names no objectives "
                                                      "(give scorer.objectives or the weights)")
        wc = float(item["cost_weight"]) if "cost_weight" in item else cost_weight(float(item["value_per_quality"]))
        prob = float(item.get("probability", 1.0 / len(items)))
        out.append(Context(item["name"], weights, wc + 0.0, prob))
    if len({len(c.objective_weights) for c in out}) > 1:
        _fail(where, "contexts", "must give every context the same number of objective weights")
    total = sum(c.probability for c in out)
    if abs(total - 1.0) > 1e-6:
        _fail(where, "contexts", f"probabilities sum to {total!r}, expected 1")
    return tuple(out)


_T = TypeVar("_T")


def _settings(cls: type[_T], table: Mapping[str, Any], **given: Any) -> _T:
    """The dataclass ``cls`` from a table of the spec: each field the table sets (an integer given for a
    ``float`` field as a float), ``given`` for the fields the parser derives, and the dataclass's own
    default for the rest: the defaults are stated once, in the dataclasses above (docs/collect.md lists them).
    """
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]  # every cls here is a dataclass
        if f.name in given or f.name not in table:
            continue
        value = table[f.name]
        values[f.name] = float(value) if value is not None and str(f.type).startswith("float") else value
    return cls(**values, **given)


def _endpoint(s: dict[str, Any], endpoint_id: str = "") -> Endpoint:
    return _settings(Endpoint, s, base_url=s["base_url"].rstrip("/"), id=endpoint_id)


def _endpoints(where: str, data: dict[str, Any]) -> tuple[Endpoint, ...]:
    """The ``[endpoint]`` or the ``[[endpoints]]`` (exactly one of the two forms), with distinct ids and one API."""
    if ("endpoint" in data) == ("endpoints" in data):
        _fail(where, "endpoint", "or 'endpoints' must be given (exactly one of them: one [endpoint] table, or "
                                 "several [[endpoints]] each with an id)")
    if "endpoint" in data:
        return (_endpoint(data["endpoint"]),)
    out: list[Endpoint] = []
    for i, item in enumerate(data["endpoints"]):
        if any(e.id == item["id"] for e in out):
            _fail(where, f"endpoints[{i}].id", f"repeats endpoint id {item['id']!r}")
        out.append(_endpoint(item, item["id"]))
        if out[-1].api != out[0].api:
            _fail(where, f"endpoints[{i}].api", f"is {out[-1].api!r}, but endpoints[0] uses {out[0].api!r}: the "
                                                "arms share the prompts, so every endpoint uses one API")
    return tuple(out)


def _sampling(s: dict[str, Any]) -> Sampling:
    if "stop" not in s:
        return _settings(Sampling, s)
    return _settings(Sampling, s, stop=(s["stop"],) if isinstance(s["stop"], str) else tuple(s["stop"]))


def _prompts(where: str, items: list[Any], api: str) -> tuple[Prompt, ...]:
    out: list[Prompt] = []
    for i, item in enumerate(items):
        name = f"prompts[{i}]"
        pid = item["id"]
        if any(p.id == pid for p in out):
            _fail(where, f"{name}.id", f"repeats prompt id {pid!r}")
        if ("template" in item) == ("messages" in item):
            _fail(where, f"{name}.template", "or 'messages' must be given (exactly one of them)")
        if "template" in item:
            if api != "completions":
                _fail(where, f"{name}.template", "is for api = 'completions'; the chat API needs 'messages'")
            out.append(Prompt(id=pid, text=item["template"]))
        else:
            if api != "chat":
                _fail(where, f"{name}.messages", "is for api = 'chat'; the completions API needs 'template'")
            pairs = tuple((m["role"], m["content"]) for m in item["messages"])
            if not any("{query}" in c for _, c in pairs):
                _fail(where, f"{name}.messages", "must contain the placeholder {query} in some message")
            out.append(Prompt(id=pid, messages=pairs))
    return tuple(out)


#: The scorer settings of majority vote; Best-of-N reads the others.
_MV_SCORER = ("extractor", "pattern", "choices")


def _scorer(where: str, s: dict[str, Any], aggregator: str) -> Scorer:
    def fail(key: str, message: str) -> None:
        _fail(where, f"scorer.{key}", message)

    if aggregator == "mv":
        if "extractor" not in s:
            fail("extractor", "is missing")
        extractor = s["extractor"]
        pattern = s.get("pattern")
        if extractor == "regex":
            if pattern is None:
                fail("pattern", "is needed by extractor 'regex'")
            try:
                re.compile(str(pattern))
            except (re.error, OverflowError, RecursionError) as exc:
                fail("pattern", f"is not a valid regular expression: {exc}")
        for key in ("reward_url", "callable", "api_key_env"):
            if key in s:
                fail(key, "is for Best-of-N (aggregator = 'bon'); majority vote uses 'extractor'")
        return _settings(Scorer, {k: v for k, v in s.items() if k in _MV_SCORER})
    reward_url, target = s.get("reward_url"), s.get("callable")
    if (reward_url is None) == (target is None):
        fail("callable", "or 'reward_url' must be given for Best-of-N (exactly one of them)")
    key_env = s.get("api_key_env")
    if key_env is not None and reward_url is None:
        fail("api_key_env", "names the reward endpoint's key; it needs 'reward_url'")
    if "extractor" in s:
        fail("extractor", "is for majority vote (aggregator = 'mv')")
    derived: dict[str, Any] = {}
    if "score_range" in s:
        rng = s["score_range"]
        if not rng[0] < rng[1]:
            fail("score_range", f"must be [low, high] with low < high, got {rng!r}")
        derived["score_range"] = (float(rng[0]), float(rng[1]))
    if "objectives" in s:
        derived["objectives"] = tuple(s["objectives"])
    if s.get("grid") is False:  # false: no binning
        derived["grid"] = None
    return _settings(Scorer, {k: v for k, v in s.items() if k not in _MV_SCORER}, **derived)


def _queries(where: str, s: dict[str, Any], base: Path, aggregator: str) -> tuple[Query, ...]:
    qpath = base / s["path"]
    limit = s.get("limit")
    try:
        handle = qpath.open(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        raise SpecError(f"{where}: field 'queries.path' names a queries file that cannot be read: {exc}") from None
    out: list[Query] = []
    seen: dict[str, int] = {}
    with handle:
        for lineno, here, rec in jsonl_objects(handle, qpath, SpecError):
            qid = rec.get("id")
            if isinstance(qid, bool) or not isinstance(qid, (str, int)) or not str(qid).strip():
                raise SpecError(f"{here}: field 'id' must be a non-empty string or integer, got {qid!r}")
            qid = str(qid).strip()
            if qid in seen:
                raise SpecError(f"{here}: field 'id' repeats query id {qid!r} of line {seen[qid]}")
            seen[qid] = lineno
            text = rec.get("text")
            if not isinstance(text, str) or not text:
                raise SpecError(f"{here}: field 'text' must be a non-empty string, got {text!r}")
            gold = rec.get("gold")
            if aggregator == "mv":
                if isinstance(gold, bool) or not isinstance(gold, (str, int, float)) or not str(gold).strip():
                    raise SpecError(f"{here}: field 'gold' is needed for majority vote (a string or number), got {gold!r}")
                gold = str(int(gold)) if isinstance(gold, float) and gold.is_integer() else str(gold).strip()
            split = rec.get("split")
            if split is not None and split not in ("train", "test"):
                raise SpecError(f"{here}: field 'split' must be 'train' or 'test', got {split!r}")
            out.append(Query(id=qid, text=text, gold=gold if aggregator == "mv" else None, split=split))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        _fail(where, "queries.path", f"names a queries file with no queries: {qpath}")
    if any(q.split for q in out) and not all(q.split for q in out):
        _fail(where, "queries.path", "gives 'split' for some queries but not all; give it for every query or none")
    return tuple(out)
