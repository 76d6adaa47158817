"""PSST's paths for many contexts and arms change speed, not results.

Above ``SMALL_CELLS`` (context, arm) cells, ``trim`` (a partition and draws read only where a
tie needs them), ``Estimator.best_arms`` (only the masked arms) and the batch update (only the
touched arms) take paths that touch only what they need; Best-of-N blocks are scored a few pulls
at a time. Each is checked bit for bit against the whole-array formulas, kept here verbatim as
references (the large paths forced on small inputs), and the halving agents against policies
frozen from the implementation before these paths, on both paths.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import agents
import agents.estimator as estimator_module
import agents.psst as psst_module
from agents.estimator import Estimator, draws_at, skip_doubles
from agents.psst import trim
from benchmarks.bench_scale import build
from iapo_gym import IAPOEnv
from tests.conftest import tiny_bon_table, tiny_mv_table


def reference_trim(alive: np.ndarray, means: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``trim`` before its partition path: one lexsort of every (row, arm)."""
    n_alive = alive.sum(axis=1)
    keep = np.where(n_alive > 1, np.maximum(1, n_alive // 2), n_alive)
    seen = np.isfinite(means)
    group = np.where(alive, np.where(seen, 0, 1), 2)
    value = np.where(alive & seen, -np.nan_to_num(means, neginf=0.0, posinf=0.0), 0.0)
    order = np.lexsort((rng.random(alive.shape), value, group), axis=-1)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(alive.shape[1])[None, :].repeat(alive.shape[0], 0), axis=1)
    return alive & (rank < keep[:, None])


def reference_best_arms(est: Estimator, rng: np.random.Generator, mask: np.ndarray | None) -> tuple:
    """``Estimator.best_arms`` before its masked path: every arm of every context."""
    n_c = est.n_contexts
    mask = np.ones((n_c, est.sums[0].size), dtype=bool) if mask is None else np.asarray(mask, bool).reshape(n_c, -1)
    means = est.mean(unseen=-np.inf).reshape(n_c, -1)
    noise = rng.random(est.sums.shape).reshape(n_c, -1)
    seen = mask & (est.counts.reshape(n_c, -1) > 0)
    any_seen = seen.any(axis=1, keepdims=True)
    pool = np.where(any_seen, seen, mask | ~mask.any(axis=1, keepdims=True))
    score = np.where(pool, np.where(any_seen, means, 0.0), -np.inf)
    ties = pool & (score == score.max(axis=1, keepdims=True))
    flat = np.argmax(np.where(ties, noise, -1.0), axis=1).tolist()
    return tuple((f // est.n_max, f % est.n_max + 1) for f in flat)


def reference_update(est: Estimator, pulls, arm_mask: np.ndarray | None) -> None:
    """The batch update before its touched-arms path: a bincount over every (context, arm), and the
    Best-of-N block maxima of a sparse table over every completion's (C, total) scores."""
    def blocks_bon(pulls, pull_idx, ks, n_blocks):
        block_pair, start = est._block_starts(pulls, pull_idx, ks, n_blocks)
        scores = est._scores(pulls)
        k_block = ks[block_pair]
        level = np.floor(np.log2(k_block)).astype(np.int64)
        block_max = np.empty((est.n_contexts, block_pair.size))
        table = scores
        for lev in range(int(level.max()) + 1):
            if lev:
                half = 1 << (lev - 1)
                table = np.maximum(table[:, :-half], table[:, half:])
            sel = np.flatnonzero(level == lev)
            if sel.size:
                s = start[sel]
                e = s + k_block[sel] - (1 << lev)
                block_max[:, sel] = np.maximum(table[:, s], table[:, e])
        return np.add.reduceat(block_max, np.cumsum(n_blocks) - n_blocks, axis=1)

    ns = pulls.ns
    ks_all = np.arange(1, est.n_max + 1)
    ok = ks_all[None, :] <= ns[:, None]
    if arm_mask is not None:
        ok &= arm_mask[pulls.prompts]
    pull_idx, k_idx = np.nonzero(ok)
    ks = k_idx + 1
    n_blocks = ns[pull_idx] // ks
    task = blocks_bon(pulls, pull_idx, ks, n_blocks) if est.aggregator == "bon" else \
        est.task_sums(pulls, pull_idx, ks, n_blocks)
    cost = est._cost[pulls.prompts[pull_idx], pulls.queries[pull_idx]] * ks * n_blocks
    values = task + est._weights[:, -1:] * cost[None, :]
    arm = pulls.prompts[pull_idx] * est.n_max + (ks - 1)
    per_context = est.n_prompts * est.n_max
    flat = (np.arange(est.n_contexts)[:, None] * per_context + arm[None, :]).ravel()
    est.sums += np.bincount(flat, weights=values.ravel(), minlength=est.n_contexts * per_context).reshape(est.sums.shape)
    est.counts += np.bincount(arm, weights=n_blocks.astype(np.float64), minlength=per_context).reshape(
        est.sums.shape[1:])[None]


def bits(a: np.ndarray) -> np.ndarray:
    """The float64 array's bit patterns (so -0.0 and 0.0 differ)."""
    return np.ascontiguousarray(a, dtype=np.float64).view(np.int64)


def force_alive_only_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every array "large": the partition trim, the masked best_arms, the touched-arms update."""
    monkeypatch.setattr(psst_module, "SORT_CELLS", 0)
    monkeypatch.setattr(estimator_module, "SMALL_CELLS", 0)


@pytest.mark.parametrize("seed", range(60))
def test_trim_is_the_lexsort_rule_bit_for_bit(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    force_alive_only_paths(monkeypatch)
    g = np.random.default_rng(seed)
    n_rows, width = int(g.integers(1, 25)), int(g.integers(1, 150))
    alive = g.random((n_rows, width)) < g.choice([0.02, 0.3, 0.9, 1.0])
    means = g.integers(-3, 4, size=(n_rows, width)) / float(g.choice([1, 7]))  # many equal means
    means[g.random((n_rows, width)) < g.random()] = np.nan  # unsampled arms
    means[g.random((n_rows, width)) < 0.05] = -np.inf
    means[means == 0] = -0.0 if seed % 2 else 0.0
    if seed % 3 == 0:
        monkeypatch.setattr(psst_module, "_TRIM_BLOCK", int(g.integers(1, 400)))  # rows in several blocks
    ours, theirs = np.random.default_rng(seed + 1), np.random.default_rng(seed + 1)
    if seed % 4 == 1:  # a buffered 32-bit half-word in the generator must survive the skips
        ours.integers(0, 10, dtype=np.int32)
        theirs.integers(0, 10, dtype=np.int32)
    assert np.array_equal(trim(alive, means, ours), reference_trim(alive, means, theirs))
    assert ours.integers(0, 1000, size=4, dtype=np.int32).tolist() == theirs.integers(0, 1000, size=4, dtype=np.int32).tolist()
    assert ours.random() == theirs.random()


@pytest.mark.parametrize("bit_generator", [np.random.PCG64, np.random.MT19937])
def test_skipped_and_partial_draws_leave_the_generator_where_full_draws_do(bit_generator) -> None:
    full, ours = np.random.Generator(bit_generator(7)), np.random.Generator(bit_generator(7))
    full.integers(0, 5, dtype=np.int32)
    ours.integers(0, 5, dtype=np.int32)
    drawn = full.random((9, 13))
    rows = np.array([0, 0, 3, 3, 3, 7])
    cols = np.array([1, 12, 0, 5, 6, 2])
    assert np.array_equal(draws_at(ours, 9, 13, rows, cols), drawn[rows, cols])
    full.random(1000)
    skip_doubles(ours, 1000)
    assert ours.integers(0, 100, size=5, dtype=np.int32).tolist() == full.integers(0, 100, size=5, dtype=np.int32).tolist()
    assert ours.random() == full.random()


@pytest.mark.parametrize("seed", range(40))
def test_best_arms_is_the_full_rule_bit_for_bit(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    force_alive_only_paths(monkeypatch)
    g = np.random.default_rng(seed)
    env = IAPOEnv(table=tiny_bon_table(seed=seed % 7, n_prompts=4, n_max=8))
    env.reset(seed=seed)
    est = Estimator(env)
    for _ in range(int(g.integers(0, 4))):
        n = int(g.integers(1, 6))
        est.update(env.pull(g.integers(env.n_prompts, size=n), g.integers(1, env.n_max + 1, size=n)))
    if seed % 4 == 0:
        est.sums = np.round(est.sums)  # exact ties between estimates
    mask = None if seed % 5 == 0 else g.random(est.sums.shape) < g.choice([0.05, 0.3, 1.0])
    ours, theirs = np.random.default_rng(seed), np.random.default_rng(seed)
    assert est.best_arms(ours, mask).arms == reference_best_arms(est, theirs, mask)
    assert ours.random() == theirs.random()


@pytest.mark.parametrize("kind", ["mv", "bon"])
@pytest.mark.parametrize("reuse", ["blocks", "all_subsets"])
def test_batch_update_is_the_bincount_update_bit_for_bit(kind: str, reuse: str, monkeypatch: pytest.MonkeyPatch) -> None:
    force_alive_only_paths(monkeypatch)
    make = tiny_bon_table if kind == "bon" else tiny_mv_table
    env = IAPOEnv(table=make(seed=4, n_prompts=5, n_max=64))
    env.reset(seed=4)
    ours, theirs = Estimator(env, reuse), Estimator(env, reuse)
    rng = np.random.default_rng(4)
    for step in range(10):
        if step == 5:  # pulls split across many chunks and context blocks
            monkeypatch.setattr(estimator_module, "_BON_CHUNK_CELLS", 7)
            monkeypatch.setattr(estimator_module, "_SCATTER_CELLS", 3)
        n = int(rng.integers(2, 30))
        pulls = env.pull(rng.integers(env.n_prompts, size=n), rng.integers(1, env.n_max + 1, size=n))
        mask = rng.random((env.n_prompts, env.n_max)) < 0.7 if step % 2 else None
        ours.update(pulls, arm_mask=mask)
        if reuse == "blocks":
            reference_update(theirs, pulls, mask)
        else:  # the all-subset kernels are unchanged: the reference is their bincount update
            pull_idx, ks, n_samples, values = theirs.pair_samples(pulls, arm_mask=mask)
            arm = pulls.prompts[pull_idx] * theirs.n_max + (ks - 1)
            size = theirs.n_prompts * theirs.n_max
            flat = (np.arange(theirs.n_contexts)[:, None] * size + arm[None, :]).ravel()
            theirs.sums += np.bincount(flat, weights=values.ravel(), minlength=theirs.n_contexts * size).reshape(
                theirs.sums.shape)
            theirs.counts += np.bincount(arm, weights=n_samples, minlength=size).reshape(theirs.sums.shape[1:])[None]
    assert ours.counts.sum() > 0
    assert np.array_equal(bits(ours.sums), bits(theirs.sums))
    assert np.array_equal(bits(ours.counts), bits(theirs.counts))


# (agent, seed, budget) -> (sha256 of the policy's arms, 16 digits; env.np_random.random() after training),
# frozen from the implementation before these paths on the 24-prompt, 30-context grid table below
# (plugin_halving's from agents/plugin, whose estimator reads Best-of-N per query as auto's does: its location-scale reading
# with the unbiased correction).
FROZEN = {
    ("psst", 0, 3000): ("1c0c101b7e397cac", 0.483909408772),
    ("psst", 1, 20000): ("75fbff43951d62d8", 0.485369729299),
    ("psst_topk", 1, 20000): ("ab9f3477167b8ccb", 0.728517449391),
    ("triple_random_n", 1, 20000): ("9219599f149077e0", 0.904109662439),
    ("sequential_halving", 1, 20000): ("1b52974fda3338e1", 0.140766760948),
    ("plugin_halving", 1, 20000): ("fe58d640bd546c9d", 0.605768322946),
}


@pytest.mark.parametrize("alive_only", [False, True])
@pytest.mark.parametrize("key", sorted(FROZEN))
def test_halving_agents_match_frozen_policies(key: tuple[str, int, int], alive_only: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if alive_only:
        force_alive_only_paths(monkeypatch)
    name, seed, budget = key
    env = IAPOEnv(table=build(24, 30, 40, 16))
    env.reset(seed=seed)
    policy = agents.make(name, seed=seed).train(env, budget)
    digest = hashlib.sha256(repr(tuple(policy.arms)).encode()).hexdigest()[:16]
    assert (digest, round(float(env.np_random.random()), 12)) == FROZEN[key]
