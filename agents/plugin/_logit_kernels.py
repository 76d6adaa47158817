"""The threshold-logit kernels of the plug-in estimator's Best-of-N reading (numba).

``threshold_fit``: per weighting, up to ``max_thresholds`` thresholds t_k of the pooled scores, the bins between
them at their pooled mean scores, and the ridge-penalized binomial fit logit P(score > t_k | p, q) = a_pk + b_qk
over every seen (prompt, query) by alternating one-dimensional Newton steps, each sweep followed by the exact
minimization of the ridges along the one direction the data cannot see (a_pk + c, b_qk - c).
``threshold_readings``: each asked (prompt, query)'s exact E[max of N] of the K + 1 bins under its fitted
probabilities, made non-increasing in k. ``tests/test_plugin_kernels.py`` checks the fit against scipy's minimum of
the same loss and the readings against the oracle's expected max.
"""

from __future__ import annotations

import math

import numpy as np

from agents._jit import _njit
from agents.plugin.majority_vote import SIGMOID_CLIP


@_njit
def _sigmoid(x: float) -> float:  # pragma: no cover - compiled
    """1 / (1 + exp(-x)), the argument clipped to +-``SIGMOID_CLIP``."""
    return 1.0 / (1.0 + math.exp(-min(max(x, -SIGMOID_CLIP), SIGMOID_CLIP)))


@_njit
def _thresholds(scores: np.ndarray, counts: np.ndarray, max_thresholds: int,
                out: np.ndarray) -> int:  # pragma: no cover - compiled
    """The thresholds of one weighting's pooled ``scores`` (ascending, with ``counts``) into ``out``; their number K.
    Every distinct score but the largest when there are at most ``max_thresholds`` + 1 of them (each bin then holds
    one score); else the weighted quantiles at j / (max_thresholds + 1), j = 1..max_thresholds, the repeats and the
    largest score left out. Every bin (t_k, t_k+1] then holds some score."""
    n = scores.size
    distinct = 1
    for i in range(1, n):
        if scores[i] != scores[i - 1]:
            distinct += 1
    k = 0
    if distinct - 1 <= max_thresholds:
        for i in range(n - 1):
            if scores[i] != scores[i + 1]:
                out[k] = scores[i]
                k += 1
        return k
    total = 0.0
    for i in range(n):
        total += counts[i]
    top, below, i = scores[n - 1], 0.0, 0
    for j in range(1, max_thresholds + 1):
        target = j * total / (max_thresholds + 1)
        while i < n - 1 and below + counts[i] < target:
            below += counts[i]
            i += 1
        if scores[i] < top and (k == 0 or scores[i] > out[k - 1]):
            out[k] = scores[i]
            k += 1
    return k


@_njit
def _newton(theta: np.ndarray, grad: np.ndarray, hess: np.ndarray, prior: np.ndarray, ridge: float, k: int,
            step_max: float) -> None:  # pragma: no cover - compiled
    """One Newton step per row of ``theta`` (rows, >= k) on its first k columns: the summed binomial gradient and
    curvature plus a ridge ``ridge`` towards ``prior`` (k,), each step clipped to +-``step_max``."""
    for r in range(theta.shape[0]):
        for j in range(k):
            step = (grad[r, j] - ridge * (theta[r, j] - prior[j])) / (hess[r, j] + ridge)
            theta[r, j] += min(max(step, -step_max), step_max)


@_njit
def _gauge(a: np.ndarray, b: np.ndarray, prior: np.ndarray, seen_p: np.ndarray, seen_q: np.ndarray,
           prompt_ridge: float, query_ridge: float, k: int) -> None:  # pragma: no cover - compiled
    """Moves a_pk + c, b_qk - c over the seen prompts and queries (every pair's logit unchanged) by the c that
    minimizes the ridges prompt_ridge (a_pk - prior_k)^2 + query_ridge b_qk^2 summed over them, per threshold.
    The data do not see this direction, so the Newton sweeps alone crawl along it at the ridges' pace."""
    n_p, n_q = seen_p.sum(), seen_q.sum()
    for j in range(k):
        off_p, off_q = 0.0, 0.0
        for p in range(a.shape[0]):
            if seen_p[p]:
                off_p += a[p, j] - prior[j]
        for q in range(b.shape[0]):
            if seen_q[q]:
                off_q += b[q, j]
        c = (query_ridge * off_q - prompt_ridge * off_p) / (prompt_ridge * n_p + query_ridge * n_q)
        for p in range(a.shape[0]):
            if seen_p[p]:
                a[p, j] += c
        for q in range(b.shape[0]):
            if seen_q[q]:
                b[q, j] -= c


