"""``iapo_gym.deploy.Router`` against a scripted OpenAI-compatible server (a real process): aggregation checked exactly."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.deploy import ContextError, Router
from iapo_gym.deploy.router import TIE_KEY
from iapo_gym.seeding import derive_rng
from tests.deploy_helpers import bon_policy, mv_policy, scripted_stats, start_scripted
from tests.llm_scorer import score
from tests.llm_server import free_port, stop, write_spec

pytest.importorskip("openai")

TIE_QUERIES = [f"tie {i}" for i in range(200)]


def _script() -> dict[str, list[str]]:
    script = {
        "Q: clear\nA:": ["so 7", "I get 3", "it is 7.0", "7 again"],  # N = 3: 7 wins 2 to 1
        "Q: none\nA:": ["no idea", "maybe 5", "dunno", "9"],  # "no answer" has 2 votes of 3: it wins
        "clear ->": ["41", "42"],
    }
    for q in TIE_QUERIES:
        script[f"Q: {q}\nA:"] = ["1", "2", "3"]  # N = 3: a three-way tie
        script[f"{q} ->"] = ["4", "5"]  # N = 2: a two-way tie
    return script


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The scripted server honouring n; yields (port, spec path)."""
    folder = tmp_path_factory.mktemp("scripted")
    port = free_port()
    proc = start_scripted(_script(), folder, port)
    spec = write_spec(folder, port, endpoint={"concurrency": 8, "max_retries": 0})
    try:
        yield port, spec
    finally:
        stop(proc)


def test_majority_vote_returns_the_first_completion_of_the_winning_answer(scripted: tuple[int, Path]) -> None:
    port, spec = scripted
    # the scripted server answers a request for n completions with the first n of its script, whatever their
    # sample indices, so votes drawn in waves would repeat them: all N in one wave here (early stopping is
    # tested in tests/test_deploy_early_stop.py)
    with Router(mv_policy(), spec, early_stop=False) as router:
        before = scripted_stats(port)
        r = router.complete("clear", "low")  # low: prompt plain, N = 3
        after = scripted_stats(port)
        assert (r.prompt_id, r.n, r.context.name) == ("plain", 3, "low")
        assert r.answers == ["7", "3", "7"] and r.votes == [("7", 2), ("3", 1)] and r.tied == ["7"]
        assert r.chosen == 0 and r.text == "so 7"
        assert after["choices"] - before["choices"] == 3 and after["requests"] - before["requests"] == 1
        assert r.completion_tokens == len("so 7") + len("I get 3") + len("it is 7.0")
        assert r.prompt_tokens == len("Q: clear\nA:".split())
        info = r.info()
        assert info["winner"] == "7" and info["n"] == 3 and info["prompt"] == "plain"
        # "no answer" is one bucket, as in the tables: with 2 of 3 votes it wins
        r = router.complete("none", "low")
        assert r.answers == [None, "5", None] and r.tied == [None] and r.chosen == 0 and r.text == "no idea"
        assert r.info()["winner"] is None
        # the same query in context mid: the other prompt, N = 2, a 41/42 tie
        r = router.complete("clear", "mid")
        assert (r.prompt_id, r.n) == ("short", 2) and r.tied == ["41", "42"]


def test_ties_are_broken_uniformly_with_the_seeded_generator(scripted: tuple[int, Path]) -> None:
    """A t-way tie gives each tied answer with probability 1/t: the oracle's tie credit."""
    _, spec = scripted
    for seed in (0, 5):
        router = Router(mv_policy(), spec, seed=seed, early_stop=False)  # all N in one wave (see above)
        try:
            three, two = Counter(), Counter()
            for q in TIE_QUERIES:
                r = router.complete(q, "low")
                assert r.tied == ["1", "2", "3"]
                rng = derive_rng(seed, TIE_KEY, "low", "plain", q, "1", "2", "3")
                assert r.text == ["1", "2", "3"][int(rng.integers(3))]
                three[r.text] += 1
                r2 = router.complete(q, "mid")
                assert r2.tied == ["4", "5"]
                two[r2.text] += 1
            assert router.complete(TIE_QUERIES[0], "low").text == Router(
                mv_policy(), spec, seed=seed, early_stop=False).complete(TIE_QUERIES[0], "low").text  # reproducible
        finally:
            router.close()
        # 200 draws: each share within 5 standard deviations of 1/t
        for counts, t in ((three, 3), (two, 2)):
            assert set(counts) == {str(v) for v in (range(1, 4) if t == 3 else range(4, 6))}
            sd = np.sqrt(200 * (1 / t) * (1 - 1 / t))
            assert all(abs(c - 200 / t) < 5 * sd for c in counts.values()), counts


def test_best_of_n_picks_the_best_weighted_rounded_score(tmp_path: Path) -> None:
    texts = ["abcdefghijklmnopqrst", "ab", "1", "1234abcdefghij"]
    port = free_port()
    proc = start_scripted({"Q: pick\nA:": texts}, tmp_path, port)
    try:
        spec = write_spec(tmp_path, port, aggregator="bon")
        with Router(bon_policy(), spec) as router:
            for context, weights in (("long", (0.9, 0.1)), ("digits", (0.1, 0.9))):
                r = router.complete("pick", context)
                raw = [score(t, "pick") for t in texts]
                vec = np.round(np.array([[s["length"], s["digits"]] for s in raw]) / 0.5) * 0.5
                weighted = vec @ np.array(weights)
                assert r.scores == pytest.approx(weighted.tolist())
                assert r.chosen == int(np.argmax(weighted)) and r.text == texts[r.chosen]
                assert r.objective_scores == raw
            assert router.complete("pick", "long").text == texts[0]
            assert router.complete("pick", "digits").text == texts[2]  # "1": all digits, short
    finally:
        stop(proc)


