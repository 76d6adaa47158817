"""A caller's OpenAI request body, read into what ``serve`` does with it; every parameter honoured or refused.

The policy was learned with the upstream spec's prompt and sampling, so a parameter is honoured only
within that: ``max_tokens`` (or ``max_completion_tokens``) as an upper bound on the spec's, ``seed`` as
the root of the per-completion seeds, ``stop`` on the returned text (and upstream where the vote cannot
change), ``stream`` and ``stream_options.include_usage``; a sampling parameter equal to the spec's (or to
the OpenAI default the spec keeps) is accepted as is, another value only within a range the operator
declared (``CallerRules.accept``: ``serve --accept temperature=0:1``). A chat's system message and
earlier turns are refused unless the operator chose how they ride along with the policy's prompt
(``CallerRules.system_message``, ``CallerRules.history``; the router renders them). Anything else that
would change what the policy answers (tools, images, ``n`` > 1, logprobs, ...) is refused with 400 naming
the parameter. What was changed is listed in ``Plan.changed`` (the response's ``iapo.parameters``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HISTORY_MODES", "MODEL_PREFIX", "SYSTEM_MODES", "CallerRules", "Plan", "RequestError", "parse_accept",
           "read_request", "stop_note"]

MODEL_PREFIX = "iapo/"
MAX_STOP = 4  # the OpenAI API's limit on stop sequences
MAX_WEIGHTS_CHARS = 2000  # a model name's weights list past this is refused unparsed
#: What ``serve --system-message`` may do with a chat's system message (docs/deploy.md, "Chat front-ends").
SYSTEM_MODES = ("refuse", "append", "as-context")
#: What ``serve --history`` may do with a chat's earlier turns.
HISTORY_MODES = ("refuse", "keep")
SYSTEM_ROLES = ("system", "developer")  # the newer API's name for the system message


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
    system: str | None = None  # the chat's system text (leading system messages joined), when accepted
    history: tuple[tuple[str, str], ...] = ()  # the chat's earlier turns (role, text), when accepted
    sampling: dict[str, float] = field(default_factory=dict)  # sampling parameters sent instead of the spec's


@dataclass(frozen=True)
class CallerRules:
    """What a server accepts beyond the policy's own prompt and sampling (all refused by default).

    ``system_message``: ``refuse`` (400), ``append`` (the caller's system text after the policy's system
    part) or ``as-context`` (before the query inside the policy's template); ``history``: ``refuse`` or
    ``keep`` (earlier turns sent before the templated last user turn); ``accept``: per sampling parameter
    the closed range of values sent upstream instead of the learned one (``parse_accept``). How each
    renders is ``Router.render``'s, documented in docs/deploy.md ("Chat front-ends").
    """

    system_message: str = "refuse"
    history: str = "refuse"
    accept: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        """Refuse a mode or a range that is not one of the documented ones."""
        if self.system_message not in SYSTEM_MODES:
            raise ValueError(f"system_message must be one of {', '.join(SYSTEM_MODES)}, got {self.system_message!r}")
        if self.history not in HISTORY_MODES:
            raise ValueError(f"history must be one of {', '.join(HISTORY_MODES)}, got {self.history!r}")
        seen = set()
        for name, low, high in self.accept:
            if name not in ACCEPT_BOUNDS:
                raise ValueError(f"accept: {name!r} is not a sampling parameter that can be accepted; "
                                 f"one of {', '.join(ACCEPT_BOUNDS)}")
            if name in seen:
                raise ValueError(f"accept: {name} is given twice")
            seen.add(name)
            lo, hi = ACCEPT_BOUNDS[name]
            if not (_finite(low) and _finite(high) and lo <= low <= high <= hi):
                raise ValueError(f"accept: {name}={low:g}:{high:g} must be a range LOW:HIGH with "
                                 f"{lo:g} <= LOW <= HIGH <= {hi:g}")

    def range_of(self, name: str) -> tuple[float, float] | None:
        """The declared range of a sampling parameter, None when only the learned value is accepted."""
        return next(((low, high) for n, low, high in self.accept if n == name), None)


def parse_accept(text: str) -> tuple[str, float, float]:
    """``NAME=LOW:HIGH`` (``serve --accept``) as (name, low, high); ValueError naming what is wrong."""
    name, eq, bounds = text.partition("=")
    low, colon, high = bounds.partition(":")
    try:
        if not (eq and colon):
            raise ValueError
        rule = (name.strip(), float(low), float(high))
    except ValueError:
        raise ValueError(f"--accept {text!r}: expected NAME=LOW:HIGH, e.g. temperature=0.0:1.0") from None
    CallerRules(accept=(rule,))  # checks the name and the range
    return rule


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
# The values the OpenAI API takes for each; a declared range must lie within them.
ACCEPT_BOUNDS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "frequency_penalty": (-2.0, 2.0),
                 "presence_penalty": (-2.0, 2.0)}
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


def _content(m: dict[str, Any], where: str, required: bool) -> str:
    """A message's text: a string, or text content parts joined; ``required``: it may not be empty."""
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{j}]", f"only text parts are supported, got type {_show(kind)}",
                           "unsupported_content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str) or (required and not content):
        raise _bad(f"{where}.content", "the user message has no text content" if required else
                   f"must be text, got {_show(content)}", "invalid_messages")
    return _text(content, f"{where}.content")


