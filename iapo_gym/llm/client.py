"""The transport to an OpenAI-compatible endpoint: concurrency limit, retries, spending cap, ``n``, cache.

Built on ``openai.AsyncOpenAI`` with its own retries disabled (``max_retries=0``) so that every
HTTP attempt passes through the spending cap here: a request first reserves its worst case
(one request, ``n * max_tokens`` completion tokens) and settles with the server's ``usage``. A
connection that was refused (nothing reached a server) gives its reservation back; a request that
may have been processed (timed out, dropped after sending, 5xx) keeps its worst case. Retries
follow ``iapo_gym.llm.retry``; the key goes only where ``Spec.llm_route`` says, enforced on every
request by an HTTP hook.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from iapo_gym.llm.budget import Budget, Rate, RateLimited, Reservation, Spend
from iapo_gym.llm.cache import ResponseCache, completion_key, sample_key
from iapo_gym.llm.loop import gather_all
from iapo_gym.llm.prices import prompt_token_bound
from iapo_gym.llm.retry import (
    EndpointError,
    EndpointUnreachable,
    Retrier,
    Retry,
    RetryPolicy,
    retry_after,
    retryable_status,
)
from iapo_gym.llm.spec import Route, Spec, origin
from iapo_gym.seeding import derive_rng, derive_seed

__all__ = ["BudgetExhausted", "ClientOptions", "Completion", "EndpointError", "EndpointUnreachable", "LLMClient",
           "RequestOptions", "SpendingCap", "Usage", "require_openai", "route_hook", "upstream_stop"]

RETRY_KEY = "iapo_gym.llm.retry"
#: Tokens a server may add past ``max_tokens`` per completion: llama.cpp finishes a multi-byte UTF-8
#: character (at most 3 more byte tokens), so the worst case reserved for a completion includes them.
OVERSHOOT_TOKENS = 3
SAMPLE_SEED_KEY = "iapo_gym.llm.sample"
#: Headers the openai library fills from OPENAI_* variables; they go only where OPENAI_API_KEY goes.
OPENAI_ACCOUNT_HEADERS = ("openai-organization", "openai-project")


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

    ``prompt_tokens`` is this completion's share of the request's prompt tokens (also when cached; 0 from a
    cache that predates them).
    """

    text: str
    tokens: int
    finish: str | None
    cached: bool = False
    prompt_tokens: int = 0


@dataclass
class Usage:
    """What one caller's request spent upstream: HTTP attempts sent, completion tokens settled, and prompt tokens
    (as reported; an attempt whose usage is unknown counts ``prices.prompt_token_bound`` of its prompt)."""

    requests: int = 0
    tokens: int = 0
    prompt_tokens: int = 0


@dataclass(frozen=True)
class RequestOptions:
    """Per-request changes a server makes within what its policy was learned with.

    ``max_tokens``: an upper bound below the spec's; ``seed``: the root of the per-completion seeds
    instead of the spec's; ``usage``: filled with what the request spent; ``sampling``: sampling
    parameters sent instead of the spec's (a range the server's operator accepts); ``stop``: stop
    sequences sent upstream besides the spec's (``upstream_stop``).
    """

    max_tokens: int | None = None
    seed: int | None = None
    usage: Usage | None = None
    sampling: tuple[tuple[str, float], ...] = ()
    stop: tuple[str, ...] = ()

    @property
    def neutral(self) -> bool:
        """Nothing differs from the spec's request."""
        return self.max_tokens is None and self.seed is None and self.usage is None and not self.sampling \
            and not self.stop


MAX_STOP = 4  # the OpenAI API's limit on stop sequences in one request


def upstream_stop(spec_stop: tuple[str, ...] | list[str], extra: tuple[str, ...]) -> list[str] | None:
    """The stop sequences a request sends with ``extra`` added to the spec's, None when they are more than the
    API takes (``MAX_STOP``; then only the spec's go and the caller's cut the text locally)."""
    merged = list(dict.fromkeys([*spec_stop, *extra]))
    return merged if len(merged) <= MAX_STOP else None


