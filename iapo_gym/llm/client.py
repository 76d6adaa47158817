"""The transport to an OpenAI-compatible endpoint: concurrency limit, retries, spending cap, ``n``, cache.

Built on ``openai.AsyncOpenAI`` with its own retries disabled (``max_retries=0``) so that every
HTTP attempt passes through the spending cap here: a request first reserves its worst case
(one request, ``n * max_tokens`` completion tokens), and settles with the server's ``usage``.
Connection errors, timeouts, 429 and 5xx are retried with exponential backoff and jitter
(honouring ``Retry-After``); any other 4xx stops at once with ``EndpointError``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from iapo_gym.llm.cache import ResponseCache, completion_key
from iapo_gym.llm.spec import Spec
from iapo_gym.seeding import derive_rng, derive_seed

RETRY_KEY = "iapo_gym.llm.retry"
#: Tokens a server may add past ``max_tokens`` per completion: llama.cpp finishes a multi-byte UTF-8
#: character (at most 3 more byte tokens), so the worst case reserved for a completion includes them.
OVERSHOOT_TOKENS = 3
SAMPLE_SEED_KEY = "iapo_gym.llm.sample"


class EndpointError(RuntimeError):
    """The endpoint refused a request for a reason retrying cannot fix (4xx other than 429), or retries ran out."""

    def __init__(self, message: str, status: int | None = None) -> None:
        """``status``: the endpoint's HTTP status of a refusal (None when retries ran out)."""
        super().__init__(message)
        self.status = status


class BudgetExhausted(RuntimeError):
    """The spending cap would be exceeded by the next request; nothing over the cap was sent."""


def require_openai() -> Any:
    """The ``openai`` module, or an ImportError naming the extra that provides it."""
    try:
        import openai
    except ImportError:
        raise ImportError('talking to an LLM endpoint needs the openai library: pip install "iapo-gym[llm]"') from None
    return openai


@dataclass
class Completion:
    """One completion: its text, completion tokens (the cost signal), finish reason, and whether it was cached.

    ``prompt_tokens`` is this completion's share of the request's prompt tokens (0 when cached).
    """

    text: str
    tokens: int
    finish: str | None
    cached: bool = False
    prompt_tokens: int = 0


class SpendingCap:
    """Requests and completion tokens spent, plus those reserved by in-flight requests; never above the cap."""

    def __init__(self, max_requests: int | None, max_tokens_total: int | None) -> None:
        """Caps of None are unlimited."""
        self.max_requests, self.max_tokens_total = max_requests, max_tokens_total
        self.requests = 0  # sent (each HTTP attempt counts)
        self.tokens = 0  # completion tokens settled
        self.reserved_tokens = 0  # worst case of in-flight requests

    def reserve(self, tokens: int) -> None:
        """Reserve one request of at most ``tokens`` completion tokens, or raise ``BudgetExhausted``."""
        if self.max_requests is not None and self.requests + 1 > self.max_requests:
            raise BudgetExhausted(f"the spending cap max_requests = {self.max_requests} is reached")
        if self.max_tokens_total is not None and self.tokens + self.reserved_tokens + tokens > self.max_tokens_total:
            raise BudgetExhausted(f"the spending cap max_tokens_total = {self.max_tokens_total} would be exceeded "
                                  f"({self.tokens} spent, {self.reserved_tokens} reserved in flight, "
                                  f"{tokens} more for the next request)")
        self.requests += 1
        self.reserved_tokens += tokens

    def fits(self, tokens: int) -> bool:
        """Whether one more request of at most ``tokens`` completion tokens would fit under the cap now."""
        if self.max_requests is not None and self.requests + 1 > self.max_requests:
            return False
        return self.max_tokens_total is None or self.tokens + self.reserved_tokens + tokens <= self.max_tokens_total

    def settle(self, reserved: int, used: int) -> None:
        """Replace a reservation by what the server reported."""
        self.reserved_tokens -= reserved
        self.tokens += used


