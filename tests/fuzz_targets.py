"""Fuzz targets: every parser of outside input, its valid seeds, its mutators and the errors it may raise.

``TARGETS`` is the registry; a new parser is one ``register(Target(...))`` call. Each example starts
from a valid seed (a spec, a log, a bundle, a pickle, a table, a policy) and corrupts it: structured
mutations (drop, rename or retype a key, huge numbers, NaN, lone surrogates, deep nesting, unsafe
archive member names, symlinks, declared sizes past the limits, allocation bombs) and then, often,
byte-level ones (flips, truncation, junk). ``run_one`` feeds the result to the parser and classifies:

- ``accepted``: the parser returned;
- ``refused``: it raised one of the target's documented error classes, with a message naming the
  input file, and left nothing in its output folder;
- ``failed``: anything else (another exception, a message without the file name, a file left
  behind, or more memory than the target's bound, measured by ``tracemalloc``).

Used by ``tests/test_fuzz_parsers.py`` (a short run per target) and ``tools/fuzz.py``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gzip
import hashlib
import io
import json
import pickle
import random
import shutil
import struct
import sys
import tarfile
import tempfile
import tracemalloc
import types
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

Mutator = Callable[[bytes, random.Random], bytes]
MiB = 1 << 20


@dataclass(frozen=True)
class Target:
    """One parser of outside input, as the fuzzer drives it."""

    name: str
    suffix: str  # the input file's suffix (parsers choose the format by it)
    errors: tuple[type[Exception], ...]  # the documented refusals
    seeds: Callable[[], list[bytes]]  # valid inputs, each accepted as is
    parse: Callable[[Path, Path], object]  # (input file, empty output folder) -> anything
    mutators: tuple[Mutator, ...]  # structured mutators for this format
    memory_bound: int = 64 * MiB  # peak traced allocation while parsing one input
    byte_level: float = 0.3  # chance of byte-level corruption after the structured mutations
    isolate: bool = False  # parse in a forked child with a time limit (the C library below may hang)


TARGETS: dict[str, Target] = {}


def register(target: Target) -> Target:
    """Add ``target`` to the registry (one line per parser)."""
    TARGETS[target.name] = target
    return target


@dataclass(frozen=True)
class Outcome:
    """What one input did: ``accepted``, ``refused`` or ``failed`` (with the reason)."""

    kind: str
    detail: str = ""


def run_one(target: Target, data: bytes) -> Outcome:
    """Parse ``data`` (as a file named ``input`` + suffix) and classify the outcome."""
    work = Path(tempfile.mkdtemp(prefix="iapo-fuzz-"))
    try:
        path = work / f"input{target.suffix}"
        path.write_bytes(data)
        out = work / "out"
        out.mkdir()
        tracemalloc.start()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                target.parse(path, out)
            kind, detail = "accepted", ""
        except target.errors as exc:
            message = str(exc)
            if path.name not in message:
                return Outcome("failed", f"{type(exc).__name__} does not name the file {path.name}: {message[:300]}")
            kind, detail = "refused", f"{type(exc).__name__}: {message[:200]}"
        except (Exception, RecursionError, MemoryError) as exc:  # noqa: B014 (named for the reader)
            return Outcome("failed", f"{type(exc).__name__}: {str(exc)[:300]}")
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        if peak > target.memory_bound:
            return Outcome("failed", f"{kind} but allocated {peak} bytes, more than the bound {target.memory_bound}")
        if kind == "refused":
            left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
            if left:
                return Outcome("failed", f"refused but left {left[:5]} in the output folder ({detail})")
        return Outcome(kind, detail)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_isolated(target: Target, data: bytes, timeout: float = 5.0) -> Outcome:
    """``run_one`` in a forked child: a parser stuck in C code for ``timeout`` seconds is killed and failed."""
    import os
    import signal
    import time

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: classify, send the outcome, leave without cleanup handlers
        os.close(read)
        try:
            outcome = run_one(target, data)
            payload = json.dumps([outcome.kind, outcome.detail]).encode()
        except BaseException as exc:  # noqa: BLE001 (the parent must hear something)
            payload = json.dumps(["failed", f"harness: {exc!r}"]).encode()
        os.write(write, payload)
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + timeout
    status = 0
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.002)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)
        return Outcome("failed", f"no answer within {timeout:g} s (stuck in the parser or the library below)")
    with os.fdopen(read, "rb") as fh:
        answer = fh.read()
    if not answer:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit status {os.waitstatus_to_exitcode(status)}"
        return Outcome("failed", f"the parsing process died ({how})")
    kind, detail = json.loads(answer)
    return Outcome(kind, detail)


def mutate(target: Target, rnd: random.Random) -> bytes:
    """A seed of ``target`` after 1-4 structured mutations and, sometimes, byte-level corruption."""
    seeds = target.seeds()
    data = seeds[rnd.randrange(len(seeds))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate names it is asked to write
        for _ in range(rnd.randint(1, 3)):
            data = rnd.choice(target.mutators)(data, rnd)
    if rnd.random() < target.byte_level:
        data = rnd.choice(BYTE_MUTATORS)(data, rnd)
    return data


# ---- generic byte-level mutators -------------------------------------------------------------------


def flip_bytes(data: bytes, rnd: random.Random) -> bytes:
    """Overwrite 1-8 random bytes."""
    if not data:
        return bytes([rnd.randrange(256)])
    buf = bytearray(data)
    for _ in range(rnd.randint(1, 8)):
        buf[rnd.randrange(len(buf))] = rnd.randrange(256)
    return bytes(buf)


def truncate(data: bytes, rnd: random.Random) -> bytes:
    """Cut the input at a random point."""
    return data[: rnd.randrange(len(data) + 1)]


JUNK = [b"\x00", b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", "é😀\u202e".encode(), b"\r\n", b"\n\n", b"{", b"]",
        b"\"", b"\\", b"9" * 5000, b"[" * 3000, b"NaN", b"-Infinity"]


def insert_junk(data: bytes, rnd: random.Random) -> bytes:
    """Insert invalid UTF-8, control characters, brackets or long digit runs somewhere."""
    at = rnd.randrange(len(data) + 1)
    return data[:at] + rnd.choice(JUNK) + data[at:]


def duplicate_chunk(data: bytes, rnd: random.Random) -> bytes:
    """Repeat a random slice in place."""
    if not data:
        return data
    a = rnd.randrange(len(data))
    b = min(len(data), a + rnd.randint(1, 256))
    return data[:b] + data[a:b] * rnd.randint(1, 4) + data[b:]


BYTE_MUTATORS: tuple[Mutator, ...] = (flip_bytes, truncate, insert_junk, duplicate_chunk)

# ---- JSON documents --------------------------------------------------------------------------------

#: Replacement values: wrong types, extremes, NaN, unicode, empty containers.
VALUES: list[Any] = [None, True, False, 0, -1, 1, 2**63, -(2**63) - 1, 10**400, 1e308, -0.0, 0.5,
                     float("nan"), float("inf"), float("-inf"), "", " ", "\u0000", "\ud800", "é😀\u202e", "x" * 3000,
                     "{query}", "../../etc/passwd", "http://127.0.0.1:9/v1", "mv", "bon", "chat", "train", "test",
                     [], {}, [1, "a", None], {"a": {"b": [1]}}, [[0, 1]] * 3, list(range(50))]
#: Raw JSON text that no Python value serializes to: deep nesting, over-long integers.
RAW = ["[" * 20000 + "]" * 20000, "{\"a\":" * 5000 + "1" + "}" * 5000, "9" * 5000, "1e99999", "-1e-99999"]


def _containers(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, dict):
        yield path
        for k, v in node.items():
            yield from _containers(v, path + (k,))
    elif isinstance(node, list):
        yield path
        for i, v in enumerate(node):
            yield from _containers(v, path + (i,))


def _at(node: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        node = node[key]
    return node


def mutate_tree(doc: Any, rnd: random.Random) -> tuple[Any, dict[str, str]]:
    """One structural change to a parsed JSON document; returns it and raw-text substitutions."""
    doc = copy.deepcopy(doc)
    raws: dict[str, str] = {}
    paths = list(_containers(doc))
    if not paths:
        return rnd.choice(VALUES), raws
    node = _at(doc, rnd.choice(paths))
    keys = list(node) if isinstance(node, dict) else list(range(len(node)))
    op = rnd.randrange(6)
    if not keys or op == 0:  # add an element or a key
        value = copy.deepcopy(rnd.choice(VALUES))
        if isinstance(node, dict):
            node[rnd.choice(["extra", "", "id", "arms", "n_max", "path", "format", "é"])] = value
        else:
            node.insert(rnd.randint(0, len(node)), value)
        return doc, raws
    key = rnd.choice(keys)
    if op == 1:  # delete
        del node[key]
    elif op == 2 and isinstance(node, dict):  # rename
        node[key + rnd.choice(["_", "X", " ", "\u0000"]) if rnd.random() < 0.5 else key.upper()] = node.pop(key)
    elif op == 3:  # raw text: deep nesting, huge integers
        marker = f"@@raw{len(raws)}@@"
        raws[json.dumps(marker)] = rnd.choice(RAW)
        node[key] = marker
    elif op == 4 and isinstance(node, list):  # duplicate an element
        node.append(copy.deepcopy(node[key]))
    else:  # replace the value
        node[key] = copy.deepcopy(rnd.choice(VALUES))
    return doc, raws


def dump_json(doc: Any, raws: dict[str, str], indent: int | None = None) -> str:
    """JSON text of ``doc`` (NaN and infinities allowed, as Python writes them) with raw substitutions."""
    text = json.dumps(doc, indent=indent)
    for marker, raw in raws.items():
        text = text.replace(marker, raw)
    return text


def json_mutator(data: bytes, rnd: random.Random) -> bytes:
    """Parse, mutate the tree, dump (input that is no longer JSON is corrupted at byte level instead)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return rnd.choice(BYTE_MUTATORS)(data, rnd)
    try:
        doc, raws = mutate_tree(doc, rnd)
        text = dump_json(doc, raws, indent=rnd.choice([None, 1]))
    except RecursionError:  # a document nested deeper than copy/json recurse (Python 3.13 parses it)
        return rnd.choice(BYTE_MUTATORS)(data, rnd)
    return text.encode("utf-8", errors="surrogatepass")


