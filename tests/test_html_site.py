"""The static leaderboard site in a real headless Chromium (Selenium): loads from file:// without
console errors or network requests, shows every task, sorts by click and by keyboard.

``full_page_screenshot`` is also how docs/leaderboard_figures/site.png was taken (see docs/leaderboard.md).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from iapo_gym.leaderboard.run.runner import run_sweep
from iapo_gym.leaderboard.run.specs import parse_agent_spec, resolve_task

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")


def chrome(width: int = 1280, height: int = 900, extra: tuple[str, ...] = ()) -> Any:
    """A headless Chromium with browser and performance logs (``extra``: more command-line switches); skips where it
    cannot run here."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (test extra)")
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium/chromedriver not installed (apt-get install -y chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--allow-file-access-from-files", *extra):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def full_page_screenshot(index: Path, png: Path, width: int = 1280) -> Path:
    """Open ``index`` from file:// in headless Chromium and save a full-page PNG ``width`` px wide."""
    driver = chrome(width)
    try:
        driver.get(index.resolve().as_uri())
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": width, "height": int(height), "deviceScaleFactor": 1, "mobile": False})
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        import base64

        png.write_bytes(base64.b64decode(shot["data"]))
    finally:
        driver.quit()
    return png


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny two-task sweep and its --html report."""
    from iapo_gym.leaderboard.report.write import write_report

    out = tmp_path_factory.mktemp("site") / "out"
    agents = [parse_agent_spec(s) for s in ("tests.leaderboard_toy_agents:Greedy@greedy",
                                            "tests.leaderboard_toy_agents:Greedy:pulls=5@greedy5",
                                            "tests.leaderboard_toy_agents:Fixed@fixed")]
    tasks = [resolve_task("synthetic_bernoulli"), resolve_task("synthetic_categorical")]
    summary = run_sweep(out, tasks, agents, [40, 200], 4, log=sys.stderr, bar=False)
    assert not summary.failures
    return write_report(out, html=True, plots=False)["html"]


def _rows(driver: Any, task: str) -> list[str]:
    from selenium.webdriver.common.by import By

    return [tr.get_attribute("data-label") for tr in
            driver.find_elements(By.CSS_SELECTOR, f"#ranking-{task} tbody tr")]


def _column(driver: Any, task: str, index: int) -> list[float]:
    from selenium.webdriver.common.by import By

    return [float(tr.find_elements(By.CSS_SELECTOR, "td, th")[index].get_attribute("data-sort"))
            for tr in driver.find_elements(By.CSS_SELECTOR, f"#ranking-{task} tbody tr")]


@pytest.mark.heavy
def test_site_in_chromium(site: Path, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver = chrome()
    try:
        driver.get(site.as_uri())
        # every task has its section and ranked table; images load (naturalWidth > 0) and have alt text
        for task in ("synthetic_bernoulli", "synthetic_categorical"):
            section = driver.find_element(By.ID, f"task-{task}")
            assert section.find_element(By.TAG_NAME, "h2").text.startswith("Synthetic")
            assert sorted(_rows(driver, task)) == ["fixed", "greedy", "greedy5"]
        images = driver.find_elements(By.TAG_NAME, "img")
        assert images and all(img.get_attribute("alt") for img in images)
        assert all(driver.execute_script("return arguments[0].naturalWidth", img) > 0 for img in images)

        task = "synthetic_bernoulli"
        ranked = _rows(driver, task)
        headers = driver.find_elements(By.CSS_SELECTOR, f"#ranking-{task} thead th")
        names = [h.text for h in headers]
        wins_col, regret_col = names.index("Wins"), names.index("Mean regret")
        # click "Mean regret": ascending (lowest regret first), then descending
        headers[regret_col].find_element(By.TAG_NAME, "button").click()
        regrets = _column(driver, task, regret_col)
        assert regrets == sorted(regrets) and headers[regret_col].get_attribute("aria-sort") == "ascending"
        assert headers[0].get_attribute("aria-sort") == "none"
        headers[regret_col].find_element(By.TAG_NAME, "button").click()
        assert _column(driver, task, regret_col) == sorted(regrets, reverse=True)
        assert headers[regret_col].get_attribute("aria-sort") == "descending"
        # agent column sorts by name
        headers[1].find_element(By.TAG_NAME, "button").click()
        assert _rows(driver, task) == ["fixed", "greedy", "greedy5"]
        # keyboard: focus the Rank header button and press Enter, then Space: rank order, then reversed
        rank_button = headers[0].find_element(By.TAG_NAME, "button")
        rank_button.send_keys(Keys.ENTER)
        assert _rows(driver, task) == ranked and headers[0].get_attribute("aria-sort") == "ascending"
        assert driver.switch_to.active_element == rank_button
        rank_button.send_keys(Keys.SPACE)
        assert _rows(driver, task) == ranked[::-1] and headers[0].get_attribute("aria-sort") == "descending"
        # Tab from the Rank button reaches the Agent button (headers are in the tab order)
        rank_button.send_keys(Keys.TAB)
        assert driver.switch_to.active_element == headers[1].find_element(By.TAG_NAME, "button")
        wins = headers[wins_col].find_element(By.TAG_NAME, "button")
        wins.send_keys(Keys.ENTER)
        assert _column(driver, task, wins_col) == sorted(_column(driver, task, wins_col), reverse=True)
        # sorting by another column resets the Rank header
        assert headers[0].get_attribute("aria-sort") == "none"

        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
        assert errors == [], errors
        urls = []
        for entry in driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                urls.append(message["params"]["request"]["url"])
        assert urls, "the performance log recorded no requests at all"
        assert all(u.startswith(("file://", "data:")) for u in urls), [u for u in urls if not u.startswith("file://")]
        assert any(u.endswith("assets/site.js") for u in urls) and any(u.endswith("assets/site.css") for u in urls)
    finally:
        driver.quit()
    png = full_page_screenshot(site, tmp_path / "site.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_site_sources_are_local(site: Path) -> None:
    """Every src/href of the page is a relative path inside the site folder (no CDN, no absolute paths)."""
    import re

    html = site.read_text()
    refs = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert refs
    for ref in refs:
        if ref.startswith("#"):
            continue
        assert "://" not in ref and not ref.startswith("/"), ref
        assert (site.parent / ref).is_file(), ref


def test_the_site_reuses_the_reports_pairwise_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With plots and --html, each task's win matrices are drawn once; the site holds the report's very file."""
    from iapo_gym.leaderboard.report import plots
    from iapo_gym.leaderboard.report.write import write_report
    from iapo_gym.tables import write_table
    from tests.conftest import tiny_bon_table, tiny_mv_table

    tasks = [resolve_task(str(write_table(make(n_queries=20), tmp_path / f"{name}.h5")))
             for name, make in (("tiny_mv", tiny_mv_table), ("tiny_bon", tiny_bon_table))]
    agents = [parse_agent_spec(s) for s in ("tests.leaderboard_toy_agents:Greedy@greedy",
                                            "tests.leaderboard_toy_agents:Fixed@fixed")]
    assert not run_sweep(tmp_path / "out", tasks, agents, [30], 3, log=sys.stderr, bar=False).failures
    drawn: list[str] = []
    real = plots.plot_win_matrices

    def counted(report: Any, task: str, path: Path) -> Path:
        drawn.append(task)
        return real(report, task, path)

    monkeypatch.setattr(plots, "plot_win_matrices", counted)
    written = write_report(tmp_path / "out", html=True, plots=True)
    assert sorted(drawn) == ["tiny_bon", "tiny_mv"]  # once per task, not again for the site
    site = written["html"].parent / "assets"
    for task in ("tiny_bon", "tiny_mv"):
        assert (site / f"pairwise_{task}.png").read_bytes() == written[f"pairwise_{task}"].read_bytes()
    drawn.clear()
    only_site = write_report(tmp_path / "out", tmp_path / "report2", html=True, plots=False)
    assert sorted(drawn) == ["tiny_bon", "tiny_mv"] and (only_site["html"].parent / "assets" / "pairwise_tiny_mv.png").is_file()
