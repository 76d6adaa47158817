"""lm-evaluation-harness --log_samples runs built into majority-vote tables: the real `lm-eval` against the
llama.cpp server on 127.0.0.1, and logs in its documented format written here."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from iapo_gym.cli import main
from iapo_gym.data.build import BuildOptions, LogFormatError, answer_text
from iapo_gym.data.lmeval import build_lm_eval_table
from iapo_gym.tables import read_table
from tests.llm_server import llama_server, tiny_model  # noqa: F401  (fixtures)

DATE = "2026-11-25T07-33-54.595167"
TOP_K = 24  # at least 3 variants x 8 samples: every distinct answer keeps its own bucket


def write_run(folder: Path, docs: dict[str, list[dict]], model: str = "m", date: str = DATE) -> Path:
    """A run as lm-eval's EvaluationTracker writes it: results_<date>.json and samples_<task>_<date>.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    results = {"configs": {t: {"task": t, "repeats": 4, "metadata": {"base_url": "http://127.0.0.1:1"}} for t in docs},
               "task_hashes": {t: f"hash-{t}" for t in docs}, "model_name": model,
               "config": {"model": "local-completions"}, "lm_eval_version": "0.4.13"}
    path = folder / f"results_{date}.json"
    path.write_text(json.dumps(results))
    for task, lines in docs.items():
        (folder / f"samples_{task}_{date}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def doc(doc_id: int, target: str, resps: list[str], filtered: object = None, filter_name: str = "f",
        doc_hash: str | None = None) -> dict:
    """One samples line (the fields lm-eval writes that the builder reads)."""
    return {"doc_id": doc_id, "doc": {}, "target": target, "arguments": {}, "resps": [resps],
            "filtered_resps": [resps] if filtered is None else filtered, "filter": filter_name,
            "metrics": ["exact_match"], "doc_hash": doc_hash or f"doc{doc_id}", "exact_match": 0.0}


def test_documented_format_builds_exact_counts(tmp_path: Path) -> None:
    docs = {"v_a": [doc(0, "4", [" 4", "4", "5", ""], filtered=[["4", "4", "5", "[none]"]]),
                    doc(1, "9", ["9", "9", "9", "1"], filtered=[["9", "9", "9", "1"]])],
            "v_b": [doc(0, "4", ["5", "5", "6", "4"], filtered=[["5", "5", "6", "4"]]),
                    doc(1, "9", ["1", "1", "1", "1"], filtered=[["1", "1", "1", "1"]])]}
    results = write_run(tmp_path / "out" / "m", docs)
    table = build_lm_eval_table(tmp_path / "out", BuildOptions(test_fraction=0.0, top_k=2))
    assert table.prompts == ("v_a", "v_b") and table.queries == ("0", "1") and table.attrs["completions"] == 16
    # query 0 over both prompts: "4" x3, "5" x3, "6", "[none]" -> top 2 = "4" (gold, first seen), "5"; other
    np.testing.assert_array_equal(table.probs[:, 0], [[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]])
    # query 1: "1" x5 (most votes), gold "9" x3
    np.testing.assert_array_equal(table.probs[:, 1], [[0.25, 0.75, 0.0], [1.0, 0.0, 0.0]])
    np.testing.assert_array_equal(table.gold, [0, 1])
    raw_len = {"v_a": np.mean([2, 1, 1, 0, 1, 1, 1, 1]), "v_b": 1.0}
    np.testing.assert_allclose(table.cost, [0.01, 0.01 * raw_len["v_b"] / raw_len["v_a"]])
    assert table.attrs["lm_eval_model"] == "m (local-completions)" and table.attrs["lm_eval_results"] == results.name
    tasks = json.loads(table.attrs["lm_eval_tasks"])
    assert tasks["v_a"]["task_hash"] == "hash-v_a" and tasks["v_a"]["filter"] == "f"
    raw = build_lm_eval_table(results, BuildOptions(test_fraction=0.0, top_k=4), answers="raw")
    np.testing.assert_array_equal(raw.probs[0, 0] * 4, [2, 1, 0, 0, 1])  # " 4" and "4" are one answer; "" none