def jsonl_line_mutator(data: bytes, rnd: random.Random) -> bytes:
    """Mutate one line's object as a JSON tree."""
    lines = data.split(b"\n")
    i = rnd.randrange(len(lines))
    lines[i] = json_mutator(lines[i], rnd).replace(b"\n", b" ")
    return b"\n".join(lines)


def lines_mutator(data: bytes, rnd: random.Random) -> bytes:
    """Drop, duplicate, swap or blank lines, or add a junk line."""
    lines = data.split(b"\n")
    i, j = rnd.randrange(len(lines)), rnd.randrange(len(lines))
    op = rnd.randrange(5)
    if op == 0:
        del lines[i]
    elif op == 1:
        lines.insert(j, lines[i])
    elif op == 2:
        lines[i], lines[j] = lines[j], lines[i]
    elif op == 3:
        lines.insert(i, b"   ")
    else:
        lines.insert(i, rnd.choice([b"[1, 2]", b"\"text\"", b"null", b"{", b"{}", b"\xff\xfe", b"{\"a\": 1}"]))
    return b"\n".join(lines)


# ---- TOML ------------------------------------------------------------------------------------------

TOML_VALUES = ['""', "0", "-1", "1", "9223372036854775808", "1" * 5000, "inf", "nan", "-0.0", "1e999", "true",
               "[]", '[1, "a"]', "{a = 1}", '"\\u0000"', "'''x\ny'''", '"é😀"', "1979-05-27T07:32:00Z",
               "[" * 3000 + "]" * 3000, '"{query}"', '"http://127.0.0.1:9"', '"mv"', '"bon"', '"regex"', '"(("',
               '"a{4294967296}"', '"chat"', '["train"]', "[[1, 2], [3]]"]
TOML_KEYS = ["task", "aggregator", "n_max", "base_url", "model", "api", "concurrency", "timeout", "max_retries",
             "max_tokens", "temperature", "top_p", "seed", "stop", "id", "template", "messages", "path", "limit",
             "extractor", "pattern", "reward_url", "callable", "objectives", "grid", "score_range", "top_k",
             "test_fraction", "cost", "cache", "unknown_key"]


def toml_mutator(data: bytes, rnd: random.Random) -> bytes:
    """Line-level TOML changes: retype or rename a key, drop or repeat a line or a table header."""
    lines = data.decode("utf-8", errors="surrogateescape").split("\n")
    settings = [i for i, line in enumerate(lines) if "=" in line and not line.lstrip().startswith("#")]
    headers = [i for i, line in enumerate(lines) if line.startswith("[")]
    op = rnd.randrange(6)
    if op in (0, 1) and settings:
        i = rnd.choice(settings)
        key, _, value = lines[i].partition("=")
        if op == 0:
            lines[i] = f"{key}= {rnd.choice(TOML_VALUES)}"
        else:
            lines[i] = f"{rnd.choice(TOML_KEYS)} ={value}"
    elif op == 2 and lines:
        del lines[rnd.randrange(len(lines))]
    elif op == 3 and headers:
        i = rnd.choice(headers)
        lines.insert(rnd.randrange(len(lines) + 1), lines[i])
    elif op == 4:
        at = rnd.choice(headers) + 1 if headers else 0
        lines.insert(at, f"{rnd.choice(TOML_KEYS)} = {rnd.choice(TOML_VALUES)}")
    else:
        lines.insert(rnd.randrange(len(lines) + 1),
                     rnd.choice(["[endpoint]", "[[prompts]]", "[live]", "[queries]", "[[scorer]]", "x.y.z = 1", "= 1"]))
    return "\n".join(lines).encode("utf-8", errors="surrogateescape")


