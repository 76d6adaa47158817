"""Calibrate the generated family ``math_like`` to the MATH release table, and print both side by side.

    python research/calibrate_math_like.py                 # the side-by-side table (median and range over 100 levels)
    python research/calibrate_math_like.py --fit           # the random search that gave MATH_LIKE's point values

MATH is read only from ``../shared/iapo-release/MATH_final.pkl`` (or ``--math PATH``) through the project's safe
loader (``iapo_gym.data.release.read_release``); nothing converted from it is written. The statistics are
``iapo_gym.tasks.generated.mv_statistics``; the fitted point values are the centres of ``MATH_LIKE``'s ranges.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from iapo_gym.data.release import read_release
from iapo_gym.seeding import derive_rng
from iapo_gym.tables import OutcomeTable
from iapo_gym.tasks import generated
from iapo_gym.tasks.generated import MATH_LIKE, MVRanges, level_table, mv_statistics

DEFAULT_MATH = Path(__file__).resolve().parents[1] / ".." / "shared" / "iapo-release" / "MATH_final.pkl"
#: Scale of each statistic in the fit's loss (a difference of one scale costs 1).
SCALES = {"query_acc_p10": 0.05, "query_acc_median": 0.03, "query_acc_p90": 0.03, "prompt_acc_min": 0.08,
          "prompt_acc_median": 0.03, "prompt_acc_max": 0.03, "answers": 0.2, "majority_wrong_n1": 0.03,
          "majority_wrong_nmax": 0.03}
#: The fitted parameters and the box the search draws them from.
SEARCH_BOX = {"skill_mean": (0.5, 3.0), "skill_sd": (0.05, 0.6), "difficulty_sd": (0.8, 3.0),
              "difficulty_skew": (0.0, 6.0), "noise_sd": (0.1, 1.2), "interaction_sd": (0.0, 1.0),
              "distractor_concentration": (0.1, 2.0), "temper_sd": (0.0, 1.0)}


def math_table(path: Path) -> OutcomeTable:
    """The MATH table of the release file (safe unpickling)."""
    if not path.is_file():
        sys.exit(f"no MATH release file at {path}; pass --math PATH")
    return read_release(path, task="math")[0]


def point_ranges(values: dict[str, float]) -> MVRanges:
    """MATH_LIKE with the given parameters fixed to points (the search's candidates)."""
    return replace(MATH_LIKE, prompts=(25, 25), train_queries=(253, 253), **{k: (v, v) for k, v in values.items()})


def simulated(ranges: MVRanges, seeds: int) -> dict[str, float]:
    """Mean statistics over ``seeds`` tables drawn with ``ranges``."""
    rows = []
    for seed in range(seeds):
        params, kwargs = generated.mv_build(derive_rng(7, "calibrate", seed), ranges, binary=False)
        table = OutcomeTable(task="calibration", **kwargs)
        rows.append(mv_statistics(table))
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def loss(stats: dict[str, float], target: dict[str, float]) -> float:
    """Sum of squared scaled differences."""
    return float(sum(((stats[k] - target[k]) / s) ** 2 for k, s in SCALES.items()))


def fit(target: dict[str, float], candidates: int, seeds: int) -> dict[str, float]:
    """Random search in SEARCH_BOX, then as many draws around the best in a box a quarter as wide."""
    rng = np.random.default_rng(20261125)
    best: tuple[float, dict[str, float]] = (np.inf, {})
    for round_, width in ((0, 1.0), (1, 0.25), (2, 0.1)):
        for _ in range(candidates):
            if round_ == 0:
                values = {k: float(rng.uniform(lo, hi)) for k, (lo, hi) in SEARCH_BOX.items()}
            else:
                values = {k: float(np.clip(best[1][k] + width * (hi - lo) * rng.uniform(-0.5, 0.5), lo, hi))
                          for k, (lo, hi) in SEARCH_BOX.items()}
            value = loss(simulated(point_ranges(values), seeds), target)
            if value < best[0]:
                best = (value, values)
                print(f"round {round_} loss {value:.3f} {json.dumps({k: round(v, 3) for k, v in values.items()})}",
                      flush=True)
    return best[1]


def side_by_side(target: dict[str, float], levels: int) -> str:
    """Markdown: MATH's statistics beside math_like's median and range over ``levels`` tuning levels."""
    rows = [mv_statistics(level_table("math_like", level)) for level in range(levels)]
    lines = [f"| statistic | MATH | math_like median | math_like range ({levels} levels) |", "|---|---:|---:|---:|"]
    for key in target:
        values = np.array([r[key] for r in rows])
        lines.append(f"| {key} | {target[key]:.3f} | {np.median(values):.3f} | {values.min():.3f} - {values.max():.3f} |")
    return "\n".join(lines)


def main() -> None:
    """Print the side-by-side table, or run the fit."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--math", type=Path, default=DEFAULT_MATH, help="MATH_final.pkl (default: ../shared/iapo-release/)")
    parser.add_argument("--fit", action="store_true", help="run the random search")
    parser.add_argument("--candidates", type=int, default=40, help="candidates per search round (default 40)")
    parser.add_argument("--seeds", type=int, default=4, help="tables per candidate (default 4)")
    parser.add_argument("--levels", type=int, default=100, help="levels in the side-by-side table (default 100)")
    args = parser.parse_args()
    target = mv_statistics(math_table(args.math.resolve()))
    if args.fit:
        best = fit(target, args.candidates, args.seeds)
        print("best:", json.dumps({k: round(v, 3) for k, v in best.items()}))
        return
    print(side_by_side(target, args.levels))


if __name__ == "__main__":
    main()
