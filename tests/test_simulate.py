"""``iapo-gym simulate``: an outcome table as an OpenAI-compatible upstream, checked through the real ``openai``
client against a real ``iapo-gym simulate`` process on 127.0.0.1.

The mapping is checked from the outside, by the rules docs/simulate.md states: the answer the spec's extractor
reads is the gold answer of the written queries file for the gold bucket, and the integers 0, 1, 2, ... skipping
it for the other buckets in order; the frequencies of the answers over many draws must match the table's
probabilities (a chi-square test that a wrong mapping fails, shown on the same counts).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats

from iapo_gym.llm.scoring import last_number
from iapo_gym.online.schedule import build_schedule
from iapo_gym.tables import read_table
from iapo_gym.tasks.generated import level_table
from tests.llm_server import free_port, output, stop, wait_ready

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
MV = "generated:mv_categorical:2"  # 5 prompts x 27 queries x 4 answers, N_max 42
BON = "generated:bon_flat:1"  # 5 prompts x 30 queries x 27 atoms, 3 objectives
DRIFT = "generated:mv_binary:16"  # drift over 40 requests: one step at request 15
CLI = [sys.executable, "-m", "iapo_gym.cli"]
ALPHA = 1e-6  # a right mapping fails a test this rarely; the wrong ones below fail with p < 1e-8
NULL_DRAWS = 100_000  # draws of a statistic's law under a right collection (it fails 1 in NULL_DRAWS + 1 runs)


def start_simulator(*args: str, port: int | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """``iapo-gym simulate ARGS --port P`` in its own process, ready to answer."""
    import tempfile

    port = port or free_port()
    log = tempfile.TemporaryFile(prefix="iapo-simulate-")
    proc = subprocess.Popen([*CLI, "simulate", *args, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT)
    proc.log_file = log  # type: ignore[attr-defined]
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=60)
    except BaseException:
        stop(proc)
        raise
    return proc, port


@pytest.fixture(scope="module")
def mv_sim() -> Iterator[int]:
    proc, port = start_simulator(MV)
    try:
        yield port
    finally:
        stop(proc)


def client(port: int) -> Any:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)


def model_of(port: int) -> str:
    return str(client(port).models.list().data[0].id)


def template(prompt_id: str, query: str) -> str:
    """The written spec's template of a prompt (docs/simulate.md)."""
    return f"[{prompt_id}] {query}\nAnswer:"


def bucket_of(answer: str | None, gold_bucket: int, gold_text: str, n_buckets: int) -> int:
    """The documented labels: the gold answer for the gold bucket, the integers skipping it for the others."""
    assert answer is not None
    if answer == gold_text:
        return gold_bucket
    others = [m for m in range(n_buckets) if m != gold_bucket]
    labels = [str(i) for i in range(64) if str(i) != gold_text][:len(others)]
    return others[labels.index(answer)]


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """The p-value of ``counts`` under ``probs`` (Pearson's chi-square, the outcomes expected fewer than 5 times
    pooled into one cell); an outcome of probability 0 that was drawn gives 0."""
    if np.any(counts[probs <= 0] > 0):
        return 0.0
    expected = probs * counts.sum()
    small = expected < 5
    observed = [*counts[~small], counts[small].sum()] if small.any() else list(counts)
    wanted = [*expected[~small], expected[small].sum()] if small.any() else list(expected)
    keep = np.array(wanted) > 0
    if keep.sum() < 2:
        return 1.0
    return float(stats.chisquare(np.array(observed)[keep], np.array(wanted)[keep]).pvalue)


