"""``IAPOOnline``'s read test: whether a prompt's utilities served since its last read differ from those before.
It runs before each read of a prompt and every ``TEST_EVERY`` requests.

The CUSUM measures residuals against an estimate that moves: a served prompt's shift follows a change made in small
steps, and each early read restarts its CUSUM, so a change of a prompt that is read often can pass it unseen (drift
``bon_large_n`` tuning level 0: no detection in 100,000 requests, 19 regret per 1,000 requests over the last 30,000).
The read test needs no estimate: on a table that does not change, a prompt's utilities at one N under one context
have the same mean before and after any step. Before a prompt is read, a two-sample z-test per (N, context) compares
the two sides of its last read; the variance is pooled over both sides with the pooled residual variance sigma^2
counted as ``ARM_RESIDUALS`` more observations, so that one failed vote after a flawless run of them is not
significant (stationary ``mv_models`` tuning level 3: 1 failure in 40 pulls after 1,204 without one was |z| 5.5 in
the two sides' own variance).
"""

from __future__ import annotations

import numpy as np

from agents.online._iapo_kernels import ARM_RESIDUALS
from iapo_gym.env import Pulls

#: The |z| at which a prompt's utilities since its last read differ from those before: a two-sided normal tail of
#: 5.7e-7 a test, and a 100,000-request run makes 250-28,000 tests (level 0 of five families, stationary), so under
#: 0.02 false alarms a run if the z were normal.
CHANGE_Z = 5.0
#: Requests between read tests of every prompt with pulls since its last read. Reads come at doublings of a prompt's
#: completions, so a prompt served on most requests is read rarely late in a run, and a change of it after its last
#: read went untested (``mv_specialist`` tuning level 3, drift: 5,662.8 at T = 100K). 1,000 / 2,000 / 4,000 on the
#: drift runs of tuning levels 0-3 of every family (seed 0): mean 442.8 / 442.3 / 446.5 at T = 100K (531.1 without).
TEST_EVERY = 2_000
#: Pulls at one N on each side of a prompt's last read before the test compares them (the means' normal
#: approximation).
CHANGE_PULLS = 30


def read_test(steps: np.ndarray, pulls: Pulls, utilities: np.ndarray, prompts: np.ndarray, read_step: np.ndarray,
              n_max: int, pooled_var: float) -> dict[int, int]:
    """The logged requests' changes among ``prompts`` (P,) bool.

    ``steps``, ``pulls`` and ``utilities`` (B, C) are the log in step order, ``read_step`` (P,) each prompt's last
    read and ``pooled_var`` sigma^2. Returns {prompt: change estimate} for each prompt whose z-test passes
    ``CHANGE_Z`` at some (N, context); the change is dated at the largest standardized CUSUM of that (N, context)'s
    utilities (where a shift of their mean fits best)."""
    rows = np.flatnonzero(prompts[pulls.prompts])
    if not rows.size:
        return {}
    p, n, st = pulls.prompts[rows], pulls.ns[rows], steps[rows]
    key = (p * n_max + (n - 1)) * 2 + (st >= read_step[p])  # (prompt, N, after the read)
    cnt = np.bincount(key, minlength=prompts.size * n_max * 2).astype(np.float64).reshape(-1, 2)
    tested = np.all(cnt >= CHANGE_PULLS, axis=1)
    cells = np.flatnonzero(tested)
    if not cells.size:
        return {}
    # the sums of the tested cells only, each over its pulls in step order (a stable sort keeps it): the utilities of
    # the log's other pulls, most of it late in a run, are not copied
    in_cells = tested[key // 2]
    key_in = key[in_cells]
    order = np.argsort(key_in, kind="stable")
    groups, first = np.unique(key_in[order], return_index=True)
    u_in = utilities[rows[in_cells][order]]
    n_c = utilities.shape[1]
    s1, s2 = np.zeros((cnt.size, n_c)), np.zeros((cnt.size, n_c))
    s1[groups] = np.add.reduceat(u_in, first, axis=0)
    s2[groups] = np.add.reduceat(u_in ** 2, first, axis=0)
    s1, s2 = s1.reshape(-1, 2, n_c)[cells], s2.reshape(-1, 2, n_c)[cells]
    count = cnt[cells][:, :, None]
    mean = s1 / count
    var = ((s2 - s1 * mean).sum(axis=1) + ARM_RESIDUALS * pooled_var) / (count.sum(axis=1) - 2.0 + ARM_RESIDUALS)
    z = np.abs(mean[:, 1] - mean[:, 0]) / np.sqrt(var * (1.0 / count[:, 0] + 1.0 / count[:, 1]))
    score = z.max(axis=1)
    hits = np.flatnonzero(score > CHANGE_Z)
    detected: dict[int, int] = {}
    for i in hits[np.argsort(-score[hits], kind="stable")].tolist():
        prompt, k = divmod(int(cells[i]), n_max)
        if prompt in detected:
            continue
        sel = (p == prompt) & (n == k + 1)  # its utilities at that N, in step order
        x, x_steps = utilities[rows[sel], int(z[i].argmax())], st[sel]
        m = np.arange(1, x.size)
        dev = np.abs(np.cumsum(x - x.mean())[:-1]) / np.sqrt(m * (x.size - m) / x.size)
        detected[prompt] = int(x_steps[int(dev.argmax()) + 1])
    return detected
