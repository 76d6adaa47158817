"""The Best-of-N location-scale kernels of the plug-in estimator (numba): the residuals under every weighting,
their squared sums and scaling (``residual_sums``, ``standardize``, ``over_spread``), and the clipped location-scale
readings (``location_scale_readings``, and ``clipped_readings``, their weighted sum per prompt without the
(weightings x prompts x queries x N) array). Each sums in a fixed order that no thread count changes.
"""

from __future__ import annotations

import numpy as np

from agents._jit import _njit


@_njit
def _residual_block(projected: np.ndarray, level: np.ndarray, offsets: np.ndarray, prompt: np.ndarray,
                    query: np.ndarray, counts: np.ndarray, n_prompts: int,
                    n_queries: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """``residual_sums`` in one pass over tiles of the entries (each tile's rows of ``projected`` stay in cache
    while every weighting reads them); each sum adds its entries in entry order, as ``np.bincount`` does."""
    n_entries, n_weightings = projected.shape
    resid = np.empty((n_weightings, n_entries))
    ss_prompt = np.zeros((n_weightings, n_prompts))
    ss_query = np.zeros((n_weightings, n_queries))
    for tile in range(0, n_entries, 64):
        stop = min(tile + 64, n_entries)
        for w in range(n_weightings):
            for e in range(tile, stop):
                r = projected[e, w] - level[w, prompt[e]] - offsets[w, query[e]]
                resid[w, e] = r
                square = counts[e] * (r * r)
                ss_prompt[w, prompt[e]] += square
                ss_query[w, query[e]] += square
    return resid, ss_prompt, ss_query


def residual_sums(projected: np.ndarray, level: np.ndarray, offsets: np.ndarray, prompt: np.ndarray,
                  query: np.ndarray, counts: np.ndarray, n_prompts: int,
                  n_queries: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(W, E) residuals r = ``projected`` (E, W) - level[w, prompt] - offsets[w, query] of E entries, and (W, P),
    (W, Q) sums of ``counts`` x r^2 by prompt and by query (``LocationScaleFit._location_scale``), each sum adding
    its entries in entry order, without (W, E) temporaries."""
    def f64(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float64)
    return _residual_block(f64(projected), f64(level), f64(offsets), np.ascontiguousarray(prompt, dtype=np.int64),
                           np.ascontiguousarray(query, dtype=np.int64), f64(counts), int(n_prompts), int(n_queries))


@_njit
def _standardize_block(resid: np.ndarray, scale: np.ndarray, prompt: np.ndarray) -> None:  # pragma: no cover - compiled
    """``standardize`` in place."""
    n_weightings, n_entries = resid.shape
    for w in range(n_weightings):
        for e in range(n_entries):
            s = scale[w, prompt[e]]
            resid[w, e] = resid[w, e] / s if s > 0 else 0.0


def standardize(resid: np.ndarray, scale: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """``resid`` (W, E), C-contiguous float64, overwritten with resid[w, e] / scale[w, prompt[e]] (0 where that
    scale is 0) and returned, in one pass."""
    _standardize_block(resid, np.ascontiguousarray(scale, dtype=np.float64), np.ascontiguousarray(prompt, dtype=np.int64))
    return resid


@_njit
def _over_spread_block(std: np.ndarray, spread: np.ndarray, query: np.ndarray,
                       entries: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """``over_spread``."""
    n_weightings = std.shape[0]
    out = np.empty((n_weightings, entries.size))
    for w in range(n_weightings):
        for i in range(entries.size):
            e = entries[i]
            out[w, i] = std[w, e] / spread[w, query[e]]
    return out


def over_spread(std: np.ndarray, spread: np.ndarray, query: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """(W, len(entries)) ``std[:, entries] / spread[:, query[entries]]``, C-contiguous (numpy's gather
    along the last axis is not), in one pass."""
    return _over_spread_block(np.ascontiguousarray(std, dtype=np.float64), np.ascontiguousarray(spread, dtype=np.float64),
                              np.ascontiguousarray(query, dtype=np.int64), np.ascontiguousarray(entries, dtype=np.int64))


@_njit
def _reading(base: float, scale: float, expected: float, spread: float, shape: float, low: float,
             high: float) -> float:  # pragma: no cover - compiled
    """The location-scale reading R = clip(base + scale (expected + spread shape), low, high), base = level_p + o_q
    (docs/agents.md's V_ls before its - o_q): the one place the formula is written."""
    return min(max(base + scale * (expected + spread * shape), low), high)


@_njit
def _readings_block(expected: np.ndarray, spread: np.ndarray, shape: np.ndarray, scale: np.ndarray, level: np.ndarray,
                    offsets: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """``location_scale_readings``."""
    n_weightings, n_prompts = level.shape
    n_queries, n_max = expected.shape[1], expected.shape[2]
    out = np.empty((n_weightings, n_prompts, n_queries, n_max))
    for w in range(n_weightings):
        for p in range(n_prompts):
            for q in range(n_queries):
                base = level[w, p] + offsets[w, q]
                for n in range(n_max):
                    out[w, p, q, n] = _reading(base, scale[w, p], expected[w, q, n], spread[w, q], shape[w, p, n],
                                               low[w], high[w])
    return out


def location_scale_readings(expected: np.ndarray, spread: np.ndarray, shape: np.ndarray, scale: np.ndarray,
                            level: np.ndarray, offsets: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """(W, p, q, N) the pooled reading R = clip(level_p + o_q + scale_p (M_q(N) + s_q D_p(N)), low, high) of p prompts
    on q queries: ``expected`` M (W, q, N), ``spread`` s (W, q), ``shape`` D (W, p, N), ``scale``, ``level`` (W, p),
    ``offsets`` (W, q), ``low`` and ``high`` (W,)."""
    def f64(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float64)
    return _readings_block(f64(expected), f64(spread), f64(shape), f64(scale), f64(level), f64(offsets), f64(low),
                           f64(high))


@_njit
def _clipped_block(level: np.ndarray, offsets: np.ndarray, scale: np.ndarray, expected: np.ndarray,
                   spread: np.ndarray, shape: np.ndarray, weight: np.ndarray, weight_at_draws: np.ndarray,
                   draws: np.ndarray, seen: np.ndarray, low: np.ndarray, high: np.ndarray, other: np.ndarray,
                   alpha: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """``clipped_readings`` in one pass (no (W, P, Q, N) work array but ``other``'s): each reading computed once and
    added to every set of weights."""
    n_weightings, n_prompts = level.shape
    n_queries, n_max = expected.shape[1], expected.shape[2]
    n_sets = weight.shape[0]
    out = np.zeros((n_sets, n_weightings, n_prompts, n_max))
    for w in range(n_weightings):
        for p in range(n_prompts):
            for q in range(n_queries):
                if not seen[p, q]:
                    continue
                base, last = level[w, p] + offsets[w, q], draws[p, q] - 1
                at_draws = 0.0  # R at N = the pair's draws, once reached
                for n in range(n_max):
                    r = _reading(base, scale[w, p], expected[w, q, n], spread[w, q], shape[w, p, n], low[w], high[w])
                    if alpha[w] > 0.0:
                        r = (1.0 - alpha[w]) * r + alpha[w] * other[w, p, q, n]
                    if n == last:
                        at_draws = r
                    for k in range(n_sets):
                        value = weight[k, p, q, n] * r
                        if n > last:
                            value += weight_at_draws[k, p, q] * at_draws
                        out[k, w, p, n] += value
    return out


def clipped_readings(level: np.ndarray, offsets: np.ndarray, scale: np.ndarray, expected: np.ndarray,
                     spread: np.ndarray, shape: np.ndarray, weight: np.ndarray, weight_at_draws: np.ndarray,
                     draws: np.ndarray, seen: np.ndarray, low: np.ndarray, high: np.ndarray,
                     other: np.ndarray | None = None, alpha: np.ndarray | None = None) -> np.ndarray:
    """(K, W, P, N) per set k of weights, the sum over the queries ``seen`` (P, Q) marks of weight[k, p, q, n]
    R(p, q, n) + [n > d] weight_at_draws[k, p, q] R(p, q, d), d = draws[p, q] (>= 1), R the location-scale reading
    (``_reading``) of ``location_scale_readings``' arguments at N = n: the pooled readings' sums of
    ``BestOfNReadings._bon_value`` (the shrunk reading's and the correction's, K = 2), each prompt's terms added query
    by query in query order. ``weight`` is (K, P, Q, N), ``weight_at_draws`` (K, P, Q). With ``other`` (W, P, Q, N)
    and ``alpha`` (W,), R is the blend (1 - alpha) R + alpha other in each row where alpha > 0."""
    def f64(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float64)
    return _clipped_block(f64(level), f64(offsets), f64(scale), f64(expected), f64(spread), f64(shape), f64(weight),
                          f64(weight_at_draws), np.ascontiguousarray(draws, dtype=np.int64),
                          np.ascontiguousarray(seen, dtype=np.bool_), f64(low), f64(high),
                          np.zeros((1, 1, 1, 1)) if other is None else f64(other),
                          np.zeros(level.shape[0]) if alpha is None else f64(alpha))
