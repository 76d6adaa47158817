"""The recommended online agent (``iapo_online``, agents/online/iapo_online.py) and the retirement and model-arrival
schedules: exact per-step regret against a recomputation from the schedule's documented draws, the one-request and
batch paths, optimistic entry, and the drift property that catches an agent that stops exploring."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from agents.online import make_online
from agents.online._iapo_kernels import ARM_RESIDUALS, ENTRY_REQUESTS, MIN_COUNT, NO_SHIFT, feed_cusums
from agents.online._read_test import CHANGE_PULLS, CHANGE_Z, read_test
from agents.online.explore_commit import ExploreThenCommit
from agents.online.iapo_online import IAPOOnline
from iapo_gym import Pulls
from iapo_gym.online import OnlineEnv, Requests, ScheduleError, Served, build_schedule, run_online
from iapo_gym.oracle import q_table
from iapo_gym.seeding import derive_seed
from iapo_gym.tasks.generated import level_table, redraw_table

SMALL = [("mv_categorical", 2), ("mv_binary", 6), ("bon_flat", 7), ("bon_shift", 5)]


class RandomArms(IAPOOnline):
    """Uniform over the available prompts and every N (draws independent of what it saw); never learns."""

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        live = np.flatnonzero(requests.available)
        u = self.rng.random((len(requests), 2))
        return live[(u[:, 0] * live.size).astype(np.int64)], 1 + (u[:, 1] * self.schema.n_max).astype(np.int64)

    def update_batch(self, requests: Requests, served: Served) -> None:
        return None


class StopsAtDrift(IAPOOnline):
    """``iapo_online`` until request ``stop``, then its greedy arm per context, never exploring or learning again."""

    def __init__(self, stop: int) -> None:
        super().__init__()
        self.stop = stop

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        if requests.start < self.stop:
            return super().choose_batch(requests)
        prompts = self.value[requests.contexts].argmax(axis=1)
        return prompts, self.best_n[requests.contexts, prompts]

    def update_batch(self, requests: Requests, served: Served) -> None:
        if requests.start < self.stop:
            super().update_batch(requests, served)


class Recording(IAPOOnline):
    """``iapo_online`` that checks each batch's choices against ``batch_by_hand`` and, after each update, that no
    read prompt through its entry holds twice the completions it had when last read (the early reads)."""

    def start(self, env: OnlineEnv, seed: int) -> None:
        super().start(env, seed)
        self.batches = 0
        self.first_choices: list[tuple[int, int, bool]] = []  # (prompt, N, any prompt read) of the first requests

    def choose_batch(self, requests: Requests) -> tuple[np.ndarray, np.ndarray]:
        expected = batch_by_hand(self, requests.contexts, requests.available)
        prompts, ns = super().choose_batch(requests)
        assert np.array_equal(prompts, expected[0]) and np.array_equal(ns, expected[1])
        self.batches += 1
        if len(self.first_choices) < 200:
            self.first_choices += [(p, n, bool(self.read.any())) for p, n in zip(prompts.tolist(), ns.tolist(),
                                                                                 strict=True)]
        return prompts, ns

    def update_batch(self, requests: Requests, served: Served) -> None:
        super().update_batch(requests, served)
        through = self.read & (self.entries >= ENTRY_REQUESTS) & (self.completions > 0)  # served, not only warm
        assert (self.completions[through] < 2.0 * self._read_at[through]).all()


def batch_by_hand(agent: IAPOOnline, contexts: np.ndarray, available: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The batch's (prompts, Ns) from the agent's state, one request at a time in plain Python: entering prompts
    (fewer than ENTRY_REQUESTS requests, counting the batch's earlier choices) first, the fewest first; then the
    UCB index with each earlier choice of the batch counted as a request served at a later step; while no prompt is
    read, the fewest requests first again."""
    fade, live = agent._fade(), np.flatnonzero(available)
    counts = agent._scaled * fade
    held = agent.entries.astype(float).copy()
    prompts, ns = [], []
    for i, c in enumerate(contexts.tolist()):
        entering = [p for p in live if held[p] < ENTRY_REQUESTS]
        if entering:
            p = min(entering, key=lambda q: (held[q], agent._tie[q]))
            n = agent._entry
        else:
            best, best_v = -1, -np.inf
            for q in live:
                if not agent.read[q]:
                    continue
                count = max(counts[q], MIN_COUNT)
                shift = agent._res_sum[c, q] * fade / (agent._res_n[q] * fade + agent._pool[2])
                v = agent.value[c, q] + agent.width * agent._pool[3] * np.sqrt(np.log(agent.t + i + 2) / count) \
                    + agent._tie[q] + shift
                if v > best_v:
                    best, best_v = q, v
            if best >= 0:
                p, n = best, int(agent.best_n[c, best])
            else:  # nothing read yet (the entry round within this batch): the fewest requests first
                p, n = min(live, key=lambda q: (held[q], agent._tie[q])), agent._entry
        prompts.append(p)
        ns.append(n)
        held[p] += 1
        counts[p] += 1.0
    return np.array(prompts), np.array(ns)


