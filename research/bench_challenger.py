"""The recommended agent (``auto``) against the paper's best, PSST and PSST+K4, paired per run, with a held-out protocol.

Runs (or resumes) a leaderboard sweep of ``psst``, ``psst_topk:k=4,rho=0.2`` and the challengers
(default: ``auto``), then prints per (task, budget): each agent's regret against the
train-optimal policy (its test ACR minus the agent's), and for each challenger its paired gain
over PSST, over PSST+K4 and over the better of the two in that cell (the one of higher mean
test ACR), each with the two-sided Wilcoxon signed-rank p-value Holm-corrected over every
(task, budget) cell of that comparison, the share of the better agent's regret removed and the
ratio of mean training time to PSST's. ``--markdown`` writes the table, ``--plot`` the regret
against the budget (one panel per task).

The tuning protocol (docs/agents.md, "How auto is chosen and measured"):

1. tune: sweep the candidate specs with ``--seed TUNE_SEED`` into a tuning store;
2. ``--select-from TUNE_STORE... --candidates SPEC...`` picks, from the tuning stores only, the
   candidate with the largest mean share of the better agent's regret removed over the
   ``--select-budgets`` cells of the selection tasks (averaged over the stores, each a tuning
   seed: more of them, less of the pick is one seed's noise; ``--select-rule floor``: the smallest
   such cell instead of the mean): all tasks for the fresh-seed
   table, the two other tasks for each task of the leave-one-task-out (``--loto``) table;
3. report: the picked spec(s) run with a fresh ``--seed`` never used in tuning.

    IAPO_GYM_OFFLINE=1 IAPO_GYM_DATA=../shared/iapo-release nice -n 10 python research/bench_challenger.py \\
        --out results/challenger --runs 200 --jobs 2 \\
        --markdown results/challenger/table.md --plot results/challenger/regret_vs_budget.png

``--timing RUNS`` times the training alone (PSST ``train`` per budget; an anytime challenger
both by ``train_budgets`` up to each budget, as the leaderboard times it, and by ``train``
for one budget), on tables whose samplers are built before any clock starts.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np
from regret_plot import plot_regret

from iapo_gym.cli import main as cli_main
from iapo_gym.leaderboard.report.stats import adjust_pvalues, mean_sem, paired_test
from iapo_gym.leaderboard.run.specs import PAPER_BUDGETS
from iapo_gym.leaderboard.run.store import ResultStore

PSST, TOPK = "psst", "psst+K4"
BASELINES = (PSST, f"psst_topk:k=4,rho=0.2@{TOPK}")
BETTER = "better"

#: (task, budget) -> label -> (per-run test ACR, train-optimal test ACR, train seconds), paired by run index.
Cells = dict[tuple[str, int], dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]]


def label_of(spec: str) -> str:
    """The display label a leaderboard spec gets (``...@label``, else the spec itself)."""
    return spec.rsplit("@", 1)[1] if "@" in spec else spec


def load_cells(out: str, labels: list[str]) -> Cells:
    """Every (task, budget) cell with the runs that all ``labels`` completed."""
    with ResultStore(out, create=False) as store:
        results = store.results()
    raw: dict[tuple[str, int], dict[str, dict[int, tuple[float, float, float]]]] = defaultdict(lambda: defaultdict(dict))
    for r in results:
        if r.label in labels:
            raw[(r.task, r.budget)][r.label][r.run] = (r.acr, r.train_optimal_acr, r.train_seconds)
    cells: Cells = {}
    for key in sorted(raw):
        by_label = raw[key]
        if any(label not in by_label for label in labels):
            continue
        runs = sorted(set.intersection(*(set(by_label[label]) for label in labels)))
        if runs:
            cells[key] = {label: tuple(np.array([by_label[label][r][i] for r in runs]) for i in range(3))  # type: ignore[misc]
                          for label in labels}
    return cells


def analyse(cells: Cells, challengers: list[str]) -> str:
    """The Markdown table: regrets, and each challenger's paired gains with Holm-corrected p-values."""
    keys = list(cells)
    refs = (PSST, TOPK, BETTER)
    gains: dict[tuple[str, str], list[tuple[float, float, float]]] = defaultdict(list)
    pvals: dict[tuple[str, str], list[float]] = defaultdict(list)
    for key in keys:
        cell = cells[key]
        better = PSST if cell[PSST][0].mean() >= cell[TOPK][0].mean() else TOPK
        for ch in challengers:
            for ref in refs:
                base = cell[better if ref == BETTER else ref]
                acr, ref_acr, ceiling = cell[ch][0], base[0], base[1]
                gain = mean_sem(acr - ref_acr)
                regret = float(np.mean(ceiling - ref_acr))
                removed = gain[0] / regret if regret > 0 else float("nan")
                gains[(ch, ref)].append((gain[0], gain[1], removed))
                pvals[(ch, ref)].append(paired_test(acr, ref_acr).p_value)
    adjusted = {k: adjust_pvalues(v, "holm") for k, v in pvals.items()}
    lines = []
    for ch in challengers:
        lines += [f"**{ch}** against PSST, PSST+K4 and the better of the two per cell (regret = train-optimal "
                  "test ACR minus the agent's; gain = paired mean difference of test ACR ± SEM; p: two-sided "
                  "Wilcoxon signed-rank, Holm-corrected over the cells of each comparison; removed = gain / "
                  "regret of the reference; time = mean training time / PSST's)", "",
                  "| task | T | runs | regret psst | regret psst+K4 | regret " + ch + " | better | gain vs better "
                  "| p (Holm) | removed | gain vs psst | p (Holm) | gain vs psst+K4 | p (Holm) | time / psst |",
                  "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for i, key in enumerate(keys):
            cell = cells[key]
            regret = {label: float(np.mean(cell[label][1] - cell[label][0])) for label in (PSST, TOPK, ch)}
            better = PSST if cell[PSST][0].mean() >= cell[TOPK][0].mean() else TOPK
            row = (f"| {key[0]} | {key[1]} | {cell[ch][0].size} | {regret[PSST]:.4f} | {regret[TOPK]:.4f} "
                   f"| {regret[ch]:.4f} | {better}")
            g, s, removed = gains[(ch, BETTER)][i]
            row += f" | {g:+.4f} ± {s:.4f} | {adjusted[(ch, BETTER)][i]:.2g} | {100 * removed:.0f}%"
            for ref in (PSST, TOPK):
                g, s, _ = gains[(ch, ref)][i]
                row += f" | {g:+.4f} ± {s:.4f} | {adjusted[(ch, ref)][i]:.2g}"
            ratio = float(np.mean(cell[ch][2]) / np.mean(cell[PSST][2]))
            lines.append(row + f" | {ratio:.1f}x |")
        lines.append("")
    return "\n".join(lines)


def plot(cells: Cells, labels: list[str], path: Path) -> Path:
    """Regret (mean ± SEM over runs) against the budget, one panel per task."""
    return plot_regret(cells, labels, path)


def share_removed(cell: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], label: str) -> float:
    """The share of the better of PSST / PSST+K4's regret that ``label`` removes in one cell (paired means)."""
    better = PSST if cell[PSST][0].mean() >= cell[TOPK][0].mean() else TOPK
    regret = float(np.mean(cell[better][1] - cell[better][0]))
    gain = float(np.mean(cell[label][0] - cell[better][0]))
    return gain / regret if regret > 0 else float("nan")


