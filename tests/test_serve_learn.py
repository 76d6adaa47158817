"""``iapo-gym serve --learn`` and ``--shadow`` against a real ``iapo-gym simulate`` upstream (docs/deploy.md,
"Learning while serving").

The upstream is a Best-of-N table (``generated:bon_flat:1``: 5 prompts x 30 queries), so the expected utility of
every arm is known exactly from the table; the served policy's one context is given the table's worst prompt on
purpose. Checked from the outside, on the responses and the outcome log: the exploration never passes its
budget at any request, every logged propensity is the probability the stated rule gives the served arm (so the
K arms' probabilities sum to 1), ``--learn`` serves the table's best arm from a stated request on and resumes
from its log after a restart, and ``--shadow`` logs the candidate's arm without serving it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iapo_gym.cli import main
from iapo_gym.deploy.learn import DEFAULT_SPREAD
from iapo_gym.outcome_log import read_log
from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyPrompt
from iapo_gym.tasks.generated import level_table
from tests.deploy_helpers import get_json, post_json, start_serve
from tests.llm_server import free_port, output, stop, wait_ready

pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parent.parent
BON = "generated:bon_flat:1"
WEIGHTS = (0.0, 0.0, 1.0)  # the context's objective weights; cost weight 0
SHARE = 0.2  # --explore-share of the learning test
SETTLED = 200  # --learn serves the table's best arm from this request on (stated in docs/deploy.md)
REQUESTS = 300


def exact_utilities() -> np.ndarray:
    """(P, N_max): the exact expected utility of every arm (p, N) in the context, the query uniform: the expected
    best of N weighted scores (cost weight 0)."""
    table = level_table("bon_flat", 1)
    assert table.atoms is not None
    values = table.atoms @ np.array(WEIGHTS)  # (P, Q, M)
    order = np.argsort(values, axis=2)
    v = np.take_along_axis(values, order, axis=2)
    cdf = np.cumsum(np.take_along_axis(table.probs, order, axis=2), axis=2)
    below = np.concatenate([np.zeros(cdf.shape[:2] + (1,)), cdf[..., :-1]], axis=2)
    n = np.arange(1, table.n_max + 1)
    best = (v[..., None] * (cdf[..., None] ** n - below[..., None] ** n)).sum(axis=2)  # (P, Q, N_max)
    return np.asarray(best.mean(axis=1))


def policy(spec: dict[str, Any], prompt: str, n: int = 1) -> PolicyFile:
    """A Best-of-N policy of the simulator's spec with one context ``c`` serving (``prompt``, ``n``)."""
    return PolicyFile(
        task=spec["task"], aggregator="bon", api="completions", n_max=int(spec["n_max"]),
        objectives=tuple(spec["scorer"]["objectives"]), scorer={**spec["scorer"], "grid": None},
        sampling=spec["sampling"],
        prompts=tuple(PolicyPrompt(p["id"], p["template"]) for p in spec["prompts"]),
        contexts=(PolicyContext("c", WEIGHTS, 0.0, 1.0, prompt, n),), learned={"agent": "test"})


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[int, Path, dict[str, Any]]]:
    """The simulator of the table on a free port, and its written spec."""
    folder = Path(tempfile.mkdtemp(prefix="iapo-learn-"))
    port = free_port()
    spec = folder / "spec.json"
    cli = [sys.executable, "-m", "iapo_gym.cli"]
    subprocess.run([*cli, "simulate", BON, "--port", str(port), "--write-spec", str(spec)], check=True, cwd=ROOT,
                   capture_output=True)
    log = tempfile.TemporaryFile(prefix="iapo-simulate-")
    proc = subprocess.Popen([*cli, "simulate", BON, "--port", str(port), "--seed", "3"], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    proc.log_file = log  # type: ignore[attr-defined]
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=60)
        yield port, spec, json.loads(spec.read_text())
    finally:
        stop(proc)