# ---- seeds: collection specs and query files ----------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
QUERIES = (ROOT / "examples" / "collect_llamacpp_queries.jsonl").read_bytes()
SPEC_TOML = (ROOT / "examples" / "collect_llamacpp.toml").read_bytes()
QUERIES_NAME = "collect_llamacpp_queries.jsonl"


@functools.cache
def spec_toml_seeds() -> list[bytes]:
    """The example majority-vote spec, a chat Best-of-N spec, a minimal one and one of two priced endpoints."""
    bon = b"""aggregator = "bon"
n_max = 4
[endpoint]
base_url = "https://api.example.org/v1"
model = "m"
api = "chat"
[sampling]
max_tokens = 64
stop = ["\\n\\n"]
top_p = 0.9
[[prompts]]
id = "a"
messages = [{role = "system", content = "Be brief."}, {role = "user", content = "{query}"}]
[queries]
path = "collect_llamacpp_queries.jsonl"
limit = 3
[scorer]
callable = "tests.fuzz_targets:score"
objectives = ["helpful", "harmless"]
score_range = [-1, 1]
grid = 0.25
[live]
cost = [0.5]
"""
    minimal = b"""aggregator = "mv"
n_max = 2
[endpoint]
base_url = "http://127.0.0.1:8080"
model = "local"
[sampling]
max_tokens = 8
[[prompts]]
id = "p"
template = "{query}"
[queries]
path = "collect_llamacpp_queries.jsonl"
[scorer]
extractor = "regex"
pattern = "answer: (\\\\d+)"
"""
    two_models = b"""aggregator = "mv"
n_max = 3
currency = "EUR"
[[endpoints]]
id = "small"
base_url = "http://127.0.0.1:8080/v1"
model = "small"
input_price_per_million = 0.1
output_price_per_million = 0.4
[[endpoints]]
id = "large"
base_url = "https://api.example.org/v1"
model = "large"
api_key_env = "LARGE_KEY"
concurrency = 2
input_price_per_million = 2.5
output_price_per_million = 10
[sampling]
max_tokens = 8
[[prompts]]
id = "p"
template = "{query}"
[queries]
path = "collect_llamacpp_queries.jsonl"
[scorer]
extractor = "last_number"
[live]
cost = [0.1, 2]
"""
    return [SPEC_TOML, bon, minimal, two_models]


@functools.cache
def spec_json_seeds() -> list[bytes]:
    """The TOML seeds as JSON documents."""
    from iapo_gym.llm.spec import tomllib

    return [json.dumps(tomllib.loads(s.decode()), indent=1).encode() for s in spec_toml_seeds()]


def parse_spec_file(path: Path, out: Path) -> object:
    """load_spec with the example query file beside the spec."""
    from iapo_gym.llm.spec import load_spec

    (path.parent / QUERIES_NAME).write_bytes(QUERIES)
    return load_spec(path)


def parse_queries_file(path: Path, out: Path) -> object:
    """The example spec, pointed at the fuzzed query file."""
    from iapo_gym.llm.spec import load_spec

    spec = path.parent / "spec.toml"
    spec.write_bytes(SPEC_TOML.replace(QUERIES_NAME.encode(), path.name.encode()))
    return load_spec(spec)


# ---- seeds: completion logs -------------------------------------------------------------------------


@functools.cache
def log_seeds(aggregator: str) -> list[bytes]:
    """Small valid completion logs: 3 prompts x 6 queries x 2 completions, with and without splits."""
    rnd = random.Random(aggregator)
    out = []
    for with_split in (False, True):
        lines = []
        for q in range(6):
            for p in ("direct", "cot", 7):
                for _ in range(2):
                    rec: dict[str, Any] = {"prompt": p, "query": f"q{q}", "tokens": rnd.randint(1, 400)}
                    if aggregator == "mv":
                        rec.update(answer=rnd.choice(["1", "2", 3, None, "", 4.0]), gold=str(q % 3 + 1))
                    else:
                        rec["scores"] = {"helpful": rnd.uniform(-1, 1), "harmless": rnd.choice([-1, 0, 1])}
                    if with_split:
                        rec["split"] = "test" if q == 5 else "train"
                    lines.append(json.dumps(rec))
        out.append(("\n".join(lines) + "\n").encode())
    return out


def parse_log(aggregator: str) -> Callable[[Path, Path], object]:
    def parse(path: Path, out: Path) -> object:
        from iapo_gym.data.build import build_table
        from iapo_gym.tables import write_table

        return write_table(build_table(path, aggregator), out / "table.h5", exact=False)

    return parse


# ---- seeds: result bundles ------------------------------------------------------------------------

MEMBER_NAMES = ["manifest.json", "results.jsonl", "tasks.jsonl"]
UNSAFE_NAMES = ["../results.jsonl", "/etc/manifest.json", "a/../../tasks.jsonl", "C:\\x.json", "..", "./manifest.json",
                "manifest.json/", "results.jsonl\u0000", "extra.txt", "dir/", "tasks.jsonl"]


