"""Properties of ``ServeLearner`` (``iapo_gym.deploy.learn``) on real routed answers drawn from a generated table.

Each request's completions are drawn from ``generated:bon_flat:1`` (5 prompts, 26 contexts, N up to 19) and given
to the learner as the router builds them (``Routed``: the completions, their objective scores and weighted
scores); expected utilities are exact from the table (``iapo_gym.exact``). Checked: the exploration budget is never
exceeded, also across a restart that resumes from the outcome log's rows; the propensity of the served arm is the
frequency with which the rule serves it; an estimate converges to the exact value of its arm in every context and
for every N at most the one served (cross-context and nested reuse); after a drift the greedy arm moves to the new
best arm; a prompt of the upstream the policy file never had is explored and adopted where it is best.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from iapo_gym.deploy.feedback import outcome_row
from iapo_gym.deploy.learn import DEFAULT_SPREAD, ServeLearner
from iapo_gym.deploy.router import Routed
from iapo_gym.exact import exact_reward
from iapo_gym.llm.client import Completion
from iapo_gym.online.schedule import build_schedule
from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyPrompt
from iapo_gym.tables import OutcomeTable
from iapo_gym.tasks.generated import level_table

TABLE = level_table("bon_flat", 1)


def bon_policy(table: OutcomeTable, arms: dict[int, tuple[str, int]] | None = None,
               prompts: tuple[str, ...] | None = None) -> PolicyFile:
    """A Best-of-N policy of ``table``'s contexts (each serving ``arms[c]``, default (first prompt, 1)); no
    ``arm_estimates``, so the learner starts without a warm start."""
    names = tuple(table.objective_names)
    contexts = tuple(PolicyContext(f"c{c}", tuple(float(w) for w in table.context_weights[c, :-1]),
                                   float(table.context_weights[c, -1]),
                                   float(table.context_probs[c] / np.sum(table.context_probs)),
                                   *(arms or {}).get(c, (table.prompts[0], 1)))
                     for c in range(table.n_contexts))
    return PolicyFile(task=table.task, aggregator="bon", api="completions", n_max=table.n_max, objectives=names,
                      scorer={"objectives": list(names), "grid": None, "reward_url": "http://127.0.0.1:9/reward"},
                      sampling=None,
                      prompts=tuple(PolicyPrompt(p, f"[{p}] {{query}}") for p in (prompts or table.prompts)),
                      contexts=contexts, learned={"agent": "test"})


def exact_utilities(table: OutcomeTable) -> np.ndarray:
    """(C, P, N_max): the expected utility of every arm in every context, the query uniform (cost weights 0 in
    bon_flat:1's contexts are checked by the callers that need them)."""
    exact = exact_reward(table)
    reward = exact.reward[exact.rows(table.n_contexts)]  # (C, P, Q, N_max)
    n = np.arange(1, table.n_max + 1, dtype=np.float64)
    cost = table.cost_matrix()
    utility = reward + table.context_weights[:, -1][:, None, None, None] * cost[None, :, :, None] * n
    return np.asarray(utility.mean(axis=2))


def routed(table: OutcomeTable, ctx: PolicyContext, rng: np.random.Generator) -> Routed:
    """The router's answer to one request served ``ctx``'s arm: N completions of a uniform query drawn from the
    table, their objective scores, the best one chosen."""
    p, q = table.prompts.index(ctx.prompt), int(rng.integers(table.n_queries))
    cdf = np.cumsum(table.probs[p, q])
    atoms = np.minimum(np.searchsorted(cdf, rng.random(ctx.n) * cdf[-1], side="right"), table.n_atoms - 1)
    assert table.atoms is not None
    vectors = table.atoms[p, q, atoms]
    raw = [{name: float(v) for name, v in zip(table.objective_names, row, strict=True)} for row in vectors]
    weighted = vectors @ np.asarray(ctx.objective_weights)
    chosen = int(np.argmax(weighted))
    completions = [Completion(f"completion {m}", 10, "stop") for m in atoms]
    return Routed(completions[chosen].text, "stop", chosen, ctx, ctx.prompt, completions,
                  scores=[float(w) for w in weighted], objective_scores=raw)


def serve(learner: ServeLearner, policy: PolicyFile, table: OutcomeTable, requests: int, seed: int,
          rows: list | None = None) -> list:
    """``requests`` requests in contexts drawn from the table's mix: each chosen, answered and learned from;
    returns the choices (and appends each request's outcome log row to ``rows``)."""
    rng = np.random.default_rng(seed)
    probs = np.asarray(table.context_probs) / np.sum(table.context_probs)
    choices = []
    for t in range(requests):
        ctx = policy.contexts[int(rng.choice(len(probs), p=probs))]
        choice = learner.choose(ctx)
        assert choice is not None
        answer = routed(table, choice.context, rng)
        answer.learn = choice.to_dict()
        learner.observe(f"r{seed}-{t}", answer)
        if rows is not None:
            rows.append(outcome_row(f"r{seed}-{t}", answer, None, objectives=tuple(policy.objectives), cost=None,
                                    unit_cost=None, propensity=choice.propensity))
        choices.append(choice)
    return choices


def test_the_budget_holds_at_every_request_and_across_a_restart() -> None:
    share = 0.1
    policy = bon_policy(TABLE)
    rows: list = []
    first = ServeLearner(policy, explore_share=share, seed=1)
    explored = 0
    for t, choice in enumerate(serve(first, policy, TABLE, 300, seed=1, rows=rows)):
        explored += choice.explored
        assert explored <= math.floor(share * (t + 1) + 1e-9), t
    assert explored >= 0.8 * share * 300  # a learner without a warm start has much to explore: it uses its budget
    # a restart resumes the counts from the log's rows: the budget is that of all requests, not of the new process
    again = ServeLearner(policy, explore_share=share, seed=2)
    assert again.resume(rows) == 300
    assert (again.chosen, again.explored) == (300, explored)
    total = explored
    for t, choice in enumerate(serve(again, policy, TABLE, 200, seed=2)):
        total += choice.explored
        assert total <= math.floor(share * (300 + t + 1) + 1e-9), t


@pytest.mark.parametrize("spread", [0.0, DEFAULT_SPREAD])
def test_the_propensity_is_the_probability_the_arm_was_served(spread: float) -> None:
    """With the estimates held fixed, the served arm's frequency over many draws is its stated propensity, and the
    distribution the logged record states (what ``evaluate-log`` reads) gives every served arm its propensity and
    sums to 1 over all K candidate arms; without the uniform part only the greedy arm and the contender are
    served, with it every arm is."""
    from iapo_gym.ope import _mass, _row_arms

    share = 0.3
    policy = bon_policy(TABLE)
    learner = ServeLearner(policy, explore_share=share, seed=3, spread=spread)
    serve(learner, policy, TABLE, 100, seed=3)
    ctx = policy.contexts[0]
    learner.explored = learner._spent = 0  # an untouched budget for the draws below (the budget's test is above)
    learner.chosen = 10 ** 9
    draws = 40_000
    counts: dict[tuple[str, int], int] = {}
    stated: dict[tuple[str, int], float] = {}
    for _ in range(draws):
        choice = learner.choose(ctx)
        assert choice is not None
        arm = (choice.context.prompt, choice.context.n)
        counts[arm] = counts.get(arm, 0) + 1
        stated.setdefault(arm, choice.propensity)
        assert stated[arm] == choice.propensity
    record = choice.to_dict()
    arms, uniform = _row_arms(record, 0.0)
    every = [(p, n) for p in TABLE.prompts for n in range(1, TABLE.n_max + 1)]
    assert sum(_mass(arms, uniform, p, n, nested=False) for p, n in every) == pytest.approx(1.0)
    for arm in counts:
        assert _mass(arms, uniform, *arm, nested=False) == pytest.approx(stated[arm], rel=1e-12)
    if spread == 0:
        assert set(counts) == {choice.greedy, choice.contender}  # the two arms the logged record names
    else:
        assert len(counts) == len(every)  # 95 arms of probability 0.3 x 0.1 / 95 or more: each drawn ~13 times
    for arm, k in counts.items():
        p = stated[arm]
        assert abs(k / draws - p) < 4.5 * math.sqrt(p * (1 - p) / draws), (arm, k / draws, p)


def test_an_estimate_converges_to_the_exact_value_in_every_context_and_smaller_n() -> None:
    """Serving one arm (p, 6) in one context teaches (p, k) for k <= 6 in all 26 contexts: each estimate is
    within a few standard errors of the exact expected utility from the table."""
    prompt, n = TABLE.prompts[2], 6
    policy = bon_policy(TABLE, {c: (prompt, n) for c in range(TABLE.n_contexts)})
    learner = ServeLearner(policy, explore_share=0.0, half_life=math.inf, prior_weight=0.0)
    requests = 4000
    serve(learner, policy, TABLE, requests, seed=4)
    exact = exact_utilities(TABLE)
    report = learner.report()
    p = TABLE.prompts.index(prompt)
    checked = 0
    for c in range(TABLE.n_contexts):
        arms = {(a["prompt"], a["n"]): a for a in report["contexts"][f"c{c}"]["arms"]}
        assert set(arms) == {(prompt, k) for k in range(1, n + 1)}  # nothing else was observed
        for k in range(1, n + 1):
            assert arms[(prompt, k)]["weight"] == pytest.approx(requests)
            # each observation is bounded by the atoms' weighted range: a loose but sure standard error
            spread = float(np.ptp(TABLE.atoms @ TABLE.context_weights[c, :-1])) + 1e-12
            assert abs(arms[(prompt, k)]["estimate"] - exact[c, p, k - 1]) < 4 * spread / 2 / math.sqrt(requests)
            checked += 1
    assert checked == TABLE.n_contexts * n


def test_after_a_drift_the_greedy_arm_moves_to_the_new_best() -> None:
    """The table, then its drift schedule's final table: in the contexts whose best arm the drift changed by a
    clear margin, the learner's greedy arm is within a small margin of the new best after the drift."""
    schedule = build_schedule("drift", TABLE, 10_000)
    drifted = schedule.table_at(TABLE, len(schedule.segments) - 1)
    before, after = exact_utilities(TABLE), exact_utilities(drifted)
    best_before = before.reshape(TABLE.n_contexts, -1).argmax(axis=1)
    flat_after = after.reshape(TABLE.n_contexts, -1)
    changed = [c for c in range(TABLE.n_contexts) if flat_after[c].max() - flat_after[c, best_before[c]] > 0.02]
    assert changed, "the drift changes some context's best arm"
    arms = {c: (TABLE.prompts[int(best_before[c]) // TABLE.n_max], int(best_before[c]) % TABLE.n_max + 1)
            for c in range(TABLE.n_contexts)}
    policy = bon_policy(TABLE, arms)
    learner = ServeLearner(policy, seed=5)
    serve(learner, policy, TABLE, 3000, seed=5)
    for c in changed:  # before the drift: the policy's arm (the best) is still greedy, or one as good
        p, n = learner.greedy(f"c{c}")
        assert before[c, TABLE.prompts.index(p), n - 1] >= before[c].max() - 0.01
    serve(learner, policy, drifted, 5000, seed=6)
    for c in changed:
        p, n = learner.greedy(f"c{c}")
        assert after[c, TABLE.prompts.index(p), n - 1] >= after[c].max() - 0.01, (c, p, n)
    assert learner.changes >= 1  # the change test saw the drift


def test_a_new_prompt_is_explored_first_and_adopted_where_it_is_best() -> None:
    """A policy file without the prompt the table rates best in the most contexts, the router serving it as the
    spec's new prompt: the learner explores it early and ends greedy on it where it is clearly best."""
    exact = exact_utilities(TABLE)
    best_prompt = exact.max(axis=2).argmax(axis=1)  # (C,)
    new = int(np.bincount(best_prompt, minlength=TABLE.n_prompts).argmax())
    known = tuple(p for i, p in enumerate(TABLE.prompts) if i != new)
    policy = bon_policy(TABLE, {c: (known[0], 1) for c in range(TABLE.n_contexts)}, prompts=known)
    learner = ServeLearner(policy, seed=7, extra_prompts=[TABLE.prompts[new]])
    choices = serve(learner, policy, TABLE, 3000, seed=7)
    # without evidence its bound is infinite: explored early, at N_max (whose completions teach every smaller N)
    assert any(ch.explored and (ch.context.prompt, ch.context.n) == (TABLE.prompts[new], TABLE.n_max)
               for ch in choices[:300])
    where = [c for c in range(TABLE.n_contexts)
             if best_prompt[c] == new and exact[c, new].max() - np.delete(exact[c], new, axis=0).max() > 0.01]
    assert where
    for c in where:
        assert learner.greedy(f"c{c}")[0] == TABLE.prompts[new], c


def test_the_budget_holds_across_a_kill_that_lost_the_last_explored_rows(tmp_path) -> None:
    """A kill -9 can lose the log's last rows (docs/log-format.md); the budget file reserves explorations before
    they are served, so the restarted learner counts those the lost rows held and the budget still holds."""
    share = 0.1
    policy = bon_policy(TABLE)
    budget = tmp_path / "learn-budget.json"
    rows: list = []
    first = ServeLearner(policy, explore_share=share, seed=3, budget_file=budget)
    choices = serve(first, policy, TABLE, 300, seed=3, rows=rows)
    explored = sum(c.explored for c in choices)
    last = max(i for i, c in enumerate(choices) if c.explored)
    kept = rows[:last]  # the kill lost every row from the last explored one on
    again = ServeLearner(policy, explore_share=share, seed=4, budget_file=budget)
    again.resume(kept)
    assert again.explored == explored - sum(c.explored for c in choices[last:])  # what the log shows
    assert explored <= again.report()["budget_spent"] <= explored + 8  # what the budget counts: every one served
    total = explored
    for t, choice in enumerate(serve(again, policy, TABLE, 300, seed=4)):
        total += choice.explored
        assert total <= math.floor(share * (len(kept) + t + 1) + 1e-9), t
    # without the budget file the restarted learner would count only the logged explorations
    blind = ServeLearner(policy, explore_share=share, seed=4)
    blind.resume(kept)
    assert blind.report()["budget_spent"] < explored


def test_a_budget_file_that_is_not_one_is_refused_by_name(tmp_path) -> None:
    budget = tmp_path / "learn-budget.json"
    budget.write_text('{"explored_reserved": -3}\n')
    learner = ServeLearner(bon_policy(TABLE), explore_share=0.1, budget_file=budget)
    with pytest.raises(ValueError, match="explored_reserved=-3"):
        learner.resume([])