@pytest.mark.parametrize("family,level,kind", [("mv_many_queries", 0, "stationary"), ("bon_shift", 5, "model_arrival")])
def test_a_batch_is_chosen_as_one_request_at_a_time_with_virtual_counts(family: str, level: int, kind: str) -> None:
    """Every batch of two runs equals the by-hand rule, and the early-read invariant holds after every update."""
    env = OnlineEnv(family=family, level=level, schedule=kind, horizon=6_000)
    agent = Recording()
    run_online(env, agent, seed=1, batch_size=16)
    assert agent.batches >= 6_000 // 16 and agent._first_read  # a batch ends where the arms change


def test_every_prompt_enters_with_several_requests_before_it_competes() -> None:
    """Without a warm start (``budget`` 0) every prompt serves its entry requests before any estimate is read."""
    env = OnlineEnv(family="mv_categorical", level=2, schedule="stationary", horizon=1_000)
    agent = Recording(budget=0)
    run_online(env, agent, seed=0, batch_size=1)
    n_p = env.table.n_prompts
    entry = agent.first_choices[:ENTRY_REQUESTS * n_p]
    assert ENTRY_REQUESTS * n_p <= 200
    assert np.bincount([p for p, _, _ in entry], minlength=n_p).tolist() == [ENTRY_REQUESTS] * n_p
    assert all(n == min(agent.entry_n, env.table.n_max) and not read for _, n, read in entry)
    assert agent.first_choices[ENTRY_REQUESTS * n_p][2]  # read right after the entry round


