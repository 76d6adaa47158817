"""research/rules_paired.py: the pair is the agent without and with stopping rules on the same seeds."""

from __future__ import annotations

from rules_paired import main, paired

import agents
from iapo_gym.env import generated_env


def test_the_pair_is_the_same_agent_with_and_without_rules_on_the_same_seeds(capsys) -> None:
    without, with_rules = paired("psst", "mv_binary", 0, 1, 3_000)
    env = generated_env("mv_binary", 0)
    env.reset(seed=1001)
    assert without == env.evaluate(agents.make("psst", seed=1).train(env, 3_000), "test")
    env = generated_env("mv_binary", 0, rule_arms=True)
    env.reset(seed=1001)
    policy = agents.make("psst", seed=1).train(env, 3_000)
    assert with_rules == env.evaluate(policy, "test") and policy.has_rules
    main(["psst", "--families", "mv_binary", "--levels", "0:0", "--seeds", "2", "--budget", "3000"])
    out = capsys.readouterr().out
    assert f"seed 1: without {without:.4f} with {with_rules:.4f}" in out
    assert "== psst mv_binary T=3000: gain" in out and "of 2" in out
