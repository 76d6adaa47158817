"""Stopping rules read by the agents: every (prompt, cap N, rule) arm from the same completions as the (prompt, N) arms.

With ``env.unwrapped.rule_arms`` an agent's arm set is (p, N, r) over the env's rules (``iapo_gym.rules``; rule 0 is
fixed N). A rule needs no completions of its own: a pull of n completions is a draw sequence, so it shows what every
rule would have done on it at every cap k <= n. Two readings, one per kind of agent (docs/agents.md, "Stopping rules"):

* ``block_readings`` / ``RuleEstimator`` (PSST, PSST+Top-K, uniform, the sequential baselines): on each of a pull's
  floor(n / k) disjoint blocks of k completions (the estimator's block reuse), rule r stops at T (the first draw
  after which it stops, checked from the first one; ``iapo_gym.rules.vote_stops`` on majority vote, the context's
  tau from ``iapo_gym.rules.context_thresholds`` on Best-of-N), so the block gives the reward of its first min(T, k)
  completions (the tie-aware credit of their votes, or the best of them) and costs min(T, k) completions; the
  sample's utility is the reward plus the context's cost weight x the query's cost per completion x min(T, k), as in
  the exact Q of ``oracle.q_table(..., rules=True)``.
* ``plugin_rule_values`` (``auto``, ``plugin_halving``): the exact rule expectations of ``iapo_gym.rules`` (the
  oracle's kernels) applied to the plug-in estimator's per-(prompt, query) distributions give each rule's change
  against fixed N, in reward and in expected completions x cost; their mean over the prompt's seen queries is added
  to the plug-in estimate of fixed N, so rule 0 is that estimate unchanged. ``trusted_rule_values`` keeps a rule's
  arm a candidate only at the caps where those distributions are trusted (``RULE_CAP``).

``best_rule_arms`` reads a policy over (p, N, r) out of either.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from agents.estimator import Estimator, Reuse
from iapo_gym import Policy, Pulls
from iapo_gym.rules import FixedN, Rule, bon_rule_expectations, context_thresholds, mv_rule_expectations, vote_stops
from iapo_gym.utility import mv_credit

#: Cells of the (pulls, starts, draws[, answers or contexts]) work arrays per chunk of ``block_readings``' callers.
CHUNK_CELLS = 1 << 22

#: The plug-in read-out's rule arms (p, N, r >= 1) are candidates only at caps N <= RULE_CAP x the cap of the context's
#: best fixed-N arm (``trusted_rule_values``): far above the caps fixed N's own choice trusts, the smoothed
#: distributions' credit is too high (docs/agents.md, "Stopping rules"). Chosen on tuning levels (1, 1.5, 2, 3, 4 tried).
RULE_CAP = 2.0


def block_layout(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The disjoint blocks of a pull of ``n`` completions at every cap k = 1..n, ordered by k then position (as the
    estimator's block reuse): (k of each block, first completion of each block, first block of each k)."""
    ks = np.arange(1, n + 1)
    per_k = n // ks
    first_block = np.cumsum(per_k) - per_k
    block_k = np.repeat(ks, per_k)
    start = (np.arange(block_k.size) - np.repeat(first_block, per_k)) * block_k
    return block_k, start, first_block


def _first_true(stop: np.ndarray) -> np.ndarray:
    """Index of the first True along the last axis, the axis' length where there is none."""
    return np.where(stop.any(axis=-1), stop.argmax(axis=-1), stop.shape[-1])


