"""``iapo-gym serve`` streams in the OpenAI chunk format and honours or refuses each caller parameter.

llama.cpp with the tiny model behind the counting proxy (which relays a stream line by line), serve as a
process, the official ``openai`` client and its streaming iterator; for timing, cancellation and early
votes, the echo upstream (tests/echo_upstream.py) whose streams send one character every ``stream_delay``.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.deploy_helpers import FIRST_CHAR, bon_policy, mv_policy, start_serve
from tests.echo_upstream import EchoUpstream
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
        assert proxy_bodies(proxy_port)[-1].get("stream", False) is (n == 1)  # N = 1: streamed from the upstream
        iapo = [c.model_extra["iapo"] for c in chunks if c.model_extra and "iapo" in c.model_extra]
        assert len(iapo) == 1 and iapo[0]["n"] == n and iapo[0]["context"] == context
        # exactly the completions drawn went upstream, as many as without streaming (the same seeded completions)
        assert after["choices"] - before["choices"] == iapo[0]["drawn"] == whole.model_extra["iapo"]["drawn"]
        assert n // 2 + 1 <= iapo[0]["drawn"] <= n
        pieces = [c.choices[0].delta.content or "" if chat else c.choices[0].text for c in chunks if c.choices]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert "".join(pieces) == text  # the same answer as without streaming (seeded completions and ties)
        assert finishes[-1] == whole.choices[0].finish_reason and all(f is None for f in finishes[:-1])
        texts = [p for p in pieces if p]
        if n == 1:  # true streaming: one chunk per piece the upstream sent, as many as it sent
            assert len(texts) == after["stream_deltas"] - before["stream_deltas"] > 1
            # llama-cpp-python's server reports no usage in a stream: the completion counts its worst case
            assert after["completion_tokens"] == before["completion_tokens"]
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8 + 3
        else:  # the answer once the vote is decided, in one chunk
            assert len(texts) <= 1 and after["stream_deltas"] == before["stream_deltas"]
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
        "messages[0]": dict(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]),
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
    cut_at = next(ch for ch in text[1:] if ch.strip())
    for stream in (False, True):
        # N = 1: the stop sequence goes upstream too (the upstream stops there), and cuts the returned text
        before = proxy_stats(proxy_port)["posts"]
        stopped = client.chat.completions.create(model="iapo/high", stop=[cut_at], stream=stream,
                                                 messages=[{"role": "user", "content": "1 + 1 ="}])
        if stream:
            chunks = list(stopped)
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish, info = chunks[-1].choices[0].finish_reason, chunks[-1].model_extra["iapo"]
        else:
            got, finish, info = stopped.choices[0].message.content, stopped.choices[0].finish_reason, \
                stopped.model_extra["iapo"]
        assert got == text[:text.index(cut_at)] and finish == "stop"
        assert info["parameters"]["stop"] == "sent upstream and applied to the returned completion"
        assert proxy_bodies(proxy_port)[before]["stop"] == [cut_at]
    # N = 3: the vote is over whole completions; the stop sequence only cuts the returned text
    before = proxy_stats(proxy_port)["posts"]
    voted = client.chat.completions.create(model="iapo/low", stop=["\n"], messages=[{"role": "user", "content": "hi"}])
    assert all("stop" not in body for body in proxy_bodies(proxy_port)[before:])
    assert "\n" not in voted.choices[0].message.content
    assert re.match(r"applied to the returned completion only", voted.model_extra["iapo"]["parameters"]["stop"])


def _echo_serve(up: EchoUpstream, folder: Path, extra: list[str] | None = None) -> tuple[Any, Any]:
    """serve in front of the echo upstream (contexts low/mid/high: N = 3, 2, 1); (process, openai client)."""
    port = free_port()
    spec = write_spec(folder, 0, endpoint={"base_url": up.url, "max_retries": 0})
    proc = start_serve(mv_policy().save(folder / "policy.json"), spec, port, extra=extra)
    return proc, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("chat", [False, True])
def test_n1_text_arrives_while_the_upstream_is_still_sending(tmp_path: Path, chat: bool) -> None:
    answer = "0123456789"
    with EchoUpstream(answer, stream_delay=0.1) as up:  # one character every 0.1 s: the whole answer takes 1 s
        proc, client = _echo_serve(up, tmp_path)
        try:
            if chat:
                stream = client.chat.completions.create(model="iapo/high", messages=[{"role": "user", "content": "q"}],
                                                        stream=True, stream_options={"include_usage": True})
            else:
                stream = client.completions.create(model="iapo/high", prompt="q", stream=True,
                                                   stream_options={"include_usage": True})
            pieces, arrived = [], []
            for chunk in stream:
                piece = (chunk.choices[0].delta.content if chat else chunk.choices[0].text) if chunk.choices else None
                if piece:
                    pieces.append(piece)
                    arrived.append(time.monotonic())
            # each character as its own chunk, the first well before the upstream sent its last (the upstream
            # notes its finish just after its last write, so the caller can read [DONE] a moment before it does)
            assert pieces == list(answer)
            deadline = time.monotonic() + 3
            while not up.streams_done and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(up.streams_done) == 1 and arrived[0] < up.streams_done[0] - 0.5
            assert up.bodies[-1]["stream"] is True and up.bodies[-1]["stream_options"] == {"include_usage": True}
            # the usage is the upstream's own final usage chunk (the echo counts a token per character, and the
            # words of the prompt "q ->")
            assert chunk.usage.completion_tokens == len(answer) and chunk.usage.prompt_tokens == 2
        finally:
            stop(proc)


def test_best_of_one_streams_then_scores(tmp_path: Path) -> None:
    with EchoUpstream("12345", stream_delay=0.05) as up:
        port = free_port()
        spec = write_spec(tmp_path, 0, aggregator="bon", endpoint={"base_url": up.url, "max_retries": 0})
        proc = start_serve(bon_policy(n=1).save(tmp_path / "policy.json"), spec, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        try:
            chunks = list(client.completions.create(model="iapo/long", prompt="q", stream=True))
            assert [c.choices[0].text for c in chunks[:-1]] == list("12345")  # one chunk per upstream chunk
            info = chunks[-1].model_extra["iapo"]  # scored once the completion is in: 5 characters, all digits
            assert info["aggregator"] == "bon" and info["objective_scores"] == [{"length": -0.5, "digits": 1.0}]
            assert up.bodies[-1]["stream"] is True
        finally:
            stop(proc)


def test_a_decided_vote_streams_before_all_n_are_drawn(tmp_path: Path) -> None:
    with EchoUpstream("7") as up:  # every completion answers 7: a vote of 3 is decided by the first 2
        proc, client = _echo_serve(up, tmp_path)
        try:
            chunks = list(client.completions.create(model="iapo/low", prompt="q", stream=True))
            info = chunks[-1].model_extra["iapo"]
            assert info["n"] == 3 and info["drawn"] == 2 and info["votes"] == [["7", 2]]
            assert "".join(c.choices[0].text for c in chunks) == "7"
            assert sum(int(b.get("n") or 1) for b in up.bodies) == 2  # the third completion was never asked for
            assert not any(b.get("stream") for b in up.bodies)  # N > 1: whole completions, then the vote
        finally:
            stop(proc)


def test_a_caller_gone_or_the_deadline_cancels_the_upstream_stream(tmp_path: Path) -> None:
    with EchoUpstream("x" * 40, stream_delay=0.1) as up:  # a 4 s stream
        proc, client = _echo_serve(up, tmp_path, ["--deadline", "1.5"])
        port = int(str(client.base_url).rsplit(":", 1)[1].split("/")[0])
        try:
            # the caller reads the first event and hangs up: the upstream's stream is broken off at once
            body = b'{"model": "iapo/high", "prompt": "q", "stream": true}'
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                             b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                assert b"data: " in sock.recv(4096) or b"data: " in sock.recv(4096)
            deadline = time.monotonic() + 3
            while up.broken == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert up.broken == 1 and up.streams_done == []
            # the deadline passes mid-stream: the stream ends with the error event, the upstream call is cancelled
            start = time.monotonic()
            with pytest.raises(openai.APIError, match="deadline of 1.5 s"):
                for _ in client.completions.create(model="iapo/high", prompt="q", stream=True):
                    pass
            assert 1.4 < time.monotonic() - start < 3.0
            deadline = time.monotonic() + 3
            while up.broken < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert up.broken == 2 and up.streams_done == []
        finally:
            stop(proc)
