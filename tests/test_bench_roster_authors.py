"""benchmarks/bench_roster_authors.py: the agent counterparts and their hyper-parameters, the roster total, a small run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.bench_psst_authors import AUTHORS_AGENTS, matched_params
from benchmarks.bench_roster_authors import TOTAL, check_params, main, summarise
from iapo_gym.leaderboard.run.specs import PAPER_AGENTS, parse_agent_spec

AUTHORS_CODE = Path(__file__).resolve().parents[1].parent / "authors-psst"


def test_every_paper_agent_has_a_counterpart_with_our_hyper_parameters() -> None:
    specs = [parse_agent_spec(a) for a in PAPER_AGENTS]
    assert sorted(s.label for s in specs) == sorted(AUTHORS_AGENTS)
    check_params(specs)
    assert dict((n, (t, o)) for n, t, o in matched_params(parse_agent_spec("ucb"))) == {"ucb_c": (0.1, 0.1)}


def test_a_differing_hyper_parameter_or_an_unknown_agent_stops_the_benchmark() -> None:
    with pytest.raises(SystemExit, match="epsilon_greedy: their epsilon=0.15, ours 0.1"):
        check_params([parse_agent_spec("epsilon_greedy:epsilon=0.1@epsilon_greedy")])
    with pytest.raises(SystemExit, match="'random' has no counterpart"):
        check_params([parse_agent_spec("random")])


def test_the_roster_total_is_the_median_of_each_repeats_sum() -> None:
    """a and b are slow on different repeats: the sum of the medians (2 + 2) is not the median of the sums (11)."""
    times = {"a": [(1.0, 10.0), (2.0, 20.0), (9.0, 90.0)], "b": [(9.0, 90.0), (2.0, 20.0), (1.0, 10.0)]}
    acrs = {"a": [(0.5, 0.6)] * 3, "b": [(0.7, 0.8)] * 3}
    rows = summarise(["a", "b"], 1000, times, acrs)
    assert [r.agent for r in rows] == ["a", "b", TOTAL]
    assert (rows[0].ours, rows[0].theirs, rows[0].ratio) == (2.0, 20.0, 10.0)
    total = rows[-1]
    assert (total.ours, total.theirs, total.ratio) == (10.0, 100.0, 10.0)
    assert total.acr_ours == pytest.approx(0.6) and total.acr_theirs == pytest.approx(0.7)
    one_side = summarise(["a"], 1000, {"a": [(1.0, math.nan)]}, {"a": [(0.5, math.nan)]})
    assert math.isnan(one_side[-1].ratio)


@pytest.mark.skipif(not (AUTHORS_CODE / "Agents").is_dir(), reason=f"the authors' code is not at {AUTHORS_CODE}")
def test_a_small_run_against_the_authors_code(math_release: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("IAPO_GYM_DATA", str(math_release.parent))
    monkeypatch.setenv("IAPO_GYM_CACHE", str(tmp_path))  # the converted MATH table stays out of the session's cache
    main(["--authors-code", str(AUTHORS_CODE), "--budgets", "300", "--repeats", "1", "--eval-samples", "50",
          "--agents", "psst", "ucb", "triple_n1"])
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["psst"], ["ucb"],
                                                                                                ["triple_n1"])}
    assert set(lines) == {"psst", "ucb", "triple_n1"}
    for fields in lines.values():
        assert fields[1] == "300" and float(fields[2]) > 0 and float(fields[3]) > 0 and 0 <= float(fields[5]) <= 1
    assert "roster total" in out and "load average at end" in out
