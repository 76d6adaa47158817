"""The collection spec: one TOML (or JSON) file naming the endpoint, prompts, queries, sampling, budget and scorer.

Everything is checked before any request is sent; a bad spec raises ``SpecError`` naming the field.
The API key is never part of the spec: the spec names the environment variable that holds it, and
``Spec.llm_route``/``Spec.reward_route`` decide which variable's value goes to which host.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from iapo_gym.data.build import jsonl_objects

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
    grid: float | None = 0.5
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
class Build:
    """Options passed to the table builder (``iapo_gym.data.build``)."""

    top_k: int = 4
    cost_scale: float = 0.01
    test_fraction: float = 0.2
    seed: int = 0


@dataclass(frozen=True)
class Spec:
    """A validated collection spec."""

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

    def base_url(self, environ: Mapping[str, str] | None = None) -> str:
        """The endpoint: ``OPENAI_BASE_URL`` overrides the spec's ``base_url``."""
        env = os.environ if environ is None else environ
        return env.get("OPENAI_BASE_URL") or self.endpoint.base_url

    def llm_route(self, environ: Mapping[str, str] | None = None) -> Route:
        """Where LLM requests go and whose key they carry; a key only ever goes to the endpoint it was issued for.

        The variable the spec names (``endpoint.api_key_env``) wins. ``OPENAI_API_KEY`` is used only
        when the spec names none and the endpoint is the OpenAI API itself or came from
        ``OPENAI_BASE_URL`` in the same environment. A spec-named key is for the spec's host: if
        ``OPENAI_BASE_URL`` moves the requests to another host, that is refused (``SpecError``).
        """
        env = os.environ if environ is None else environ
        url = self.base_url(env)
        from_env = bool(env.get("OPENAI_BASE_URL"))
        named = self.endpoint.api_key_env
        if named:
            if from_env and origin(url) != origin(self.endpoint.base_url):
                raise SpecError(f"{self.path}: OPENAI_BASE_URL ({origin(url)}) overrides endpoint.base_url "
                                f"({origin(self.endpoint.base_url)}), but the key in endpoint.api_key_env = {named!r} "
                                "is for the spec's host; unset OPENAI_BASE_URL, or remove api_key_env to send "
                                "OPENAI_API_KEY with it")
            return Route("LLM endpoint", url, named, "the spec's endpoint.api_key_env")
        if from_env:
            return Route("LLM endpoint", url, "OPENAI_API_KEY", "the endpoint came from OPENAI_BASE_URL")
        if (urlsplit(url).hostname or "").lower() == OPENAI_HOST:
            return Route("LLM endpoint", url, "OPENAI_API_KEY", f"the endpoint is the OpenAI API ({OPENAI_HOST})")
        return Route("LLM endpoint", url, None, "the spec names no endpoint.api_key_env and the endpoint is not "
                     "the OpenAI API, so OPENAI_API_KEY is not sent")

    def reward_route(self) -> Route | None:
        """The reward endpoint's route (Best-of-N with ``scorer.reward_url``): only ``scorer.api_key_env``, if named."""
        if self.scorer.reward_url is None:
            return None
        named = self.scorer.api_key_env
        return Route("reward endpoint", self.scorer.reward_url, named,
                     "the spec's scorer.api_key_env" if named else
                     "the spec names no scorer.api_key_env (a reward endpoint never gets an LLM key)")


