"""Test helpers: a tiny random-weight llama GGUF written with ``gguf``, and real server processes on 127.0.0.1."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer llama (embedding 64, 4 heads, 259 byte-level tokens) with random float32 weights.

    It never emits a byte >= 0x80: llama.cpp keeps generating past ``max_tokens`` while a UTF-8
    character is unfinished, so such bytes could make a request run to the end of the context.
    Residual dimension 0 is a constant 1 (no layer writes to it), so after the final norm it is
    positive, and those tokens' output rows weigh it by a large negative number.
    """
    import gguf

    rng = np.random.default_rng(seed)
    n_embd, n_ff, n_layer, n_head = 64, 128, 2, 4
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("iapo-tiny")
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)

    def t(name: str, *shape: int, scale: float = 0.2) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def rand(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    embd = rand(vocab, n_embd, scale=1.0)
    embd[:, 0] = 1.0
    w.add_tensor("token_embd.weight", embd)
    for i in range(n_layer):
        for x in ("q", "k", "v"):
            t(f"blk.{i}.attn_{x}.weight", n_embd, n_embd)
        attn_out = rand(n_embd, n_embd)
        attn_out[0] = 0.0  # nothing writes residual dimension 0
        w.add_tensor(f"blk.{i}.attn_output.weight", attn_out)
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        down = rand(n_embd, n_ff)
        down[0] = 0.0
        w.add_tensor(f"blk.{i}.ffn_down.weight", down)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    out = rand(vocab, n_embd, scale=1.0)
    out[:, 0] = 0.0
    out[3 + 0x80:, 0] = -1e4  # bytes >= 0x80 are never the likeliest, nor sampled in practice
    w.add_tensor("output.weight", out)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


#: The ports ``free_port`` has handed out in this process.
_HANDED_OUT: set[int] = set()
#: Where processes on this machine claim the ports ``free_port`` hands out (one file per port, under a lock).
_CLAIMS = Path(tempfile.gettempdir()) / "iapo-test-ports"
#: Seconds a claim keeps another process from being handed the port (a server binds its port within seconds).
CLAIM_SECONDS = 600.0


def _claim(port: int) -> bool:
    """Claim ``port`` for this process; False when any process on this machine claimed it in the last
    ``CLAIM_SECONDS``. The check and the claim are one step under an exclusive lock, so two test processes (the
    suites .ci/other_pythons runs side by side) never both get a port from the kernel's free ones."""
    _CLAIMS.mkdir(exist_ok=True)
    with open(_CLAIMS / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        path = _CLAIMS / str(port)
        try:
            if time.time() - path.stat().st_mtime < CLAIM_SECONDS:
                return False
        except FileNotFoundError:
            pass
        path.write_text(f"{os.getpid()}\n")
        return True


def free_port() -> int:
    """A free TCP port on 127.0.0.1, never one this process was handed before, nor one another process on this
    machine was handed in the last ``CLAIM_SECONDS``: the port is released before its server binds it, so two calls
    in a row (a page's port and a server's, bound later), or two test processes at once, could otherwise get the
    same port back from the kernel, and the second server would fail to bind (while a check of the port reached the
    first)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT and _claim(port):
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no port on 127.0.0.1 that was not handed out before after 1000 tries ({len(_HANDED_OUT)} handed out)")


def _log_file(name: str) -> object:
    """An unnamed temporary file for a server's output (a pipe nobody reads would fill and stall it)."""
    import tempfile

    return tempfile.TemporaryFile(prefix=f"iapo-{name}-")


def output(proc: subprocess.Popen[bytes]) -> str:
    """What a process started here has printed so far."""
    log = getattr(proc, "log_file", None)
    if log is None:
        return ""
    log.seek(0)
    return str(log.read().decode(errors="replace"))


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Poll ``url`` until it answers 200, or fail with the process's output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {output(proc)[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server at {url} not ready after {timeout}s")


def start_llama_server(model: Path, port: int, alias: str = "tiny") -> subprocess.Popen[bytes]:
    """``python -m llama_cpp.server`` on 127.0.0.1:port serving ``model`` as ``alias``, ready to answer."""
    log = _log_file("llama")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
         "--n_ctx", "512", "--model_alias", alias, "--n_threads", "1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OPENAI_API_KEY": ""})
    proc.log_file = log  # type: ignore[attr-defined]
    try:
        wait_ready(f"http://127.0.0.1:{port}/v1/models", proc)
    except BaseException:
        stop(proc)
        raise
    return proc


def start_proxy(upstream_port: int, port: int, schedule: list[str] | None = None,
                slow: float = 3.0) -> subprocess.Popen[bytes]:
    """The error-injecting proxy (tests/llm_proxy.py) in front of the server, ready to answer."""
    cmd = [sys.executable, str(HERE / "llm_proxy.py"), "--port", str(port), "--upstream", str(upstream_port),
           "--slow", str(slow)]
    if schedule:
        cmd += ["--schedule", ",".join(schedule)]
    return start_with_stats(cmd, "proxy", port)


