"""Synthetic task families: determinism, caching, and the archetypes behaving as the paper says."""

from __future__ import annotations

import numpy as np
import pytest

from iapo_gym.data import load_synthetic, synthetic_cache_path
from iapo_gym.oracle import q_table
from iapo_gym.tasks.synthetic import synthetic_bernoulli, synthetic_categorical


@pytest.mark.parametrize("generator", [synthetic_bernoulli, synthetic_categorical])
def test_instances_are_deterministic_and_distinct(generator) -> None:
    a, b, c = generator(4), generator(4), generator(5)
    assert np.array_equal(a.probs, b.probs) and np.array_equal(a.cost, b.cost)
    assert not np.array_equal(a.probs, c.probs)


def test_paper_shapes() -> None:
    sb, sc = synthetic_bernoulli(0), synthetic_categorical(0)
    assert (sb.n_prompts, sb.n_queries, sb.n_max, sb.n_contexts) == (32, 520, 32, 3)
    assert (sc.n_prompts, sc.n_queries, sc.n_max, sc.n_contexts) == (32, 512, 32, 27)
    tiers = [q.rsplit("-", 1)[1] for q in sb.queries]
    assert [tiers.count(t) for t in ("easy", "medium", "hard")] == [240, 160, 120]
    assert set(np.unique(sc.atoms)) == set(range(-4, 5))
    assert np.all((sc.cost >= 0.02) & (sc.cost <= 0.1))


def test_cache_round_trip() -> None:
    table = load_synthetic("synthetic_bernoulli", 2)
    assert synthetic_cache_path("synthetic_bernoulli", 2).is_file()
    again = load_synthetic("synthetic_bernoulli", 2)
    assert np.array_equal(table.probs, again.probs) and table.split is not None
    assert np.array_equal(table.split, again.split)


@pytest.mark.parametrize("instance", [0, 1, 2])
def test_deceiving_prompts_win_single_shot_but_not_large_n(instance: int) -> None:
    table = synthetic_bernoulli(instance)
    q = q_table(table, table.split_indices("train"))
    deceiving = np.array(["deceiving" in p for p in table.prompts])
    low = 0  # cost weight 0
    best_n1 = int(np.argmax(q[low, :, 0]))
    assert deceiving[best_n1], "a deceiving prompt is best at N = 1"
    assert q[low, best_n1, 30] < q[low, ~deceiving, 30].max(), "an all-rounder beats it at N = 31"
    assert not deceiving[int(np.argmax(q[low, :, 30]))]


@pytest.mark.parametrize("instance", [0, 1])
def test_hmlv_wins_at_one_lmhv_at_large_n(instance: int) -> None:
    table = synthetic_categorical(instance)
    q = q_table(table, table.split_indices("train"))
    hmlv = np.array(["HMLV" in p for p in table.prompts])
    cheap = [c for c, w in enumerate(table.context_weights) if w[-1] == -0.1]
    for c in cheap:
        assert hmlv[int(np.argmax(q[c, :, 0]))], table.context_names[c]
        assert not hmlv[int(np.argmax(q[c, :, 31]))], table.context_names[c]


def test_random_mv_table_has_the_shape_asked_for_and_refuses_bad_shapes() -> None:
    from iapo_gym.tasks.synthetic import random_mv_table

    table = random_mv_table(4, n_prompts=48, n_queries=1500, n_answers=5, n_max=32)
    assert table.probs.shape == (48, 1500, 5) and table.n_max == 32
    assert np.allclose(table.probs.sum(axis=2), 1.0) and (table.probs > 0).all()
    assert table.split.sum() == 300 and set(np.unique(table.gold)) == set(range(5))
    assert np.array_equal(random_mv_table(4, 48, 1500, 5, 32).probs, table.probs)  # seeded
    with pytest.raises(ValueError, match="n_answers >= 2"):
        random_mv_table(0, n_answers=1)