def select(stores: list[str], candidates: list[str], tasks: list[str], budgets: list[int],
           penalty_budgets: list[int] | None = None, rule: str = "mean") -> tuple[str, dict[str, float]]:
    """The candidate label of largest score; and every score.

    Each (task, budget) cell of ``budgets`` gets the share removed averaged over the stores; the
    score is the mean of these cells (``rule="mean"``) or the smallest (``"floor"``: a bar on
    every cell is as good as its worst one), minus, per task, the shortfall below 0 of the mean
    share removed over its ``penalty_budgets`` cells (averaged over the stores and the tasks): a
    candidate that loses to the better agent at the penalty budgets pays for it, one that wins
    there gains nothing. Reads only ``stores`` (the tuning stores), so the choice never sees
    the report seeds; each candidate is paired with PSST and PSST+K4 on the runs all three
    completed.
    """
    if rule not in ("mean", "floor"):
        raise ValueError(f"rule must be 'mean' or 'floor', got {rule!r}")
    penalty_budgets = penalty_budgets or []
    wanted = set(budgets) | set(penalty_budgets)
    scores = {}
    for label in candidates:
        per_store, cell_shares = [], []
        for store in stores:
            cells = load_cells(store, [PSST, TOPK, label])
            keys = [k for k in cells if k[0] in tasks and k[1] in wanted]
            if len(keys) < len(tasks) * len(wanted):
                raise SystemExit(f"candidate {label!r} lacks tuning runs in {store} for tasks {tasks} x budgets "
                                 f"{sorted(wanted)}")
            cell_shares.append([share_removed(cells[(t, b)], label) for t in tasks for b in budgets])
            penalty = 0.0
            if penalty_budgets:
                penalty = float(np.mean([min(0.0, float(np.mean([share_removed(cells[(t, b)], label)
                                                                  for b in penalty_budgets]))) for t in tasks]))
            per_store.append(penalty)
        shares = np.mean(cell_shares, axis=0)
        scores[label] = float(np.mean(shares) if rule == "mean" else np.min(shares)) + float(np.mean(per_store))
    best = max(candidates, key=lambda label: scores[label])
    return best, scores