def start_with_stats(cmd: list[str], name: str, port: int) -> subprocess.Popen[bytes]:
    """Start a test helper process (output in a log file) and wait until its ``/__stats`` answers."""
    log = _log_file(name)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    proc.log_file = log  # type: ignore[attr-defined]
    try:
        wait_ready(f"http://127.0.0.1:{port}/__stats", proc, timeout=20)
    except BaseException:
        stop(proc)
        raise
    return proc


def proxy_stats(port: int) -> dict[str, int]:
    """The counters of a helper on ``port`` (the proxy's: requests forwarded, errors injected, tokens served)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/__stats", timeout=5) as resp:
        stats: dict[str, int] = json.loads(resp.read())
    return stats


def proxy_bodies(port: int) -> list[dict]:
    """The JSON bodies of every POST the proxy received, in order."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/__bodies", timeout=5) as resp:
        bodies: list[dict] = json.loads(resp.read())
    return bodies


def proxy_headers(port: int) -> list[dict[str, str]]:
    """The headers of every POST the proxy received, in order (names lower-cased)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/__headers", timeout=5) as resp:
        headers: list[dict[str, str]] = json.loads(resp.read())
    return headers


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a process and wait for it (kill if it lingers)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log = getattr(proc, "log_file", None)
    if log is not None:
        log.close()


# ---- pytest fixtures (imported by the tests/test_llm_*.py modules) ------------------------------
import pytest  # noqa: E402


def _need_llama_cpp() -> None:
    try:
        import llama_cpp  # noqa: F401
        import llama_cpp.server.app  # noqa: F401  (the [server] extra's fastapi, starlette, sse-starlette)
    except ImportError as exc:
        pytest.skip(f"llama-cpp-python[server] is not installed ({exc}); pip install \"iapo-gym[llm]\"")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight GGUF, written once per session."""
    pytest.importorskip("gguf", reason="the gguf package is needed to write the test model")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def llama_server(tiny_model: Path) -> object:
    """A real llama.cpp OpenAI-compatible server on 127.0.0.1 for the session; yields its port."""
    _need_llama_cpp()
    port = free_port()
    proc = start_llama_server(tiny_model, port)
    try:
        yield port
    finally:
        stop(proc)


@pytest.fixture
def proxy(llama_server: int) -> object:
    """A counting, header-capturing proxy in front of the session's server; yields its port."""
    port = free_port()
    proc = start_proxy(llama_server, port)
    try:
        yield port
    finally:
        stop(proc)


QUERIES = [
    {"id": "q0", "text": "1 + 1 =", "gold": "2"},
    {"id": "q1", "text": "What is 7 times 6?", "gold": "("},
    {"id": "q2", "text": "Name a letter:", "gold": "a"},
]


def write_spec(folder: Path, port: int, *, aggregator: str = "mv", n_max: int = 4, queries: list[dict] | None = None,
               endpoint: dict | None = None, sampling: dict | None = None, budget: dict | None = None,
               scorer: dict | None = None, extra: dict | None = None, name: str = "spec.json") -> Path:
    """A JSON spec for the tiny server (2 prompts, 3 queries) with overrides; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    qpath = folder / "queries.jsonl"
    qpath.write_text("".join(json.dumps(q) + "\n" for q in (queries or QUERIES)), encoding="utf-8")
    doc: dict = {
        "task": "tiny", "aggregator": aggregator, "n_max": n_max,
        "endpoint": {"base_url": f"http://127.0.0.1:{port}/v1", "model": "tiny", "concurrency": 4, "timeout": 20,
                     "backoff": 0.05, "max_backoff": 0.5, **(endpoint or {})},
        "sampling": {"temperature": 0.0, "max_tokens": 6, "seed": 1, **(sampling or {})},
        "budget": budget or {},
        "prompts": [{"id": "plain", "template": "Q: {query}\nA:"}, {"id": "short", "template": "{query} ->"}],
        "queries": {"path": "queries.jsonl"},
        "scorer": scorer or ({"extractor": "regex", "pattern": r"\A\s*(\S)"} if aggregator == "mv" else
                             {"callable": "tests.llm_scorer:score", "objectives": ["length", "digits"], "grid": 0.5,
                              "score_range": [-1.0, 1.0]}),
        "build": {"test_fraction": 0.0},
        **(extra or {}),
    }
    path = folder / name
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


class RewardServer:
    """A reward endpoint on 127.0.0.1 in this process (``tests.llm_scorer.score``), recording every request.

    ``bodies`` are the JSON bodies received, ``headers`` their headers (names lower-cased).
    """

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from tests.llm_scorer import score

        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []
        outer = self

        class Reward(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                outer.headers.append({k.lower(): v for k, v in self.headers.items()})
                data = json.dumps({"scores": score(body["completion"], body["query"])}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Reward)
        self._server.daemon_threads = True
        self.port = int(self._server.server_port)
        self.url = f"http://127.0.0.1:{self.port}/score"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> RewardServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
