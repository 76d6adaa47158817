"""How often ``serve --learn --learn-reward feedback`` fails to settle on the most accurate prompt within a given
number of requests: the scenario of ``tests/test_serve_learn.py::test_majority_vote_learns_from_feedback_once_per_
response`` replayed in-process, many times, to choose that test's length.

The scenario: generated level ``mv_binary`` 21 (4 prompts, 46 queries, exact accuracy at N = 1 from 0.58 to
0.89), one context served N = 1 and starting on the least accurate prompt, ``--explore-share 0.25``, queries in
turn, and each answer's feedback a fresh Bernoulli draw at the served prompt's exact accuracy on the query (what
the unseeded simulator gives). A replay fails when the most accurate prompt is greedy for fewer than 75 % of the
requests from ``--settled`` on, or is not greedy at the last request (the test's two checks).

``.venv/bin/python research/feedback_replay.py --requests 440 --settled 300 --replays 2000`` (about a minute)
prints the failure rate; ``--requests 220 --settled 150`` gives the test's former length.
"""

from __future__ import annotations

import argparse
import functools
import sys
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from iapo_gym.deploy.learn import ServeLearner  # noqa: E402
from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyPrompt  # noqa: E402
from iapo_gym.tables import OutcomeTable  # noqa: E402
from iapo_gym.tasks.generated import level_table  # noqa: E402

#: The test's table and exploration share.
FAMILY, LEVEL, EXPLORE_SHARE = "mv_binary", 21, 0.25


@functools.cache
def scenario() -> tuple[OutcomeTable, np.ndarray, PolicyFile]:
    """The table, its exact accuracy per (prompt, query) at N = 1, and the policy serving its least accurate prompt
    (built once for all replays)."""
    table = level_table(FAMILY, LEVEL)
    assert table.gold is not None
    accuracy = table.probs[:, np.arange(table.n_queries), table.gold]  # (P, Q)
    worst = table.prompts[int(np.argmin(accuracy.mean(axis=1)))]
    policy = PolicyFile(
        task=FAMILY, aggregator="mv", api="completions", n_max=int(table.n_max), objectives=("correct",),
        scorer={"extractor": {"kind": "regex", "pattern": "(.)"}}, sampling={"max_tokens": 4, "temperature": 1.0},
        prompts=tuple(PolicyPrompt(p, "{query}") for p in table.prompts),
        contexts=(PolicyContext("c", (1.0,), 0.0, 1.0, worst, 1),), learned={"agent": "replay"})
    return table, accuracy, policy


def replay(seed: int, requests: int) -> tuple[list[str], str]:
    """One replay: the greedy prompt at each request, and the most accurate prompt."""
    table, accuracy, policy = scenario()
    learner = ServeLearner(policy, explore_share=EXPLORE_SHARE, reward="feedback", seed=0)
    context = policy.contexts[0]
    rng = np.random.default_rng(seed)
    greedy = []
    for t in range(requests):
        choice = learner.choose(context)
        assert choice is not None
        greedy.append(choice.greedy[0])
        p = table.prompts.index(choice.context.prompt)
        routed = types.SimpleNamespace(context=choice.context, prompt_id=choice.context.prompt, n=1,
                                       completion_tokens=0, answers=["a"], chosen=0)
        learner.observe(str(t), routed)
        learner.feedback(str(t), bool(rng.random() < accuracy[p, t % table.n_queries]))
    return greedy, table.prompts[int(np.argmax(accuracy.mean(axis=1)))]


def failed(greedy: list[str], best: str, settled: int) -> bool:
    """The test's checks: the best prompt greedy on at least 75 % of the requests from ``settled`` on, and last."""
    window = greedy[settled:]
    return sum(g == best for g in window) < 0.75 * len(window) or greedy[-1] != best


def main(argv: list[str] | None = None) -> None:
    """Print the share of ``--replays`` replays that fail the test's checks."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=440, help="requests per replay (default 440)")
    ap.add_argument("--settled", type=int, default=300, help="the first request the checks look at (default 300)")
    ap.add_argument("--replays", type=int, default=2000, help="replays, seeded 0, 1, ... (default 2000)")
    args = ap.parse_args(argv)
    if not 0 <= args.settled < args.requests:
        ap.error(f"--settled must be in [0, --requests), got {args.settled} with --requests {args.requests}")
    fails = sum(failed(*replay(seed, args.requests), args.settled) for seed in range(args.replays))
    print(f"{args.requests} requests, checks from {args.settled}: {fails} of {args.replays} replays fail "
          f"({fails / args.replays:.2%})")


if __name__ == "__main__":
    main()
