"""A caller's OpenAI request body, read into what ``serve`` does with it; every parameter honoured or refused.

The policy was learned with the upstream spec's prompt and sampling, so a parameter is honoured only
within that: ``max_tokens`` (or ``max_completion_tokens``) as an upper bound on the spec's, ``seed`` as
the root of the per-completion seeds, ``stop`` on the returned text, ``stream`` and
``stream_options.include_usage``; a sampling parameter equal to the spec's (or to the OpenAI default
the spec keeps) is accepted as is. Anything that would change what the policy answers
(another temperature, tools, images, ``n`` > 1, a system message, logprobs, ...) is refused with 400
naming the parameter. What was changed is listed in ``Plan.changed`` (the response's ``iapo.parameters``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MODEL_PREFIX", "Plan", "RequestError", "read_request"]

MODEL_PREFIX = "iapo/"
MAX_STOP = 4  # the OpenAI API's limit on stop sequences
MAX_WEIGHTS_CHARS = 2000  # a model name's weights list past this is refused unparsed


class RequestError(Exception):
    """A request ``serve`` refuses: its status, the OpenAI error ``code`` and ``param``, and a message for the caller."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> None:
        """``extra``: more fields of the error object; ``headers``: response headers (``Retry-After``)."""
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.extra, self.headers = extra or {}, headers or {}


@dataclass
class Plan:
    """What to do for one request."""

    query: str
    context: Any  # what Router.resolve takes (None, a name, or a list of weights)
    model_context: Any = None  # the model's form when iapo_context gives another: both must resolve alike
    max_tokens: int | None = None  # None: the spec's
    seed: int | None = None  # None: the spec's
    stop: tuple[str, ...] = ()  # cut the returned text at the first of these
    stream: bool = False
    include_usage: bool = False
    changed: dict[str, str] = field(default_factory=dict)


def _bad(param: str, message: str, code: str = "unsupported_parameter") -> RequestError:
    return RequestError(400, f"{param}: {message}", code, param)


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(value: Any, where: str) -> str:
    """A string that can be sent on as UTF-8 (no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(where, "the text is not valid Unicode (a lone surrogate)", "invalid_text") from None
    return str(value)


# Parameters accepted when equal to the spec's value (or absent); the default the API assumes when absent.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
# Parameters accepted only at the value that changes nothing (the reason they are refused otherwise).
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1,), "the policy chooses how many completions to sample; ask for one answer"),
    "best_of": ((1,), "the policy chooses how many completions to sample"),
    "echo": ((False,), "the policy renders its own prompt; it is not echoed"),
    "suffix": (("",), "insertion is not part of the learned prompts"),
    "logprobs": ((False, 0), "the answer is a vote over N completions; there are no logprobs of it"),
    "top_logprobs": ((0,), "the answer is a vote over N completions; there are no logprobs of it"),
    "logit_bias": (({},), "it changes what the policy was learned on"),
    "tools": (([],), "tools are not supported: the policy answers with text"),
    "functions": (([],), "function calling is not supported: the policy answers with text"),
    "tool_choice": (("none", "auto"), "tools are not supported"),
    "function_call": (("none", "auto"), "function calling is not supported"),
    "parallel_tool_calls": ((True, False), ""),
    "response_format": (({"type": "text"},), "only text answers are supported"),
    "modalities": ((["text"],), "only text answers are supported"),
    "audio": ((), "audio output is not supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "reasoning_effort": ((), "the upstream's sampling is the policy's"),
    "store": ((False,), "completions are not stored"),
    "metadata": (({},), "completions are not stored"),
    "service_tier": (("auto", "default"), "the upstream's tier is the spec's"),
}
COMMON = frozenset({"model", "iapo_context", "max_tokens", "max_completion_tokens", "seed", "stop", "stream",
                    "stream_options", "user", *SAMPLING_DEFAULTS, *NEUTRAL})


def _finite(value: Any) -> bool:
    """A JSON number that is a finite float (an integer too large for a float is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _int(value: Any, param: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(param, f"must be an integer >= {low}, got {_show(value)}", "invalid_value")
    return value


def _context(body: dict[str, Any]) -> tuple[Any, Any]:
    """The context a request names: ``iapo_context``, else the model ``iapo/<context>``, else None; and the
    model's form when both are given and differ (the server checks that they name the same context)."""
    ref = body.get("iapo_context")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"must be a string, got {_show(model)}", "invalid_value")
    from_model: Any = None
    if model is not None and model.startswith(MODEL_PREFIX):
        from_model = _text(model[len(MODEL_PREFIX):], "model")
        if from_model.startswith("["):
            if len(from_model) > MAX_WEIGHTS_CHARS:
                raise _bad("model", f"the weights after 'iapo/' are longer than {MAX_WEIGHTS_CHARS} characters",
                           "invalid_context")
            try:
                from_model = json.loads(from_model)
            except (ValueError, RecursionError):
                raise _bad("model", "the weights after 'iapo/' are not a JSON list", "invalid_context") from None
    if ref is not None:
        if isinstance(ref, str):
            ref = _text(ref, "iapo_context")
        elif not (isinstance(ref, list) and all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in ref)):
            raise _bad("iapo_context", f"must be a context name or a list of weights, got {_show(ref)}",
                       "invalid_context")
    for form, param in ((ref, "iapo_context"), (from_model, "model")):
        if form is not None and not isinstance(form, str):
            if not (isinstance(form, list) and all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                   for w in form)):
                raise _bad(param, f"the context must be a name or a list of weights, got {_show(form)}",
                           "invalid_context")
            if not all(_finite(w) for w in form):
                raise _bad(param, f"context weights must be finite numbers, got {_show(form)}", "invalid_context")
    if ref is None:
        return from_model, None
    return ref, (from_model if from_model is not None and from_model != ref else None)