class SpendingCap:
    """A collection's lifetime cap: HTTP attempts (``max_requests``) and completion tokens (``max_tokens_total``)
    spent, plus those reserved by in-flight requests; never above the cap.

    It is an ``iapo_gym.llm.budget.Budget`` whose limits are ``total`` windows (the budget class ``serve``'s
    rates use, here in this process's memory): each attempt reserves its worst case and settles with the
    server's count. Reservations do not expire: the client settles or releases every one.
    """

    def __init__(self, max_requests: int | None, max_tokens_total: int | None) -> None:
        """Caps of None are unlimited."""
        self.max_requests, self.max_tokens_total = max_requests, max_tokens_total
        rates = ([] if max_requests is None else [Rate("requests", "total", max_requests)]) + \
            ([] if max_tokens_total is None else [Rate("tokens", "total", max_tokens_total)])
        self.budget = Budget(rates)
        self._held: dict[int, list[Reservation]] = {}  # by worst case: reservations of one size are interchangeable

    def _spent(self) -> tuple[int, int, int]:
        spent = self.budget.spent()
        total, reserved = spent["total"], spent["reserved"]
        return int(total["requests"] + reserved["requests"]), int(total["tokens"]), int(reserved["tokens"])

    @property
    def requests(self) -> int:
        """Requests sent (each HTTP attempt counts), in flight included."""
        return self._spent()[0]

    @property
    def tokens(self) -> int:
        """Completion tokens settled."""
        return self._spent()[1]

    @property
    def reserved_tokens(self) -> int:
        """The worst case of the requests in flight."""
        return self._spent()[2]

    def reserve(self, tokens: int) -> None:
        """Reserve one request of at most ``tokens`` completion tokens, or raise ``BudgetExhausted``."""
        try:
            reservation = self.budget.admit(Spend(requests=1, upstream=1, tokens=tokens), math.inf)
        except RateLimited:
            requests, spent, reserved = self._spent()
            if self.max_requests is not None and requests + 1 > self.max_requests:
                raise BudgetExhausted(f"the spending cap max_requests = {self.max_requests} is reached") from None
            raise BudgetExhausted(f"the spending cap max_tokens_total = {self.max_tokens_total} would be exceeded "
                                  f"({spent} spent, {reserved} reserved in flight, {tokens} more for the next "
                                  "request)") from None
        self._held.setdefault(tokens, []).append(reservation)

    def fits(self, tokens: int) -> bool:
        """Whether one more request of at most ``tokens`` completion tokens would fit under the cap now."""
        return self.budget.fits(Spend(requests=1, upstream=1, tokens=tokens))

    def settle(self, reserved: int, used: int) -> None:
        """Replace a reservation of ``reserved`` tokens by the ``used`` ones the server reported."""
        self.budget.settle(self._held[reserved].pop(), Spend(requests=1, upstream=1, tokens=used))

    def release(self, reserved: int) -> None:
        """Give a reservation back whole: the request never reached a server (connection refused)."""
        self.budget.settle(self._held[reserved].pop(), Spend())


@dataclass(frozen=True)
class ClientOptions:
    """How a server's client differs from a collection's (None: the spec's own setting).

    ``cap``: the spending cap to count against (a server passes an unlimited one: its budget is a rate,
    ``iapo_gym.deploy.limits``); ``max_retries``: at most this many retries per call, below the endpoint's
    own ``max_retries`` (each endpoint keeps its own backoff); ``concurrency``: requests on the wire at once;
    ``direct``: send each request with the HTTP client (same route hook, headers, timeout and errors), which
    costs a server a fraction of the openai client's time per request.
    """

    cap: SpendingCap | None = None
    max_retries: int | None = None
    concurrency: int | None = None
    direct: bool = False  # post the JSON body with the HTTP client itself, not the openai client's request models


