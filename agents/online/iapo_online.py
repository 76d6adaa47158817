"""``IAPOOnline`` (``iapo_online``), the recommended online agent: ``auto``'s plug-in estimate, served by UCB over
prompts, refitted on a doubling schedule, with a change detector for drift and optimistic entry for new prompts.

* **Estimate.** Every completion served goes into ``agents.plugin.PlugInEstimator``, the estimator of ``auto``: per
  (prompt, query) outcome distributions read through the oracle's exact formulas with a prior shared across queries and
  prompts, so one pull informs every context (cross-context reuse) and every N (nested reuse); on majority vote
  without ``auto``'s correction by the unbiased reading (``mv_correction=False``: served one request's votes at a
  time, the corrected estimate let the regret stop falling on ``mv_many_queries`` level 0). The estimate is
  refitted when the completions served since the last refit reach those before (a doubling schedule, about log2 of
  the completions refits in a run), never per request: a refit costs as much as thousands of requests.
* **Warm start.** Before request 0 ``plugin_anytime`` (``auto`` on majority vote; the agent this one was tuned with)
  spends ``budget`` completions on the train split (as ``ExploreThenCommit`` trains, with the same seeds: the same
  completions). Its estimate Q_off of each prompt it read enters as k_p = 1 / (1 / q_p + 1 / Q_train + 1 / Q_test)
  requests served at step 0, faded as every request, q_p the train queries it read the prompt on and Q_train, Q_test
  the splits' sizes: a prompt's value on the train split differs from its value on the run's queries by the sampling
  of both splits' queries, so a prompt read on a few queries counts as about that many requests and one read on many
  as at most the splits allow. A read prompt's estimate is (k_p (Q_off + d_c) + n_p Q^) / (k_p + n_p) with n_p its
  faded requests (Q_off + d_c before the prompt is served), and d_c, per context, the mean over every served pull of a
  warm prompt of its utility less Q_off at its N, shrunk to 0 by ``ARM_RESIDUALS`` pulls: the run's queries as a whole
  are easier or harder than the train split's (by 0.1-0.25 on tuning levels of the families with few queries), and
  without it a prompt known only from the train split is compared with served ones on another scale. A warm prompt
  needs no entry requests; a prompt that arrives, or every prompt after a detected change (the prior is dropped),
  enters as without the warm start.
* **Choice.** For a request of context c, each available prompt p scores ``max_N Q^(c, p, N) + s_cp + width *
  sigma * sqrt(log(t + 2) / n_p)`` with n_p the requests the prompt served, faded, and sigma the pooled sd of the
  residuals; the request gets the best prompt at its best N. Within a batch each earlier choice counts as a request
  served (n_p one higher, t one later), so a batch spreads over the prompts as one-at-a-time choices would; given
  all to the one prompt whose index topped, a batch of 16 went to prompts 0.4-0.6 below the best early in a run.
  The fading makes a prompt not served for a while worth a look again, so a prompt that drifted while unserved is
  re-examined. A request s counts exp(phi(s) - phi(t)) at
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
* **Optimistic entry.** A prompt with fewer than ``ENTRY_REQUESTS`` (2) requests served (at the start, one that
  arrives, or one whose completions were all forgotten) comes before every other, at N = ``entry_n``, the fewest
  served first: one request's completions are on one query and read a prompt far below its value at times (0.32
  against 0.86). The estimate is first read once every available prompt is through its entry; a prompt that enters
  later is read as soon as it is.
* **Early reads.** Between refits, a prompt whose completions have doubled since its last read is read again at
  once (its pending pulls go into the estimator; its estimates, shifts and residual sds are re-read), not judged
  on its first few completions until the next doubling of every completion, thousands of requests later.
* **Change detector.** Each served request's residual under its context less the prompt's shift s_cp before it
  (the prompt's own recent mean, so the estimate's bias is not taken for a change), over the prompt's own residual
  sd under that context as of the last refit (its faded residuals' sd about their mean then, so not inflated by a
  change since, with the pooled variance sigma^2 counted as ``ARM_RESIDUALS`` residuals: a best-of-N prompt served
  at a high N spreads wider than the pool, and in pooled sds its CUSUM walked past the threshold on a stationary
  table), feeds a two-sided CUSUM per prompt (slack ``slack``, threshold ``threshold``; every CUSUM starts over at
  a refit). Its change estimate is the crossing side's last zero.
* **Read test.** Before a prompt is read (a refit, an early read), and every ``TEST_EVERY`` requests, its utilities
  since its last read are compared with those before, per N and context (``agents.online._read_test``): a served
  prompt's shift and early reads can absorb a change its CUSUM never sees. A change is dated where they shift.
* **Forgetting.** On a change (either detector) every prompt's completions before its estimated start (the
  earliest of a batch's detections; a detected prompt's own, if later) are forgotten, the estimator rebuilt from
  the rest; a prompt with none left enters again, and the fading's window restarts (above). Every prompt's: a drift
  moves a quarter to three quarters of them, and one not served since kept its old estimate otherwise.

Everything runs on the env's schema (``OnlineEnv.schema``); the estimator's env is an ``IAPOEnv`` on that schema
whose completion source refuses to draw: the online env serves every completion.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import numpy as np

from agents.base import make
from agents.online._iapo_kernels import ARM_RESIDUALS, ENTRY_REQUESTS, MIN_COUNT, NO_SHIFT, best_prompts, feed_cusums
from agents.online._read_test import TEST_EVERY, read_test
from agents.online.explore_commit import ExploreThenCommit
from agents.online.served_log import ServedElsewhere, ServedLog, select_pulls
from agents.plugin.anytime import AnytimePlugIn
from agents.plugin.estimator import PlugInEstimator, check_nonnegative, warm_up
from iapo_gym.env import IAPOEnv, Pulls
from iapo_gym.online import OnlineAgentBase, OnlineEnv, Requests, Served
from iapo_gym.seeding import derive_seed

#: ``budget``'s default: explore-then-commit's offline budget (what ``iapo-gym optimize`` spends before ``serve``),
#: read from its signature so that both agents start from one number.
OFFLINE_BUDGET: int = inspect.signature(ExploreThenCommit.__init__).parameters["budget"].default
#: The lazily faded counts are renormalized when their scale passes this.
_RESCALE = 1e150


class IAPOOnline(OnlineAgentBase):
    """UCB over prompts on ``auto``'s plug-in estimate, with a CUSUM change detector and optimistic entry.

    :param width: exploration weight of a prompt's confidence width sigma * sqrt(log(t + 2) / n_p) (residual sds).
    :param memory: n_p fades over a window of ``memory`` * sqrt(t - o) requests, o the last detection (inf: none).
    :param threshold: CUSUM threshold (in the prompt's residual sds) at which its older completions are forgotten.
    :param slack: CUSUM slack (in the prompt's residual sds): smaller shifts of its mean utility go undetected.
    :param entry_n: N of an entering prompt's ``ENTRY_REQUESTS`` pulls (optimistic entry; capped at N_max).
    :param prior: weight of the estimator's shared prior, times ``auto``'s (``alpha`` 32 pseudo-votes, ``bon_prior`` 1).
    :param bias_sd: prior sd of the estimate's bias per (context, prompt) (utility units; 0: no shift s_cp).
    :param budget: completions ``plugin_anytime`` spends on the train split before request 0 (warm start; 0: none).
    """

    def __init__(self, seed: int | None = None, width: float = 0.5, memory: float = 200.0, threshold: float = 50.0,
                 slack: float = 0.25, entry_n: int = 8, prior: float = 0.1, bias_sd: float = 0.05,
                 budget: int = OFFLINE_BUDGET) -> None:
        """Hyper-parameters as documented on the class; ``seed`` for ties."""
        super().__init__(seed)
        self.width, self.threshold, self.slack, self.prior, self.bias_sd = check_nonnegative(
            width=width, threshold=threshold, slack=slack, prior=prior, bias_sd=bias_sd)
        if isinstance(memory, bool) or not float(memory) > 0.0:
            raise ValueError(f"memory must be a number > 0 (inf: no fading), got {memory!r}")
        if isinstance(entry_n, bool) or not isinstance(entry_n, (int, np.integer)) or entry_n < 1:
            raise ValueError(f"entry_n must be an integer >= 1, got {entry_n!r}")
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
            raise ValueError(f"budget must be an integer >= 0 (completions before request 0), got {budget!r}")
        self.memory, self.entry_n, self.budget = float(memory), int(entry_n), int(budget)
        self._rate = 2.0 / self.memory  # phi(t) = _rate * sqrt(t) (0 at memory = inf)
        warm_up()

    def params(self) -> dict[str, Any]:
        """The hyper-parameters."""
        return {"width": self.width, "memory": self.memory, "threshold": self.threshold, "slack": self.slack,
                "entry_n": self.entry_n, "prior": self.prior, "bias_sd": self.bias_sd, "budget": self.budget}

    # ---- state ----------------------------------------------------------------------------------
    def start(self, env: OnlineEnv, seed: int) -> None:
        """Empty estimate over the env's schema, then the warm start (``budget`` > 0)."""
        super().start(env, seed)
        self.schema = env.schema
        self._base = IAPOEnv(table=self.schema, source=ServedElsewhere(), split=env.split)
        n_c, n_p, n_max = self.schema.n_contexts, self.schema.n_prompts, self.schema.n_max
        self._entry = min(self.entry_n, n_max)
        self.est = PlugInEstimator(self._base, alpha=32.0 * self.prior, bon_prior=self.prior, mv_correction=False)
        self.log = ServedLog()
        self._pending = ServedLog()  # served, not yet in the estimator
        self.value = np.zeros((n_c, n_p))  # max_N of the estimate (0 until a prompt is read)
        self.best_n = np.full((n_c, n_p), self._entry, dtype=np.int64)
        self.q = np.zeros((n_c, n_p, n_max))
        self.entries = np.zeros(n_p, dtype=np.int64)  # requests each prompt served (kept ones; warm: through entry)
        self.read = np.zeros(n_p, dtype=bool)  # prompts with an estimate
        self.completions = np.zeros(n_p)  # completions of each prompt (kept ones)
        self._read_at = np.zeros(n_p)  # each prompt's completions when its estimate was last read
        self._read_step = np.zeros(n_p, dtype=np.int64)  # the step at which each prompt's estimate was last read
        self._drawn = 0.0  # completions kept (in the estimator or pending)
        self._fitted_total = 0.0  # completions kept at the last refit
        self._scaled = np.zeros(n_p)  # faded counts, times exp(phi(t) - phi(_t0))
        self._t0 = 0
        # phi's pieces: it restarts growing like 2 sqrt(t - o) / memory at each detection o (the window is short again)
        self._origin, self._phi_origin = 0, 0.0
        self._origins, self._phi_origins = [0], [0.0]
        self._tie = self.rng.random(n_p) * 1e-12  # a fixed random order among equal indices
        self.t = 0
        self._next_test = TEST_EVERY
        self._first_read = False  # the entry round is over and the estimate was read
        # the change detector: pooled residual moments, per prompt two CUSUMs and their last zeros
        # residuals pooled, their sum of squares, the shift prior sigma^2 / bias_sd^2 and the width's unit sigma once
        # the pooled residual sd sigma is read (``NO_SHIFT`` and 1 before)
        self._pool = np.array([0.0, 0.0, NO_SHIFT, 1.0])
        self._res_sum = np.zeros((n_c, n_p))  # per (context, prompt): faded residual sum, scaled as ``_scaled``
        self._res_n = np.zeros(n_p)  # per prompt: its faded residual count, scaled as ``_scaled``
        # per (context, prompt) at the last refit: the faded sum of squared residuals about their mean, and per prompt
        # their faded count, scaled as ``_scaled``: the prompt's own residual variance, read by the change detector
        self._ref_ss, self._ref_n = np.zeros((n_c, n_p)), np.zeros(n_p)
        self._up, self._down = np.zeros(n_p), np.zeros(n_p)
        self._up_zero, self._down_zero = np.zeros(n_p, dtype=np.int64), np.zeros(n_p, dtype=np.int64)
        self._since = np.zeros(1, dtype=np.int64)
        self.changes: list[tuple[int, int, int]] = []  # (step detected, prompt, change estimate)
        self._avail_key = b""
        self._blocked = np.zeros(n_p, dtype=bool)
        # one request's buffers: its context, prompt and N in ``choose``; its prompt, context and step in ``update``
        self._one, self._one_p, self._one_n = (np.zeros(1, dtype=np.int64) for _ in range(3))
        self._fed_p, self._fed_c, self._fed_t = (np.zeros(1, dtype=np.int64) for _ in range(3))
        # the warm start: each prompt's k_p (scaled as ``_scaled``; 0 without one), Q_off and the offset d_c
        self._prior, self._q_off, self._offset = np.zeros(n_p), np.zeros((n_c, n_p, n_max)), np.zeros(n_c)
        if self.budget > 0:
            self._warm_start(env, seed)

    def _warm_start(self, env: OnlineEnv, seed: int) -> None:
        """``plugin_anytime``'s estimate after ``budget`` offline completions, each read prompt as k_p requests."""
        # explore-then-commit's training (``ExploreThenCommit.start``): its env and generator seeded alike, so the
        # warm start reads the completions explore-then-commit's policy was chosen on
        offline, keep = env.offline_env("train", seed=derive_seed(seed, "offline env"))
        learner = make("plugin_anytime", seed=derive_seed(seed, "offline agent"))
        learner.train(offline, self.budget)
        assert isinstance(learner, AnytimePlugIn) and learner.last_tail is not None
        est = learner.last_tail.estimator
        reads = est.seen(np.arange(keep.size)).sum(axis=1).astype(np.float64)  # q_p
        ok = reads > 0
        warm = keep[ok]
        self._q_off[:, warm] = est.mean()[:, ok]
        self._prior[warm] = 1.0 / (1.0 / reads[ok] + 1.0 / offline.queries("train").size
                                   + 1.0 / offline.queries("test").size)
        self._scaled[warm] += self._prior[warm]
        self.entries[warm] = ENTRY_REQUESTS
        self.read[warm] = True
        self._store(warm)

    @property
    def served(self) -> np.ndarray:
        """(P,) whether each prompt has served a request (one kept since its completions were last forgotten)."""
        return self.completions > 0

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

    def _set_available(self, available: np.ndarray) -> None:
        key = available.tobytes()
        if key != self._avail_key:
            self._avail_key = key
            self._blocked = ~np.asarray(available, dtype=bool)

    # ---- choosing -------------------------------------------------------------------------------
    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        """Per request the best available prompt by estimate plus width at its best N, each earlier choice of the
        batch counted as a request served; entering prompts first (``_iapo_kernels.best_prompts``)."""
        self._set_available(requests.available)
        contexts = np.ascontiguousarray(requests.contexts, dtype=np.int64)
        prompts = np.empty(contexts.size, dtype=np.int64)
        ns = np.empty(contexts.size, dtype=np.int64)
        self._choose(contexts, prompts, ns)
        return prompts, ns

    def choose(self, observation: dict[str, Any]) -> tuple[int, int]:
        """(p, N) for one request: ``choose_batch`` for a batch of one."""
        self._set_available(observation["available"])
        self._one[0] = int(observation["context"])
        self._choose(self._one, self._one_p, self._one_n)
        return int(self._one_p[0]), int(self._one_n[0])

    def _choose(self, contexts: np.ndarray, prompts: np.ndarray, ns: np.ndarray) -> None:
        best_prompts(contexts, self._scaled, self._fade(), self.width * self._pool[3], self.t, self._tie,
                     self._res_sum, self._res_n, self._pool[2], self.entries, self.read, self._blocked,
                     self.value, self.best_n, self._entry, prompts, ns)

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
            since = np.empty(idx.size, dtype=np.int64)
            self._feed(prompts, np.ascontiguousarray(contexts[idx], dtype=np.int64), idx + start, residuals,
                       fade_now, since)
            for i in np.flatnonzero(since >= 0).tolist():
                detected.setdefault(int(prompts[i]), int(since[i]))
        steps = np.arange(start, start + b)
        self.log.add(steps, pulls, utilities)
        self._pending.add(steps, pulls, utilities)
        ns = pulls.ns.astype(np.float64)
        self.t = start + b
        np.add.at(self.completions, pulls.prompts, ns)
        np.add.at(self._scaled, pulls.prompts, 1.0 / fade_now)
        np.add.at(self.entries, pulls.prompts, 1)
        self._drawn += float(ns.sum())
        self._after(detected, np.unique(pulls.prompts))

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
            self._fed_p[0], self._fed_c[0], self._fed_t[0] = p, c, t
            self._feed(self._fed_p, self._fed_c, self._fed_t, (utilities - self.q[:, p, n - 1])[None, :], fade_now,
                       self._since)
            if self._since[0] >= 0:
                detected[p] = int(self._since[0])
        q = int(info["query"])
        self.log.add_one(t, p, n, q, atoms, utilities)
        self._pending.add_one(t, p, n, q, atoms, utilities)
        self.t = t + 1
        self.completions[p] += n
        self._scaled[p] += 1.0 / fade_now
        self.entries[p] += 1
        self._drawn += n
        self._after(detected, p)

    def _after(self, detected: dict[int, int], touched: np.ndarray | int) -> None:
        """After a request or batch is counted (``touched``: the prompts it served): forget on a CUSUM's detection;
        else the first read once every available prompt is through its entry, a refit when due, or an early read of
        the touched prompts whose completions doubled since their last read (or that just finished their entry), each
        after its read test."""
        fade = self._fade()
        if fade < 1.0 / _RESCALE:  # keep the lazily faded counts in range
            self._scaled *= fade
            self._prior *= fade
            self._res_sum *= fade
            self._ref_ss *= fade
            self._ref_n *= fade
            self._res_n *= fade
            self._t0 = self.t
        if detected:
            self._forget(list(detected.items()))
        elif not self._first_read:
            if ((self.entries >= ENTRY_REQUESTS) | self._blocked).all():  # the entry round is over
                self._first_read = True
                self._refit()
        elif self._drawn >= 2.0 * self._fitted_total:
            self._test_then_read(None)
        elif isinstance(touched, int):  # one request: scalars
            if self._due(touched):
                self._one[0] = touched
                self._test_then_read(self._one)
        else:
            due = touched[self._due(touched)]
            if due.size:
                self._test_then_read(due)
        if self._first_read and not detected and self.t >= self._next_test:  # the read test between reads
            self._next_test = self.t + TEST_EVERY
            found = self._read_test(self.read & (self.completions > self._read_at))
            if found:
                self._forget(list(found.items()))

    def _test_then_read(self, prompts: np.ndarray | None) -> None:
        """The read test of ``prompts`` (None: every read prompt, at a refit of the whole estimate); on a change,
        forget, else the refit or their early read."""
        detected = self._read_test(self.read if prompts is None else np.isin(np.arange(self.read.size), prompts))
        if detected:
            self._forget(list(detected.items()))
        elif prompts is None:
            self._refit()
        else:
            self._read_early(prompts)

    def _due(self, prompts: Any) -> Any:
        """Whether ``prompts`` (array or int) are due for an early read: entered, completions doubled since read."""
        return (self.entries[prompts] >= ENTRY_REQUESTS) & (self.completions[prompts] >= 2.0 * self._read_at[prompts])

    def _feed(self, prompts: np.ndarray, contexts: np.ndarray, steps: np.ndarray, residuals: np.ndarray,
              fade: float, since: np.ndarray) -> None:
        """Feed pulls' residuals (b, C) to the shifts s_cp and to their prompts' CUSUMs (``feed_cusums``)."""
        feed_cusums(prompts, contexts, steps, np.ascontiguousarray(residuals, dtype=np.float64), fade, self._res_n,
                    self._res_sum, self._ref_ss, self._ref_n, self._up, self._down, self._up_zero, self._down_zero,
                    self._pool, self.slack, self.threshold, self.bias_sd, since)

    def _read_test(self, prompts: np.ndarray) -> dict[int, int]:
        """``read_test`` of ``prompts`` (P,) bool on the log (none before the pooled residual sd is read)."""
        steps, pulls = self.log.read()
        if steps.size == 0 or self._pool[0] < ARM_RESIDUALS or self._pool[1] <= 0.0:
            return {}
        return read_test(steps, pulls, self.log.utilities(), prompts, self._read_step, self.q.shape[2],
                         self._pool[1] / self._pool[0])

    def _forget(self, detected: list[tuple[int, int]]) -> None:
        """Drop every prompt's completions before the earliest change estimate of ``detected`` ((prompt, estimate)
        pairs), and each detected prompt's before its own; rebuild the estimate from the rest."""
        steps, pulls = self.log.read()
        keep = steps >= min(since for _, since in detected)
        for p, since in detected:
            keep &= ~((pulls.prompts == p) & (steps < since))
            self.changes.append((self.t, p, since))
        if self.t > self._origin:
            self._phi_origin, self._origin = self._phi(self.t), self.t
            self._origins.append(self._origin)
            self._phi_origins.append(self._phi_origin)
        self.log.keep(keep)
        steps, pulls = self.log.read()
        self.est = PlugInEstimator(self._base, alpha=32.0 * self.prior, bon_prior=self.prior, mv_correction=False)
        ns = pulls.ns.astype(np.float64)
        self.completions = np.bincount(pulls.prompts, weights=ns, minlength=self.completions.size).astype(np.float64)
        self._scaled = np.bincount(pulls.prompts, weights=self._weights(steps, self.t),
                                   minlength=self.completions.size).astype(np.float64)
        self._t0 = self.t
        self.entries = np.bincount(pulls.prompts, minlength=self.completions.size).astype(np.int64)
        self._prior[:] = 0.0  # the warm start's prior is dropped with the completions before a change
        self.read[:] = False
        self._read_at[:] = 0.0
        self._read_step[:] = self.t
        self._drawn = float(ns.sum())
        self._pending.clear()
        self._pending.add(steps, pulls, self.log.utilities())
        self._refit()

    def _refit(self) -> None:
        """Move every pending pull into the estimator and read the estimates of the prompts they touched; every
        CUSUM starts over (the residuals' reference moved)."""
        self._fitted_total = self._drawn
        self._up[:] = self._down[:] = 0.0
        self._up_zero[:] = self._down_zero[:] = self.t
        if not self._pending:
            return
        _, pulls = self._pending.read()
        self._pending.clear()
        if len(pulls) == 0:
            return
        self._read_pulls(pulls)
        if self._prior.any():  # the offset moved: every warm prompt's estimate
            self._store(np.flatnonzero(self._prior > 0))
        self._residual_stats()

    def _read_early(self, prompts: np.ndarray) -> None:
        """Move the pending pulls of ``prompts`` alone into the estimator and read their estimates, shifts and
        residual sds; their CUSUMs start over. The rest waits for the next refit of the whole estimate: between
        refits (a doubling of every completion) a prompt's first reads would otherwise stay on its first few."""
        _, pulls = self._pending.read()
        mask = np.isin(pulls.prompts, prompts)
        if not mask.any():
            return
        self._pending.keep(~mask)
        self._read_pulls(select_pulls(pulls, mask))
        self._residual_stats(prompts)
        self._up[prompts] = self._down[prompts] = 0.0
        self._up_zero[prompts] = self._down_zero[prompts] = self.t

    def _read_pulls(self, pulls: Pulls) -> None:
        """Add ``pulls`` to the estimator and read the estimates of the prompts they touch."""
        self.est.update(pulls)
        prompts = np.unique(pulls.prompts)
        if self._prior[prompts].any():
            self._read_offset()
        self.read[prompts] = True
        self._read_at[prompts] = self.completions[prompts]
        self._read_step[prompts] = self.t
        self._store(prompts)

    def _store(self, prompts: np.ndarray) -> None:
        """Q^ of ``prompts`` into ``q``, ``best_n`` and ``value``: the estimator's (its counts are 1 once a prompt is
        pulled), blended with a warm prompt's Q_off + d_c by k_p : n_p (the fading cancels in the ratio)."""
        q = self.est.table.sums[:, prompts, :].copy()
        prior = self._prior[prompts]
        if prior.any():
            pulled = self.est.table.counts[0, prompts, 0] > 0
            share = np.where(pulled, prior / np.maximum(self._scaled[prompts], MIN_COUNT), 1.0)[None, :, None]
            q = share * (self._q_off[:, prompts, :] + self._offset[:, None, None]) + (1.0 - share) * q
        self.q[:, prompts, :] = q
        best = q.argmax(axis=2)
        self.best_n[:, prompts] = best + 1
        self.value[:, prompts] = np.take_along_axis(q, best[..., None], axis=2)[..., 0]

    def _read_offset(self) -> None:
        """d_c: the mean over every logged pull of a warm prompt of its utility under c less Q_off(c, p, N), shrunk
        to 0 by ``ARM_RESIDUALS`` pulls."""
        _, pulls = self.log.read()
        rows = self._prior[pulls.prompts] > 0
        if rows.any():
            residuals = self.log.utilities()[rows] - self._q_off[:, pulls.prompts[rows], pulls.ns[rows] - 1].T
            self._offset = residuals.sum(axis=0) / (rows.sum() + ARM_RESIDUALS)

    def _residual_stats(self, prompts: np.ndarray | None = None) -> None:
        """The residuals (utility served minus the estimate Q^(c, p, N)) of ``prompts`` (None: every prompt) over
        every logged request, faded as the counts: the shift s_cp measures the estimate's bias on what the prompt
        served (the prior's pull on a prompt with few completions), so it does not start over at a read."""
        steps, pulls = self.log.read()
        utilities = self.log.utilities()
        n_c, n_p = self._res_sum.shape
        served, ns = pulls.prompts, pulls.ns
        if prompts is not None:
            rows = np.isin(served, prompts)
            steps, utilities, served, ns = steps[rows], utilities[rows], served[rows], ns[rows]
        res_sum, ref_ss = np.zeros((n_c, n_p)), np.zeros((n_c, n_p))
        if steps.size:
            weights = self._weights(steps, self._t0)  # scaled as ``_scaled``
            residuals = utilities - self.q[:, served, ns - 1].T  # (B, C)
            for c in range(n_c):
                res_sum[c] = np.bincount(served, weights=weights * residuals[:, c], minlength=n_p)
                ref_ss[c] = np.bincount(served, weights=weights * residuals[:, c] ** 2, minlength=n_p)
            res_n = np.bincount(served, weights=weights, minlength=n_p).astype(np.float64)
        else:
            res_n = np.zeros(n_p)
        seen = res_n > 0.0  # the sums of squares about each (context, prompt)'s mean
        ref_ss[:, seen] -= res_sum[:, seen] ** 2 / res_n[seen]
        np.maximum(ref_ss, 0.0, out=ref_ss)
        cols = slice(None) if prompts is None else prompts
        self._res_sum[:, cols], self._ref_ss[:, cols] = res_sum[:, cols], ref_ss[:, cols]
        self._res_n[cols] = res_n[cols]
        self._ref_n[cols] = res_n[cols]
