"""The generated families of tasks.families_mv and tasks.families_bon: pinned digests, valid tables in their stated
ranges, exact oracle = Monte Carlo, each family's stated property on its levels, redraws, and every entry point."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import scipy
from scipy.stats import spearmanr

import iapo_gym
from iapo_gym.cli import main
from iapo_gym.exact import mv_expected_credit
from iapo_gym.leaderboard.run.specs import resolve_task, table_checksum
from iapo_gym.oracle import exact_acr, monte_carlo_acr, q_table
from iapo_gym.tables import OutcomeTable, read_table, validate
from iapo_gym.tasks.draws import TRAIN_FRACTION
from iapo_gym.tasks.generated import families, level_params, level_table, redraw_table
from tests.conftest import uses_avx512_kernels

SIX = ("mv_categorical", "mv_binary", "math_like", "bon_shift", "bon_shape", "bon_flat")
NEW = ("mv_distractor", "mv_specialist", "mv_models", "mv_many_queries", "mv_few_queries",
       "bon_multi", "bon_mixture", "bon_large_n")
#: table_checksum of level 1,000,003 of every family: any change to a generator shows here (then bump
#: GENERATOR_VERSION). The first six are the digests before the new families were added. Recorded where numpy computes
#: float64 exp and log with its AVX-512 kernels (its X86_V4 dispatch: ``uses_avx512_kernels``).
DIGESTS_AVX512 = {
    "mv_categorical": "f8d872a950add384f17e3d1bd84359d90d95122974a2cdf6e6dede4c5c4f8640",
    "mv_binary": "41ec09752546b702f322e21cb628837da0c80f410d828e0b85438863b0945e66",
    "math_like": "fb83f28ac40873abc8b56c625851a5c6d2e46a5632ef16282005b82881a2073e",
    "bon_shift": "7c3e7e3cf1a1b5aa83257a22028920206fe3a8ff6ba66792eee26eb8769f6ea4",
    "bon_shape": "901aeb6f790c542e2980ea86dcc65b2e2fcba4c8b4aa1db73d46a13d8ee36359",
    "bon_flat": "168582c5b283c74d50450fb6bbd4eeaac1c04c7b121548246af0e57cc2154dee",
    "mv_distractor": "45f756d94a6a69d5c5ba5db0a162614a3a9d71fc8ad5cafe7c84a396448f841d",
    "mv_specialist": "2254ab3805f4387544f1193d7a28e941088d76c7c2b3b87e17666d3c90033686",
    "mv_models": "255c5c6501db16e73af7ee88960245ae94994f01733697325a6d41a3feb26b43",
    "mv_many_queries": "4321f3f7e948bca8801d98104b3069ba0f6790c85d98ec97a8e9c41d9c8ebf6a",
    "mv_few_queries": "9869a922cf0ae1c0dd6bcb5814d7ab54549d384f0090c9f47be9451406946d47",
    "bon_multi": "7d4d9cd93acc986bdcf1f34c8cea76a9c4c820bff7d369953a68bc7a4f17ce80",
    "bon_mixture": "023bf90410c78598625b2384b0699ca5403d4f74063ecab876af70f3ce06bd83",
    "bon_large_n": "57860bc6c2d5185aef7467c01332c0d6de7c7775156f8609b986aa51df1c073a",
}
#: The same digests where numpy computes them with the C library's exp and log (no AVX-512 kernels).
DIGESTS_LIBM = {
    "mv_categorical": "310802fba72a87def9bc2e49e88ae2e2100e386b8a266176abde0e0a9cbfaf88",
    "mv_binary": "41ec09752546b702f322e21cb628837da0c80f410d828e0b85438863b0945e66",
    "math_like": "872ac678ce17b27a01c1b15d091ebc1678bf5bebc62dd937ec1d3fa0fd89914b",
    "bon_shift": "963d4b1b8091c3a7442a60e98ae11990578368d32692f409dbecfa73ca828575",
    "bon_shape": "492eacece3383cbfa02eeec33dc783246be0c8d49ff7113f5d22f7e30ac6d9df",
    "bon_flat": "35969d76e0fd44e599467981e1d2da0591fea000acc409587dd8844bb5e4fff0",
    "mv_distractor": "52ea96bf49257b5022c657d2a3119b7c764a4b81faba93fadcc4f050e968df06",
    "mv_specialist": "042b9a20533c37d3d0af96808c0a359b0e418e9c816de17c87fe2fc68a3292c4",
    "mv_models": "c2af1bd4ca32ada1188c26ac0f8da3bd2fa4c68b625b4c8915f6f26e4053d50b",
    "mv_many_queries": "25ed07facdfae1efce96e0c2cb8637569a97e0586971395c2a864519d5414493",
    "mv_few_queries": "ec493fb1507d8a248f15fdeb819ee08799384acf6211585511bf3308183870ec",
    "bon_multi": "7d4d9cd93acc986bdcf1f34c8cea76a9c4c820bff7d369953a68bc7a4f17ce80",
    "bon_mixture": "502534f9593bc776001f681cae270bb00ee96babf5e8e574aecd43d624ef512d",
    "bon_large_n": "ba9810b9505d7c857d12204853b0dea612d2ec9da3bd0970358fc45855122bc0",
}
SAMPLE_LEVELS = (0, 1, 2, 9_999, 1_000_000, 1_000_001)
PROPERTY_LEVELS = range(12)
ANSWERS = {"mv_distractor": (3, 10), "mv_specialist": (2, 6), "mv_models": (2, 6), "mv_many_queries": (2, 4),
           "mv_few_queries": (2, 10)}


def test_every_family_is_registered_after_the_first_six() -> None:
    assert families() == SIX + NEW


#: numpy and scipy (major, minor) the digests were recorded with. Another release's math library may round a
#: probability's last bit differently (numpy 2.2 and scipy 1.15, on Python 3.10, do on bon_shape and bon_large_n:
#: 4e-16 at most), and so does numpy's AVX-512 exp and log against the C library's, which numpy calls on a CPU
#: without AVX-512 (12 of the 14 families differ): either changes the bytes a digest hashes. Each machine checks the
#: digests of its kind; on other releases the level is held to FINGERPRINTS alone.
DIGESTS_WITH = ("2.4", "1.17")
#: Sums of the level's probabilities, outcomes (atoms or gold answers), costs and context weights, each weighted by
#: a fixed uniform draw (``_fingerprint``), on level 1,000,003: equal to 1e-12 on every supported numpy and scipy.
FINGERPRINTS = {
    "mv_categorical": (703.0953629214878, 56.81546820455622, 1.2381202481806821, 2.3190431650660708),
    "mv_binary": (2173.7391200904967, 158.1140794402139, 40.524157859009286, 0.9962651136233214),
    "math_like": (3392.105466502088, 348.2275632619271, 20.539447722245104, 0.7860481187092277),
    "bon_shift": (173.98047882272854, 14262.062651787066, 0.17561678866313254, 5.158128601779695),
    "bon_shape": (4000.46867148468, 196557.33320449217, 14.118511232534281, 6.244446619771956),
    "bon_flat": (371.18451412989543, 23744.582054653947, 1.0169819196521401, 6.3891518776553715),
    "mv_distractor": (7003.691861433375, 182.87361348991675, 8.697026303349572, 1.1976089860798946),
    "mv_specialist": (6036.3707541707245, 150.94075494854752, 182.95584746783754, -0.10300346021468443),
    "mv_models": (640.3333591631531, 225.74876567672194, 1.9886993989914097, 1.0020835076858359),
    "mv_many_queries": (4889.633645208907, 755.6012755968912, 11.988913634092217, 0.7749492488749101),
    "mv_few_queries": (158.3298767693388, 5.036993866304833, 0.16970335706287576, 0.41045193974336935),
    "bon_multi": (2453.596130487202, 69205.79833882097, 32.88076677625983, 0.5974423026034563),
    "bon_mixture": (895.6401381953505, 6318.0195064896, 15.55614767482257, 0.10125579515722527),
    "bon_large_n": (2004.2273930011866, 11018.711510461999, 36.759120095577856, 0.5961000030010378),
}


def _fingerprint(table: OutcomeTable) -> list[float]:
    arrays = [table.probs, table.atoms if table.atoms is not None else table.gold, table.cost_matrix(),
              table.context_weights]
    rng = np.random.default_rng(20261128)
    return [float((np.asarray(a, dtype=np.float64) * rng.random(np.shape(a))).sum()) for a in arrays]


@pytest.mark.parametrize("family", SIX + NEW)
def test_a_level_keeps_its_pinned_digest(family: str) -> None:
    table = level_table(family, 1_000_003)
    assert _fingerprint(table) == pytest.approx(FINGERPRINTS[family], rel=1e-12, abs=1e-12)
    versions = tuple(".".join(v.split(".")[:2]) for v in (np.__version__, scipy.__version__))
    if versions == DIGESTS_WITH:
        assert table_checksum(table) == (DIGESTS_AVX512 if uses_avx512_kernels() else DIGESTS_LIBM)[family]


def _sizes_in_range(family: str, table: OutcomeTable) -> None:
    n_train = table.split_indices("train").size
    n_test = table.split_indices("test").size
    lows = {"mv_many_queries": (1200, 1600, 8, 32), "mv_few_queries": (10, 20, 8, 64), "bon_large_n": (20, 1000, 64, 128)}
    train_low, train_high, n_low, n_high = lows.get(family, (20, 1000, 8, 64))
    assert train_low <= n_train <= train_high and n_low <= table.n_max <= n_high, (family, n_train, table.n_max)
    assert n_test == max(5, round(n_train * (1 - TRAIN_FRACTION) / TRAIN_FRACTION))  # a quarter, at least 5
    if family == "mv_models":
        params = json.loads(table.attrs["params"])
        assert table.n_prompts == params["models"] * params["templates"] and 4 <= params["models"] <= 12
    else:
        assert 4 <= table.n_prompts <= 64


@pytest.mark.parametrize("family", NEW)
def test_sampled_levels_pass_the_validator_and_stay_in_the_stated_ranges(family: str) -> None:
    for level in SAMPLE_LEVELS:
        table = level_table(family, level)
        validate(table)
        _sizes_in_range(family, table)
        assert table.attrs["family"] == family and table.attrs["level"] == level
        assert json.loads(table.attrs["params"])["n_prompts"] == table.n_prompts
        if table.aggregator == "mv":
            low, high = ANSWERS[family]
            assert low <= table.n_atoms <= high
        else:
            assert table.atoms is not None and 0.0 <= table.atoms.min() and table.atoms.max() <= 1.0
        if family == "bon_multi":
            assert 4 <= table.n_objectives <= 6 and 8 <= table.n_atoms <= 24
            assert np.allclose(table.probs, 1.0 / table.n_atoms)
            bins = json.loads(table.attrs["params"])["bins"]
            assert np.allclose(table.atoms * (bins - 1), np.round(table.atoms * (bins - 1)))  # binned scores
        if family == "bon_mixture":
            assert table.n_objectives in (1, 2)


@pytest.mark.parametrize("family", NEW)
def test_exact_oracle_agrees_with_monte_carlo(family: str) -> None:
    table = level_table(family, 1_000_005)
    rng = np.random.default_rng(5)
    arms = [(int(rng.integers(table.n_prompts)), int(rng.integers(1, table.n_max + 1)))
            for _ in range(table.n_contexts)]
    test = table.split_indices("test")
    exact = exact_acr(table, arms, test)
    mc, se = monte_carlo_acr(table, arms, test, 20_000, np.random.default_rng(7))
    assert se > 0 and abs(mc - exact) <= 4.5 * se + 1e-9, (family, exact, mc, se)


def _best_prompts(table: OutcomeTable) -> tuple[int, int]:
    """The best prompt at N = 1 and at N_max in the first context on the train split, costs left out."""
    q = q_table(table, table.split_indices("train"))[0]
    return int(np.argmax(q[:, 0])), int(np.argmax(q[:, -1]))


def test_mixture_safe_prompts_win_at_one_and_risky_ones_at_large_n() -> None:
    reversed_, riskier = 0, 0
    for level in PROPERTY_LEVELS:
        table = level_table("bon_mixture", level)
        at_one, at_max = _best_prompts(table)
        if at_one != at_max:
            reversed_ += 1
            train = table.split_indices("train")
            score = table.atoms[:, train] @ np.full(table.n_objectives, 1.0 / table.n_objectives)  # (P, Q, M)
            probs = table.probs[:, train]
            mean = (probs * score).sum(axis=2, keepdims=True)
            spread = np.sqrt((probs * (score - mean) ** 2).sum(axis=2)).mean(axis=1)  # per-prompt score sd
            riskier += bool(spread[at_max] > spread[at_one])
    assert reversed_ >= 8 and riskier >= reversed_ - 1, (reversed_, riskier)


def test_multi_has_correlated_and_anticorrelated_objectives() -> None:
    for level in PROPERTY_LEVELS:
        table = level_table("bon_multi", level)
        assert table.atoms is not None
        corr = np.corrcoef(table.atoms.reshape(-1, table.n_objectives).T)[np.triu_indices(table.n_objectives, 1)]
        signs = np.array(json.loads(table.attrs["params"])["signs"])
        assert signs[0] == 1 and (signs < 0).any()
        assert corr.max() > 0.2, (level, corr)
        assert corr.min() < -0.05, (level, corr)


def _vote_falls(table: OutcomeTable, prompts: np.ndarray, queries: np.ndarray, rng: np.random.Generator) -> float:
    """Share of (up to 80 sampled) (prompt, query) pairs whose vote of N_max is right less often than one completion."""
    assert table.gold is not None
    pairs = rng.integers(0, [prompts.size, queries.size], size=(80, 2))
    p, q = prompts[pairs[:, 0]], queries[pairs[:, 1]]
    credit = mv_expected_credit(table.probs[p, q], table.gold[q], table.n_max)  # (80, N_max), exact
    return float((credit[:, -1] < credit[:, 0]).mean())


def test_distractor_votes_amplify_shared_errors_and_fix_spread_ones() -> None:
    shared_falls, spread_falls = [], []
    rng = np.random.default_rng(0)
    for level in PROPERTY_LEVELS:
        table = level_table("mv_distractor", level)
        conformist = np.array(["conformist" in p for p in table.prompts])
        shared = np.array([q.endswith("-shared") for q in table.queries])
        if conformist.any() and (~conformist).any() and shared.any() and (~shared).any():
            shared_falls.append(_vote_falls(table, np.flatnonzero(conformist), np.flatnonzero(shared), rng))
            spread_falls.append(_vote_falls(table, np.flatnonzero(~conformist), np.flatnonzero(~shared), rng))
            assert shared_falls[-1] > spread_falls[-1], (level, shared_falls[-1], spread_falls[-1])
    assert len(shared_falls) >= 10
    assert np.median(shared_falls) >= 0.5 and np.median(spread_falls) <= 0.2, (shared_falls, spread_falls)


def test_specialists_best_prompt_differs_across_query_groups() -> None:
    differs = 0
    for level in PROPERTY_LEVELS:
        table = level_table("mv_specialist", level)
        assert table.gold is not None
        group = np.array([int(q.rsplit("-g", 1)[1]) for q in table.queries])
        p_gold = table.probs[:, np.arange(table.n_queries), table.gold]
        best = {int(np.argmax(p_gold[:, group == g].mean(axis=1))) for g in np.unique(group)}
        differs += len(best) >= 2
    assert differs >= 10


def test_models_spread_cost_10_to_100x_with_quality_rising() -> None:
    rising = 0
    for level in PROPERTY_LEVELS:
        table = level_table("mv_models", level)
        assert table.gold is not None and table.cost.shape == (table.n_prompts, table.n_queries)
        cost = table.cost_matrix().mean(axis=1)
        assert 10.0 - 1e-9 <= cost.max() / cost.min() <= 100.0 + 1e-9
        ratio = table.cost[:, 0] / table.cost[:, 1]
        assert np.allclose(ratio, ratio[0])  # a query's length scales every arm alike
        accuracy = table.probs[:, np.arange(table.n_queries), table.gold].mean(axis=1)
        rising += spearmanr(cost, accuracy).statistic > 0.3
    assert rising >= 10


@pytest.mark.parametrize("family", NEW)
def test_redraw_keeps_everything_but_the_distributions(family: str) -> None:
    base, other = level_table(family, 4), redraw_table(family, 4, "drift")
    validate(other)
    assert other.probs.shape == base.probs.shape and np.abs(other.probs - base.probs).max() > 0.05
    assert np.array_equal(other.split, base.split) and np.array_equal(other.cost, base.cost)
    if base.aggregator == "mv":
        assert np.array_equal(other.gold, base.gold)
    else:
        assert np.array_equal(other.atoms, base.atoms)
    assert np.array_equal(redraw_table(family, 4, "drift").probs, other.probs)  # seeded
    if family == "mv_models":  # the redraw keeps the models' places on the price scale
        accuracy = other.probs[:, np.arange(other.n_queries), other.gold].mean(axis=1)
        assert spearmanr(other.cost_matrix().mean(axis=1), accuracy).statistic > 0.3


def test_entry_points_take_the_new_families(tmp_path: Path) -> None:
    env = gym.make("IAPO-Generated-v0", family="bon_multi", level=1_000_002)
    assert table_checksum(iapo_gym.base_env(env).table) == table_checksum(level_table("bon_multi", 1_000_002))
    env.reset(seed=0)
    assert np.isfinite(env.step((0, 2))[1])
    assert main(["data", "generate", "mv_models", "--levels", "3:4", "--out", str(tmp_path)]) == 0
    for level in (3, 4):
        table = read_table(tmp_path / f"mv_models-{level}.h5")
        assert table_checksum(table) == table_checksum(level_table("mv_models", level))
        assert level_params("mv_models", level) == json.loads(table.attrs["params"])
    task = resolve_task("generated:mv_few_queries:1000000-1000001")
    assert task.run_count(5) == 2
    assert table_checksum(task.load(1)) == table_checksum(level_table("mv_few_queries", 1_000_001))
