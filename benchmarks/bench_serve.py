"""Benchmark: the latency ``iapo-gym serve`` adds over calling the upstream directly for the same N completions.

Upstream: the tiny llama.cpp server on 127.0.0.1 (tests/llm_server.py; it ignores ``n``, so every
side sends N requests of one completion, with the same prompts, sampling and per-completion seeds).
One logical call = N completions of one query:

* ``direct``: the N requests straight to the upstream, concurrently (the floor);
* ``bare proxy``: the same N requests through a bare FastAPI + httpx2 pass-through proxy (the reference);
* ``serve``: one request to ``iapo-gym serve`` with a one-context majority-vote policy of N, which
  renders the prompt, sends the N requests through the project's client, votes and answers; it runs
  with ``--no-early-stop``, so that it draws all N completions as the other sides do (like with like:
  a serve answer with ``iapo.drawn`` other than N counts as an error; ``--early-stop`` below measures
  what stopping early saves and costs);
* ``optillm`` (``--optillm-python PY``, OptiLLM installed in a venv of its own): one chat request with
  its self-consistency approach, which always samples 5 completions, one after another, through the
  upstream's chat API (run with ``--n 5`` to compare at the same N);
* ``serve h11`` (``--h11``): serve again with ``--http h11`` instead of httptools, the parser's cost (both
  run with the same connection bounds, ``iapo_gym.deploy.connections``).

The load generator (this process, asyncio + httpx2) runs ``--calls`` calls per side at each
concurrency, sides interleaved over ``--repeats`` rounds; it reports p50/p99 latency, calls per
second, the latency added over ``direct`` and the throughput kept, the same two against the bare
proxy (the goal: serve within 1 ms of its p50 at concurrency 1, and at least 90 % of its calls per
second at concurrency 16), and the CPU time per call of each proxy process (read from /proc: a
steadier figure on a shared machine).
Run: ``nice -n 5 python benchmarks/bench_serve.py`` (needs ``pip install "iapo-gym[llm,serve]"`` and fastapi).

``--ttft``: time to first token at N = 1, streamed: ``serve``'s first text chunk against the upstream's
own (a streaming request straight to llama.cpp with the body serve sends), and the whole answer
without streaming (what a caller waited for before the first text when serve streamed the decided
answer only), medians and ratios in the same run, sides interleaved.

``--log-latency``: the latency ``--log DIR`` and ``--learn --log DIR`` add to plain ``serve``, at each N of ``--ns``
(default 1 and 5), in front of one ``iapo-gym simulate`` of a Best-of-N table (default ``generated:bon_flat:1``; no
model, so the figures are serve's own): three serve processes of the same one-context policy, the table's best
prompt at N (its ``n_max`` N, so the learner's arms are the table's prompts at N = 1..N and its greedy arm is the
policy's), each call sent to the three in a shuffled order. Reported
per side: p50/p95 latency, the added p50 (the side's p50 minus plain serve's) and the median of the per-call
differences (paired), and the CPU time per call. A call the learner served at another N than the others (an
explored arm) is left out on every side and counted. The goal: under 1 ms added at p50. ``--all-contexts``: a
policy of every objective weighting of the simulator's spec instead (26 for ``bon_flat``; cost weight 0), the calls
going to its contexts in turn: the learner's work grows with its contexts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from iapo_gym.exact import bon_weighted_max  # noqa: E402
from iapo_gym.llm.client import LLMClient  # noqa: E402
from iapo_gym.llm.spec import load_spec  # noqa: E402
from iapo_gym.outcome_log import read_log  # noqa: E402
from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyPrompt  # noqa: E402
from iapo_gym.tasks.generated import level_table  # noqa: E402
from tests.deploy_helpers import mv_policy, start_serve  # noqa: E402
from tests.llm_server import _log_file, free_port, start_llama_server, stop, wait_ready, write_spec, write_tiny_gguf  # noqa: E402

TEMPLATE = "Q: {query}\nA:"


def bare_proxy(port: int, upstream: str) -> None:
    """The reference: a bare FastAPI + httpx2 pass-through proxy (run in its own process)."""
    import httpx2
    import uvicorn
    from fastapi import FastAPI, Request, Response

    app = FastAPI()
    client = httpx2.AsyncClient(base_url=upstream, timeout=60, limits=httpx2.Limits(max_connections=256))

    async def forward(request: Request) -> Response:
        r = await client.post(request.url.path, content=await request.body(), headers={"content-type": "application/json"})
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(b'{"status": "ok"}', media_type="application/json")

    app.router.add_route("/v1/{path:path}", forward, methods=["POST"])
    app.router.add_route("/health", health, methods=["GET"])

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Side:
    """One way of getting N completions per call."""

    def __init__(self, name: str, port: int, pid: int | None, mode: str) -> None:
        self.name, self.port, self.pid, self.mode = name, port, pid, mode
        self.latencies: dict[int, list[float]] = {}
        self.seconds: dict[int, float] = {}
        self.calls: dict[int, int] = {}
        self.cpu: dict[int, float] = {}
        self.errors = 0


async def one_call(client: Any, side: Side, query: str, n: int, upstream_body: Any, model: str,
                   max_tokens: int) -> None:
    """One logical call of ``side``: N completions of ``query``."""
    if side.mode == "fan-out":  # direct or bare proxy: the N requests serve would send
        rs = await asyncio.gather(*(client.post(f"http://127.0.0.1:{side.port}/v1/completions", json=upstream_body(query, i))
                                    for i in range(n)))
    elif side.mode == "serve":
        rs = [await client.post(f"http://127.0.0.1:{side.port}/v1/completions",
                                json={"model": "iapo/low", "prompt": query})]
    else:  # optillm: its self-consistency approach, N samples
        rs = [await client.post(f"http://127.0.0.1:{side.port}/v1/chat/completions",
                                json={"model": f"self_consistency-{model}", "max_tokens": max_tokens,
                                      "messages": [{"role": "user", "content": TEMPLATE.replace('{query}', query)}]})]
    for r in rs:
        if r.status_code != 200:
            side.errors += 1
            if side.errors <= 3:
                print(f"  {side.name}: HTTP {r.status_code} {r.text[:200]}", file=sys.stderr)
        elif side.mode == "serve" and r.json()["iapo"]["drawn"] != n:  # like with like: serve drew all N too
            side.errors += 1
            if side.errors <= 3:
                print(f"  serve drew {r.json()['iapo']['drawn']} completions, not {n}", file=sys.stderr)


async def run_segment(side: Side, concurrency: int, calls: int, n: int, upstream_body: Any, model: str,
                      offset: int, max_tokens: int) -> None:
    """``calls`` calls of ``side`` by ``concurrency`` workers; latencies and wall time recorded."""
    import httpx2

    limits = httpx2.Limits(max_connections=concurrency * n + 8, max_keepalive_connections=concurrency * n + 8)
    async with httpx2.AsyncClient(timeout=120, limits=limits) as client:
        await one_call(client, side, "warm up", n, upstream_body, model, max_tokens)  # connections open
        todo = list(range(calls))
        lat = side.latencies.setdefault(concurrency, [])

        async def worker() -> None:
            while todo:
                i = todo.pop()
                t = time.perf_counter()
                await one_call(client, side, f"{offset + i} + {i % 7} =", n, upstream_body, model, max_tokens)
                lat.append(time.perf_counter() - t)
        cpu0 = cpu_seconds(side.pid) if side.pid else 0.0
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        side.seconds[concurrency] = side.seconds.get(concurrency, 0.0) + time.perf_counter() - start
        side.calls[concurrency] = side.calls.get(concurrency, 0) + calls
        if side.pid:
            side.cpu[concurrency] = side.cpu.get(concurrency, 0.0) + cpu_seconds(side.pid) - cpu0


def main() -> None:
    """Start the processes, run the interleaved rounds, print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3, help="completions per call (the policy's N)")
    ap.add_argument("--calls", type=int, default=150, help="calls per side, concurrency and round")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--optillm-python", help="python of a venv with optillm installed (a peer, never a dependency)")
    ap.add_argument("--h11", action="store_true",
                    help="also a side 'serve h11': serve with --http h11 instead of httptools (the parser's cost)")
    ap.add_argument("--bare-proxy", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_proxy:
        bare_proxy(int(args.bare_proxy[0]), args.bare_proxy[1])
        return
    folder = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    up = free_port()
    llama = start_llama_server(write_tiny_gguf(folder / "tiny.gguf"), up)
    procs: list[subprocess.Popen[bytes]] = [llama]
    try:
        spec_path = write_spec(folder, up, n_max=args.n, sampling={"temperature": 0.9, "max_tokens": args.max_tokens},
                               endpoint={"concurrency": 256, "use_n": "no", "max_retries": 0})
        spec = load_spec(spec_path)
        seeder = LLMClient(spec)  # the per-completion seeds serve's client sends, so every side sends the same
        params = spec.sampling.as_dict()
        params.pop("seed", None)

        def upstream_body(query: str, i: int) -> dict[str, Any]:
            prompt = TEMPLATE.replace("{query}", query)
            return {"model": spec.endpoint.model, "prompt": prompt, "seed": seeder._seed(prompt, i), **params}

        policy = mv_policy({"low": ("plain", args.n)}, extractor={"extractor": "regex", "pattern": r"\A\s*(\S)"},
                           n_max=args.n).save(folder / "policy.json")
        serve_port, bare_port = free_port(), free_port()
        serve = start_serve(policy, spec_path, serve_port, extra=["--no-early-stop"])
        procs.append(serve)
        log = _log_file("bare")
        bare = subprocess.Popen([sys.executable, __file__, "--bare-proxy", str(bare_port), f"http://127.0.0.1:{up}"],
                                stdout=log, stderr=subprocess.STDOUT)
        bare.log_file = log  # type: ignore[attr-defined]
        procs.append(bare)
        wait_ready(f"http://127.0.0.1:{bare_port}/health", bare)
        sides = [Side("direct", up, None, "fan-out"), Side("bare proxy", bare_port, bare.pid, "fan-out"),
                 Side("serve", serve_port, serve.pid, "serve")]
        if args.h11:
            h11_port = free_port()
            serve_h11 = start_serve(policy, spec_path, h11_port, extra=["--no-early-stop", "--http", "h11"])
            procs.append(serve_h11)
            sides.append(Side("serve h11", h11_port, serve_h11.pid, "serve"))
        optillm_note = "not run (give --optillm-python)"
        if args.optillm_python:
            opt_port = free_port()
            log = _log_file("optillm")
            env = {**os.environ, "OPENAI_API_KEY": "none"}
            opt = subprocess.Popen([args.optillm_python, "-c", "import sys; from optillm import main; sys.exit(main())",
                                    "--host", "127.0.0.1", "--port", str(opt_port), "--base-url",
                                    f"http://127.0.0.1:{up}/v1", "--approach", "self_consistency", "--log", "warning"],
                                   stdout=log, stderr=subprocess.STDOUT, env=env)
            opt.log_file = log  # type: ignore[attr-defined]
            procs.append(opt)
            try:
                wait_ready(f"http://127.0.0.1:{opt_port}/health", opt, timeout=120)
                sides.append(Side("optillm", opt_port, opt.pid, "optillm"))
                optillm_note = "run"
            except RuntimeError as exc:
                optillm_note = f"did not start: {str(exc)[-300:]}"
        rng = random.Random(0)
        for r in range(args.repeats):
            for c in args.concurrency:
                order = sides[:]
                rng.shuffle(order)
                for side in order:
                    asyncio.run(run_segment(side, c, args.calls, args.n, upstream_body, spec.endpoint.model,
                                            offset=r * 100000 + c * 1000, max_tokens=args.max_tokens))
        report(sides, args, optillm_note)
    finally:
        for p in reversed(procs):
            stop(p)


def report(sides: list[Side], args: argparse.Namespace, optillm_note: str) -> None:
    """The table: p50/p99 latency, calls/s, added latency and kept throughput against direct, CPU per call."""
    direct = sides[0]
    print(f"N = {args.n} completions per call, max_tokens {args.max_tokens}, {args.calls} calls x {args.repeats} rounds "
          f"per side and concurrency; {os.cpu_count()} cores shared with other jobs; OptiLLM: {optillm_note}")
    bare = sides[1]
    print(f"{'side':<12} {'conc':>4} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>8} {'+p50 ms':>8} {'thr kept':>8} "
          f"{'vs bare':>8} {'thr/bare':>8} {'CPU ms/call':>11} {'errors':>6}")
    for c in args.concurrency:
        d50 = float(np.percentile(direct.latencies[c], 50)) * 1000
        b50 = float(np.percentile(bare.latencies[c], 50)) * 1000
        drate = direct.calls[c] / direct.seconds[c]
        brate = bare.calls[c] / bare.seconds[c]
        for side in sides:
            lat = np.array(side.latencies[c]) * 1000
            rate = side.calls[c] / side.seconds[c]
            cpu = f"{side.cpu[c] / side.calls[c] * 1000:.2f}" if side.pid else "-"
            print(f"{side.name:<12} {c:>4} {np.percentile(lat, 50):>8.2f} {np.percentile(lat, 99):>8.2f} {rate:>8.1f} "
                  f"{np.percentile(lat, 50) - d50:>+8.2f} {rate / drate:>8.1%} {np.percentile(lat, 50) - b50:>+8.2f} "
                  f"{rate / brate:>8.1%} {cpu:>11} {side.errors:>6}")
    print(json.dumps({s.name: {str(c): {"p50_ms": float(np.percentile(s.latencies[c], 50) * 1000),
                                        "p99_ms": float(np.percentile(s.latencies[c], 99) * 1000),
                                        "calls_per_s": s.calls[c] / s.seconds[c]} for c in args.concurrency}
                      for s in sides}))



def early_stop_bench(argv: list[str]) -> None:
    """``--early-stop``: completions and latency of majority votes that stop when decided against all N, live.

    The example task (examples/collect_llamacpp.toml: 3 prompts x 5 queries) on the tiny llama.cpp
    model, through ``iapo_gym.deploy.Router`` in this process: every (prompt, query) at each cap N,
    with early stopping and with all N, interleaved over the rounds. llama.cpp ignores ``n``, so both
    send one request per completion and completion i has the same seed on both sides.
    """
    import dataclasses

    from iapo_gym.deploy import Router
    from iapo_gym.llm.spec import load_spec
    from iapo_gym.policyfile import PolicyContext, PolicyFile, PolicyPrompt

    ap = argparse.ArgumentParser()
    ap.add_argument("--early-stop", action="store_true")
    ap.add_argument("--ns", type=int, nargs="+", default=[3, 5, 8], help="caps N")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="bench-early-"))
    up = free_port()
    llama = start_llama_server(write_tiny_gguf(folder / "tiny.gguf"), up)
    try:
        spec = load_spec(Path(__file__).resolve().parent.parent / "examples" / "collect_llamacpp.toml")
        spec = dataclasses.replace(spec, endpoint=dataclasses.replace(spec.endpoint, base_url=f"http://127.0.0.1:{up}/v1",
                                                                      concurrency=16),
                                   sampling=dataclasses.replace(spec.sampling, max_tokens=args.max_tokens),
                                   budget=dataclasses.replace(spec.budget, max_requests=None, max_tokens_total=None))
        n_max = max(args.ns)
        prompts = tuple(PolicyPrompt(p.id, p.text) for p in spec.prompts)
        contexts = tuple(PolicyContext(f"{p.id}-{n}", (1.0,), -0.01 * n, 1.0 / (len(prompts) * len(args.ns)), p.id, n)
                         for p in prompts for n in args.ns)
        policy = PolicyFile(task=spec.task, aggregator="mv", api="completions", n_max=n_max, objectives=("correct",),
                            scorer={"extractor": spec.scorer.extractor}, sampling=None, prompts=prompts,
                            contexts=contexts)
        rows: dict[tuple[str, bool], list[tuple[int, float]]] = {}
        with Router(policy, spec) as early, Router(policy, spec, early_stop=False) as full:
            for _ in range(args.repeats):
                for c in contexts:
                    for q in spec.queries:
                        for router, on in ((early, True), (full, False)):
                            t = time.perf_counter()
                            r = router.complete(q.text, c.name)
                            rows.setdefault((c.name, on), []).append((r.n, time.perf_counter() - t))
        print(f"early stopping on {spec.task}: {len(spec.queries)} queries x {args.repeats} rounds per row, tiny llama.cpp "
              f"model, max_tokens {args.max_tokens}")
        print(f"{'context':<18} {'N':>3} {'drawn':>6} {'saved':>6} {'p50 ms all N':>12} {'p50 ms early':>12}")
        total = {True: 0, False: 0}
        for c in contexts:
            e, f = rows[(c.name, True)], rows[(c.name, False)]
            de, df = sum(x for x, _ in e), sum(x for x, _ in f)
            total[True] += de
            total[False] += df
            print(f"{c.name:<18} {c.n:>3} {de / len(e):>6.2f} {1 - de / df:>6.1%} "
                  f"{np.percentile([t for _, t in f], 50) * 1000:>12.1f} {np.percentile([t for _, t in e], 50) * 1000:>12.1f}")
        print(f"all: {total[True]} of {total[False]} completions drawn ({1 - total[True] / total[False]:.1%} saved)")
    finally:
        stop(llama)


