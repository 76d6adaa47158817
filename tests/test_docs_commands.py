"""Every command in README.md, docs/deploy.md and docs/collect.md, taken from their code blocks and run.

The commands are read from the Markdown at test time, so the docs and this test cannot drift: a
command that is added, removed or changed in a ```sh/```bash/```python block is what runs. Those
needing an endpoint run against a real llama.cpp server on 127.0.0.1 (``OPENAI_BASE_URL`` points
the example spec there, as docs/collect.md says), in a scratch folder holding a copy of
``examples/``. Where a command is not run as written, ``_how`` says why and what runs instead.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.llm_server import (
    free_port,
    llama_server,  # noqa: F401 (fixture)
    stop,
    tiny_model,  # noqa: F401 (fixture)
    wait_ready,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/collect.md", "docs/deploy.md")
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
#: The tiny test model writes random bytes up to max_tokens; the example's 256 would make the 900-completion
#: quickstart take minutes on two shared cores. The copy of the example spec used here asks for 12 tokens: the
#: same requests (what the spending cap counts), shorter texts.
TEST_MAX_TOKENS = 12


def code_blocks(doc: str) -> list[tuple[str, str]]:
    """(language, text) of every fenced code block of a Markdown file of the repository."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer((ROOT / doc).read_text(encoding="utf-8"))]