class _Section:
    """Typed reads from one table of the spec; every error names ``section.key``."""

    def __init__(self, where: str, name: str, data: Any) -> None:
        self.where, self.name = where, name
        if not isinstance(data, dict):
            self.fail("", f"must be a table of settings, got {data!r}")
        self.data: dict[str, Any] = data

    def fail(self, key: str, message: str) -> None:
        dotted = f"{self.name}.{key}" if self.name and key else (self.name or key)
        raise SpecError(f"{self.where}: field {dotted!r} {message}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., *, required: bool = False) -> Any:
        if key not in self.data:
            if required or default is ...:
                self.fail(key, "is missing")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            self.fail(key, f"must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                self.fail(key, f"must be a finite number, got an integer of {len(str(value))} digits")
        if not isinstance(value, kinds):
            self.fail(key, f"must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        return value

    def positive_int(self, key: str, default: Any = ...) -> Any:
        value = self.get(key, int, default)
        if value is not None and value is not default and value < 1:
            self.fail(key, f"must be an integer >= 1, got {value!r}")
        return value

    def number(self, key: str, default: Any = ..., low: float = 0.0) -> Any:
        value = self.get(key, float, default)
        if value is not None and value is not default and not (math.isfinite(value) and value >= low):
            self.fail(key, f"must be a finite number >= {low}, got {value!r}")
        return value

    def unknown(self, allowed: tuple[str, ...]) -> None:
        extra = sorted(set(self.data) - set(allowed))
        if extra:
            self.fail(extra[0], f"is not a known setting (expected one of {', '.join(allowed)})")


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


def parse_spec(data: Any, path: Path) -> Spec:
    """Validate a parsed spec document; ``path`` anchors relative file names and error messages."""
    where = str(path)
    top = _Section(where, "", data)
    top.unknown(("task", "aggregator", "n_max", "endpoint", "sampling", "budget", "prompts", "queries",
                 "scorer", "build", "cache", "live"))
    task = top.get("task", str, path.stem)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", task):
        top.fail("task", f"must be letters, digits, '.', '_' or '-', got {task!r}")
    aggregator = top.get("aggregator", str, required=True)
    if aggregator not in AGGREGATORS:
        top.fail("aggregator", f"must be one of {AGGREGATORS}, got {aggregator!r}")
    n_max = top.positive_int("n_max")
    endpoint = _endpoint(_Section(where, "endpoint", top.get("endpoint", dict)))
    sampling = _sampling(_Section(where, "sampling", top.get("sampling", dict)))
    budget = _budget(_Section(where, "budget", top.get("budget", dict, {})))
    prompts = _prompts(where, top.get("prompts", list), endpoint.api)
    scorer = _scorer(_Section(where, "scorer", top.get("scorer", dict)), aggregator)
    try:
        queries = _queries(_Section(where, "queries", top.get("queries", dict)), path.parent, aggregator)
    except SpecError as exc:  # a query file's own errors name that file; say which spec and field led there
        if where in str(exc):
            raise
        raise SpecError(f"{where}: field 'queries.path': {exc}") from None
    b = _Section(where, "build", top.get("build", dict, {}))
    b.unknown(("top_k", "cost_scale", "test_fraction", "seed"))
    build = Build(top_k=b.positive_int("top_k", 4), cost_scale=b.number("cost_scale", 0.01),
                  test_fraction=b.number("test_fraction", 0.2), seed=b.get("seed", int, 0))
    if not 0.0 <= build.test_fraction < 1.0:
        b.fail("test_fraction", f"must be in [0, 1), got {build.test_fraction!r}")
    cache = top.get("cache", str, None)
    live = _Section(where, "live", top.get("live", dict, {}))
    live.unknown(("cost",))
    live_cost = live.get("cost", list, None)
    if live_cost is not None:
        if len(live_cost) != len(prompts) or not all(_finite(c) and c >= 0 for c in live_cost):
            live.fail("cost", f"must list one number >= 0 per prompt ({len(prompts)}), got {live_cost!r}")
        live_cost = tuple(float(c) for c in live_cost)
    return Spec(path=path, task=task, aggregator=aggregator, n_max=n_max, endpoint=endpoint, sampling=sampling,
                budget=budget, prompts=prompts, queries=queries, scorer=scorer, build=build,
                cache=(path.parent / cache) if cache else None, live_cost=live_cost)


def _finite(value: Any) -> bool:
    """A JSON/TOML number (not a bool) that is finite as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond the float range
        return False
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _endpoint(s: _Section) -> Endpoint:
    s.unknown(("base_url", "model", "api_key_env", "api", "concurrency", "timeout", "max_retries", "backoff",
               "max_backoff", "use_n"))
    base_url = s.get("base_url", str, required=True)
    if not re.match(r"https?://", base_url):
        s.fail("base_url", f"must start with http:// or https://, got {base_url!r}")
    api = s.get("api", str, "completions")
    if api not in APIS:
        s.fail("api", f"must be one of {APIS}, got {api!r}")
    use_n = s.get("use_n", str, "auto")
    if use_n not in ("auto", "yes", "no"):
        s.fail("use_n", f"must be 'auto', 'yes' or 'no', got {use_n!r}")
    max_retries = s.get("max_retries", int, 6)
    if max_retries < 0:
        s.fail("max_retries", f"must be an integer >= 0, got {max_retries!r}")
    timeout = s.number("timeout", 60.0)
    if timeout <= 0:
        s.fail("timeout", f"must be > 0 seconds, got {timeout!r}")
    key_env = s.get("api_key_env", str, None)
    if key_env is not None and not _ENV_NAME.fullmatch(key_env):
        s.fail("api_key_env", "must be the NAME of an environment variable (letters, digits, '_'); the value given "
               "is not one and is not shown, in case it is the key itself")
    return Endpoint(base_url=base_url.rstrip("/"), model=s.get("model", str, required=True),
                    api_key_env=key_env, api=api,
                    concurrency=s.positive_int("concurrency", 4), timeout=timeout, max_retries=max_retries,
                    backoff=s.number("backoff", 0.5), max_backoff=s.number("max_backoff", 30.0), use_n=use_n)


def _sampling(s: _Section) -> Sampling:
    s.unknown(SAMPLING_KEYS)
    stop = s.get("stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(x, str) and x for x in stop):
        s.fail("stop", f"must be a string or a list of non-empty strings, got {stop!r}")
    top_p = s.number("top_p", None)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        s.fail("top_p", f"must be in (0, 1], got {top_p!r}")
    return Sampling(max_tokens=s.positive_int("max_tokens"), temperature=s.number("temperature", 1.0),
                    top_p=top_p, seed=s.get("seed", int, None), stop=tuple(stop))


def _budget(s: _Section) -> Budget:
    s.unknown(("max_requests", "max_tokens_total", "price_per_1k_tokens"))
    return Budget(max_requests=s.positive_int("max_requests", None),
                  max_tokens_total=s.positive_int("max_tokens_total", None),
                  price_per_1k_tokens=s.number("price_per_1k_tokens", 0.0))


def _prompts(where: str, items: list[Any], api: str) -> tuple[Prompt, ...]:
    if not items:
        raise SpecError(f"{where}: field 'prompts' must list at least one prompt")
    out: list[Prompt] = []
    for i, item in enumerate(items):
        s = _Section(where, f"prompts[{i}]", item)
        s.unknown(("id", "template", "messages"))
        pid = s.get("id", str, required=True)
        if not pid.strip():
            s.fail("id", "is empty")
        if any(p.id == pid for p in out):
            s.fail("id", f"repeats prompt id {pid!r}")
        if ("template" in s.data) == ("messages" in s.data):
            s.fail("template", "or 'messages' must be given (exactly one of them)")
        if "template" in s.data:
            if api != "completions":
                s.fail("template", "is for api = 'completions'; the chat API needs 'messages'")
            text = s.get("template", str)
            if "{query}" not in text:
                s.fail("template", "must contain the placeholder {query}")
            out.append(Prompt(id=pid, text=text))
        else:
            if api != "chat":
                s.fail("messages", "is for api = 'chat'; the completions API needs 'template'")
            msgs = s.get("messages", list)
            pairs = []
            for j, m in enumerate(msgs):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    s.fail(f"messages[{j}]", f"must be a table with string 'role' and 'content', got {m!r}")
                pairs.append((m["role"], m["content"]))
            if not any("{query}" in c for _, c in pairs):
                s.fail("messages", "must contain the placeholder {query} in some message")
            out.append(Prompt(id=pid, messages=tuple(pairs)))
    return tuple(out)


def _scorer(s: _Section, aggregator: str) -> Scorer:
    s.unknown(("extractor", "pattern", "choices", "reward_url", "callable", "objectives", "grid", "score_range",
               "api_key_env"))
    if aggregator == "mv":
        extractor = s.get("extractor", str, required=True)
        if extractor not in EXTRACTORS:
            s.fail("extractor", f"must be one of {EXTRACTORS}, got {extractor!r}")
        pattern = s.get("pattern", str, None)
        if extractor == "regex":
            if pattern is None:
                s.fail("pattern", "is needed by extractor 'regex'")
            try:
                re.compile(str(pattern))
            except (re.error, OverflowError, RecursionError) as exc:
                s.fail("pattern", f"is not a valid regular expression: {exc}")
        choices = s.get("choices", str, "ABCDE")
        for key in ("reward_url", "callable", "api_key_env"):
            if key in s.data:
                s.fail(key, "is for Best-of-N (aggregator = 'bon'); majority vote uses 'extractor'")
        return Scorer(extractor=extractor, pattern=pattern, choices=choices)
    reward_url = s.get("reward_url", str, None)
    target = s.get("callable", str, None)
    if (reward_url is None) == (target is None):
        s.fail("callable", "or 'reward_url' must be given for Best-of-N (exactly one of them)")
    if target is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", target):
        s.fail("callable", f"must look like 'package.module:function', got {target!r}")
    if reward_url is not None and not re.match(r"https?://", reward_url):
        s.fail("reward_url", f"must start with http:// or https://, got {reward_url!r}")
    key_env = s.get("api_key_env", str, None)
    if key_env is not None:
        if reward_url is None:
            s.fail("api_key_env", "names the reward endpoint's key; it needs 'reward_url'")
        if not _ENV_NAME.fullmatch(key_env):
            s.fail("api_key_env", "must be the NAME of an environment variable (letters, digits, '_'); the value "
                   "given is not one and is not shown, in case it is the key itself")
    if "extractor" in s.data:
        s.fail("extractor", "is for majority vote (aggregator = 'mv')")
    objectives = s.get("objectives", list, [])
    if not all(isinstance(o, str) and o for o in objectives) or len(set(objectives)) != len(objectives):
        s.fail("objectives", f"must be distinct non-empty names, got {objectives!r}")
    grid = s.get("grid", (float, bool), 0.5)
    if grid is False:
        grid = None
    elif isinstance(grid, bool) or not (math.isfinite(grid) and grid > 0):
        s.fail("grid", f"must be a number > 0 or false (no binning), got {grid!r}")
    rng = s.get("score_range", list, None)
    if rng is not None:
        if len(rng) != 2 or not all(_finite(v) for v in rng) or not rng[0] < rng[1]:
            s.fail("score_range", f"must be [low, high] with low < high, got {rng!r}")
        rng = (float(rng[0]), float(rng[1]))
    return Scorer(reward_url=reward_url, callable=target, objectives=tuple(objectives), grid=grid, score_range=rng,
                  api_key_env=key_env)


def _queries(s: _Section, base: Path, aggregator: str) -> tuple[Query, ...]:
    s.unknown(("path", "limit"))
    qpath = base / s.get("path", str, required=True)
    limit = s.positive_int("limit", None)
    try:
        handle = qpath.open(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        s.fail("path", f"names a queries file that cannot be read: {exc}")
        raise AssertionError from None  # unreachable: fail raised
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
        s.fail("path", f"names a queries file with no queries: {qpath}")
    if any(q.split for q in out) and not all(q.split for q in out):
        s.fail("path", "gives 'split' for some queries but not all; give it for every query or none")
    return tuple(out)
