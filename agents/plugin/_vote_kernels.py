"""The majority-vote kernel of the plug-in estimator (numba) beside the credit (``agents._vote_credit``): the
response-curve fit.

Response curves (``fit_curves``): the safeguarded Newton fit of ``MajorityVoteReadings._fit_curves``, one prompt at
a time (``tests/test_plugin_kernels.py`` checks it against a plain-loop reference, step for step).
"""

from __future__ import annotations

import math

import numpy as np

from agents._jit import _njit


@_njit
def _curve_objective(a: float, b: float, g: np.ndarray, n: np.ndarray, z: np.ndarray, lam_a: float, lam_b: float,
                     slope: float) -> float:  # pragma: no cover - compiled
    """One prompt's penalised log-likelihood at (a, b): sum_j -(n_j log(1 + e^-x_j) + (n_j - g_j) x_j), x_j = a + b z_j,
    less 0.5 (lam_a a^2 + lam_b (b - slope)^2)."""
    total = 0.0
    for j in range(z.size):
        x = a + b * z[j]
        # logaddexp(0, -x), as numpy computes it: max(0, -x) + log1p(exp(-|x|))
        soft = (-x if x < 0.0 else 0.0) + math.log1p(math.exp(-abs(x)))
        total += n[j] * soft + (n[j] - g[j]) * x
    return -total - 0.5 * (lam_a * a * a + lam_b * (b - slope) * (b - slope))


@_njit
def fit_curves_kernel(g: np.ndarray, n: np.ndarray, z: np.ndarray, lam_a: float, lam_b: float, slope: float,
                      start: np.ndarray, iterations: int,
                      halvings: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """``MajorityVoteReadings._fit_curves`` one prompt at a time: (P, 2) curves and posterior variances from ``start``.

    Safeguarded Newton steps: each step is halved until the penalised likelihood (``_curve_objective``) does not
    fall (to rounding, 1e-12 relative), at most ``halvings`` times (then no step: at the maximum to rounding); a
    prompt stops once its step is below 1e-9, or after ``iterations`` steps.
    """
    n_prompts = g.shape[0]
    theta = start.copy()
    variance = np.zeros((n_prompts, 2))
    for p in range(n_prompts):
        a, b = theta[p, 0], theta[p, 1]
        value = _curve_objective(a, b, g[p], n[p], z, lam_a, lam_b, slope)
        for _ in range(iterations):
            grad_a, grad_b, h00, h01, h11 = -lam_a * a, -lam_b * (b - slope), lam_a, 0.0, lam_b
            for j in range(z.size):
                x = min(30.0, max(-30.0, a + b * z[j]))
                mu = 1.0 / (1.0 + math.exp(-x))
                r, w = g[p, j] - n[p, j] * mu, n[p, j] * mu * (1.0 - mu)
                grad_a += r
                grad_b += r * z[j]
                h00 += w
                h01 += w * z[j]
                h11 += w * z[j] * z[j]
            det = h00 * h11 - h01 * h01
            step_a, step_b = (h11 * grad_a - h01 * grad_b) / det, (h00 * grad_b - h01 * grad_a) / det
            variance[p, 0], variance[p, 1] = h11 / det, h00 / det
            size = 1.0
            accepted = False
            for _ in range(halvings):
                trial = _curve_objective(a + size * step_a, b + size * step_b, g[p], n[p], z, lam_a, lam_b, slope)
                if trial >= value - 1e-12 * abs(value):
                    value = trial
                    accepted = True
                    break
                size *= 0.5
            if not accepted:
                size = 0.0  # no ascent left along the step: at the maximum to rounding
            a += size * step_a
            b += size * step_b
            if max(abs(size * step_a), abs(size * step_b)) < 1e-9:
                break
        theta[p, 0], theta[p, 1] = a, b
    return theta, variance


def fit_curves(g: np.ndarray, n: np.ndarray, z: np.ndarray, ridge: tuple[float, float], start: np.ndarray,
               slope: float, iterations: int, halvings: int) -> tuple[np.ndarray, np.ndarray]:
    """(P, 2) response curves and their posterior variances of prompts with gold votes ``g`` and votes ``n``
    (P, Q) on queries of difficulty ``z`` (Q,), compiled (``MajorityVoteReadings._fit_curves`` says what they are)."""
    return fit_curves_kernel(np.ascontiguousarray(g, dtype=np.float64), np.ascontiguousarray(n, dtype=np.float64),
                             np.ascontiguousarray(z, dtype=np.float64), float(ridge[0]), float(ridge[1]),
                             float(slope), np.ascontiguousarray(start, dtype=np.float64), int(iterations),
                             int(halvings))