async def _first_text(client: Any, url: str, body: dict[str, Any]) -> tuple[float, float, str]:
    """A streaming completions request: seconds to the first chunk with text, to the end, and the text."""
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code} {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text = "".join(c.get("text") or "" for c in chunk.get("choices") or ())
            if text:
                parts.append(text)
                if first is None:
                    first = time.perf_counter() - start
    total = time.perf_counter() - start
    return (total if first is None else first), total, "".join(parts)


def ttft_bench(argv: list[str]) -> None:
    """``--ttft``: time to first token at N = 1 through serve, streamed, against the upstream's own (module docstring)."""
    import httpx2

    ap = argparse.ArgumentParser()
    ap.add_argument("--ttft", action="store_true")
    ap.add_argument("--calls", type=int, default=100, help="calls per side and round")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="bench-ttft-"))
    up = free_port()
    llama = start_llama_server(write_tiny_gguf(folder / "tiny.gguf"), up)
    procs: list[subprocess.Popen[bytes]] = [llama]
    try:
        spec_path = write_spec(folder, up, n_max=1, sampling={"temperature": 0.9, "max_tokens": args.max_tokens},
                               endpoint={"use_n": "no", "max_retries": 0})
        spec = load_spec(spec_path)
        seeder = LLMClient(spec)
        params = spec.sampling.as_dict()
        params.pop("seed", None)
        policy = mv_policy({"low": ("plain", 1)}, extractor={"extractor": "regex", "pattern": r"\A\s*(\S)"},
                           n_max=1).save(folder / "policy.json")
        serve_port = free_port()
        procs.append(start_serve(policy, spec_path, serve_port))
        direct_url = f"http://127.0.0.1:{up}/v1/completions"
        serve_url = f"http://127.0.0.1:{serve_port}/v1/completions"

        def direct_body(query: str) -> dict[str, Any]:  # the body serve sends upstream for this query
            prompt = TEMPLATE.replace("{query}", query)
            return {"model": spec.endpoint.model, "prompt": prompt, **params, "seed": seeder._seed(prompt, 0),
                    "stream": True, "stream_options": {"include_usage": True}}

        sides = ("direct stream", "serve stream", "serve whole")
        first: dict[str, list[float]] = {s: [] for s in sides}
        total: dict[str, list[float]] = {s: [] for s in sides}
        mismatched = 0

        async def round_(r: int) -> None:
            nonlocal mismatched
            async with httpx2.AsyncClient(timeout=120) as client:
                await _first_text(client, serve_url, {"model": "iapo/low", "prompt": "warm up", "stream": True})
                for i in range(args.calls):
                    query = f"{r * 1000 + i} + {i % 7} ="
                    texts: dict[str, str] = {}
                    order = list(sides)
                    random.Random(r * 1000 + i).shuffle(order)
                    for side in order:
                        if side == "direct stream":
                            f, t, texts[side] = await _first_text(client, direct_url, direct_body(query))
                        elif side == "serve stream":
                            f, t, texts[side] = await _first_text(client, serve_url, {"model": "iapo/low", "prompt": query,
                                                                                      "stream": True})
                        else:
                            start = time.perf_counter()
                            resp = await client.post(serve_url, json={"model": "iapo/low", "prompt": query})
                            f = t = time.perf_counter() - start
                            texts[side] = resp.json()["choices"][0]["text"]
                        first[side].append(f)
                        total[side].append(t)
                    mismatched += len(set(texts.values())) != 1

        for r in range(args.repeats):
            asyncio.run(round_(r))
        med = {s: (float(np.median(first[s])) * 1000, float(np.median(total[s])) * 1000) for s in sides}
        print(f"time to first token at N = 1: {args.calls} calls x {args.repeats} rounds per side, tiny llama.cpp model, "
              f"max_tokens {args.max_tokens}, {os.cpu_count()} cores shared with other jobs; answers that differed "
              f"between the sides: {mismatched}")
        print(f"{'side':<14} {'first text p50 ms':>17} {'whole p50 ms':>12} {'first / direct':>14}")
        for s in sides:
            print(f"{s:<14} {med[s][0]:>17.2f} {med[s][1]:>12.2f} {med[s][0] / med['direct stream'][0]:>14.2f}")
        print(json.dumps({s: {"first_text_p50_ms": med[s][0], "whole_p50_ms": med[s][1]} for s in sides}))
    finally:
        for p in reversed(procs):
            stop(p)