def _chat_messages(messages: Any, rules: CallerRules) -> tuple[str, str | None, tuple[tuple[str, str], ...]]:
    """A chat's query (its last message, the user's), system text and earlier turns, each as ``rules`` allow.

    Leading ``system`` (or ``developer``) messages are the system text, joined by a blank line; the
    messages between them and the last are the earlier turns (``user`` and ``assistant`` only).
    """
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of {role, content} objects", "invalid_messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"must be a {{role, content}} object, got {_show(m)}", "invalid_messages")
        unknown = sorted(set(m) - {"role", "content"})
        if unknown:
            raise _bad(f"messages[{i}].{unknown[0]}", "is not supported in a message", "unsupported_messages")
    last = len(messages) - 1
    if messages[last].get("role") != "user":
        raise _bad(f"messages[{last}].role", f"the last message must be the user's ('user'), got "
                                             f"{_show(messages[last].get('role'))}", "unsupported_messages")
    system: list[str] = []
    history: list[tuple[str, str]] = []
    for i, m in enumerate(messages[:last]):
        role = m.get("role")
        where = f"messages[{i}]"
        if role in SYSTEM_ROLES:
            if history:
                raise _bad(f"{where}.role", f"a {role} message is taken only before the conversation's turns",
                           "unsupported_messages")
            if rules.system_message == "refuse":
                raise _bad(where, f"a {role} message is refused here: the policy renders its own prompt, as it was "
                                  "learned; the server's operator can let it ride along with `iapo-gym serve "
                                  "--system-message append` or `--system-message as-context` (docs/deploy.md)",
                           "unsupported_messages")
            system.append(_content(m, where, required=False))
        elif role in ("user", "assistant"):
            if rules.history == "refuse":
                raise _bad(where, "earlier turns of a conversation are refused here: the policy answers one user "
                                  "message, as it was learned; the server's operator can send them along with "
                                  "`iapo-gym serve --history keep` (docs/deploy.md)", "unsupported_messages")
            history.append((str(role), _content(m, where, required=False)))
        else:
            raise _bad(f"{where}.role", f"must be 'system', 'developer', 'user' or 'assistant', got {_show(role)} "
                                        "(tools and functions are not supported)", "unsupported_messages")
    query = _content(messages[last], f"messages[{last}]", required=True)
    return query, ("\n\n".join(system) if system else None), tuple(history)


def _completion_query(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise _bad("prompt", "one prompt per request is answered (a list of prompts or token ids is not supported)",
                   "invalid_prompt")
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", f"must be a non-empty string, got {_show(prompt)}", "invalid_prompt")
    return _text(prompt, "prompt")


def read_request(body: Any, chat: bool, sampling: dict[str, Any], rules: CallerRules | None = None) -> Plan:
    """What to do for one request ``body`` (module docstring); ``sampling``: the spec's ``Sampling.as_dict()``;
    ``rules``: what the server accepts beyond the policy's prompt and sampling (default: nothing).

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
    rules = rules or CallerRules()
    system: str | None = None
    history: tuple[tuple[str, str], ...] = ()
    if chat:
        query, system, history = _chat_messages(body.get("messages"), rules)
    else:
        query = _completion_query(body.get("prompt"))
    context, model_context = _context(body)
    plan = Plan(query=query, context=context, model_context=model_context, system=system, history=history)
    if system is not None:
        plan.changed["system_message"] = f"{rules.system_message}: with the policy's prompt (docs/deploy.md)"
    if history:
        plan.changed["history"] = f"keep: {len(history)} earlier turn(s) with the policy's prompt (docs/deploy.md)"
    for name, (neutral, why) in NEUTRAL.items():
        value = body.get(name)
        if value is not None and value not in neutral:
            raise _bad(name, f"{_show(value)} is not supported: {why}" if why else f"{_show(value)} is not supported")
    for name, default in SAMPLING_DEFAULTS.items():
        value = body.get(name)
        if value is None:
            continue
        learned = sampling.get(name, default)
        if _finite(value) and float(value) == float(learned):
            continue
        span = rules.range_of(name)
        if span is not None and _finite(value) and span[0] <= float(value) <= span[1]:
            plan.sampling[name] = float(value)
            plan.changed[name] = f"{float(value):g} sent upstream (the policy was learned at {learned:g}; this " \
                                 f"server accepts {span[0]:g} to {span[1]:g})"
            continue
        also = f", or a value from {span[0]:g} to {span[1]:g}" if span is not None else \
            f" (the server's operator can accept a range with `iapo-gym serve --accept {name}=LOW:HIGH`)"
        raise _bad(name, f"{_show(value)} is not supported: the policy was learned at {name} = {learned:g}; "
                         f"send {learned:g} or leave it out{also}")
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


def stop_note(upstream: bool) -> str:
    """What ``iapo.parameters.stop`` says: whether the stop sequences went upstream (N = 1) or only cut the answer."""
    if upstream:
        return "sent upstream and applied to the returned completion"
    return "applied to the returned completion only (not sent upstream: the vote or the scores are over whole " \
           "completions, as the policy was learned)"
