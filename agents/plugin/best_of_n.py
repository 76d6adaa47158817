"""``PlugInEstimator``'s Best-of-N value: each query's own expected max of N shrunk towards the location-scale
reading, corrected by the unbiased reading, on a reference's queries (docs/agents.md, "auto", item 2, whose
names the code uses: V_ls the location-scale reading R, w_pqN the own reading's weight, U the unbiased reading,
m = min(N, n_pq), lam the correction's weight, D_p the prompt's own shape).
"""

from __future__ import annotations

import numpy as np

from agents.plugin._logit_kernels import threshold_readings
from agents.plugin._max_kernels import segment_readings as _segment_sums
from agents.plugin._scale_kernels import clipped_readings, location_scale_readings
from agents.plugin.common import CORRECTION_QUERIES, held_index
from agents.plugin.location_scale import LocationScaleFit, blocks
from agents.plugin.threshold_logit import Fit, ThresholdLogitFit

#: The Best-of-N pooled readings ``PlugInEstimator`` takes (``bon_reading``), the first the default: the
#: location-scale one alone, or its blend with the threshold-logit one (docs/agents.md, "auto", item 2).
BON_READINGS = ("location_scale", "blend")


def check_bon_reading(bon_reading: str) -> str:
    """``bon_reading`` if it is one of ``BON_READINGS``; else a ValueError naming it."""
    if bon_reading not in BON_READINGS:
        raise ValueError(f"bon_reading must be one of {', '.join(map(repr, BON_READINGS))}, got {bon_reading!r}")
    return bon_reading

#: A prompt's own shape D_p (its standardized residuals pooled over its queries, against the pool over every query)
#: weighs n / (n + SHAPE_DRAWS N) at N for the prompt's n completions. Tuned on the generated tuning levels
#: (research/README.md): the pooled shape rules while a prompt has few draws against N.
SHAPE_DRAWS = 8.0


def score_range(atoms: np.ndarray, objectives: np.ndarray) -> np.ndarray:
    """(2, W) the lowest and highest score ``objectives`` (W, K) can give any outcome of ``atoms`` (..., K): per
    weighting, the corner of the objectives' box of ranges it scores lowest and highest (a min and a max pass over
    each objective's column of the atoms)."""
    k = range(atoms.shape[-1])  # one objective at a time: numpy reduces a strided column faster than an axis-0 (.., K)
    low = np.array([atoms[..., i].min() for i in k]) * objectives
    high = np.array([atoms[..., i].max() for i in k]) * objectives
    return np.stack([np.minimum(low, high).sum(axis=1), np.maximum(low, high).sum(axis=1)])


