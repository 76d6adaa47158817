"""Two models, optimize -> serve: a policy learned live on two llama.cpp servers, then served by ``iapo-gym serve``.

The queries' gold answers are model b's own greedy answers, and model a is 100x cheaper, so the
learned policy sends a thrifty context to model a and an accuracy-minded one to model b. The
served requests of each context must reach only its arm's endpoint (N completions there, none at
the other), each with that endpoint's key only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.llm_server import free_port, proxy_stats, stop
from tests.test_llm_endpoints import (  # noqa: F401 (fixtures)
    assert_only_own_traffic,
    hosts,
    keys,
    two_endpoint_spec,
    two_servers,
)

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

TEMPLATES = {"plain": "Q: {query}\nA:", "short": "{query} ->"}
CANDIDATES = ["1 + 1 =", "What is 7 times 6?", "Name a letter:", "Say hi", "2, 4, 6,", "The sky is", "Count: 1 2",
              "x =", "Hello", "ABC", "Capital of France?", "3 * 3 ="]


def first_char(port: int, model: str, prompt: str) -> str | None:
    """The first non-space character of the model's greedy completion (what the spec's extractor takes)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    text = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0.0).choices[0].text
    stripped = text.strip()
    return stripped[0] if stripped else None


def test_optimize_then_serve_sends_each_context_to_its_arms_endpoint(
        tmp_path: Path, two_servers: dict[str, int], hosts: dict[str, int],  # noqa: F811
        keys: dict[str, str]) -> None:  # noqa: F811
    from iapo_gym.leaderboard.optimize import optimize
    from tests.deploy_helpers import start_serve

    # queries on which model b's greedy answer to "plain" differs from model a's to both prompts: gold = b's answer
    queries = []
    for i, text in enumerate(CANDIDATES):
        b_plain = first_char(two_servers["b"], "tiny-b", TEMPLATES["plain"].replace("{query}", text))
        a_answers = {first_char(two_servers["a"], "tiny-a", t.replace("{query}", text)) for t in TEMPLATES.values()}
        if b_plain is not None and b_plain not in a_answers:
            queries.append({"id": f"q{i}", "text": text, "gold": b_plain})
    assert len(queries) >= 3, "the two tiny models answer alike on too many queries"
    contexts = [{"name": "thrifty", "value_per_quality": 1e-6}, {"name": "accurate", "value_per_quality": 10.0}]
    spec_path = two_endpoint_spec(tmp_path / "spec", hosts, n_max=2, prices={"a": (0.1, 0.1), "b": (10.0, 10.0)},
                                  extra={"contexts": contexts,
                                         "sampling": {"temperature": 0.0, "max_tokens": 5, "seed": 3}})
    (tmp_path / "spec" / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))

    result = optimize(str(spec_path), "uniform", 4 * 2 * len(queries), tmp_path / "policy", seed=0,
                      cache=str(tmp_path / "cache.sqlite"))
    arm = {c.name: (c.prompt, c.n) for c in result.policy.contexts}
    assert arm["thrifty"][0].startswith("a/") and arm["accurate"][0] == "b/plain", arm

    port = free_port()
    serve = start_serve(result.policy_path, spec_path, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for name, (prompt, n) in arm.items():
            own, other = prompt.split("/")[0], "b" if prompt.startswith("a/") else "a"
            for q in queries:
                before = {h: proxy_stats(p) for h, p in hosts.items()}
                resp = client.completions.create(model=f"iapo/{name}", prompt=q["text"])
                after = {h: proxy_stats(p) for h, p in hosts.items()}
                iapo = resp.model_extra["iapo"]
                assert iapo["prompt"] == prompt and iapo["n"] == n and 1 <= iapo["drawn"] <= n
                # the policy's arm, at its endpoint: the completions drawn (a decided vote stops early), no more
                assert after[own]["choices"] - before[own]["choices"] == iapo["drawn"]
                assert after[other]["posts"] == before[other]["posts"]  # and nothing at the other
                if name == "accurate":
                    assert resp.choices[0].text.strip()[:1] == q["gold"]
    finally:
        stop(serve)
    assert_only_own_traffic(hosts, keys)


def test_a_policy_prompt_that_is_not_an_arm_of_the_spec_is_refused(tmp_path: Path) -> None:
    from iapo_gym.deploy.router import Router
    from iapo_gym.policyfile import PolicyFileError
    from tests.deploy_helpers import mv_policy

    spec = two_endpoint_spec(tmp_path, {"a": 9, "b": 10})  # arms a/plain, a/short, b/plain, b/short
    with pytest.raises(PolicyFileError, match=r"the policy's prompt\(s\) \['plain', 'short'\] are not arms of the "
                                              r"upstream spec .*a/plain"):
        Router(mv_policy(), spec)
