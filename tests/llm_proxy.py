"""An error-injecting HTTP proxy for the collector tests: a real process in front of the llama.cpp server.

Each POST is handled by the next action of ``--schedule`` (then ``ok``): ``ok`` forwards it,
``429`` answers Too Many Requests with Retry-After: 1, ``503`` Service Unavailable with Retry-After: 1,
``500`` an internal error, ``drop`` closes
the connection without an answer, ``slow`` waits ``--slow`` seconds before forwarding (past the
client's timeout), ``400``/``401`` a client error. ``GET /__stats`` returns the counters as JSON (``choices``: completions
forwarded back, ``prompt_tokens``/``completion_tokens``: the upstream's reported usage); ``GET /__headers`` the
headers of every POST received, in order (names lower-cased), so tests can see which ``Authorization`` reached
this host; ``GET /__bodies`` the JSON bodies of every POST received, in order. A streamed answer
(``text/event-stream``) is relayed line by line as the upstream sends it (``stream_deltas`` counts its
chunks with text; its usage chunk counts as a response's usage).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    """Parse the options and serve until killed."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", type=int, required=True)
    ap.add_argument("--schedule", default="")
    ap.add_argument("--slow", type=float, default=3.0)
    opts = ap.parse_args()
    schedule = [a for a in opts.schedule.split(",") if a]
    lock = threading.Lock()
    stats = {"posts": 0, "forwarded": 0, "injected": 0, "completion_tokens": 0, "prompt_tokens": 0, "choices": 0,
             "in_flight": 0, "max_in_flight": 0, "stream_deltas": 0}
    seen_headers: list[dict[str, str]] = []
    seen_bodies: list[object] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall

        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/__stats":
                with lock:
                    body = json.dumps(stats).encode()
                self._send(200, body)
                return
            if self.path == "/__bodies":
                with lock:
                    body = json.dumps(seen_bodies).encode()
                self._send(200, body)
                return
            if self.path == "/__headers":
                with lock:
                    body = json.dumps(seen_headers).encode()
                self._send(200, body)
                return
            self._forward(b"", "GET")

        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with lock:
                stats["posts"] += 1
                seen_headers.append({k.lower(): v for k, v in self.headers.items()})
                try:
                    seen_bodies.append(json.loads(body))
                except ValueError:
                    seen_bodies.append(None)
                action = schedule.pop(0) if schedule else "ok"
                if action != "ok":
                    stats["injected"] += 1
            if action == "429":
                self._send(429, b'{"error": {"message": "rate limited by the test proxy"}}', {"Retry-After": "1"})
            elif action == "503":
                self._send(503, b'{"error": {"message": "injected: overloaded"}}', {"Retry-After": "1"})
            elif action == "500":
                self._send(500, b'{"error": {"message": "injected server error"}}')
            elif action == "400":
                self._send(400, b'{"error": {"message": "injected bad request"}}')
            elif action == "401":
                self._send(401, b'{"error": {"message": "injected: invalid API key"}}')
            elif action == "drop":
                self.close_connection = True
                self.connection.shutdown(2)
            else:
                if action == "slow":
                    time.sleep(opts.slow)
                self._forward(body, "POST")

        def _forward(self, body: bytes, method: str) -> None:
            with lock:
                stats["in_flight"] += 1
                stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{opts.upstream}{self.path}", data=body or None,
                                             method=method, headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=60) as resp:
                        if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                            self._relay(resp)
                            return
                        status, data = resp.status, resp.read()
                except urllib.error.HTTPError as exc:
                    status, data = exc.code, exc.read()
                except OSError:
                    self._send(502, b'{"error": {"message": "upstream unreachable"}}')
                    return
            finally:
                with lock:
                    stats["in_flight"] -= 1
            if method == "POST" and status == 200:
                answer = json.loads(data)
                usage = answer.get("usage") or {}
                with lock:
                    stats["forwarded"] += 1
                    stats["completion_tokens"] += int(usage.get("completion_tokens", 0))
                    stats["prompt_tokens"] += int(usage.get("prompt_tokens", 0))
                    stats["choices"] += len(answer.get("choices") or ())
            self._send(status, data)

        def _relay(self, resp: object) -> None:
            """Send a streamed answer on as it comes, one line at a time, counting its text chunks and usage."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            # each line is counted before it is relayed, so a caller that has read the stream's end reads counters
            # that include it (counting after the write raced with the caller's next /__stats)
            indices: set[int] = set()
            forwarded = False
            for line in resp:  # type: ignore[attr-defined]
                if line.strip() == b"data: [DONE]":
                    with lock:
                        stats["forwarded"] += 1
                    forwarded = True
                elif line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or {}
                    with lock:
                        stats["completion_tokens"] += int(usage.get("completion_tokens", 0))
                        stats["prompt_tokens"] += int(usage.get("prompt_tokens", 0))
                        for c in chunk.get("choices") or ():
                            index = int(c.get("index", 0))
                            if index not in indices:
                                indices.add(index)
                                stats["choices"] += 1
                            if (c.get("delta") or {}).get("content") or c.get("text"):
                                stats["stream_deltas"] += 1
                self.wfile.write(line)
                self.wfile.flush()
            if not forwarded:
                with lock:
                    stats["forwarded"] += 1

    server = ThreadingHTTPServer(("127.0.0.1", opts.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
