"""``optimize`` and ``collect`` refuse before spending when the plan cannot fit the spec's spending cap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iapo_gym.cli import main
from tests.llm_server import free_port, write_spec

ROOT = Path(__file__).resolve().parent.parent


def test_a_plan_beyond_the_cap_is_refused_before_any_request(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()  # nothing listens there: a request would fail, a refusal before spending does not try
    monkeypatch.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{port}/v1")
    example = ROOT / "examples" / "collect_llamacpp.toml"
    assert main(["optimize", str(example), "--budget", "800", "--check", "300", "--out", str(tmp_path / "o"),
                 "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "optimize --budget 800 --check 300 (1100 completions) needs 1100 requests" in err
    assert "budget.max_requests = 1000" in err and "nothing was sent" in err
    assert not (tmp_path / "o").exists()
    spec = write_spec(tmp_path, port, n_max=8, budget={"max_requests": 20})  # 2 prompts x 3 queries x 8 = 48
    assert main(["collect", str(spec), "--out", str(tmp_path / "d"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "collecting 48 missing completions needs 48 requests" in err and "budget.max_requests = 20" in err
    assert not (tmp_path / "d").exists()
    # with use_n = "yes" a pull of a group's missing completions is one request: 6 groups need 6
    doc = json.loads(spec.read_text())
    doc["endpoint"]["use_n"] = "yes"
    doc["budget"]["max_requests"] = 5
    spec.write_text(json.dumps(doc))
    assert main(["collect", str(spec), "--out", str(tmp_path / "e"), "--quiet"]) == 1
    assert "needs 6 requests (at least one request per pull" in capsys.readouterr().err
