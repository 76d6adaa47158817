"""Models as arms: a spec with two [[endpoints]] (two llama.cpp servers of two tiny models) in collect, live and optimize.

Each server sits behind its own recording proxy (tests/llm_proxy.py, a real process) so the tests see
exactly which requests, keys and models reached each host; the costs are checked against the
token counts the upstreams reported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.llm.spec import load_spec
from iapo_gym.tables import read_metadata, read_table
from tests.llm_server import (
    QUERIES,
    _need_llama_cpp,
    free_port,
    proxy_bodies,
    proxy_headers,
    proxy_stats,
    start_llama_server,
    start_proxy,
    stop,
    write_tiny_gguf,
)

pytest.importorskip("openai", reason="the [llm] extra (openai) is needed to talk to an endpoint")

KEYS = {"KEY_A": "secret-of-host-a", "KEY_B": "secret-of-host-b", "OPENAI_API_KEY": "secret-openai"}
PRICES = {"a": (0.5, 2.0), "b": (3.0, 15.0)}  # per million input, output tokens


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    """Two llama.cpp servers of two tiny models (seeds 0 and 1), as "tiny-a" and "tiny-b"; yields their ports."""
    pytest.importorskip("gguf", reason="the gguf package is needed to write the test models")
    _need_llama_cpp()
    folder = tmp_path_factory.mktemp("two-models")
    procs, ports = [], {}
    try:
        for name, seed in (("a", 0), ("b", 1)):
            port = free_port()
            procs.append(start_llama_server(write_tiny_gguf(folder / f"tiny-{name}.gguf", seed=seed), port,
                                            alias=f"tiny-{name}"))
            ports[name] = port
        yield ports
    finally:
        for proc in procs:
            stop(proc)


@pytest.fixture
def hosts(two_servers: dict[str, int]) -> Iterator[dict[str, int]]:
    """A fresh recording proxy in front of each server (clean counters per test); yields the proxies' ports."""
    procs, ports = [], {}
    try:
        for name, upstream in two_servers.items():
            port = free_port()
            procs.append(start_proxy(upstream, port))
            ports[name] = port
        yield ports
    finally:
        for proc in procs:
            stop(proc)


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Distinct keys in two variables, and an OpenAI key that must reach neither host."""
    for name in ("OPENAI_BASE_URL", "OPENAI_ORG_ID", "OPENAI_PROJECT_ID", "OPENAI_CUSTOM_HEADERS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    return KEYS


def two_endpoint_spec(folder: Path, ports: dict[str, int], *, n_max: int = 3,
                      prices: dict[str, tuple[float, float]] | None = PRICES, extra: dict | None = None) -> Path:
    """A majority-vote spec of 2 endpoints x 2 prompts x 3 queries (JSON)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUERIES), encoding="utf-8")
    endpoints = []
    for name, port in ports.items():
        ep = {"id": name, "base_url": f"http://127.0.0.1:{port}/v1", "model": f"tiny-{name}",
              "api_key_env": f"KEY_{name.upper()}", "concurrency": 2, "timeout": 20, "backoff": 0.05,
              "max_backoff": 0.5}
        if prices:
            ep["input_price_per_million"], ep["output_price_per_million"] = prices[name]
        endpoints.append(ep)
    doc = {"task": "two-models", "aggregator": "mv", "n_max": n_max, "endpoints": endpoints,
           "sampling": {"temperature": 0.8, "max_tokens": 5, "seed": 3},
           "prompts": [{"id": "plain", "template": "Q: {query}\nA:"}, {"id": "short", "template": "{query} ->"}],
           "queries": {"path": "queries.jsonl"}, "scorer": {"extractor": "regex", "pattern": r"\A\s*(\S)"},
           "build": {"test_fraction": 0.0}, **(extra or {})}
    path = folder / "spec.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def assert_only_own_traffic(hosts: dict[str, int], keys: dict[str, str]) -> None:
    """Every request at host X named model tiny-X and carried exactly X's key; no other key reached it."""
    for name, port in hosts.items():
        own = keys[f"KEY_{name.upper()}"]
        bodies, headers = proxy_bodies(port), proxy_headers(port)
        assert bodies, f"host {name} received nothing"
        assert {b["model"] for b in bodies} == {f"tiny-{name}"}
        assert {h.get("authorization") for h in headers} == {f"Bearer {own}"}
        seen = json.dumps(headers)
        for other, value in keys.items():
            if value != own:
                assert value not in seen, f"{other} reached host {name}"


