"""A real ``redis-server`` on 127.0.0.1 for the budget tests: a free port, no persistence, stopped after the test."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.llm_server import free_port


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """``redis://127.0.0.1:PORT/0`` of a redis-server started for one test (skipped when the binary is absent)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server); CI installs it")
    pytest.importorskip("redis", reason='the redis client is part of the serve extra: pip install "iapo-gym[serve]"')
    import redis

    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
