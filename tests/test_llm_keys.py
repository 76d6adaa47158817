"""Which key goes to which host: header-capturing servers on 127.0.0.1 record every request's headers.

The "other provider" is the proxy of tests/llm_proxy.py (a real process recording each POST's
headers) in front of the llama.cpp server; the reward endpoint is ``tests.llm_server.RewardServer``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iapo_gym.cli import main as cli_main
from iapo_gym.llm.collect import collect
from iapo_gym.llm.spec import SpecError, load_spec
from tests.llm_server import (
    RewardServer,
    free_port,
    llama_server,  # noqa: F401 (fixture)
    proxy,  # noqa: F401 (fixture)
    proxy_headers,
    proxy_stats,
    tiny_model,  # noqa: F401 (fixture)
    write_spec,
)

OPENAI_SECRET = "sk-openai-secret-0123456789"
OTHER_SECRET = "other-provider-secret-9876"
REWARD_SECRET = "reward-secret-5555"


@pytest.fixture
def other_provider(proxy: int) -> int:  # noqa: F811
    """The header-capturing proxy in front of the session's llama.cpp server: "another provider's host"."""
    return proxy


@pytest.fixture
def user_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """What most users have set: an OpenAI key and account headers, and no OPENAI_BASE_URL."""
    monkeypatch.setenv("OPENAI_API_KEY", OPENAI_SECRET)
    monkeypatch.setenv("OPENAI_ORG_ID", "org-secret-org")
    monkeypatch.setenv("OPENAI_PROJECT_ID", "proj-secret-project")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    return monkeypatch


def _all_text(headers: list[dict[str, str]]) -> str:
    return json.dumps(headers)


def test_the_named_key_goes_to_its_host_and_the_reward_endpoint_gets_no_llm_key(
        tmp_path: Path, other_provider: int, user_env: pytest.MonkeyPatch) -> None:
    user_env.setenv("OTHER_PROVIDER_KEY", OTHER_SECRET)
    with RewardServer() as reward:
        spec = load_spec(write_spec(tmp_path, other_provider, aggregator="bon", n_max=2,
                                    endpoint={"api_key_env": "OTHER_PROVIDER_KEY"},
                                    scorer={"reward_url": reward.url, "objectives": ["length", "digits"]}))
        result = collect(spec, tmp_path / "out", progress=False)
    assert result.complete
    llm = proxy_headers(other_provider)
    assert len(llm) == result.requests > 0
    assert {h.get("authorization") for h in llm} == {f"Bearer {OTHER_SECRET}"}
    assert OPENAI_SECRET not in _all_text(llm)
    assert "org-secret-org" not in _all_text(llm) and "proj-secret-project" not in _all_text(llm)
    assert len(reward.headers) == 2 * 3 * 2
    assert all("authorization" not in h for h in reward.headers)
    for secret in (OPENAI_SECRET, OTHER_SECRET):
        assert secret not in _all_text(reward.headers)
        for path in (tmp_path / "out").iterdir():
            assert secret.encode() not in path.read_bytes(), path


def test_openai_key_is_not_sent_to_a_spec_endpoint_that_names_no_key(
        tmp_path: Path, other_provider: int, user_env: pytest.MonkeyPatch) -> None:
    spec = load_spec(write_spec(tmp_path, other_provider, n_max=1))
    assert collect(spec, tmp_path / "out", progress=False).complete
    llm = proxy_headers(other_provider)
    assert llm and all("authorization" not in h for h in llm)
    assert OPENAI_SECRET not in _all_text(llm)


def test_openai_base_url_carries_openai_key_from_the_same_environment(
        tmp_path: Path, other_provider: int, user_env: pytest.MonkeyPatch) -> None:
    spec = load_spec(write_spec(tmp_path, free_port(), n_max=1))  # nothing listens on the spec's own port
    user_env.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{other_provider}/v1")
    assert collect(spec, tmp_path / "out", progress=False).complete
    llm = proxy_headers(other_provider)
    assert llm and {h.get("authorization") for h in llm} == {f"Bearer {OPENAI_SECRET}"}


