"""The shared, vectorized Q estimator of every built-in agent.

It keeps running sums and sample counts per (context, prompt, N) and turns a batch of
pulls into samples with the paper's two kinds of reuse:

* cross-context: every pull is scored under every context at once;
* nested scales: a pull of N_i completions is a sample of every scale k <= N_i.

Two ways of reading a pull at scale k (``reuse``):

* ``"blocks"`` (the paper): floor(N_i / k) disjoint blocks of k completions, in draw order;
* ``"all_subsets"``: the average over all C(N_i, k) subsets of k completions (a
  U-statistic, the Rao-Blackwellization of the block estimate), weighted like the blocks
  (floor(N_i / k) samples). Best-of-N: with a pull's utilities sorted ascending,
  mean max = sum_i u_(i) C(i-1, k-1) / C(N_i, k). Majority vote: from the answer counts,
  ``vote_credit_series`` with binomial terms, divided by C(N_i, k).

Both are unbiased for Q(c, p, k) on the env's query distribution. Stockpiling is the
caller's choice: keep the estimator across rounds, or ``reset()`` it.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from agents.scoring import binomial_table, bon_subset_weights, mv_subset_credit, objective_scores
from iapo_gym import Policy, Pulls, base_env
from iapo_gym.utility import mv_credit

Reuse = Literal["blocks", "all_subsets"]
REUSE_MODES: tuple[Reuse, ...] = ("blocks", "all_subsets")


#: Estimates of at most this many (context, arm) cells are updated and read out whole (a few numpy
#: calls); larger ones only at the arms a batch touches or a mask keeps (the same values).
SMALL_CELLS = 1 << 16

#: (completion, context) cells of Best-of-N scores per chunk of ``Estimator._blocks_bon`` (cache-sized).
_BON_CHUNK_CELLS = 1 << 17

#: (context, arm) cells per chunk of the estimator's scatter into its (C, P, N_max) sums and counts.
_SCATTER_CELLS = 1 << 16

#: Cells per block of the uniform draws that ``draws_at`` makes (rows it needs) at a time.
_DRAW_BLOCK = 1 << 19


def skip_doubles(rng: np.random.Generator, n: int) -> None:
    """Move ``rng`` past ``n`` uniform doubles (where ``rng.random(n)`` leaves it) without making them.

    PCG64 jumps ahead (one 64-bit output per double; the buffered 32-bit half-word that
    ``advance`` would drop is kept); any other bit generator draws and discards them.
    """
    if n <= 0:
        return
    bits = rng.bit_generator
    if type(bits) is np.random.PCG64:
        saved = bits.state
        bits.advance(int(n))
        state = bits.state
        state["has_uint32"], state["uinteger"] = saved["has_uint32"], saved["uinteger"]
        bits.state = state
        return
    for start in range(0, n, _DRAW_BLOCK):
        rng.random(min(_DRAW_BLOCK, n - start))


def draws_at(rng: np.random.Generator, n_rows: int, width: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``rng.random((n_rows, width))[rows, cols]`` (``rows`` non-decreasing) without making the rows nobody reads.

    Rows with no asked cell are skipped in the generator's stream (``skip_doubles``); ``rng`` ends
    where the full draw leaves it.
    """
    out = np.empty(rows.size)
    wanted = np.zeros(n_rows, dtype=bool)
    wanted[rows] = True
    edges = np.flatnonzero(np.diff(np.r_[False, wanted, False].astype(np.int8)))  # runs of wanted rows
    bounds = np.searchsorted(rows, np.arange(n_rows + 1))
    per_draw = max(1, _DRAW_BLOCK // max(1, width))
    done = 0
    for run_start, run_end in zip(edges[::2], edges[1::2], strict=True):
        skip_doubles(rng, (run_start - done) * width)
        for s in range(run_start, run_end, per_draw):
            e = min(run_end, s + per_draw)
            block = rng.random((e - s, width))
            lo, hi = bounds[s], bounds[e]
            out[lo:hi] = block[rows[lo:hi] - s, cols[lo:hi]]
        done = run_end
    skip_doubles(rng, (n_rows - done) * width)
    return out


class Estimator:
    """Running estimates of Q(c, p, N) for every context, prompt and scale of one env.

    ``sums``/``counts`` are (C, P, N_max) arrays (index N-1); ``update`` adds a batch of
    pulls, ``mean`` reads the estimates, ``reset`` forgets everything (no stockpiling).
    """

    def __init__(self, env: Any, reuse: Reuse = "blocks") -> None:
        """Bind to ``env`` (an IAPOEnv or a wrapper) and pick the scale ``reuse`` mode."""
        if reuse not in REUSE_MODES:
            raise ValueError(f"reuse must be one of {REUSE_MODES}, got {reuse!r}")
        base = base_env(env, "Estimator needs")
        self.env = base
        self.reuse = reuse
        table = base.table
        self.aggregator = table.aggregator
        self.n_contexts, self.n_prompts, self.n_max = base.n_contexts, base.n_prompts, base.n_max
        self.n_atoms = table.n_atoms
        self._weights = table.context_weights  # (C, K+1): the scorer's weights, not the oracle
        self._cost = table.cost_matrix()  # (P, Q) per-completion cost
        self._binom = binomial_table(self.n_max)
        self._bon_w: dict[int, np.ndarray] = {}
        self._plans: dict[int, _SinglePlan] = {}  # per N: the block layout of one pull (fast path)
        shape = (self.n_contexts, self.n_prompts, self.n_max)
        self.sums = np.zeros(shape)
        self.counts = np.zeros(shape)

    # ---- state ------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every sample (a round without stockpiling)."""
        self.sums[...] = 0.0
        self.counts[...] = 0.0

    def mean(self, unseen: float = np.nan) -> np.ndarray:
        """Estimated Q (C, P, N_max); arms without samples get ``unseen``."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.counts > 0, self.sums / np.where(self.counts > 0, self.counts, 1.0), unseen)

    def mean_at(self, contexts: np.ndarray, arms: np.ndarray) -> np.ndarray:
        """``mean()[c, arm]`` for each (context, flat arm p * N_max + N - 1) pair, nan where unsampled.

        Reads only the asked arms (a PSST round trims the alive arms, not all C x P x N_max).
        """
        flat = contexts * (self.n_prompts * self.n_max) + arms
        counts = self.counts.reshape(-1)[flat]
        seen = counts > 0
        out = np.full(flat.shape, np.nan)
        out[seen] = self.sums.reshape(-1)[flat[seen]] / counts[seen]
        return out

    # ---- updates ----------------------------------------------------------------------
    def update(self, pulls: Pulls, *, scales: str | np.ndarray | None = None,
               arm_mask: np.ndarray | None = None, contexts: np.ndarray | None = None) -> None:
        """Add the samples of ``pulls`` at every scale k <= N of each pull.

        ``scales``: None (all k <= N), an array of scales, or ``"own"`` (only k = N: no
        nested reuse). ``arm_mask`` (P, N_max) restricts the updated arms. ``contexts``
        (one per pull) scores each pull under that context only (no cross-context reuse).
        """
        if len(pulls) == 0:
            return
        if (len(pulls) == 1 and scales is None and arm_mask is None and contexts is None and self.reuse == "blocks"
                and type(self).task_sums is Estimator.task_sums):
            self._update_single(pulls)
            return
        pull_idx, ks, n_samples, values = self.pair_samples(pulls, scales=scales, arm_mask=arm_mask)
        if pull_idx.size == 0:
            return
        arm = pulls.prompts[pull_idx] * self.n_max + (ks - 1)
        per_context = self.n_prompts * self.n_max
        size = self.n_contexts * per_context
        if contexts is None and len(pulls) == 1:  # one pull: its (p, k) arms are distinct
            self.sums.reshape(self.n_contexts, -1)[:, arm] += values
            self.counts.reshape(self.n_contexts, -1)[:, arm] += n_samples[None, :]
        elif contexts is None and self.sums.size <= SMALL_CELLS:
            flat = (np.arange(self.n_contexts)[:, None] * per_context + arm[None, :]).ravel()
            self.sums += np.bincount(flat, weights=values.ravel(), minlength=size).reshape(self.sums.shape)
            self.counts += np.bincount(arm, weights=n_samples, minlength=per_context).reshape(self.sums.shape[1:])[None]
        elif contexts is None:
            # Only the touched arms: per (context, arm) the pairs' values are summed from 0.0 in pair
            # order, as a bincount over every (context, arm) would, then added once (no pass over all
            # C x P x N_max). Pairs of one arm are folded in by their rank among that arm's pairs.
            touched, slot = np.unique(arm, return_inverse=True)
            slot = slot.reshape(-1)
            by_slot = np.argsort(slot, kind="stable")
            first = np.searchsorted(slot[by_slot], np.arange(touched.size))
            rank = np.empty_like(slot)
            rank[by_slot] = np.arange(slot.size) - first[slot[by_slot]]
            sums = self.sums.reshape(self.n_contexts, -1)
            counts = self.counts.reshape(self.n_contexts, -1)
            added_counts = np.bincount(slot, weights=n_samples, minlength=touched.size)
            step = max(1, _SCATTER_CELLS // max(1, slot.size))  # contexts per chunk: cache-sized work arrays
            if rank.max() == 0:  # every arm from one pair: 0.0 + value, as the bincount does
                for c0 in range(0, self.n_contexts, step):
                    rows = sums[c0 : c0 + step]
                    rows[:, arm] += values[c0 : c0 + step] + 0.0
                    rows = counts[c0 : c0 + step]
                    rows[:, touched] += added_counts[None, :]
            else:
                folds = [(slot[sel], sel) for sel in (np.flatnonzero(rank == r) for r in range(int(rank.max()) + 1))]
                for c0 in range(0, self.n_contexts, step):
                    chunk = values[c0 : c0 + step]
                    added = np.zeros((chunk.shape[0], touched.size))
                    for slots, sel in folds:  # at most one pair per arm in each fold
                        added[:, slots] += chunk[:, sel]
                    rows = sums[c0 : c0 + step]
                    rows[:, touched] += added
                    rows = counts[c0 : c0 + step]
                    rows[:, touched] += added_counts[None, :]
        else:
            ctx = np.asarray(contexts, dtype=np.int64).reshape(-1)
            if ctx.shape != pulls.prompts.shape:
                raise ValueError(f"contexts must have one entry per pull ({len(pulls)}), got {ctx.size}")
            c = ctx[pull_idx]
            flat = c * per_context + arm
            self.sums += np.bincount(flat, weights=values[c, np.arange(c.size)], minlength=size).reshape(self.sums.shape)
            self.counts += np.bincount(flat, weights=n_samples, minlength=size).reshape(self.sums.shape)

    def pair_samples(self, pulls: Pulls, *, scales: str | np.ndarray | None = None,
                     arm_mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per (pull, scale k) pair: (pull index, k, number of samples, summed utilities (C, pairs)).

        The number of samples is floor(N / k); the utilities are summed over the blocks
        (``"blocks"``) or are floor(N / k) times the all-subset mean (``"all_subsets"``).
        """
        ns = pulls.ns
        ks_all = np.arange(1, self.n_max + 1)
        ok = ks_all[None, :] <= ns[:, None]
        if isinstance(scales, str):
            if scales != "own":
                raise ValueError(f"scales must be None, an array of N or 'own', got {scales!r}")
            ok &= ks_all[None, :] == ns[:, None]
        elif scales is not None:
            wanted = np.zeros(self.n_max + 1, dtype=bool)
            wanted[np.asarray(scales, dtype=np.int64)] = True
            ok &= wanted[None, 1:]
        if arm_mask is not None:
            ok &= np.asarray(arm_mask, dtype=bool)[pulls.prompts]
        pull_idx, k_idx = np.nonzero(ok)
        ks = k_idx + 1
        n_blocks = ns[pull_idx] // ks
        if pull_idx.size == 0:
            return pull_idx, ks, n_blocks.astype(np.float64), np.zeros((self.n_contexts, 0))
        task = self.task_sums(pulls, pull_idx, ks, n_blocks)
        cost = self._cost[pulls.prompts[pull_idx], pulls.queries[pull_idx]] * ks * n_blocks
        if type(self).task_sums is not Estimator.task_sums:
            return pull_idx, ks, n_blocks.astype(np.float64), task + self._weights[:, -1:] * cost[None, :]
        step = max(1, _BON_CHUNK_CELLS // max(1, cost.size))  # our own fresh array: the cost added in place, by rows
        for c0 in range(0, self.n_contexts, step):
            task[c0 : c0 + step] += self._weights[c0 : c0 + step, -1:] * cost[None, :]
        return pull_idx, ks, n_blocks.astype(np.float64), task

    def task_sums(self, pulls: Pulls, pull_idx: np.ndarray, ks: np.ndarray, n_blocks: np.ndarray) -> np.ndarray:
        """(C, pairs) task utility (no cost) of each (pull, scale k) pair, summed over its floor(N / k) samples.

        The one place a pull's completions become samples: a subclass that reads pulls another
        way overrides this (the cost term and the bookkeeping stay in ``pair_samples``).
        """
        if self.reuse == "blocks":
            if self.aggregator == "mv":
                return self._blocks_mv(pulls, pull_idx, ks, n_blocks)
            return self._blocks_bon(pulls, pull_idx, ks, n_blocks)
        if self.aggregator == "mv":
            return self._subsets_mv(pulls, pull_idx, ks, n_blocks)
        return self._subsets_bon(pulls, pull_idx, ks, n_blocks)

    # ---- one pull, block reuse: the sequential agents' per-step path ---------------------
    def _plan(self, n: int) -> _SinglePlan:
        plan = self._plans.get(n)
        if plan is None:
            plan = self._plans[n] = _SinglePlan(n, self.n_atoms)
        return plan

    def _update_single(self, pulls: Pulls) -> None:
        """``update`` of one pull with block reuse at every scale (see ``update_one``)."""
        self.update_one(int(pulls.prompts[0]), int(pulls.ns[0]), int(pulls.queries[0]), pulls.atoms)

    def update_one(self, p: int, n: int, q: int, atoms: np.ndarray) -> None:
        """``update`` of one pull (prompt ``p``, ``n`` atoms on query ``q``) with block reuse at every scale.

        Computes exactly what the general path does (the same floating-point operations in
        the same order, so the sums are bit-identical) with a fixed handful of small array
        operations on a precomputed block layout: a pull of N touches the contiguous arms
        (p, 1..N) of every context. Needs ``reuse="blocks"`` and the base ``task_sums``.
        """
        if self.reuse != "blocks" or type(self).task_sums is not Estimator.task_sums:
            raise ValueError(f"update_one needs reuse='blocks' and the built-in task_sums, got {self.reuse!r}")
        plan = self._plan(n)
        cost = self._cost[p, q] * plan.ks * plan.n_blocks
        if self.aggregator == "mv":
            # (M, blocks) votes (exact small integers); blocks along the fast axis throughout
            counts = plan.one_hot.take(atoms, axis=1) @ plan.member_t
            top = np.maximum.reduce(counts, axis=0)
            ties = np.add.reduce(counts == top, axis=0)
            gold = self.env.table.gold
            assert gold is not None
            credit = (counts[int(gold[q])] == top) / ties  # = where(winner, 1.0 / ties, 0.0), bit for bit
            pair_credit = np.bincount(plan.block_pair, weights=credit, minlength=n)
            self.sums[:, p, :n] += self._weights[:, :1] * pair_credit[None, :] + self._weights[:, -1:] * cost[None, :]
        else:
            table_atoms = self.env.table.atoms
            assert table_atoms is not None
            # The sparse table of _blocks_bon, flattened and transposed: (entries, C).
            levels = np.empty((plan.table_size, self.n_contexts))
            levels[:n] = objective_scores(self._weights, table_atoms[p, q, atoms]).T  # as in _scores
            for src, width, half, dst in plan.levels:
                np.maximum(levels[src:src + width], levels[src + half:src + half + width], out=levels[dst:dst + width])
            block_max = np.maximum(levels.take(plan.first, axis=0), levels.take(plan.last, axis=0))
            task = np.add.reduceat(block_max, plan.pair_start, axis=0)  # (n, C), summed as in _blocks_bon
            self.sums[:, p, :n] += (task + cost[:, None] * self._weights[None, :, -1]).T
        self.counts[:, p, :n] += plan.samples

    # ---- the four kernels: task reward only, summed over each pair's samples ------------
    def _block_starts(self, pulls: Pulls, pull_idx: np.ndarray, ks: np.ndarray,
                      n_blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pair of each block, first completion of each block) in the pulls' atom array."""
        block_pair = np.repeat(np.arange(pull_idx.size), n_blocks)
        first = np.arange(block_pair.size) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)
        return block_pair, pulls.offsets[pull_idx[block_pair]] + first * ks[block_pair]

    def _blocks_mv(self, pulls: Pulls, pull_idx: np.ndarray, ks: np.ndarray, n_blocks: np.ndarray) -> np.ndarray:
        block_pair, start = self._block_starts(pulls, pull_idx, ks, n_blocks)
        total = pulls.atoms.size
        cum = np.zeros((total + 1, self.n_atoms), dtype=np.int32)
        cum[np.arange(1, total + 1), pulls.atoms] = 1
        np.cumsum(cum, axis=0, out=cum)
        counts = cum[start + ks[block_pair]] - cum[start]
        gold = self.env.table.gold
        assert gold is not None
        credit = mv_credit(counts, gold[pulls.queries[pull_idx[block_pair]]])
        pair_credit = np.bincount(block_pair, weights=credit, minlength=pull_idx.size)
        return self._weights[:, :1] * pair_credit[None, :]

    def _scores(self, pulls: Pulls) -> np.ndarray:
        """(C, total completions) weighted objective score of every completion (no cost)."""
        atoms = self.env.table.atoms
        assert atoms is not None
        rep = np.repeat(np.arange(len(pulls)), pulls.ns)
        vectors = atoms[pulls.prompts[rep], pulls.queries[rep], pulls.atoms]  # (total, K)
        return objective_scores(self._weights, vectors)

    def _blocks_bon(self, pulls: Pulls, pull_idx: np.ndarray, ks: np.ndarray, n_blocks: np.ndarray) -> np.ndarray:
        out = np.empty((self.n_contexts, pull_idx.size))
        # Pulls a few at a time (pairs are in pull order), so the work arrays stay cache-sized
        # whatever C and the batch: each pull's pairs only read that pull's completions.
        per_chunk = max(1, _BON_CHUNK_CELLS // max(1, self.n_contexts))
        ends = pulls.offsets[1:]
        first_pull = 0
        n_pulls = len(pulls)
        while first_pull < n_pulls:
            last_pull = int(np.searchsorted(ends, pulls.offsets[first_pull] + per_chunk, side="right"))
            last_pull = max(last_pull, first_pull + 1)  # at least one pull per chunk
            lo, hi = np.searchsorted(pull_idx, [first_pull, last_pull])
            if hi > lo:
                out[:, lo:hi] = self._blocks_bon_chunk(pulls, first_pull, last_pull, pull_idx[lo:hi], ks[lo:hi],
                                                    n_blocks[lo:hi]).T
            first_pull = last_pull
        return out

    def _blocks_bon_chunk(self, pulls: Pulls, first_pull: int, last_pull: int, pull_idx: np.ndarray, ks: np.ndarray,
                          n_blocks: np.ndarray) -> np.ndarray:
        """(pairs, C) block sums of the pairs of pulls first_pull..last_pull - 1 (``_blocks_bon``'s work)."""
        base = int(pulls.offsets[first_pull])
        block_pair, start = self._block_starts(pulls, pull_idx, ks, n_blocks)
        start = start - base
        atoms = self.env.table.atoms
        assert atoms is not None
        chunk = np.arange(first_pull, last_pull)
        rep = np.repeat(chunk, pulls.ns[chunk])
        # (completions, C): a completion's scores under every context are contiguous, so the gathers
        # below move whole rows (the values are those of ``_scores``, transposed).
        vectors = atoms[pulls.prompts[rep], pulls.queries[rep], pulls.atoms[base : base + rep.size]]
        table = objective_scores(self._weights, vectors, transposed=True)
        # Sparse table for range maxima: level l holds max over windows of 2^l completions.
        k_block = ks[block_pair]
        level = np.floor(np.log2(k_block)).astype(np.int64)
        block_max = np.empty((block_pair.size, self.n_contexts))
        for lev in range(int(level.max()) + 1):
            if lev:
                half = 1 << (lev - 1)
                table = np.maximum(table[:-half], table[half:])
            sel = np.flatnonzero(level == lev)
            if sel.size:
                s = start[sel]
                e = s + k_block[sel] - (1 << lev)
                block_max[sel] = np.maximum(table.take(s, axis=0), table.take(e, axis=0))
        pair_start = np.cumsum(n_blocks) - n_blocks
        return np.add.reduceat(block_max, pair_start, axis=0)

    def _subsets_bon(self, pulls: Pulls, pull_idx: np.ndarray, ks: np.ndarray, n_blocks: np.ndarray) -> np.ndarray:
        scores = self._scores(pulls)
        ustat = np.empty((self.n_contexts, pull_idx.size))
        for n in np.unique(pulls.ns[pull_idx]):
            sel = np.flatnonzero(pulls.ns[pull_idx] == n)
            if n not in self._bon_w:
                self._bon_w[int(n)] = bon_subset_weights(int(n), self._binom)
            used, row = np.unique(pull_idx[sel], return_inverse=True)  # sort each pull once, for all its k
            ordered = np.sort(scores[:, pulls.offsets[used][:, None] + np.arange(n)[None, :]], axis=2)
            every_k = ordered @ self._bon_w[int(n)]  # (C, pulls, k = 1..n)
            ustat[:, sel] = every_k[:, row, ks[sel] - 1]
        return ustat * n_blocks[None, :]

    def _subsets_mv(self, pulls: Pulls, pull_idx: np.ndarray, ks: np.ndarray, n_blocks: np.ndarray) -> np.ndarray:
        gold = self.env.table.gold
        assert gold is not None
        used = np.unique(pull_idx)
        counts = pulls.counts(self.n_atoms)[used]
        k_max = int(ks.max())
        credit = mv_subset_credit(counts, gold[pulls.queries[used]], k_max)  # (used, k_max)
        row = np.searchsorted(used, pull_idx)
        return self._weights[:, :1] * (credit[row, ks - 1] * n_blocks)[None, :]

    # ---- reading out a policy -----------------------------------------------------------
    def best_arms(self, rng: np.random.Generator, mask: np.ndarray | None = None) -> Policy:
        """Per context, the arm of highest estimate among ``mask`` (C, P, N_max) arms with samples.

        Ties are broken at random; a context with no sampled arm in its mask gets a
        uniformly random arm of the mask (of all arms if the mask is empty).
        """
        n_c = self.n_contexts
        mask = np.ones((n_c, self.sums[0].size), dtype=bool) if mask is None else np.asarray(mask, bool).reshape(n_c, -1)
        if type(self).mean is Estimator.mean and mask.size > SMALL_CELLS:
            return self._best_masked(rng, mask)
        means = self.mean(unseen=-np.inf).reshape(n_c, -1)
        noise = rng.random(self.sums.shape).reshape(n_c, -1)
        seen = mask & (self.counts.reshape(n_c, -1) > 0)  # every context at once, row by row
        any_seen = seen.any(axis=1, keepdims=True)
        pool = np.where(any_seen, seen, mask | ~mask.any(axis=1, keepdims=True))
        score = np.where(pool, np.where(any_seen, means, 0.0), -np.inf)
        ties = pool & (score == score.max(axis=1, keepdims=True))
        flat = np.argmax(np.where(ties, noise, -1.0), axis=1).tolist()
        return Policy(tuple((f // self.n_max, f % self.n_max + 1) for f in flat))

    def _best_masked(self, rng: np.random.Generator, mask: np.ndarray) -> Policy:
        """``best_arms`` reading only the arms in each context's pool (its mask, or every arm if empty).

        The same rule and the same draws: the (C, P x N_max) uniform draw is read only in contexts
        with a tie to break (``draws_at``), so results and ``rng``'s state are those of the full draw.
        """
        n_c, width = mask.shape
        empty = np.logical_not(np.any(mask, axis=1))
        rows, cols = np.nonzero(mask | empty[:, None])
        flat_arm = rows * width + cols
        counts = self.counts.reshape(-1)[flat_arm]
        seen = mask[rows, cols] & (counts > 0)
        any_seen = np.bincount(rows, weights=seen, minlength=n_c) > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            means = np.where(counts > 0, self.sums.reshape(-1)[flat_arm] / np.where(counts > 0, counts, 1.0), -np.inf)
        pool = np.where(any_seen[rows], seen, True)
        score = np.where(pool, np.where(any_seen[rows], means, 0.0), -np.inf)
        starts = np.searchsorted(rows, np.arange(n_c))
        top = np.maximum.reduceat(score, starts)  # every row has at least one entry
        ties = pool & (score == top[rows])
        n_ties = np.bincount(rows, weights=ties, minlength=n_c)
        drawn = ties & (n_ties[rows] > 1)
        noise = np.full(rows.size, -1.0)
        noise[drawn] = draws_at(rng, n_c, width, rows[drawn], cols[drawn])
        noise[ties & ~drawn] = 0.0  # a context's only tie
        first = np.lexsort((np.arange(rows.size), -noise, rows))  # per row: highest noise, then lowest index
        best = first[starts]
        return Policy(tuple((int(c) // self.n_max, int(c) % self.n_max + 1) for c in cols[best]))


class _SinglePlan:
    """The block layout of one pull of ``n`` completions at every scale k = 1..n (blocks reuse).

    Blocks are ordered as in the general path: by k, then by position. ``member_t`` (n,
    blocks) marks each block's completions (majority vote); ``levels``/``first``/``last`` index
    a flattened sparse table of range maxima (Best-of-N).
    """

    def __init__(self, n: int, n_atoms: int) -> None:
        self.ks = np.arange(1, n + 1)
        self.n_blocks = n // self.ks
        self.samples = self.n_blocks.astype(np.float64)
        self.block_pair = np.repeat(np.arange(n), self.n_blocks)
        k_block = self.ks[self.block_pair]
        self.pair_start = np.cumsum(self.n_blocks) - self.n_blocks
        start = (np.arange(self.block_pair.size) - self.pair_start[self.block_pair]) * k_block
        self.member_t = ((np.arange(n)[:, None] >= start[None, :])
                         & (np.arange(n)[:, None] < (start + k_block)[None, :])).astype(np.float64)
        self.one_hot = np.eye(n_atoms)
        # Sparse table: level l (window 2^l) has n - 2^l + 1 entries, stored after level l - 1.
        n_levels = int(np.floor(np.log2(n))) + 1
        offsets = [0]
        self.levels: list[tuple[int, int, int, int]] = []
        for lev in range(1, n_levels):
            half = 1 << (lev - 1)
            width = n - (1 << lev) + 1
            prev_width = n - half + 1
            offsets.append(offsets[-1] + prev_width)
            self.levels.append((offsets[lev - 1], width, half, offsets[lev]))
        self.table_size = offsets[-1] + n - (1 << (n_levels - 1)) + 1
        level = np.floor(np.log2(k_block)).astype(np.int64)
        base = np.asarray(offsets, dtype=np.int64)[level]
        self.first = base + start
        self.last = base + start + k_block - (1 << level)