def ask(port: int, t: int) -> dict[str, Any]:
    """Request t: query q(t mod 30), so every 30 requests cover the table's queries uniformly."""
    status, body, _ = post_json(port, "/v1/completions", json.dumps(
        {"model": "iapo/c", "prompt": f"Question q{t % 30}?"}).encode())
    assert status == 200, body
    return body


@pytest.mark.heavy
def test_learn_explores_within_budget_logs_propensities_and_serves_the_best_arm(
        sim: tuple[int, Path, dict[str, Any]], tmp_path: Path) -> None:
    _, spec_path, spec = sim
    u = exact_utilities()
    worst = int(np.argmin(u[:, 0]))
    prompts = [p["id"] for p in spec["prompts"]]
    path = policy(spec, prompts[worst]).save(tmp_path / "policy.json")
    port = free_port()
    extra = ["--learn", "--explore-share", str(SHARE), "--log", str(tmp_path / "log"), "--seed", "5"]
    serve = start_serve(path, spec_path, port, extra=extra)
    try:
        answers = [ask(port, t) for t in range(REQUESTS)]
        _, health = get_json(port, "/health")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
    finally:
        stop(serve)
    explored = 0
    k_arms = len(prompts) * int(spec["n_max"])  # the uniform part's arms: every prompt with every N
    for t, body in enumerate(answers):
        learn = body["iapo"]["learn"]
        arm = [body["iapo"]["prompt"], body["iapo"]["n"]]
        allowed = explored + 1 <= SHARE * (t + 1)  # the budget: explored requests <= floor(share x requests)
        assert learn["share"] == (SHARE if allowed else 0.0)
        spread, contender = learn["share"] * DEFAULT_SPREAD, learn["contender"]
        directed = learn["share"] - spread if contender is not None else 0.0
        # the stated rule: the contender share - spread, each of the K arms spread / K, the greedy arm the rest
        expected = (1.0 - directed - spread) * (arm == learn["greedy"]) + directed * (arm == contender) + \
            spread / k_arms
        assert learn["propensity"] == pytest.approx(expected, rel=1e-12)
        assert learn["explored"] == (arm != learn["greedy"])
        if learn["explored"]:
            assert allowed, f"request {t} explored past the budget"
            explored += 1
        assert explored <= math.floor(SHARE * (t + 1) + 1e-9)
    # without a warm start every other prompt has no estimate: each is the contender (at N_max, teaching every N)
    assert {tuple(b["iapo"]["learn"]["contender"]) for b in answers if b["iapo"]["learn"]["contender"]} >= \
        {(p, int(spec["n_max"])) for p in prompts if p != prompts[worst]}
    assert health["learn"]["explored"] == explored and health["learn"]["chosen"] == REQUESTS
    assert f"iapo_serve_learn_explored {float(explored)}" in metrics
    assert f"iapo_serve_learn_chosen {float(REQUESTS)}" in metrics
    # exactly judged from the table: from request SETTLED on the greedy arm has closed at least 3/4 of the gap from
    # the policy's arm to the best arm (serve's completions are seeded per prompt, query and index, so the learner
    # sees one fixed draw per query and completion: the best arm on those draws need not be the exact best)
    greedy = [b["iapo"]["learn"]["greedy"] for b in answers]
    assert greedy[0] == [prompts[worst], 1]
    value = [u[prompts.index(p), n - 1] for p, n in greedy]
    assert min(value[SETTLED:]) >= u[worst, 0] + 0.75 * (u.max() - u[worst, 0]), greedy[SETTLED:]
    # the log holds each answer with its propensity and how its arm was chosen
    _, rows = read_log(tmp_path / "log")
    logged = {r.id: r for r in rows}
    assert len(logged) == REQUESTS
    for body in answers:
        row = logged[body["id"]]
        assert row.propensity == pytest.approx(body["iapo"]["learn"]["propensity"])
        learn = body["iapo"]["learn"]
        spread = {"share": learn["share"] * DEFAULT_SPREAD, "prompts": sorted(prompts),
                  "ns": list(range(1, int(spec["n_max"]) + 1))}
        assert row.outcomes["learn"] == {"explored": learn["explored"], "greedy": learn["greedy"],
                                         "share": learn["share"],
                                         **({} if learn["contender"] is None else {"contender": learn["contender"]}),
                                         **({"spread": spread} if learn["share"] else {})}
        assert (row.prompt, row.n) == (body["iapo"]["prompt"], body["iapo"]["n"])
    # restarted on the same log without exploring: it resumes from the log, learning the same estimates, and
    # serves the arm it had come to
    serve = start_serve(path, spec_path, port, extra=["--learn", "--explore-share", "0", "--log",
                                                      str(tmp_path / "log")])
    try:
        again = ask(port, 0)
        _, resumed = get_json(port, "/health")
        printed = output(serve)
    finally:
        stop(serve)
    assert f"--learn resumed from {REQUESTS} logged requests ({explored} of {REQUESTS} explored)" in printed
    assert [again["iapo"]["prompt"], again["iapo"]["n"]] == health["learn"]["contexts"]["c"]["greedy"]
    assert again["iapo"]["learn"]["propensity"] == 1.0
    assert resumed["learn"]["chosen"] == REQUESTS + 1


