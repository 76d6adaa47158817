"""Build IAPO outcome tables from your own LLM logs (docs/log-format.md), end to end.

The script writes two small logs itself, standing in for what your generation loop would
record (one JSON line per completion), builds a majority-vote and a Best-of-N table from
them, saves them as HDF5 and prints the exact optimal policy of each. Run it from any folder:

    python examples/build_table_from_logs.py          # writes my_mv.jsonl/.h5, my_bon.jsonl/.h5 here

The same tables come from the command line:

    iapo-gym data build my_mv.jsonl --aggregator mv --top-k 4 --out my_mv.h5
    iapo-gym data build my_bon.jsonl --aggregator bon --grid 0.5 --out my_bon.h5
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from iapo_gym.data.build import build_bon_table, build_mv_table
from iapo_gym.data.summary import format_summary, oracle_summary
from iapo_gym.tables import write_table


def write_mv_log(path: Path, rng: np.random.Generator, n_prompts: int = 3, n_queries: int = 20, per_pair: int = 16) -> None:
    """A fake math log: prompt i answers correctly with probability acc[i], else one of a few wrong integers."""
    accuracy = rng.uniform(0.35, 0.8, n_prompts)
    tokens = rng.uniform(150, 600, n_prompts)
    with path.open("w") as f:
        for q in range(n_queries):
            gold = int(rng.integers(0, 100))
            wrong = gold + rng.integers(1, 20, 6)  # a handful of plausible wrong answers
            for p in range(n_prompts):
                for _ in range(per_pair):
                    correct = rng.random() < accuracy[p]
                    answer = gold if correct else (int(rng.choice(wrong)) if rng.random() < 0.9 else None)
                    record = {"prompt": f"template-{p}", "query": f"problem-{q}", "answer": answer, "gold": gold,
                              "tokens": int(rng.normal(tokens[p], 30))}
                    f.write(json.dumps(record) + "\n")


def write_bon_log(path: Path, rng: np.random.Generator, n_prompts: int = 3, n_queries: int = 20, per_pair: int = 16) -> None:
    """A fake two-objective log: each completion scored by two reward models in [-1, 1]."""
    means = rng.uniform(-0.5, 0.5, (n_prompts, 2))
    spread = rng.uniform(0.1, 0.5, n_prompts)
    with path.open("w") as f:
        for q in range(n_queries):
            for p in range(n_prompts):
                scores = np.clip(means[p] + spread[p] * rng.normal(size=(per_pair, 2)), -1, 1)
                for helpful, harmless in scores:
                    record = {"prompt": f"template-{p}", "query": f"conversation-{q}",
                              "scores": {"helpful": round(float(helpful), 3), "harmless": round(float(harmless), 3)},
                              "tokens": int(rng.integers(80, 300))}
                    f.write(json.dumps(record) + "\n")


def main(out: Path = Path(".")) -> None:
    """Write both logs into ``out``, build and save the tables, print their exact optima."""
    rng = np.random.default_rng(2025)
    mv_log, bon_log = out / "my_mv.jsonl", out / "my_bon.jsonl"
    write_mv_log(mv_log, rng)
    write_bon_log(bon_log, rng)
    mv = build_mv_table(mv_log, task="my_mv", top_k=4, n_max=16)
    bon = build_bon_table(bon_log, task="my_bon", grid=0.5, n_max=16)
    for table in (mv, bon):
        path = write_table(table, out / f"{table.task}.h5")
        print(f"== {path}")
        print(format_summary(table, oracle_summary(table)))


if __name__ == "__main__":
    main()