def test_upstream_ignoring_n_gets_n_requests(tmp_path: Path) -> None:
    port = free_port()
    proc = start_scripted({"Q: clear\nA:": ["7", "7", "3"]}, tmp_path, port, ignore_n=True)
    try:
        spec = write_spec(tmp_path, port)
        with Router(mv_policy(), spec, early_stop=False) as router:  # all N in one wave
            first = router.complete("clear", "low")
            stats = scripted_stats(port)
            # one request with n = 3 answered with 1 choice, then the 2 missing ones one by one
            assert stats["requests"] == 3 and stats["choices"] == 3 and first.n == 3
            assert sorted(first.answers or []) == ["3", "7", "7"] and first.text == "7"
            router.complete("clear", "low")
            assert scripted_stats(port)["requests"] == 6  # now known: N requests of one completion
    finally:
        stop(proc)


def test_contexts_by_name_index_or_weights(scripted: tuple[int, Path]) -> None:
    _, spec = scripted
    router = Router(mv_policy(), spec)
    assert router.resolve("mid").name == "mid"
    assert router.resolve(2).name == "high"
    assert router.resolve([1.0, -0.2]).name == "mid"
    with pytest.raises(ContextError, match="unknown context 'nope'.*low.*mid.*high"):
        router.resolve("nope")
    with pytest.raises(ContextError, match="match 3 contexts"):
        router.resolve([1.0])
    with pytest.raises(ContextError, match="no context has the weights"):
        router.resolve([1.0, -0.3])
    with pytest.raises(ContextError, match="names no context"):
        router.resolve(None)


def test_async_twin_runs_requests_concurrently(scripted: tuple[int, Path]) -> None:
    port, spec = scripted

    async def main() -> list[str]:
        async with Router(mv_policy(), spec) as router:
            routed = await asyncio.gather(*(router.acomplete(q, "high") for q in TIE_QUERIES[:40]))
            return [r.text for r in routed]
    before = scripted_stats(port)
    texts = asyncio.run(main())
    assert all(t in ("4", "5") for t in texts)
    assert scripted_stats(port)["choices"] - before["choices"] == 40  # high: N = 1


def test_upstream_refusal_is_reported_and_does_not_stop_the_router(tmp_path: Path, scripted: tuple[int, Path]) -> None:
    from iapo_gym.llm.client import EndpointError

    _, spec = scripted
    with Router(mv_policy(), spec) as router:
        with pytest.raises(EndpointError) as info:
            router.complete("FORBIDDEN", "low")
        assert info.value.status == 403
        assert router.complete("clear", "low").text == "so 7"  # the next request goes through


def test_chat_upstream_gets_the_policy_messages(tmp_path: Path) -> None:
    from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyPrompt

    port = free_port()
    proc = start_scripted({"Q: 6 * 7": ["42", "the answer is 42", "41"]}, tmp_path, port)
    try:
        messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "Q: {query}"}]
        spec = write_spec(tmp_path, port, endpoint={"api": "chat"},
                          extra={"prompts": [{"id": "sys", "messages": messages}]})
        policy = PolicyFile(task="tiny", aggregator="mv", api="chat", n_max=3, objectives=("correct",),
                            scorer={"extractor": "last_number"}, sampling=None,
                            prompts=(PolicyPrompt("sys", None, tuple((m["role"], m["content"]) for m in messages)),),
                            contexts=(PolicyContext("only", (1.0,), -0.1, 1.0, "sys", 3),))
        with Router(policy, spec) as router:
            r = router.complete("6 * 7")  # one context: no need to name it
            # 42 twice decides the vote of 3: the third completion is never drawn
            assert r.answers == ["42", "42"] and r.text == "42" and r.prompt_id == "sys" and r.n == 2
            assert r.info()["n"] == 3 and r.info()["drawn"] == 2
        with pytest.raises(ValueError, match="written for the chat API.*endpoint.api = 'completions'"):
            Router(policy, write_spec(tmp_path, port, name="completions.json"))
    finally:
        stop(proc)


def test_spending_cap_stops_routing(tmp_path: Path) -> None:
    from iapo_gym.llm.client import BudgetExhausted

    port = free_port()
    proc = start_scripted({"1 + 1 = ->": ["2"]}, tmp_path, port)
    try:
        spec = write_spec(tmp_path, port, budget={"max_requests": 2})
        with Router(mv_policy(), spec) as router:
            assert router.complete("1 + 1 =", "high").text == "2"
            assert router.complete("1 + 1 =", "high").text == "2"
            with pytest.raises(BudgetExhausted, match="max_requests = 2"):
                router.complete("1 + 1 =", "high")
            assert router.spent["requests"] == 2
        assert scripted_stats(port)["requests"] == 2
    finally:
        stop(proc)
