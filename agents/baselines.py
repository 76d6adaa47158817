"""The paper's structure-agnostic baselines: uniform, epsilon-greedy, softmax, UCB, random.

All of them learn through the shared estimator with cross-context and nested-scale reuse
(as in the paper: "all baseline methods share information across contexts and inference
scales"). The sequential ones draw a context uniformly at random each step, choose an
arm among those whose N fits the remaining budget, pull it and update at once; see
``docs/agents.md`` for the optional batching.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from agents import _jit
from agents.base import Agent
from agents.estimator import REUSE_MODES, Estimator, Reuse
from agents.psst import partial_allocation
from agents.rule_readings import RuleEstimator
from iapo_gym import IAPOEnv, Policy


def _check_reuse(reuse: Any) -> None:
    if reuse not in REUSE_MODES:
        raise ValueError(f"reuse must be one of {REUSE_MODES}, got {reuse!r}")


class RandomAgent(Agent):
    """A uniformly random arm per context (the agent's own generator); spends nothing."""


    def train(self, env: Any, budget: int) -> Policy:
        """Ignore the budget and return one uniformly random arm (p, N) per context."""
        base = self.base_env(env)
        self.check_budget(budget)
        prompts = self.rng.integers(base.n_prompts, size=base.n_contexts)
        ns = self.rng.integers(1, base.n_max + 1, size=base.n_contexts)
        arms = tuple(zip(prompts.tolist(), ns.tolist(), strict=True))
        if base.rule_arms:  # a uniformly random rule too, drawn after the arms
            return Policy(arms, rules=tuple(self.rng.integers(len(base.rules), size=base.n_contexts).tolist()))
        return Policy(arms)


class Uniform(Agent):
    """Every arm in one batch: each prompt pulled floor(T / (P N_max)) times at N_max.

    Nested reuse makes a pull at N_max a sample of every scale. The leftover (less than
    P N_max) buys one more pull of every prompt at N = floor(leftover / P) when that is
    >= 1 (so every prompt keeps the same coverage), else is left unspent; a budget below
    P N_max is spent entirely that way. Returns the best estimate per context.
    """


    def __init__(self, seed: int | None = None, reuse: Reuse = "blocks") -> None:
        """``reuse``: how the estimator reads nested scales ("blocks" or "all_subsets")."""
        super().__init__(seed)
        _check_reuse(reuse)
        self.reuse: Reuse = reuse

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"reuse": self.reuse}

    def train(self, env: Any, budget: int) -> Policy:
        """One batch of pulls, then the greedy policy on the estimates."""
        base = self.base_env(env)
        budget = self.check_budget(budget)
        est = RuleEstimator(base, self.reuse) if base.rule_arms else Estimator(base, self.reuse)
        n_p, n_max = base.n_prompts, base.n_max
        per_prompt = budget // (n_p * n_max)
        prompts = np.repeat(np.arange(n_p), per_prompt)
        ns = np.full(prompts.size, n_max, dtype=np.int64)
        leftover = budget - per_prompt * n_p * n_max
        if per_prompt == 0:  # too small for one full pass: the shared partial rule
            extra_p, extra_n = partial_allocation(np.full(n_p, n_max), leftover, self.rng)
        else:  # one more pull per prompt at a common N, or nothing (equal coverage)
            extra_p = np.arange(n_p) if leftover >= n_p else np.zeros(0, np.int64)
            extra_n = np.full(extra_p.size, leftover // n_p, dtype=np.int64)
        prompts, ns = np.concatenate([prompts, extra_p]), np.concatenate([ns, extra_n])
        if prompts.size:
            est.update(base.pull(prompts, ns))
        return est.best_arms(self.rng)


class _Sequential(Agent):
    """Shared loop of the sequential baselines: draw a context, choose a feasible arm, pull, update.

    ``batch_size`` > 1 chooses that many (context, arm) steps from the same estimates
    before pulling them in one call (a delayed-update approximation, for speed only);
    the default 1 is the exact sequential algorithm.
    """

    def __init__(self, seed: int | None = None, reuse: Reuse = "blocks", batch_size: int = 1) -> None:
        super().__init__(seed)
        _check_reuse(reuse)
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.reuse: Reuse = reuse
        self.batch_size = int(batch_size)

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"reuse": self.reuse, "batch_size": self.batch_size}

    @abstractmethod
    def choose(self, means: np.ndarray, counts: np.ndarray, feasible: np.ndarray | None) -> int:
        """Flat arm index (p * N_max + N - 1) to pull among ``feasible`` arms of one context.

        ``means`` are the context's flat (P * N_max) estimates, 0 where unsampled; ``counts``
        its flat sample counts; ``feasible`` a flat mask, None when every arm fits. Called
        with numpy's divide/invalid warnings silenced.
        """

    def jit_rule(self) -> tuple[int, float] | None:
        """(rule, parameter) of the compiled copy of ``choose`` in ``agents._jit._choose``; None: no copy."""
        return None

    @staticmethod
    def _argmax(values: np.ndarray, mask: np.ndarray | None, rng: np.random.Generator) -> int:
        """Index of the largest value among ``mask`` (None: all), ties broken at random."""
        score = values if mask is None else np.where(mask, values, -np.inf)
        ties = (score == np.maximum.reduce(score)).nonzero()[0]
        return int(ties[0] if ties.size == 1 else ties[rng.integers(ties.size)])

    def train(self, env: Any, budget: int) -> Policy:
        """Step until the budget is spent (N = 1 always fits, so it is spent exactly)."""
        budget = self.check_budget(budget)
        run = _Trajectory(self, self.base_env(env))
        self._advance(run, budget, stop=budget)
        return run.read(self.rng)

    @property
    def anytime(self) -> bool:
        """Whether ``train_budgets`` shares one trajectory (the exact sequential algorithm only)."""
        return self.batch_size == 1

    def train_budgets(self, env: Any, budgets: Sequence[int]) -> Iterator[tuple[int, Policy]]:
        """(budget, policy) for each budget in increasing order, from one trajectory.

        Each policy is bit-identical to ``train(env, budget)`` by a fresh agent with the same
        seed on an env reset with the same seed: the runs of a smaller and a larger budget
        take the same steps until the smaller one has fewer than N_max completions left,
        where its own tail branches off (the env's and the agent's generators are saved and
        restored around it). The protocol's budgets 3K..40K then cost one 40K run, not 108K.
        Needs ``self.anytime`` and an env with ``snapshot``/``restore``.
        """
        if not self.anytime:
            raise ValueError(f"train_budgets needs batch_size=1 (the exact sequential algorithm), got {self.batch_size}")
        checked = sorted({self.check_budget(b) for b in budgets})
        if not checked:
            return
        base = self.base_env(env)
        run = _Trajectory(self, base)
        top = checked[-1]
        for budget in checked[:-1]:
            self._advance(run, top, stop=budget - base.n_max)  # the steps both runs take
            saved = (base.snapshot(), self.rng.bit_generator.state, run.save())
            self._advance(run, budget, stop=budget)
            yield budget, run.read(self.rng)
            env_state, rng_state, run_state = saved
            base.restore(env_state)
            self.rng.bit_generator.state = rng_state
            run.load(run_state)
        self._advance(run, top, stop=top)
        yield top, run.read(self.rng)

    def _advance(self, run: _Trajectory, budget: int, stop: int) -> None:
        """Take the steps of a run with ``budget`` while completions spent <= ``stop`` (and < budget).

        The flat estimates (0 where unsampled) are kept up to date incrementally: a pull
        of (p, N) changes only the arms (p, 1..N) of every context.
        """
        base, est, n_max, n_contexts = run.base, run.est, run.n_max, run.n_contexts
        means, sums, counts, arm_n = run.means, run.sums, run.counts, run.arm_n
        if run.compiled is not None:  # the same steps, compiled (agents/_jit.py)
            before = run.spent
            rule, param = run.compiled
            run.spent = _jit.advance(rule, param, self.rng, base.np_random, budget, stop, run.spent, means,
                                     est.sums, est.counts, *run.tables)
            base.record_draws(run.spent - before)
            return
        with np.errstate(divide="ignore", invalid="ignore"):
            while run.spent < budget and run.spent <= stop:
                remaining = budget - run.spent
                feasible = None if remaining >= n_max else arm_n <= remaining
                if self.batch_size == 1:  # the exact sequential algorithm
                    c = int(self.rng.integers(n_contexts))  # the same draw as size=1, 4x cheaper
                    arm = self.choose(means[c], counts[c], feasible)
                    p, n = divmod(arm, n_max)
                    query, atoms = base.pull_one(p, n + 1)  # what pull draws, without a Pulls object
                    est.update_one(p, n + 1, query, atoms)
                    run.spent += n + 1
                    touched = slice(arm - n, arm + 1)  # arms (p, 1..N)
                    means[:, touched] = sums[:, touched] / counts[:, touched]
                    continue
                contexts = self.rng.integers(n_contexts, size=self.batch_size)
                arms = np.array([self.choose(means[c], counts[c], feasible) for c in contexts.tolist()],
                                dtype=np.int64)
                ns = arms % n_max + 1
                fits = np.cumsum(ns) <= remaining
                fits[0] = True  # the first step was chosen among feasible arms
                arms, ns = arms[fits], ns[fits]
                pulls = base.pull(arms // n_max, ns)
                run.spent += pulls.completions
                est.update(pulls)
                means[...] = Estimator.mean(est, unseen=0.0).reshape(n_contexts, -1)  # fixed N, with rules too


class _Trajectory:
    """The state of one sequential run: its estimator, flat means (C, P * N_max) and spend."""

    def __init__(self, agent: _Sequential, base: IAPOEnv) -> None:
        self.base = base
        self.est = RuleEstimator(base, agent.reuse) if base.rule_arms else Estimator(base, agent.reuse)
        self.n_max, self.n_contexts = base.n_max, base.n_contexts
        self.arm_n = np.tile(np.arange(1, base.n_max + 1), base.n_prompts)
        self.means = np.zeros((base.n_contexts, self.arm_n.size))
        self.sums = self.est.sums.reshape(base.n_contexts, -1)  # views: updated with the estimator
        self.counts = self.est.counts.reshape(base.n_contexts, -1)
        self.spent = 0
        # The compiled loop draws what IAPOEnv.pull_one draws from the table and accounts through record_draws.
        rule = agent.jit_rule()
        self.compiled = rule if (
            _jit.enabled() and rule is not None and agent.batch_size == 1 and agent.reuse == "blocks"
            and base.draws_from_table and not base.rule_arms  # the rules read the pulls, which the kernel keeps
            and type(self.est).task_sums is Estimator.task_sums) else None
        self.tables: tuple[Any, ...] = ()
        if self.compiled is not None:
            table, sampler = base.table, base.sampler
            mv = table.aggregator == "mv"
            self.tables = (np.ascontiguousarray(base.queries(), dtype=np.int64), sampler.accept, sampler.alias,
                           table.n_queries, mv, table.gold if mv else np.zeros(1, np.int64),
                           np.zeros((0, 0, 0, 1)) if mv else table.atoms, table.context_weights,
                           np.ascontiguousarray(table.cost_matrix(), dtype=np.float64))

    def read(self, rng: np.random.Generator) -> Policy:
        """The policy: per context the arm of highest estimate (``Estimator.best_arms``); with ``rule_arms``, that
        same arm (the same draws) with its best rule (``RuleEstimator.rules_at``)."""
        if isinstance(self.est, RuleEstimator):
            return self.est.rules_at(Estimator.best_arms(self.est, rng))
        return self.est.best_arms(rng)

    def save(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray | None]:
        """Copies of what the steps change (the rules' sums too, with ``rule_arms``)."""
        rules = self.est.snapshot() if isinstance(self.est, RuleEstimator) else None
        return self.est.sums.copy(), self.est.counts.copy(), self.means.copy(), self.spent, rules

    def load(self, state: tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray | None]) -> None:
        """Back to a ``save``d state (in place: the views stay valid)."""
        sums, counts, means, self.spent, rules = state
        self.est.sums[...] = sums
        self.est.counts[...] = counts
        self.means[...] = means
        if isinstance(self.est, RuleEstimator) and rules is not None:
            self.est.restore(rules)