def test_collect_sends_each_arm_to_its_own_host_with_its_own_key_and_costs_money(
        tmp_path: Path, hosts: dict[str, int], keys: dict[str, str]) -> None:
    from iapo_gym.llm.collect import collect

    contexts = [{"name": "thrifty", "value_per_quality": 0.001}, {"name": "lavish", "cost_weight": -10}]
    spec_path = two_endpoint_spec(tmp_path / "spec", hosts, extra={"contexts": contexts})
    spec = load_spec(spec_path)
    assert [p.id for p in spec.prompts] == ["a/plain", "a/short", "b/plain", "b/short"]
    result = collect(spec, tmp_path / "out", progress=False)
    assert result.complete and result.table is not None
    assert_only_own_traffic(hosts, keys)

    lines = [json.loads(line) for line in (tmp_path / "out" / "two-models.jsonl").read_text().splitlines()]
    assert len(lines) == 4 * 3 * 3
    for name, port in hosts.items():
        mine = [r for r in lines if r["prompt"].startswith(f"{name}/")]
        stats = proxy_stats(port)
        # every completion of host X's arms came from X, and the tokens logged are the ones X reported
        assert stats["choices"] == len(mine) == 2 * 3 * 3
        assert sum(r["tokens"] for r in mine) == stats["completion_tokens"]
        assert sum(r["prompt_tokens"] for r in mine) == stats["prompt_tokens"] > 0
        prompts_sent = {b["prompt"] for b in proxy_bodies(port)}
        assert prompts_sent == {t.replace("{query}", q["text"]) for t in ("Q: {query}\nA:", "{query} ->")
                                for q in QUERIES}

    table = read_table(result.table)
    assert table.cost_unit == "USD" and read_metadata(result.table)["cost_unit"] == "USD"
    assert table.prompts == ("a/plain", "a/short", "b/plain", "b/short")
    assert table.context_names == ("thrifty", "lavish")  # the spec's contexts, the cost weight from the value
    np.testing.assert_array_equal(table.context_weights, [[1.0, -1000.0], [1.0, -10.0]])
    np.testing.assert_array_equal(table.context_probs, [0.5, 0.5])
    for i, arm in enumerate(table.prompts):  # the mean price per completion, recomputed from the log
        price_in, price_out = PRICES[arm.split("/")[0]]
        mine = [r for r in lines if r["prompt"] == arm]
        expected = np.mean([(r["prompt_tokens"] * price_in + r["tokens"] * price_out) / 1e6 for r in mine])
        assert table.cost[i] == pytest.approx(expected, rel=1e-12)
    spent = sum((r["prompt_tokens"] * PRICES[r["prompt"][0]][0] + r["tokens"] * PRICES[r["prompt"][0]][1]) / 1e6
                for r in lines)
    assert result.spend == pytest.approx(spent, rel=1e-12)


