"""Completions to outcomes: answer extractors for majority vote, objective scorers for Best-of-N.

A Best-of-N scorer is async: ``await scorer(completion, query) -> {objective: score}``. A Python
callable runs in a worker thread; a reward endpoint is posted to with the HTTP client ``openai`` is
built on (``httpx2``), under the same retry policy and concurrency limit as the LLM
endpoint (``iapo_gym.llm.retry``) and with its own key only (``Spec.reward_route``).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import re
from collections.abc import Callable
from typing import Any

from iapo_gym.llm.client import route_hook
from iapo_gym.llm.retry import EndpointError, Retrier, Retry, RetryPolicy, retry_after, retryable_status
from iapo_gym.llm.spec import Scorer, Spec
from iapo_gym.seeding import derive_rng

REWARD_RETRY_KEY = "iapo_gym.llm.reward_retry"

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _canonical_number(text: str) -> str:
    """``1,234.0`` -> ``1234``: numbers compare as the table builder compares them."""
    clean = text.replace(",", "")
    try:
        value = float(clean)
    except ValueError:
        return clean
    if math.isfinite(value) and value.is_integer():
        return str(int(value))
    return repr(value)


def last_number(text: str) -> str | None:
    """The last number in the text, canonical (integral values without a decimal point)."""
    found = _NUMBER.findall(text)
    return _canonical_number(found[-1]) if found else None


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces allowed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                inner = text[i + 1:j].strip()
                return (_canonical_number(inner) if _NUMBER.fullmatch(inner) else inner) or None
    return None


def choice_letter(text: str, choices: str = "ABCDE") -> str | None:
    """The last standalone choice letter (``(B)``, ``B.``, ``answer: B``)."""
    found = re.findall(rf"(?<![A-Za-z])([{re.escape(choices)}])(?![A-Za-z])", text)
    return found[-1] if found else None


def make_extractor(scorer: Scorer) -> Callable[[str], str | None]:
    """The majority-vote extractor the spec names."""
    if scorer.extractor == "last_number":
        return last_number
    if scorer.extractor == "boxed":
        return boxed
    if scorer.extractor == "choice":
        letters = scorer.choices
        return lambda text: choice_letter(text, letters)
    if scorer.extractor == "regex":
        pattern = re.compile(str(scorer.pattern))

        def regex(text: str) -> str | None:
            found = list(pattern.finditer(text))
            if not found:
                return None
            m = found[-1]
            value = m.group(1) if m.groups() else m.group(0)
            return value.strip() or None if value is not None else None
        return regex
    raise ValueError(f"unknown extractor {scorer.extractor!r}")


def _check_scores(scores: Any, objectives: tuple[str, ...], source: str) -> dict[str, float]:
    if not isinstance(scores, dict) or not scores:
        raise ValueError(f"{source} must return an object of named scores, got {scores!r}")
    out: dict[str, float] = {}
    for name, value in scores.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{source} gave score {name!r} = {value!r}; scores must be finite numbers")
        out[str(name)] = float(value)
    if objectives and set(out) != set(objectives):
        raise ValueError(f"{source} gave objectives {sorted(out)}, the spec names {sorted(objectives)}")
    return out


def http_module() -> Any:
    """``httpx2``, the HTTP library ``openai`` 3.x is built on (its ``AsyncClient`` posts to a reward endpoint)."""
    try:
        import httpx2
    except ImportError:
        raise ImportError('a reward endpoint needs httpx2: pip install "iapo-gym[llm]"') from None
    return httpx2


class CallableScorer:
    """``package.module:function`` as a scorer; each call runs in a worker thread (it may block)."""

    def __init__(self, scorer: Scorer) -> None:
        """Import the function now, so a bad name fails before any request."""
        assert scorer.callable is not None
        self.name = scorer.callable
        self.objectives = scorer.objectives
        module_name, attr = self.name.split(":", 1)
        try:
            self.fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"scorer.callable {self.name!r} cannot be loaded: {exc}") from None
        self.requests = self.retries = 0

    async def __call__(self, completion: str, query: str) -> dict[str, float]:
        """The completion's scores, checked against the spec's objectives."""
        return _check_scores(await asyncio.to_thread(self.fn, completion, query), self.objectives, self.name)

    async def aclose(self) -> None:
        """Nothing to release."""


class RewardScorer:
    """A reward endpoint (``POST {"query", "completion"}`` -> ``{"scores": {...}}``) with retries.

    The HTTP client opens on the first call, in the caller's event loop, and ``aclose`` closes it
    (a later call opens a new one). ``requests`` counts HTTP attempts, ``retries`` the retried ones.
    ``stop_on_failure``: as ``LLMClient``'s (a server sets it False, and its own ``policy``).
    """

    stop_on_failure = True

    def __init__(self, spec: Spec) -> None:
        """Bind to the spec's ``scorer.reward_url``, its key route and the endpoint's retry and concurrency settings."""
        route = spec.reward_route()
        assert route is not None
        self.route = route
        self.url = route.url
        self.objectives = spec.scorer.objectives
        ep = spec.endpoint
        self.policy = RetryPolicy.of(ep)
        self.timeout, self.concurrency = ep.timeout, ep.concurrency
        self._rng = derive_rng(spec.build.seed, REWARD_RETRY_KEY)
        self._http: Any = None
        self._client: Any = None
        self._retrier: Retrier | None = None
        self.requests = 0  # HTTP attempts

    def _open(self) -> None:
        self._http = http_module()
        self._client = self._http.AsyncClient(timeout=self.timeout, follow_redirects=False,
                                              event_hooks={"request": [route_hook(self.route)]})
        self._retrier = Retrier("the reward endpoint", self.url, self.policy, self._rng, self.concurrency,
                                stop_on_failure=self.stop_on_failure)

    @property
    def retries(self) -> int:
        """HTTP attempts retried so far (in the current client)."""
        return 0 if self._retrier is None else self._retrier.retries

    async def __call__(self, completion: str, query: str) -> dict[str, float]:
        """POST one completion, retrying connection errors, timeouts, 429 and 5xx; 4xx and exhaustion stop every call."""
        if self._client is None:
            self._open()
        assert self._retrier is not None
        body = {"query": query, "completion": completion}
        client, http = self._client, self._http

        async def attempt() -> dict[str, float]:
            self.requests += 1
            try:
                resp = await client.post(self.url, json=body)
            except http.TransportError as exc:  # refused, dropped, timed out
                raise Retry(exc, connection=True) from None
            if resp.status_code == 200:
                return self._scores(resp.content)
            if not retryable_status(resp.status_code):
                raise EndpointError(f"the reward endpoint {self.url} refused the request with HTTP "
                                    f"{resp.status_code}: {resp.text[:300]}", resp.status_code)
            raise Retry(EndpointError(f"HTTP {resp.status_code}: {resp.text[:300]}"),
                        server_asks=retry_after(resp.headers))
        return await self._retrier.call(attempt)

    def _scores(self, content: bytes) -> dict[str, float]:
        try:
            payload = json.loads(content)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"reward endpoint {self.url} answered with invalid JSON ({exc})") from None
        scores = payload.get("scores", payload) if isinstance(payload, dict) else payload
        return _check_scores(scores, self.objectives, f"reward endpoint {self.url}")

    async def aclose(self) -> None:
        """Close the HTTP client (idempotent)."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


def make_scorer(spec: Spec) -> CallableScorer | RewardScorer:
    """The spec's Best-of-N scorer: ``await scorer(completion, query) -> {objective: score}``."""
    if spec.scorer.callable is not None:
        return CallableScorer(spec.scorer)
    return RewardScorer(spec)
