"""``IAPOOnline``'s compiled passes. ``best_prompts``: its choice for a batch of requests, each request's prompt by
the agent's index with every earlier choice of the batch counted as a request served (its count one higher, so the
requests of one batch spread over the prompts as one-at-a-time choices would, without their outcomes), and entry
before competition (a prompt served fewer than ``ENTRY_REQUESTS`` requests comes first). ``feed_cusums``: a batch's
residuals into the shifts' sums and the change detector's CUSUMs, request by request."""

from __future__ import annotations

import numpy as np

from iapo_gym.compiled import njit

#: A prompt's faded count below this is treated as this (its width stays finite).
MIN_COUNT = 1e-3
#: Requests at ``entry_n`` every prompt is served (at the start, on arrival, after its completions are forgotten)
#: before its estimate competes: one request's completions are on one query and can read a prompt far below its
#: value (1, 2 and 3 were screened on tuning levels: research/online_tuning.md).
ENTRY_REQUESTS = 2


@njit
def _fewest_requests(held: np.ndarray, tie: np.ndarray, blocked: np.ndarray,
                     limit: int) -> int:  # pragma: no cover - compiled
    """The available prompt with the fewest requests ``held``, among those below ``limit``, the lowest ``tie`` among
    equals; -1 if there is none."""
    best = -1
    for p in range(held.size):
        if blocked[p] or held[p] >= limit:
            continue
        if best < 0 or held[p] < held[best] or (held[p] == held[best] and tie[p] < tie[best]):
            best = p
    return best


@njit
def best_prompts(contexts: np.ndarray, scaled: np.ndarray, fade: float, width: float, t: int, tie: np.ndarray,
                 res_sum: np.ndarray, res_n: np.ndarray, shift_prior: float, entries: np.ndarray, read: np.ndarray,
                 blocked: np.ndarray, value: np.ndarray, best_n: np.ndarray, entry_n: int, prompts: np.ndarray,
                 ns: np.ndarray) -> None:  # pragma: no cover - compiled
    """Fill ``prompts`` and ``ns`` (B,) for the requests of ``contexts`` (B,), arriving at steps t, t + 1, ...

    Request i of the batch, of context c, goes to
    * an entering prompt if an available one has had fewer than ``ENTRY_REQUESTS`` requests (``entries``, plus its
      choices earlier in the batch): the one with the fewest, the lowest ``tie`` among equals, at N = ``entry_n``;
    * else the read, available prompt p of highest ``value[c, p] + width sqrt(log(t + i + 2) / n_p) + tie[p] +
      s_cp`` at ``best_n[c, p]``, with n_p = max(``scaled[p]`` ``fade`` + its choices earlier in the batch,
      ``MIN_COUNT``) and s_cp = ``res_sum[c, p]`` ``fade`` / (``res_n[p]`` ``fade`` + ``shift_prior``); the first
      maximum, or the first NaN, as ``np.argmax`` takes it;
    * else (no available prompt is read yet) the unread available prompt with the fewest requests, at ``entry_n``.
    """
    n_p = scaled.size
    extra = np.zeros(n_p)
    held = entries.copy()
    for i in range(contexts.size):
        c = contexts[i]
        best = _fewest_requests(held, tie, blocked, ENTRY_REQUESTS)  # entry first
        if best >= 0:
            prompts[i], ns[i] = best, entry_n
        else:
            log_t = np.log(t + i + 2.0)
            best_v, nan = 0.0, False
            for p in range(n_p):
                if blocked[p] or not read[p]:
                    continue
                count = scaled[p] * fade + extra[p]
                if count < MIN_COUNT:
                    count = MIN_COUNT
                shift = res_sum[c, p] * fade / (res_n[p] * fade + shift_prior)
                v = value[c, p] + (width * np.sqrt(log_t / count) + tie[p] + shift)
                if v != v:
                    if not nan:
                        best, nan = p, True
                elif not nan and (best < 0 or v > best_v):
                    best, best_v = p, v
            if best >= 0:
                prompts[i], ns[i] = best, best_n[c, best]
            else:
                best = _fewest_requests(held, tie, blocked, np.iinfo(np.int64).max)
                prompts[i], ns[i] = best, entry_n
        if best < 0:
            raise ValueError("no prompt is available for a request")
        extra[best] += 1.0
        held[best] += 1