@functools.cache
def bundle_members() -> tuple[tuple[str, bytes], ...]:
    """A valid bundle's members, built by bundle.py's own manifest builder from hand-made runs."""
    from iapo_gym.leaderboard.run.store import RunResult, TaskInfo
    from iapo_gym.leaderboard.submit import bundle as b

    digest = hashlib.sha256(b"tiny table").hexdigest()
    results, tasks = [], []
    for task in ("tiny_mv", "other"):
        tasks.append(TaskInfo(task, digest, task.title(), "mv", 3, 6, ("low", "mid", "high")))
        for label, params in (("fixed", '{"n":2}'), ("greedy", "{}")):
            for budget in (30, 120):
                for run in range(2):
                    results.append(RunResult(
                        task=task, table_sha256=digest, agent=f"tests.leaderboard_toy_agents:{label.title()}",
                        params=params, label=label, budget=budget, run=run, root_seed=0,
                        split_seed=None if task == "other" else run + 7, env_seed=run, agent_seed=run + 1,
                        acr=0.5 + run / 10, optimal_acr=0.8, train_optimal_acr=0.75, regret=0.3 - run / 10,
                        arms="[[0, 1], [1, 2], [2, 3]]", optimal_arms="[[0, 2], [1, 2], [2, 2]]",
                        train_seconds=0.01, budget_spent=budget - 1, version="0.0"))
    files = {b.RESULTS: b.sha256_bytes(b._results_jsonl(results)), b.TASKS: b.sha256_bytes(b._tasks_jsonl(tasks))}
    manifest = b.build_manifest(results, tasks, {"root_seed": "0", "train_fraction": "0.8"}, files)
    return ((b.MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n"),
            (b.RESULTS, b._results_jsonl(results)), (b.TASKS, b._tasks_jsonl(tasks)))


@dataclass
class _Member:
    name: str
    data: bytes
    kind: str = "file"  # file, dir, symlink, hardlink, fifo
    declared: int | None = None  # a size header that lies (tar) / declared uncompressed size (zip)


def _resign(members: list[_Member]) -> None:
    """Make the manifest's digests and count match the (mutated) members, so parsing goes deeper."""
    by = {m.name: m for m in members if m.kind == "file"}
    if "manifest.json" not in by:
        return
    try:
        manifest = json.loads(by["manifest.json"].data)
        for name in ("results.jsonl", "tasks.jsonl"):
            if name in by:
                manifest["files"][name] = hashlib.sha256(by[name].data).hexdigest()
        if "results.jsonl" in by:
            manifest["n_results"] = sum(1 for line in by["results.jsonl"].data.splitlines() if line.strip())
        by["manifest.json"].data = json.dumps(manifest).encode()
    except (ValueError, TypeError, KeyError, RecursionError, UnicodeDecodeError):
        pass


def _archive_members(rnd: random.Random) -> list[_Member]:
    """The valid members after 1-3 structured mutations (re-signed most of the time)."""
    members = [_Member(n, d) for n, d in bundle_members()]
    for _ in range(rnd.randint(1, 3)):
        op = rnd.randrange(9)
        m = rnd.choice(members) if members else None
        if op in (0, 1, 2) and m is not None:  # a field of the manifest or of one row
            m.data = (json_mutator if m.name == "manifest.json" else jsonl_line_mutator)(m.data, rnd)
        elif op == 3 and m is not None:
            m.data = lines_mutator(m.data, rnd)
        elif op == 4 and m is not None:
            m.name = rnd.choice(UNSAFE_NAMES)
        elif op == 5:
            members.append(_Member(rnd.choice(UNSAFE_NAMES + MEMBER_NAMES), b"{}\n",
                                   rnd.choice(["file", "dir", "symlink", "hardlink", "fifo"])))
        elif op == 6 and m is not None:
            m.declared = rnd.choice([3 << 30, 1 << 40, 2**32 - 1, len(m.data) + 1, max(0, len(m.data) - 1), 0])
        elif op == 7:
            members.extend(_Member(f"d{i}/", b"", "dir") for i in range(rnd.choice([10, 70])))
        elif members:
            members.remove(m)
    if rnd.random() < 0.8:
        _resign(members)
    return members


def _zip_bytes(members: list[_Member], rnd: random.Random) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for m in members:
            info = zipfile.ZipInfo(m.name + ("/" if m.kind == "dir" and not m.name.endswith("/") else ""),
                                   date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = rnd.choice([zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED, zipfile.ZIP_BZIP2])
            if m.kind == "symlink":
                info.external_attr = 0o120777 << 16
            zf.writestr(info, m.data)
    data = bytearray(buf.getvalue())
    patches = [m for m in members if m.declared is not None]
    central = data.find(b"PK\x01\x02")
    for m in patches:  # rewrite the declared uncompressed size in the local and central headers
        name = m.name.encode()
        at = data.find(b"PK\x03\x04")
        while at != -1:
            n = struct.unpack_from("<H", data, at + 26)[0]
            if data[at + 30: at + 30 + n] == name:
                struct.pack_into("<I", data, at + 22, min(m.declared, 2**32 - 1))
            at = data.find(b"PK\x03\x04", at + 4)
        at = central
        while at != -1:
            n = struct.unpack_from("<H", data, at + 28)[0]
            if data[at + 46: at + 46 + n] == name:
                struct.pack_into("<I", data, at + 24, min(m.declared, 2**32 - 1))
            at = data.find(b"PK\x01\x02", at + 4)
    if rnd.random() < 0.1 and central != -1:  # mark the first member encrypted, or of an unknown method
        if rnd.random() < 0.5:
            data[central + 8] |= 1
        else:
            struct.pack_into("<H", data, central + 10, 99)
    return bytes(data)


def _tar_bytes(members: list[_Member], rnd: random.Random) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=rnd.choice([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])) as tf:
        for m in members:
            info = tarfile.TarInfo(m.name)
            info.mode = 0o644
            if m.kind == "file":
                info.size = len(m.data)
                if m.declared is None:
                    tf.addfile(info, io.BytesIO(m.data))
                    continue
                info.size = m.declared  # a header that lies about the size: written by hand
                tf.fileobj.write(info.tobuf(tf.format, tf.encoding, tf.errors))
                tf.fileobj.write(m.data + b"\0" * (-len(m.data) % 512))
                tf.offset += 512 + len(m.data) + (-len(m.data) % 512)
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
                         "fifo": tarfile.FIFOTYPE}[m.kind]
            info.linkname = "/etc/passwd" if m.kind in ("symlink", "hardlink") else ""
            tf.addfile(info)
    return gzip.compress(raw.getvalue(), mtime=0)


def bundle_mutator(kind: str) -> Mutator:
    def mutate_bundle(data: bytes, rnd: random.Random) -> bytes:
        members = _archive_members(rnd)
        return _zip_bytes(members, rnd) if kind == "zip" else _tar_bytes(members, rnd)

    return mutate_bundle


@functools.cache
def bundle_seeds(kind: str) -> list[bytes]:
    members = [_Member(n, d) for n, d in bundle_members()]
    rnd = random.Random(0)
    if kind == "zip":
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for m in members:
                zf.writestr(zipfile.ZipInfo(m.name, date_time=(1980, 1, 1, 0, 0, 0)), m.data)
        return [buf.getvalue()]
    return [_tar_bytes(members, rnd)]


def parse_bundle(path: Path, out: Path) -> object:
    """read_bundle, then merge it (alone) into a new results folder."""
    from iapo_gym.leaderboard.submit.bundle import read_bundle
    from iapo_gym.leaderboard.submit.merge import merge

    read_bundle(path)
    return merge([path], out / "merged")


# ---- seeds: release pickles -------------------------------------------------------------------------