def route_hook(route: Route, environ: dict[str, str] | None = None) -> Callable[[Any], Awaitable[None]]:
    """An HTTP request hook that sets exactly the route's key on requests to the route's origin, and none elsewhere.

    It runs on every request the client sends (redirects included), after the libraries have built
    their headers, so no key from the environment reaches another host whatever those libraries read.
    Unless the route's key is ``OPENAI_API_KEY``, the OpenAI account headers and any header named in
    ``OPENAI_CUSTOM_HEADERS`` are removed too.
    """
    env = dict(os.environ if environ is None else environ)
    key = route.key(env)
    strip: tuple[str, ...] = ()
    if route.key_env != "OPENAI_API_KEY":
        custom = [line.split(":", 1)[0].strip().lower() for line in env.get("OPENAI_CUSTOM_HEADERS", "").split("\n")
                  if ":" in line]
        strip = (*OPENAI_ACCOUNT_HEADERS, *custom)

    async def hook(request: Any) -> None:
        headers = request.headers
        for name in strip:
            headers.pop(name, None)
        if key is not None and origin(str(request.url)) == route.origin:
            headers["Authorization"] = f"Bearer {key}"
        else:
            headers.pop("Authorization", None)
    return hook


def _not_reached(exc: BaseException) -> bool:
    """Whether a connection error happened before anything was sent (refused, unresolvable, connect timeout).

    Anything else (a dropped connection, a read timeout) may have reached the server and counts.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__name__ in ("ConnectError", "ConnectTimeout"):
            return True
        seen = seen.__cause__  # the libraries chain the transport's error as the cause
    return False


class LLMClient:
    """Completions of rendered prompts, by sample index, through the cache and the spending cap.

    Use inside one event loop: ``async with LLMClient(spec) as client: await client.complete(...)``.
    ``stop_on_failure``: after a refusal (4xx) or a request out of retries nothing more is sent (a
    collection); a server sets it False so one caller's failed request does not stop the others.
    """

    stop_on_failure = True

    def __init__(self, spec: Spec, cache: ResponseCache | None = None, options: ClientOptions | None = None) -> None:
        """Bind to ``spec``'s endpoint and key (``Spec.llm_route``) and budget; ``options`` override the latter."""
        options = options or ClientOptions()
        self.spec = spec
        self.route = spec.llm_route()
        self.base_url = self.route.url
        self.cache = cache
        self.cap = options.cap if options.cap is not None else SpendingCap(spec.budget.max_requests,
                                                                          spec.budget.max_tokens_total)
        self.sampling = spec.sampling.as_dict()
        # "auto": learn from the first multi-completion answer whether the server honours n
        self.n_supported: bool | None = {"auto": None, "yes": True, "no": False}[spec.endpoint.use_n]
        self._rng = derive_rng(spec.build.seed, RETRY_KEY)
        self.policy = RetryPolicy.of(spec.endpoint, options.max_retries)
        self.concurrency = options.concurrency or spec.endpoint.concurrency
        self.direct = options.direct
        api = "/chat/completions" if spec.endpoint.api == "chat" else "/completions"
        self._url = self.base_url.rstrip("/") + api
        self._client: Any = None
        self._http: Any = None
        self._headers: dict[str, str] = {}
        self._transport_errors: tuple[type[BaseException], ...] = ()
        self._retrier: Retrier | None = None  # concurrency, retries and the stop signal, in the client's loop
        self.refused = 0  # connection attempts refused (nothing reached a server; not counted by the cap)
        self.in_flight = 0  # completions in requests on the wire now

    @property
    def failed(self) -> EndpointError | None:
        """The failure that stopped this client (a refusal, or a request out of retries), if any."""
        return None if self._retrier is None else self._retrier.stop.error

    @property
    def retries(self) -> int:
        """HTTP attempts retried so far."""
        return 0 if self._retrier is None else self._retrier.retries

    async def __aenter__(self) -> LLMClient:
        openai = require_openai()
        ep = self.spec.endpoint
        self._http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [route_hook(self.route)]},
                                                    follow_redirects=False)
        # the library needs some key to build a request; the hook replaces or removes it before sending.
        # OPENAI_ORG_ID / OPENAI_PROJECT_ID (read by the library when given None) go where OPENAI_API_KEY goes
        account = None if self.route.key_env == "OPENAI_API_KEY" else ""
        self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.route.key() or "no-key",
                                          organization=account, project=account, max_retries=0,
                                          timeout=ep.timeout, http_client=self._http)
        self._retrier = Retrier("the endpoint", self.base_url, self.policy, self._rng, self.concurrency,
                                stop_on_failure=self.stop_on_failure)
        self._headers = direct_headers(self.route)
        self._transport_errors = (openai.APIConnectionError, openai.APITimeoutError, _http_module().TransportError)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._client is not None:
            await self._client.close()
            await self._http.aclose()
            self._client = self._http = None

    async def probe(self, timeout: float) -> int | None:
        """``GET /models`` of the endpoint (not counted by the cap): its HTTP status, or None when nothing answered."""
        assert self._http is not None, "use LLMClient inside 'async with'"
        try:
            resp = await self._http.get(self.base_url.rstrip("/") + "/models", headers=self._headers, timeout=timeout)
        except self._transport_errors:
            return None
        return int(resp.status_code)

    def key(self, prompt: Any, index: int, max_tokens: int | None = None) -> str:
        """The cache key of completion ``index`` of a rendered prompt (at ``max_tokens`` when it is not the spec's)."""
        return completion_key(self.base_url, self.spec.endpoint.model, self.spec.endpoint.api, prompt,
                              self._sampling_at(max_tokens), index)

    def _sampling_at(self, max_tokens: int | None) -> dict[str, Any]:
        return self.sampling if max_tokens is None else {**self.sampling, "max_tokens": max_tokens}

    def _seed(self, prompt: Any, index: int, options: RequestOptions | None = None) -> int | None:
        """Per-completion seed derived from the spec's seed, or the request's, and the sample's ``sample_key``
        (distinct samples; reproducible reruns, wherever the model is served)."""
        seed = self.spec.sampling.seed if options is None or options.seed is None else options.seed
        if seed is None:
            return None
        max_tokens = options.max_tokens if options is not None else None
        key = sample_key(self.spec.endpoint.model, self.spec.endpoint.api, prompt, self._sampling_at(max_tokens), index)
        return derive_seed(seed, SAMPLE_SEED_KEY, key) % (2**31)

    async def complete(self, prompt: Any, indices: list[int], options: RequestOptions | None = None) -> list[Completion]:
        """Completions ``indices`` of ``prompt`` (string or chat messages), cached ones without a request.

        ``options``: a server's per-request bound on ``max_tokens``, seed, and where to count the spend.
        """
        if options is not None and options.neutral:
            options = None
        found: dict[int, Completion] = {}
        max_tokens = options.max_tokens if options is not None else None
        if self.cache is not None:
            keys = {i: self.key(prompt, i, max_tokens) for i in indices}
            hits = await self.cache.aget_many(list(keys.values()))
            for i, k in keys.items():
                if k in hits:
                    text, tokens, finish, prompt_tokens = hits[k]
                    found[i] = Completion(text, tokens, finish, cached=True, prompt_tokens=prompt_tokens or 0)
        missing = [i for i in indices if i not in found]
        per = (max_tokens or self.spec.sampling.max_tokens) + OVERSHOOT_TOKENS
        if len(missing) > 1 and self.n_supported is not False and self.cap.fits(len(missing) * per):
            got = await self._request(prompt, missing, options)
            if len(got) < len(missing):
                self.n_supported = False  # the server ignored n: one request per completion from now on
            elif self.n_supported is None:
                self.n_supported = True
            for i, c in zip(missing, got, strict=False):  # got may be shorter
                found[i] = self._store(prompt, i, c, max_tokens)
            missing = missing[len(got):]
        if missing:
            async def one(i: int) -> None:
                found[i] = self._store(prompt, i, (await self._request(prompt, [i], options))[0], max_tokens)
            # each completion is cached as it arrives; a failure waits for the requests already in flight
            await gather_all(*(one(i) for i in missing))
        return [found[i] for i in indices]

    def _store(self, prompt: Any, index: int, completion: Completion, max_tokens: int | None = None) -> Completion:
        if self.cache is not None:  # queued: the cache's thread commits it
            self.cache.put(self.key(prompt, index, max_tokens), completion.text, completion.tokens, completion.finish,
                           completion.prompt_tokens)
        return completion

    async def _request(self, prompt: Any, indices: list[int], options: RequestOptions | None = None) -> list[Completion]:
        """One logical request for ``len(indices)`` completions, retried; each HTTP attempt passes the cap."""
        assert self._client is not None and self._retrier is not None, "use LLMClient inside 'async with'"
        ep = self.spec.endpoint
        n = len(indices)
        params = dict(self.sampling)
        params.pop("seed", None)
        usage_out = options.usage if options is not None else None
        self._apply(params, options)
        seed = self._seed(prompt, indices[0], options)
        extra: dict[str, Any] = {} if seed is None else {"seed": seed}
        if n > 1:
            extra["n"] = n
        worst = n * (params["max_tokens"] + OVERSHOOT_TOKENS)
        prompt_worst = prompt_token_bound(prompt)
        openai = require_openai()
        client, cap = self._client, self.cap

        async def attempt() -> list[Completion]:
            cap.reserve(worst)
            used: int | None = worst  # a request whose usage is unknown (timeout, dropped, 5xx) counts its worst case
            prompt_used = prompt_worst
            self.in_flight += n
            try:
                if self.direct:
                    choices, completion_tokens, prompt_total = await self._post(prompt, params, extra)
                elif ep.api == "chat":
                    resp = await client.chat.completions.create(model=ep.model, messages=prompt, **params, **extra)
                    choices = [(c.message.content or "", c.finish_reason) for c in resp.choices]
                else:
                    resp = await client.completions.create(model=ep.model, prompt=prompt, **params, **extra)
                    choices = [(c.text or "", c.finish_reason) for c in resp.choices]
                if not self.direct:
                    usage = getattr(resp, "usage", None)
                    completion_tokens = None if usage is None or usage.completion_tokens is None \
                        else int(usage.completion_tokens)
                    prompt_total = int(usage.prompt_tokens or 0) if usage is not None else 0
                total = worst if completion_tokens is None else completion_tokens
                used = total
                prompt_used = prompt_worst if completion_tokens is None else prompt_total
                return _split_usage(choices, total, prompt_total)
            except (openai.APIStatusError, StatusError) as exc:
                failure, turned_away = self._status_failure(exc)
                if turned_away:
                    used = prompt_used = 0  # refused or rate limited before any work: no tokens were produced
                raise failure from None
            except self._transport_errors as exc:
                if _not_reached(exc):
                    used = None  # nothing reached a server: no request, no tokens
                    self.refused += 1
                raise Retry(exc, connection=True) from None
            finally:
                self.in_flight -= n
                self._account(worst, used, usage_out, prompt_used)
        return await self._retrier.call(attempt)

    def _apply(self, params: dict[str, Any], options: RequestOptions | None) -> None:
        """Put a request's ``options`` (max_tokens bound, sampling, stop sequences) into its parameters."""
        if options is None:
            return
        if options.max_tokens is not None:
            params["max_tokens"] = options.max_tokens
        params.update(options.sampling)
        if options.stop:
            stop = upstream_stop(self.spec.sampling.stop, options.stop)
            if stop is not None:
                params["stop"] = stop

    def _status_failure(self, exc: Any) -> tuple[BaseException, bool]:
        """What an HTTP error answer becomes: ``EndpointError`` for a refusal, ``Retry`` otherwise; and whether
        the request was turned away before any work (a refusal, or 429: no completion tokens produced)."""
        status = exc.status_code
        if not retryable_status(status):
            return EndpointError(f"the endpoint {self.base_url} refused the request with HTTP "
                                 f"{status}{_hint(status)}: {_message(exc)}", status), True
        return (Retry(exc, server_asks=retry_after(getattr(getattr(exc, "response", None), "headers", None))),
                status == 429)

    async def stream(self, prompt: Any, index: int, options: RequestOptions | None,
                     on_text: Callable[[str], Awaitable[None]]) -> Completion:
        """Completion ``index`` of ``prompt`` in one streaming request: each piece of text goes to ``on_text`` as
        the upstream sends it, and the whole completion is returned.

        The request ``complete(prompt, [index], options)`` sends (same parameters and seed, so the same
        completion from a seeded upstream) with ``stream: true``, through the spending cap, the retries and
        the key's route alike. Its usage is the upstream's final usage chunk (``stream_options.include_usage``);
        without one it counts its worst case, as a response without usage does. An attempt that fails before
        its first text is retried; one that fails after text went to ``on_text`` raises ``EndpointError``
        (the caller has part of the text: a retry would repeat it).
        """
        assert self._http is not None and self._retrier is not None, "use LLMClient inside 'async with'"
        ep = self.spec.endpoint
        chat = ep.api == "chat"
        params = dict(self.sampling)
        params.pop("seed", None)
        self._apply(params, options)
        seed = self._seed(prompt, index, options)
        body: dict[str, Any] = {"model": ep.model, "messages" if chat else "prompt": prompt, **params,
                                **({} if seed is None else {"seed": seed}), "stream": True,
                                "stream_options": {"include_usage": True}}
        usage_out = options.usage if options is not None else None
        worst = params["max_tokens"] + OVERSHOOT_TOKENS
        prompt_worst = prompt_token_bound(prompt)

        async def attempt() -> Completion:
            self.cap.reserve(worst)
            used: int | None = worst  # a stream whose usage is unknown counts its worst case
            prompt_used = prompt_worst
            passed_on = False
            self.in_flight += 1
            try:
                async with self._http.stream("POST", self._url, json=body, headers=self._headers,
                                             timeout=ep.timeout) as resp:
                    if not 200 <= resp.status_code < 300:
                        await resp.aread()
                        raise StatusError(resp)
                    parts: list[str] = []
                    finish: str | None = None
                    completion_tokens: int | None = None
                    prompt_tokens = 0
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue  # blank separators, comments, event names
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        try:
                            chunk = json.loads(data)
                            if "error" in chunk:
                                error = chunk["error"]
                                said = error.get("message", error) if isinstance(error, dict) else error
                                raise EndpointError(f"the endpoint {self.base_url} ended a streamed completion with "
                                                    f"an error: {said}")
                            usage = chunk.get("usage")
                            if usage and usage.get("completion_tokens") is not None:
                                completion_tokens = int(usage["completion_tokens"])
                                prompt_tokens = int(usage.get("prompt_tokens") or 0)
                            pieces = [((c.get("delta") or {}).get("content") if chat else c.get("text"),
                                       c.get("finish_reason")) for c in chunk.get("choices") or ()]
                        except (ValueError, TypeError, AttributeError) as exc:
                            raise EndpointError(f"the endpoint {self.base_url} streamed a chunk that is not a "
                                                f"{'chat ' if chat else ''}completion chunk ({type(exc).__name__}: "
                                                f"{exc})") from None
                        for piece, reason in pieces:
                            if reason:
                                finish = str(reason)
                            if piece:
                                parts.append(str(piece))
                                passed_on = True
                                await on_text(str(piece))
                total = worst if completion_tokens is None else completion_tokens
                used = total
                prompt_used = prompt_worst if completion_tokens is None else prompt_tokens
                # without the upstream's usage, the tokens reported are the worst case charged to the budgets
                return Completion("".join(parts), total, finish, prompt_tokens=prompt_used)
            except StatusError as exc:
                failure, turned_away = self._status_failure(exc)
                if turned_away:
                    used = prompt_used = 0
                raise failure from None
            except self._transport_errors as exc:
                if passed_on:
                    raise EndpointError(f"the endpoint {self.base_url} broke off a streamed completion "
                                        f"({type(exc).__name__}: {exc})") from None
                if _not_reached(exc):
                    used = None
                    self.refused += 1
                raise Retry(exc, connection=True) from None
            finally:
                self.in_flight -= 1
                self._account(worst, used, usage_out, prompt_used)
        return await self._retrier.call(attempt)

    def _account(self, worst: int, used: int | None, usage_out: Usage | None, prompt_used: int = 0) -> None:
        """Settle one HTTP attempt's reservation of ``worst`` with ``used`` tokens (None: it never reached a
        server, the reservation goes back whole) and add it, with its ``prompt_used`` tokens, to the request's
        ``usage_out``."""
        if used is None:
            self.cap.release(worst)
            return
        self.cap.settle(worst, used)
        if usage_out is not None:
            usage_out.requests += 1
            usage_out.tokens += used
            usage_out.prompt_tokens += prompt_used

    async def _post(self, prompt: Any, params: dict[str, Any],
                    extra: dict[str, Any]) -> tuple[list[tuple[str, str | None]], int | None, int]:
        """One request sent directly (``ClientOptions.direct``): the choices, completion tokens (None when
        not reported) and prompt tokens; a non-2xx answer raises ``StatusError``."""
        ep = self.spec.endpoint
        chat = ep.api == "chat"
        body = {"model": ep.model, "messages" if chat else "prompt": prompt, **params, **extra}
        resp = await self._http.post(self._url, json=body, headers=self._headers, timeout=ep.timeout)
        if not 200 <= resp.status_code < 300:
            raise StatusError(resp)
        try:
            data = resp.json()
            choices = [((c["message"]["content"] if chat else c["text"]) or "", c.get("finish_reason"))
                       for c in data["choices"]]
            usage = data.get("usage") or {}
            completion_tokens = usage.get("completion_tokens")
            return (choices, None if completion_tokens is None else int(completion_tokens),
                    int(usage.get("prompt_tokens") or 0))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise EndpointError(f"the endpoint {self.base_url} answered HTTP {resp.status_code} with a body that is "
                                f"not a {'chat ' if chat else ''}completion ({type(exc).__name__}: {exc})") from None


