"""The paper's context sets: cost weights of the majority-vote tasks, objective and cost grid of the Best-of-N tasks.

Shared by the synthetic generators, the release importer, the table builder and the live env.
"""

from __future__ import annotations

import numpy as np

COST_WEIGHTS_MV = {"low": 0.0, "mid": 0.2, "high": 1.0}
COST_WEIGHTS_BON = (0.1, 0.5, 1.0)
OBJECTIVE_WEIGHTS_BON = tuple(round(0.1 * i, 1) for i in range(1, 10))


def mv_cost_contexts() -> tuple[np.ndarray, tuple[str, ...], np.ndarray]:
    """The MV tasks' contexts low/mid/high: weights (1, -coeff), uniform."""
    names = tuple(COST_WEIGHTS_MV)
    weights = np.array([[1.0, -COST_WEIGHTS_MV[n]] for n in names])
    return weights, names, np.full(len(names), 1.0 / len(names))


def bon_grid_contexts() -> tuple[np.ndarray, tuple[str, ...], np.ndarray]:
    """The BoN tasks' 27 contexts: w1 in 0.1..0.9, w2 = 1 - w1, cost weight in {0.1, 0.5, 1.0}."""
    weights, names = [], []
    for wc in COST_WEIGHTS_BON:
        for w1 in OBJECTIVE_WEIGHTS_BON:
            weights.append([w1, round(1.0 - w1, 1), -wc])
            names.append(f"w1={w1:.1f},w2={1.0 - w1:.1f},cost={wc:.1f}")
    return np.array(weights), tuple(names), np.full(len(names), 1.0 / len(names))