def test_shadow_logs_the_candidates_arm_and_serves_the_policys(sim: tuple[int, Path, dict[str, Any]],
                                                                tmp_path: Path) -> None:
    _, spec_path, spec = sim
    prompts = [p["id"] for p in spec["prompts"]]
    path = policy(spec, prompts[1]).save(tmp_path / "policy.json")
    candidate = policy(spec, prompts[3], n=4).save(tmp_path / "candidate.json")
    port = free_port()
    serve = start_serve(path, spec_path, port, extra=["--shadow", str(candidate), "--log", str(tmp_path / "log")])
    try:
        answers = [ask(port, t) for t in range(6)]
    finally:
        stop(serve)
    _, rows = read_log(tmp_path / "log")
    logged = {r.id: r for r in rows}
    for body in answers:
        assert (body["iapo"]["prompt"], body["iapo"]["n"], body["iapo"]["drawn"]) == (prompts[1], 1, 1)
        assert "learn" not in body["iapo"]  # the shadow is not told to callers
        row = logged[body["id"]]
        assert row.outcomes["shadow"] == {"context": "c", "prompt": prompts[3], "n": 4}
        assert (row.prompt, row.n, row.propensity) == (prompts[1], 1, 1.0) and "learn" not in row.outcomes


def test_bad_learning_options_are_refused_naming_the_value(sim: tuple[int, Path, dict[str, Any]], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    _, spec_path, spec = sim
    path = policy(spec, "p0").save(tmp_path / "policy.json")
    mv = dict(spec, scorer={"extractor": "last_number"})
    mv_path = PolicyFile(**{**policy(spec, "p0").__dict__, "aggregator": "mv", "objectives": ("correct",),
                            "scorer": mv["scorer"], "contexts": (PolicyContext("c", (1.0,), 0.0, 1.0, "p0", 1),)}
                         ).save(tmp_path / "mv.json")
    base = ["serve", str(path), "--upstream", str(spec_path), "--port", str(free_port())]
    cases = [(["--learn", "--explore-share", "1.5"], "--explore-share must be a finite number >= 0.0 and < 1.0"),
             (["--learn", "--explore-share", "nan"], "--explore-share must be a finite number >= 0.0 and < 1.0"),
             (["--learn", "--learn-half-life", "0"], "--learn-half-life must be a finite number > 0.0"),
             (["--learn", "--learn-bonus", "-1"], "--learn-bonus must be a finite number >= 0.0"),
             (["--learn", "--learn-spread", "1.5"], "--learn-spread must be a share in [0, 1]"),
             (["--learn", "--learn-spread", "-0.1"], "--learn-spread must be a finite number >= 0.0"),
             (["--learn-spread", "0.5"], "--learn-spread needs --learn"),
             (["--learn-half-life", "10"], "--learn-half-life needs --learn"),
             (["--explore-share", "0.1"], "--explore-share needs --learn"),
             (["--learn", "--learn-reward", "feedback", "--log", str(tmp_path / "l")],
              "--learn-reward feedback is for a majority-vote policy"),
             (["--learn", "--learn-prior", "-1"], "--learn-prior must be a finite number >= 0.0"),
             (["--learn", "--workers", "2"], "--learn keeps its estimates and exploration budget in one process"),
             (["--shadow", str(mv_path), "--log", str(tmp_path / "l")], "the candidate is a mv policy"),
             (["--shadow", str(path)], "--shadow needs --log DIR")]
    for extra, message in cases:
        assert main([*base, *extra]) == 1, extra
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "l").exists()  # nothing half-written