@contextlib.contextmanager
def _envs_modules() -> Iterator[dict[str, type]]:
    """The authors' class names, importable only while pickling a seed."""
    added = []
    classes = {}
    for dotted, names in (("Envs.catMV.catMV", ("CategoricalMVEnv", "CostContext")),
                          ("Envs.catBoN.catBoN", ("CategoricalBoNEnv", "Context")),
                          ("Envs.synthBernoulli.synthBernoulli", ("SyntheticBernoulliEnv",))):
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in sys.modules:
                sys.modules[name] = types.ModuleType(name)
                added.append(name)
        for cls_name in names:
            cls = type(cls_name, (), {"__module__": dotted, "__qualname__": cls_name})
            setattr(sys.modules[dotted], cls_name, cls)
            classes[cls_name] = cls
    try:
        yield classes
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _release_attrs(kind: str, rnd: np.random.Generator) -> dict[str, Any]:
    if kind == "CategoricalMVEnv":
        return {"cat_probs": rnd.dirichlet(np.ones(3), size=(4, 6)), "answers": rnd.integers(0, 3, 6),
                "cat_probs_te": rnd.dirichlet(np.ones(3), size=(4, 2)), "answers_te": rnd.integers(0, 3, 2),
                "cost_per_prompt": rnd.uniform(0.005, 0.01, 4), "N_max": 6,
                "cost_coeffs": {"low": 0.0, "mid": 0.2, "high": 1.0}, "context_distribution": np.full(3, 1 / 3),
                "prompts": list(range(4)), "rng": np.random.default_rng(3)}
    if kind == "CategoricalBoNEnv":
        return {"outcome_vectors_train": rnd.choice(np.arange(-1, 1.01, 0.5), size=(3, 5, 4, 2)),
                "outcome_probs_train": rnd.dirichlet(np.ones(4), size=(3, 5)),
                "outcome_vectors_test": rnd.choice(np.arange(-1, 1.01, 0.5), size=(3, 2, 3, 2)),
                "outcome_probs_test": rnd.dirichlet(np.ones(3), size=(3, 2)),
                "cost_per_prompt": rnd.uniform(0.01, 0.05, 3), "N_max": 8,
                "_contexts": [(0.3, 0.7, -0.1), (0.6, 0.4, -1.0)], "context_distribution": np.array([0.25, 0.75])}
    return {"success_probs": {"easy": rnd.uniform(0, 1, (3, 4)), "hard": rnd.uniform(0, 1, (3, 2))},
            "success_probs_test": {"easy": rnd.uniform(0, 1, (3, 2))}, "cost_per_prompt": rnd.uniform(0.01, 0.02, 3),
            "N_max": 4, "cost_coeffs": {"low": 0.0, "mid": 0.2, "high": 1.0}, "context_distribution": np.full(3, 1 / 3)}


ARRAY_VALUES: list[Any] = [np.zeros((0,)), np.full((2, 2), np.nan), -np.ones((4, 6, 3)), np.ones((4, 6, 3, 1)),
                           np.array(["a", "b"]), np.array([1, None], dtype=object), np.arange(6).reshape(2, 3),
                           np.float64(np.inf), np.int64(-5), np.array(2**62), [[1, 2], [3]], {"a": 1}, "x", None,
                           10**30, float("nan"), 1.5, True, -1, 0, (1, 2), {1, 2}, complex(1, 2), bytearray(b"ab")]


def _pickle_doc(doc: list[tuple[str, dict[str, Any]]], rnd: random.Random) -> bytes:
    with _envs_modules() as classes:
        objs = []
        for kind, attrs in doc:
            obj = classes[kind]()
            obj.__dict__.update(attrs)
            objs.append(obj)
        protocol = rnd.choice([2, 3, 4])
        return pickle.dumps(objs if rnd.random() < 0.9 else tuple(objs), protocol=protocol)


def release_mutator(data: bytes, rnd: random.Random) -> bytes:
    """A fresh release document with attributes dropped, retyped or reshaped, or an allocation bomb."""
    gen = np.random.default_rng(rnd.randrange(2**32))
    kinds = ["CategoricalMVEnv", "CategoricalBoNEnv", "SyntheticBernoulliEnv"]
    doc = [(k, _release_attrs(k, gen)) for k in rnd.sample(kinds, rnd.randint(1, 2))]
    for _ in range(rnd.randint(1, 3)):
        kind, attrs = rnd.choice(doc)
        key = rnd.choice(sorted(attrs) + ["N_max", "prompts", "objective_names", "cost_coeffs", "_contexts"])
        op = rnd.randrange(6)
        if op == 5:  # a change the converter ignores or tolerates: the input stays valid
            attrs[rnd.choice(["rng", "notes"])] = copy.deepcopy(rnd.choice(ARRAY_VALUES))
        elif op == 0:
            attrs.pop(key, None)
        elif op == 1:
            attrs[key] = copy.deepcopy(rnd.choice(ARRAY_VALUES))
        elif op == 2 and isinstance(attrs.get(key), np.ndarray) and attrs[key].size and attrs[key].dtype.kind in "fiu":
            arr = attrs[key].astype(np.float64)
            arr.flat[rnd.randrange(arr.size)] = rnd.choice([np.nan, -1.0, 1e308, 2.0])
            attrs[key] = arr
        elif op == 3 and isinstance(attrs.get(key), dict):
            attrs[key] = {**attrs[key], rnd.choice(["x", "low", 1]): rnd.choice(ARRAY_VALUES[:8])}
        else:
            return rnd.choice(BOMBS)
    return _pickle_doc(doc, rnd)


def _craft(*ops: bytes) -> bytes:
    return b"\x80\x02" + b"".join(ops) + b"."


def _glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


#: Hand-made pickles that ask for huge allocations or forbidden globals.
BOMBS = [
    _craft(_glob("numpy.core.multiarray", "_reconstruct"), _glob("numpy", "ndarray"),
           b"\x8a\x05\x00\x00\x00\x00\x10\x85", b"U\x02f8", b"\x87R"),  # _reconstruct(ndarray, (2**36,), 'f8')
    _craft(_glob("builtins", "bytearray"), b"\x8a\x05\x00\x00\x00\x00\x10\x85R"),  # bytearray(2**36)
    _craft(_glob("numpy", "ndarray"), b"\x8a\x05\x00\x00\x00\x00\x10\x85\x85R"),  # ndarray((2**36,))
    _craft(_glob("numpy._core.multiarray", "scalar"), _glob("numpy", "dtype"), b"U\x05V9999\x85R",
           b"C\x01x\x86R"),  # scalar(dtype('V9999'), b'x')
    _craft(_glob("builtins", "eval"), b"U\x041+1\x85R"),
    _craft(_glob("os", "system"), b"U\x04true\x85R"),
    b"\x80\x02]" + b"(" * 10000 + b"t" * 10000 + b".",
    b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"xx.",  # BINBYTES8 of 1 TB, truncated
]


@functools.cache
def release_seeds() -> list[bytes]:
    gen = np.random.default_rng(0)
    rnd = random.Random(0)
    return [_pickle_doc([(k, _release_attrs(k, gen))], rnd)
            for k in ("CategoricalMVEnv", "CategoricalBoNEnv", "SyntheticBernoulliEnv")]


def parse_release(path: Path, out: Path) -> object:
    """import_release into the output folder under a name of its own."""
    from iapo_gym.data.release import import_release

    return import_release(path, task="fuzz-release", dest=out)


# ---- seeds: HDF5 tables ----------------------------------------------------------------------------