class EpsilonGreedy(_Sequential):
    """A random context each step; its greedy arm w.p. 1 - epsilon, else a uniformly random
    feasible arm. Unsampled arms count as 0 (the reference code's convention)."""


    def __init__(self, seed: int | None = None, epsilon: float = 0.15, reuse: Reuse = "blocks",
                 batch_size: int = 1) -> None:
        """``epsilon`` is the exploration probability (paper: 0.15)."""
        super().__init__(seed, reuse, batch_size)
        if not 0.0 <= float(epsilon) <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon!r}")
        self.epsilon = float(epsilon)

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"epsilon": self.epsilon, **super().params()}

    def choose(self, means: np.ndarray, counts: np.ndarray, feasible: np.ndarray | None) -> int:
        """Explore w.p. epsilon, else exploit the context's current estimates."""
        if self.rng.random() < self.epsilon:
            if feasible is None:
                return int(self.rng.integers(means.size))
            options = np.flatnonzero(feasible)
            return int(options[self.rng.integers(options.size)])
        return self._argmax(means, feasible, self.rng)

    def jit_rule(self) -> tuple[int, float] | None:
        """The compiled ``choose`` (``_jit._choose``, EPSILON_GREEDY branch), unless a subclass redefines it."""
        return (_jit.EPSILON_GREEDY, self.epsilon) if type(self).choose is EpsilonGreedy.choose else None