def loto_table(store: str, chosen: dict[str, str], budgets: list[int]) -> str:
    """The leave-one-task-out table: per held-out task, the candidate chosen on the others, against the better
    of PSST / PSST+K4 (paired gain ± SEM, Holm-corrected Wilcoxon over the table's cells, share removed)."""
    rows, pvals = [], []
    for task, label in chosen.items():
        cells = load_cells(store, [PSST, TOPK, label])
        for budget in budgets:
            cell = cells.get((task, budget))
            if cell is None or label not in cell:
                continue
            better = PSST if cell[PSST][0].mean() >= cell[TOPK][0].mean() else TOPK
            gain = mean_sem(cell[label][0] - cell[better][0])
            rows.append((task, budget, label, cell[label][0].size, better, gain, share_removed(cell, label)))
            pvals.append(paired_test(cell[label][0], cell[better][0]).p_value)
    adjusted = adjust_pvalues(pvals, "holm")
    lines = ["Leave-one-task-out: each task's agent is the candidate chosen on the other two tasks' tuning runs "
             "(gain = paired mean difference of test ACR against the better of PSST / PSST+K4 ± SEM; p: two-sided "
             "Wilcoxon signed-rank, Holm-corrected over the cells of this table; removed = gain / the better "
             "agent's regret)", "",
             "| held-out task | T | chosen on the other two | runs | better | gain vs better | p (Holm) | removed |",
             "|---|---:|---|---:|---|---:|---:|---:|"]
    for (task, budget, label, n, better, gain, removed), p in zip(rows, adjusted, strict=True):
        lines.append(f"| {task} | {budget} | {label} | {n} | {better} | {gain[0]:+.4f} ± {gain[1]:.4f} | {p:.2g} "
                     f"| {100 * removed:.0f}% |")
    return "\n".join(lines + [""])


