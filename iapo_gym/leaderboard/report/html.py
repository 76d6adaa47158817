"""``iapo-gym report DIR --html``: the leaderboard as a self-contained static site.

``site/index.html`` plus ``site/assets/`` (CSS, JS, PNG plots), rendered from the Jinja2
templates in ``templates/``: one section per task with the ranked table (sortable by any
column from the keyboard), the ACR-against-budget plot, the pairwise significance matrix, and
the provenance of every merged bundle with its verify status. No server, no network: every
resource is a relative file, so the folder can be opened from disk or put on any static host.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from iapo_gym.atomic import atomic_directory
from iapo_gym.leaderboard.report.model import (
    Report,
    budgets_of,
    cells_by_label,
    display_path,
    file_stem,
    labels_by_rank,
    optimal_means,
)
from iapo_gym.leaderboard.report.online import OnlineReport, online_site_views
from iapo_gym.leaderboard.report.stats import win_matrix

TEMPLATES = Path(__file__).resolve().parent / "templates"
ASSETS = ("site.css", "site.js")


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def _fmt(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "–"


def _task_view(report: Report, task: str) -> dict[str, Any]:
    """Everything the template shows for one task."""
    info = report.tasks.get(task)
    budgets = budgets_of(report, task)
    cells = cells_by_label(report, task)
    ranks = [r for r in report.ranking if r.task == task]
    rows = []
    for r in ranks:
        by_budget = {s.budget: s for s in cells[r.label]}
        budget_cells = []
        for b in budgets:
            s = by_budget.get(b)
            if s is None:
                budget_cells.append({"mean": "–", "sem": "", "sort": "", "n": 0})
            else:
                sem = _fmt(s.acr_sem) if math.isfinite(s.acr_sem) else ""
                budget_cells.append({"mean": _fmt(s.acr_mean), "sem": sem, "sort": repr(s.acr_mean), "n": s.n_runs})
        rows.append({"rank": r.rank, "label": r.label, "budgets": budget_cells,
                     "acr": _fmt(r.acr_mean_over_budgets), "acr_sort": repr(r.acr_mean_over_budgets),
                     "regret": _fmt(r.regret_mean_over_budgets), "regret_sort": repr(r.regret_mean_over_budgets),
                     "wins": r.wins, "losses": r.losses})
    labels = labels_by_rank(report, task)
    wins = [[0] * len(labels) for _ in labels]
    losses = [[0] * len(labels) for _ in labels]
    for b in budgets:
        m = win_matrix(report.pairs, task, b, labels)
        for i in range(len(labels)):
            for j in range(len(labels)):
                wins[i][j] += int(m[i, j] > 0)
                losses[i][j] += int(m[i, j] < 0)
    matrix = [{"label": a, "cells": [{"self": i == j, "wins": wins[i][j], "losses": losses[i][j],
                                      "tone": "win" if wins[i][j] > losses[i][j] else
                                      "loss" if losses[i][j] > wins[i][j] else "even"}
                                     for j in range(len(labels))]} for i, a in enumerate(labels)]
    task_cells = [s for s in report.summary if s.task == task]
    optimal, train_opt = optimal_means(report, task)
    best = rows[0] if rows else None
    last = budgets[-1]
    best_last = next((s for s in cells[str(best["label"])] if s.budget == last), None) if best else None
    alt = (f"Line chart of test ACR against training budget T ({', '.join(map(str, budgets))} completions) for "
           f"{len(labels)} agents on {info.title if info else task}, with bands of one standard error and the "
           f"optimal test ACR {optimal:.4f} dashed.")
    if best and best_last is not None:
        alt += f" The top-ranked agent, {best['label']}, reaches {best_last.acr_mean:.4f} at T={last}."
    return {
        "name": task, "title": info.title if info else task, "budgets": budgets, "rows": rows,
        "labels": labels, "matrix": matrix, "optimal": _fmt(optimal), "train_optimal": _fmt(train_opt),
        "n_runs": max(s.n_runs for s in task_cells), "plot": f"assets/acr_vs_budget_{file_stem(task)}.png", "plot_alt": alt,
        "matrix_plot": f"assets/pairwise_{file_stem(task)}.png",
        "aggregator": info.aggregator if info else "", "digests": report.meta.get("checksums", {}).get(task, []),
        "rules": report.meta.get("rules", {}).get(task),  # a --rules run: its stopping rules' labels
    }


def _provenance_view(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for e in entries:
        manifest = e.get("manifest") or {}
        verify = e.get("verify")
        if verify:
            status = (f"{verify.get('status')}: {verify.get('matched')} of {verify.get('sample')} re-run(s) matched "
                      f"exactly (sample seed {verify.get('sample_seed')}, {verify.get('verified_at')})")
            state = "ok" if verify.get("status") == "verified" else "bad"
        else:
            status, state = "not verified", "none"
        out.append({
            "name": e.get("name"), "kind": e.get("kind"), "sha256": e.get("sha256"), "status": status, "state": state,
            "created_at": manifest.get("created_at", ""), "software": manifest.get("software", {}),
            "protocol": manifest.get("protocol", {}), "tasks": manifest.get("tasks", []),
            "agents": manifest.get("agents", []) + (manifest.get("online") or {}).get("agents", []),
            "n_results": manifest.get("n_results"),
            "online": manifest.get("online"),
            "problems": (verify or {}).get("agent_problems", []) + (verify or {}).get("table_problems", []),
            "error": e.get("error"),
        })
    return out


def write_site(report: Report, out_dir: str | Path, site_dir: str | Path,
               pairwise: Mapping[str, Path] | None = None, online: OnlineReport | None = None) -> Path:
    """Render the site for ``report`` (read from ``out_dir``) into ``site_dir``; returns its index.html.

    ``online``: the folder's online runs (``report.online``): a section per task with its ranked regret table per
    schedule and horizon and its regret curves.

    ``pairwise``: per task, its pairwise win-matrix plot already drawn for the report (copied, not
    drawn again); the others are drawn here. Written into a temporary sibling folder first and
    moved into place, so a failure leaves the previous site intact.
    """
    from iapo_gym.leaderboard.report.plots import plot_acr_vs_budget, plot_win_matrices
    from iapo_gym.leaderboard.submit.provenance import site_provenance

    site = Path(site_dir)
    with atomic_directory(site) as tmp:
        assets = tmp / "assets"
        assets.mkdir()
        tasks = sorted({s.task for s in report.summary})
        views = []
        for task in tasks:
            sub = dataclasses.replace(report, summary=[s for s in report.summary if s.task == task])
            plot_acr_vs_budget(sub, assets / f"acr_vs_budget_{file_stem(task)}.png")
            drawn = (pairwise or {}).get(task)
            if drawn is not None:
                shutil.copyfile(drawn, assets / f"pairwise_{file_stem(task)}.png")
            else:
                plot_win_matrices(report, task, assets / f"pairwise_{file_stem(task)}.png")
            views.append(_task_view(report, task))
        online_views = online_site_views(online, assets) if online is not None else []
        for name in ASSETS:
            shutil.copyfile(TEMPLATES / name, assets / name)
        page = _environment().get_template("index.html.j2").render(
            tasks=views, meta=report.meta, test=report.test, correction=report.correction, alpha=report.alpha,
            provenance=_provenance_view(site_provenance(out_dir)), source=display_path(out_dir),
            online=online_views, online_meta=None if online is None else {
                "baseline": online.baseline, "n_runs": online.meta["n_runs"], "batch_size": online.meta["batch_size"],
                "test": online.test, "correction": online.correction, "alpha": online.alpha},
        )
        (tmp / "index.html").write_text(page, encoding="utf-8")
    return site / "index.html"
