"""Majority votes that stop once decided: the same answer as all N (tie rule included), and the completions saved."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from iapo_gym.deploy import Router
from iapo_gym.deploy.estimates import simulate_drawn
from iapo_gym.llm.client import Completion, RequestOptions, Usage
from iapo_gym.policyfile import PolicyContext
from iapo_gym.tables import OutcomeTable
from iapo_gym.utility import vote_stop_points, votes_to_decide
from tests.deploy_helpers import mv_policy
from tests.echo_upstream import EchoUpstream
from tests.llm_server import (
    free_port,
    llama_server,  # noqa: F401 (fixture)
    proxy,  # noqa: F401 (fixture)
    proxy_stats,
    tiny_model,  # noqa: F401 (fixture)
    write_spec,
)

ANSWERS = ["1", "2", "3", "4", None]  # None: no answer, a bucket of its own


def _texts(answers: list[str | None]) -> list[str]:
    return [f"so {a}" if a is not None else "no idea" for a in answers]


def test_early_stopped_vote_is_the_vote_of_all_n(tmp_path: Path) -> None:
    """5,000 random vote sequences: drawing in the router's waves gives the winner, returned completion and tie rule
    of all N, stops at the first decided completion (as the simulator counts), and never stops undecided."""
    spec = write_spec(tmp_path, free_port(), scorer={"extractor": "last_number"})
    router = Router(mv_policy(extractor={"extractor": "last_number"}), spec, seed=3)
    rng = np.random.default_rng(20261125)
    saved = ties = 0
    for trial in range(5000):
        n = int(rng.integers(1, 12))
        alphabet = ANSWERS[: int(rng.integers(1, len(ANSWERS) + 1))]
        weights = rng.dirichlet(np.ones(len(alphabet)))
        answers = [alphabet[i] for i in rng.choice(len(alphabet), size=n, p=weights)]
        completions = [Completion(t, 1, "stop") for t in _texts(answers)]
        ctx = PolicyContext("c", (1.0,), -0.1, 1.0, "plain", n)
        full = router._vote(ctx, f"q{trial}", completions)
        drawn = 0
        while (wave := votes_to_decide(np.unique([str(a) for a in answers[:drawn]], return_counts=True)[1], n)) > 0:
            drawn += wave
        early = router._vote(ctx, f"q{trial}", completions[:drawn])
        assert (early.text, early.chosen) == (full.text, full.chosen), (answers, drawn)
        assert answers[early.chosen] == answers[full.chosen]
        # stopped at the first completion after which no remaining one can change the winner
        first = next(k for k in range(1, n + 1) if _decided(answers[:k], n))
        assert drawn == first == vote_stop_points(np.array([[ANSWERS.index(a) for a in answers]]), np.array([n]))[0, 0]
        if drawn < n:
            assert len(early.tied) == 1  # an early stop never needs the tie rule
        saved += n - drawn
        ties += len(full.tied) > 1
    assert saved > 0 and ties > 100  # both early stops and full-N ties were exercised


def _decided(answers: list[str | None], n: int) -> bool:
    """No way to fill the remaining n - k votes changes the plurality winner or makes a tie (brute force)."""
    left = n - len(answers)
    counts = {a: answers.count(a) for a in set(answers)}
    if left == 0:
        return True
    leader = max(counts, key=lambda a: counts[a])
    if sum(v == counts[leader] for v in counts.values()) > 1:
        return False
    for rest in itertools.combinations_with_replacement([*ANSWERS, "new"], min(left, 3)):
        if len(rest) < left:  # more votes than 3 left: give all of them to one rival
            rest = rest[:1] * left
        total = dict(counts)
        for a in rest:
            total[a] = total.get(a, 0) + 1
        top = max(total.values())
        if total.get(leader, 0) != top or sum(v == top for v in total.values()) > 1:
            return False
    return True


def test_simulated_completions_match_exact_enumeration() -> None:
    """``simulate_drawn`` (what optimize reports on a table) against the exact expectation by enumerating every
    sequence of votes."""
    probs = np.array([[[0.6, 0.3, 0.1]], [[0.34, 0.33, 0.33]]])  # two prompts, one query, three buckets
    table = OutcomeTable(task="t", aggregator="mv", probs=probs, cost=np.ones((2, 1)), n_max=5,
                         context_weights=np.array([[1.0, 0.0], [1.0, -0.1], [1.0, -0.2], [1.0, -0.3]]),
                         context_names=("a", "b", "c", "d"), context_probs=np.full(4, 0.25),
                         prompts=("x", "y"), queries=("q",), objective_names=("correct",), gold=np.zeros(1, np.int64))
    arms = np.array([[0, 5], [1, 5], [0, 4], [1, 3]])
    simulated = simulate_drawn(table, arms, np.array([0]), 40_000, seed=1)
    for c, (p, n) in enumerate(arms.tolist()):
        seqs = np.array(list(itertools.product(range(3), repeat=n)))
        weight = probs[p, 0][seqs].prod(axis=1)
        exact = float((vote_stop_points(seqs, np.array([n]))[:, 0] * weight).sum())
        assert exact < n  # the rule saves completions on these distributions
        assert abs(simulated[c] - exact) < 5 * n / np.sqrt(40_000), (c, simulated[c], exact)


def test_live_early_stop_against_llama_cpp(tmp_path: Path, proxy: int) -> None:  # noqa: F811
    """llama.cpp ignores n, so completion i is its own request with its own seed: the early-stopped vote draws a
    prefix of the full vote's completions, answers the same, and the upstream saw exactly the completions drawn."""
    spec = write_spec(tmp_path, proxy, n_max=8, sampling={"temperature": 0.7, "max_tokens": 3},
                      scorer={"extractor": "regex", "pattern": r"\A\s*(\S)"}, endpoint={"concurrency": 8})
    policy = mv_policy({"low": ("plain", 8), "mid": ("plain", 5), "high": ("short", 1)}, n_max=8,
                       extractor={"extractor": "regex", "pattern": r"\A\s*(\S)"})
    used = cap = 0
    with Router(policy, spec) as early, Router(policy, spec, early_stop=False) as full:
        for i in range(12):
            for context in ("low", "mid"):
                before = proxy_stats(proxy)["choices"]
                e = early.complete(f"{i} + {i} =", context)
                middle = proxy_stats(proxy)["choices"]
                f = full.complete(f"{i} + {i} =", context)
                assert middle - before == e.n <= f.n == e.context.n
                assert [c.text for c in e.completions] == [c.text for c in f.completions[: e.n]]
                assert (e.text, e.chosen) == (f.text, f.chosen)
                assert e.info()["drawn"] == e.n and e.info()["n"] == f.n
                used, cap = used + e.n, cap + f.n
    assert used < cap  # some votes were decided early