@functools.cache
def table_seeds() -> list[bytes]:
    """Small mv and bon tables, with and without the stored exact tensor, as written by write_table."""
    from iapo_gym.tables import write_table
    from tests.conftest import tiny_bon_table, tiny_mv_table

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (table, exact) in enumerate([(tiny_mv_table(seed=1, n_queries=6), True),
                                            (tiny_bon_table(seed=2, n_queries=5), True),
                                            (tiny_mv_table(seed=3, n_queries=4), False)]):
            path = write_table(dataclasses.replace(table, attrs={"source": "fuzz seed", "n": i}),
                               Path(tmp) / f"t{i}.h5", exact=exact)
            out.append(path.read_bytes())
    return out


H5_DATASETS = ["probs", "cost", "objective_names", "prompts", "queries", "contexts/weights", "contexts/names",
               "contexts/probs", "atoms", "gold", "split", "exact/task_reward", "exact/context_index"]
H5_ATTRS = ["schema_version", "task", "aggregator", "n_max", "prov_source", "exact/version", "exact/digest"]
H5_ATTR_VALUES: list[Any] = ["x", b"\xff\xfe", 99, 0, -1, 2, 1.5, np.nan, 2**62, np.arange(3), "mv", "bon", True,
                             np.array(["a", "b"], dtype=h5py.string_dtype())]
H5_DATA_VALUES: list[Any] = [np.zeros(()), np.zeros((0,)), np.full((3, 6, 3), np.nan), -np.ones((3, 6, 3)),
                             np.arange(6), np.array([b"a", b"\xff"]), np.ones((2, 2, 2, 2, 2)), np.array([2**40]),
                             np.array([-1, 7]), np.array([1.5, 0.5]), np.full(6, 255, dtype=np.uint8),
                             np.array(["x"], dtype=h5py.string_dtype()), np.array([1 + 2j])]


def h5_mutator(data: bytes, rnd: random.Random) -> bytes:
    """Structured HDF5 changes with h5py: datasets dropped, retyped, reshaped, made groups or declared huge;
    attributes of the wrong kind."""
    buf = io.BytesIO(data)
    try:
        f = h5py.File(buf, "r+")
    except OSError:
        return rnd.choice(BYTE_MUTATORS)(data, rnd)
    with f:
        for _ in range(rnd.randint(1, 3)):
            op = rnd.randrange(6)
            name = rnd.choice(H5_DATASETS)
            if op in (0, 1, 2):
                if name in f:
                    del f[name]
                if op == 0:
                    continue
                if op == 1:
                    f.create_dataset(name, data=copy.deepcopy(rnd.choice(H5_DATA_VALUES)))
                else:
                    f.create_group(name)
            elif op == 3:
                if name in f:
                    del f[name]
                shape = rnd.choice([(1 << 20, 1 << 20, 8), (1 << 40,), (60000, 60000, 4)])
                f.create_dataset(name, shape=shape, dtype="f8", chunks=(1,) * len(shape), fillvalue=0.5)
            elif op == 4:
                attr = rnd.choice(H5_ATTRS)
                group, _, key = attr.rpartition("/")
                target = f[group] if group and group in f and isinstance(f[group], h5py.Group) else f
                target.attrs[key] = copy.deepcopy(rnd.choice(H5_ATTR_VALUES))
            else:
                attr = rnd.choice(H5_ATTRS)
                if attr in f.attrs:
                    del f.attrs[attr]
    return buf.getvalue()


def parse_table(path: Path, out: Path) -> object:
    """read_metadata, then read_table."""
    from iapo_gym.tables import read_metadata, read_table

    read_metadata(path)
    return read_table(path)


def parse_table_checked(path: Path, out: Path) -> object:
    """A table file from others: check_table_file (a child process reads it first), then read it here."""
    from iapo_gym.tables import check_table_file

    check_table_file(path, timeout=3.0)
    return parse_table(path, out)


# ---- seeds: policies ---------------------------------------------------------------------------------


def policy_seeds() -> list[bytes]:
    return [b'{"arms": [[0, 1], [2, 8], [1, 32]]}', b'{"arms": [[0, 4]]}']


def parse_policy(path: Path, out: Path) -> object:
    from iapo_gym.policy import Policy

    return Policy.from_json(path.read_bytes(), source=str(path))


@functools.cache
def policy_file_seeds() -> list[bytes]:
    """Deployable policy files (docs/deploy.md) as ``PolicyFile.to_json`` writes them, with and without
    ``arm_estimates`` (outcome counts per prompt and query; Best-of-N with its outcome vectors)."""
    import dataclasses

    from tests.deploy_helpers import bon_policy, mv_policy

    mv, bon = mv_policy(), bon_policy()
    mv_estimates = {"method": "plug-in", "completions": 24, "prompts": [
        {"id": "plain", "cost": 3.5, "queries": [[4, 1, 1], [2, 3], [0, 2, 1, 1]]},
        {"id": "short", "cost": 1.25, "queries": [[3], [1, 0, 2]]}]}
    bon_estimates = {"method": "plug-in", "completions": 12, "prompts": [
        {"id": "plain", "cost": 2.0, "outcomes": [[0.5, -0.5], [1.0, 0.0], [-1.0, 1.0]],
         "queries": [[2, 1, 3], [0, 4, 2]]}]}
    return [doc.to_json().encode() for doc in (mv, bon, dataclasses.replace(mv, arm_estimates=mv_estimates),
                                               dataclasses.replace(bon, arm_estimates=bon_estimates))]


def policy_file_mutator(data: bytes, rnd: random.Random) -> bytes:
    """A JSON mutation, then most of the time a fresh checksum, so the checks past the checksum are reached."""
    from iapo_gym.policyfile import _digest

    data = json_mutator(data, rnd)
    if rnd.random() < 0.8:
        try:
            doc = json.loads(data)
            doc["sha256"] = _digest(doc)
            data = json.dumps(doc, indent=1).encode()
        except (ValueError, TypeError, RecursionError):  # not an object any more, or NaN (no checksum)
            pass
    return data


def parse_policy_file(path: Path, out: Path) -> object:
    from iapo_gym.deploy import load_policy

    return load_policy(path)


def score(completion: str) -> dict[str, float]:
    """A Best-of-N scorer the fuzzed specs may name (never called while parsing)."""
    return {"helpful": 0.0, "harmless": 0.0}


# ---- seeds: serve's request bodies ---------------------------------------------------------------------


class ServeRefused(ValueError):
    """``iapo-gym serve`` answered a 4xx in the OpenAI error shape (its documented refusal of a bad request)."""


def _user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