@_njit
def _fit_block(projected: np.ndarray, counts: np.ndarray, entry_pair: np.ndarray, pair_prompt: np.ndarray,
               pair_query: np.ndarray, n_prompts: int, n_queries: int, max_thresholds: int, sweeps: int,
               prompt_ridge: float, query_ridge: float, step_max: float,
               tol: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """``threshold_fit``."""
    n_weightings, n_entries = projected.shape
    n_pairs = pair_prompt.size
    a = np.zeros((n_weightings, n_prompts, max_thresholds))
    b = np.zeros((n_weightings, n_queries, max_thresholds))
    values = np.zeros((n_weightings, max_thresholds + 1))
    n_thresholds = np.zeros(n_weightings, np.int64)
    thresholds, pooled = np.empty(max_thresholds), np.empty(max_thresholds)
    above, drawn = np.empty((n_pairs, max_thresholds)), np.zeros(n_pairs)
    last = np.zeros((n_pairs, max_thresholds))  # each pair's probabilities at the previous sweep
    bin_of = np.empty(n_entries, np.int64)
    mass = np.empty(max_thresholds + 1)
    grad_p, hess_p = np.empty((n_prompts, max_thresholds)), np.empty((n_prompts, max_thresholds))
    grad_q, hess_q = np.empty((n_queries, max_thresholds)), np.empty((n_queries, max_thresholds))
    zero = np.zeros(max_thresholds)
    seen_p, seen_q = np.zeros(n_prompts, np.bool_), np.zeros(n_queries, np.bool_)
    for i in range(n_pairs):
        seen_p[pair_prompt[i]] = True
        seen_q[pair_query[i]] = True
    for e in range(n_entries):
        drawn[entry_pair[e]] += counts[e]
    for w in range(n_weightings):
        order = np.argsort(projected[w], kind="mergesort")
        scores, weights = projected[w][order], counts[order]
        k_w = _thresholds(scores, weights, max_thresholds, thresholds)
        n_thresholds[w] = k_w
        mass[:] = 0.0
        values[w] = 0.0
        j = 0
        for i in range(n_entries):
            while j < k_w and scores[i] > thresholds[j]:
                j += 1
            bin_of[order[i]] = j
            mass[j] += weights[i]
            values[w, j] += weights[i] * scores[i]
        for j in range(k_w + 1):
            values[w, j] /= mass[j]
        above[:, :k_w] = 0.0
        for e in range(n_entries):
            for j in range(bin_of[e]):
                above[entry_pair[e], j] += counts[e]
        total, share = 0.0, 0.0
        for j in range(k_w + 1):
            total += mass[j]
        for j in range(k_w):
            share = 0.0
            for m in range(j + 1, k_w + 1):
                share += mass[m]
            pooled[j] = math.log(share / (total - share))  # 0 < share < total: every bin holds some score
        for p in range(n_prompts):
            for j in range(k_w):
                a[w, p, j] = pooled[j]
        for sweep in range(sweeps):
            moved = 0.0  # the largest change of a pair's fitted probability since the previous sweep
            for side in range(2):
                grad, hess = (grad_p, hess_p) if side == 0 else (grad_q, hess_q)
                grad[:, :k_w] = 0.0
                hess[:, :k_w] = 0.0
                for i in range(n_pairs):
                    p, q = pair_prompt[i], pair_query[i]
                    r = p if side == 0 else q
                    for j in range(k_w):
                        mu = _sigmoid(a[w, p, j] + b[w, q, j])
                        if side == 0:
                            moved = max(moved, abs(mu - last[i, j]))
                            last[i, j] = mu
                        grad[r, j] += above[i, j] - drawn[i] * mu
                        hess[r, j] += drawn[i] * mu * (1.0 - mu)
                if side == 0:
                    _newton(a[w], grad, hess, pooled, prompt_ridge, k_w, step_max)
                else:
                    _newton(b[w], grad, hess, zero, query_ridge, k_w, step_max)
            _gauge(a[w], b[w], pooled, seen_p, seen_q, prompt_ridge, query_ridge, k_w)
            if moved < tol and sweep > 0:
                break
    return a, b, values, n_thresholds


def threshold_fit(projected: np.ndarray, counts: np.ndarray, entry_pair: np.ndarray, pair_prompt: np.ndarray,
                  pair_query: np.ndarray, n_prompts: int, n_queries: int, max_thresholds: int, sweeps: int,
                  prompt_ridge: float, query_ridge: float, step_max: float,
                  tol: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The threshold-logit fit of W weightings' scores: ``projected`` (W, E) the scores of E entries (a seen
    (prompt, query) pair's outcome of positive count), ``counts`` (E,) their counts, ``entry_pair`` (E,) their pair,
    ``pair_prompt`` and ``pair_query`` each pair's prompt and query (every pair has an entry).

    Per weighting: K <= ``max_thresholds`` thresholds (``_thresholds``), the K + 1 bins' pooled mean scores, and
    logit P(score > t_k | p, q) = a_pk + b_qk fitted to each pair's draws above t_k: the maximum of the binomial
    log-likelihood less the ridges prompt_ridge / 2 (a_pk - pooled logit of t_k)^2 and query_ridge / 2 b_qk^2, from
    a_pk at the pooled logit and b_qk at 0 by alternating sweeps of one Newton step per a_pk and per b_qk (each at
    most ``step_max``), each sweep followed by the ridges' exact minimum along (a_pk + c, b_qk - c) over the seen
    prompts and queries; a sweep that finds no pair's fitted probability moved by ``tol`` or more since the previous
    sweep began is the last (its steps are kept), and there are at most ``sweeps`` sweeps.
    Returns a (W, n_prompts, max_thresholds), b (W, n_queries, max_thresholds) (unseen prompts keep the pooled
    logits, unseen queries 0), the bins' scores (W, max_thresholds + 1) and K (W,); columns past K are unused."""
    def f64(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=np.float64)

    def i64(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=np.int64)
    return _fit_block(f64(projected), f64(counts), i64(entry_pair), i64(pair_prompt), i64(pair_query), int(n_prompts),
                      int(n_queries), int(max_thresholds), int(sweeps), float(prompt_ridge), float(query_ridge),
                      float(step_max), float(tol))


@_njit
def _readings_block(a: np.ndarray, b: np.ndarray, values: np.ndarray, n_thresholds: np.ndarray, prompts: np.ndarray,
                    queries: np.ndarray, seen: np.ndarray, n_max: int) -> np.ndarray:  # pragma: no cover - compiled
    """``threshold_readings``."""
    n_weightings = a.shape[0]
    out = np.zeros((n_weightings, prompts.size, queries.size, n_max))
    cdf, gap, power = np.empty(a.shape[2]), np.empty(a.shape[2]), np.empty(a.shape[2])
    for w in range(n_weightings):
        k_w = n_thresholds[w]
        top = values[w, k_w]
        for j in range(k_w):
            gap[j] = values[w, j + 1] - values[w, j]
        for i in range(prompts.size):
            p = prompts[i]
            for c in range(queries.size):
                if not seen[i, c]:
                    continue
                q, run = queries[c], 1.0
                for j in range(k_w):
                    run = min(run, _sigmoid(a[w, p, j] + b[w, q, j]))  # P(score > t_j), non-increasing in j
                    cdf[j] = 1.0 - run
                    power[j] = cdf[j]
                for n in range(n_max):
                    below = 0.0
                    for j in range(k_w):
                        below += gap[j] * power[j]
                        power[j] *= cdf[j]
                    out[w, i, c, n] = top - below
    return out


def threshold_readings(fit: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], prompts: np.ndarray,
                       queries: np.ndarray, seen: np.ndarray, n_max: int) -> np.ndarray:
    """(W, len(prompts), len(queries), n_max) each (prompt, query) ``seen`` (len(prompts), len(queries)) marks: the
    expected max of N = 1..n_max of ``fit``'s (``threshold_fit``) K + 1 bins v_0 < .. < v_K with P(score > t_k) =
    sigmoid(a_pk + b_qk) made non-increasing in k, E = v_K - sum_k (v_k+1 - v_k) F_k^N, F_k = 1 - P(score > t_k);
    0 where not seen."""
    a, b, values, n_thresholds = fit
    return _readings_block(a, b, values, n_thresholds, np.ascontiguousarray(prompts, dtype=np.int64),
                           np.ascontiguousarray(queries, dtype=np.int64), np.ascontiguousarray(seen, dtype=np.bool_),
                           int(n_max))
