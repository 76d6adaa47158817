"""``IAPOOnline`` (``iapo_online``), the recommended online agent: ``auto``'s plug-in estimate, served by UCB over
prompts, refitted on a doubling schedule, with a change detector for drift and optimistic entry for new prompts.

* **Estimate.** Every completion served goes into ``agents.plugin.PlugInEstimator``, the estimator of ``auto``: per
  (prompt, query) outcome distributions read through the oracle's exact formulas with a prior shared across queries and
  prompts, so one pull informs every context (cross-context reuse) and every N (nested reuse). The estimate is
  refitted when the completions served since the last refit reach ``refit`` times those before (1: a doubling
  schedule, about log2 of the completions refits in a run), never per request: a refit costs as much as thousands
  of requests.
* **Choice.** For a request of context c, each available prompt p scores ``max_N Q^(c, p, N) + s_cp + width *
  sigma * sqrt(log(t + 2) / n_p)`` with n_p the requests the prompt served, faded, and sigma the pooled sd of the
  residuals; the request gets the best prompt at its best N. The fading makes a prompt not served for a while worth
  a look again, so a prompt that drifted while unserved is re-examined. A request s counts exp(phi(s) - phi(t)) at
  request t, phi(t) = 2 sqrt(t - o) / ``memory`` (plus phi(o)) with o the last detected change (0 before any): the
  fading's window, ``memory`` * sqrt(t - o) requests, grows with t, so on a stationary table the re-examining it
  causes falls like log(t) / sqrt(t) (a fixed factor per request kept every count below a fixed window, and the
  regret per request of telling close prompts apart stopped falling), and after a detected change it is short
  again, so every prompt is looked at again soon.
* **Shift.** The plug-in estimate of a prompt with few completions is pulled toward the shared prior, far below its
  value at times (0.1-0.3 on some tuning levels). s_cp measures that bias on what the prompt served: the sum of its
  residuals under context c (each served pull's utility under c, which the env reports for every context, minus
  Q^(c, p, N) at the pull's N), faded as n_p, over their faded count + sigma^2 / ``bias_sd``^2, the posterior mean
  of a bias of prior sd ``bias_sd`` under residual noise sigma. It is recomputed over every logged pull at each
  refit (against the new estimate) and follows every residual in between, so the choice follows what is served
  without paying for a refit, and a prompt's few unlucky residuals fade with its count.
* **Optimistic entry.** A prompt never served (at the start, or one that arrives) comes before every other, at N =
  ``entry_n``; the requests of one batch spread over the new prompts. The estimate is first read once every
  available prompt has been served (the entry round), and a prompt that arrives later is read right after its
  first request.
* **Change detector.** Each served request's residual under its context less the prompt's shift s_cp before it
  (the prompt's own recent mean, so the estimate's bias is not taken for a change), over the prompt's own residual
  sd under that context as of the last refit (its faded residuals' sd about their mean then, so not inflated by a
  change since, with the pooled variance sigma^2 counted as ``ARM_RESIDUALS`` residuals: a best-of-N prompt served
  at a high N spreads wider than the pool, and in pooled sds its CUSUM walked past the threshold on a stationary
  table), feeds a two-sided CUSUM per prompt (slack ``slack``, threshold ``threshold``; every CUSUM starts over at
  a refit). When one crosses, the prompt's completions before the CUSUM's change estimate (the crossing side's last
  zero) are forgotten: the estimator is rebuilt from the completions kept, and the prompt's count restarts, so it
  is explored again; the fading's window restarts too (above), so the other prompts are soon re-examined.

Everything runs on the env's schema (``OnlineEnv.schema``); the estimator's env is an ``IAPOEnv`` on that schema
whose completion source refuses to draw: the online env serves every completion.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from agents.online.served_log import ServedElsewhere, ServedLog
from agents.plugin.estimator import PlugInEstimator, check_nonnegative, warm_up
from iapo_gym.compiled import njit
from iapo_gym.env import IAPOEnv
from iapo_gym.online import OnlineAgentBase, OnlineEnv, Requests, Served

#: The shift prior before the pooled residual sd is read (shifts stay 0), and at ``bias_sd`` = 0.
_NO_SHIFT = 1e300
#: Residuals the pooled sd sigma is read from before the change detector, the shifts and the width's unit are armed.
ARM_RESIDUALS = 50
#: A prompt's faded count below this is treated as this (its width stays finite).
MIN_COUNT = 1e-3
#: The lazily faded counts are renormalized when their scale passes this.
_RESCALE = 1e150


@njit
def _best_prompt(scaled: np.ndarray, fade: float, width: float, log_t: float, tie: np.ndarray, res_sum: np.ndarray,
                 res_n: np.ndarray, shift_prior: float, served: np.ndarray, blocked: np.ndarray,
                 value: np.ndarray) -> int:  # pragma: no cover - compiled
    """``IAPOOnline.choose``'s prompt for a context of estimates ``value`` (P,), or -1 when a prompt's index is +inf
    (never served, or an infinite width): ``_index``'s arithmetic per prompt, in the same order, then the first
    maximum of ``value + index`` as ``np.argmax`` takes it (the first NaN, if any)."""
    best, best_v, nan = -1, 0.0, False
    for i in range(scaled.size):
        if blocked[i]:
            b = -np.inf
        elif not served[i]:
            return -1
        else:
            count = scaled[i] * fade
            if count < MIN_COUNT:
                count = MIN_COUNT
            shift = res_sum[i] * fade / (res_n[i] * fade + shift_prior)
            b = width * np.sqrt(log_t / count) + tie[i] + shift
            if b == np.inf:
                return -1
        v = value[i] + b
        if v != v:
            if not nan:
                best, nan = i, True
        elif not nan and (best < 0 or v > best_v):
            best, best_v = i, v
    return best


class IAPOOnline(OnlineAgentBase):
    """UCB over prompts on ``auto``'s plug-in estimate, with a CUSUM change detector and optimistic entry.

    :param width: exploration weight of a prompt's confidence width sigma * sqrt(log(t + 2) / n_p) (residual sds).
    :param memory: n_p fades over a window of ``memory`` * sqrt(t - o) requests, o the last detection (inf: none).
    :param refit: the estimate is refitted when the completions since the last refit reach this times those before.
    :param threshold: CUSUM threshold (in the prompt's residual sds) at which its older completions are forgotten.
    :param slack: CUSUM slack (in the prompt's residual sds): smaller shifts of its mean utility go undetected.
    :param entry_n: N of a never-served prompt's first pull (optimistic entry; capped at N_max).
    :param prior: weight of the estimator's shared prior, times ``auto``'s (``alpha`` 32 pseudo-votes, ``bon_prior`` 1).
    :param bias_sd: prior sd of the estimate's bias per (context, prompt) (utility units; 0: no shift s_cp).
    """

    def __init__(self, seed: int | None = None, width: float = 0.5, memory: float = 200.0, refit: float = 1.0,
                 threshold: float = 50.0, slack: float = 0.25, entry_n: int = 4, prior: float = 0.1,
                 bias_sd: float = 0.05) -> None:
        """Hyper-parameters as documented on the class; ``seed`` for ties."""
        super().__init__(seed)
        self.width, self.threshold, self.slack, self.prior, self.bias_sd = check_nonnegative(
            width=width, threshold=threshold, slack=slack, prior=prior, bias_sd=bias_sd)
        if isinstance(memory, bool) or not float(memory) > 0.0:
            raise ValueError(f"memory must be a number > 0 (inf: no fading), got {memory!r}")
        if isinstance(refit, bool) or not float(refit) > 0.0:
            raise ValueError(f"refit must be a number > 0, got {refit!r}")
        if isinstance(entry_n, bool) or not isinstance(entry_n, (int, np.integer)) or entry_n < 1:
            raise ValueError(f"entry_n must be an integer >= 1, got {entry_n!r}")
        self.memory, self.refit, self.entry_n = float(memory), float(refit), int(entry_n)
        self._rate = 2.0 / self.memory  # phi(t) = _rate * sqrt(t) (0 at memory = inf)
        warm_up()

    def params(self) -> dict[str, Any]:
        """The hyper-parameters."""
        return {"width": self.width, "memory": self.memory, "refit": self.refit, "threshold": self.threshold,
                "slack": self.slack, "entry_n": self.entry_n, "prior": self.prior, "bias_sd": self.bias_sd}

    # ---- state ----------------------------------------------------------------------------------
    def start(self, env: OnlineEnv, seed: int) -> None:
        """Empty estimate over the env's schema."""
        super().start(env, seed)
        self.schema = env.schema
        self._base = IAPOEnv(table=self.schema, source=ServedElsewhere(), split=env.split)
        n_c, n_p, n_max = self.schema.n_contexts, self.schema.n_prompts, self.schema.n_max
        self._entry = min(self.entry_n, n_max)
        self.est = PlugInEstimator(self._base, alpha=32.0 * self.prior, bon_prior=self.prior)
        self.log = ServedLog()
        self._pending = ServedLog()  # served, not yet in the estimator
        self.value = np.zeros((n_c, n_p))  # max_N of the estimate (0 until a prompt is read)
        self.best_n = np.full((n_c, n_p), self._entry, dtype=np.int64)
        self.q = np.zeros((n_c, n_p, n_max))
        self.served = np.zeros(n_p, dtype=bool)  # prompts served at least once (since a forget)
        self.read = np.zeros(n_p, dtype=bool)  # prompts with an estimate
        self.completions = np.zeros(n_p)  # completions of each prompt (kept ones)
        self._drawn = 0.0  # completions kept (in the estimator or pending)
        self._fitted_total = 0.0  # completions kept at the last refit
        self._scaled = np.zeros(n_p)  # faded counts, times exp(phi(t) - phi(_t0))
        self._t0 = 0
        # phi's pieces: it restarts growing like 2 sqrt(t - o) / memory at each detection o (the window is short again)
        self._origin, self._phi_origin = 0, 0.0
        self._origins, self._phi_origins = [0], [0.0]
        self._tie = self.rng.random(n_p) * 1e-12  # a fixed random order among equal indices
        self.t = 0
        self._next_new = 0
        # the change detector: pooled residual moments, per prompt two CUSUMs and their last zeros
        self._pool_n, self._res_ss = 0, 0.0
        self._shift_prior = _NO_SHIFT  # sigma^2 / bias_sd^2 once the pooled residual sd sigma is read
        self._scale = 1.0  # the width's unit: the pooled residual sd sigma once read (1 before)
        self._res_sum = np.zeros((n_c, n_p))  # per (context, prompt): faded residual sum, scaled as ``_scaled``
        self._res_n = np.zeros(n_p)  # per prompt: its faded residual count, scaled as ``_scaled``
        # per (context, prompt) at the last refit: the faded sum of squared residuals about their mean, and per prompt
        # their faded count, scaled as ``_scaled``: the prompt's own residual variance, read by the change detector
        self._ref_ss, self._ref_n = np.zeros((n_c, n_p)), np.zeros(n_p)
        self._n_served = self._n_read = 0
        self._up = [0.0] * n_p
        self._down = [0.0] * n_p
        self._up_zero = [0] * n_p
        self._down_zero = [0] * n_p
        self.changes: list[tuple[int, int, int]] = []  # (step detected, prompt, change estimate)
        self._avail_key = b""
        self._blocked = np.zeros(n_p, dtype=bool)

    def _phi(self, t: int) -> float:
        """phi(t): phi at the last detection plus 2 sqrt(t - that step) / ``memory`` (t at or after it)."""
        return self._phi_origin + self._rate * math.sqrt(t - self._origin)

    def _fade(self) -> float:
        """exp(phi(t0) - phi(t)): the factor turning ``_scaled`` into the faded counts now."""
        return math.exp(self._phi(self._t0) - self._phi(self.t))

    def _weights(self, steps: np.ndarray, now: int) -> np.ndarray:
        """exp(phi(s + 1) - phi(now)) per logged request s (at most ``now``), phi over every piece since the run
        started: its weight in a count scaled as ``_scaled`` is at t0 = ``now`` (a request counts from the step after
        it)."""
        origins, at = np.array(self._origins, dtype=np.float64), np.array(self._phi_origins)
        x = (steps + 1).astype(np.float64)
        k = np.searchsorted(origins, x, side="right") - 1
        return np.exp(at[k] + self._rate * np.sqrt(x - origins[k]) - self._phi(now))

    def _shift(self) -> np.ndarray:
        """(C, P) the shifts s_cp: a prompt's faded residual sum under context c over its faded residual count +
        sigma^2 / ``bias_sd``^2."""
        fade = self._fade()
        return self._res_sum * fade / (self._res_n * fade + self._shift_prior)

    def _index(self) -> np.ndarray:
        """(P,) each prompt's confidence width now (0 for none when width = 0); +inf for never-served prompts."""
        counts = np.maximum(self._scaled * self._fade(), MIN_COUNT)
        bonus = self.width * self._scale * np.sqrt(math.log(self.t + 2) / counts) + self._tie
        bonus[~self.served] = np.inf
        return bonus

    def _set_available(self, available: np.ndarray) -> None:
        key = available.tobytes()
        if key != self._avail_key:
            self._avail_key = key
            self._blocked = ~np.asarray(available, dtype=bool)

    # ---- choosing -------------------------------------------------------------------------------
    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        """Per request the best available prompt by estimate plus width at its best N; never-served prompts first,
        the batch's requests spread over them."""
        self._set_available(requests.available)
        bonus = self._index()
        bonus[self._blocked] = -np.inf
        fresh = np.flatnonzero(np.isposinf(bonus))
        contexts = requests.contexts
        b = contexts.size
        if fresh.size:
            k = np.arange(self._next_new, self._next_new + b)
            self._next_new += b
            prompts = fresh[k % fresh.size]
            return prompts, np.full(b, self._entry, dtype=np.int64)
        index = self.value[contexts] + self._shift()[contexts] + bonus[None, :]
        prompts = index.argmax(axis=1)
        return prompts, self.best_n[contexts, prompts]

    def choose(self, observation: dict[str, Any]) -> tuple[int, int]:
        """(p, N) for one request: what ``choose_batch`` gives for a batch of one, without building one."""
        self._set_available(observation["available"])
        c = int(observation["context"])
        p = _best_prompt(self._scaled, self._fade(), self.width * self._scale, math.log(self.t + 2), self._tie,
                         self._res_sum[c], self._res_n, self._shift_prior, self.served, self._blocked, self.value[c])
        if p >= 0:
            return p, int(self.best_n[c, p])
        bonus = self._index()  # a never-served prompt is due (its index is +inf): the entry round's order
        bonus[self._blocked] = -np.inf
        if np.isposinf(bonus).any():
            fresh = np.flatnonzero(np.isposinf(bonus))
            p = int(fresh[self._next_new % fresh.size])
            self._next_new += 1
            return p, self._entry
        p = int((self.value[c] + self._shift()[c] + bonus).argmax())
        return p, int(self.best_n[c, p])

    # ---- learning -------------------------------------------------------------------------------
    def update_batch(self, requests: Requests, served: Served) -> None:
        """Detect changes on the batch's residuals, log its pulls, refit when due."""
        pulls, contexts, start = served.pulls, requests.contexts, requests.start
        b = contexts.size
        detected: dict[int, int] = {}
        fade_now = self._fade()
        read = self.read[pulls.prompts]
        utilities = np.ascontiguousarray(np.asarray(served.utilities, dtype=np.float64).T)  # (B, C)
        if read.any():
            idx = np.flatnonzero(read)
            prompts = pulls.prompts[idx]
            residuals = utilities[idx] - self.q[:, prompts, pulls.ns[idx] - 1].T  # (b, C)
            for i, p, t in zip(range(idx.size), prompts.tolist(), (idx + start).tolist(), strict=True):
                since = self._cusum(p, residuals[i], int(contexts[idx[i]]), t, fade_now)
                if since >= 0 and p not in detected:
                    detected[p] = since
        steps = np.arange(start, start + b)
        self.log.add(steps, pulls, utilities)
        self._pending.add(steps, pulls, utilities)
        ns = pulls.ns.astype(np.float64)
        self.t = start + b
        np.add.at(self.completions, pulls.prompts, ns)
        np.add.at(self._scaled, pulls.prompts, 1.0 / fade_now)
        self.served[pulls.prompts] = True
        self._n_served = int(self.served.sum())
        self._drawn += float(ns.sum())
        self._after(detected)

    def update(self, observation: dict[str, Any], action: tuple[int, int], info: dict[str, Any]) -> None:
        """One served request (``OnlineEnv.step``'s ``info``): what ``update_batch`` does with a batch of one, on
        scalars (the one-request path of a plain Gymnasium loop)."""
        p, n = int(action[0]), int(action[1])
        atoms = np.asarray(info["atoms"], dtype=np.int64)
        if atoms.size != n:
            raise ValueError(f"info holds {atoms.size} outcomes, not the N = {n} of the action {action!r}")
        c, t = int(observation["context"]), int(info["t"])
        detected: dict[int, int] = {}
        fade_now = self._fade()
        utilities = np.asarray(info["utilities"], dtype=np.float64)
        if self.read[p]:
            since = self._cusum(p, utilities - self.q[:, p, n - 1], c, t, fade_now)
            if since >= 0:
                detected[p] = since
        q = int(info["query"])
        self.log.add_one(t, p, n, q, atoms, utilities)
        self._pending.add_one(t, p, n, q, atoms, utilities)
        self.t = t + 1
        self.completions[p] += n
        self._scaled[p] += 1.0 / fade_now
        if not self.served[p]:
            self.served[p] = True
            self._n_served += 1
        self._drawn += n
        self._after(detected)

    def _after(self, detected: dict[int, int]) -> None:
        """After a request or batch is counted: forget on a detection, else refit when due."""
        if self._fade() < 1.0 / _RESCALE:  # keep the lazily faded counts in range
            fade = self._fade()
            self._scaled *= fade
            self._res_sum *= fade
            self._ref_ss *= fade
            self._ref_n *= fade
            self._res_n *= fade
            self._t0 = self.t
        if detected:
            self._forget(list(detected.items()))
            return
        if self._drawn - self._fitted_total >= self.refit * self._fitted_total:
            if (self.served | self._blocked).all():  # after the entry round
                self._refit()
        elif self._n_served > self._n_read and (self.served | self._blocked).all():  # the entry round is over: read its prompts
            self._refit()

    def _cusum(self, p: int, residuals: np.ndarray, c: int, t: int, fade: float) -> int:
        """Feed one pull's residuals (C,) (prompt ``p``, request ``t`` of context ``c``) to the shifts s_cp, and its
        residual under ``c`` less s_cp before it to the prompt's two CUSUMs: the change estimate (the crossing side's
        last zero) when one crosses ``threshold``, else -1."""
        s_n = self._res_n[p]
        centred = float(residuals[c]) - float(self._res_sum[c, p]) * fade / (s_n * fade + self._shift_prior)
        self._res_n[p] = s_n + 1.0 / fade
        self._res_sum[:, p] += residuals / fade
        self._pool_n += 1
        self._res_ss += centred * centred
        if self._pool_n < ARM_RESIDUALS or self._res_ss <= 0.0:
            return -1
        var = self._res_ss / self._pool_n
        self._shift_prior = var / self.bias_sd ** 2 if self.bias_sd > 0.0 else _NO_SHIFT
        self._scale = math.sqrt(var)
        # in the prompt's own residual sd under c as of the last refit (the residuals before a change, not those
        # after), with the pooled variance counted as ARM_RESIDUALS residuals: a prompt whose utilities spread wider
        # than the pool's (a high N of best-of-N) walked its CUSUM past the threshold on a stationary table
        own = (float(self._ref_ss[c, p]) * fade + ARM_RESIDUALS * var) / (self._ref_n[p] * fade + ARM_RESIDUALS)
        x = centred / math.sqrt(own)
        k = self.slack
        u = self._up[p] + x - k
        if u <= 0.0:
            u, self._up_zero[p] = 0.0, t + 1
        d = self._down[p] - x - k
        if d <= 0.0:
            d, self._down_zero[p] = 0.0, t + 1
        self._up[p], self._down[p] = u, d
        if u > self.threshold:
            return self._up_zero[p]
        if d > self.threshold:
            return self._down_zero[p]
        return -1

    def _forget(self, detected: list[tuple[int, int]]) -> None:
        """Drop each detected prompt's completions before its change estimate; rebuild the estimate from the rest."""
        steps, pulls = self.log.read()
        keep = np.ones(steps.size, dtype=bool)
        for p, since in detected:
            keep &= ~((pulls.prompts == p) & (steps < since))
            self.changes.append((self.t, p, since))
        if self.t > self._origin:
            self._phi_origin, self._origin = self._phi(self.t), self.t
            self._origins.append(self._origin)
            self._phi_origins.append(self._phi_origin)
        self.log.keep(keep)
        steps, pulls = self.log.read()
        self.est = PlugInEstimator(self._base, alpha=32.0 * self.prior, bon_prior=self.prior)
        ns = pulls.ns.astype(np.float64)
        self.completions = np.bincount(pulls.prompts, weights=ns, minlength=self.completions.size).astype(np.float64)
        self._scaled = np.bincount(pulls.prompts, weights=self._weights(steps, self.t),
                                   minlength=self.completions.size).astype(np.float64)
        self._t0 = self.t
        self.served = self.completions > 0
        self._n_served = int(self.served.sum())
        self.read[:] = False
        self._n_read = 0
        self._drawn = float(ns.sum())
        self._pending.clear()
        self._pending.add(steps, pulls, self.log.utilities())
        self._refit()

    def _refit(self) -> None:
        """Move every pending pull into the estimator and read the estimates of the prompts they touched; every
        CUSUM starts over (the residuals' reference moved)."""
        self._fitted_total = self._drawn
        n_p = len(self._up)
        self._up, self._down = [0.0] * n_p, [0.0] * n_p
        self._up_zero, self._down_zero = [self.t] * n_p, [self.t] * n_p
        if not self._pending:
            return
        _, pulls = self._pending.read()
        self._pending.clear()
        if len(pulls) == 0:
            return
        self.est.update(pulls)
        prompts = np.unique(pulls.prompts)
        q = self.est.table.sums[:, prompts, :]  # the estimator's estimates of the pulled prompts (counts are 1)
        self.q[:, prompts, :] = q
        best = q.argmax(axis=2)
        self.best_n[:, prompts] = best + 1
        self.value[:, prompts] = np.take_along_axis(q, best[..., None], axis=2)[..., 0]
        self.read[prompts] = True
        self._n_read = int(self.read.sum())
        self._residual_stats()

    def _residual_stats(self) -> None:
        """Each prompt's residuals (utility served minus the new estimate Q^(c, p, N)) over every logged request,
        faded as the counts: the shift s_cp measures the estimate's bias on what the prompt served
        (the prior's pull on a prompt with few completions), so it does not start over at a refit."""
        steps, pulls = self.log.read()
        n_c, n_p = self._res_sum.shape
        self._res_sum, self._res_n = np.zeros((n_c, n_p)), np.zeros(n_p)
        self._ref_ss, self._ref_n = np.zeros((n_c, n_p)), np.zeros(n_p)
        if steps.size == 0:
            return
        weights = self._weights(steps, self._t0)  # scaled as ``_scaled``
        residuals = self.log.utilities() - self.q[:, pulls.prompts, pulls.ns - 1].T  # (B, C)
        for c in range(n_c):
            self._res_sum[c] = np.bincount(pulls.prompts, weights=weights * residuals[:, c], minlength=n_p)
            self._ref_ss[c] = np.bincount(pulls.prompts, weights=weights * residuals[:, c] ** 2, minlength=n_p)
        self._res_n = np.bincount(pulls.prompts, weights=weights, minlength=n_p).astype(np.float64)
        self._ref_n = self._res_n.copy()
        seen = self._res_n > 0.0  # the sums of squares about each (context, prompt)'s mean
        self._ref_ss[:, seen] -= self._res_sum[:, seen] ** 2 / self._res_n[seen]
        np.maximum(self._ref_ss, 0.0, out=self._ref_ss)