LOG_SIDES = ("serve", "serve --log", "serve --learn --log")


async def _log_latency_round(r: int, n: int, ports: list[int], queries: list[str], calls: int, concurrency: int,
                             out: dict[str, Any], names: list[str]) -> None:
    """Round ``r`` of ``--log-latency`` at N: ``calls`` calls, each sent to the three sides in a shuffled order;
    latencies of the calls every side served at N go to ``out``."""
    import httpx2

    limits = httpx2.Limits(max_connections=4 * concurrency + 8)
    async with httpx2.AsyncClient(timeout=60, limits=limits) as client:
        for port in ports:  # connections open, the learner's first request behind it
            await client.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"model": f"iapo/{names[0]}", "prompt": queries[0]})
        todo = list(range(calls))

        async def worker() -> None:
            while todo:
                i = todo.pop()
                order = list(zip(LOG_SIDES, ports, strict=True))
                random.Random(r * 1_000_003 + i).shuffle(order)
                took: dict[str, float] = {}
                like = True
                for name, port in order:
                    t = time.perf_counter()
                    resp = await client.post(f"http://127.0.0.1:{port}/v1/completions", json={
                        "model": f"iapo/{names[i % len(names)]}", "prompt": queries[(r * calls + i) % len(queries)]})
                    took[name] = time.perf_counter() - t
                    if resp.status_code != 200:
                        out["errors"][name] += 1
                        like = False
                        if out["errors"][name] <= 3:
                            print(f"  {name}: HTTP {resp.status_code} {resp.text[:200]}", file=sys.stderr)
                    elif resp.json()["iapo"]["drawn"] != n:  # like with like: every side draws N
                        if name != "serve --learn --log":
                            raise RuntimeError(f"{name} drew {resp.json()['iapo']['drawn']} completions, not {n}")
                        out["other_n"] += 1
                        like = False
                if like:
                    for name in LOG_SIDES:
                        out["lat"][name].append(took[name])
                        out["paired"][name].append(took[name] - took["serve"])

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def log_latency_bench(argv: list[str]) -> None:
    """``--log-latency``: the latency ``serve --log DIR`` and ``serve --learn --log DIR`` add to plain ``serve``, at
    each N (module docstring), in front of one ``iapo-gym simulate`` of a Best-of-N table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--log-latency", action="store_true")
    ap.add_argument("--table", default="generated:bon_flat:1",
                    help="the simulated upstream's table: a generated Best-of-N level, generated:FAMILY:LEVEL")
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 5], help="the policy's N, one run of the three sides each")
    ap.add_argument("--calls", type=int, default=400, help="calls per side and round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds")
    ap.add_argument("--concurrency", type=int, default=1, help="callers, each sending every call to the three sides")
    ap.add_argument("--all-contexts", action="store_true",
                    help="a policy of every objective weighting of the simulator's spec (cost weight 0), the calls "
                         "going to them in turn, instead of one context")
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="bench-serve-log-"))
    up = free_port()
    cli = [sys.executable, "-m", "iapo_gym.cli"]
    spec_path = folder / "sim.json"
    subprocess.run([*cli, "simulate", args.table, "--port", str(up), "--write-spec", str(spec_path)], check=True,
                   cwd=ROOT, capture_output=True)
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    queries = [json.loads(line)["text"] for line in (folder / "sim.queries.jsonl").read_text().splitlines() if line]
    log = _log_file("simulate")
    sim = subprocess.Popen([*cli, "simulate", args.table, "--port", str(up), "--seed", "0", "--max-connections",
                            "1024"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    sim.log_file = log  # type: ignore[attr-defined]
    procs: list[subprocess.Popen[bytes]] = [sim]
    rows: dict[int, dict[str, Any]] = {}
    objectives = tuple(spec["scorer"]["objectives"])
    weightings = sorted({tuple(float(w) for w in c["objective_weights"]) for c in spec["contexts"]}) \
        if args.all_contexts else [(1.0,) + (0.0,) * (len(objectives) - 1)]
    names = [f"c{i}" for i in range(len(weightings))]
    family, level = args.table.split(":")[1:]
    table = level_table(family, int(level))
    assert table.atoms is not None
    # the table's best prompt at each N under the context's weights (exact): the policy serves it, so that the
    # learner's greedy arm stays at N and only its explored arms go elsewhere
    value = bon_weighted_max(table.atoms, table.probs, np.asarray(weightings), max(args.ns), query_mean=True)
    try:
        wait_ready(f"http://127.0.0.1:{up}/health", sim)
        for n in args.ns:
            # n_max = N: the learner's arms are the prompts at N = 1..N; without cost, N is the best of them
            policy = PolicyFile(
                task=spec["task"], aggregator="bon", api="completions", n_max=n, objectives=objectives,
                scorer={**spec["scorer"], "grid": None}, sampling=spec["sampling"],
                prompts=tuple(PolicyPrompt(p["id"], p["template"]) for p in spec["prompts"]),
                contexts=tuple(PolicyContext(name, w, 0.0, 1.0 / len(names),
                                             table.prompts[int(np.argmax(value[c, :, n - 1]))], n)
                               for c, (name, w) in enumerate(zip(names, weightings, strict=True))),
                learned={"agent": "bench"}).save(folder / f"policy-{n}.json")
            extras = ([], ["--log", str(folder / f"log-{n}")], ["--learn", "--log", str(folder / f"learn-log-{n}")])
            ports = [free_port() for _ in LOG_SIDES]
            serves = []
            for port, extra in zip(ports, extras, strict=True):
                serves.append(start_serve(policy, spec_path, port, extra=extra))
                procs.append(serves[-1])
            out: dict[str, Any] = {"lat": {s: [] for s in LOG_SIDES}, "paired": {s: [] for s in LOG_SIDES},
                                   "errors": dict.fromkeys(LOG_SIDES, 0), "other_n": 0}
            cpu0 = [cpu_seconds(p.pid) for p in serves]
            for r in range(args.repeats):
                asyncio.run(_log_latency_round(r, n, ports, queries, args.calls, args.concurrency, out, names))
            cpu = [cpu_seconds(p.pid) - c for p, c in zip(serves, cpu0, strict=True)]
            calls = args.calls * args.repeats
            lat, paired = out["lat"], out["paired"]
            if not lat["serve"]:
                raise RuntimeError(f"no call was served at N = {n} by every side (errors {out['errors']}, the learner "
                                   f"served {out['other_n']} at another N)")
            rows[n] = {name: {"p50_ms": float(np.percentile(lat[name], 50)) * 1000,
                              "p95_ms": float(np.percentile(lat[name], 95)) * 1000,
                              "added_p50_ms": float(np.percentile(lat[name], 50) - np.percentile(lat["serve"], 50)) * 1000,
                              "paired_median_ms": float(np.median(paired[name])) * 1000,
                              "cpu_ms_per_call": cpu[k] / calls * 1000, "errors": out["errors"][name]}
                       for k, name in enumerate(LOG_SIDES)}
            rows[n]["calls_compared"] = len(lat["serve"])
            rows[n]["learner_other_n"] = out["other_n"]
            for p in serves:
                stop(p)
                procs.remove(p)
            rows[n]["logged"] = {"serve --log": sum(1 for _ in read_log(folder / f"log-{n}")[1]),
                                 "serve --learn --log": sum(1 for _ in read_log(folder / f"learn-log-{n}")[1])}
    finally:
        for p in reversed(procs):
            stop(p)
    print(f"the latency --log and --learn add: {args.calls} calls x {args.repeats} rounds per N, each call sent to the "
          f"three sides in a shuffled order, {args.concurrency} caller(s); upstream: iapo-gym simulate {args.table}, a "
          f"Best-of-N policy of {len(names)} context(s) at N (n_max N); {os.cpu_count()} cores shared with other jobs")
    print(f"{'N':>2} {'side':<20} {'p50 ms':>8} {'p95 ms':>8} {'+p50 ms':>8} {'paired ms':>9} {'CPU ms/call':>11} "
          f"{'errors':>6}")
    for n, sides in rows.items():
        for name in LOG_SIDES:
            s = sides[name]
            print(f"{n:>2} {name:<20} {s['p50_ms']:>8.2f} {s['p95_ms']:>8.2f} {s['added_p50_ms']:>+8.2f} "
                  f"{s['paired_median_ms']:>+9.3f} {s['cpu_ms_per_call']:>11.2f} {s['errors']:>6}")
        print(f"   compared: the {sides['calls_compared']} calls every side served at N = {n} (the learner served "
              f"{sides['learner_other_n']} at another N: left out)")
    print(json.dumps({str(n): sides for n, sides in rows.items()}))


if __name__ == "__main__":
    if "--log-latency" in sys.argv:
        log_latency_bench(sys.argv[1:])
    elif "--early-stop" in sys.argv:
        early_stop_bench(sys.argv[1:])
    elif "--ttft" in sys.argv:
        ttft_bench(sys.argv[1:])
    else:
        main()
