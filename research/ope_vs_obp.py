"""``iapo-gym evaluate-log``'s estimators on simulated traffic: against the exact values, and against the Open Bandit
Pipeline's (``obp``) estimators on the same log.

The traffic is ``tests/test_ope.py``'s: Synthetic-Bernoulli's three contexts, a known stochastic logging policy over
three arms per context, each request's N completions drawn from the table for a random query, the vote's
correctness as feedback, written through ``OutcomeLog`` and read back. The exact value of each of the three
candidates is the table's exact Q of its arms, weighted by the logged context frequencies.

    python research/ope_vs_obp.py --requests 20000 --seeds 5
    python research/ope_vs_obp.py --requests 20000 --seeds 1 --obp-python .venv310-obp/bin/python

``--obp-python PY``: an interpreter with ``obp`` installed (obp 0.5.7 needs Python < 3.11:
``python3.10 -m venv /tmp/obp310 && /tmp/obp310/bin/pip install --no-deps obp==0.5.7 && /tmp/obp310/bin/pip install
"numpy<2" scipy scikit-learn pandas tqdm matplotlib seaborn pyyaml``). obp's package imports ``torch`` at import
time (for its neural policy learners and a tensor check), which is not installed there (over 700 MB); this script
then gives obp an empty stand-in module for ``torch`` before importing it and says so. The estimators compared
(``InverseProbabilityWeighting``, ``SelfNormalizedInverseProbabilityWeighting``, ``DoublyRobust``) are numpy only.
The same log goes to obp as arrays: the arm index, the propensity (``pscore``), the utility (``reward``), the
candidate's action distribution, and for DR the same leave-one-out plug-in model ``evaluate-log`` uses
(``estimated_rewards_by_reg_model``). obp's intervals are bootstrap intervals (its ``estimate_interval``, 95 %,
1000 resamples), ours normal.

``--nested``: instead, the Best-of-N logs of ``tests/test_ope_nested.py``'s learner (the rule of ``serve --learn``),
where DR uses the nested observation (docs/deploy.md, "DR on a Best-of-N log of serve --learn"). obp's ``DoublyRobust`` gets it as
a bandit of two pseudo-actions per request, "observed" (the candidate's utility seen, with probability P_i) and
"not observed" (1 - P_i), the candidate always choosing "observed", the reward y_i, and the same cross-fitted
model for "observed" (``evaluate``'s ``terms``): its textbook DR is then ours, term by term.

    python research/ope_vs_obp.py --nested --requests 20000 --seeds 3 --obp-python .venv310-obp/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

OBP_SIDE = r"""
import importlib.abc, importlib.machinery, json, sys, types
import numpy as np

class _Meta(type):
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Meta(attr, (), {"__init__": lambda self, *a, **k: None})