def shell_commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined; comments dropped, except commented alternatives
    that are themselves commands (``#     iapo-gym collect ...``)."""
    out: list[str] = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("#"):
            inner = line.lstrip("#").strip().rstrip(")")
            if inner.startswith("iapo-gym "):
                out.append(inner)
            continue
        if line:
            out.append(line)
    return out


def test_code_blocks_are_found() -> None:
    """The extraction sees the commands the docs show (so an empty extraction cannot pass the test below)."""
    deploy = [c for lang, t in code_blocks("docs/deploy.md") if lang == "sh" for c in shell_commands(t)]
    assert any(c.startswith("iapo-gym optimize examples/collect_llamacpp.toml") for c in deploy)
    assert any(c.startswith("iapo-gym collect examples/collect_llamacpp.toml") for c in deploy)
    assert any(c.startswith("iapo-gym serve runs/arith-policy/policy.json") for c in deploy)
    assert sum(lang == "python" for lang, _ in code_blocks("README.md")) == 3


class Runner:
    """Runs the docs' commands in ``work`` against the llama.cpp server on ``port``."""

    def __init__(self, work: Path, port: int) -> None:
        self.work, self.port = work, port
        self.env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1", "OPENAI_API_KEY": ""}
        self.ran: list[str] = []
        self.serve: subprocess.Popen[bytes] | None = None
        self.serve_port = 0

    def argv(self, command: str) -> list[str]:
        args = shlex.split(command)
        if args[:2] == ["nice", "-n"]:
            args = args[3:]
        if args[0] == "iapo-gym":
            return [sys.executable, "-m", "iapo_gym.cli", *args[1:]]
        if args[0] in ("python", "python3"):
            return [sys.executable, *args[1:]]
        raise AssertionError(f"no rule to run {command!r}")

    def run(self, command: str, *, cwd: Path | None = None, timeout: float = 400) -> str:
        proc = subprocess.run(self.argv(command), cwd=cwd or self.work, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        self.ran.append(command)
        return proc.stdout

    def python(self, code: str) -> str:
        return self.run(f"python -c {shlex.quote(code)}")

    def shell(self, command: str) -> None:
        """One command of a shell block, run as written unless ``_how`` says otherwise."""
        how = _how(command)
        if how == "as written":
            self.run(command)
        elif how == "serve":
            if self.serve is not None:  # a later serve command of the docs replaces the running one
                stop(self.serve)
            self.serve_port = free_port()
            argv = self.argv(command.replace("--port 8000", f"--port {self.serve_port}"))
            self.serve = subprocess.Popen(argv, cwd=self.work, env=self.env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
            wait_ready(f"http://127.0.0.1:{self.serve_port}/health", self.serve)
            self.ran.append(command)
        elif how.startswith("faster:"):
            self.run(command + how.removeprefix("faster:"), cwd=ROOT)
        else:
            assert how.startswith("not run:"), how


def _how(command: str) -> str:
    """How a shell command of the docs is run here, and why when not as written."""
    if command.startswith("python -m llama_cpp.server"):
        return "not run: the llama.cpp server is the test's (the same module on 127.0.0.1, the tiny model)"
    if command.startswith("iapo-gym serve"):
        return "serve"  # a server: started, then the client block runs against it (on a free port, not 8000)
    if "benchmarks/bench_serve.py" in command:
        if "--early-stop" in command:
            return "faster: --repeats 1"  # one round of every (prompt, query, N) instead of three
        if "--optillm-python" in command:
            return "not run: needs OptiLLM in a venv of its own (a peer, never a dependency)"
        return "faster: --calls 3 --repeats 1"  # the full benchmark takes minutes; this runs every side once
    if command.startswith("python3 -m venv"):
        return "not run: creating a venv and installing needs the network (the installed package is what runs here)"
    return "as written"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch folder with a copy of examples/ (the spec's sampling.max_tokens lowered, see TEST_MAX_TOKENS)."""
    folder = tmp_path_factory.mktemp("docs")
    (folder / "examples").mkdir()
    for f in (ROOT / "examples").iterdir():
        if f.is_file():
            (folder / "examples" / f.name).write_bytes(f.read_bytes())
    spec = folder / "examples" / "collect_llamacpp.toml"
    text = spec.read_text(encoding="utf-8")
    assert "max_tokens = 256" in text
    spec.write_text(text.replace("max_tokens = 256", f"max_tokens = {TEST_MAX_TOKENS}"), encoding="utf-8")
    return folder


@pytest.mark.heavy
def test_deploy_and_collect_docs_run_against_llama_cpp(work: Path, llama_server: int) -> None:  # noqa: F811
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    runner = Runner(work, llama_server)
    try:
        # docs/collect.md: collect the example's table, read it, train an agent on the live env
        for lang, text in code_blocks("docs/collect.md"):
            if lang == "sh":
                for command in shell_commands(text):
                    runner.shell(command)
            elif lang == "python":
                runner.python(text)
        assert (work / "runs" / "arith" / "arith-llamacpp.h5").exists()
        # docs/deploy.md: the quickstart (optimize live, then on the collected table), serve, the client, the Router
        for lang, text in code_blocks("docs/deploy.md"):
            if lang == "sh":
                for command in shell_commands(text):
                    runner.shell(command)
            elif lang == "python":
                assert runner.serve is not None, "the client block needs the served policy"
                runner.python(text.replace("http://127.0.0.1:8000/v1", f"http://127.0.0.1:{runner.serve_port}/v1"))
    finally:
        if runner.serve is not None:
            stop(runner.serve)
    assert any(c.startswith("iapo-gym optimize examples/collect_llamacpp.toml --agent auto --budget 600 --check 300")
               for c in runner.ran)
    assert (work / "runs" / "arith-policy" / "policy.json").exists()
    assert any("bench_serve.py" in c for c in runner.ran)


@pytest.mark.heavy
def test_readme_commands_run(tmp_path: Path) -> None:
    runner = Runner(tmp_path, 0)
    for lang, text in code_blocks("README.md"):
        if lang == "bash":
            for command in shell_commands(text):
                how = _how(command)
                assert how.startswith("not run:"), command
                # what runs after the install: the main job as written (the test suite is this suite)
                rest = command.split(" && ")[-1]
                if "iapo-gym leaderboard" in rest:
                    out = runner.run(rest.replace(".venv/bin/iapo-gym", "iapo-gym"))
                    assert "auto" in out
                else:
                    extras = re.search(r'-e "\.\[([\w,]+)\]"', command)
                    assert extras is not None, command
                    setup = (ROOT / "setup.cfg").read_text(encoding="utf-8")
                    for extra in extras.group(1).split(","):
                        assert re.search(rf"^{extra}\s*=", setup, re.M), f"extra {extra!r} is not in setup.cfg"
    # the README's Python blocks are one session read top to bottom (the second uses the first's imports)
    runner.python("\n".join(text for lang, text in code_blocks("README.md") if lang == "python"))
    assert (tmp_path / "results" / "quick").exists()