def test_every_wave_gets_the_request_options_and_the_spend_adds_up(tmp_path: Path) -> None:
    """A vote drawn in two waves from an upstream that honours n: each wave's request carries the caller's max_tokens
    bound and a seed from the caller's seed (by the wave's first completion), and the request's spend tally, the
    router's spend and the usage count both waves."""
    with EchoUpstream(answers=["1", "2", "3", "1", "1"]) as up:  # wave 1 (n = 3): 1, 2, 3; wave 2 (n = 2): 1, 1
        spec = write_spec(tmp_path, 0, endpoint={"base_url": up.url, "max_retries": 0}, n_max=5,
                          scorer={"extractor": "last_number"})
        policy = mv_policy({"low": ("plain", 5)}, n_max=5)
        usage = Usage()
        options = RequestOptions(max_tokens=2, seed=11, usage=usage)
        with Router(policy, spec) as router:
            routed = router.complete("1 + 1 =", "low", options)
            assert router._client is not None
            seeds = [router._client._seed(router.render(routed.context, "1 + 1 ="), i, options) for i in (0, 3)]
            spent = router.spent
        assert [b["n"] for b in up.bodies] == [3, 2] and [b["max_tokens"] for b in up.bodies] == [2, 2]
        assert [b["seed"] for b in up.bodies] == seeds and seeds[0] != seeds[1]
        assert routed.info()["answers"] == ["1", "2", "3", "1", "1"] and routed.text == "1"
        assert routed.info()["n"] == routed.info()["drawn"] == 5
        assert (usage.requests, usage.tokens) == (2, 5) == (spent["requests"], spent["tokens"])
        assert routed.completion_tokens == 5 and routed.prompt_tokens == 2 * len("Q: 1 + 1 =\nA:".split())