def _by_hand(family: str, level: int, kind: str, horizon: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Q (C, P', N_max), first step (P',), retirement step (P',)) rebuilt from the schedule's documented draws."""
    base = level_table(family, level)
    schedule = build_schedule(kind, base, horizon)
    table = base
    if kind == "model_arrival":
        new = redraw_table(family, level, "model")
        factor = schedule.params["cost_factor"]
        assert 0.5 <= factor <= 2.0
        table = replace(base, probs=np.concatenate([base.probs, new.probs]),
                        cost=np.concatenate([base.cost, factor * base.cost]),
                        atoms=None if base.atoms is None else np.concatenate([base.atoms, base.atoms]),
                        prompts=base.prompts + tuple(f"{p}@new" for p in base.prompts))
    retired = schedule.retired if schedule.retired is not None else np.full(table.n_prompts, horizon)
    return q_table(table, base.split_indices("test")), schedule.arrival, retired


@pytest.mark.parametrize("family,level", SMALL)
@pytest.mark.parametrize("kind", ["retirement", "model_arrival"])
def test_step_regret_is_the_exact_regret_of_the_new_schedules(family: str, level: int, kind: str) -> None:
    horizon = 300
    env = OnlineEnv(family=family, level=level, schedule=kind, horizon=horizon)
    assert len(env.schedule.segments) >= 2  # the arms change within the run
    q, arrival, retired = _by_hand(family, level, kind, horizon)
    agent = RandomArms()
    obs, _ = env.reset(seed=3)
    agent.start(env, 3)
    for t in range(horizon):
        live = (arrival <= t) & (retired > t)
        assert np.array_equal(obs["available"].astype(bool), live)
        p, n = agent.choose(obs)
        obs, _, _, _, info = env.step((p, n))
        c = info["context"]
        q_star = q[c][live].max()  # brute force over the live arms
        assert info["q_star"] == pytest.approx(q_star, abs=1e-12)
        assert info["regret"] == pytest.approx(q_star - q[c, p, n - 1], abs=1e-12)
    if kind == "model_arrival":  # the new model's prompts: their own costs, unavailable before the step
        n_p = level_table(family, level).n_prompts
        assert env.table.n_prompts == 2 * n_p and (arrival[n_p:] > 0).all() and (arrival[:n_p] == 0).all()
        factor = env.schedule.params["cost_factor"]
        assert np.allclose(env.table.cost[n_p:], factor * env.table.cost[:n_p])
    else:
        assert (retired < horizon).any() and (retired == horizon).any()  # some go, at least one stays


def test_retired_and_unarrived_prompts_are_refused_with_the_reason() -> None:
    env = OnlineEnv(family="mv_categorical", level=2, schedule="retirement", horizon=400)
    p = int(np.argmin(env.schedule.retired))
    gone = int(env.schedule.retired[p])
    stays = int(np.flatnonzero(env.schedule.retired == 400)[0])
    env.reset(seed=0)
    while env.t < gone:
        env.step((stays, 1))
    with pytest.raises(ValueError, match=rf"prompt {p} is not available at step {gone}: it was retired at step {gone}"):
        env.step((p, 1))
    assert env.t == gone
    grown = OnlineEnv(family="bon_shift", level=5, schedule="model_arrival", horizon=400)
    late = grown.table.n_prompts - 1
    with pytest.raises(ValueError, match=rf"prompt {late} is not available at step 0: it arrives at step"):
        grown.step((late, 1))
    plain = replace(level_table("bon_shift", 5), attrs={})
    with pytest.raises(ScheduleError, match="not a generated level"):
        OnlineEnv(table=plain, schedule="model_arrival")


def test_explore_then_commit_stands_in_for_a_retired_prompt_whatever_the_batch_size() -> None:
    env = OnlineEnv(family="bon_shift", level=5, schedule="retirement", horizon=3_000)
    runs = [run_online(env, ExploreThenCommit(budget=400), seed=1, batch_size=b) for b in (1, 9, 500)]
    for other in runs[1:]:
        assert np.array_equal(runs[0].regret, other.regret)


def test_the_one_request_path_is_the_batch_path_of_one() -> None:
    for family, level, kind in (("bon_shift", 5, "drift"), ("mv_binary", 6, "model_arrival")):
        env = OnlineEnv(family=family, level=level, schedule=kind, horizon=2_000)
        result = run_online(env, IAPOOnline(), seed=4, batch_size=1)
        agent = IAPOOnline()
        obs, _ = env.reset(seed=4)
        agent.start(env, derive_seed(4, "agent"))
        regret, done = [], False
        while not done:
            action = agent.choose(obs)
            next_obs, _, done, _, info = env.step(action)
            agent.update(obs, action, info)
            regret.append(info["regret"])
            obs = next_obs
        assert np.array_equal(np.array(regret), result.regret)
        again = run_online(env, IAPOOnline(), seed=4, batch_size=32)
        assert np.array_equal(again.regret, run_online(env, IAPOOnline(), seed=4, batch_size=32).regret)


@pytest.mark.parametrize("family,level", [("bon_shift", 5), ("mv_binary", 6)])
def test_it_learns_on_a_stationary_level(family: str, level: int) -> None:
    env = OnlineEnv(family=family, level=level, schedule="stationary", horizon=6_000)
    result = run_online(env, make_online("iapo_online"), seed=2, batch_size=8)
    assert result.regret[-1_000:].mean() < 0.25 * result.regret[:300].mean()
    assert result.cumulative_regret[-1] < run_online(env, RandomArms(), seed=2, batch_size=8).cumulative_regret[-1] / 5


def test_a_starved_prompt_is_found_early() -> None:
    """``mv_many_queries`` tuning level 0 (many queries, so one request's completions say little of a prompt): with a
    batch's 16 requests given to the prompt whose index topped, each prompt entered on one request, and a refit only
    at each doubling of every completion, 109 of the run's 164 regret came in its first 1,000 requests. With the
    batch rule, three entry requests and early reads, the regret per request after request 2,000 is below 0.005."""
    env = OnlineEnv(family="mv_many_queries", level=0, schedule="stationary", horizon=20_000)
    regret = run_online(env, IAPOOnline(), seed=0, batch_size=16).regret
    assert regret[2_000:].mean() < 0.005


@pytest.mark.parametrize("family,level", [("mv_specialist", 1), ("mv_many_queries", 0)])
def test_its_regret_keeps_falling_on_a_stationary_level(family: str, level: int) -> None:
    """The plateau of a width in fixed utility units: the best prompt's plug-in estimate from its few completions sat
    far below its value (the shared prior's pull), a width of 0.025 never served it again, and the per-request regret
    of the second half stayed at 0.87 and 0.64 times the first quarter's (0.044 and 0.046 per request). The width in
    residual sds and the per-context shift s_cp find it: the second half's regret is a small part of the first
    quarter's, and no change is detected where none is. Without a warm start (``budget`` 0), whose prior would
    otherwise serve the best prompt from the first request on."""
    horizon = 10_000
    env = OnlineEnv(family=family, level=level, schedule="stationary", horizon=horizon)
    agent = IAPOOnline(budget=0)
    result = run_online(env, agent, seed=0, batch_size=16)
    first, second_half = result.regret[:horizon // 4].mean(), result.regret[horizon // 2:].mean()
    assert second_half < 0.3 * first
    assert second_half < 0.01
    assert len(agent.changes) <= 1


def test_with_its_warm_start_its_regret_keeps_falling_on_close_majority_vote_prompts() -> None:
    """The warm start serves the train split's best prompts from request 0, so what is left is telling close prompts
    apart and the fading's re-checks. On stationary ``mv_categorical`` tuning level 1 (majority-vote prompts a few
    thousandths apart) its per-request regret over requests 50K-100K is below that over 25K-50K (0.71 of it here):
    an agent that stopped learning, or re-checked more as the run went on, would fail it, unless its regret were
    already negligible (below 0.0002 per request, a tenth of what is left here)."""
    env = OnlineEnv(family="mv_categorical", level=1, schedule="stationary", horizon=100_000)
    agent = IAPOOnline()
    regret = run_online(env, agent, seed=0, batch_size=16).regret
    earlier, late = regret[25_000:50_000].mean(), regret[50_000:].mean()
    assert late < 0.9 * earlier or late < 0.0002
    assert agent._prior.any() and not agent.changes


def test_its_regret_keeps_falling_at_a_long_horizon() -> None:
    """The plateau of a fixed fading factor: with every prompt's count faded by 0.9999 per request, no count passed
    about 10K, the width never fell below a floor, and on this majority-vote table (tuning level 0 of
    ``mv_categorical``, 46 prompts; ``mv_distractor`` plateaued the same way) the close prompts kept being served:
    the last quarter of 100K requests had 0.81 times the first quarter's regret, 0.023 per request. A window growing
    as ``memory`` * sqrt(t) lets the re-examining fall with t."""
    horizon = 100_000
    env = OnlineEnv(family="mv_categorical", level=0, schedule="stationary", horizon=horizon)
    agent = IAPOOnline()
    regret = run_online(env, agent, seed=0, batch_size=16).regret
    first, last = regret[:horizon // 4].mean(), regret[-horizon // 4:].mean()
    assert last < 0.5 * first
    assert last < 0.01
    assert not agent.changes  # a stationary run: nothing to detect


def test_a_detected_change_sends_every_prompt_back_for_a_look() -> None:
    """The fading's window restarts at a detection. On drift ``bon_shape`` level 0 (tuning; 70 % of the prompts
    change at request 46,922) the detector fires once, on one prompt, about 100 requests after the change; the new
    best prompts are among those not served for a while. With a window still ``memory`` * sqrt(t) (45K requests)
    they were found only after about 35K requests (0.027 per request over 57K-77K); restarted, the window is short
    and they are found within a few thousand."""
    env = OnlineEnv(family="bon_shape", level=0, schedule="drift", horizon=100_000)
    change = env.schedule.segments[1].start
    agent = IAPOOnline()
    regret = run_online(env, agent, seed=0, batch_size=16).regret
    assert any(change <= step < change + 1_000 for step, _, _ in agent.changes)
    assert regret[change + 10_000:change + 30_000].mean() < 0.01


def test_a_prompt_with_wide_utilities_trips_no_detector_on_a_stationary_table() -> None:
    """The CUSUM's residuals are in the served prompt's own residual sd (as of the last refit). On stationary
    ``bon_flat`` level 0 (tuning) the best prompt of one context, served at N = 16, has residuals of sd 0.12 against
    a pooled sd of 0.045; in pooled sds its CUSUM walked past the threshold 3 times between requests 59K and 62K,
    its completions were forgotten and it was lost again (0.0097 per request over the last tenth). In its own sd
    nothing fires and, once it is found, it is kept: the regret per request over the last tenth is below a tenth of
    what losing it cost, and below a fifth of the first tenth's (without a warm start, ``budget`` 0, so that the
    best prompt is found by exploring)."""
    horizon = 66_000
    env = OnlineEnv(family="bon_flat", level=0, schedule="stationary", horizon=horizon)
    agent = IAPOOnline(budget=0)
    regret = run_online(env, agent, seed=0, batch_size=16).regret
    assert not agent.changes
    tenth = horizon // 10
    lost = 0.0097  # per request over the last tenth, the best prompt lost
    assert regret[-tenth:].mean() < 0.1 * lost
    assert regret[-tenth:].mean() < 0.2 * regret[:tenth].mean()


def _cusum_crossings(residuals: np.ndarray, slack: float = 0.25, threshold: float = 50.0) -> np.ndarray:
    """``feed_cusums`` on one prompt's standardized residuals (own and pooled sd 1, no shift): each pull's change
    estimate, -1 where no CUSUM is past ``threshold``."""
    n = residuals.size
    since = np.empty(n, dtype=np.int64)
    feed_cusums(np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64),
                residuals[:, None].astype(np.float64), 1.0, np.zeros(1), np.zeros((1, 1)), np.full((1, 1), 1e9),
                np.full(1, 1e9), np.zeros(1), np.zeros(1), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
                np.array([1e9, 1e9, NO_SHIFT, 1.0]), slack, threshold, 0.0, since)
    return since


def test_rare_failed_votes_trip_no_detector_and_a_shift_of_one_sd_is_seen_at_once() -> None:
    """A majority vote's residuals are skewed: a little above the estimate on most queries and far below it on the
    rare query whose vote fails. Two-point residuals of mean 0 and sd 1 (22.3 sds below w.p. 0.002): unclipped, a
    few failures close together walked the CUSUM past its threshold about every 10^5 pulls (a stationary table's
    best prompt lost, ``mv_few_queries`` tuning level 0 at request 73K); clipped to +-``CUSUM_CLIP`` nothing
    crosses in 2 million pulls. A shift of the mean by one sd is still detected within 100 pulls and dated to it."""
    rare = 0.002
    low, high = -np.sqrt((1 - rare) / rare), np.sqrt(rare / (1 - rare))  # mean 0, variance 1
    rng = np.random.default_rng(0)
    residuals = np.where(rng.random(2_000_000) < rare, low, high)
    assert abs(residuals.mean()) < 0.01 and abs(residuals.std() - 1.0) < 0.01
    assert (_cusum_crossings(residuals) < 0).all()
    shifted = np.concatenate([residuals[:10_000], residuals[10_000:20_000] - 1.0])
    since = _cusum_crossings(shifted)
    first = int(np.flatnonzero(since >= 0)[0])
    assert 10_000 <= first < 10_100 and abs(int(since[first]) - 10_000) < 30


def test_rare_failed_votes_of_a_stationary_table_trip_no_detector_in_a_run() -> None:
    """The same on a whole run: on stationary ``mv_few_queries`` level 0 (tuning), seed 0, the unclipped CUSUM of
    the best prompt of context 0 (a majority vote of 13 completions) crossed at request 73,152 and its completions
    were forgotten; clipped, nothing is detected."""
    env = OnlineEnv(family="mv_few_queries", level=0, schedule="stationary", horizon=75_000)
    agent = IAPOOnline()
    run_online(env, agent, seed=0, batch_size=16)
    assert agent.changes == []


def test_new_models_enter_optimistically() -> None:
    env = OnlineEnv(family="mv_binary", level=6, schedule="model_arrival", horizon=4_000)
    agent = IAPOOnline()
    run_online(env, agent, seed=0, batch_size=4)
    late = np.flatnonzero(env.schedule.arrival > 0)
    assert late.size and agent.served[late].all() and agent.read[late].all()  # every new prompt tried and read


def test_an_agent_that_stops_exploring_after_drift_is_caught_and_iapo_online_is_not() -> None:
    """Per-request regret after the change point: it stays up for the agent that stops at the drift, and falls for
    ``iapo_online`` (its detector forgets the drifted prompts' old completions)."""
    horizon = 20_000
    env = OnlineEnv(family="bon_shift", level=5, schedule="drift", horizon=horizon)
    change = env.schedule.segments[1].start
    assert env.schedule.segments[-1].weight > 0
    stops = run_online(env, StopsAtDrift(change), seed=0, batch_size=16)
    agent = IAPOOnline()
    adapts = run_online(env, agent, seed=0, batch_size=16)
    third = (horizon - change) // 3

    def slope(result, a: int, b: int) -> float:  # type: ignore[no-untyped-def]
        return float(result.regret[a:b].mean())

    before = slope(adapts, change - 2_000, change)
    assert slope(stops, change - 2_000, change) == before  # the same agent up to the change point
    assert slope(stops, horizon - third, horizon) > 0.8 * slope(stops, change, change + third)  # caught: stays up
    assert slope(stops, horizon - third, horizon) > 10 * before
    assert slope(adapts, change, change + third) < 0.2 * slope(stops, change, change + third)  # it adapts at once
    assert slope(adapts, horizon - third, horizon) < 0.2 * slope(stops, horizon - third, horizon)


def test_the_change_detector_forgets_every_completion_before_the_change() -> None:
    """The CUSUM of the served prompt that drifts fires right after the change point, dates the change near it, and
    every prompt's completions before that date are gone, those after it kept."""
    env = OnlineEnv(family="bon_shift", level=5, schedule="drift", horizon=20_000)
    change = env.schedule.segments[1].start
    agent = IAPOOnline()
    run_online(env, agent, seed=0, batch_size=16)
    after = [(t, p, since) for t, p, since in agent.changes if t >= change]
    assert after and all(env.schedule.drifting[p] for _, p, _ in after)
    t, p, since = after[0]
    assert t - change < 500 and abs(since - change) < 200  # detected and dated near the change
    steps, pulls = agent.log.read()
    last = max(s for _, q, s in agent.changes if q == p)
    assert not ((pulls.prompts == p) & (steps < last)).any()  # forgotten
    assert steps.min() >= min(s for _, _, s in agent.changes)  # every prompt's, before the earliest change estimate
    assert np.isin(np.arange(steps.min(), agent.t), steps).all()  # every request since it is kept


def ref_read_test(steps: np.ndarray, prompts_served: np.ndarray, ns: np.ndarray, utilities: np.ndarray,
                  tested: np.ndarray, read_step: np.ndarray, pooled_var: float) -> dict[int, int]:
    """``read_test`` written out cell by cell: per tested prompt and N with ``CHANGE_PULLS`` pulls on each side of
    its last read, per context the two-sample z with the pooled residual variance counted as ``ARM_RESIDUALS`` more
    observations; the prompts whose largest z passes ``CHANGE_Z``, the strongest first, each dated at the largest
    standardized CUSUM of that cell's utilities under the context of its largest z."""
    found = []
    for prompt in np.flatnonzero(tested):
        for n in np.unique(ns[prompts_served == prompt]):
            cell = (prompts_served == prompt) & (ns == n)
            after = steps >= read_step[prompt]
            a, b = utilities[cell & ~after], utilities[cell & after]
            if len(a) < CHANGE_PULLS or len(b) < CHANGE_PULLS:
                continue
            var = ((((a - a.mean(axis=0)) ** 2).sum(axis=0) + ((b - b.mean(axis=0)) ** 2).sum(axis=0)
                    + ARM_RESIDUALS * pooled_var) / (len(a) + len(b) - 2 + ARM_RESIDUALS))
            z = np.abs(b.mean(axis=0) - a.mean(axis=0)) / np.sqrt(var * (1 / len(a) + 1 / len(b)))
            if z.max() > CHANGE_Z:
                x, x_steps = utilities[cell, int(z.argmax())], steps[cell]
                dev = [abs((x[:m] - x.mean()).sum()) / np.sqrt(m * (len(x) - m) / len(x)) for m in range(1, len(x))]
                found.append((-z.max(), int(prompt), int(x_steps[int(np.argmax(dev)) + 1])))
    detected: dict[int, int] = {}
    for _, prompt, since in sorted(found, key=lambda f: f[0]):
        detected.setdefault(prompt, since)
    return detected


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_read_test_is_its_cell_by_cell_reference(seed: int) -> None:
    """``read_test`` (the sums of the tested cells only, in one sorted pass) finds and dates what the cell-by-cell
    reference does, on a log where some prompts change after their last read (a shift of their utilities at one
    step) and the others do not: some prompts are found and some are not, prompts outside ``prompts`` never."""
    rng = np.random.default_rng(seed)
    n_prompts, n_max, n_contexts, size = 6, 4, 3, 3_000
    steps = np.arange(size)
    served = rng.integers(0, n_prompts, size)
    ns = rng.integers(1, n_max + 1, size)
    read_step = rng.integers(500, 2_500, n_prompts)
    change = read_step + rng.integers(-100, 300, n_prompts)
    moved = rng.random(n_prompts) < 0.5
    utilities = rng.normal(0.5, 0.2, (size, n_contexts)) + 0.3 * (moved[served] & (steps >= change[served]))[:, None]
    tested = np.ones(n_prompts, dtype=bool)
    tested[rng.integers(n_prompts)] = False
    pulls = Pulls.of(served, ns, np.zeros(size, dtype=np.int64), np.zeros(int(ns.sum()), dtype=np.int64))
    got = read_test(steps, pulls, utilities, tested, read_step, n_max, 0.04)
    assert got == ref_read_test(steps, served, ns, utilities, tested, read_step, 0.04)
    assert got and set(got) <= set(np.flatnonzero(tested & moved).tolist())


def test_a_change_the_reads_absorb_is_found_by_the_read_test() -> None:
    """On drift ``bon_large_n`` level 0 (tuning; half the prompts change at request 41,529) no CUSUM crosses: the
    served prompt's shift and its early reads absorb the change, and without the read test nothing was detected in
    100,000 requests and the regret per request stayed at 0.019 over the last 30,000. The read test, comparing a
    prompt's utilities since its last read with those before, finds it within 2,000 requests, dates it within 100
    of the change point, and the last 30,000 requests cost less than a tenth of that."""
    env = OnlineEnv(family="bon_large_n", level=0, schedule="drift", horizon=100_000)
    change = env.schedule.segments[1].start
    agent = IAPOOnline()
    regret = run_online(env, agent, seed=0, batch_size=16).regret
    assert agent.changes
    t, p, since = agent.changes[0]
    assert change <= t < change + 2_000 and abs(since - change) < 100 and env.schedule.drifting[p]
    assert regret[-30_000:].mean() < 0.0019


def test_a_change_sends_the_prompts_not_served_since_back_to_their_entry() -> None:
    """On drift ``bon_flat`` level 0 (tuning; the drifting prompts ramp from request 33,031 to 41,805) a prompt that
    rose by 0.21 while it was not served kept its old estimate to the end when a detection forgot only the detected
    prompt's completions: its CUSUM is fed only what it serves, and the regret per request stayed at 0.0125 over
    the last 30,000 requests. A detection forgets every prompt's completions before the change, so the prompts not
    served since enter again, and the last 30,000 requests cost less than a tenth of that."""
    env = OnlineEnv(family="bon_flat", level=0, schedule="drift", horizon=100_000)
    agent = IAPOOnline()
    regret = run_online(env, agent, seed=0, batch_size=16).regret
    assert agent.changes and min(s for _, _, s in agent.changes) >= env.schedule.segments[1].start
    assert regret[-30_000:].mean() < 0.00125


def test_a_change_after_the_last_read_of_a_prompt_served_on_most_requests_is_found() -> None:
    """On drift ``mv_specialist`` level 3 (tuning; a ramp in four steps from request 34,175) the best prompt before
    the drift falls by 0.05-0.09, keeps about 99 % of the requests, and is read last at request 53,990: its
    completions do not double again before T, nor do the run's. Tested only at reads, the change went unseen and
    the last 30,000 requests cost 0.119 a request; tested every ``TEST_EVERY`` requests too, it is found after
    the ramp's last step and the last 30,000 cost less than a tenth of that."""
    env = OnlineEnv(family="mv_specialist", level=3, schedule="drift", horizon=100_000)
    agent = IAPOOnline()
    regret = run_online(env, agent, seed=0, batch_size=16).regret
    assert agent.changes and agent.changes[0][0] > 53_990
    assert regret[-30_000:].mean() < 0.0119


def test_one_failed_vote_after_a_flawless_read_is_not_a_change() -> None:
    """On stationary ``mv_models`` level 3 (tuning) a prompt served at N = 35 won every one of its 1,204 votes
    before its read at request 13,456 and lost one of its next 40. With the two sides' own variance only (about
    the one failure's) that was |z| = 5.5, a change, at request 14,768, and the 100,000-request run paid 46.4 -> 65.3 for it; with
    the pooled residual variance counted as ``ARM_RESIDUALS`` observations it is no change, and nothing is
    detected."""
    env = OnlineEnv(family="mv_models", level=3, schedule="stationary", horizon=20_000)
    agent = IAPOOnline()
    run_online(env, agent, seed=0, batch_size=16)
    assert agent.changes == []


def test_the_warm_start_reads_the_completions_explore_then_commit_chose_its_policy_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both agents train ``auto`` on the run's train split with the same seeds: their offline estimators hold the
    same completions (counts and sums equal), and explore-then-commit's policy is the warm learner's."""
    import agents.online.explore_commit as etc_module
    import agents.online.iapo_online as iapo_module

    learners: dict[str, list] = {"etc": [], "iapo": []}
    for key, module in (("etc", etc_module), ("iapo", iapo_module)):
        def keep(name: str, _key: str = key, _make=module.make, **kwargs):  # type: ignore[no-untyped-def]
            learner = _make(name, **kwargs)
            learners[_key].append(learner)
            return learner
        monkeypatch.setattr(module, "make", keep)
    env = OnlineEnv(family="bon_shift", level=3, schedule="stationary", horizon=100)
    env.reset(seed=7)
    etc, warm = ExploreThenCommit(), IAPOOnline()
    etc.start(env, derive_seed(7, "agent"))
    warm.start(env, derive_seed(7, "agent"))
    assert warm.budget == etc.budget and warm._prior.any()
    (a,), (b,) = learners["etc"], learners["iapo"]
    ta, tb = a.last_tail.estimator.table, b.last_tail.estimator.table
    assert ta.counts.sum() > 0
    np.testing.assert_array_equal(ta.counts, tb.counts)
    np.testing.assert_array_equal(ta.sums, tb.sums)


def test_the_warm_starts_offset_is_what_the_run_queries_add_to_the_train_splits_values() -> None:
    """``mv_few_queries`` tuning level 2 (13 train and 5 test queries): ``auto``'s offline estimates of the train
    split sit far below the prompts' values on the run's queries. The offset d_c the agent reads from what it served
    is, within sampling error, the exact mean over those pulls of Q (on the run's queries) less Q_off at each pull's
    (p, N), shrunk by ``ARM_RESIDUALS`` as the agent shrinks it: its residuals against the exact Q have mean 0."""
    env = OnlineEnv(family="mv_few_queries", level=2, schedule="stationary", horizon=5_000)
    agent = IAPOOnline()
    run_online(env, agent, seed=0, batch_size=16)
    assert not agent.changes and agent._prior.all()
    agent._read_offset()  # on every pull logged
    q, _ = env.segment_tensors(0)
    _, pulls = agent.log.read()
    at = (slice(None), pulls.prompts, pulls.ns - 1)
    exact = (q[at] - agent._q_off[at]).sum(axis=1) / (len(pulls) + ARM_RESIDUALS)  # (C,)
    noise = agent.log.utilities().T - q[at]  # (C, B): each utility less its exact expectation
    se = noise.std(axis=1) * np.sqrt(len(pulls)) / (len(pulls) + ARM_RESIDUALS)
    assert (exact > 0.1).all()  # the train split's estimates sit far below the run's values
    assert (np.abs(agent._offset - exact) < 5.0 * se).all()


def test_bad_hyper_parameters_name_the_value() -> None:
    with pytest.raises(ValueError, match="width must be a number >= 0"):
        IAPOOnline(width=-1.0)
    with pytest.raises(ValueError, match=r"memory must be a number > 0 \(inf: no fading\), got 0.0"):
        IAPOOnline(memory=0.0)
    with pytest.raises(ValueError, match=r"budget must be an integer >= 0 \(completions before request 0\), got -1"):
        IAPOOnline(budget=-1)
    with pytest.raises(ValueError, match="entry_n must be an integer >= 1"):
        IAPOOnline(entry_n=0)
    with pytest.raises(ValueError, match="bias_sd must be a number >= 0"):
        IAPOOnline(bias_sd=-0.1)
    agent = make_online("iapo_online")
    assert isinstance(agent, IAPOOnline) and set(agent.params()) == {
        "width", "memory", "threshold", "slack", "entry_n", "prior", "bias_sd", "budget"}