def test_a_reward_endpoint_gets_only_its_own_named_key(tmp_path: Path, llama_server: int,  # noqa: F811
                                                       user_env: pytest.MonkeyPatch) -> None:
    user_env.setenv("REWARD_KEY", REWARD_SECRET)
    with RewardServer() as reward:
        spec = load_spec(write_spec(tmp_path, llama_server, aggregator="bon", n_max=1,
                                    scorer={"reward_url": reward.url, "objectives": ["length", "digits"],
                                            "api_key_env": "REWARD_KEY"}))
        assert collect(spec, tmp_path / "out", progress=False).complete
    assert reward.headers and {h.get("authorization") for h in reward.headers} == {f"Bearer {REWARD_SECRET}"}
    assert OPENAI_SECRET not in _all_text(reward.headers)


def test_openai_base_url_elsewhere_than_the_named_keys_host_is_refused_before_sending(
        tmp_path: Path, other_provider: int, user_env: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    user_env.setenv("OTHER_PROVIDER_KEY", OTHER_SECRET)
    spec = write_spec(tmp_path, free_port(), n_max=1, endpoint={"api_key_env": "OTHER_PROVIDER_KEY"})
    user_env.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{other_provider}/v1")
    assert cli_main(["collect", str(spec), "--out", str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "OPENAI_BASE_URL" in err and "OTHER_PROVIDER_KEY" in err and OTHER_SECRET not in err
    assert proxy_stats(other_provider)["posts"] == 0


def test_dry_run_prints_hosts_and_key_names_never_values(tmp_path: Path, other_provider: int,
                                                         user_env: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    user_env.setenv("OTHER_PROVIDER_KEY", OTHER_SECRET)
    user_env.setenv("REWARD_KEY", REWARD_SECRET)
    reward_port = free_port()
    spec = write_spec(tmp_path, other_provider, aggregator="bon", n_max=2,
                      endpoint={"api_key_env": "OTHER_PROVIDER_KEY"},
                      scorer={"reward_url": f"http://127.0.0.1:{reward_port}/score",
                              "objectives": ["length", "digits"], "api_key_env": "REWARD_KEY"})
    out = tmp_path / "out"
    assert cli_main(["collect", str(spec), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    llm_line = next(line for line in text.splitlines() if "LLM endpoint" in line)
    reward_line = next(line for line in text.splitlines() if "reward endpoint" in line)
    assert f"127.0.0.1:{other_provider}" in llm_line and "$OTHER_PROVIDER_KEY (set)" in llm_line
    assert f"127.0.0.1:{reward_port}" in reward_line and "$REWARD_KEY (set)" in reward_line
    assert "OPENAI_API_KEY" not in llm_line + reward_line
    for secret in (OPENAI_SECRET, OTHER_SECRET, REWARD_SECRET):
        assert secret not in text
    assert "= 12 completions" in text
    assert proxy_stats(other_provider)["posts"] == 0 and not out.exists()  # nothing sent, nothing written


def test_routes_of_the_rule(tmp_path: Path) -> None:
    """The rule on addresses no test server can take: the OpenAI API itself, and keys pasted as names."""
    env = {"OPENAI_API_KEY": OPENAI_SECRET}
    hosted = load_spec(write_spec(tmp_path, 1, endpoint={"base_url": "https://api.openai.com/v1"}, name="a.json"))
    assert hosted.llm_route(env).key_env == "OPENAI_API_KEY" and hosted.llm_route(env).key(env) == OPENAI_SECRET
    lookalike = load_spec(write_spec(tmp_path, 1, endpoint={"base_url": "https://api.openai.com.evil.example/v1"},
                                     name="b.json"))
    assert lookalike.llm_route(env).key_env is None
    named = load_spec(write_spec(tmp_path, 1, endpoint={"base_url": "https://api.openai.com/v1",
                                                        "api_key_env": "MY_KEY"}, name="c.json"))
    assert named.llm_route({**env, "MY_KEY": "mine"}).key({**env, "MY_KEY": "mine"}) == "mine"
    assert named.llm_route(env).key(env) is None  # named but unset: no key at all, not OPENAI_API_KEY
    with pytest.raises(SpecError, match="api_key_env") as err:
        load_spec(write_spec(tmp_path, 1, endpoint={"api_key_env": "sk-pasted-key-value"}, name="d.json"))
    assert "sk-pasted-key-value" not in str(err.value)
