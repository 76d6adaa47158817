"""The T = 100,000 and T = 10,000 results of docs/online.md are the committed bundles' (benchmarks/bundles): the
docs' merge command, then the benchmark's command as the docs give it, runs nothing and prints every row of the
docs' table and its goal counts; the docs' analysis block prints the figures the prose quotes; and the docs' verify
command re-runs a sample of the bundle's runs bit for bit."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from iapo_gym.cli import main
from tests.conftest import uses_avx512_kernels

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "online.md"
BUNDLE = "benchmarks/bundles/online_100k_iapo_etc.iapo.zip"
BUNDLE_10K = "benchmarks/bundles/online_10k_iapo_etc.iapo.zip"
VW_BUNDLE = "benchmarks/bundles/online_100k_vw.iapo.zip"
VW_BUNDLE_10K = "benchmarks/bundles/online_10k_vw.iapo.zip"


def _section(title: str) -> str:
    """The text of docs/online.md from the heading ``title`` to the next heading of its level or above."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(title + "\n")
    level = len(title.split(" ")[0])
    after = re.search(rf"^#{{1,{level}}} ", text[start + len(title):], re.M)
    return text[start:start + len(title) + after.start()] if after else text[start:]


def _commands(section: str) -> list[str]:
    """Every command of the section's ```bash blocks, continuations joined."""
    out = []
    for block in section.split("```bash\n")[1:]:
        body = block.split("```", 1)[0]
        out += [line.strip() for line in body.replace("\\\n", " ").splitlines() if line.strip()]
    return out


def _report_from_bundle(section: str, bundles: list[str], folder: str, tmp_path: Path) -> str:
    """Run the section's merge command (its bundles linked into ``tmp_path``) and then its benchmark command there;
    the command's output."""
    bench, merge = _commands(section)
    merge = merge.removeprefix("PYTHONPATH=benchmarks ")  # set by the caller (VW's adapter lives in benchmarks/)
    assert bench.startswith(f".venv/bin/python benchmarks/bench_online.py --out {folder}")
    assert merge == f"iapo-gym leaderboard merge {' '.join(bundles)} --out {folder}"
    (tmp_path / "benchmarks" / "bundles").mkdir(parents=True)
    for bundle in bundles:
        (tmp_path / bundle).symlink_to(REPO / bundle)
    assert main(shlex.split(merge)[1:]) == 0
    argv = shlex.split(bench)
    return subprocess.run([sys.executable, str(REPO / argv[1]), *argv[2:]], capture_output=True, text=True,
                          check=True, timeout=600).stdout


def _table_and_counts(section: str, horizon: int) -> tuple[list[str], list[str]]:
    """The section's goal-table rows at ``horizon`` and its goal-count lines."""
    rows = [line for line in section.splitlines() if re.match(rf"^\| \w+ \| \w+ \| {horizon} \|", line)]
    counts = [line for line in section.splitlines() if re.match(r"^- \w+, against `\w+` \(", line)]
    return rows, counts


def _table_is_printed(title: str, bundles: list[str], folder: str, horizon: int, done: int, n_rows: int,
                      n_counts: int, tmp_path: Path) -> None:
    """The section's merge and benchmark commands, run in ``tmp_path``, find its ``done`` runs in the bundles and
    print every one of its ``n_rows`` goal-table rows and ``n_counts`` goal counts (and the figure, if it asks)."""
    section = _section(title)
    out = _report_from_bundle(section, bundles, folder, tmp_path)
    assert f"0 runs added, {done} already in {folder}, 0 failed" in out
    rows, counts = _table_and_counts(section, horizon)
    assert len(rows) == n_rows and len(counts) == n_counts
    printed = set(out.splitlines())
    assert [r for r in rows if r not in printed] == [] and [c for c in counts if c not in printed] == []
    if "--figure" in section:
        assert (tmp_path / folder / "regret_grid.png").stat().st_size > 0


@pytest.mark.heavy
def test_the_10k_table_is_what_the_benchmark_command_prints_from_the_bundle(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # the merge command's PYTHONPATH=benchmarks: VW's adapter
    _table_is_printed("### The benchmark at T = 10,000", [BUNDLE_10K, VW_BUNDLE_10K], "results/online_10k_full", 10000,
                      20160, 84, 12, tmp_path)


@pytest.mark.heavy
def test_the_100k_table_is_what_the_benchmark_command_prints_from_the_bundles(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # the merge command's PYTHONPATH=benchmarks: VW's adapter
    _table_is_printed("### The benchmark at T = 100,000", [BUNDLE, VW_BUNDLE], "results/online_100k_full", 100000,
                      10080, 84, 12, tmp_path)
    # benchmarks/bundles/README.md reports the same grid with the same merge command (run above)
    readme = (REPO / "benchmarks" / "bundles" / "README.md").read_text(encoding="utf-8")
    merges = [c for c in _commands(readme) if "iapo-gym leaderboard merge" in c]
    assert merges == [_commands(_section("### The benchmark at T = 100,000"))[1]]

    # the analysis block of "What is not there yet" prints the figures its prose quotes
    lacking = _section("## What is not there yet")
    block = lacking.split("\n```\n", 1)[1].split("\n```", 1)[0]
    shown = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, check=True, timeout=120)
    etc_zeros, etc_median, at_10k, at_t = re.fullmatch(
        r"etc_auto: (\d+) of 40 runs at 0, median ([\d.]+); iapo_online: median ([\d.]+) at 10K, ([\d.]+) at T\n",
        shown.stdout).groups()
    prose = " ".join(lacking.split())
    assert f"find the exact optimum on {etc_zeros} of the 40 runs" in prose
    assert f"leave a median of {etc_median} at T" in prose
    assert f"the first 10,000 requests alone is {at_10k}, and its median at T {at_t}" in prose


@pytest.mark.heavy
def test_the_bundles_docs_verify_command_re_runs_its_runs_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    readme = (REPO / "benchmarks" / "bundles" / "README.md").read_text(encoding="utf-8")
    verify = next(c for c in _commands(readme) if c.startswith("iapo-gym verify"))
    assert verify.startswith(f"iapo-gym verify {BUNDLE} --sample ")
    if not uses_avx512_kernels():
        pytest.skip("the bundle's generated tables were computed with numpy's AVX-512 exp and log, which this CPU "
                    "lacks: numpy calls the C library's here, whose last bits differ (tests/conftest.py)")
    (tmp_path / "benchmarks" / "bundles").mkdir(parents=True)
    (tmp_path / BUNDLE).symlink_to(REPO / BUNDLE)
    monkeypatch.chdir(tmp_path)
    assert verify.endswith("--no-record")  # the README's command writes nothing beside the committed bundle
    assert main([*shlex.split(verify)[1:], "--sample", "2"]) == 0
    assert "verified: 2 of 2 runs match exactly" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "benchmarks" / "bundles").iterdir()) == [Path(BUNDLE).name]