def block_readings(table: Any, rules: tuple[Rule, ...], prompts: np.ndarray, queries: np.ndarray,
                   atoms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every rule's reward and completions drawn on the blocks of L pulls of n completions each, per cap k = 1..n.

    ``atoms`` (L, n) are the pulls' outcomes in draw order, ``prompts`` and ``queries`` (L,) theirs. Returns
    (reward, drawn), each (C', L, n, len(rules)): entry [., l, k - 1, r] sums over pull l's floor(n / k) blocks of k
    completions the reward of the block's first min(T, k) completions and min(T, k), T the draw after which rule r
    stops on the block. C' = 1 on majority vote (the reward is the tie-aware credit of the votes; at a stop the leader
    is unique), C' = C on Best-of-N (the context's utility w . a of the best completion, w and tau the context's
    objective weights and thresholds from ``context_thresholds``). Rule 0 (``FixedN``) reads every block whole.
    """
    atoms = np.asarray(atoms, dtype=np.int64)
    n_pulls, n = atoms.shape
    block_k, start, first_block = block_layout(n)
    position = np.arange(n)
    if table.aggregator == "mv":
        n_answers = max(table.n_atoms, 2)
        cum = np.zeros((n_pulls, n + 1, n_answers), dtype=np.int32)
        cum[np.arange(n_pulls)[:, None], position[None, :] + 1, atoms] = 1
        np.cumsum(cum, axis=1, out=cum)
        end = np.minimum(position[:, None] + position[None, :] + 1, n)  # (start s, draw t): the votes s..s+t
        counts = cum[:, end] - cum[:, :n, None]  # (L, s, t, answers)
        top2 = np.partition(counts, n_answers - 2, axis=-1)[..., -2:]
        valid = (position[:, None] + position[None, :]) < n
        assert table.gold is not None
        credit = mv_credit(counts, table.gold[queries][:, None, None])  # (L, s, t)
        stops = np.empty((len(rules), n_pulls, n), dtype=np.int64)  # the draw index t of each start's stop
        for j, rule in enumerate(rules):
            if isinstance(rule, FixedN):
                stops[j] = n
            else:
                stops[j] = _first_true(vote_stops(rule, top2[..., 1], top2[..., 0], max(table.n_max, n)) & valid)
        t_star = np.minimum(stops[:, :, start], block_k - 1)  # (R, L, blocks)
        value = credit[np.arange(n_pulls)[None, :, None], start[None, None, :], t_star]
        reward = np.add.reduceat(value, first_block, axis=-1)[None]  # (1, R, L, n)
        drawn = np.add.reduceat(t_star + 1.0, first_block, axis=-1)[None]
    else:
        assert table.atoms is not None
        taus, weights = context_thresholds(table, rules)
        cells = table.atoms[prompts, queries]  # (L, M, K)
        scores = np.stack([np.take_along_axis(cells @ w, atoms, axis=1) for w in weights])  # (C, L, n), as sampled_stop
        padded = np.concatenate([scores, np.full(scores.shape, -np.inf)], axis=-1)
        best = np.maximum.accumulate(sliding_window_view(padded, n, axis=-1)[..., :n, :], axis=-1)  # (C, L, s, t)
        n_contexts = scores.shape[0]
        reward = np.empty((n_contexts, len(rules), n_pulls, n))
        drawn = np.empty((n_contexts, len(rules), n_pulls, n))
        lanes = (np.arange(n_contexts)[:, None, None], np.arange(n_pulls)[None, :, None])
        for j in range(len(rules)):
            hit = np.where(scores >= taus[:, j, None, None], position, n)  # FixedN: tau = +inf, never
            after = np.minimum.accumulate(hit[..., ::-1], axis=-1)[..., ::-1] - position  # (C, L, s): draws to a stop
            t_star = np.minimum(after[..., start], block_k - 1)  # (C, L, blocks)
            value = best[lanes[0], lanes[1], start[None, None, :], t_star]
            reward[:, j] = np.add.reduceat(value, first_block, axis=-1)
            drawn[:, j] = np.add.reduceat(t_star + 1.0, first_block, axis=-1)
    return reward.transpose(0, 2, 3, 1), drawn.transpose(0, 2, 3, 1)


def chunk_pulls(n: int, width: int) -> int:
    """Pulls of ``n`` completions per chunk so the (pulls, n, n, ``width``) work arrays stay near ``CHUNK_CELLS``."""
    return max(1, CHUNK_CELLS // max(1, n * n * width))


class RuleEstimator(Estimator):
    """The shared estimator plus each stopping rule's block readings: Q(c, p, N, r) for every rule of the env.

    Rule 0 is the ``Estimator``'s own estimate (any ``reuse``), bit for bit; rules 1.. are the means of
    ``block_readings`` over the same (pull, cap) samples the estimator counts (the rule sums share its ``counts``).
    The readings of the pulls added are computed when an estimate is read (``rule_mean``), in chunks, not per pull.
    ``mean`` and ``mean_at`` stay fixed N's (what the agents explore and trim by, so their pulls are those without
    rules); ``best_arms`` returns a policy over (p, N, r), every rule of the (p, N) arms it may choose from. At cap 1
    every rule draws one completion, so there each rule's estimate is rule 0's.
    """

    def __init__(self, env: Any, reuse: Reuse = "blocks") -> None:
        """Bind to ``env`` and its rules (``IAPOEnv.rules``)."""
        super().__init__(env, reuse)
        self.rules: tuple[Rule, ...] = self.env.rules
        self.rule_sums = np.zeros(self.sums.shape + (len(self.rules) - 1,))
        self._pending: list[tuple[Pulls, np.ndarray | None]] = []
        self._singles: list[tuple[int, int, int, np.ndarray]] = []

    def reset(self) -> None:
        """Forget every sample, the rules' included."""
        super().reset()
        self.rule_sums[...] = 0.0
        self._pending.clear()
        self._singles.clear()

    def update(self, pulls: Pulls, *, scales: str | np.ndarray | None = None,
               arm_mask: np.ndarray | None = None, contexts: np.ndarray | None = None) -> None:
        """``Estimator.update``, and the pulls kept for the rules' readings (on the same arms: ``scales``, ``arm_mask``).

        Per-pull contexts and ``scales="own"`` (sequential halving's reading) have no rule reading: a ValueError.
        """
        if contexts is not None or isinstance(scales, str):
            raise ValueError("stopping-rule readings need pulls scored under every context at every scale "
                             f"(got contexts={'given' if contexts is not None else None}, scales={scales!r})")
        super().update(pulls, scales=scales, arm_mask=arm_mask)
        if len(pulls) == 0:
            return
        mask = None
        if scales is not None or arm_mask is not None:
            mask = np.ones((self.n_prompts, self.n_max), dtype=bool) if arm_mask is None else np.asarray(arm_mask, bool)
            if scales is not None:
                at = np.zeros(self.n_max, dtype=bool)
                at[np.asarray(scales, dtype=np.int64) - 1] = True
                mask = mask & at[None, :]
        self._pending.append((pulls, mask))

    def _update_single(self, pulls: Pulls) -> None:
        """The one-pull fast path of ``update`` (which keeps the pull itself)."""
        Estimator.update_one(self, int(pulls.prompts[0]), int(pulls.ns[0]), int(pulls.queries[0]), pulls.atoms)

    def update_one(self, p: int, n: int, q: int, atoms: np.ndarray) -> None:
        """``Estimator.update_one``, and the pull kept for the rules' readings."""
        super().update_one(p, n, q, atoms)
        self._singles.append((p, n, q, np.array(atoms, dtype=np.int64)))

    def snapshot(self) -> np.ndarray:
        """The rules' sums with every kept pull read (``restore`` returns to it; the base sums are the caller's)."""
        self._flush()
        return self.rule_sums.copy()

    def restore(self, rule_sums: np.ndarray) -> None:
        """Back to a ``snapshot``: its sums, and the pulls kept since forgotten."""
        self.rule_sums[...] = rule_sums
        self._pending.clear()
        self._singles.clear()

    def _flush(self) -> None:
        """Read the kept pulls into ``rule_sums``."""
        if self._singles:
            p, n, q, atoms = zip(*self._singles, strict=True)
            self._pending.append((Pulls.of(np.array(p, dtype=np.int64), np.array(n, dtype=np.int64),
                                           np.array(q, dtype=np.int64), np.concatenate(atoms)), None))
            self._singles.clear()
        for pulls, mask in self._pending:
            self._add(pulls, mask)
        self._pending.clear()

    def _add(self, pulls: Pulls, mask: np.ndarray | None) -> None:
        """Add the rules' (1..) block readings of ``pulls`` on the arms of ``mask`` (P, N_max) (None: all)."""
        table = self.env.table
        weights = self._weights
        width = max(table.n_atoms, self.n_contexts if self.aggregator == "bon" else 1)
        for n in np.unique(pulls.ns).tolist():
            which = np.flatnonzero(pulls.ns == n)
            step = chunk_pulls(n, width)
            for lo in range(0, which.size, step):
                idx = which[lo:lo + step]
                prompts, queries = pulls.prompts[idx], pulls.queries[idx]
                atoms = pulls.atoms[pulls.offsets[idx][:, None] + np.arange(n)[None, :]]
                reward, drawn = block_readings(table, self.rules, prompts, queries, atoms)
                reward, drawn = reward[..., 1:], drawn[..., 1:]
                cost = self._cost[prompts, queries][None, :, None, None] * drawn  # (C', L, n, R - 1)
                if self.aggregator == "mv":
                    q = weights[:, 0, None, None, None] * reward + weights[:, -1, None, None, None] * cost
                else:
                    q = reward + weights[:, -1, None, None, None] * cost
                if mask is not None:
                    q = q * mask[prompts, :n][None, :, :, None]
                np.add.at(self.rule_sums[:, :, :n].transpose(1, 0, 2, 3), prompts, q.transpose(1, 0, 2, 3))

    def rule_mean(self, unseen: float = np.nan) -> np.ndarray:
        """Estimated Q (C, P, N_max, R) of every (prompt, cap N, rule); arms without samples get ``unseen``."""
        self._flush()
        out = np.empty(self.rule_sums.shape[:3] + (len(self.rules),))
        out[..., 0] = super().mean(unseen)
        seen = self.counts > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            out[..., 1:] = np.where(seen[..., None], self.rule_sums / np.where(seen, self.counts, 1.0)[..., None],
                                    unseen)
        out[:, :, 0, 1:] = out[:, :, 0, :1]  # cap 1: every rule is fixed N
        return out

    def rules_at(self, policy: Policy) -> Policy:
        """``policy``'s (p, N) in every context with the rule of highest estimate there (ties: the lowest rule)."""
        values = self.rule_mean(unseen=-np.inf)
        rules = [int(np.argmax(values[c, p, n - 1])) for c, (p, n) in enumerate(policy.arms)]
        return Policy(policy.arms, rules=tuple(rules))

    def best_arms(self, rng: np.random.Generator, mask: np.ndarray | None = None) -> Policy:
        """Per context, the (p, N, r) of highest estimate among the rules of ``mask``'s (p, N) arms (``best_rule_arms``)."""
        return best_rule_arms(self.rule_mean(), rng, mask)


