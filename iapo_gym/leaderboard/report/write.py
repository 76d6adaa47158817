"""``iapo-gym report DIR``: the ranked Markdown leaderboard, CSV and JSON, the plots and the site."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from iapo_gym.leaderboard.report.files import jsonable, write_csv
from iapo_gym.leaderboard.report.model import Report, build_report, file_stem, modal_arms, optimal_means
from iapo_gym.leaderboard.report.stats import DEFAULT_ALPHA, PairwiseRow, SummaryRow
from iapo_gym.leaderboard.run.store import TaskInfo


def _pm(mean: float, sem: float, digits: int = 4) -> str:
    if not math.isfinite(mean):
        return "-"
    if not math.isfinite(sem):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {sem:.{digits}f}"


def markdown(report: Report, policies: bool = True) -> str:
    """The ranked leaderboard as Markdown: one table per task, agents by mean ACR over budgets
    (``policies``: also the best agent's most frequent arm per context)."""
    lines = ["# iapo-gym leaderboard", ""]
    versions = ", ".join(report.meta.get("versions", []))
    lines.append(f"{report.meta.get('n_runs', 0)} runs from `{report.meta.get('database')}` (iapo-gym {versions}; "
                 f"root seed {report.meta.get('root_seed')}). Exact test ACR, mean ± SEM over runs. Pairwise "
                 f"{report.test} tests, {report.correction} correction per (task, budget), alpha {report.alpha}; "
                 "W/L = significant wins/losses summed over budgets.")
    arm_rules: dict[str, list[str]] = report.meta.get("rules", {})
    by_cell = {(s.task, s.label, s.budget): s for s in report.summary}
    for task in sorted({s.task for s in report.summary}):
        info = report.tasks.get(task)
        budgets = sorted({s.budget for s in report.summary if s.task == task})
        ranks = [r for r in report.ranking if r.task == task]
        cells = [s for s in report.summary if s.task == task]
        optimal, train_opt = optimal_means(report, task)
        title = info.title if info else task
        n_runs = max(s.n_runs for s in cells)
        lines += ["", f"## {title} (`{task}`)", "",
                  f"Runs per cell: up to {n_runs}. Optimal test ACR {optimal:.4f}; the train-optimal policy "
                  f"reaches {train_opt:.4f} on the test split.", ""]
        if task in arm_rules:
            lines += [f"Arm set: (prompt, N, stopping rule) with the rules {', '.join(arm_rules[task])} "
                      "(rule 0 is fixed N); the optimum and the regret are over this enlarged arm set.", ""]
        header = ["rank", "agent"] + [f"T={b}" for b in budgets] + ["mean regret", "W/L"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join(["---:", ":---"] + ["---:"] * (len(budgets) + 2)) + "|")
        for r in ranks:
            row = [str(r.rank), r.label]
            for b in budgets:
                s = by_cell.get((task, r.label, b))
                row.append(_pm(s.acr_mean, s.acr_sem) if s else "-")
            row += [f"{r.regret_mean_over_budgets:.4f}", f"{r.wins}/{r.losses}"]
            lines.append("| " + " | ".join(row) + " |")
        best = ranks[0].label if ranks else None
        if task in report.meta.get("mixed_shapes", ()):
            lines += ["", "The runs' tables differ in prompts, N_max or contexts (one generated level per run): "
                      "no per-context policy table."]
        elif policies and best is not None and info is not None:
            arm_kind = "p, N, rule" if task in arm_rules else "p, N"
            lines += ["", f"Policy of `{best}` at T={budgets[-1]} over the runs (prompt index p, completions N"
                      + (", stopping rule" if task in arm_rules else "")
                      + "; synthetic runs are different instances, so compare the last column there):", ""]
            lines += _policy_table(report, task, best, budgets[-1], info, arm_kind, arm_rules.get(task))
    return "\n".join(lines) + "\n"


def _policy_table(report: Report, task: str, label: str, budget: int, info: TaskInfo, arm_kind: str = "p, N",
                  rules: list[str] | None = None) -> list[str]:
    chosen, optimal = modal_arms(report.results, task, label, budget)
    hits = [0] * len(chosen)
    runs = 0
    for r in report.results:
        if r.task == task and r.label == label and r.budget == budget:
            runs += 1
            for c, (arm, opt) in enumerate(zip(json.loads(r.arms), json.loads(r.optimal_arms), strict=True)):
                hits[c] += arm == opt
    lines = [f"| context | most chosen ({arm_kind}) | share of runs | most often optimal ({arm_kind}) "
             "| runs choosing the optimal arm |",
             "|:---|---:|---:|---:|---:|"]

    def shown(key: tuple[int, ...]) -> str:
        if rules is not None and len(key) == 3:
            return f"({key[0]}, {key[1]}, {rules[key[2]] if key[2] < len(rules) else key[2]})"
        return "(" + ", ".join(map(str, key)) + ")"

    for c, (counter, opt) in enumerate(zip(chosen, optimal, strict=True)):
        most, k = counter.most_common(1)[0]
        best, _ = opt.most_common(1)[0]
        name = info.context_names[c] if c < len(info.context_names) else str(c)
        lines.append(f"| {name} | {shown(most)} | {k / runs:.0%} | {shown(best)} | {hits[c] / runs:.0%} |")
    return lines


def write_report(out_dir: str | Path, report_dir: str | Path | None = None, *, plots: bool = True,
                 test: str = "wilcoxon", correction: str = "holm", alpha: float = DEFAULT_ALPHA,
                 html: bool = False, baseline: str | None = None) -> dict[str, Path]:
    """Write leaderboard.md, summary.csv, pairwise.csv, leaderboard.json and the PNG plots
    (``html``: also the static site ``site/index.html``, see ``iapo_gym.leaderboard.report.html``).
    A folder with online runs (``--protocol online``) also gets the online report (``report.online``: online.md,
    its CSV and JSON, the regret curves), its statistics paired against ``baseline`` (default ``etc_auto``).

    Returns the written paths by kind; ``report_dir`` defaults to ``out_dir/report``.
    """
    from iapo_gym.leaderboard.report.online import online_report, write_online

    report = build_report(out_dir, test, correction, alpha)
    online = online_report(out_dir, test, correction, alpha, baseline)
    if not report.results and online is None:
        raise ValueError(f"no results in {out_dir} yet (run `iapo-gym leaderboard --out {out_dir}` first)")
    target = Path(report_dir) if report_dir is not None else Path(out_dir) / "report"
    target.mkdir(parents=True, exist_ok=True)
    if online is not None and not report.results:  # a folder of online runs only
        only = write_online(online, target, plots)
        only["markdown"] = only.pop("online_markdown")
        if html:
            from iapo_gym.leaderboard.report.html import write_site

            only["html"] = write_site(report, out_dir, target / "site", online=online)
        return only
    written: dict[str, Path] = {}
    written["markdown"] = target / "leaderboard.md"
    written["markdown"].write_text(markdown(report))
    written["summary_csv"] = target / "summary.csv"
    write_csv(written["summary_csv"], report.summary, SummaryRow)
    written["pairwise_csv"] = target / "pairwise.csv"
    write_csv(written["pairwise_csv"], report.pairs, PairwiseRow)
    written["json"] = target / "leaderboard.json"
    payload = {
        "meta": report.meta, "test": report.test, "correction": report.correction, "alpha": report.alpha,
        "tasks": {k: asdict(v) for k, v in report.tasks.items()},
        "ranking": [asdict(r) for r in report.ranking],
        "summary": [asdict(s) for s in report.summary],
        "pairwise": [asdict(p) for p in report.pairs],
    }
    written["json"].write_text(json.dumps(jsonable(payload), indent=1))
    if plots:
        from iapo_gym.leaderboard.report.plots import plot_acr_vs_budget, plot_best_policy, plot_win_matrices

        written["acr_vs_budget"] = plot_acr_vs_budget(report, target / "acr_vs_budget.png")
        for task in sorted({s.task for s in report.summary}):
            written[f"pairwise_{task}"] = plot_win_matrices(report, task, target / f"pairwise_{file_stem(task)}.png")
            path = plot_best_policy(report, task, target / f"best_policy_{file_stem(task)}.png")
            if path is not None:
                written[f"best_policy_{task}"] = path
    if online is not None:
        written.update(write_online(online, target, plots))
    if html:
        from iapo_gym.leaderboard.report.html import write_site

        drawn = {task: written[f"pairwise_{task}"] for task in {s.task for s in report.summary}} if plots else None
        written["html"] = write_site(report, out_dir, target / "site", pairwise=drawn, online=online)
    return written
