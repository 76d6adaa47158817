"""Every parser of outside input, fuzzed from valid seeds (short run; ``tools/fuzz.py`` runs 10,000 each).

Each mutated input must be accepted or refused with the parser's documented error naming the file,
with nothing left in the output folder and within the target's memory bound (``tests/fuzz_targets.py``).
"""

from __future__ import annotations

import io
import pickle
import random
import re
import tarfile
import tracemalloc
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from iapo_gym.data.release import ReleaseError, load_release_objects
from iapo_gym.leaderboard.submit import bundle as bundle_module
from iapo_gym.leaderboard.submit.bundle import BundleError, read_bundle
from iapo_gym.policy import Policy, PolicyError
from iapo_gym.tables import TableError, read_table
from tests.fuzz_targets import BOMBS, TARGETS, Target, _Member, _tar_bytes, _zip_bytes, bundle_members, mutate, run_one

#: Examples per target in the test suite (about 0.5-3 s per target).
EXAMPLES = 120


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_seeds_are_accepted(name: str) -> None:
    """The valid seeds parse: the fuzzer starts from real inputs, so its mutations reach deep code."""
    target = TARGETS[name]
    for seed in target.seeds():
        assert run_one(target, seed) == run_one(target, seed)
        outcome = run_one(target, seed)
        assert outcome.kind == "accepted", outcome.detail


@pytest.mark.parametrize("name", sorted(n for n, t in TARGETS.items() if not t.isolate))
def test_fuzzed_inputs_are_accepted_or_refused_cleanly(name: str) -> None:
    target: Target = TARGETS[name]
    kinds: list[str] = []
    causes: set[str] = set()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(st.randoms(use_true_random=False))
    def check(rnd: random.Random) -> None:
        outcome = run_one(target, mutate(target, rnd))
        kinds.append(outcome.kind)
        assert outcome.kind != "failed", outcome.detail
        if outcome.kind == "refused":  # the cause without the file's (temporary) path and the values
            causes.add(re.sub(r"\S*input\.\S+", "FILE", outcome.detail)[:45])

    check()
    # The mutations break inputs in many ways, each caught by a different check of the parser.
    assert kinds.count("refused") >= EXAMPLES // 2 and len(causes) >= 5, sorted(causes)


def test_the_harness_catches_a_parser_that_fails(tmp_path: Path) -> None:
    """A parser raising the wrong class, naming no file, leaving a file or allocating too much is a failure."""
    def wrong_class(path: Path, out: Path) -> None:
        raise KeyError("arms")

    def no_file_name(path: Path, out: Path) -> None:
        raise PolicyError("field 'arms' is missing")

    def leaves_a_file(path: Path, out: Path) -> None:
        (out / "half.h5").write_bytes(b"x")
        raise PolicyError(f"{path}: bad")

    def too_much(path: Path, out: Path) -> None:
        blob = np.ones(4 << 20)  # 32 MiB
        raise PolicyError(f"{path}: bad {blob.size}")

    for parse, words in ((wrong_class, "KeyError"), (no_file_name, "does not name the file"),
                         (leaves_a_file, "half.h5"), (too_much, "more than the bound")):
        target = Target("t", ".json", (PolicyError,), lambda: [b"{}"], parse, (), memory_bound=8 << 20)
        outcome = run_one(target, b"{}")
        assert outcome.kind == "failed" and words in outcome.detail


# ---- the hostile inputs the issue names, one by one ------------------------------------------------


def _valid_members() -> list[_Member]:
    return [_Member(n, d) for n, d in bundle_members()]


