"""``iapo-gym serve`` streams in the OpenAI chunk format and honours or refuses each caller parameter.

llama.cpp with the tiny model behind the counting proxy, serve as a process, the official ``openai``
client and its streaming iterator.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.deploy_helpers import FIRST_CHAR, mv_policy, start_serve
from tests.llm_server import (
    free_port,
    llama_server,  # noqa: F401 (fixture)
    proxy_stats,
    start_proxy,
    stop,
    tiny_model,  # noqa: F401 (fixture)
    write_spec,
)

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

N_OF = {"low": 3, "mid": 2, "high": 1}


@pytest.fixture(scope="module")
def stack(llama_server: int, tmp_path_factory: pytest.TempPathFactory) -> object:  # noqa: F811
    """llama.cpp <- counting proxy <- serve; yields (openai client, proxy port)."""
    folder = tmp_path_factory.mktemp("stream")
    proxy_port, serve_port = free_port(), free_port()
    proxy = start_proxy(llama_server, proxy_port)
    spec = write_spec(folder, proxy_port, sampling={"temperature": 0.9, "max_tokens": 8, "seed": 3})
    serve = start_serve(mv_policy(extractor=FIRST_CHAR).save(folder / "policy.json"), spec, serve_port)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key="x", max_retries=0), proxy_port
    finally:
        stop(serve)
        stop(proxy)


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_with_the_official_iterator(stack: tuple[Any, int], chat: bool) -> None:
    client, proxy_port = stack
    for context, n in N_OF.items():
        query = f"{n} + {n} ="
        if chat:
            whole = client.chat.completions.create(model=f"iapo/{context}",
                                                   messages=[{"role": "user", "content": query}])
            text = whole.choices[0].message.content
        else:
            whole = client.completions.create(model=f"iapo/{context}", prompt=query)
            text = whole.choices[0].text
        before = proxy_stats(proxy_port)
        if chat:
            stream = client.chat.completions.create(model=f"iapo/{context}", stream=True,
                                                    stream_options={"include_usage": True},
                                                    messages=[{"role": "user", "content": query}])
        else:
            stream = client.completions.create(model=f"iapo/{context}", prompt=query, stream=True,
                                               stream_options={"include_usage": True})
        chunks = list(stream)
        after = proxy_stats(proxy_port)
        iapo = [c.model_extra["iapo"] for c in chunks if c.model_extra and "iapo" in c.model_extra]
        assert len(iapo) == 1 and iapo[0]["n"] == n and iapo[0]["context"] == context
        # exactly the completions drawn went upstream, as many as without streaming (the same seeded completions)
        assert after["choices"] - before["choices"] == iapo[0]["drawn"] == whole.model_extra["iapo"]["drawn"]
        assert n // 2 + 1 <= iapo[0]["drawn"] <= n
        pieces = [c.choices[0].delta.content or "" if chat else c.choices[0].text for c in chunks if c.choices]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert "".join(pieces) == text  # the same answer as without streaming (seeded completions and ties)
        assert finishes[-1] == whole.choices[0].finish_reason and all(f is None for f in finishes[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
            after["completion_tokens"] - before["completion_tokens"]
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
        assert all(c.model == f"iapo/{context}" for c in chunks)
        # without include_usage: no usage chunk
        plain = list(client.completions.create(model=f"iapo/{context}", prompt=query, stream=True)) if not chat else \
            list(client.chat.completions.create(model=f"iapo/{context}", stream=True,
                                                messages=[{"role": "user", "content": query}]))
        assert all(c.choices for c in plain) and all(c.usage is None for c in plain)


def test_parameters_are_honoured_within_the_policy_or_refused(stack: tuple[Any, int]) -> None:
    client, proxy_port = stack
    # max_tokens below the spec's is sent upstream; above it, the spec's is used and the response says so
    before = proxy_stats(proxy_port)
    short = client.completions.create(model="iapo/low", prompt="Name a letter:", max_tokens=1)
    after = proxy_stats(proxy_port)
    assert after["completion_tokens"] - before["completion_tokens"] == short.usage.completion_tokens <= 3 * (1 + 3)
    assert "parameters" not in short.model_extra["iapo"]
    long = client.chat.completions.create(model="iapo/high", messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=1000)
    assert long.model_extra["iapo"]["parameters"] == {
        "max_completion_tokens": "1000 asked; the policy's 8 used (its upper bound)"}
    # the learned sampling is accepted as is; another value is refused, naming the parameter
    same = client.completions.create(model="iapo/high", prompt="1 + 1 =", temperature=0.9, top_p=1, seed=7,
                                     frequency_penalty=0, presence_penalty=0, n=1, user="u-1")
    assert same.model_extra["iapo"]["parameters"] == {"user": "not sent upstream"}
    again = client.completions.create(model="iapo/high", prompt="1 + 1 =", seed=7)
    assert again.choices[0].text == same.choices[0].text  # the caller's seed fixes the completions
    refused = {
        "temperature": dict(temperature=0.2), "top_p": dict(top_p=0.5), "n": dict(n=2),
        "logprobs": dict(logprobs=2), "echo": dict(echo=True), "best_of": dict(best_of=3),
        "presence_penalty": dict(presence_penalty=1.0), "suffix": dict(suffix="x"),
        "logit_bias": dict(logit_bias={"50256": -100}), "max_tokens": dict(max_tokens=0),
        "iapo_unknown": dict(extra_body={"iapo_unknown": 1}),
    }
    before = proxy_stats(proxy_port)["posts"]
    for param, kwargs in refused.items():
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="iapo/high", prompt="1 + 1 =", **kwargs)
        assert info.value.body["param"] == param and param in info.value.message, (param, info.value.body)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    chat_refused = {
        "tools": dict(tools=[tool], messages=[{"role": "user", "content": "hi"}]),
        "response_format": dict(response_format={"type": "json_object"}, messages=[{"role": "user", "content": "hi"}]),
        "messages[0].content[1]": dict(messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]),
        "messages": dict(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]),
        "messages[0].role": dict(messages=[{"role": "assistant", "content": "hi"}]),
    }
    for param, kwargs in chat_refused.items():
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="iapo/high", **kwargs)
        assert info.value.body["param"] == param, (param, info.value.body)
    assert proxy_stats(proxy_port)["posts"] == before  # nothing refused went upstream
    # text parts are joined; stop cuts the returned completion (the vote is over whole completions)
    parts = client.chat.completions.create(model="iapo/high", messages=[{"role": "user", "content": [
        {"type": "text", "text": "1 + "}, {"type": "text", "text": "1 ="}]}])
    whole = client.chat.completions.create(model="iapo/high", messages=[{"role": "user", "content": "1 + 1 ="}])
    assert parts.choices[0].message.content == whole.choices[0].message.content
    text = whole.choices[0].message.content
    cut_at = next((ch for ch in text[1:] if ch.strip()), None)
    if cut_at is not None:
        stopped = client.chat.completions.create(model="iapo/high", stop=[cut_at],
                                                 messages=[{"role": "user", "content": "1 + 1 ="}])
        assert stopped.choices[0].message.content == text[:text.index(cut_at, 0)]
        assert stopped.choices[0].finish_reason == "stop" and "stop" in stopped.model_extra["iapo"]["parameters"]
        assert re.match(r"applied to the returned completion", stopped.model_extra["iapo"]["parameters"]["stop"])
