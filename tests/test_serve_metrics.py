"""``serve``'s ``GET /metrics``: a real ``iapo-gym serve`` process with a simulated upstream (``iapo-gym simulate``
of a generated table), called with the real ``openai`` client; the metrics are read with ``prometheus-client``'s
own parser and checked against the answers the callers got."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from iapo_gym.deploy.simulate import write_spec
from iapo_gym.tables import write_table
from iapo_gym.tasks.generated import level_table
from tests.deploy_helpers import start_serve
from tests.llm_server import free_port, stop
from tests.test_simulate import ROOT, start_simulator

openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

KEY = "metrics-test-key-123"


def scrape(port: int, key: str | None) -> tuple[int, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """The status of ``GET /metrics`` and its samples by (name, sorted labels)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            text = resp.read().decode()
            assert resp.headers["content-type"].startswith("text/plain")
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in parser.text_string_to_metric_families(text) for s in family.samples}
    return 200, samples


def test_metrics_count_what_the_callers_got(tmp_path: Path) -> None:
    """Requests by status and context, the arms served, completions drawn and saved by early stopping, tokens and
    the latency histogram equal what the answers said; contexts given as weights share one label; without the
    inbound key, 401."""
    table = level_table("mv_categorical", 2)
    write_table(table, tmp_path / "table.h5")
    sim_port, serve_port = free_port(), free_port()
    spec, _ = write_spec(tmp_path / "sim.json", table, port=sim_port)
    sim, _ = start_simulator(str(tmp_path / "table.h5"), port=sim_port)
    serve = None
    try:
        done = subprocess.run([sys.executable, "-m", "iapo_gym.cli", "optimize", str(tmp_path / "table.h5"), "--spec",
                               str(spec), "--budget", "300", "--out", str(tmp_path / "policy"), "--quiet"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert done.returncode == 0, done.stderr
        serve = start_serve(tmp_path / "policy" / "policy.json", spec, serve_port,
                            extra=["--api-key-env", "IAPO_METRICS_KEY"], env={"IAPO_METRICS_KEY": KEY})
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key=KEY, max_retries=0)
        answers: list[Any] = []
        for i in range(9):
            context = ("mid", "low", "high")[i % 3]
            answers.append(c.completions.create(model=f"iapo/{context}", prompt=f"Question q{i}?"))
        weighted = c.completions.create(model="iapo/[1.0, -0.5]", prompt="Question q1?")
        for _ in range(2):
            with pytest.raises(openai.BadRequestError):
                c.completions.create(model="iapo/nosuch", prompt="Question q1?")
        assert scrape(serve_port, None)[0] == 401
        assert scrape(serve_port, "wrong")[0] == 401
        status, samples = scrape(serve_port, KEY)
        assert status == 200

        def value(name: str, **labels: str) -> float:
            return samples.get((name, tuple(sorted(labels.items()))), 0.0)

        for context in ("mid", "low", "high"):
            mine = [a for a in answers if a.model_extra["iapo"]["context"] == context]
            assert value("iapo_serve_requests_total", status="200", context=context) == len(mine) == 3
            info = mine[0].model_extra["iapo"]
            assert value("iapo_serve_arm_choices_total", context=context, prompt=info["prompt"],
                         n=str(info["n"])) == 3
            drawn = sum(a.model_extra["iapo"]["drawn"] for a in mine)
            assert value("iapo_serve_completions_drawn_total", context=context, prompt=info["prompt"]) == drawn
            assert value("iapo_serve_completions_saved_total", context=context,
                         prompt=info["prompt"]) == 3 * info["n"] - drawn
        assert value("iapo_serve_requests_total", status="200", context="weights") == 1
        assert value("iapo_serve_requests_total", status="400", context="none") == 2
        everyone = [*answers, weighted]
        assert value("iapo_serve_tokens_total", kind="completion") == sum(a.usage.completion_tokens for a in everyone)
        assert value("iapo_serve_tokens_total", kind="prompt") == sum(a.usage.prompt_tokens for a in everyone)
        assert value("iapo_serve_request_seconds_count", status_class="2xx") == 10
        assert value("iapo_serve_request_seconds_count", status_class="4xx") == 2
        assert value("iapo_serve_in_flight") == 0
    finally:
        if serve is not None:
            stop(serve)
        stop(sim)
