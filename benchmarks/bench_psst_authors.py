"""Benchmark: PSST on MATH at T=10K, ours against the paper authors' code, side by side in one run.

One repeat of each side does what a user of that code does for one run of the paper's protocol:

- ours: fresh ``gym.make("IAPO-MATH-v0")`` (reads the table file, with its stored exact
  expectations), seeded 80/20 resplit, PSST training with budget T, exact test ACR;
- the authors': a fresh ``CategoricalMVEnv`` from the release arrays, their
  ``combine_and_resplit(0.8, seed)``, their ``PSSTAgent("mv").train(env, T)``, and their
  10,000-sample test evaluation (``example_runner.evaluate``).

Figures are medians of ``--repeats`` (default 5) runs with seeds 0.., interleaved so load changes
hit both sides alike. The authors' code is not part of this repository; get it with
``git clone https://github.com/IAPO-AAAI25/IAPO-PSST DIR`` and pass ``--authors-code DIR``
(without it only our side is measured). Their release file is read with iapo-gym's safe
unpickler (``iapo_gym.data.release.load_release_objects``), never with plain ``pickle.load``.
Run::

    IAPO_GYM_OFFLINE=1 IAPO_GYM_DATA=../shared/iapo-release \\
        nice -n 10 .venv/bin/python benchmarks/bench_psst_authors.py --authors-code ../authors-psst
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

import iapo_gym
from iapo_gym.data import resolve_table
from iapo_gym.data.registry import get_entry
from iapo_gym.data.release import load_release_objects
from iapo_gym.leaderboard.run.runner import build_agent
from iapo_gym.leaderboard.run.specs import AgentSpec, parse_agent_spec
from iapo_gym.tasks import get_task


def ours(budget: int, seed: int, agent: str = "psst") -> tuple[float, float]:
    """Seconds and exact test ACR of one fresh make + resplit + train (agent spec ``agent``) + exact evaluate."""
    spec = parse_agent_spec(agent)
    start = time.perf_counter()
    env = gym.make("IAPO-MATH-v0")
    base: Any = env.unwrapped  # an IAPOEnv
    base.resplit(0.8, seed=seed)
    env.reset(seed=seed)  # the env's draws (queries, completions) from this run's seed
    policy = build_agent(spec, seed).train(env, budget)
    acr = iapo_gym.evaluate(policy, env)
    return time.perf_counter() - start, acr


#: The authors' agent for each label of PAPER_AGENTS: module under their ``Agents/``, class, keyword arguments.
#: The arguments are the paper's values, which our agents' defaults also are (``matched_params`` checks that);
#: their ``example_runner.agent_factories`` builds epsilon-greedy with epsilon 0.1 and UCB with their default
#: ``ucb_c`` 2.0 instead.
AUTHORS_AGENTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "psst": ("PSST", "PSSTAgent", {}),
    "psst+K1": ("PSST_HB", "PSSTHAgent", {"burn": 0.2, "K": 1}),
    "psst+K4": ("PSST_HB", "PSSTHAgent", {"burn": 0.2, "K": 4}),
    "psst+K8": ("PSST_HB", "PSSTHAgent", {"burn": 0.2, "K": 8}),
    "uniform": ("Uniform", "UniformAgent", {}),
    "epsilon_greedy": ("adaptiv_sampling", "AdaptiveAgent", {"action_mode": "epsilon", "epsilon": 0.15}),
    "softmax": ("adaptiv_sampling", "AdaptiveAgent", {"action_mode": "softmax", "tau": 0.05}),
    "ucb": ("UCB", "UCBAgent", {"ucb_c": 0.1}),
    "triple_n1": ("TRIPLE", "TRAgent", {"h": "one"}),
    "triple_random_n": ("TRIPLE", "TRAgent", {"h": "random"}),
}
#: Our parameter name for each of their hyper-parameters (``action_mode`` picks the class, no parameter).
OUR_PARAM = {"burn": "rho", "K": "k", "epsilon": "epsilon", "tau": "temperature", "ucb_c": "c", "h": "n_mode"}


def matched_params(spec: AgentSpec) -> list[tuple[str, Any, Any]]:
    """(their name, their value, our effective value) of each hyper-parameter of ``spec``'s counterpart."""
    _, _, kwargs = AUTHORS_AGENTS[spec.label]
    effective = build_agent(spec, 0).params()
    return [(name, value, effective[OUR_PARAM[name]]) for name, value in kwargs.items() if name in OUR_PARAM]