SERVE_SEEDS = {  # by endpoint, and "chat_modes": chats for a server that accepts system messages and history
    "/v1/chat/completions": [
        {"model": "iapo/low", "messages": _user("1 + 1 =")},
        {"model": "any", "iapo_context": "mid", "messages": _user("2 + 2 ="), "max_tokens": 3, "stream": True,
         "stream_options": {"include_usage": True}},
        {"model": "iapo/[1.0, -0.2]", "messages": _user([{"type": "text", "text": "3 + 3 ="}]), "temperature": 0.0,
         "stop": ["\n"], "seed": 4, "user": "u-1"},
        {"model": "anything", "iapo_context": [1.0, -1.0], "messages": _user("q"), "max_completion_tokens": 100,
         "n": 1, "top_p": 1, "tools": [], "response_format": {"type": "text"}},
    ],
    "chat_modes": [
        {"model": "iapo/high", "messages": [{"role": "system", "content": "Be brief."}, *_user("1 + 1 =")]},
        {"model": "iapo/low", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": "hello"}, *_user("2 + 2 =")],
         "temperature": 0.5, "stream": True},
        {"model": "iapo/high", "messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "a"},
                                            {"role": "assistant", "content": [{"type": "text", "text": "b"}]},
                                            *_user("q")], "stream": True, "stop": ["x"],
         "stream_options": {"include_usage": True}},
    ],
    "/v1/completions": [
        {"model": "iapo/low", "prompt": "1 + 1 ="},
        {"model": "iapo/[1.0, -0.2]", "prompt": ["2 + 2 ="], "max_tokens": 2, "stream": True},
        {"model": "gpt-4o", "iapo_context": "high", "prompt": "q", "stop": "\n", "seed": 1, "logprobs": None,
         "echo": False, "best_of": 1},
        {"model": "iapo/mid", "iapo_context": [1.0, -0.2], "prompt": "7 * 6 =", "stream": False,
         "frequency_penalty": 0, "presence_penalty": 0.0, "suffix": None},
    ],
}
#: Fields serve reads and values that probe them: context forms by model name and iapo_context,
#: parameters at and past what the policy was learned with, unsupported features, hostile text.
SERVE_KEYS = ["model", "iapo_context", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "stop",
              "seed", "temperature", "top_p", "tools", "tool_choice", "messages", "prompt", "user", "logprobs",
              "response_format", "best_of", "echo", "suffix", "logit_bias", "frequency_penalty", "metadata", "messages",
              "messages", "temperature"]
SERVE_VALUES: list[Any] = [
    "iapo/low", "iapo/mid", "iapo/high", "iapo/", "iapo/[1.0, -0.2]", "iapo/[1.0]", "iapo/[1.0, -0.2, 3]",
    "iapo/[1e999]", "iapo/[NaN]", "iapo/[", "iapo/[[1]]", "iapo/[true, 1]", "iapo/" + "[" * 5000,
    "iapo/" + json.dumps([0.5] * 400), "iapo/\ud800", "iapo/low ", "IAPO/low", "low", [1.0, -0.2], [1.0, -0.7],
    [1.0], [], [True], [[1.0]], [10**400, 1], ["low"], 0, 1, -1, 3, 2**70, 1.5, 1e308, True, None, "", "\ud800",
    "x" * 40000, {}, {"include_usage": True}, {"include_usage": "yes"}, {"type": "json_object"},
    ["a", "b", "c", "d", "e"], ["\n"], _user("hi"), _user(None), _user([{"type": "image_url", "image_url": {}}]),
    _user([{"type": "text"}]), [{"role": "system", "content": "s"}, *_user("hi")], [{"role": "tool"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     *_user("c")], [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}, *_user("c")],
    [*_user("a"), {"role": "system", "content": "late"}, *_user("c")], [*_user("a"), {"role": "assistant"}],
    [{"role": "developer", "content": [{"type": "text", "text": "d"}]}, *_user("q")],
    [{"role": "system", "content": "\ud800"}, *_user("q")], [{"role": "system", "content": "x" * 40000}, *_user("q")],
    [{"role": "assistant", "content": "b", "tool_calls": []}, *_user("q")], [{"role": "system", "content": 5}, *_user("q")],
    0.5, 2.5, -0.1,
    [{"type": "function", "function": {"name": "f"}}], ["p1", "p2"], [1, 2, 3],
]