class _StandIn(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _Meta(attr, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, attr, value)
        return value

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        return module
    def exec_module(self, module):
        pass

stand_in = False
try:
    import torch  # noqa: F401
except ImportError:
    sys.meta_path.insert(0, _Finder())
    stand_in = True
import obp
from obp.ope import DoublyRobust, InverseProbabilityWeighting, SelfNormalizedInverseProbabilityWeighting

data = np.load(sys.argv[1])
out = {"obp": obp.__version__, "torch_stand_in": stand_in, "candidates": {}}
own = len(sys.argv) > 3  # per-candidate arrays (--nested): action_NAME, pscore_NAME, reward_NAME
for name in json.loads(sys.argv[2]):
    sfx = "_" + name if own else ""
    kw = dict(reward=data["reward" + sfx], action=data["action" + sfx], pscore=data["pscore" + sfx],
              action_dist=data["dist_" + name], position=np.zeros(data["reward" + sfx].size, dtype=int))
    res = {}
    for label, est, extra in (("ips", InverseProbabilityWeighting(), {}),
                              ("snips", SelfNormalizedInverseProbabilityWeighting(), {}),
                              ("dr", DoublyRobust(), {"estimated_rewards_by_reg_model": data["qhat_" + name]})):
        value = float(est.estimate_policy_value(**kw, **extra))
        ci = est.estimate_interval(**kw, **extra, alpha=0.05, n_bootstrap_samples=1000, random_state=0)
        res[label] = {"value": value, "low": float(ci["95.0% CI (lower)"]), "high": float(ci["95.0% CI (upper)"])}
    out["candidates"][name] = res
print(json.dumps(out))
"""


def _arrays(rows: list, candidate_arms: dict, table: object) -> dict:  # type: ignore[type-arg]
    """The log as obp takes it, for one candidate: actions over the union of the logged arms and the candidate's."""
    import numpy as np

    from iapo_gym.ope import arm_key, row_utility

    keys = [tuple(r.weights) for r in rows]
    contexts = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    arm_names = sorted({arm_key(r.prompt, r.n, r.rule) for r in rows})
    index = {a: i for i, a in enumerate(arm_names)}
    action = np.array([index[arm_key(r.prompt, r.n, r.rule)] for r in rows])
    ctx = np.array([contexts[k] for k in keys])
    reward = np.array([row_utility(r, {}) for r in rows], dtype=np.float64)
    n, n_a, n_c = len(rows), len(arm_names), len(contexts)
    # the leave-one-out plug-in q^(x_i, a): the mean over the other rows of context x_i and arm a
    s = np.zeros((n_c, n_a))
    c = np.zeros((n_c, n_a))
    np.add.at(s, (ctx, action), reward)
    np.add.at(c, (ctx, action), 1.0)
    s_i = s[ctx].copy()
    c_i = c[ctx].copy()
    s_i[np.arange(n), action] -= reward
    c_i[np.arange(n), action] -= 1.0
    qhat = np.divide(s_i, c_i, out=np.zeros_like(s_i), where=c_i > 0)[:, :, None]
    names = ("low", "mid", "high")
    dist = np.zeros((n, n_a, 1))
    for i, r in enumerate(rows):
        p, arm_n = candidate_arms[names.index(r.context)]
        dist[i, index[f"{table.prompts[p]}/{arm_n}"], 0] = 1.0  # type: ignore[attr-defined]
    return {"action": action, "pscore": np.array([r.propensity for r in rows]), "reward": reward, "dist": dist,
            "qhat": qhat}


def nested(args: argparse.Namespace) -> None:
    """``--nested`` (module docstring)."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's tests package
    from iapo_gym.deploy.learn import DEFAULT_SPREAD
    from iapo_gym.ope import evaluate
    from tests.test_ope_nested import CANDIDATES, _candidate, _exact, _simulate

    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            rows = _simulate(args.requests, 2000 + seed, directed=True, spread=DEFAULT_SPREAD)
            print(f"seed {2000 + seed}: {len(rows)} requests of the learner")
            arrays: dict[str, np.ndarray] = {}
            ours = {}
            for name, arms in CANDIDATES.items():
                terms: dict[str, np.ndarray] = {}
                _, overall, counts = evaluate(rows, _candidate(arms), terms=terms)
                assert overall.dr is not None
                ours[name] = overall.dr
                seen = terms["observed"] & (terms["probability"] > 0)
                p = terms["probability"]
                n = seen.size
                dist = np.zeros((n, 2, 1))
                dist[:, 0, 0] = 1.0
                qhat = np.zeros((n, 2, 1))
                qhat[:, 0, 0] = terms["model"]
                arrays[f"action_{name}"] = np.where(seen, 0, 1)
                arrays[f"pscore_{name}"] = np.where(seen, p, np.where(p < 1, 1 - p, 1.0))
                arrays[f"reward_{name}"] = np.where(seen, terms["y"], 0.0)
                arrays["dist_" + name], arrays["qhat_" + name] = dist, qhat
                print(f"  {name:<8} exact {_exact(arms, rows):.4f}  DR {overall.dr.value:.6f} "
                      f"[{overall.dr.low:.4f}, {overall.dr.high:.4f}]  observed {counts['observed']}")
            if args.obp_python:
                npz = Path(tmp) / f"nested{seed}.npz"
                np.savez(npz, **arrays)
                run = subprocess.run([args.obp_python, "-c", OBP_SIDE, str(npz), json.dumps(list(CANDIDATES)),
                                      "per-candidate"], capture_output=True, text=True, check=True)
                got = json.loads(run.stdout.strip().splitlines()[-1])
                note = " (torch replaced by an empty stand-in module)" if got["torch_stand_in"] else ""
                print(f"  obp {got['obp']}{note} DoublyRobust on the observation: value (ours - obp), obp's "
                      "bootstrap interval")
                for name, res in got["candidates"].items():
                    dr = res["dr"]
                    print(f"  {name:<8} {dr['value']:.6f} ({ours[name].value - dr['value']:+.1e}) "
                          f"[{dr['low']:.4f}, {dr['high']:.4f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--obp-python", help="an interpreter with obp installed (Python < 3.11)")
    parser.add_argument("--nested", action="store_true",
                        help="the Best-of-N learner's logs of tests/test_ope_nested.py and DR's nested observation")
    args = parser.parse_args()
    if args.nested:
        nested(args)
        return

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's tests package
    from iapo_gym.ope import evaluate
    from tests.test_ope import CANDIDATES, TABLE, _candidate, _exact, _read, _simulate

    covered = dict.fromkeys(CANDIDATES, 0)
    ratios: dict[str, list[float]] = {k: [] for k in CANDIDATES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            folder = Path(tmp) / f"log{seed}"
            _simulate(folder, args.requests, 1000 + seed)
            rows, freq = _read(folder)
            print(f"seed {1000 + seed}: {len(rows)} requests; context shares {np.round(freq, 4).tolist()}")
            print(f"  {'candidate':<10} {'exact':>8}  {'IPS':<27} {'SNIPS':<27} {'DR':<27} {'DR/IPS width':>12}")
            ours = {}
            for name, arms in CANDIDATES.items():
                _, overall, _ = evaluate(rows, _candidate(arms))
                _, true = _exact(arms, freq)
                assert overall.ips and overall.snips and overall.dr
                ratio = (overall.dr.high - overall.dr.low) / (overall.ips.high - overall.ips.low)
                covered[name] += overall.dr.covers(true)
                ratios[name].append(ratio)
                ours[name] = overall

                def cell(e: object) -> str:
                    return f"{e.value:.4f} [{e.low:.4f}, {e.high:.4f}]"  # type: ignore[attr-defined]
                print(f"  {name:<10} {true:>8.4f}  {cell(overall.ips):<27} {cell(overall.snips):<27} "
                      f"{cell(overall.dr):<27} {ratio:>12.3f}")
            if args.obp_python:
                npz = Path(tmp) / f"obp{seed}.npz"
                arrays = {}
                for name, arms in CANDIDATES.items():
                    a = _arrays(rows, arms, TABLE)
                    arrays.update(action=a["action"], pscore=a["pscore"], reward=a["reward"])
                    arrays["dist_" + name], arrays["qhat_" + name] = a["dist"], a["qhat"]
                np.savez(npz, **arrays)
                run = subprocess.run([args.obp_python, "-c", OBP_SIDE, str(npz), json.dumps(list(CANDIDATES))],
                                     capture_output=True, text=True, check=True)
                got = json.loads(run.stdout.strip().splitlines()[-1])
                note = " (torch replaced by an empty stand-in module)" if got["torch_stand_in"] else ""
                print(f"  obp {got['obp']}{note}: value (ours - obp), obp's bootstrap interval")
                for name, res in got["candidates"].items():
                    parts = []
                    for label in ("ips", "snips", "dr"):
                        mine = getattr(ours[name], label).value
                        parts.append(f"{label} {res[label]['value']:.6f} ({mine - res[label]['value']:+.1e}) "
                                     f"[{res[label]['low']:.4f}, {res[label]['high']:.4f}]")
                    print(f"  {name:<10} " + "; ".join(parts))
    print(f"exact value inside the DR interval: {covered} of {args.seeds} seeds; median DR/IPS interval width: "
          f"{ {k: round(float(np.median(v)), 3) for k, v in ratios.items()} }")


if __name__ == "__main__":
    sys.exit(main())
