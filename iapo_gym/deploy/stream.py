"""One streamed answer of ``serve``: server-sent events in the OpenAI chunk format, made as the text comes.

The request's work puts each piece of text the upstream sends (N = 1) into ``EventStream.text``,
which queues it as one chunk event, cut at the caller's stop sequences (the last characters that
could begin one are held back until the next piece); the server's ``StreamingResponse`` sends the
queued events (``events``) and, once the answer is in, ``finish``'s (the rest held back, or the
whole answer when nothing was streamed, N > 1: once decided; the final chunk with ``finish_reason``
and the ``iapo`` object; usage if asked; ``[DONE]``), or ``error``'s event when the request failed
after text went out, as the OpenAI API ends a started stream. Events wait in memory while the caller
reads slowly: an answer is at most its ``max_tokens``, within the request's deadline.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from iapo_gym.deploy.health import UpstreamWatch
from iapo_gym.deploy.router import Routed
from iapo_gym.outcome_log import new_response_id

__all__ = ["EventStream", "cut"]


def cut(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first of ``stops``, and whether it was cut."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


class EventStream:
    """The events of one streamed answer (module docstring)."""

    def __init__(self, chat: bool, upstream: UpstreamWatch) -> None:
        """``chat``: the chat API's chunk shape (else the completions API's); ``upstream``: told of each piece.
        Made on the running loop."""
        self.chat, self.upstream = chat, upstream
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: the request's work is done
        # done at the first text queued (the answer is a stream from here on) or when the work is done
        self.decided: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.head: dict[str, Any] = {}
        self.stops: tuple[str, ...] = ()
        self.keep = 0  # characters held back: one less than the longest stop sequence
        self.held = ""
        self.cut = False  # a stop sequence was found: nothing more of the text goes out
        self.role_sent = False
        self.first: float | None = None  # perf_counter() when the first text was queued

    def open(self, model: str, stops: tuple[str, ...]) -> None:
        """Name the model and the stop sequences (once the request's context is known)."""
        self.head = {"id": new_response_id("chatcmpl-" if self.chat else "cmpl-"),
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.stops, self.keep = stops, max((len(s) for s in stops), default=1) - 1

    def done(self, work: asyncio.Future[Any]) -> None:
        """The request's ``work`` is done: ``events`` ends after what is queued (its done-callback; its outcome is
        read by the server, here only marked as read, so that a caller gone first leaves no warning)."""
        if not work.cancelled():
            work.exception()
        self.queue.put_nowait(None)
        if not self.decided.done():
            self.decided.set_result(None)

    async def events(self) -> AsyncIterator[bytes]:
        """The queued events, then each as it comes, until ``done``."""
        while (event := await self.queue.get()) is not None:
            yield event

    @staticmethod
    def _event(doc: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(doc).encode() + b"\n\n"

    def _chunk(self, text: str) -> bytes:
        if self.chat:
            delta = {"content": text} if self.role_sent else {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
        self.role_sent = True
        if self.first is None:
            self.first = time.perf_counter()
        return self._event({**self.head, "choices": [choice]})

    async def text(self, piece: str) -> None:
        """One piece of the answer as the upstream sent it (``Router.astream``'s ``on_text``)."""
        self.upstream.answered = time.monotonic()  # the upstream is answering: not a stall
        if self.cut:
            return
        buffer = self.held + piece
        if self.stops:
            out, found = cut(buffer, self.stops)
            if found:
                self.cut, self.held = True, ""
            else:
                split = max(0, len(buffer) - self.keep)
                out, self.held = buffer[:split], buffer[split:]
        else:
            out = buffer
        if out:
            self.queue.put_nowait(self._chunk(out))
            if not self.decided.done():
                self.decided.set_result(None)

    def finish(self, routed: Routed, text: str, finish: str, info: dict[str, Any],
               usage: dict[str, int] | None) -> list[bytes]:
        """The rest of the answer (``text``: the returned text, cut), the final chunk, usage, ``[DONE]``."""
        rest = ("" if self.cut else self.held) if routed.streamed else text
        out = [self._chunk(rest)] if rest or not self.role_sent else []
        delta: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
        out.append(self._event({**self.head, "choices": [{"index": 0, **delta, "finish_reason": finish,
                                                          "logprobs": None}], "iapo": info}))
        if usage is not None:
            out.append(self._event({**self.head, "choices": [], "usage": usage}))
        out.append(b"data: [DONE]\n\n")
        return out

    @staticmethod
    def error(body: bytes) -> bytes:
        """The event that ends a started stream with an error (the OpenAI error object)."""
        return b"data: " + body + b"\n\n"
