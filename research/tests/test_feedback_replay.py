"""research/feedback_replay.py: the replay is the test's scenario, and its checks are the test's."""

from __future__ import annotations

from feedback_replay import failed, replay


def test_a_replay_starts_on_the_least_accurate_prompt_and_learns_the_most_accurate() -> None:
    """The first greedy prompt is the policy's (p0, the least accurate); 20 replays of 440 requests all pass."""
    for seed in range(20):
        greedy, best = replay(seed, 440)
        assert len(greedy) == 440 and greedy[0] == "p0-plain" and best == "p2-plain"
        assert not failed(greedy, best, 300), seed


def test_the_checks_are_the_tests_checks() -> None:
    assert not failed(["a"] * 3 + ["b", "a", "b", "b"], "b", 3)  # 3 of 4 from request 3 on, and the last
    assert failed(["b"] * 3 + ["a"] * 2 + ["b"] * 2, "b", 3)  # the last, but 2 of 4
    assert failed(["b"] * 6 + ["a"], "b", 3)  # 3 of 4, not the last
