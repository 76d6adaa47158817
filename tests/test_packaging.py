"""What a wheel install gets: the package data that the data layer reads at run time."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from iapo_gym.data.registry import entries, registry_path

ROOT = Path(__file__).resolve().parents[1]


def _can_build_wheels() -> bool:
    """setuptools with a bdist_wheel command (built in since 70.1, else from the wheel package)."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


def test_registry_lives_inside_the_package() -> None:
    package_dir = Path(importlib.util.find_spec("iapo_gym.data").origin).parent  # type: ignore[union-attr,arg-type]
    assert registry_path().parent == package_dir
    assert entries() and all(e.git_blob for e in entries())  # read from there, every release file known


@pytest.mark.skipif(not _can_build_wheels(), reason="needs setuptools >= 70.1 or the wheel package to build a wheel offline")
def test_wheel_ships_registry_and_type_marker(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("iapo_gym", "agents"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(source)], check=True, capture_output=True)
    names = set(zipfile.ZipFile(next(out.glob("*.whl"))).namelist())
    assert "iapo_gym/data/registry.json" in names
    assert "iapo_gym/py.typed" in names
    assert "iapo_gym/leaderboard/submit/bundle-schema.json" in names  # bundles are validated against it
    assert "iapo_gym/leaderboard/report/templates/index.html.j2" in names
    assert "iapo_gym/policy.schema.json" in names  # policy files are validated against it
    assert "iapo_gym/llm/spec.schema.json" in names  # collection specs are validated against it


def test_every_agent_module_is_under_500_lines() -> None:
    """One module per agent family, each under 500 lines (docs/architecture.md): a family that outgrows it moves its
    helpers into a module of their own."""
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "agents").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) >= 500}
    assert not long, f"agent modules of 500 lines or more: {long}"