def best_rule_arms(values: np.ndarray, rng: np.random.Generator, mask: np.ndarray | None = None) -> Policy:
    """Per context, the (p, N, r) of highest ``values`` (C, P, N_max, R) (nan: no estimate) among every rule of the
    (p, N) arms of ``mask`` (C, P, N_max) (None: all).

    Ties are broken at random (one uniform draw per (context, arm, rule) from ``rng``); a context with no estimate
    in its mask gets a uniformly random (p, N) of the mask (of all arms if the mask is empty) with rule 0.
    """
    n_contexts, n_prompts, n_max, n_rules = values.shape
    flat = values.reshape(n_contexts, -1)
    arm_mask = np.ones((n_contexts, n_prompts * n_max), dtype=bool) if mask is None else \
        np.asarray(mask, dtype=bool).reshape(n_contexts, -1)
    allowed = np.repeat(arm_mask, n_rules, axis=1)
    fixed = np.zeros(n_rules, dtype=bool)
    fixed[0] = True
    seen = allowed & np.isfinite(flat)
    any_seen = seen.any(axis=1, keepdims=True)
    fallback = np.repeat(arm_mask | ~arm_mask.any(axis=1, keepdims=True), n_rules, axis=1) & np.tile(fixed, n_prompts * n_max)
    pool = np.where(any_seen, seen, fallback)
    score = np.where(pool, np.where(any_seen, np.nan_to_num(flat, nan=0.0), 0.0), -np.inf)
    ties = pool & (score == score.max(axis=1, keepdims=True))
    pick = np.argmax(np.where(ties, rng.random(flat.shape), -1.0), axis=1)
    arm, rule = np.divmod(pick, n_rules)
    prompt, n = np.divmod(arm, n_max)
    return Policy(tuple(zip(prompt.tolist(), (n + 1).tolist(), strict=True)), rules=tuple(rule.tolist()))