def binomial_z2_tail(n: int, probs: np.ndarray, z2: float, step: float = 0.01) -> float:
    """An upper bound on P(sum_i (K_i / n - p_i)^2 / (p_i (1 - p_i) / n) >= z2) for independent K_i ~
    Binomial(n, p_i): each term is rounded up to a multiple of ``step`` (the sum only grows, so the tail only
    grows) and the terms' distributions are convolved exactly on that lattice, up to z2 (the mass beyond is the
    tail). Exact where a Monte Carlo null cannot reach: with tens of completions per cell and probabilities near 0
    or 1 the sum's tail is much heavier than the chi-square's."""
    bins = int(np.ceil(z2 / step))
    dist = np.zeros(bins + 1)  # dist[b]: P(sum = b * step) for b < bins; dist[bins]: P(sum >= z2)
    dist[0] = 1.0
    k = np.arange(n + 1)
    for p in probs:
        mass = stats.binom.pmf(k, n, p)
        terms = np.minimum(np.ceil((k / n - p) ** 2 / (p * (1 - p) / n) / step - 1e-9), bins).astype(np.int64)
        below = np.concatenate([np.cumsum(dist[:bins][::-1])[::-1], [0.0]])  # below[b]: mass of sums b..bins-1
        new = np.zeros_like(dist)
        new[bins] = dist[bins]  # a sum already past z2 stays past it
        for s, m in zip(terms, mass, strict=True):
            new[s:bins] += m * dist[:bins - s]
            new[bins] += m * below[bins - s]  # the sums this term carries past z2
        dist = new
    return float(min(dist[bins], 1.0))


def post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None,
         method: str = "POST") -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body if method == "POST" else None,
                                     method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_answer_frequencies_match_the_table(mv_sim: int, tmp_path: Path) -> None:
    """Over 2,048 draws of each of three (prompt, query) pairs, the answers the spec's extractor reads have the
    table's probabilities; the same counts fail the test under the gold bucket swapped with another."""
    table = level_table("mv_categorical", 2)
    spec = tmp_path / "sim.json"
    subprocess.run([*CLI, "simulate", MV, "--port", str(mv_sim), "--write-spec", str(spec)], check=True, cwd=ROOT)
    queries = [json.loads(line) for line in spec.with_name("sim.queries.jsonl").read_text().splitlines()]
    assert [q["id"] for q in queries] == list(table.queries)
    assert table.gold is not None
    c, model = client(mv_sim), model_of(mv_sim)
    # the three pairs whose second most likely answer is the most likely of all pairs (two answers or more compete)
    second = np.sort(table.probs, axis=2)[:, :, -2]
    pairs = [tuple(int(i) for i in np.unravel_index(k, second.shape)) for k in np.argsort(-second, axis=None)[:3]]
    for p, q in pairs:
        gold = int(table.gold[q])
        counts = np.zeros(table.n_atoms, dtype=np.int64)
        for _ in range(16):
            r = c.completions.create(model=model, prompt=template(table.prompts[p], queries[q]["text"]), n=128)
            assert len(r.choices) == 128
            for choice in r.choices:
                counts[bucket_of(last_number(choice.text), gold, queries[q]["gold"], table.n_atoms)] += 1
        probs = table.probs[p, q]
        assert chi_square_p(counts, probs) > ALPHA, (p, q, counts, probs)
        other = int(np.argmax(np.abs(probs - probs[gold]) * (np.arange(table.n_atoms) != gold)))
        wrong = probs.copy()
        wrong[[gold, other]] = probs[[other, gold]]
        assert chi_square_p(counts, wrong) < 1e-8  # the test would catch the gold answer on the wrong bucket