class LLMClient:
    """Completions of rendered prompts, by sample index, through the cache and the spending cap.

    Use inside one event loop: ``async with LLMClient(spec) as client: await client.complete(...)``.
    ``latch_refusals``: after a refusal (4xx) nothing more is sent (a collection); a server sets it
    False so one caller's bad request does not stop the others.
    """

    latch_refusals = True

    def __init__(self, spec: Spec, cache: ResponseCache | None = None) -> None:
        """Bind to ``spec``'s endpoint (``OPENAI_BASE_URL``/``OPENAI_API_KEY`` override it) and budget."""
        self.spec = spec
        self.base_url = spec.base_url()
        self.cache = cache
        self.cap = SpendingCap(spec.budget.max_requests, spec.budget.max_tokens_total)
        self.sampling = spec.sampling.as_dict()
        # "auto": learn from the first multi-completion answer whether the server honours n
        self.n_supported: bool | None = {"auto": None, "yes": True, "no": False}[spec.endpoint.use_n]
        self._rng = derive_rng(spec.build.seed, RETRY_KEY)
        self._client: Any = None
        self._sem: asyncio.Semaphore | None = None
        self.retries = 0
        self.failed: EndpointError | None = None  # after a refusal, nothing more is sent

    async def __aenter__(self) -> LLMClient:
        openai = require_openai()
        ep = self.spec.endpoint
        self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.spec.api_key(), max_retries=0,
                                          timeout=ep.timeout)
        self._sem = asyncio.Semaphore(ep.concurrency)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def key(self, prompt: Any, index: int) -> str:
        """The cache key of completion ``index`` of a rendered prompt."""
        return completion_key(self.base_url, self.spec.endpoint.model, self.spec.endpoint.api, prompt,
                              self.sampling, index)

    def _seed(self, prompt: Any, index: int) -> int | None:
        """Per-completion seed derived from the spec's seed (distinct samples, reproducible reruns)."""
        seed = self.spec.sampling.seed
        if seed is None:
            return None
        return derive_seed(seed, SAMPLE_SEED_KEY, self.key(prompt, index)) % (2**31)

    async def complete(self, prompt: Any, indices: list[int]) -> list[Completion]:
        """Completions ``indices`` of ``prompt`` (string or chat messages), cached ones without a request."""
        found: dict[int, Completion] = {}
        if self.cache is not None:
            keys = {i: self.key(prompt, i) for i in indices}
            hits = self.cache.get_many(list(keys.values()))
            for i, k in keys.items():
                if k in hits:
                    text, tokens, finish = hits[k]
                    found[i] = Completion(text, tokens, finish, cached=True)
        missing = [i for i in indices if i not in found]
        per = self.spec.sampling.max_tokens + OVERSHOOT_TOKENS
        if len(missing) > 1 and self.n_supported is not False and self.cap.fits(len(missing) * per):
            got = await self._request(prompt, missing)
            if len(got) < len(missing):
                self.n_supported = False  # the server ignored n: one request per completion from now on
            elif self.n_supported is None:
                self.n_supported = True
            for i, c in zip(missing, got, strict=False):  # got may be shorter
                found[i] = self._store(prompt, i, c)
            missing = missing[len(got):]
        if missing:
            async def one(i: int) -> None:
                found[i] = self._store(prompt, i, (await self._request(prompt, [i]))[0])
            # each completion is cached as it arrives; a failure waits for the requests already in flight
            outcomes = await asyncio.gather(*(one(i) for i in missing), return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        return [found[i] for i in indices]

    def _store(self, prompt: Any, index: int, completion: Completion) -> Completion:
        if self.cache is not None:
            self.cache.put(self.key(prompt, index), completion.text, completion.tokens, completion.finish)
        return completion

    async def _request(self, prompt: Any, indices: list[int]) -> list[Completion]:
        """One logical request for ``len(indices)`` completions, retried; each HTTP attempt passes the cap."""
        assert self._client is not None and self._sem is not None, "use LLMClient inside 'async with'"
        ep = self.spec.endpoint
        n = len(indices)
        params = dict(self.sampling)
        params.pop("seed", None)
        seed = self._seed(prompt, indices[0])
        extra: dict[str, Any] = {} if seed is None else {"seed": seed}
        if n > 1:
            extra["n"] = n
        worst = n * (self.spec.sampling.max_tokens + OVERSHOOT_TOKENS)
        openai = require_openai()
        attempt = 0
        while True:
            async with self._sem:
                if self.failed is not None:
                    raise self.failed
                self.cap.reserve(worst)
                used = worst  # a request whose usage is unknown (timeout, dropped) counts its worst case
                try:
                    if ep.api == "chat":
                        resp = await self._client.chat.completions.create(model=ep.model, messages=prompt,
                                                                          **params, **extra)
                        choices = [(c.message.content or "", c.finish_reason) for c in resp.choices]
                    else:
                        resp = await self._client.completions.create(model=ep.model, prompt=prompt, **params, **extra)
                        choices = [(c.text or "", c.finish_reason) for c in resp.choices]
                    usage = getattr(resp, "usage", None)
                    total = int(usage.completion_tokens) if usage is not None and usage.completion_tokens is not None \
                        else worst
                    used = total
                    prompt_total = int(usage.prompt_tokens or 0) if usage is not None else 0
                    return _split_usage(choices, total, prompt_total)
                except openai.APIStatusError as exc:
                    used = 0  # the server answered with an error: no completion tokens were produced
                    status = exc.status_code
                    if status != 429 and status < 500:
                        refusal = EndpointError(f"the endpoint {self.base_url} refused the request with HTTP "
                                                f"{status}{_hint(status)}: {_message(exc)}", status)
                        if self.latch_refusals:
                            self.failed = refusal
                        raise refusal from None
                    error: Exception = exc
                    retry_after = _retry_after(exc)
                except (openai.APIConnectionError, openai.APITimeoutError) as exc:
                    error, retry_after = exc, None
                finally:
                    self.cap.settle(worst, used)
            attempt += 1
            self.retries += 1
            if attempt > ep.max_retries:
                raise EndpointError(f"giving up on {self.base_url} after {ep.max_retries} retries: "
                                    f"{type(error).__name__}: {error}") from None
            delay = min(ep.max_backoff, ep.backoff * 2 ** (attempt - 1)) * (0.5 + float(self._rng.random()))
            if retry_after is not None:
                delay = max(delay, retry_after)
            await asyncio.sleep(delay)


def _split_usage(choices: list[tuple[str, str | None]], total: int, prompt_total: int = 0) -> list[Completion]:
    """Share a response's completion tokens among its choices (exact for one choice; by text length for n > 1);
    its prompt tokens are shared evenly (the remainder to the first choices)."""
    prompt = np.full(len(choices), prompt_total // max(len(choices), 1), dtype=np.int64)
    prompt[: prompt_total - int(prompt.sum())] += 1
    if len(choices) == 1:
        return [Completion(choices[0][0], total, choices[0][1], prompt_tokens=prompt_total)]
    lengths = np.array([max(len(t), 1) for t, _ in choices], dtype=np.float64)
    shares = np.floor(total * lengths / lengths.sum()).astype(np.int64)
    shares[: total - int(shares.sum())] += 1
    return [Completion(t, int(s), f, prompt_tokens=int(pt))
            for (t, f), s, pt in zip(choices, shares, prompt, strict=True)]


def _retry_after(exc: Any) -> float | None:
    headers = getattr(getattr(exc, "response", None), "headers", None) or {}
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def _message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return str(getattr(exc, "message", exc))


def _hint(status: int) -> str:
    return {401: " (unauthorized: check the API key variable named by endpoint.api_key_env, or OPENAI_API_KEY)",
            403: " (forbidden)", 404: " (not found: check endpoint.base_url and endpoint.model)",
            400: " (bad request)"}.get(status, "")