def test_documented_format_refusals(tmp_path: Path) -> None:
    two = write_run(tmp_path / "two", {"t": [doc(0, "1", ["1", "2"], filter_name="a"),
                                            doc(0, "1", ["1", "2"], filtered=[["1", "2"]], filter_name="b")]})
    with pytest.raises(LogFormatError, match=r"logs 2 filters \['a', 'b'\]; choose one with --lm-eval-filter"):
        build_lm_eval_table(two)
    assert build_lm_eval_table(two, BuildOptions(test_fraction=0.0), filter_name="b").attrs["completions"] == 2
    assert build_lm_eval_table(two, BuildOptions(test_fraction=0.0), answers="raw").attrs["completions"] == 2
    first = write_run(tmp_path / "first", {"t": [doc(0, "1", ["1", "2"], filtered=["1"])]})
    with pytest.raises(LogFormatError, match="the filter keeps one answer per document"):
        build_lm_eval_table(first)
    choice = write_run(tmp_path / "mc", {"t": [{**doc(0, "1", ["1"]), "resps": [[["-1.2", "False"]], [["-0.3", "True"]]]}]})
    with pytest.raises(LogFormatError, match="only a generate_until task"):
        build_lm_eval_table(choice)
    other = write_run(tmp_path / "other", {"a": [doc(0, "1", ["1"])], "b": [doc(0, "1", ["1"], doc_hash="x")]})
    with pytest.raises(LogFormatError, match="doc_id 0 of task 'b' is another document"):
        build_lm_eval_table(other)
    write_run(tmp_path / "other", {"a": [doc(0, "1", ["1"])]}, date="2026-11-26T00-00-00.0")
    with pytest.raises(LogFormatError, match="2 lm-eval runs"):
        build_lm_eval_table(tmp_path / "other")
    with pytest.raises(LogFormatError, match=r"no samples of task\(s\) \['c'\]"):
        build_lm_eval_table(other, tasks=["c"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(LogFormatError, match="no lm-eval results_<date>.json"):
        build_lm_eval_table(tmp_path / "empty")


# ---- the real lm-eval --------------------------------------------------------------------------------------

DOCS = [{"question": f"What is {a} plus {b}?", "answer": str(a + b)} for a, b in ((1, 1), (2, 3), (4, 4), (5, 2), (3, 3))]
VARIANTS = ("Q: {{question}}\\nA:", "{{question}} The answer is", "Question: {{question}}\\nAnswer:")


def write_tasks(folder: Path) -> list[str]:
    """Three prompt variants of one tiny generate_until task on a local JSON-lines dataset, repeats 8, a
    per-sample filter (the first non-space character of each response)."""
    folder.mkdir()
    data = folder / "arith.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    names = []
    for i, template in enumerate(VARIANTS):
        name = f"iapo_arith_v{i}"
        (folder / f"{name}.yaml").write_text("\n".join([
            f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {data}",
            "test_split: test", "output_type: generate_until", f'doc_to_text: "{template}"',
            'doc_to_target: "{{answer}}"', "repeats: 8", "generation_kwargs:", '  until: ["\\n"]',
            "  max_gen_toks: 4", "  do_sample: true", "  temperature: 1.5", "  seed: -1",
            "filter_list:", "  - name: first_char", "    filter:", "      - function: regex",
            '        regex_pattern: "(\\\\S)"', "        group_select: 0", '        fallback: "[none]"',
            "metric_list:", "  - metric: exact_match", ""]))
        names.append(name)
    return names


@pytest.fixture(scope="session")
def lm_eval_command() -> str:
    """The `lm-eval` command beside this Python, else on PATH; the test is skipped without it (before any server starts)."""
    here = Path(sys.executable).parent
    found = shutil.which("lm-eval", path=os.pathsep.join([str(here), os.environ.get("PATH", "")]))
    if found is None:
        pytest.skip("lm-eval is not installed (pip install \"iapo-gym[lmeval]\", Python 3.10-3.13)")
    return found


@pytest.mark.heavy
def test_real_lm_eval_run_builds_the_table_of_its_log(lm_eval_command: str, tmp_path: Path,
                                                      llama_server: int,  # noqa: F811
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    command = lm_eval_command
    tasks = write_tasks(tmp_path / "tasks")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI", "HF_"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), TRANSFORMERS_OFFLINE="1")
    model_args = (f"model=tiny,base_url=http://127.0.0.1:{llama_server}/v1/completions,tokenized_requests=False,"
                  "tokenizer_backend=None,num_concurrent=1,max_retries=1")
    run = subprocess.run([command, "--model", "local-completions", "--model_args", model_args, "--tasks", ",".join(tasks),
                          "--include_path", str(tmp_path / "tasks"), "--log_samples", "--output_path",
                          str(tmp_path / "out"), "--seed", "0"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (results,) = (tmp_path / "out").glob("*/results_*.json")
    log = {t: [json.loads(line) for line in next(results.parent.glob(f"samples_{t}_*.jsonl")).read_text().splitlines()]
           for t in tasks}
    out = tmp_path / "arith.h5"
    assert main(["data", "build", str(tmp_path / "out"), "--top-k", str(TOP_K), "--test-fraction", "0",
                 "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: 3 prompts x 5 queries x {TOP_K + 1} atoms (mv), 120 completions"
    table = read_table(out)
    assert table.prompts == tuple(tasks) and table.queries == tuple(str(i) for i in range(5))
    lengths = {}
    for p, task in enumerate(tasks):
        assert [line["doc_id"] for line in log[task]] == list(range(5))
        lengths[task] = np.mean([len(r) for line in log[task] for r in line["resps"][0]])
        for line in log[task]:
            answers = [answer_text(a, "a", "log", allow_null=True) for a in line["filtered_resps"][0]]
            assert len(answers) == 8 and len(line["resps"][0]) == 8
            counts = collections.Counter(answers)
            probs = table.probs[p, line["doc_id"]] * 8
            assert probs[-1] == pytest.approx(counts[None])  # only samples without an answer are "other"
            kept = sorted(round(x) for x in probs[:-1] if x > 0.5)
            assert kept == sorted(n for a, n in counts.items() if a is not None)
            assert probs[table.gold[line["doc_id"]]] == pytest.approx(counts[line["target"]])
            assert line["target"] == DOCS[line["doc_id"]]["answer"]
    mean = np.array([lengths[t] for t in tasks])
    np.testing.assert_allclose(table.cost, 0.01 * mean / mean.max(), rtol=1e-12)
    saved = json.loads(results.read_text())
    provenance = json.loads(table.attrs["lm_eval_tasks"])
    for task in tasks:
        config = {k: v for k, v in saved["configs"][task].items() if k != "metadata"}
        assert provenance[task]["config_sha256"] == hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
        assert provenance[task]["task_hash"] == saved["task_hashes"][task] and provenance[task]["filter"] == "first_char"
    assert table.attrs["lm_eval_model"] == "tiny (local-completions)"
    assert str(llama_server) not in json.dumps(table.attrs)  # the run's model arguments are not copied
