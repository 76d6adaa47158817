"""Exact expected utilities (Q-tables), optimal policies and the Average Contextual Return.

Q(c, p, N) is the mean over a split's queries of the exact expected aggregated utility;
ACR(pi) = E_c[Q(c, pi(c))] (paper eq. 3). A Monte Carlo ACR, the paper's n-sample
estimate, is kept for cross-checks.
"""

from __future__ import annotations

import numpy as np

from iapo_gym.exact import stored
from iapo_gym.policy import Policy, PolicyLike
from iapo_gym.rules import default_rules, rule_expectations
from iapo_gym.tables import OutcomeTable, TableSchema
from iapo_gym.utility import block_utilities, expected_arm_reward, mean_task_reward


def q_table(table: OutcomeTable, queries: np.ndarray | None = None, *, rules: bool = False) -> np.ndarray:
    """Exact Q (C, P, N_max) averaged over ``queries`` (default: every query); index N-1.

    With ``rules`` the Q of every stopping rule of the table's family (``iapo_gym.rules.default_rules``),
    (C, P, N_max, R), entry [c, p, N-1, r]: expected task reward plus the cost weight times the expected cost of
    the completions the rule draws; [..., 0] (fixed N) is the Q-table without rules.
    """
    queries = _checked_queries(table, queries, "q_table")
    if rules:
        return _rules_q_table(table, queries)
    reward, rows = mean_task_reward(table, queries)  # (C', P, N)
    if table.aggregator == "bon":
        q = reward[rows]  # one row per context
    else:
        q = table.context_weights[:, 0, None, None] * reward
    mean_cost = table.cost_matrix()[:, queries].mean(axis=1)  # (P,)
    n = np.arange(1, table.n_max + 1)
    weights = table.context_weights
    step = max(1, _ROWS_CELLS // max(1, q[0].size))  # contexts at a time: no second (C, P, N_max) array
    for c0 in range(0, q.shape[0], step):
        q[c0 : c0 + step] += weights[c0 : c0 + step, -1, None, None] * mean_cost[None, :, None] * n[None, None, :]
    return q


_ROWS_CELLS = 1 << 18  # (prompt, N) cells of the cost term added at a time


def _checked_queries(table: OutcomeTable, queries: np.ndarray | None, what: str) -> np.ndarray:
    """``queries`` as int64 indices (default: every query of ``table``); at least one."""
    if queries is None:
        queries = np.arange(table.n_queries)
    queries = np.asarray(queries, dtype=np.int64)
    if queries.size == 0:
        raise ValueError(f"{what} needs at least one query")
    return queries


def expected_drawn(table: OutcomeTable, queries: np.ndarray | None = None) -> np.ndarray:
    """Exact expected completions drawn (C, P, N_max, R) by every (prompt, cap N, stopping rule), mean over
    ``queries``; [..., 0] (fixed N) is N."""
    queries = _checked_queries(table, queries, "expected_drawn")
    found = rule_expectations(table)
    drawn = found.drawn[:, :, queries].mean(axis=2)  # (C', P, N_max, R)
    return drawn[found.rows(table.n_contexts)]


def expected_cost(table: OutcomeTable, queries: np.ndarray | None = None) -> np.ndarray:
    """Exact expected cost (C, P, N_max, R) of every (prompt, cap N, stopping rule): the mean over ``queries`` of
    the query's cost per completion times the completions the rule is expected to draw (what Q's cost term weighs)."""
    queries = _checked_queries(table, queries, "expected_cost")
    found = rule_expectations(table)
    cost = table.cost_matrix()[:, queries]  # (P, Q')
    spend = np.einsum("cpqnr,pq->cpnr", found.drawn[:, :, queries], cost) / queries.size
    return spend[found.rows(table.n_contexts)]


def _rules_q_table(table: OutcomeTable, queries: np.ndarray) -> np.ndarray:
    """``q_table(..., rules=True)``: rule 0 is ``q_table`` itself (bit for bit), the others from
    ``iapo_gym.rules.rule_expectations`` plus the cost weight times ``expected_cost``."""
    found = rule_expectations(table)
    reward = found.reward[:, :, queries, :, 1:].mean(axis=2)[found.rows(table.n_contexts)]  # (C, P, N_max, R - 1)
    if table.aggregator == "mv":
        reward = table.context_weights[:, 0, None, None, None] * reward
    q = np.empty(reward.shape[:3] + (len(found.rules),))
    q[..., 0] = q_table(table, queries)
    q[..., 1:] = reward + table.context_weights[:, -1, None, None, None] * expected_cost(table, queries)[..., 1:]
    return q


def greedy_policy(q: np.ndarray) -> Policy:
    """The arm of highest Q in every context (ties: lowest prompt, then lowest N, then lowest rule).

    ``q`` is (C, P, N_max), or (C, P, N_max, R) over stopping rules (``q_table(..., rules=True)``): the policy then
    carries each context's rule.
    """
    if q.ndim == 3:
        q = q[..., None]
    n_contexts, _, n_max, n_rules = q.shape
    flat = q.reshape(n_contexts, -1).argmax(axis=1)
    arm, rule = np.divmod(flat, n_rules)
    prompt, n = np.divmod(arm, n_max)
    return Policy(tuple((int(p), int(k) + 1) for p, k in zip(prompt, n, strict=True)), tuple(int(r) for r in rule))


def optimal_policy(table: OutcomeTable, queries: np.ndarray | None = None) -> Policy:
    """The exact optimal policy pi*(c) = argmax_a Q(c, a) on ``queries``."""
    return greedy_policy(q_table(table, queries))


def policy_arms(policy: PolicyLike, table: TableSchema) -> np.ndarray:
    """(C, 2) array of the policy's (p, N), checked against the table's arm ranges; (C, 3) (p, N, r) when the policy
    stops by a rule other than fixed N in some context (the rule checked against the table's stopping rules)."""
    pol = Policy.coerce(policy, table.n_contexts)
    arms = np.array(pol.triples, dtype=np.int64).reshape(-1, 3)
    n_rules = len(default_rules(table.aggregator))
    bad = ((arms[:, 0] < 0) | (arms[:, 0] >= table.n_prompts) | (arms[:, 1] < 1) | (arms[:, 1] > table.n_max)
           | (arms[:, 2] >= n_rules))
    if bad.any():
        c = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"policy arm {tuple(int(x) for x in arms[c])} (p, N, rule) for context {c} is outside prompts "
            f"[0, {table.n_prompts}) x N [1, {table.n_max}] x rules [0, {n_rules})"
        )
    return arms if pol.has_rules else arms[:, :2]