def timing(tasks: list[str], budgets: list[int], spec: str, runs: int, seed: int) -> str:
    """Mean training time of ``spec`` over PSST's per (task, budget), timed alone on warmed tables.

    PSST runs ``train`` per budget; the challenger runs ``train_budgets`` over every budget (the
    clock up to each budget's policy, as the leaderboard times an anytime agent) when it is
    anytime, and ``train`` for each budget alone. Paired by run, interleaved, so load moves both.
    """
    import time

    from agents import make
    from iapo_gym import IAPOEnv
    from iapo_gym.data import load_task_table
    from iapo_gym.leaderboard.run.runner import build_agent
    from iapo_gym.leaderboard.run.specs import parse_agent_spec
    from iapo_gym.seeding import derive_seed

    parsed = parse_agent_spec(spec)
    lines = [f"Training time of {parsed.label} / PSST's (mean over {runs} runs per cell, tables and samplers built "
             "before the clocks start)", "",
             "| task | T | psst (ms) | train (ms) | train / psst | train_budgets up to T (ms) | train_budgets / psst |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for task in tasks:
        totals: dict[str, np.ndarray] = {k: np.zeros(len(budgets)) for k in ("psst", "train", "shared")}
        for run in range(runs):
            env = IAPOEnv(table=load_task_table(task, run))
            env.reset(seed=0)
            env.pull(np.zeros(1, np.int64), np.ones(1, np.int64))  # builds the table's sampler
            env_seed = derive_seed(seed, "timing", task, run)
            for i, budget in enumerate(budgets):
                env.reset(seed=env_seed)
                agent = make("psst", seed=run)
                start = time.perf_counter()
                agent.train(env, budget)
                totals["psst"][i] += time.perf_counter() - start
                env.reset(seed=env_seed)
                agent = build_agent(parsed, run)
                start = time.perf_counter()
                agent.train(env, budget)
                totals["train"][i] += time.perf_counter() - start
            agent = build_agent(parsed, run)
            if getattr(agent, "anytime", False):
                env.reset(seed=env_seed)
                start = time.perf_counter()
                for i, (_, _policy) in enumerate(agent.train_budgets(env, budgets)):
                    totals["shared"][i] += time.perf_counter() - start
            else:
                totals["shared"][:] = np.nan
        for i, budget in enumerate(budgets):
            psst, train, shared = (1000 * totals[k][i] / runs for k in ("psst", "train", "shared"))
            lines.append(f"| {task} | {budget} | {psst:.1f} | {train:.1f} | {train / psst:.1f}x | {shared:.1f} "
                         f"| {shared / psst:.1f}x |")
    return "\n".join(lines + [""])


def versus_table(cells: Cells, label: str, other: str) -> str:
    """``label`` against ``other`` per cell: paired gain ± SEM, Holm-corrected Wilcoxon over the cells."""
    keys = [k for k in cells if label in cells[k] and other in cells[k]]
    gains = [mean_sem(cells[k][label][0] - cells[k][other][0]) for k in keys]
    adjusted = adjust_pvalues([paired_test(cells[k][label][0], cells[k][other][0]).p_value for k in keys], "holm")
    lines = [f"**{label}** against **{other}** (paired mean difference of test ACR ± SEM; p: two-sided Wilcoxon "
             "signed-rank, Holm-corrected over the cells)", "",
             f"| task | T | runs | regret {label} | regret {other} | gain | p (Holm) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for key, gain, p in zip(keys, gains, adjusted, strict=True):
        cell = cells[key]
        r1, r2 = (float(np.mean(cell[x][1] - cell[x][0])) for x in (label, other))
        lines.append(f"| {key[0]} | {key[1]} | {gain[2]} | {r1:.4f} | {r2:.4f} | {gain[0]:+.4f} ± {gain[1]:.4f} | {p:.2g} |")
    return "\n".join(lines + [""])


def check_auto(spec: str) -> None:
    """Say whether the registered ``auto`` is the chosen spec (the same class and parameters)."""
    from agents import make
    from iapo_gym.leaderboard.run.specs import parse_agent_spec

    parsed = parse_agent_spec(spec)
    chosen, auto = make(parsed.name, **parsed.params), make("auto")
    same = type(chosen) is type(auto) and chosen.params() == auto.params()
    print(f"auto {'is' if same else 'is NOT'} the chosen spec {spec} (auto: {type(auto).__name__} {auto.params()})")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file (nothing half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def sweep(args: argparse.Namespace, tasks: list[str], challengers: list[str]) -> None:
    """Run (or resume) the leaderboard of the baselines and ``challengers`` on ``tasks`` into ``args.out``."""
    status = cli_main(["leaderboard", "--tasks", *tasks, "--agents", *BASELINES, *challengers,
                       "--budgets", *args.budgets, "--runs", args.runs, "--jobs", args.jobs,
                       "--seed", args.seed, "--out", args.out, "--no-table"])
    if status != 0:
        raise SystemExit(status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/challenger")
    parser.add_argument("--tasks", nargs="+", default=["math", "synthetic_bernoulli", "synthetic_categorical"])
    parser.add_argument("--budgets", nargs="+", default=[str(b) for b in PAPER_BUDGETS])
    parser.add_argument("--challengers", nargs="+", default=["auto"], help="leaderboard agent specs")
    parser.add_argument("--runs", default="200")
    parser.add_argument("--jobs", default="2")
    parser.add_argument("--seed", default="0", help="the leaderboard's root seed (tune on another than the table's)")
    parser.add_argument("--markdown", type=Path, help="also write the table into this Markdown file")
    parser.add_argument("--plot", type=Path, help="also draw the regret against the budget into this PNG")
    parser.add_argument("--analyse-only", action="store_true", help="only read the results already in --out")
    parser.add_argument("--select-from", nargs="+", metavar="TUNE_STORE",
                        help="choose the challenger among --candidates on these tuning stores' runs (never --out's), "
                             "the score averaged over the stores")
    parser.add_argument("--candidates", nargs="+", default=[], metavar="SPEC",
                        help="the candidate specs of the tuning store (with --select-from); the sweep of --out "
                             "runs --challengers (auto should be the chosen one: it is checked), --loto the folds' choices")
    parser.add_argument("--select-budgets", nargs="+", type=int, default=[3000, 5000, 10000])
    parser.add_argument("--select-rule", choices=["mean", "floor"], default="mean",
                        help="with --select-from: score a candidate by the mean of its cells' shares removed "
                             "(each averaged over the stores) or by the smallest (floor)")
    parser.add_argument("--penalty-budgets", nargs="*", type=int, default=[],
                        help="with --select-from: subtract each task's shortfall below 0 of the mean share removed "
                             "over these budgets (e.g. 20000 30000 40000)")
    parser.add_argument("--loto", action="store_true",
                        help="with --select-from: the leave-one-task-out table (choose on two tasks, report on the third)")
    parser.add_argument("--loto-markdown", type=Path, help="also write the leave-one-task-out table here")
    parser.add_argument("--versus", metavar="LABEL",
                        help="also compare the first challenger with this one (a label among --challengers)")
    parser.add_argument("--timing", type=int, default=0, metavar="RUNS",
                        help="also time the first challenger against PSST alone on RUNS runs per task")
    parser.add_argument("--timing-markdown", type=Path, help="also write the timing table here")
    args = parser.parse_args()
    challengers = list(args.challengers)
    if args.select_from:
        by_label = {label_of(c): c for c in args.candidates}
        if not by_label:
            raise SystemExit("--select-from needs --candidates")
        chosen, scores = select(args.select_from, list(by_label), args.tasks, args.select_budgets,
                                args.penalty_budgets, args.select_rule)
        print(f"chosen on {', '.join(args.tasks)} (tuning stores {', '.join(args.select_from)}): {chosen}; "
              f"score ({args.select_rule} share removed): "
              + ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(scores.items(), key=lambda kv: -kv[1])))
        check_auto(by_label[chosen])
        if args.loto:
            fold = {}
            for task in args.tasks:
                others = [t for t in args.tasks if t != task]
                fold[task], _ = select(args.select_from, list(by_label), others, args.select_budgets,
                                       args.penalty_budgets, args.select_rule)
                print(f"held out {task}: chosen on {', '.join(others)}: {fold[task]}")
            if not args.analyse_only:
                for task in args.tasks:
                    sweep(args, [task], [by_label[fold[task]]])
            text = loto_table(args.out, fold, [int(b) for b in args.budgets])
            print(text)
            if args.loto_markdown:
                write_atomic(args.loto_markdown, text)
    if not args.analyse_only:
        sweep(args, args.tasks, challengers)
    labels_ch = [label_of(c) for c in challengers]
    cells = load_cells(args.out, [PSST, TOPK, *labels_ch])
    text = analyse(cells, labels_ch)
    print(text)
    if args.versus:
        text += "\n" + versus_table(cells, labels_ch[0], args.versus)
        print(text[text.rindex("**" + labels_ch[0] + "** against **"):])
    if args.markdown:
        write_atomic(args.markdown, text + "\n")
    if args.plot:
        print(f"plot: {plot(cells, [PSST, TOPK, *labels_ch], args.plot)}")
    if args.timing:
        text = timing(args.tasks, [int(b) for b in args.budgets], challengers[0], args.timing, int(args.seed))
        print(text)
        if args.timing_markdown:
            write_atomic(args.timing_markdown, text)


if __name__ == "__main__":
    main()