def test_a_shared_cache_keeps_prompt_tokens_so_a_rerun_prices_the_same(
        tmp_path: Path, hosts: dict[str, int], keys: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    from iapo_gym.cli import main as cli_main
    from iapo_gym.llm.collect import collect

    spec_path = two_endpoint_spec(tmp_path / "spec", hosts, n_max=2, extra={"cache": "shared.sqlite"})
    assert cli_main(["collect", str(spec_path), "--out", str(tmp_path / "one"), "--quiet"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "one" / "two-models.jsonl").read_text().splitlines()]
    spent = sum((r["prompt_tokens"] * PRICES[r["prompt"][0]][0] + r["tokens"] * PRICES[r["prompt"][0]][1]) / 1e6
                for r in lines)
    prompt_tokens = sum(r["prompt_tokens"] for r in lines)
    assert f", {prompt_tokens} prompt tokens, spent {spent:.6f} USD" in capsys.readouterr().out
    first = collect(load_spec(spec_path), tmp_path / "one", progress=False)  # complete: the table, nothing sent
    posts = {name: proxy_stats(port)["posts"] for name, port in hosts.items()}
    second = collect(load_spec(spec_path), tmp_path / "two", progress=False)
    assert {name: proxy_stats(port)["posts"] for name, port in hosts.items()} == posts  # all from the cache
    assert second.cached == second.new == 4 * 3 * 2 and second.spend == 0.0
    assert first.table is not None and second.table is not None
    np.testing.assert_array_equal(read_table(first.table).cost, read_table(second.table).cost)
    assert np.all(read_table(second.table).cost > 0)


def test_dry_run_lists_every_host_and_key_variable_and_sends_nothing(
        tmp_path: Path, hosts: dict[str, int], keys: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    from iapo_gym.cli import main as cli_main

    spec_path = two_endpoint_spec(tmp_path / "spec", hosts)
    assert cli_main(["collect", str(spec_path), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for name, port in hosts.items():
        assert f"http://127.0.0.1:{port}" in out and f"$KEY_{name.upper()} (set)" in out
        assert f"'tiny-{name}'" in out
        assert proxy_stats(port)["posts"] == 0
    assert "2 endpoints x 2 prompts = 4 arms x 3 queries x N_max 3 = 36 completions" in out
    assert not any(value in out for value in keys.values())
    assert not (tmp_path / "out").exists()


def test_openai_base_url_cannot_stand_in_for_several_endpoints(tmp_path: Path, hosts: dict[str, int],
                                                               keys: dict[str, str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from iapo_gym.llm.collect import collect
    from iapo_gym.llm.spec import SpecError

    monkeypatch.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{hosts['a']}/v1")
    with pytest.raises(SpecError, match="OPENAI_BASE_URL is set, but the spec names 2 endpoints"):
        collect(load_spec(two_endpoint_spec(tmp_path / "spec", hosts)), tmp_path / "out", progress=False)
    assert all(proxy_stats(port)["posts"] == 0 for port in hosts.values())


def test_live_env_pulls_each_arm_from_its_endpoint_and_prices_the_pull(
        tmp_path: Path, hosts: dict[str, int], keys: dict[str, str]) -> None:
    from iapo_gym.llm.live import LiveEnv
    from iapo_gym.llm.prices import prompt_bytes

    spec = load_spec(two_endpoint_spec(tmp_path / "spec", hosts))
    env = LiveEnv(spec, cache=tmp_path / "cache.sqlite")
    try:
        assert env.table.prompts == ("a/plain", "a/short", "b/plain", "b/short") and env.table.cost_unit == "USD"
        bound = [(b * PRICES[p[0]][0] + 5 * PRICES[p[0]][1]) / 1e6 for p, b in zip(env.table.prompts,
                                                                                     prompt_bytes(spec), strict=True)]
        np.testing.assert_allclose(env.table.cost, bound, rtol=1e-12)
        env.reset(seed=0)
        _, _, _, _, info = env.step((3, 2))  # b/short, N = 2
        assert proxy_stats(hosts["a"])["posts"] == 0 and proxy_stats(hosts["b"])["choices"] == 2
        assert info["spend"] == pytest.approx(float((info["prompt_tokens"] * 3.0 + info["tokens"] * 15.0).sum()) / 1e6)
        assert int(info["prompt_tokens"].sum()) == proxy_stats(hosts["b"])["prompt_tokens"]
        env.step((0, 1))  # a/plain, N = 1
        assert proxy_stats(hosts["a"])["choices"] == 1
        assert env.requests == proxy_stats(hosts["a"])["posts"] + proxy_stats(hosts["b"])["posts"]  # one cap
    finally:
        env.close()
    assert_only_own_traffic(hosts, keys)


def test_one_spending_cap_covers_every_endpoint(tmp_path: Path, hosts: dict[str, int], keys: dict[str, str]) -> None:
    from iapo_gym.llm.collect import collect

    # each request reserves max_tokens + 3 = 8 completion tokens: the two endpoints' requests share 60
    spec = load_spec(two_endpoint_spec(tmp_path / "spec", hosts, extra={"budget": {"max_tokens_total": 60}}))
    result = collect(spec, tmp_path / "out", progress=False)
    assert result.budget_exhausted is not None and not result.complete
    stats = [proxy_stats(port) for port in hosts.values()]
    assert all(s["posts"] > 0 for s in stats)  # both endpoints worked at once, under the one cap
    assert sum(s["posts"] for s in stats) == result.requests <= 60 // 8
    assert sum(s["completion_tokens"] for s in stats) == result.tokens <= 60


def test_optimize_on_two_live_endpoints_reports_the_spend_per_request(
        tmp_path: Path, hosts: dict[str, int], keys: dict[str, str]) -> None:
    from iapo_gym.leaderboard.optimize import optimize
    from iapo_gym.llm.prices import live_costs

    spec_path = two_endpoint_spec(tmp_path / "spec", hosts, extra={"build": {"test_fraction": 0.34}})
    result = optimize(str(spec_path), "uniform", 24, tmp_path / "policy", seed=0, cache=str(tmp_path / "c.sqlite"))
    pf = result.policy
    assert [p.id for p in pf.prompts] == ["a/plain", "a/short", "b/plain", "b/short"]
    assert all(pf.prompt(p).servable for p in ("a/plain", "b/short"))
    cost, unit = live_costs(load_spec(spec_path))
    report = result.report_path.read_text()
    assert "## Expected spend per request" in report and f"in {unit}" in report
    index = {p.id: i for i, p in enumerate(pf.prompts)}
    for c in pf.contexts:
        assert f"| {c.name} | {c.prompt} | {c.n} | {cost[index[c.prompt]]:.6g} | {c.n * cost[index[c.prompt]]:.6g} |" \
            in report
    assert_only_own_traffic(hosts, keys)
    assert os.environ["KEY_A"] not in (tmp_path / "policy" / "policy.json").read_text()