def serve_mutator(data: bytes, rnd: random.Random) -> bytes:
    """Set one field serve reads to a probing value (or drop it), then maybe a JSON tree mutation."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return rnd.choice(BYTE_MUTATORS)(data, rnd)
    if not isinstance(doc, dict):
        return json_mutator(data, rnd)
    key = rnd.choice(SERVE_KEYS)
    if rnd.random() < 0.15:
        doc.pop(key, None)
    else:
        doc[key] = copy.deepcopy(rnd.choice(SERVE_VALUES))
    return json.dumps(doc).encode("utf-8", errors="surrogatepass")


@functools.cache
def _serve_harness(modes: bool = False) -> tuple[Any, Any]:
    """serve's ASGI app in this process on a loop thread; its upstream the echo server (tests/echo_upstream.py).

    ``modes``: the server accepts a chat's system message (``append``), its earlier turns (``keep``) and a
    temperature from 0 to 1 (``serve --system-message append --history keep --accept temperature=0:1``).
    """
    import os

    from iapo_gym.deploy.params import CallerRules
    from iapo_gym.deploy.router import Router
    from iapo_gym.deploy.server import create_app
    from iapo_gym.llm.loop import LoopThread
    from tests.deploy_helpers import mv_policy
    from tests.echo_upstream import EchoUpstream
    from tests.llm_server import write_spec

    upstream = EchoUpstream("7")
    folder = Path(tempfile.mkdtemp(prefix="iapo-fuzz-serve-"))
    spec = write_spec(folder, 0, endpoint={"base_url": upstream.url, "max_retries": 0})
    rules = CallerRules("append", "keep", (("temperature", 0.0, 1.0),)) if modes else None
    router = Router(mv_policy(), spec, rules=rules)
    app = create_app(router, log=open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115 (lives with the app)
    loop = LoopThread("iapo-fuzz-serve")
    loop.run(router.start(app.client_options()))
    return app, loop


async def _asgi_post(app: Any, path: str, body: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """POST ``body`` to ``app`` as uvicorn would; the caller stays connected until the answer."""
    import asyncio

    pending = [body]

    async def receive() -> dict[str, Any]:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        await asyncio.Event().wait()  # no disconnect
        raise AssertionError("unreachable")

    out: dict[str, Any] = {"body": []}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"], out["headers"] = message["status"], dict(message["headers"])
        else:
            out["body"].append(message.get("body", b""))

    scope = {"type": "http", "method": "POST", "path": path, "headers": [
        (b"host", b"127.0.0.1"), (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    await app(scope, receive, send)
    return out["status"], out["headers"], b"".join(out["body"])


def parse_serve(endpoint: str, modes: bool = False) -> Callable[[Path, Path], object]:
    """Send the input file as a request body to serve's ``endpoint``: 200 is accepted, a 4xx in the OpenAI error
    shape is refused (``ServeRefused``), anything else (a 5xx, a malformed answer) fails. ``modes``: the server
    that accepts system messages, history and a temperature range (``_serve_harness``)."""
    def parse(path: Path, out: Path) -> object:
        app, loop = _serve_harness(modes)
        status, headers, body = loop.run(_asgi_post(app, endpoint, path.read_bytes()))
        if status == 200:
            if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
                if events[-1] != b"[DONE]" or not all("choices" in json.loads(e) for e in events[:-1]):
                    raise RuntimeError(f"a malformed stream: {body[:300]!r}")
            elif not json.loads(body)["choices"]:
                raise RuntimeError(f"no choices: {body[:300]!r}")
            return status
        error = json.loads(body)["error"]
        if not (isinstance(error["message"], str) and isinstance(error["type"], str) and isinstance(error["code"], str)):
            raise RuntimeError(f"not the OpenAI error shape: {body[:300]!r}")
        if 400 <= status < 500:
            raise ServeRefused(f"{path.name}: HTTP {status} {error['code']}: {error['message'][:150]}")
        raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
    return parse


def serve_seeds(endpoint: str) -> list[bytes]:
    return [json.dumps(doc).encode() for doc in SERVE_SEEDS[endpoint]]


# ---- the serving budget's stored state (iapo_gym.llm.budget: what a store shared with others may hold) -------------

BUDGET_CLOCK = 1.0e9


def _budget(store: Any) -> Any:
    from iapo_gym.llm.budget import Budget, parse_rate

    rates = [parse_rate(r) for r in ("tokens/minute=500", "cost/day=2", "requests/total=100", "requests/hour=50")]
    return Budget(rates, store, clock=lambda: BUDGET_CLOCK)


def budget_state_seeds() -> list[bytes]:
    """States a budget leaves: empty, a settled spend with a reservation in flight, and a reservation expired."""
    from iapo_gym.llm.budget import MemoryStore, Spend

    store = MemoryStore()
    budget = _budget(store)
    seeds = [store.transact(lambda s: json.dumps(s)).encode()]
    budget.settle(budget.admit(Spend(1, 2, 60, 0.2), 30), Spend(1, 1, 40, 0.1))
    budget.admit(Spend(1, 2, 60, 0.2), 30)
    seeds.append(store.transact(lambda s: json.dumps(s)).encode())
    budget.admit(Spend(1, 1, 10, 0.01), -1.0)  # expired at once: charged whole at the next transaction
    seeds.append(store.transact(lambda s: json.dumps(s)).encode())
    return seeds


def parse_budget_state(path: Path, out: Path) -> object:
    """The bytes as a deployment's state in an SQLite budget store (beside the input, named after it), then a
    report, an admission and a settlement on it, as a server's next request would do."""
    import sqlite3

    from iapo_gym.llm.budget import RateLimited, Spend, SQLiteStore

    db = path.parent / (path.name + ".sqlite")
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE budget (name TEXT PRIMARY KEY, state TEXT NOT NULL)")
    con.execute("INSERT INTO budget VALUES (?, ?)", ("fuzz", sqlite3.Binary(path.read_bytes())))
    con.commit()
    con.close()
    budget = _budget(SQLiteStore(db, "fuzz"))
    budget.report(True)
    with contextlib.suppress(RateLimited):
        budget.settle(budget.admit(Spend(1, 1, 10, 0.01), 30), Spend(1, 1, 5, 0.005))
    return budget.report(True)


# ---- the registry ------------------------------------------------------------------------------------


def _register_all() -> None:
    from iapo_gym.data.build import LogFormatError
    from iapo_gym.data.release import ReleaseError
    from iapo_gym.deploy import PolicyFileError
    from iapo_gym.leaderboard.submit.bundle import BundleError
    from iapo_gym.leaderboard.submit.merge import MergeError
    from iapo_gym.llm.spec import SpecError
    from iapo_gym.policy import PolicyError
    from iapo_gym.tables import TableError

    register(Target("spec_toml", ".toml", (SpecError,), spec_toml_seeds, parse_spec_file, (toml_mutator,)))
    register(Target("spec_json", ".json", (SpecError,), spec_json_seeds, parse_spec_file, (json_mutator,)))
    register(Target("queries_jsonl", ".jsonl", (SpecError,), lambda: [QUERIES], parse_queries_file,
                    (jsonl_line_mutator, lines_mutator)))
    register(Target("log_mv", ".jsonl", (LogFormatError,), lambda: log_seeds("mv"), parse_log("mv"),
                    (jsonl_line_mutator, lines_mutator)))
    register(Target("log_bon", ".jsonl", (LogFormatError,), lambda: log_seeds("bon"), parse_log("bon"),
                    (jsonl_line_mutator, lines_mutator)))
    register(Target("bundle_zip", ".iapo.zip", (BundleError, MergeError), lambda: bundle_seeds("zip"), parse_bundle,
                    (bundle_mutator("zip"),)))
    register(Target("bundle_tar", ".iapo.tar.gz", (BundleError, MergeError), lambda: bundle_seeds("tar"),
                    parse_bundle, (bundle_mutator("tar"),)))
    register(Target("release_pickle", ".pkl", (ReleaseError,), release_seeds, parse_release, (release_mutator,)))
    register(Target("hdf5_table", ".h5", (TableError,), table_seeds, parse_table, (h5_mutator,), byte_level=0.0))
    # Byte-level corruption of HDF5 files can make the HDF5 library itself loop (seen with HDF5 2.0.0):
    # run in forked children with a time limit, by tools/fuzz.py only.
    register(Target("hdf5_table_bytes", ".h5", (TableError,), table_seeds, parse_table_checked, BYTE_MUTATORS,
                    byte_level=0.0, isolate=True))
    register(Target("policy_json", ".json", (PolicyError,), policy_seeds, parse_policy, (json_mutator,)))
    register(Target("policy_file", ".json", (PolicyFileError,), policy_file_seeds, parse_policy_file,
                    (policy_file_mutator,)))
    register(Target("budget_state", ".json", (ValueError,), budget_state_seeds, parse_budget_state, (json_mutator,)))
    for name, endpoint in (("serve_chat", "/v1/chat/completions"), ("serve_completions", "/v1/completions")):
        register(Target(name, ".json", (ServeRefused,), functools.partial(serve_seeds, endpoint), parse_serve(endpoint),
                        (serve_mutator, serve_mutator, json_mutator), byte_level=0.15))
    # chat front-ends: system messages and history under append / keep, a temperature range (and, through the
    # seeds of serve_chat above, the same bodies refused by the default server)
    register(Target("serve_chat_modes", ".json", (ServeRefused,),
                    lambda: serve_seeds("chat_modes") + serve_seeds("/v1/chat/completions"),
                    parse_serve("/v1/chat/completions", modes=True), (serve_mutator, serve_mutator, json_mutator),
                    byte_level=0.15))


_register_all()