def _section_blocks() -> list[tuple[str, str]]:
    """The code blocks of docs/deploy.md's "Learning while serving" (```shell and ```py: run here against a
    simulator, not by tests/test_docs_commands.py, which runs the sh and python blocks against llama.cpp)."""
    text = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    section = text.split("## Learning while serving", 1)[1].split("\n## ", 1)[0]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", section, re.S | re.M)]


@pytest.mark.heavy
def test_the_commands_of_the_learning_section_run_as_written(tmp_path: Path) -> None:
    blocks = _section_blocks()
    assert [lang for lang, _ in blocks] == ["shell", "py"]
    # the docs' ports become free ones, the same in both blocks (another run on this machine may hold the docs')
    ports = {p: str(free_port()) for p in sorted(set(re.findall(r"--port (\d+)", blocks[0][1])))}
    assert len(ports) == 2

    def free(text: str) -> str:
        return re.sub(r"\b(" + "|".join(ports) + r")\b", lambda m: ports[m.group(1)], text)

    blocks = [(lang, free(text)) for lang, text in blocks]
    commands = [line.strip() for line in blocks[0][1].replace("\\\n", " ").splitlines()
                if line.strip() and not line.strip().startswith("#")]
    assert len(commands) == 6 and commands[-1].startswith("iapo-gym serve") and "--learn" in commands[-1]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for command in commands:
            argv = [sys.executable, "-m", "iapo_gym.cli", *shlex.split(command)[1:]]
            port = re.search(r"--port (\d+)", command)
            if command.startswith(("iapo-gym serve", "iapo-gym simulate")) and "--write-spec" not in command:
                assert port is not None
                proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
                servers.append(proc)
                wait_ready(f"http://127.0.0.1:{port.group(1)}/health", proc, timeout=60)
            else:
                done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
                assert done.returncode == 0, (command, done.stderr[-2000:])
        done = subprocess.run([sys.executable, "-c", blocks[1][1]], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        for proc in reversed(servers):
            stop(proc)
    lines = done.stdout.splitlines()
    explored, _, chosen = lines[-5].split()[:3]
    assert int(chosen) == 300 and int(explored) <= 30  # --explore-share 0.1
    _, logged = read_log(tmp_path / "runs" / "bon-policy" / "outcomes")
    rows = list(logged)
    assert len(rows) == 300 and sum(r.outcomes["learn"]["explored"] for r in rows) == int(explored)
    assert all(r.outcomes["shadow"]["prompt"] is not None for r in rows)


MV = "generated:mv_binary:21"  # 4 prompts x 46 queries; accuracy at N = 1 from 0.58 to 0.89
FEEDBACK_SETTLED = 300  # majority vote from feedback: the table's best arm is greedy from this request on
FEEDBACK_REQUESTS = 440


def test_majority_vote_learns_from_feedback_once_per_response(tmp_path: Path) -> None:
    """--learn-reward feedback: an answer teaches only through its feedback (posted twice here: the second, an
    idempotent 200, teaches nothing), and the learner moves to the table's most accurate prompt."""
    table = level_table("mv_binary", 21)
    assert table.gold is not None
    accuracy = table.probs[:, np.arange(table.n_queries), table.gold].mean(axis=1)  # exact, N = 1, query uniform
    best, worst = int(np.argmax(accuracy)), int(np.argmin(accuracy))
    port = free_port()
    spec_path = tmp_path / "mv.json"
    cli = [sys.executable, "-m", "iapo_gym.cli"]
    subprocess.run([*cli, "simulate", MV, "--port", str(port), "--write-spec", str(spec_path)], check=True, cwd=ROOT,
                   capture_output=True)
    spec = json.loads(spec_path.read_text())
    # unseeded sampling: every request is a fresh draw of the table's outcomes (a seeded spec derives each
    # completion's seed from the endpoint's URL and the prompt, so a (prompt, query) would answer the same every time
    # and the prompts' accuracies on that one draw, not the table's, would decide which prompt is best)
    del spec["sampling"]["seed"]
    spec_path.write_text(json.dumps(spec))
    gold = {json.loads(line)["text"]: json.loads(line)["gold"]
            for line in (tmp_path / "mv.queries.jsonl").read_text().splitlines()}
    path = PolicyFile(
        task=spec["task"], aggregator="mv", api="completions", n_max=int(spec["n_max"]), objectives=("correct",),
        scorer={"extractor": spec["scorer"]["extractor"]}, sampling=spec["sampling"],
        prompts=tuple(PolicyPrompt(p["id"], p["template"]) for p in spec["prompts"]),
        contexts=(PolicyContext("c", (1.0,), 0.0, 1.0, table.prompts[worst], 1),), learned={"agent": "test"},
    ).save(tmp_path / "policy.json")
    sim = subprocess.Popen([*cli, "simulate", MV, "--port", str(port), "--seed", "2"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, cwd=ROOT)
    serve_port = free_port()
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", sim, timeout=60)
        serve = start_serve(path, spec_path, serve_port, extra=[
            "--learn", "--learn-reward", "feedback", "--explore-share", "0.25", "--log", str(tmp_path / "log")])
        try:
            greedy = []
            for t in range(FEEDBACK_REQUESTS):
                query = f"Question {table.queries[t % table.n_queries]}?"
                body = ask_text(serve_port, query)
                greedy.append(body["iapo"]["learn"]["greedy"][0])
                right = body["iapo"]["winner"] == gold[query]
                for _ in range(2):
                    status, answer, _ = post_json(serve_port, "/v1/feedback",
                                                  json.dumps({"id": body["id"], "reward": right}).encode())
                    assert status == 200, answer
            _, health = get_json(serve_port, "/health")
        finally:
            stop(serve)
    finally:
        stop(sim)
    assert health["learn"]["observed"] == FEEDBACK_REQUESTS  # one observation per response, not per post
    assert greedy[0] == table.prompts[worst]
    # the most accurate prompt leads from FEEDBACK_SETTLED on. The draws follow the simulator's request count, which
    # an upstream retry under load shifts, so the run is one random draw of the learner's path: in 2,000 in-process
    # replays of this learner on this table (fresh Bernoulli feedback at the table's accuracies) none failed these
    # two checks at 440 requests, while 1.85 % failed at 220 (research/feedback_replay.py)
    settled = greedy[FEEDBACK_SETTLED:]
    assert sum(g == table.prompts[best] for g in settled) >= 0.75 * len(settled), greedy
    assert greedy[-1] == table.prompts[best], greedy


def ask_text(port: int, query: str) -> dict[str, Any]:
    """One completion request of ``query`` in context ``c``."""
    status, body, _ = post_json(port, "/v1/completions", json.dumps({"model": "iapo/c", "prompt": query}).encode())
    assert status == 200, body
    return body