#: Residuals the pooled sd sigma is read from before the change detector, the shifts and the width's unit are armed.
ARM_RESIDUALS = 50
#: The shift prior before the pooled residual sd is read (shifts stay 0), and at ``bias_sd`` = 0.
NO_SHIFT = 1e300
#: A standardized residual enters the CUSUMs clipped to +-this. A majority vote's residuals are skewed: mostly a
#: little above the estimate, and on the rare query whose vote fails 10-15 sds below it, so a few such queries close
#: together walked an unclipped CUSUM past its threshold on a stationary table. Clipped at c, a residual of mean 0
#: and variance 1 has a mean within 1 / (4 c) of 0 (c (|x| - c) <= x^2 / 4; 0.083, below the default ``slack``), whatever
#: its shape; a shift of the mean by up to about c sds is still seen at its size.
CUSUM_CLIP = 3.0


@njit
def feed_cusums(prompts: np.ndarray, contexts: np.ndarray, steps: np.ndarray, residuals: np.ndarray, fade: float,
                res_n: np.ndarray, res_sum: np.ndarray, ref_ss: np.ndarray, ref_n: np.ndarray, up: np.ndarray,
                down: np.ndarray, up_zero: np.ndarray, down_zero: np.ndarray, pool: np.ndarray, slack: float,
                threshold: float, bias_sd: float, since: np.ndarray) -> None:  # pragma: no cover - compiled
    """Feed each pull i (prompt ``prompts[i]`` served request ``steps[i]`` of context ``contexts[i]``, its residuals
    under every context ``residuals[i]`` (C,)) to the shifts' sums and to its prompt's two CUSUMs, in order; set
    ``since[i]`` to the change estimate (the crossing side's last zero) when a CUSUM crosses ``threshold``, else -1.

    The counts and sums are scaled by 1 / ``fade`` as ``IAPOOnline``'s faded counts. ``pool`` holds [residuals
    pooled, their sum of squares, the shift prior sigma^2 / ``bias_sd``^2, the width's unit sigma] and is updated:
    before ``ARM_RESIDUALS`` residuals the detector, the shifts and the unit stay unarmed. A residual is centred on
    the prompt's shift s_cp before it and divided by the prompt's own residual sd under its context as of the last
    read (``ref_ss`` / ``ref_n``, with the pooled variance counted as ``ARM_RESIDUALS`` residuals), and clipped to
    +-``CUSUM_CLIP``."""
    for i in range(prompts.size):
        p, c, t = prompts[i], contexts[i], steps[i]
        s_n = res_n[p]
        centred = residuals[i, c] - res_sum[c, p] * fade / (s_n * fade + pool[2])
        res_n[p] = s_n + 1.0 / fade
        for k in range(residuals.shape[1]):
            res_sum[k, p] += residuals[i, k] / fade
        pool[0] += 1.0
        pool[1] += centred * centred
        since[i] = -1
        if pool[0] < ARM_RESIDUALS or pool[1] <= 0.0:
            continue
        var = pool[1] / pool[0]
        pool[2] = var / bias_sd ** 2 if bias_sd > 0.0 else NO_SHIFT
        pool[3] = np.sqrt(var)
        own = (ref_ss[c, p] * fade + ARM_RESIDUALS * var) / (ref_n[p] * fade + ARM_RESIDUALS)
        x = min(max(centred / np.sqrt(own), -CUSUM_CLIP), CUSUM_CLIP)
        u = up[p] + x - slack
        if u <= 0.0:
            u = 0.0
            up_zero[p] = t + 1
        d = down[p] - x - slack
        if d <= 0.0:
            d = 0.0
            down_zero[p] = t + 1
        up[p], down[p] = u, d
        if u > threshold:
            since[i] = up_zero[p]
        elif d > threshold:
            since[i] = down_zero[p]