def acr_from_q(q: np.ndarray, arms: np.ndarray, context_probs: np.ndarray) -> float:
    """ACR of the arms (C, 2) (p, N) under a Q-table (C, P, N_max), or of the arms (C, 3) (p, N, r) under a Q-table
    over stopping rules (C, P, N_max, R); (C, 3) arms of rule 0 also read a (C, P, N_max) table."""
    rows = np.arange(q.shape[0])
    if q.ndim == 4:
        rule = arms[:, 2] if arms.shape[1] == 3 else np.zeros(len(arms), dtype=np.int64)
        values = q[rows, arms[:, 0], arms[:, 1] - 1, rule]
    else:
        if arms.shape[1] == 3 and arms[:, 2].any():
            raise ValueError("the policy stops by a rule other than fixed N; its ACR needs q_table(..., rules=True)")
        values = q[rows, arms[:, 0], arms[:, 1] - 1]
    return float(np.dot(context_probs, values))


def exact_acr(table: OutcomeTable, policy: PolicyLike, queries: np.ndarray | None = None) -> float:
    """Exact Average Contextual Return of ``policy`` on ``queries``.

    With the (C', P, Q, N_max) tensor at hand (stored in the file or computed before) it is a mean
    over that tensor; otherwise only the policy's C arms are computed, never the whole Q-table.
    """
    arms = policy_arms(policy, table)
    if arms.shape[1] == 3:
        return acr_from_q(q_table(table, queries, rules=True), arms, table.context_probs)
    if stored(table) is not None:
        return acr_from_q(q_table(table, queries), arms, table.context_probs)
    if queries is None:
        queries = np.arange(table.n_queries)
    queries = np.asarray(queries, dtype=np.int64)
    if queries.size == 0:
        raise ValueError("exact_acr needs at least one query")
    reward = expected_arm_reward(table, arms, queries)
    if table.aggregator == "mv":
        reward = table.context_weights[:, 0] * reward
    mean_cost = table.cost_matrix()[arms[:, 0]][:, queries].mean(axis=1)  # (C,)
    values = reward + table.context_weights[:, -1] * mean_cost * arms[:, 1]
    return float(np.dot(table.context_probs, values))


def monte_carlo_acr(table: OutcomeTable, policy: PolicyLike, queries: np.ndarray | None,
                    n_samples: int, rng: np.random.Generator) -> tuple[float, float]:
    """The paper's n-sample ACR estimate and its standard error: contexts, queries, completions drawn."""
    from iapo_gym.sampling import AliasSampler

    arms = policy_arms(policy, table)
    if arms.shape[1] == 3:
        raise ValueError("monte_carlo_acr draws fixed-N arms; a policy with stopping rules is sampled by "
                         "env.step((p, N, r)) (its exact ACR: exact_acr)")
    if queries is None:
        queries = np.arange(table.n_queries)
    queries = np.asarray(queries, dtype=np.int64)
    contexts = rng.choice(table.n_contexts, size=n_samples, p=table.context_probs)
    q = queries[rng.integers(queries.size, size=n_samples)]
    prompts, ns = arms[contexts, 0], arms[contexts, 1]
    sampler = AliasSampler(table.probs.reshape(-1, table.n_atoms))
    values = np.empty(n_samples)
    for n in np.unique(ns):
        idx = np.flatnonzero(ns == n)
        rows = np.repeat(prompts[idx] * table.n_queries + q[idx], n)
        atoms = sampler.sample(rows, rng).reshape(idx.size, n)
        utils = block_utilities(table, prompts[idx], q[idx], atoms)
        values[idx] = utils[contexts[idx], np.arange(idx.size)]
    return float(values.mean()), float(values.std(ddof=1) / np.sqrt(n_samples))