class Softmax(_Sequential):
    """A random context each step; an arm drawn with probability proportional to exp(Q_hat / tau).

    Default temperature tau = 0.05 (utility units; the reference code's value): an arm
    0.05 below the best is e times less likely. Unsampled arms count as 0.
    """


    def __init__(self, seed: int | None = None, temperature: float = 0.05, reuse: Reuse = "blocks",
                 batch_size: int = 1) -> None:
        """``temperature`` tau > 0 of the softmax over estimated Q."""
        super().__init__(seed, reuse, batch_size)
        if not float(temperature) > 0.0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.temperature = float(temperature)

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"temperature": self.temperature, **super().params()}

    def choose(self, means: np.ndarray, counts: np.ndarray, feasible: np.ndarray | None) -> int:
        """Sample a feasible arm from the softmax of the context's estimates."""
        logits = means / self.temperature
        if feasible is not None:
            logits = np.where(feasible, logits, -np.inf)
        cdf = np.add.accumulate(np.exp(logits - np.maximum.reduce(logits)))  # = np.cumsum
        return int(cdf.searchsorted(self.rng.random() * cdf[-1], side="right"))

    def jit_rule(self) -> tuple[int, float] | None:
        """The compiled ``choose`` (``_jit._choose``, SOFTMAX branch), unless a subclass redefines it."""
        return (_jit.SOFTMAX, self.temperature) if type(self).choose is Softmax.choose else None


