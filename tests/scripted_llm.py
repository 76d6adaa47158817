"""A scripted OpenAI-compatible server for the deploy tests: a real process whose completions are known in advance.

``--script FILE`` is a JSON object mapping a rendered prompt (the completions ``prompt``, or the
content of the last chat message) to its list of completion texts. A request with ``n = k`` gets the
first k texts in order; with ``--ignore-n`` every request gets one text, the next of that prompt's
list in turn. A prompt that is not scripted gets 404; a prompt containing ``FORBIDDEN`` gets 403.
``--delay S`` waits S seconds before answering. Usage: completion tokens = characters of each
text, prompt tokens = words of the prompt (per request). ``GET /__stats`` gives the counters.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    """Parse the options and serve until killed."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--script", required=True)
    ap.add_argument("--ignore-n", action="store_true")
    ap.add_argument("--delay", type=float, default=0.0)
    opts = ap.parse_args()
    with open(opts.script, encoding="utf-8") as f:
        script: dict[str, list[str]] = json.load(f)
    lock = threading.Lock()
    turn: dict[str, int] = {}
    stats = {"requests": 0, "choices": 0, "completion_tokens": 0, "prompt_tokens": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall

        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, payload: object) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/__stats":
                with lock:
                    self._send(200, dict(stats))
            elif self.path.endswith("/models"):
                self._send(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            chat = self.path.endswith("/chat/completions")
            prompt = body["messages"][-1]["content"] if chat else body["prompt"]
            if opts.delay:
                time.sleep(opts.delay)
            if "FORBIDDEN" in prompt:
                self._send(403, {"error": {"message": "scripted: this prompt is forbidden"}})
                return
            if prompt not in script:
                self._send(404, {"error": {"message": f"scripted: no script for prompt {prompt!r}"}})
                return
            texts = script[prompt]
            n = 1 if opts.ignore_n else int(body.get("n") or 1)
            with lock:
                if opts.ignore_n:
                    i = turn.get(prompt, 0)
                    turn[prompt] = i + 1
                    picked = [texts[i % len(texts)]]
                else:
                    picked = [texts[i % len(texts)] for i in range(n)]
                tokens = sum(len(t) for t in picked)
                prompt_tokens = len(prompt.split())
                stats["requests"] += 1
                stats["choices"] += len(picked)
                stats["completion_tokens"] += tokens
                stats["prompt_tokens"] += prompt_tokens
            if chat:
                choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": "stop"}
                           for i, t in enumerate(picked)]
                kind = "chat.completion"
            else:
                choices = [{"index": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(picked)]
                kind = "text_completion"
            self._send(200, {"id": "scripted", "object": kind, "created": 0, "model": body.get("model", ""),
                             "choices": choices, "usage": {"prompt_tokens": prompt_tokens,
                                                           "completion_tokens": tokens,
                                                           "total_tokens": prompt_tokens + tokens}})

    server = ThreadingHTTPServer(("127.0.0.1", opts.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
