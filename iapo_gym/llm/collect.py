"""Resumable collection: N_max completions per (prompt, query) into a completion log, then the table.

The log (``OUT/<task>.jsonl``) is in the format of ``docs/log-format.md`` with two extra fields,
``key`` ("prompt/query/sample") and ``text``; each line is appended whole and flushed, so a crash
or ``kill -9`` loses at most the in-flight requests (whose answers the response cache usually keeps),
and a rerun skips every key already logged. A bounded pool of workers (one per allowed concurrent
request) takes (prompt, query) groups in order and logs each group as soon as its samples are in,
so the log grows steadily. The table is built by ``iapo_gym.data.build``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from iapo_gym.atomic import atomic_write_text
from iapo_gym.llm.cache import ResponseCache
from iapo_gym.llm.client import BudgetExhausted, Completion, LLMClient
from iapo_gym.llm.loop import gather_all
from iapo_gym.llm.loop import run as run_sync
from iapo_gym.llm.prices import log_costs
from iapo_gym.llm.retry import EndpointUnreachable
from iapo_gym.llm.scoring import make_extractor, make_scorer
from iapo_gym.llm.spec import Query, Spec, SpecError
from iapo_gym.progress import Progress
from iapo_gym.tables import OutcomeTable, write_table

if TYPE_CHECKING:
    from iapo_gym.data.build import ContextSet

#: Seconds between fsyncs of the log (every line is flushed to the OS at once, which a killed process
#: cannot undo; a power failure can lose the last FSYNC_EVERY seconds, which the rerun requests again).
FSYNC_EVERY = 1.0


@dataclass
class CollectResult:
    """What a collect run did: completions logged now and in total, requests, tokens, and the table path."""

    log: Path
    table: Path | None
    new: int
    total: int
    expected: int
    requests: int
    tokens: int
    cached: int
    retries: int
    budget_exhausted: str | None = None
    unreachable: str | None = None  # why the run stopped on an endpoint that does not answer (resumable)
    reward_requests: int = 0
    reward_retries: int = 0
    prompt_tokens: int = 0  # prompt tokens of the completions requested now (cache hits excluded)
    spend: float | None = None  # their price in the spec's currency (None: the spec gives no prices)

    @property
    def complete(self) -> bool:
        """Every (prompt, query, sample) completion is in the log."""
        return self.total == self.expected


def check_plan_fits(spec: Spec, completions: int, plan: str, *, pulls: int | None = None) -> None:
    """Refuse, before anything is sent, a plan of ``completions`` completions that the spec's spending cap cannot hold.

    An upstream that ignores ``n`` (llama.cpp's server does) takes one request per completion, so
    unless ``endpoint.use_n = "yes"`` the plan needs ``completions`` requests (cache hits need fewer,
    retries more); with ``use_n = "yes"`` it needs at least ``pulls`` (default: one per ``n_max``).
    ``plan`` says what the completions are for, in the message.
    """
    cap = spec.budget.max_requests
    if cap is None or completions <= 0:
        return
    if all(e.use_n == "yes" for e in spec.endpoints):
        need = pulls if pulls is not None else -(-completions // spec.n_max)
        how = "at least one request per pull of up to n_max completions (endpoint.use_n = \"yes\")"
    else:
        need = completions
        how = ("one request per completion, as an upstream that ignores n needs (llama.cpp's server does; set "
               "endpoint.use_n = \"yes\" if yours honours n)")
    if need > cap:
        raise SpecError(f"{spec.path}: {plan} needs {need} requests ({how}), but the spending cap "
                        f"budget.max_requests = {cap}; nothing was sent. Raise max_requests to at least {need} "
                        "(a little more leaves room for retries) or plan fewer completions")


def line_key(prompt: str, query: str, sample: int) -> str:
    """The per-line key of completion ``sample`` of (prompt, query) in the log."""
    return f"{prompt}/{query}/{sample}"


def spec_fingerprint(spec: Spec) -> dict[str, Any]:
    """What a resumed log must share with the spec (models, prompts, sampling, scorer, N_max).

    With several endpoints ``model`` lists each endpoint's [id, model]; the arms' ids and texts are in ``prompts``.
    """
    prompts = [[p.id, p.text, [list(m) for m in p.messages]] for p in spec.prompts]
    model: Any = spec.endpoint.model if len(spec.endpoints) == 1 else [[e.id, e.model] for e in spec.endpoints]
    return {"model": model, "api": spec.endpoint.api, "aggregator": spec.aggregator,
            "n_max": spec.n_max, "sampling": spec.sampling.as_dict(),
            "scorer": dataclasses.asdict(spec.scorer),
            "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()}


def read_done(log: Path) -> set[str]:
    """Keys already logged; a last line cut short by a crash is removed from the file."""
    done: set[str] = set()
    if not log.exists():
        return done
    data = log.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):  # an unfinished last line: the process died while writing it
        with log.open("r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    for lineno, line in enumerate(data[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            key = json.loads(line)["key"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SpecError(f"{log}:{lineno}: not a line written by iapo-gym collect; use a new --out folder") from None
        if key in done:
            raise SpecError(f"{log}:{lineno}: key {key!r} appears twice; the log was edited by hand")
        done.add(key)
    return done


class _Progress:
    """The shared ``Progress`` over the completions to log, noting how many came from the cache and are in flight."""

    def __init__(self, total: int, done: int, stream: TextIO | None) -> None:
        self.cached = 0
        self.in_flight: Any = lambda: 0
        self.progress = Progress(total, stream, unit="completions logged", interval=2.0, initial=done) \
            if stream is not None else None

    def _note(self) -> str:
        return f"{self.cached} of them from the cache, {self.in_flight()} in flight"

    def update(self, k: int, cached: int) -> None:
        self.cached += cached
        if self.progress is not None:
            self.progress.update(k, self._note())

    async def tick(self) -> None:
        """Refresh also while nothing is logged (a slow or stalled endpoint)."""
        while True:
            await asyncio.sleep(0.5)
            if self.progress is not None:
                self.progress.update(0, self._note())

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()


class Collector:
    """Collect the spec's completions into ``out`` (resuming what is there), then build the table."""

    def __init__(self, spec: Spec, out: str | os.PathLike[str], *, progress: bool = True,
                 contexts: ContextSet | None = None) -> None:
        """``out`` holds the log, the table, the response cache (unless the spec names one) and a manifest;
        ``contexts``: the table's contexts (``collect --contexts FILE``), else the spec's ``[[contexts]]``, else the
        paper's."""
        self.spec = spec
        self.contexts = contexts
        self.out = Path(out)
        self.log = self.out / f"{spec.task}.jsonl"
        self.table_path = self.out / f"{spec.task}.h5"
        self.cache_path = spec.cache or self.out / "cache.sqlite"
        self.progress = progress
        self.extract = make_extractor(spec.scorer) if spec.aggregator == "mv" else None
        self.score = make_scorer(spec) if spec.aggregator == "bon" else None

    def _check_manifest(self) -> None:
        manifest = self.out / "collect.json"
        mine = json.loads(json.dumps(spec_fingerprint(self.spec)))  # as stored (tuples become lists)
        if manifest.exists():
            theirs = json.loads(manifest.read_text(encoding="utf-8"))
            diff = sorted(k for k in mine if theirs.get(k) != mine[k])
            if diff:
                raise SpecError(f"{self.out} holds a collection made with a different {', '.join(diff)}; "
                                "resume with the same spec or use a new --out folder")
            return
        atomic_write_text(manifest, json.dumps(mine, indent=1, sort_keys=True))

    def run(self) -> CollectResult:
        """Collect what is missing, then build and write the table if every completion is logged."""
        missing = self._missing(read_done(self.log) if self.log.exists() else set())
        check_plan_fits(self.spec, sum(len(s) for _, _, s in missing),
                        f"collecting {sum(len(s) for _, _, s in missing)} missing completions", pulls=len(missing))
        self.out.mkdir(parents=True, exist_ok=True)
        self._check_manifest()
        return run_sync(self._run())  # also from inside a running event loop (a notebook)

    def _missing(self, done: set[str]) -> list[tuple[int, int, list[int]]]:
        """(prompt index, query index, missing sample indices) of every group not yet complete in the log."""
        spec = self.spec
        work: list[tuple[int, int, list[int]]] = []
        for pi, p in enumerate(spec.prompts):
            for qi, q in enumerate(spec.queries):
                missing = [s for s in range(spec.n_max) if line_key(p.id, q.id, s) not in done]
                if missing:
                    work.append((pi, qi, missing))
        return work

    def _line(self, prompt: str, query: Query, sample: int, c: Completion, outcome: Any) -> str:
        rec: dict[str, Any] = {"key": line_key(prompt, query.id, sample), "prompt": prompt, "query": query.id,
                               "sample": sample, "tokens": c.tokens, "prompt_tokens": c.prompt_tokens}
        if self.spec.aggregator == "mv":
            rec["answer"], rec["gold"] = outcome, query.gold
        else:
            rec["scores"] = outcome
        if query.split:
            rec["split"] = query.split
        rec["finish"] = c.finish
        rec["text"] = c.text
        return json.dumps(rec, ensure_ascii=False) + "\n"

    async def outcomes(self, completions: list[Completion], query: Query) -> list[Any]:
        """Extracted answers (mv) or objective scores (bon) of the completions of one query."""
        if self.extract is not None:
            return [self.extract(c.text) for c in completions]
        assert self.score is not None
        return await gather_all(*(self.score(c.text, query.text) for c in completions))

    async def _run(self) -> CollectResult:
        spec = self.spec
        done = read_done(self.log)
        # one list of (prompt, query) groups per endpoint, each worked by that endpoint's own pool of workers
        work: list[list[tuple[int, int, list[int]]]] = [[] for _ in spec.endpoints]
        for group in self._missing(done):
            work[spec.prompts[group[0]].endpoint].append(group)
        expected = len(spec.prompts) * len(spec.queries) * spec.n_max
        stream = sys.stderr if self.progress else None
        progress = _Progress(expected, len(done), stream)
        cache = await asyncio.to_thread(ResponseCache, self.cache_path)  # opening may create and sync the file
        exhausted: list[str] = []
        unreachable: EndpointUnreachable | None = None
        new = cached = prompt_tokens = 0
        spend = 0.0
        synced = [time.monotonic()]
        syncing: list[asyncio.Future[None]] = []
        handle = self.log.open("a", encoding="utf-8")
        # one client per endpoint (its own key, retries and concurrency), all under one spending cap
        clients = [LLMClient(spec.for_endpoint(e), cache) for e in range(len(spec.endpoints))]
        for client in clients[1:]:
            client.cap = clients[0].cap
        requests = tokens = retries = 0
        ticker: asyncio.Task[None] | None = None
        try:
            async with contextlib.AsyncExitStack() as stack:
                for client in clients:
                    await stack.enter_async_context(client)

                async def worker(groups: Any, client: LLMClient) -> None:
                    nonlocal new, cached, prompt_tokens, spend
                    endpoint = client.spec.endpoint
                    for pi, qi, samples in groups:  # shared by the endpoint's workers: each takes the next when free
                        if exhausted:
                            return
                        p, q = spec.prompts[pi], spec.queries[qi]
                        try:
                            comps = await client.complete(p.render(q.text), samples)
                        except BudgetExhausted as exc:
                            exhausted.append(str(exc))
                            return
                        outs = await self.outcomes(comps, q)
                        handle.write("".join(self._line(p.id, q, s, c, o)
                                             for s, c, o in zip(samples, comps, outs, strict=True)))
                        handle.flush()  # in the OS from here on: a killed process loses nothing written
                        if time.monotonic() - synced[0] >= FSYNC_EVERY and not syncing:  # on disk every FSYNC_EVERY s
                            synced[0] = time.monotonic()
                            syncing.append(asyncio.ensure_future(asyncio.to_thread(os.fsync, handle.fileno())))
                            await asyncio.shield(syncing[0])  # a cancelled worker leaves it to the finally below
                            syncing.clear()
                        new += len(comps)
                        hits = sum(c.cached for c in comps)
                        cached += hits
                        sent = [c for c in comps if not c.cached]
                        prompt_tokens += sum(c.prompt_tokens for c in sent)
                        if spec.priced:
                            spend += sum(endpoint.price(c.prompt_tokens, c.tokens) for c in sent)
                        progress.update(len(comps), hits)

                progress.in_flight = lambda: sum(c.in_flight for c in clients)
                if stream is not None:
                    ticker = asyncio.ensure_future(progress.tick())
                tasks: list[asyncio.Future[None]] = []
                for endpoint_work, client in zip(work, clients, strict=True):
                    groups = iter(endpoint_work)
                    tasks += [asyncio.ensure_future(worker(groups, client))
                              for _ in range(min(client.spec.endpoint.concurrency, len(endpoint_work)))]
                try:
                    await asyncio.gather(*tasks)
                except BaseException as exc:  # the first failure stops the run: cancel the rest, then report it
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    if not isinstance(exc, EndpointUnreachable):
                        raise
                    unreachable = exc
                cap = clients[0].cap
                requests, tokens, retries = cap.requests, cap.tokens, sum(c.retries for c in clients)
        finally:
            if ticker is not None:
                ticker.cancel()
            if syncing:  # a cancelled worker's fsync still runs in its thread: let it end before closing
                await asyncio.gather(*syncing, return_exceptions=True)
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            if self.score is not None:
                await self.score.aclose()
            await asyncio.to_thread(cache.close)  # the last commit
            progress.close()
        total = len(done) + new
        table = None
        if total == expected:
            table = self.table_path
            write_table(self.build_table(), table)
        return CollectResult(log=self.log, table=table, new=new, total=total, expected=expected, requests=requests,
                             tokens=tokens, cached=cached, retries=retries,
                             budget_exhausted=exhausted[0] if exhausted else None,
                             unreachable=str(unreachable) if unreachable is not None else None,
                             reward_requests=getattr(self.score, "requests", 0),
                             reward_retries=getattr(self.score, "retries", 0), prompt_tokens=prompt_tokens,
                             spend=spend if spec.priced else None)

    def _canonical_lines(self) -> list[tuple[str, dict[str, Any]]]:
        """The log's lines (with their records) ordered by the spec's prompts, then its queries, then the sample."""
        prompts = {p.id: i for i, p in enumerate(self.spec.prompts)}
        queries = {q.id: i for i, q in enumerate(self.spec.queries)}
        ranked = []
        for lineno, line in enumerate(self.log.read_text(encoding="utf-8").splitlines(keepends=True), start=1):
            if line.strip():
                rec = json.loads(line)
                if rec.get("prompt") not in prompts or rec.get("query") not in queries:
                    raise SpecError(f"{self.log}:{lineno}: prompt {rec.get('prompt')!r}, query {rec.get('query')!r} "
                                    "is not in the spec; resume with the same prompts and queries or use a new "
                                    "--out folder")
                ranked.append(((prompts[rec["prompt"]], queries[rec["query"]], int(rec["sample"])), line, rec))
        ranked.sort(key=lambda item: item[0])
        return [(line, rec) for _, line, rec in ranked]

    def build_table(self) -> OutcomeTable:
        """The table of the finished log, through ``iapo_gym.data.build`` (the one table builder).

        With prices in the spec, an arm's cost is its mean price per completion (prompt and
        completion tokens as used, at its endpoint's prices) and the table's cost unit is the currency.
        """
        from iapo_gym.data.build import ContextSet, build_table, describe_contexts

        spec, b = self.spec, self.spec.build
        options: dict[str, Any] = {"task": spec.task, "n_max": spec.n_max, "cost_scale": b.cost_scale,
                                   "test_fraction": b.test_fraction, "seed": b.seed}
        if spec.aggregator == "mv":
            options["top_k"] = b.top_k
        else:
            options["grid"] = spec.scorer.grid
        lines = self._canonical_lines()
        with tempfile.TemporaryDirectory(dir=self.out, prefix=".build-") as tmp:
            # the builder numbers prompts, queries and tied answers by first appearance; the log's order
            # depends on timing and on where a run was resumed, so build from the lines in the spec's order
            canonical = Path(tmp) / self.log.name
            canonical.write_text("".join(line for line, _ in lines), encoding="utf-8")
            table = build_table(canonical, spec.aggregator, **options)
        models = ", ".join(f"{e.id}: {e.model!r}" for e in spec.endpoints) if len(spec.endpoints) > 1 else \
            repr(spec.endpoint.model)
        attrs = {**table.attrs, "collected": f"iapo-gym collect, model{'s' if len(spec.endpoints) > 1 else ''} "
                                             f"{models} ({spec.endpoint.api} API), sampling "
                                             f"{json.dumps(spec.sampling.as_dict())}"}
        contexts = self.contexts
        if contexts is None and spec.contexts is not None:
            arrays = spec.context_arrays()
            assert arrays is not None
            contexts = ContextSet(*arrays, source=f"the spec's [[contexts]] ({Path(spec.path).name})")
        if contexts is not None:
            if contexts.n_objectives != table.n_objectives:
                where = f"{spec.path}: field 'contexts'" if self.contexts is None else contexts.source
                raise SpecError(f"{where} weighs {contexts.n_objectives} objective(s), the table "
                                f"has {table.n_objectives} {list(table.objective_names)}")
            table = dataclasses.replace(table, context_weights=contexts.weights, context_names=contexts.names,
                                        context_probs=contexts.probs)
            attrs["contexts_source"] = f"{describe_contexts(contexts.weights, contexts.probs)}: {contexts.source}"
        if not spec.priced:
            return dataclasses.replace(table, attrs=attrs)
        cost = log_costs(spec, [rec for _, rec in lines], table.prompts, self.log)
        prices = "; ".join(f"{e.id or e.model}: {e.input_price_per_million:g} input, {e.output_price_per_million:g} "
                           "output" for e in spec.endpoints)
        attrs["cost"] = (f"mean price per completion in {spec.currency}, from the prompt and completion tokens used, "
                         f"at the prices per million tokens {prices}")
        return dataclasses.replace(table, cost=cost, cost_unit=spec.currency, attrs=attrs)


def collect(spec: Spec, out: str | os.PathLike[str], *, progress: bool = True,
            contexts: ContextSet | None = None) -> CollectResult:
    """Collect ``spec`` into ``out`` (resuming), and build the table when complete, with ``contexts`` if given
    (``iapo_gym.data.build.load_contexts``), else the spec's ``[[contexts]]``, else the paper's."""
    return Collector(spec, out, progress=progress, contexts=contexts).run()