def release_file(authors_code: Path, table_path: Path) -> Path | None:
    """The MATH release file: in their checkout's ``data/``, else beside our converted table."""
    name = get_entry("math").file
    return next((p for p in (authors_code / "data" / name, table_path.parent / name) if p.is_file()), None)


def authors_or_none(parser: argparse.ArgumentParser, authors_code: Path | None) -> Authors | None:
    """The authors' side, or None without ``--authors-code`` (only our side is measured then; a checkout
    without the release file is an error); our MATH table is converted here, once, outside the timing."""
    table_path = resolve_table(get_task("math"))
    if authors_code is None:
        print("no --authors-code: measuring our side only "
              "(git clone https://github.com/IAPO-AAAI25/IAPO-PSST DIR; --authors-code DIR)")
        return None
    release = release_file(authors_code, table_path)
    if release is None:
        parser.error(f"no {get_entry('math').file} under {authors_code / 'data'}")
    return Authors(authors_code, release)


class Authors:
    """The authors' env, agents and evaluation, imported from their checkout."""

    def __init__(self, folder: Path, release_file: Path) -> None:
        sys.path.insert(0, str(folder))
        self.env_cls = importlib.import_module("Envs.catMV.catMV").CategoricalMVEnv
        self.evaluate = importlib.import_module("example_runner").evaluate
        (self.record,) = load_release_objects(release_file)

    def agent(self, label: str) -> Any:
        """A new instance of their agent for our label (AUTHORS_AGENTS), for majority vote."""
        module, cls, kwargs = AUTHORS_AGENTS[label]
        return getattr(importlib.import_module(f"Agents.{module}"), cls)(strategy="mv", **kwargs)

    def run(self, budget: int, seed: int, n_samples: int, label: str = "psst") -> tuple[float, float]:
        """Seconds and ``n_samples``-sample test ACR of one fresh env + resplit + train + evaluation."""
        r: Any = self.record  # an inert attribute record of their env
        random.seed(seed)  # their agents draw from the global generators
        np.random.seed(seed)  # noqa: NPY002 (their legacy global generator, not ours)
        start = time.perf_counter()
        env = self.env_cls(cat_probs=r.cat_probs, answers=r.answers, cat_probs_test=r.cat_probs_te,
                           answers_test=r.answers_te, cost_per_prompt=r.cost_per_prompt, cost_coeffs=r.cost_coeffs,
                           context_distribution=r.context_distribution, N_max=r.N_max, rng=seed)
        env.combine_and_resplit(train_frac=0.8, seed=seed)
        agent = self.agent(label)
        with contextlib.redirect_stdout(io.StringIO()):  # their agents print their pull counts
            agent.train(env=env, budget=budget)
        acr = self.evaluate(agent, env, n_samples)
        return time.perf_counter() - start, acr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--authors-code", type=Path, help="checkout of github.com/IAPO-AAAI25/IAPO-PSST")
    parser.add_argument("--budget", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--eval-samples", type=int, default=10_000, help="the authors' evaluation samples")
    args = parser.parse_args()
    authors = authors_or_none(parser, args.authors_code)
    ours(args.budget, 99)  # warm: bytecode, lazy imports
    if authors is not None:
        authors.run(100, 99, 100)  # warm
    mine, theirs, acr_mine, acr_theirs = [], [], [], []
    for seed in range(args.repeats):
        t, a = ours(args.budget, seed)
        mine.append(t)
        acr_mine.append(a)
        if authors is not None:
            t, a = authors.run(args.budget, seed, args.eval_samples)
            theirs.append(t)
            acr_theirs.append(a)
    m = statistics.median(mine)
    print(f"PSST on MATH, T={args.budget}, median of {args.repeats} (seeds 0..{args.repeats - 1})")
    print(f"  ours   : fresh gym.make + resplit + train + exact evaluate      {m * 1e3:9.1f} ms   "
          f"mean test ACR {statistics.fmean(acr_mine):.4f}")
    if authors is not None:
        t = statistics.median(theirs)
        print(f"  authors: fresh env + resplit + train + {args.eval_samples}-sample evaluate {t * 1e3:9.1f} ms   "
              f"mean test ACR {statistics.fmean(acr_theirs):.4f} (sampled)")
        print(f"  speedup: {t / m:.1f}x")


if __name__ == "__main__":
    main()