def plugin_rule_values(est: Any, prompts: np.ndarray) -> np.ndarray:
    """(C, P, N_max, R) the plug-in estimate of every rule of the env at ``prompts`` (nan at the other prompts).

    ``est`` is a ``PlugInEstimator``. Rule 0 is ``est.mean()``; rule r adds, per prompt, the mean over its seen queries
    of the exact change r makes against fixed N on that (prompt, query)'s distribution: reward (x w_1 on majority
    vote) plus the context's cost weight x the query's cost per completion x the change in expected completions.
    Majority vote reads the estimator's smoothed distribution of each (prompt, query) (its votes plus the prior's
    pseudo-votes, ``mv_rule_expectations``); Best-of-N the (prompt, query)'s own completions, with the contexts'
    thresholds (``bon_rule_expectations``), and a rule r >= 1 there has a value (else nan, no candidate) only at the
    caps N up to the median number of completions of the prompt's seen queries: past a query's own completions the
    plug-in maximum of N is biased low, fixed N's more than a rule's, so the change leans towards the rules
    (docs/agents.md, "Stopping rules").
    """
    env = est.env
    table = env.table
    rules: tuple[Rule, ...] = env.rules
    prompts = np.asarray(prompts, dtype=np.int64)
    n_contexts, n_prompts, n_max = est.shape
    out = np.full((n_contexts, n_prompts, n_max, len(rules)), np.nan)
    base = est.mean()[:, prompts]
    out[:, prompts] = base[..., None]
    p_pos, q_idx = np.nonzero(est._seen[prompts])
    if p_pos.size == 0 or len(rules) == 1:
        return out
    p_idx = prompts[p_pos]
    weights = est._weights
    cost = est._cost[p_idx, q_idx]
    if table.aggregator == "mv":
        credit, drawn = mv_rule_expectations(est._probs[p_idx, q_idx], table.gold[q_idx], n_max, rules)
        change = (weights[:, 0, None, None, None] * (credit[None] - credit[None, ..., :1])
                  + weights[:, -1, None, None, None] * (cost[:, None, None] * (drawn - drawn[..., :1]))[None])
    else:
        counts = est.atom_counts[p_idx, q_idx]  # (rows, atoms): the own completions
        width = int((counts > 0).sum(axis=1).max())
        order = np.argsort(-counts, axis=1, kind="stable")[:, :width]  # the observed atoms first
        mass = np.take_along_axis(counts, order, axis=1).astype(np.float64)
        cells = table.atoms[p_idx[:, None], q_idx[:, None], order]  # (rows, width, K)
        taus, context_weights = context_thresholds(table, rules)
        reward, drawn = bon_rule_expectations(cells[None], (mass / mass.sum(axis=1, keepdims=True))[None],
                                              context_weights, n_max, rules, taus)
        reward, drawn = reward[:, 0], drawn[:, 0]  # (C, rows, N_max, R)
        change = (reward - reward[..., :1]) + weights[:, -1, None, None, None] * (
            cost[None, :, None, None] * (drawn - drawn[..., :1]))
    sums = np.zeros((n_contexts, prompts.size, n_max, len(rules)))
    np.add.at(sums.transpose(1, 0, 2, 3), p_pos, change.transpose(1, 0, 2, 3))
    n_seen = np.bincount(p_pos, minlength=prompts.size).astype(np.float64)
    mean_change = np.where(n_seen[None, :, None, None] > 0, sums / np.maximum(n_seen, 1.0)[None, :, None, None], 0.0)
    out[:, prompts] += mean_change
    if table.aggregator == "bon":  # a rule only at the caps the prompt's completions of a seen query reach
        draws = counts.sum(axis=1)
        reach = np.array([np.median(draws[p_pos == i]) // 1 if n_seen[i] else n_max for i in range(prompts.size)])
        block = out[:, prompts]
        block[..., 1:][:, np.arange(1, n_max + 1)[None, :] > reach[:, None]] = np.nan
        out[:, prompts] = block
    return out


def trusted_rule_values(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``values`` (C, P, N_max, R) of ``plugin_rule_values`` with every rule r >= 1 set to nan (no candidate) at caps
    N > ``RULE_CAP`` x N*_c, N*_c the cap of context c's best fixed-N arm (rule 0) among ``mask`` (C, P, N_max) (ties:
    the largest cap). Rule 0 is unchanged, so the fixed-N choice stays a candidate.

    Why: the plug-in values read the smoothed per-(prompt, query) distributions, whose credit at caps far above what
    the draws support is too high (majority vote: the prior's pseudo-votes make near-even queries look decided;
    Best-of-N: a plug-in maximum from a query's few completions). Fixed N never pays for it, its cost grows with N;
    a rule that stops early makes such a cap cheap, and its overestimated credit won the read-out (tuning levels of
    mv_binary, mv_few_queries and bon_multi). The rule's change against fixed N at the same cap is estimated well;
    a noise-scaled shrinkage of it changed nothing on the tuning levels.
    """
    n_contexts, n_prompts, n_max, _ = values.shape
    fixed = np.where(np.asarray(mask, dtype=bool), np.nan_to_num(values[..., 0], nan=-np.inf), -np.inf)
    flat = fixed.reshape(n_contexts, -1)
    top = (flat == flat.max(axis=1, keepdims=True)) & np.isfinite(flat)
    caps = np.tile(np.arange(1, n_max + 1), n_prompts)
    n_star = np.where(top, caps[None, :], 0).max(axis=1)
    n_star = np.where(top.any(axis=1), n_star, n_max)  # a context without an estimate: every cap
    out = values.copy()
    too_far = np.arange(1, n_max + 1)[None, :] > RULE_CAP * n_star[:, None]  # (C, N_max)
    out[..., 1:][np.broadcast_to(too_far[:, None, :], out.shape[:3])] = np.nan
    return out