def test_seeds_give_identical_completions_and_n_and_usage_are_honoured(mv_sim: int) -> None:
    """A seed gives the same completions again (also through the chat route); without one, the draws go on; n
    choices come back; usage counts the table's cost as tokens and max_tokens caps them."""
    table = level_table("mv_categorical", 2)
    c, model = client(mv_sim), model_of(mv_sim)
    prompt = template(table.prompts[1], "Question q3?")
    a = c.completions.create(model=model, prompt=prompt, n=24, seed=11)
    b = c.completions.create(model=model, prompt=prompt, n=24, seed=11)
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], n=24, seed=11)
    other = c.completions.create(model=model, prompt=prompt, n=24, seed=12)
    unseeded = [c.completions.create(model=model, prompt=prompt, n=24) for _ in range(2)]
    texts = [ch.text for ch in a.choices]
    assert texts == [ch.text for ch in b.choices] == [ch.message.content for ch in chat.choices]
    assert a.model_extra["iapo_sim"]["outcomes"] == b.model_extra["iapo_sim"]["outcomes"]
    assert [ch.text for ch in other.choices] != texts
    assert [ch.text for ch in unseeded[0].choices] != [ch.text for ch in unseeded[1].choices]
    assert a.model_extra["iapo_sim"]["prompt"] == table.prompts[1] and a.model_extra["iapo_sim"]["query"] == "q3"
    # usage: round(cost / largest mean prompt cost * 1000) tokens a completion; ceil(bytes / 4) for the prompt
    cost = table.cost_matrix()
    tokens = int(round(cost[1, 3] / cost.mean(axis=1).max() * 1000))
    assert tokens > 10
    assert a.usage.completion_tokens == 24 * tokens
    assert a.usage.prompt_tokens == -(-len(prompt.encode()) // 4)
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    capped = c.completions.create(model=model, prompt=prompt, n=3, max_tokens=10)
    assert capped.usage.completion_tokens == 30 and {ch.finish_reason for ch in capped.choices} == {"length"}
    # a query text the spec does not list goes to a query of the split by its SHA-256: always the same one
    seen = {c.completions.create(model=model, prompt=template(table.prompts[0], "What is 6 * 7?")).model_extra[
        "iapo_sim"]["query"] for _ in range(3)}
    assert len(seen) == 1
    # a stream gives the same completions as the answer, then the usage
    chunks = list(c.completions.create(model=model, prompt=prompt, n=24, seed=11, stream=True,
                                       stream_options={"include_usage": True}))
    assert [ch.choices[0].text for ch in chunks if ch.choices] == texts
    assert chunks[-1].usage.completion_tokens == 24 * tokens


def test_a_seeded_spec_draws_the_same_samples_from_the_same_model_at_another_address(
        mv_sim: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-completion seeds derive from the spec's seed, the model, the rendered prompt, the sampling and the
    index, not from the server's address: the same spec against a second simulator of the same table and --seed on
    another port (a model moved, restarted, behind a proxy) gets the same completions; another spec seed gets
    others."""
    import asyncio
    import dataclasses

    from iapo_gym.llm.client import LLMClient
    from iapo_gym.llm.spec import load_spec

    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    written = tmp_path / "sim.json"
    subprocess.run([*CLI, "simulate", MV, "--port", str(mv_sim), "--write-spec", str(written)], check=True, cwd=ROOT)
    spec = load_spec(written)
    assert spec.sampling.seed is not None
    table = level_table("mv_categorical", 2)
    prompt = template(table.prompts[2], "Question q5?")

    async def texts(port: int, seed: int) -> list[str]:
        moved = dataclasses.replace(spec, endpoint=dataclasses.replace(
            spec.endpoint, base_url=f"http://127.0.0.1:{port}/v1"), sampling=dataclasses.replace(spec.sampling,
                                                                                               seed=seed))
        async with LLMClient(moved) as llm:
            return [c.text for c in await llm.complete(prompt, list(range(16)))]

    proc, other_port = start_simulator(MV)
    try:
        here = asyncio.run(texts(mv_sim, spec.sampling.seed))
        there = asyncio.run(texts(other_port, spec.sampling.seed))
        reseeded = asyncio.run(texts(other_port, spec.sampling.seed + 1))
    finally:
        stop(proc)
    assert other_port != mv_sim and here == there
    assert reseeded != here and len(set(here)) > 1


def test_bad_requests_get_a_clear_4xx(mv_sim: int) -> None:
    """Each bad request is refused with the status, code and parameter named, and a message saying what was
    expected; the simulator goes on answering."""
    model = model_of(mv_sim)
    good = {"model": model, "prompt": template("p0-plain", "Question q0?")}
    cases: list[tuple[Any, int, str, str | None, str]] = [
        ({**good, "model": "gpt-x"}, 404, "model_not_found", "model", "does not exist"),
        ({**good, "n": 0}, 400, "invalid_value", "n", "integer in [1, 128]"),
        ({**good, "n": 129}, 400, "invalid_value", "n", "integer in [1, 128]"),
        ({**good, "n": True}, 400, "invalid_value", "n", "integer"),
        ({**good, "seed": "7"}, 400, "invalid_value", "seed", "integer"),
        ({**good, "temperature": 9}, 400, "invalid_value", "temperature", "[0, 2]"),
        ({**good, "frobnicate": 1}, 400, "unknown_parameter", "frobnicate", "unknown parameter"),
        ({**good, "logprobs": 3}, 400, "unsupported_parameter", "logprobs", "not supported"),
        ({"model": model}, 400, "invalid_prompt", "prompt", "string"),
        ({**good, "prompt": "What is 2 + 2?"}, 400, "unknown_prompt", "prompt", "matches none of the 5 templates"),
        ([1, 2], 400, "invalid_json", None, "JSON object"),
    ]
    for body, status, code, param, words in cases:
        got, answer = post(mv_sim, "/v1/completions", json.dumps(body).encode())
        error = answer["error"]
        assert (got, error["code"], error["param"]) == (status, code, param), (body, answer)
        assert words in error["message"], (body, error["message"])
    got, answer = post(mv_sim, "/v1/completions", b"{not json")
    assert (got, answer["error"]["code"]) == (400, "invalid_json")
    got, answer = post(mv_sim, "/v1/completions", json.dumps(good).encode(), {"Content-Type": "text/plain"})
    assert (got, answer["error"]["code"]) == (415, "unsupported_media_type")
    got, answer = post(mv_sim, "/v1/completions", b"x" * (2 << 20))
    assert (got, answer["error"]["code"]) == (413, "body_too_large")
    got, answer = post(mv_sim, "/v1/completions", json.dumps(good).encode(), {"Host": "evil.example"})
    assert (got, answer["error"]["code"]) == (421, "host_not_allowed")
    got, answer = post(mv_sim, "/v1/completions", b"", method="GET")
    assert (got, answer["error"]["code"]) == (405, "method_not_allowed")
    got, answer = post(mv_sim, "/v1/reward", b"{}")  # majority vote has no reward endpoint
    assert (got, answer["error"]["code"]) == (404, "not_found")
    with pytest.raises(openai.BadRequestError) as refused:
        client(mv_sim).chat.completions.create(model=model, messages=[{"role": "system", "content": "hi"},
                                                                      {"role": "user", "content": "x"}])
    assert refused.value.body["code"] == "invalid_messages"
    assert post(mv_sim, "/v1/completions", json.dumps(good).encode())[0] == 200
    # the connection's bounds are serve's (iapo_gym.deploy.connections): a head past 16 KiB gets 431 and is closed
    import socket

    with socket.create_connection(("127.0.0.1", mv_sim), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 431") and b"headers_too_large" in reply


def test_drift_applies_at_the_stated_request_count() -> None:
    """With --schedule drift --horizon 40 the requests before the schedule's change point are drawn from the
    level's table and those from it on from the drifted one: the segment each answer reports, and the answers'
    frequencies on the prompt and query that drift the most."""
    table = level_table("mv_binary", 16)
    schedule = build_schedule("drift", table, 40)
    assert len(schedule.segments) == 2  # this level steps (no ramp)
    cut = schedule.segments[1].start
    drifted = schedule.table_at(table, 1).probs
    diff = np.abs(drifted - table.probs).sum(axis=2) * schedule.drifting[:, None]
    p, q = (int(i) for i in np.unravel_index(np.argmax(diff), diff.shape))
    assert diff[p, q] > 1.0
    proc, port = start_simulator(DRIFT, "--schedule", "drift", "--horizon", "40")
    try:
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read())
        assert [s["start"] for s in health["schedule"]["segments"]] == [0, cut]
        assert table.prompts[p] in health["schedule"]["drifting"]
        assert f"segments from request {cut} " in output(proc)
        c, model = client(port), model_of(port)
        assert table.gold is not None
        gold = int(table.gold[q])
        counts = np.zeros((2, table.n_atoms), dtype=np.int64)
        for t in range(cut + 12):
            r = c.completions.create(model=model, prompt=template(table.prompts[p], f"Question {table.queries[q]}?"),
                                     n=64)
            sim = r.model_extra["iapo_sim"]
            assert (sim["request"], sim["segment"]) == (t, int(t >= cut))
            for choice in r.choices:
                counts[int(t >= cut), bucket_of(last_number(choice.text), gold, str(gold), table.n_atoms)] += 1
        assert chi_square_p(counts[0], table.probs[p, q]) > ALPHA
        assert chi_square_p(counts[1], drifted[p, q]) > ALPHA
        assert chi_square_p(counts[0], drifted[p, q]) < 1e-8 and chi_square_p(counts[1], table.probs[p, q]) < 1e-8
    finally:
        stop(proc)


def test_chat_spec_arrival_schedule_and_inbound_key() -> None:
    """A chat spec's messages map to their prompt; with --schedule arrival a late prompt is refused (400 naming
    the request it arrives at) until that many requests were answered, then served; without the inbound key,
    401."""
    table = level_table("mv_categorical", 2)
    schedule = build_schedule("arrival", table, 20)
    late = int(next(p for p in range(table.n_prompts) if schedule.arrival[p] > 0))
    early = int(next(p for p in range(table.n_prompts) if schedule.arrival[p] == 0))
    arrives = int(schedule.arrival[late])
    os.environ["IAPO_TEST_SIM_KEY"] = "sim-secret-key"
    try:
        proc, port = start_simulator(MV, "--api", "chat", "--schedule", "arrival", "--horizon", "20",
                                     "--api-key-env", "IAPO_TEST_SIM_KEY")
    finally:
        del os.environ["IAPO_TEST_SIM_KEY"]
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sim-secret-key", max_retries=0)
        model = str(c.models.list().data[0].id)

        def ask(p: int) -> Any:
            return c.chat.completions.create(model=model, messages=[
                {"role": "system", "content": f"You answer as prompt {table.prompts[p]}."},
                {"role": "user", "content": "Question q4?"}], n=2)

        for t in range(arrives):
            with pytest.raises(openai.BadRequestError) as refused:
                ask(late)
            assert refused.value.body["code"] == "prompt_not_available"
            assert f"arrives at request {arrives}" in refused.value.body["message"]
            sim = ask(early).model_extra["iapo_sim"]
            assert (sim["request"], sim["prompt"], sim["query"]) == (t, table.prompts[early], "q4")
        sim = ask(late).model_extra["iapo_sim"]
        assert (sim["request"], sim["prompt"], sim["segment"]) == (arrives, table.prompts[late], 1)
        with pytest.raises(openai.BadRequestError) as refused:  # a chat spec takes no completions request
            c.completions.create(model=model, prompt="Question q4?")
        assert refused.value.body["code"] == "wrong_api"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        stop(proc)


def test_best_of_n_completions_are_scored_by_the_reward_endpoint(tmp_path: Path) -> None:
    """Best-of-N: each completion carries its id, the reward endpoint (the written spec's reward_url) returns its
    score vector, and the vectors' frequencies match the table's."""
    table = level_table("bon_flat", 1)
    port = free_port()
    spec = tmp_path / "bon.json"
    subprocess.run([*CLI, "simulate", BON, "--port", str(port), "--write-spec", str(spec)], check=True, cwd=ROOT)
    doc = json.loads(spec.read_text())
    assert doc["scorer"]["reward_url"] == f"http://127.0.0.1:{port}/v1/reward"
    assert doc["scorer"]["objectives"] == list(table.objective_names)
    proc, _ = start_simulator(BON, port=port)
    try:
        c, model = client(port), model_of(port)
        spread = table.probs.max(axis=2)
        p, q = (int(i) for i in np.unravel_index(np.argmin(spread), spread.shape))  # the most spread-out pair
        assert table.atoms is not None
        vectors = {tuple(v) for v in table.atoms[p, q]}
        index = {v: i for i, v in enumerate(sorted(vectors))}
        probs = np.zeros(len(index))
        for m, v in enumerate(table.atoms[p, q]):
            probs[index[tuple(v)]] += table.probs[p, q, m]
        counts = np.zeros(len(index), dtype=np.int64)
        for _ in range(12):
            r = c.completions.create(model=model, prompt=template(table.prompts[p], f"Question {table.queries[q]}?"),
                                     n=128)
            for choice in r.choices:
                status, scores = post(port, "/v1/reward", json.dumps({"query": "?", "completion": choice.text}).encode())
                assert status == 200 and list(scores["scores"]) == list(table.objective_names)
                counts[index[tuple(scores["scores"][k] for k in table.objective_names)]] += 1
        assert chi_square_p(counts, probs) > ALPHA
        status, answer = post(port, "/v1/reward", json.dumps({"query": "?", "completion": "no id"}).encode())
        assert (status, answer["error"]["code"]) == (400, "unknown_completion")
        status, answer = post(port, "/v1/reward", json.dumps({"completion": "[iapo-sim 99:0:0]"}).encode())
        assert status == 400 and "outside this table's 5 prompts" in answer["error"]["message"]
    finally:
        stop(proc)


def test_binomial_z2_tail_matches_a_monte_carlo_null() -> None:
    """The collect test's p-value: the lattice's tail is an upper bound on 200,000 simulated sums' tail, and close
    to it (the rounding adds at most 0.01 per cell)."""
    table = level_table("mv_categorical", 2)
    n, probs = table.n_max, table.probs[:, :, 0].ravel()
    probs = probs[(probs > 1e-6) & (probs < 1 - 1e-6)]
    null = np.random.default_rng(0).binomial(n, probs, size=(200_000, probs.size)) / n
    sums = ((null - probs) ** 2 / (probs * (1 - probs) / n)).sum(axis=1)
    for z2 in np.quantile(sums, [0.5, 0.99, 0.999]):
        simulated = float((sums >= z2).mean())
        assert simulated - 4 * np.sqrt(simulated / sums.size) <= binomial_z2_tail(n, probs, float(z2)) \
            <= float((sums >= z2 - 0.01 * probs.size).mean()) + 4 * np.sqrt(simulated / sums.size)


@pytest.mark.heavy
def test_collect_against_the_simulator_rebuilds_the_table(tmp_path: Path) -> None:
    """`iapo-gym collect` on the written spec collects every (prompt, query) from the simulator and builds a
    table with the original's shape, split, contexts and costs, whose gold-answer frequencies match the
    original's probabilities."""
    table = level_table("mv_categorical", 2)
    port = free_port()
    spec = tmp_path / "sim.json"
    subprocess.run([*CLI, "simulate", MV, "--port", str(port), "--write-spec", str(spec)], check=True, cwd=ROOT)
    proc, _ = start_simulator(MV, port=port)
    try:
        done = subprocess.run([*CLI, "collect", str(spec), "--out", str(tmp_path / "run"), "--quiet"],
                              capture_output=True, text=True, cwd=ROOT, timeout=240,
                              env={**os.environ, "OPENAI_BASE_URL": "", "OPENAI_API_KEY": ""})
        assert done.returncode == 0, done.stderr
    finally:
        stop(proc)
    built = read_table(tmp_path / "run" / f"{json.loads(spec.read_text())['task']}.h5")
    assert built.shape == table.shape and built.n_max == table.n_max
    assert built.prompts == table.prompts and built.queries == table.queries
    assert np.array_equal(built.split, table.split)
    assert built.context_names == table.context_names
    assert np.allclose(built.context_weights, table.context_weights) and np.allclose(built.context_probs,
                                                                                     table.context_probs)
    assert np.allclose(built.cost, table.cost_matrix().mean(axis=1), rtol=2e-3)
    assert built.gold is not None and table.gold is not None
    n = table.n_max
    want = table.probs[:, np.arange(table.n_queries), table.gold]
    got = built.probs[:, np.arange(table.n_queries), built.gold]
    var = want * (1 - want) / n
    fixed = var < 1e-12
    assert np.allclose(got[fixed], want[fixed], atol=1e-9)
    z2 = float((((got - want) ** 2)[~fixed] / var[~fixed]).sum())
    assert binomial_z2_tail(n, want[~fixed], z2) > ALPHA
    wrong = table.probs[:, np.arange(table.n_queries), (table.gold + 1) % table.n_atoms]  # another bucket
    wrong_z2 = float((((got - wrong) ** 2)[~fixed] / var[~fixed]).sum())
    assert wrong_z2 >= 2_000 and binomial_z2_tail(n, want[~fixed], 2_000) < 1e-8  # the test would catch it


def test_a_bad_table_or_schedule_is_refused_before_serving(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 1 with a message naming the bad value and what was expected, before anything listens (the command's
    own entry point, in this process: it returns instead of serving)."""
    from iapo_gym.cli import main

    cases = [
        (["generated:nofamily:1"], "nofamily"),
        ([MV, "--schedule", "drift"], "needs --horizon"),
        ([MV, "--schedule", "context_shift", "--horizon", "10"], "context_shift"),
        ([str(tmp_path / "missing.h5")], "missing.h5"),
        (["synthetic_bernoulli", "--host", "0.0.0.0"], "--api-key-env"),
        ([MV, "--write-spec", str(tmp_path / "spec.toml")], "ending in .json"),
    ]
    for args, words in cases:
        assert main(["simulate", *args, "--port", str(free_port())]) == 1, args
        said = capsys.readouterr().err
        assert said.startswith("iapo-gym simulate: error: ") and words in said, (args, said)
    assert not list(tmp_path.iterdir())  # nothing written


def _doc_blocks() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "simulate.md").read_text(encoding="utf-8")
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


@pytest.mark.heavy
def test_the_commands_of_docs_simulate_run_as_written(tmp_path: Path) -> None:
    """Every command of docs/simulate.md's sh blocks runs as written in a scratch folder (the server in the
    background, until the commands after it are done), and its Python blocks run against that server."""
    commands = [line.strip() for lang, block in _doc_blocks() if lang == "sh"
                for line in block.replace("\\\n", " ").splitlines() if line.strip() and not line.strip().startswith("#")]
    assert any(c.startswith("iapo-gym simulate ") and "--write-spec" not in c for c in commands)
    assert any(c.startswith("iapo-gym collect ") for c in commands)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENAI_BASE_URL": "", "OPENAI_API_KEY": ""}
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for command in commands:
            argv = shlex.split(command)
            assert argv[0] in ("iapo-gym", "python"), command
            argv = [*CLI] + argv[1:] if argv[0] == "iapo-gym" else [sys.executable] + argv[1:]
            if ("simulate" in argv and "--write-spec" not in argv or "serve" in argv) and "--port" in argv:
                log = (tmp_path / f"server{len(servers)}.log").open("wb")
                proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
                servers.append(proc)
                wait_ready(f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/health", proc, timeout=60)
                continue
            done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
            assert done.returncode == 0, (command, done.stderr[-2000:])
        for lang, block in _doc_blocks():
            if lang == "python":
                done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True,
                                      text=True, timeout=120)
                assert done.returncode == 0, done.stderr[-2000:]
    finally:
        for proc in servers:
            stop(proc)


def test_an_edited_spec_maps_by_its_templates_and_a_label_the_extractor_cannot_read_is_refused(
        tmp_path: Path) -> None:
    """--spec: the mapping follows the spec's own templates (the one with the most text of its own wins where
    several match; a placeholder given twice must repeat the query) and query texts; an extractor that reads
    another answer than a bucket's label stops the simulator at startup, naming the label."""
    from iapo_gym.deploy.params import RequestError
    from iapo_gym.deploy.simulate import SimulateError, Simulator, write_spec
    from iapo_gym.llm.spec import load_spec

    table = level_table("mv_categorical", 2)
    path, _ = write_spec(tmp_path / "spec.json", table, port=1)
    doc = json.loads(path.read_text())
    doc["prompts"][0]["template"] = "{query}"
    doc["prompts"][1]["template"] = "Solve: {query}"
    doc["prompts"][2]["template"] = "{query} -- again: {query}"
    path.write_text(json.dumps(doc))
    sim = Simulator(table, load_spec(path))
    q7 = table.queries.index("q7")
    assert sim.match("Solve: Question q7?") == (1, q7)
    assert sim.match("Question q7?") == (0, q7)
    assert sim.match("Question q7? -- again: Question q7?") == (2, q7)
    assert sim.match("Question q7? -- again: other")[0] == 0  # not a repetition: only the bare template matches
    other = sim.match("Solve: what is 6 * 7?")
    assert other[0] == 1 and other == sim.match("Solve: what is 6 * 7?")
    with pytest.raises(RequestError) as refused:
        sim.match([("system", "hi"), ("user", "Question q7?")])
    assert refused.value.code == "invalid_messages"
    doc["scorer"] = {"extractor": "regex", "pattern": "([A-E])"}
    path.write_text(json.dumps(doc))
    with pytest.raises(SimulateError, match=r"reads None from the completion '0', not the answer '0'"):
        Simulator(table, load_spec(path))


@pytest.mark.heavy
def test_collect_of_a_best_of_n_table_scores_through_the_reward_endpoint(tmp_path: Path) -> None:
    """`iapo-gym collect` on a Best-of-N simulator (8 queries of a generated level) scores every completion through
    the written spec's reward_url, and the table it builds has the original's score vectors with their
    probabilities (the mean score vector of each (prompt, query) within sampling error), costs and contexts.

    The means are judged by the sum of their squared z-scores against its law under a right collection, drawn
    (``NULL_DRAWS`` multinomial draws of every pair's n_max outcomes), not against a chi-square law: the level has
    atoms of probability down to 1e-10, one such atom among a pair's 19 draws adds 1 / (19 pi) to the sum, and the
    chi-square's p fell below 1e-6 in about 1 right collection in 300 (the completions' seeds come from the
    endpoint's URL, a fresh port each run). A right collection exceeds every drawn sum with probability
    1 / (``NULL_DRAWS`` + 1); one scoring the wrong prompt or the objectives in the wrong order sits far beyond."""
    from dataclasses import replace

    from iapo_gym.tables import write_table

    full = level_table("bon_flat", 1)
    assert full.split is not None and full.atoms is not None
    rows = np.concatenate([np.flatnonzero(full.split == 0)[:6], np.flatnonzero(full.split == 1)[:2]])
    table = replace(full, probs=full.probs[:, rows], atoms=full.atoms[:, rows], split=full.split[rows],
                    queries=tuple(full.queries[i] for i in rows), cost=full.cost_matrix()[:, rows], task="bon-slice")
    write_table(table, tmp_path / "bon.h5")
    port = free_port()
    spec = tmp_path / "bon.json"
    subprocess.run([*CLI, "simulate", str(tmp_path / "bon.h5"), "--port", str(port), "--write-spec", str(spec)],
                   check=True, cwd=ROOT)
    proc, _ = start_simulator(str(tmp_path / "bon.h5"), port=port)
    try:
        done = subprocess.run([*CLI, "collect", str(spec), "--out", str(tmp_path / "run"), "--quiet"],
                              capture_output=True, text=True, cwd=ROOT, timeout=240,
                              env={**os.environ, "OPENAI_BASE_URL": "", "OPENAI_API_KEY": ""})
        assert done.returncode == 0, done.stderr
        assert f"reward endpoint: {table.n_prompts * 8 * table.n_max} requests" in done.stderr + done.stdout
    finally:
        stop(proc)
    built = read_table(tmp_path / "run" / "sim-bon-slice.h5")
    assert built.atoms is not None and table.atoms is not None
    assert built.queries == table.queries and np.array_equal(built.split, table.split)
    assert built.objective_names == table.objective_names
    assert np.allclose(built.cost, table.cost_matrix().mean(axis=1), rtol=2e-3)
    assert np.allclose(built.context_weights, table.context_weights)
    for p in range(table.n_prompts):
        for q in range(8):
            drawn = {tuple(v) for v, w in zip(built.atoms[p, q], built.probs[p, q], strict=True) if w > 0}
            support = {tuple(v) for v, w in zip(table.atoms[p, q], table.probs[p, q], strict=True) if w > 0}
            assert drawn <= support  # every score vector collected is one the table gives that pair
    mean_built = (built.probs[..., None] * built.atoms).sum(axis=2)
    mean_table = (table.probs[..., None] * table.atoms).sum(axis=2)
    second = (table.probs[..., None] * table.atoms ** 2).sum(axis=2)
    se = np.sqrt(np.maximum(second - mean_table ** 2, 1e-12) / table.n_max)
    z2 = float((((mean_built - mean_table) / se) ** 2).sum())
    rng = np.random.default_rng(0)
    null = np.zeros(NULL_DRAWS)  # the sum's law under a right collection
    for p in range(table.n_prompts):
        for q in range(8):
            law = table.probs[p, q] / table.probs[p, q].sum()
            means = rng.multinomial(table.n_max, law, size=NULL_DRAWS) @ table.atoms[p, q] / table.n_max
            null += (((means - mean_table[p, q]) / se[p, q]) ** 2).sum(axis=1)
    assert (null >= z2).any(), f"the sum of squared z-scores {z2:.1f} exceeds all {NULL_DRAWS} of a right collection"