def test_zip_bomb_is_refused_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Members whose declared sizes add up past MAX_BUNDLE_BYTES are refused before any is decompressed."""
    monkeypatch.setattr(bundle_module, "MAX_BUNDLE_BYTES", 10 << 20)
    path = tmp_path / "bomb.iapo.zip"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in bundle_members()[:2]:
            zf.writestr(name, data)
        zf.writestr("tasks.jsonl", b"\0" * (12 << 20))
    path.write_bytes(buf.getvalue())
    assert path.stat().st_size < 1 << 20  # 12 MiB of zeros compress to a few KiB
    tracemalloc.start()
    with pytest.raises(BundleError, match=r"bomb\.iapo\.zip: members add up to \d+ bytes, more than the limit"):
        read_bundle(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20


@pytest.mark.parametrize("declared", [3 << 30, 1 << 40])
def test_tar_member_with_a_huge_declared_size_is_refused_unread(tmp_path: Path, declared: int) -> None:
    members = _valid_members()
    members[1].declared = declared
    path = tmp_path / "huge.iapo.tar.gz"
    path.write_bytes(_tar_bytes(members, random.Random(0)))
    with pytest.raises(BundleError, match=r"huge\.iapo\.tar\.gz: member 'results\.jsonl' is \d+ bytes, more than"):
        read_bundle(path)


@pytest.mark.parametrize("kind", ["zip", "tar"])
def test_many_members_are_refused(tmp_path: Path, kind: str) -> None:
    members = _valid_members() + [_Member(f"d{i}/", b"", "dir") for i in range(100)]
    path = tmp_path / f"many.iapo.{'zip' if kind == 'zip' else 'tar.gz'}"
    path.write_bytes(_zip_bytes(members, random.Random(0)) if kind == "zip" else _tar_bytes(members, random.Random(0)))
    with pytest.raises(BundleError, match=rf"{path.name}: .*more than the limit of {bundle_module.MAX_MEMBERS}"):
        read_bundle(path)


@pytest.mark.parametrize("name", ["../results.jsonl", "/etc/manifest.json", "a/../../tasks.jsonl", "C:\\x.json"])
@pytest.mark.parametrize("kind", ["zip", "tar"])
def test_traversal_and_absolute_names_are_refused(tmp_path: Path, kind: str, name: str) -> None:
    members = _valid_members() + [_Member(name, b"{}")]
    path = tmp_path / f"evil.iapo.{'zip' if kind == 'zip' else 'tar.gz'}"
    path.write_bytes(_zip_bytes(members, random.Random(0)) if kind == "zip" else _tar_bytes(members, random.Random(0)))
    with pytest.raises(BundleError, match=r"evil\.iapo\.\S+: refusing unsafe member name"):
        read_bundle(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nothing extracted


@pytest.mark.parametrize("link", ["symlink", "hardlink", "fifo"])
def test_links_and_special_files_in_tar_are_refused(tmp_path: Path, link: str) -> None:
    members = _valid_members() + [_Member("extra", b"", link)]
    path = tmp_path / "link.iapo.tar.gz"
    path.write_bytes(_tar_bytes(members, random.Random(0)))
    with pytest.raises(BundleError, match=r"link\.iapo\.tar\.gz: refusing member 'extra': not a regular file"):
        read_bundle(path)


@pytest.mark.parametrize("index", range(len(BOMBS)))
def test_release_pickle_bombs_and_forbidden_globals_are_refused(tmp_path: Path, index: int) -> None:
    """Allocation requests past the file's size, forbidden globals and truncated giants: ReleaseError, small peak."""
    path = tmp_path / "bomb.pkl"
    path.write_bytes(BOMBS[index])
    tracemalloc.start()
    with pytest.raises(ReleaseError, match=r"bomb\.pkl"):
        load_release_objects(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20


def test_release_pickle_of_real_arrays_still_loads(tmp_path: Path) -> None:
    """The allocation bound admits genuine arrays (their bytes are in the file)."""
    path = tmp_path / "arrays.pkl"
    path.write_bytes(pickle.dumps([np.arange(1000.0), np.zeros((3, 4), dtype=np.int64)], protocol=4))
    with pytest.raises(ReleaseError, match="expected a list of IAPO environment objects"):
        load_release_objects(path)  # loads the arrays, then refuses them as not being environments


def test_hdf5_dataset_declared_huge_is_refused_before_reading(tmp_path: Path) -> None:
    seed = TARGETS["hdf5_table"].seeds()[0]
    path = tmp_path / "huge.h5"
    path.write_bytes(seed)
    with h5py.File(path, "r+") as f:
        del f["probs"]
        f.create_dataset("probs", shape=(1 << 20, 1 << 20, 8), dtype="f8", chunks=(1, 1, 8), fillvalue=0.5)
    assert path.stat().st_size < 1 << 20
    with pytest.raises(TableError, match=r"huge\.h5: its datasets declare \d+ bytes, more than the limit"):
        read_table(path)


@pytest.mark.parametrize(("text", "field"), [
    (b"{", "not valid JSON"), (b"[]", "'arms'"), (b'{"arms": [[0]]}', "'arms[0]'"),
    (b'{"arms": [[0, 0]]}', "'arms[0]'"), (b'{"arms": [[-1, 2]]}', "'arms[0]'"), (b'{"arms": [[0, true]]}', "'arms[0]'"),
    (b'{"arms": [[0, 1], "x"]}', "'arms[1]'"), (b"\xff", "not valid JSON"),
])
def test_policy_json_errors_name_the_source_and_field(text: bytes, field: str) -> None:
    with pytest.raises(PolicyError, match=rf"deploy/policy\.json: .*{re.escape(field)}"):
        Policy.from_json(text, source="deploy/policy.json")
    assert Policy.from_json(Policy(((0, 1), (2, 8))).to_json()) == Policy(((0, 1), (2, 8)))


def test_tar_bundles_from_write_bundle_layout_still_read(tmp_path: Path) -> None:
    """The lazy tar reader reads what the writer writes (regular members, no folders)."""
    path = tmp_path / "ok.iapo.tar.gz"
    path.write_bytes(_tar_bytes(_valid_members(), random.Random(1)))
    with tarfile.open(path) as tf:
        assert [t.name for t in tf] == ["manifest.json", "results.jsonl", "tasks.jsonl"]
    assert len(read_bundle(path).results) == 16


@pytest.mark.parametrize("seed", [1, 2])  # _zip_bytes draws bzip2 (1) or deflate (2) for the member
def test_zip_member_that_understates_its_size_is_not_inflated(tmp_path: Path, seed: int) -> None:
    """A header claiming 10 bytes for 50 MiB of zeros: refused without inflating them (a whole-member
    read took 133 MB here)."""
    members = [_Member("manifest.json", b"{}"), _Member("results.jsonl", b"\0" * (50 << 20), declared=10),
               _Member("tasks.jsonl", b"")]
    path = tmp_path / "liar.iapo.zip"
    path.write_bytes(_zip_bytes(members, random.Random(seed)))
    assert path.stat().st_size < 1 << 20
    tracemalloc.start()
    with pytest.raises(BundleError, match=r"liar\.iapo\.zip.*(compression method 12|Bad CRC-32)"):
        read_bundle(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20