class StatusError(Exception):
    """A non-2xx answer to a request sent directly; ``status_code``, ``body`` and ``response`` as openai's errors."""

    def __init__(self, response: Any) -> None:
        """``response``: the HTTP response."""
        self.response, self.status_code = response, int(response.status_code)
        try:
            self.body: Any = response.json()
        except ValueError:
            self.body = None
        self.message = f"Error code: {self.status_code} - {response.text[:500]}"
        super().__init__(self.message)


def direct_headers(route: Route, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The headers of a request sent directly: JSON, and the account headers openai would add from the
    environment where ``OPENAI_API_KEY`` goes (``OPENAI_ORG_ID``, ``OPENAI_PROJECT_ID``, ``OPENAI_CUSTOM_HEADERS``).
    The key itself is set by ``route_hook``."""
    env = os.environ if environ is None else environ
    headers = {"Accept": "application/json"}
    if route.key_env == "OPENAI_API_KEY":
        for name, var in (("OpenAI-Organization", "OPENAI_ORG_ID"), ("OpenAI-Project", "OPENAI_PROJECT_ID")):
            if env.get(var):
                headers[name] = env[var]
        for line in env.get("OPENAI_CUSTOM_HEADERS", "").split("\n"):
            name, sep, value = line.partition(":")
            if sep and name.strip():
                headers[name.strip()] = value.strip()
    return headers


def _http_module() -> Any:
    """``httpx2``, the HTTP library under ``openai`` (its transport errors are caught for direct requests)."""
    import httpx2

    return httpx2


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


def _message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return str(getattr(exc, "message", exc))


def _hint(status: int) -> str:
    return {401: " (unauthorized: check the key; `iapo-gym collect SPEC --dry-run` names the variable it is read from)",
            403: " (forbidden)", 404: " (not found: check endpoint.base_url and endpoint.model)",
            400: " (bad request)"}.get(status, "")
