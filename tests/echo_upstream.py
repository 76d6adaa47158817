"""A header-echoing OpenAI-compatible upstream on 127.0.0.1 (a thread of the test process) for the serve tests.

Completions and chat completions answer ``answer`` for each of ``n`` choices, or with ``answers`` the next
texts of that list in turn, one per choice (usage: completion tokens = characters of the answers, prompt
tokens = words of the prompt). A prompt containing ``STATUS:NNN``
gets HTTP NNN with a body that echoes, as some providers do, the ``Authorization`` header it received,
the prompt and this server's address; ``SLEEP:S`` waits S seconds first. With ``stream: true`` the
answer goes as server-sent events, one character a chunk (``stream_delay`` seconds apart), then the
finish chunk, a usage chunk when ``stream_options.include_usage``, and ``[DONE]``; ``streams_done``
records when each finished (``time.monotonic()``). ``GET /v1/models`` answers
``models_status``. ``headers`` and ``bodies`` record every POST; ``posts`` counts them.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class EchoUpstream:
    """The upstream (module docstring); ``url`` is its ``/v1`` base."""

    def __init__(self, answer: str = "42", answers: list[str] | None = None, stream_delay: float = 0.0) -> None:
        self.answer = answer
        self.answers = answers
        self.stream_delay = stream_delay
        self.streams_done: list[float] = []
        self.turn = 0
        self.models_status = 200
        self.headers: list[dict[str, str]] = []
        self.bodies: list[dict[str, Any]] = []
        self.posts = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, doc: Any) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, chat: bool, text: str, prompt_tokens: int, usage: bool) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True

                def event(choice: dict[str, Any] | None, **more: Any) -> None:
                    doc = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
                           "model": "echo", "choices": [choice] if choice else [], **more}
                    self.wfile.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
                    self.wfile.flush()

                for ch in text:
                    time.sleep(outer.stream_delay)
                    event({"index": 0, "delta": {"content": ch}, "finish_reason": None} if chat else
                          {"index": 0, "text": ch, "finish_reason": None})
                event({"index": 0, "delta": {}, "finish_reason": "stop"} if chat else
                      {"index": 0, "text": "", "finish_reason": "stop"})
                if usage:
                    event(None, usage={"prompt_tokens": prompt_tokens, "completion_tokens": len(text),
                                       "total_tokens": prompt_tokens + len(text)})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                outer.streams_done.append(time.monotonic())

            def do_GET(self) -> None:  # noqa: N802
                if outer.models_status != 200:
                    self._send(outer.models_status, {"error": {"message": "no"}})
                else:
                    self._send(200, {"object": "list", "data": [{"id": "echo", "object": "model"}]})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                headers = {k.lower(): v for k, v in self.headers.items()}
                with outer.lock:
                    outer.posts += 1
                    outer.headers.append(headers)
                    outer.bodies.append(body)
                chat = self.path.endswith("/chat/completions")
                prompt = body["messages"][-1]["content"] if chat else body["prompt"]
                sleep = re.search(r"SLEEP:([0-9.]+)", prompt)
                if sleep:
                    time.sleep(float(sleep.group(1)))
                status = re.search(r"STATUS:(\d{3})", prompt)
                if status:
                    code = int(status.group(1))
                    auth = headers.get("authorization", "")
                    self._send(code, {"error": {
                        "message": f"Incorrect API key provided: {auth}. You sent: {prompt!r} to "
                                   f"http://127.0.0.1:{outer.port}{self.path}", "type": "invalid_request_error",
                        "code": "invalid_api_key"}})
                    return
                n = int(body.get("n") or 1)
                texts = [outer.answer] * n
                if outer.answers:
                    with outer.lock:
                        texts = [outer.answers[(outer.turn + i) % len(outer.answers)] for i in range(n)]
                        outer.turn += n
                if body.get("stream"):
                    self._stream(chat, texts[0], len(prompt.split()), bool((body.get("stream_options") or {})
                                                                           .get("include_usage")))
                    return
                if chat:
                    choices = [{"index": i, "message": {"role": "assistant", "content": t},
                                "finish_reason": "stop"} for i, t in enumerate(texts)]
                else:
                    choices = [{"index": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(texts)]
                self._send(200, {"id": "x", "object": "chat.completion" if chat else "text_completion",
                                 "created": 0, "model": body.get("model", "echo"), "choices": choices,
                                 "usage": {"prompt_tokens": len(prompt.split()),
                                           "completion_tokens": sum(len(t) for t in texts),
                                           "total_tokens": len(prompt.split()) + sum(len(t) for t in texts)}})

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                outer.broken += 1  # the caller went away (serve cancelled the call): expected, counted

        self.broken = 0
        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_port)
        self.url = f"http://127.0.0.1:{self.port}/v1"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> EchoUpstream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