def _chat_query(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of {role, content} objects", "invalid_messages")
    if len(messages) != 1:
        roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
        raise _bad("messages", f"one user message is answered (the policy renders its own prompt around it, as it "
                               f"was learned); got {len(messages)} messages with roles {_show(roles)}",
                   "unsupported_messages")
    m = messages[0]
    if not isinstance(m, dict) or m.get("role") != "user":
        role = m.get("role") if isinstance(m, dict) else None
        raise _bad("messages[0].role", f"must be 'user', got {_show(role)}", "unsupported_messages")
    unknown = sorted(set(m) - {"role", "content"})
    if unknown:
        raise _bad(f"messages[0].{unknown[0]}", "is not supported in a user message", "unsupported_messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[0].content[{j}]", f"only text parts are supported, got type {_show(kind)}",
                           "unsupported_content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str) or not content:
        raise _bad("messages[0].content", "the user message has no text content", "invalid_messages")
    return _text(content, "messages[0].content")


def _completion_query(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise _bad("prompt", "one prompt per request is answered (a list of prompts or token ids is not supported)",
                   "invalid_prompt")
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", f"must be a non-empty string, got {_show(prompt)}", "invalid_prompt")
    return _text(prompt, "prompt")


def read_request(body: Any, chat: bool, sampling: dict[str, Any]) -> Plan:
    """What to do for one request ``body`` (module docstring); ``sampling``: the spec's ``Sampling.as_dict()``.

    Raises ``RequestError`` (400) naming the first parameter that cannot be honoured.
    """
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}", "invalid_json")
    allowed = COMMON | ({"messages"} if chat else {"prompt"})
    for name in body:
        if name not in allowed:
            other = "prompt" if chat else "messages"
            hint = f" (this endpoint takes '{'messages' if chat else 'prompt'}')" if name == other else ""
            raise _bad(str(name).encode("utf-8", "replace").decode()[:80], f"unknown parameter{hint}",
                       "unknown_parameter")
    query = _chat_query(body.get("messages")) if chat else _completion_query(body.get("prompt"))
    context, model_context = _context(body)
    plan = Plan(query=query, context=context, model_context=model_context)
    for name, (neutral, why) in NEUTRAL.items():
        value = body.get(name)
        if value is not None and value not in neutral:
            raise _bad(name, f"{_show(value)} is not supported: {why}" if why else f"{_show(value)} is not supported")
    for name, default in SAMPLING_DEFAULTS.items():
        value = body.get(name)
        if value is None:
            continue
        learned = sampling.get(name, default)
        if not _finite(value) or float(value) != float(learned):
            raise _bad(name, f"{_show(value)} is not supported: the policy was learned at {name} = {learned:g}; "
                             f"send {learned:g} or leave it out")
    limit = int(sampling["max_tokens"])
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None:
            asked = _int(body[name], name, 1)
            if asked < limit:
                plan.max_tokens = asked if plan.max_tokens is None else min(plan.max_tokens, asked)
            else:
                plan.changed[name] = f"{asked} asked; the policy's {limit} used (its upper bound)"
    if body.get("seed") is not None:
        plan.seed = _int(body["seed"], "seed", 0)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop", f"must be a non-empty string or a list of at most {MAX_STOP}, got {_show(stop)}",
                       "invalid_value")
        plan.stop = tuple(_text(s, "stop") for s in stops)
        if plan.stop:
            plan.changed["stop"] = "applied to the returned completion (the vote is over the completions the " \
                                   "policy was learned with)"
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", f"must be true or false, got {_show(stream)}", "invalid_value")
    plan.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                not isinstance(options.get("include_usage", False), bool):
            raise _bad("stream_options", f"only {{\"include_usage\": true|false}} is supported, got {_show(options)}",
                       "invalid_value")
        plan.include_usage = bool(options.get("include_usage")) and plan.stream
    user = body.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise _bad("user", f"must be a string, got {_show(user)}", "invalid_value")
        plan.changed["user"] = "not sent upstream"
    return plan
