"""The live env and the collector where an event loop is already running: ``asyncio.run`` and a real Jupyter kernel.

A notebook built with nbformat is executed by nbclient in an ipykernel process (its cells run
inside the kernel's event loop), against the real llama.cpp server.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest

import iapo_gym  # noqa: F401 (registers IAPO-Live-v0)
from iapo_gym.llm.collect import collect
from iapo_gym.llm.live import LiveEnv
from iapo_gym.llm.loop import LoopThread, run
from iapo_gym.llm.spec import load_spec
from tests.llm_server import (
    llama_server,  # noqa: F401 (fixture)
    tiny_model,  # noqa: F401 (fixture)
    write_spec,
)

ROOT = Path(__file__).resolve().parents[1]


def _spec(tmp_path: Path, port: int) -> Path:
    return write_spec(tmp_path, port, n_max=4, sampling={"temperature": 0.9, "max_tokens": 4})


def _step_outside_a_loop(spec: Path, cache: Path, action: tuple[int, int]) -> tuple[list[str], int]:
    """The same seeded step from plain sync code: its texts, and the requests it needed."""
    env = LiveEnv(spec, cache=cache)
    env.reset(seed=0)
    info = env.step(action)[4]
    requests = env.requests
    env.close()
    return list(info["texts"]), requests


def test_live_env_and_collect_inside_asyncio_run(tmp_path: Path, llama_server: int) -> None:  # noqa: F811
    spec = _spec(tmp_path, llama_server)
    cache = tmp_path / "cache.sqlite"

    async def notebook_cell() -> tuple[dict[str, Any], Any]:
        asyncio.get_running_loop()  # as in every notebook cell: a loop is running here
        env = gym.make("IAPO-Live-v0", spec=str(spec), cache=str(cache))
        env.reset(seed=0)
        _, reward, terminated, _, info = env.step((0, 3))
        assert terminated and isinstance(float(reward), float)
        env.close()
        result = collect(load_spec(spec), tmp_path / "out", progress=False)
        return info, result

    info, result = asyncio.run(notebook_cell())
    assert len(info["texts"]) == 3 and result.complete and result.table is not None
    texts, requests = _step_outside_a_loop(spec, cache, (0, 3))
    assert texts == info["texts"] and requests == 0  # the same completions, answered by the cache


def test_loop_helpers_inside_and_outside_a_running_loop() -> None:
    async def answer(x: int) -> int:
        await asyncio.sleep(0)
        return x + 1

    async def failing() -> None:
        raise ValueError("from the coroutine")

    assert run(answer(1)) == 2

    async def inside() -> int:
        with pytest.raises(ValueError, match="from the coroutine"):
            run(failing())
        return run(answer(2))
    assert asyncio.run(inside()) == 3
    loop = LoopThread()
    try:
        assert loop.run(answer(3)) == 4
        assert asyncio.run(_in_loop(loop, answer(4))) == 5
    finally:
        loop.close()
    assert loop.closed
    with pytest.raises(RuntimeError, match="closed"):
        loop.run(answer(5))


async def _in_loop(loop: LoopThread, coro: Any) -> int:
    return int(loop.run(coro))


def test_live_env_in_a_real_jupyter_kernel(tmp_path: Path, llama_server: int,  # noqa: F811
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat", reason="the notebook test needs nbformat (the 'test' extra)")
    nbclient = pytest.importorskip("nbclient", reason="the notebook test needs nbclient (the 'test' extra)")
    pytest.importorskip("ipykernel", reason="the notebook test needs ipykernel (the 'test' extra)")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    spec = _spec(tmp_path, llama_server)
    cache = tmp_path / "cache.sqlite"
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(f"import sys\nsys.path.insert(0, {str(ROOT)!r})"),
        nbformat.v4.new_code_cell("import asyncio\nprint(asyncio.get_running_loop().is_running())"),
        nbformat.v4.new_code_cell(
            "import json\nimport gymnasium as gym\nimport iapo_gym\n"
            f"env = gym.make('IAPO-Live-v0', spec={str(spec)!r}, cache={str(cache)!r})\n"
            "env.reset(seed=0)\n"
            "_, reward, terminated, _, info = env.step((1, 2))\n"
            "print(json.dumps({'texts': info['texts'], 'terminated': terminated, "
            "'requests': env.unwrapped.requests}))\n"
            "env.close()"),
    ]
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    assert nb.cells[1].outputs[0]["text"].strip() == "True"  # the cells really ran inside a running loop
    out = json.loads(nb.cells[2].outputs[0]["text"])
    assert out["terminated"] and len(out["texts"]) == 2 and out["requests"] > 0
    texts, requests = _step_outside_a_loop(spec, cache, (1, 2))
    assert texts == out["texts"] and requests == 0
