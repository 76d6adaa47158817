"""benchmarks/bon_pooling_floor.py: the plug-in's Q with every probability known, pooled raw and query-centred."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from iapo_gym import IAPOEnv
from tests.conftest import query_shifted_bon_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bon_pooling_floor import limit_q  # noqa: E402


def test_centred_limit_is_the_exact_train_q_table_and_the_pooled_one_is_not() -> None:
    """Under a pure query shift the centred reading recovers every per-query maximum exactly; pooled raw,
    the queries' spread inflates max-of-N, so the floor the script reports is a real difference."""
    table, _ = query_shifted_bon_table()
    env = IAPOEnv(table=table)
    exact = env.q_table("train")
    assert np.abs(limit_q(env, center=True) - exact).max() < 1e-4
    assert np.abs(limit_q(env, center=False) - exact)[:, :, -1].min() > 0.3
