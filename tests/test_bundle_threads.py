"""A bundle's results do not depend on the thread counts it was made with, and its manifest records the numeric
stack they can depend on (numba, BLAS), which ``verify`` names where a run does not match."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from iapo_gym.leaderboard.submit.bundle import numeric_stack, read_bundle, sha256_bytes
from iapo_gym.leaderboard.submit.verify import verify_bundle

THREAD_VARIABLES = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _cli(args: list[str], threads: int, cwd: Path, jit: str = "1") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **dict.fromkeys(THREAD_VARIABLES, str(threads)), "IAPO_GYM_OFFLINE": "1", "IAPO_GYM_JIT": jit}
    return subprocess.run([sys.executable, "-m", "iapo_gym.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def test_auto_bundle_made_with_two_threads_verifies_with_one(tmp_path: Path) -> None:
    """`auto` on a Best-of-N generated level (the estimator's matrix products and kernels) and a majority-vote one,
    and softmax (the sequential baselines' compiled loop), swept and bundled with every thread pool at 2, re-run by
    ``verify`` with every pool at 1, then also without the compiled loop (``IAPO_GYM_JIT=0``): every run matches bit
    for bit. The manifest records numba and the BLAS this machine loads; both runs see the same stack."""
    out = tmp_path / "out"
    made = _cli(["leaderboard", "--tasks", "generated:bon_shape:0", "generated:mv_binary:0", "--agents", "auto", "softmax",
                 "--budgets", "1500", "--runs", "2", "--out", str(out), "--no-table"], 2, tmp_path)
    assert made.returncode == 0, made.stderr[-2000:]
    bundle = tmp_path / "auto.iapo.zip"
    packed = _cli(["bundle", str(out), "-o", str(bundle)], 2, tmp_path)
    assert packed.returncode == 0, packed.stderr[-2000:]
    software = read_bundle(bundle).manifest["software"]
    assert software["numba"] == numeric_stack()["numba"] and software["blas"] == numeric_stack()["blas"]
    assert software["blas"] and all(lib["vendor"] and lib["version"] for lib in software["blas"])
    for jit in ("1", "0"):
        checked = _cli(["verify", str(bundle), "--sample", "all", "--seed", "0", "--no-record"], 1, tmp_path, jit)
        assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
        assert "verified: 8 of 8 runs match exactly" in checked.stdout
        assert "NUMERIC STACK DIFFERS" not in checked.stdout


def test_verify_names_the_numeric_stack_where_a_run_does_not_match(tmp_path: Path) -> None:
    """A bundle whose manifest records another numba and BLAS, and one of whose runs no longer matches: ``verify``
    fails that run and names both differences (with the bundle's and this machine's values); where every run
    matches it names none."""
    out = tmp_path / "out"
    made = _cli(["leaderboard", "--tasks", "generated:bon_flat:1", "--agents", "auto", "--budgets", "400",
                 "--runs", "2", "--out", str(out), "--no-table"], 1, tmp_path)
    assert made.returncode == 0, made.stderr[-2000:]
    bundle = tmp_path / "b.iapo.zip"
    assert _cli(["bundle", str(out), "-o", str(bundle)], 1, tmp_path).returncode == 0
    assert verify_bundle(bundle, None, 0).stack_differences == []
    with zipfile.ZipFile(bundle) as zf:
        members = {name: zf.read(name) for name in zf.namelist()}
    rows = [json.loads(line) for line in members["results.jsonl"].decode().splitlines()]
    rows[0]["acr"] += 1e-15  # a last-bit difference, as another BLAS kernel could give
    members["results.jsonl"] = "".join(json.dumps(row) + "\n" for row in rows).encode()
    manifest = json.loads(members["manifest.json"])
    manifest["files"]["results.jsonl"] = sha256_bytes(members["results.jsonl"])
    manifest["software"]["numba"] = "0.0.1"
    manifest["software"]["blas"] = [{"vendor": "openblas", "version": "0.0.1", "architecture": "Elsewhere"}]
    members["manifest.json"] = json.dumps(manifest).encode()
    tampered = tmp_path / "t.iapo.zip"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    tampered.write_bytes(buffer.getvalue())
    outcome = verify_bundle(tampered, None, 0)
    assert not outcome.ok and sum(not c.match for c in outcome.checks) == 1
    here = numeric_stack()
    assert f"numba: bundle 0.0.1, here {here['numba']}" in outcome.stack_differences
    assert any(d.startswith("blas: bundle openblas 0.0.1 (Elsewhere), here ") for d in outcome.stack_differences)
    assert not any(d.startswith(("numpy", "python")) for d in outcome.stack_differences)  # the same here
