"""Chat front-ends: a system message, earlier turns and sampling parameters under each ``serve`` setting.

llama.cpp with the tiny model behind the counting proxy (which records every body it forwards), ``iapo-gym
serve`` as processes with ``--system-message``, ``--history`` and ``--accept``, the official ``openai``
client. Each accepted request must reach the upstream as exactly the messages or prompt docs/deploy.md
("Chat front-ends") describes; each refused one gets 400 naming the option that would accept it, and
nothing goes upstream.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from iapo_gym.deploy.params import CallerRules, parse_accept
from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyPrompt
from tests.deploy_helpers import FIRST_CHAR, mv_policy, start_serve
from tests.llm_server import (
    free_port,
    llama_server,  # noqa: F401 (fixture)
    proxy_bodies,
    proxy_stats,
    start_proxy,
    stop,
    tiny_model,  # noqa: F401 (fixture)
    write_spec,
)

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

POLICY_SYSTEM = "Answer with a number."
CHAT_PROMPTS = {"sys": ((("system", POLICY_SYSTEM), ("user", "Q: {query}"))), "bare": (("user", "Q: {query}"),)}
SYSTEM = "Be brief."
HISTORY = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
QUERY = "1 + 1 ="


def chat_policy() -> PolicyFile:
    """A chat-API majority-vote policy: context 'sys' (a prompt with a system message) and 'bare' (none), N = 1."""
    return PolicyFile(
        task="tiny", aggregator="mv", api="chat", n_max=2, objectives=("correct",), scorer=FIRST_CHAR, sampling=None,
        prompts=tuple(PolicyPrompt(pid, None, messages) for pid, messages in CHAT_PROMPTS.items()),
        contexts=(PolicyContext("sys", (1.0,), -0.5, 0.5, "sys", 1), PolicyContext("bare", (1.0,), -1.0, 0.5, "bare", 1)),
        learned={"agent": "test"}, estimate={"method": None})


SERVERS = {  # name: (API of the policy, serve options)
    "refuse": ("chat", []),
    "append_keep": ("chat", ["--system-message", "append", "--history", "keep", "--accept", "temperature=0.0:1.0",
                             "--max-prompt-chars", "200"]),
    "context": ("chat", ["--system-message", "as-context"]),
    "completions": ("completions", ["--system-message", "as-context", "--history", "keep"]),
}


@pytest.fixture(scope="module")
def stack(llama_server: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], int]]:  # noqa: F811
    """llama.cpp <- counting proxy <- one serve per setting; yields ({name: openai client}, proxy port)."""
    folder = tmp_path_factory.mktemp("chat")
    proxy_port = free_port()
    proxy = start_proxy(llama_server, proxy_port)
    chat_spec = write_spec(folder, proxy_port, endpoint={"api": "chat"}, name="chat.json", extra={"prompts": [
        {"id": pid, "messages": [{"role": r, "content": c} for r, c in messages]}
        for pid, messages in CHAT_PROMPTS.items()]})
    completions_spec = write_spec(folder, proxy_port, name="completions.json")
    policies = {"chat": chat_policy().save(folder / "chat-policy.json"),
                "completions": mv_policy(extractor=FIRST_CHAR).save(folder / "completions-policy.json")}
    procs, clients = [], {}
    try:
        for name, (api, extra) in SERVERS.items():
            port = free_port()
            procs.append(start_serve(policies[api], chat_spec if api == "chat" else completions_spec, port,
                                     extra=extra))
            clients[name] = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        yield clients, proxy_port
    finally:
        for proc in procs:
            stop(proc)
        stop(proxy)


def sent(proxy_port: int, before: int) -> dict[str, Any]:
    """The one body the proxy received since ``before`` posts."""
    bodies = proxy_bodies(proxy_port)
    assert len(bodies) == before + 1, bodies[before:]
    return bodies[-1]


def ask(client: Any, context: str, messages: list[dict[str, str]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=f"iapo/{context}", messages=messages, **kwargs)


def refused(client: Any, proxy_port: int, messages: list[dict[str, str]], **kwargs: Any) -> Any:
    """The 400 of a request that must not go upstream."""
    before = proxy_stats(proxy_port)["posts"]
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, "sys", messages, **kwargs)
    assert proxy_stats(proxy_port)["posts"] == before
    return info.value


def test_refuse_names_the_option_that_would_accept(stack: tuple[dict[str, Any], int]) -> None:
    clients, proxy_port = stack
    user = [{"role": "user", "content": QUERY}]
    error = refused(clients["refuse"], proxy_port, [{"role": "system", "content": SYSTEM}, *user])
    assert error.body["param"] == "messages[0]" and error.body["code"] == "unsupported_messages"
    assert "--system-message append" in error.message and "--system-message as-context" in error.message
    error = refused(clients["refuse"], proxy_port, [*HISTORY, *user])
    assert error.body["param"] == "messages[0]" and "--history keep" in error.message
    # with system messages accepted, history is still refused where --history is refuse (and vice versa)
    error = refused(clients["context"], proxy_port, [{"role": "system", "content": SYSTEM}, *HISTORY, *user])
    assert error.body["param"] == "messages[1]" and "--history keep" in error.message
    error = refused(clients["completions"], proxy_port, [*HISTORY, {"role": "system", "content": SYSTEM}, *user])
    assert error.body["param"] == "messages[2].role" and "before the conversation" in error.message
    # the last message is the user's turn to answer; tools are not a conversation this server keeps
    error = refused(clients["append_keep"], proxy_port, [*user, {"role": "assistant", "content": "2"}])
    assert error.body["param"] == "messages[1].role"
    error = refused(clients["append_keep"], proxy_port, [{"role": "tool", "content": "x"}, *user])
    assert error.body["param"] == "messages[0].role"
    # another temperature: the option that would accept it is named, or the range accepted
    error = refused(clients["refuse"], proxy_port, user, temperature=0.5)
    assert error.body["param"] == "temperature" and "--accept temperature=LOW:HIGH" in error.message
    error = refused(clients["append_keep"], proxy_port, user, temperature=1.5)
    assert error.body["param"] == "temperature" and "a value from 0 to 1" in error.message


def test_append_and_keep_send_the_documented_messages(stack: tuple[dict[str, Any], int]) -> None:
    clients, proxy_port = stack
    client = clients["append_keep"]
    messages = [{"role": "system", "content": SYSTEM}, *HISTORY, {"role": "user", "content": QUERY}]
    before = proxy_stats(proxy_port)["posts"]
    answer = ask(client, "sys", messages)
    # the policy's system message with the caller's text after it, the earlier turns, then the templated user turn
    assert sent(proxy_port, before)["messages"] == [
        {"role": "system", "content": f"{POLICY_SYSTEM}\n\n{SYSTEM}"}, *HISTORY,
        {"role": "user", "content": f"Q: {QUERY}"}]
    assert answer.model_extra["iapo"]["parameters"] == {
        "system_message": "append: with the policy's prompt (docs/deploy.md)",
        "history": "keep: 2 earlier turn(s) with the policy's prompt (docs/deploy.md)"}
    before += 1
    ask(client, "bare", messages)  # a policy prompt without a system message: the caller's goes first
    assert sent(proxy_port, before)["messages"] == [
        {"role": "system", "content": SYSTEM}, *HISTORY, {"role": "user", "content": f"Q: {QUERY}"}]
    before += 1
    # several leading system messages are one system text; text parts are joined
    ask(client, "sys", [{"role": "system", "content": "A."}, {"role": "developer", "content": [
        {"type": "text", "text": "B"}, {"type": "text", "text": "."}]}, {"role": "user", "content": QUERY}])
    assert sent(proxy_port, before)["messages"] == [
        {"role": "system", "content": f"{POLICY_SYSTEM}\n\nA.\n\nB."}, {"role": "user", "content": f"Q: {QUERY}"}]
    before += 1
    # the prompt-length limit counts everything sent: a long system text is refused where the query alone is not
    error = refused(client, proxy_port, [{"role": "system", "content": "x" * 200}, {"role": "user", "content": QUERY}])
    assert error.body["code"] == "prompt_too_long"
    error = refused(client, proxy_port, [{"role": "user", "content": "y" * 100}, {"role": "assistant", "content": "z" * 80},
                                         {"role": "user", "content": QUERY}])
    assert error.body["code"] == "prompt_too_long"


def test_as_context_puts_the_system_text_before_the_query(stack: tuple[dict[str, Any], int]) -> None:
    clients, proxy_port = stack
    before = proxy_stats(proxy_port)["posts"]
    ask(clients["context"], "sys", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUERY}])
    # the policy's messages unchanged, the caller's system text inside the template, before the query
    assert sent(proxy_port, before)["messages"] == [
        {"role": "system", "content": POLICY_SYSTEM}, {"role": "user", "content": f"Q: {SYSTEM}\n\n{QUERY}"}]


def test_completions_api_policy_renders_the_chat_into_its_prompt(stack: tuple[dict[str, Any], int]) -> None:
    clients, proxy_port = stack
    before = proxy_stats(proxy_port)["posts"]
    answer = ask(clients["completions"], "high", [{"role": "system", "content": SYSTEM}, *HISTORY,
                                                  {"role": "user", "content": QUERY}])
    # the template "{query} ->" with the system text before the query; the earlier turns as lines before it
    assert sent(proxy_port, before)["prompt"] == f"User: hi\nAssistant: hello\n\n{SYSTEM}\n\n{QUERY} ->"
    assert answer.choices[0].message.content is not None
    # the same chat without the system message and history: the plain template
    ask(clients["completions"], "high", [{"role": "user", "content": QUERY}])
    assert sent(proxy_port, before + 1)["prompt"] == f"{QUERY} ->"


def test_accepted_temperature_goes_upstream(stack: tuple[dict[str, Any], int]) -> None:
    clients, proxy_port = stack
    user = [{"role": "user", "content": QUERY}]
    before = proxy_stats(proxy_port)["posts"]
    answer = ask(clients["append_keep"], "sys", user, temperature=0.5)
    assert sent(proxy_port, before)["temperature"] == 0.5
    assert answer.model_extra["iapo"]["parameters"]["temperature"] == \
        "0.5 sent upstream (the policy was learned at 0; this server accepts 0 to 1)"
    # the learned value is accepted anywhere, and changes nothing
    learned = ask(clients["refuse"], "sys", user, temperature=0)
    assert sent(proxy_port, before + 1)["temperature"] == 0.0 and "parameters" not in learned.model_extra["iapo"]


def test_rules_render_both_apis_as_documented(tmp_path: Path) -> None:
    """Router.render for every mode on both APIs (no upstream is called)."""
    from iapo_gym.deploy.router import Router

    spec = write_spec(tmp_path, free_port())
    chat_spec = write_spec(tmp_path, free_port(), endpoint={"api": "chat"}, name="chat.json", extra={"prompts": [
        {"id": pid, "messages": [{"role": r, "content": c} for r, c in messages]}
        for pid, messages in CHAT_PROMPTS.items()]})
    history = (("user", "hi"), ("assistant", "hello"))
    cases = {
        ("append", "completions"): f"{SYSTEM}\n\nUser: hi\nAssistant: hello\n\nQ: {QUERY}\nA:",
        ("as-context", "completions"): f"User: hi\nAssistant: hello\n\nQ: {SYSTEM}\n\n{QUERY}\nA:",
        ("append", "chat"): [{"role": "system", "content": f"{POLICY_SYSTEM}\n\n{SYSTEM}"},
                             {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                             {"role": "user", "content": f"Q: {QUERY}"}],
        ("as-context", "chat"): [{"role": "system", "content": POLICY_SYSTEM}, {"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "hello"},
                                 {"role": "user", "content": f"Q: {SYSTEM}\n\n{QUERY}"}],
    }
    for (mode, api), expected in cases.items():
        rules = CallerRules(system_message=mode, history="keep")
        router = Router(chat_policy(), chat_spec, rules=rules) if api == "chat" else \
            Router(mv_policy(extractor=FIRST_CHAR), spec, rules=rules)
        ctx = router.resolve("sys" if api == "chat" else "low")
        assert router.render(ctx, QUERY, SYSTEM, history) == expected, (mode, api)
        assert router.render(ctx, QUERY) == router._prompts[ctx.prompt].render(QUERY)  # nothing added: the policy's
    strict = Router(mv_policy(extractor=FIRST_CHAR), spec)
    with pytest.raises(ValueError, match="system_message = 'refuse'"):
        strict.render(strict.resolve("low"), QUERY, SYSTEM)
    with pytest.raises(ValueError, match="history = 'refuse'"):
        strict.render(strict.resolve("low"), QUERY, None, history)


def test_bad_rules_are_refused_naming_the_value() -> None:
    assert parse_accept("temperature=0.2:0.8") == ("temperature", 0.2, 0.8)
    for text, match in (("temperature", "expected NAME=LOW:HIGH"), ("temperature=a:1", "expected NAME=LOW:HIGH"),
                        ("max_tokens=1:5", "'max_tokens' is not a sampling parameter"),
                        ("top_p=0.5:1.5", r"0 <= LOW <= HIGH <= 1"), ("temperature=0.9:0.1", "LOW <= HIGH"),
                        ("temperature=nan:1", "LOW <= HIGH")):
        with pytest.raises(ValueError, match=match):
            parse_accept(text)
    with pytest.raises(ValueError, match="system_message must be one of refuse, append, as-context, got 'merge'"):
        CallerRules(system_message="merge")
    with pytest.raises(ValueError, match="history must be one of refuse, keep"):
        CallerRules(history="all")
    with pytest.raises(ValueError, match="given twice"):
        CallerRules(accept=(("top_p", 0.1, 0.2), ("top_p", 0.3, 0.4)))