class UCB(_Sequential):
    """A random context each step; the feasible arm of highest mu + c sqrt(ln t / n).

    n is the arm's sample count and t the context's total sample count (nested-scale
    samples included, as in the reference code); unsampled arms come first (ties at random).
    """


    def __init__(self, seed: int | None = None, c: float = 0.1, reuse: Reuse = "blocks", batch_size: int = 1) -> None:
        """``c`` is the exploration constant (paper: 0.1)."""
        super().__init__(seed, reuse, batch_size)
        if not float(c) >= 0.0:
            raise ValueError(f"c must be >= 0, got {c!r}")
        self.c = float(c)

    def params(self) -> dict[str, Any]:
        """The effective hyper-parameters, defaults included."""
        return {"c": self.c, **super().params()}

    def choose(self, means: np.ndarray, counts: np.ndarray, feasible: np.ndarray | None) -> int:
        """The optimistic arm of the context."""
        t = max(1.0, float(np.add.reduce(counts)))  # exact: counts are small integers
        index = np.where(counts > 0, means + self.c * np.sqrt(np.log(t) / counts), np.inf)
        return self._argmax(index, feasible, self.rng)

    def jit_rule(self) -> tuple[int, float] | None:
        """The compiled ``choose`` (``_jit._choose``, UCB branch), unless a subclass redefines it."""
        return (_jit.UCB, self.c) if type(self).choose is UCB.choose else None