def segment_readings(scores: np.ndarray, counts: np.ndarray, n_max: int, weight: np.ndarray,
                     bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W, S, n_max) twice: per segment ``bounds[s]:bounds[s + 1]`` of the rows of ``scores`` (W, R, M) with the
    integer draws ``counts`` (R, M), the sum of ``weight`` (R, n_max) x their E[max of N] V(N), and the sum of their
    held gaps U(m) - weight(m) V(m) at m = min(N, the row's draws), U the mean max over N-subsets, in one compiled
    pass (``_max_kernels.segment_readings``)."""
    both = _segment_sums(scores, counts, n_max, weight, bounds)
    return both[0], both[1]


class BestOfNReadings(LocationScaleFit, ThresholdLogitFit):
    """The Best-of-N value of the read prompts (a part of ``PlugInEstimator``)."""

    bon_prior: float
    bon_reading: str
    blend_weight: np.ndarray
    _own: np.ndarray
    _own_held: np.ndarray
    _objective_row: np.ndarray
    _score_range: np.ndarray

    def _own_weight_of(self, completions: np.ndarray) -> np.ndarray:
        """(..., N_max) the weight n / (n + bon_prior N) of a query's own reading at each N, for n completions."""
        n = completions[..., None]
        scale = np.arange(1, self.n_max + 1, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            return np.where(n > 0, n / (n + self.bon_prior * scale), 0.0)

    def _has_draws(self, completions: np.ndarray) -> np.ndarray:
        """(..., N_max) whether n completions of a (prompt, query) reach N (its unbiased reading exists)."""
        return completions[..., None] >= np.arange(1, self.n_max + 1)

    def _add_own(self, pp: np.ndarray, qq: np.ndarray, sign: float) -> None:
        """Add ``sign`` x the own readings of the (prompt, query) pairs ``pp``, ``qq`` (sorted by prompt) at the
        counts they have now to the per-prompt sums: w V_own (the plug-in) and the held gap U(m) - w(m) V_own(m),
        m = min(N, n) (U the unbiased mean max over m-subsets of the n draws). ``update`` takes back each pulled
        pair's readings (sign -1) before adding its completions and adds the new ones (sign +1) after: they are
        recomputed rather than stored, as a store would hold (pairs, weightings, N_max), too much at a thousand
        weightings."""
        completions = self._completions[pp, qq]
        had = completions > 0
        pp, qq, completions = pp[had], qq[had], completions[had]
        if pp.size == 0:
            return
        weight = self._own_weight_of(completions)
        counts = self.atom_counts[pp, qq]  # (pairs, atoms)
        width = max(int((counts > 0).sum(axis=1).max()), self.n_max)
        n_weightings = self._objectives.shape[0]
        for lo, hi in blocks(np.full(pp.size, n_weightings * width)):
            first = lo + np.flatnonzero(np.r_[True, pp[lo + 1:hi] != pp[lo:hi - 1]])
            plug_in_sum, held_sum = self._own_readings(pp[lo:hi], qq[lo:hi], self._objectives, weight[lo:hi],
                                                       np.r_[first - lo, hi - lo])
            self._own[:, pp[first]] += sign * plug_in_sum
            self._own_held[:, pp[first]] += sign * held_sum

    def _own_readings(self, pp: np.ndarray, qq: np.ndarray, objectives: np.ndarray, weight: np.ndarray,
                      bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``segment_readings`` of the drawn (prompt, query) pairs ``pp``, ``qq``, scored by ``objectives`` (W, K):
        per segment ``bounds[s]:bounds[s + 1]`` of the pairs, the sum of ``weight`` (pairs, N_max) x their plug-in
        E[max of N] V and the sum of their held gaps U(m) - weight(m) V(m), m = min(N, the pair's draws), U the
        unbiased mean max over m-subsets."""
        return segment_readings(*self._pair_scores(pp, qq, objectives), self.n_max, weight, bounds)

    def _bon_value(self, prompts: np.ndarray) -> np.ndarray:
        """(C, len(prompts), N_max) the prompts' Best-of-N task value: per query, the shrunk own reading.

        A location-scale reading: score(p, q) = level_p + o_q + scale_p e, e drawn from query q's residual
        distribution, shared by the prompts (``_location_scale``), so the pooled reading of (p, q, N) is
        R = level_p + o_q + scale_p (M_q(N) + s_q D_p(N)), held within the outcomes' score range: M_q(N) the
        expected max of N of q's residuals pooled over every prompt seen on q (scaled by scale_p), s_q q's
        spread, D_p(N) = G_p(N) - G(N) the prompt's own shape against the pool over every query, times
        n / (n + ``SHAPE_DRAWS`` N) for its n. D_p does not depend on which prompts are read with p, so a prompt
        read alone (the tail's last survivor) keeps its own shape; and where a query's pool mixes the prompts as
        the pool over every query does, the excess of the mixture's maximum over its components' cancels between
        M_q and G. With the shrunk reading S(q, N) = R + w_pqN (V_own(p, q, N) - R), w_pqN = n / (n + ``bon_prior``
        N), the value is the mean over the prompt's s seen queries of S(q, N) + lam (U(q, m) - S(q, m)), m = min(N,
        n_pq), U the unbiased mean max over m-subsets (the sample maximum at m = n_pq) and lam = s / (s +
        ``CORRECTION_QUERIES``), less their mean offset, plus the pooled correction (1 - lam) S / (S +
        ``CORRECTION_QUERIES``) delta(N): delta the mean of U(q, m) - S(q, m) over every read prompt's seen queries, S
        of them. Up to a query's draws the correction takes lam of the shrunk reading's bias out; beyond them it keeps
        the bias measured where they end, so the estimate does not bend at n_pq (without it, the plug-in's low bias
        past n reads the large N too low). The bias the prompt's own few queries cannot measure is read from all the
        read prompts' queries, where the readings share it (the pooled scores top out alike). As a query's draws grow,
        w -> 1 and m -> N, so the value tends to the mean over the queries of their own readings less the mean offset,
        which is 0 once every prompt has seen every train query (as the common-query agents' prompts do at large
        budgets). The fit-free parts (w V_own, and U(m) - w(m) V_own(m)) are per-prompt sums kept by ``_add_own``;
        the readings enter as two weighted sums of R per prompt and N, in one kernel pass: the shrunk reading's, weight
        1 - w, and the correction's, - (1 - w) up to n_pq and - (1 - w(n_pq)) on R at n_pq beyond it. A prompt that
        saw other queries than the reference (``_move_to_reference``) then moves onto the reference's queries. With
        ``bon_reading`` "blend", R is alpha R_logit + (1 - alpha) R throughout, R_logit the threshold-logit reading and
        alpha its weight per objective row (``ThresholdLogitFit``).
        """
        level, offsets = self._additive_fit()
        scale, expected, spread, shape = self._location_scale(level, offsets, prompts)  # (W, P), (W, Q, N), (W, Q), (W, P, N)
        n_weightings, scale_n = offsets.shape[0], np.arange(1, self.n_max + 1, dtype=np.float64)
        drawn = self._completions[prompts].sum(axis=1)
        d_p = shape[:, prompts] * (drawn[:, None] / (drawn[:, None] + SHAPE_DRAWS * scale_n))[None]  # D_p(N)
        out = np.empty((n_weightings, prompts.size, self.n_max))
        seen_all = self._seen[prompts]
        cols = np.flatnonzero(seen_all.any(axis=0))  # w is 0 on the other queries
        expected_cols = expected[:, cols]
        low, high = self._score_range  # (W,) each
        offsets_cols, spread_cols = offsets[:, cols], spread[:, cols]
        blend = None
        if self.bon_reading == BON_READINGS[1]:
            logit_fit = self._threshold_fit()
            self.blend_weight = self._blend_weight(logit_fit, prompts, cols, (level, offsets, scale, expected, spread, d_p))
            blend = (logit_fit, self.blend_weight)
        n_seen = seen_all[:, cols].sum(axis=1).astype(np.float64)  # (P,) s_p, each prompt's seen queries
        held_total = np.zeros((n_weightings, self.n_max))  # sum over the prompts of C_p
        for lo, hi in blocks(np.full(prompts.size, max(n_weightings, 1) * cols.size * self.n_max)):
            block = prompts[lo:hi]
            seen = seen_all[lo:hi, cols]
            n_queries = n_seen[lo:hi, None]  # (p, 1) s
            lam = n_queries / (n_queries + CORRECTION_QUERIES)  # (p, 1) the correction's weight
            completions = self._completions[block][:, cols]
            n_pq = np.maximum(completions, 1.0).astype(np.int64)  # (p, q) the draws; R(m) = R(N) up to them
            w_pqn = self._own_weight_of(completions)
            reached = self._has_draws(completions)  # (p, q, N): N <= n_pq, so m = N
            w_at_draws = np.take_along_axis(w_pqn, np.minimum(n_pq, self.n_max)[..., None] - 1, axis=-1)[..., 0]
            # the shrunk reading's (1 - w) on R, and the correction's - (1 - w(m)) on R(m): at N up to n_pq, and
            # at n_pq for every N > n_pq
            weight = np.stack([(seen[:, :, None] - w_pqn) / n_queries[:, :, None], (w_pqn - 1.0) * reached])
            weight_at_draws = np.stack([np.zeros(seen.shape), np.where(seen & (n_pq < self.n_max), w_at_draws - 1.0, 0.0)])
            other = None if blend is None else threshold_readings(blend[0], block, cols, seen, self.n_max)
            shrunk, held = clipped_readings(level[:, block], offsets_cols, scale[:, block], expected_cols, spread_cols,
                                            d_p[:, lo:hi], weight, weight_at_draws, n_pq, seen, low, high, other,
                                            None if blend is None else blend[1])
            held += self._own_held[:, block]  # C_p, the sum over the prompt's queries of U(m) - S(m)
            held_total += held.sum(axis=1)
            out[:, lo:hi] = (shrunk + (self._own[:, block] + lam[None] * held) / n_queries
                             - (seen @ offsets_cols.T).T[:, :, None] / n_queries)
        total = n_seen.sum()  # S
        pooled = held_total / (total + CORRECTION_QUERIES)  # S / (S + K) x delta, delta = sum_p C_p / S
        out += (CORRECTION_QUERIES / (n_seen + CORRECTION_QUERIES))[None, :, None] * pooled[:, None, :]  # (1 - lam)
        self._move_to_reference(out, prompts, seen_all, drawn, (level, offsets, scale, expected, spread, d_p), blend,
                                pooled)
        result: np.ndarray = out[self._objective_row]
        return result

    def _move_to_reference(self, out: np.ndarray, prompts: np.ndarray, seen: np.ndarray, drawn: np.ndarray,
                           fit: tuple[np.ndarray, ...], blend: tuple[Fit, np.ndarray] | None,
                           pooled: np.ndarray) -> None:
        """Move, in place, each value in ``out`` (W, len(prompts), N_max) from its prompt's queries to the reference's:
        add the reference's value on every query it saw less its value on the queries the prompt saw too. A prompt
        that saw exactly the reference's queries is left as it is (every prompt, while all read prompts saw the same
        queries).

        The reference is the read prompt that saw the most queries (then the most completions, then the lowest
        index). A prompt read on fewer queries (one a context trimmed and the tail re-admitted) is then compared
        with the others on the queries they share: how much harder its queries are at each N, beyond what the
        query offsets of the mean scores say, is read from the reference's own draws on them, not counted against
        the prompt (a prompt that shares no query with the reference has nothing to be moved by, and stays).
        The reference's value on a query subset is ``_bon_value``'s formula on that subset (its own
        readings recomputed query by query), one set of sums per distinct subset, in blocks of objective rows.
        ``seen`` (len(prompts), Q) and ``drawn`` (len(prompts),) are the prompts' seen queries and completions;
        ``fit`` is ``_bon_value``'s (level, offsets, scale, expected, spread, shape) of the read prompts, ``blend``
        its threshold-logit fit and blend weights (None: the location-scale reading alone), ``pooled`` (W, N_max) its
        pooled correction S / (S + ``CORRECTION_QUERIES``) delta, which a value on s queries takes 1 - lam of.
        """
        ref = int(np.lexsort((np.arange(prompts.size), -drawn, -seen.sum(axis=1)))[0])
        differs = np.flatnonzero((seen != seen[ref]).any(axis=1))
        if not differs.size:
            return
        level, offsets, scale, expected, spread, d_p = fit
        ref_prompt = int(prompts[ref])
        cols = np.flatnonzero(seen[ref])
        subsets, which = np.unique(seen[differs][:, cols], axis=0, return_inverse=True)
        which = which.reshape(-1)  # the subset of each moved prompt, flat
        subsets = np.vstack([np.ones(cols.size, dtype=bool), subsets]).astype(np.float64)  # (1 + distinct, q)
        completions = self._completions[ref_prompt, cols]
        w_pqn = self._own_weight_of(completions)  # (q, N)
        m_index = held_index(np.maximum(completions, 1.0), self.n_max)  # (q, N) the index of m = min(N, n)
        n_queries = subsets.sum(axis=1)[:, None]
        lam = n_queries / (n_queries + CORRECTION_QUERIES)
        beyond = 1.0 - np.take_along_axis(w_pqn, m_index, axis=-1)  # (q, N) 1 - w(m)
        counts = self.atom_counts[ref_prompt, cols]  # (q, atoms)
        pp = np.full(cols.size, ref_prompt)
        low, high = self._score_range
        for lo, hi in blocks(np.full(offsets.shape[0], cols.size * max(self.n_max, counts.shape[1]))):
            ws, one = slice(lo, hi), slice(ref, ref + 1)
            reading = location_scale_readings(expected[ws, cols], spread[ws, cols], d_p[ws, one],
                                              scale[ws, ref_prompt, None], level[ws, ref_prompt, None],
                                              offsets[ws, cols], low[ws], high[ws])[:, 0]  # (w, q, N)
            if blend is not None:
                other = threshold_readings(tuple(part[ws] for part in blend[0]), pp[:1], cols,  # type: ignore[arg-type]
                                           np.ones((1, cols.size), dtype=bool), self.n_max)[:, 0]
                alpha = blend[1][ws, None, None]
                reading = np.where(alpha > 0.0, (1.0 - alpha) * reading + alpha * other, reading)
            plug_in, held = self._own_readings(pp, cols, self._objectives[ws], w_pqn, np.arange(cols.size + 1))
            at_m = np.take_along_axis(reading, np.broadcast_to(m_index, reading.shape), axis=-1)  # R(m)
            shrunk = subsets @ ((1.0 - w_pqn) * reading) - lam * (subsets @ (beyond * at_m))
            with np.errstate(invalid="ignore", divide="ignore"):  # a subset of no query: 0 / 0, not used
                value = (shrunk + subsets @ plug_in + lam * (subsets @ held)
                         - (offsets[ws, cols] @ subsets.T)[:, :, None]) / n_queries  # (w, subsets, N)
            value += (1.0 - lam) * pooled[ws, None, :]
            move = value[:, :1] - value[:, 1:]
            move[:, n_queries[1:, 0] == 0] = 0.0  # a prompt that shares no query with the reference stays
            out[lo:hi, differs] += move[:, which]
