"""The policy file: Policy.save/load round trip, exact values, schema, checksum and consistency checks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from iapo_gym import IAPOEnv, Policy
from iapo_gym.data import load_task_table
from iapo_gym.deploy import PolicyFileError, Router, describe, load_policy
from iapo_gym.llm.spec import load_spec
from iapo_gym.policyfile import PolicyFile, schema
from tests.deploy_helpers import mv_policy
from tests.llm_server import free_port, write_spec


@pytest.fixture(scope="module")
def env() -> IAPOEnv:
    table = load_task_table("synthetic_bernoulli", instance=0)
    return IAPOEnv(table=table)


def _rewrite(path: Path, edit: object, *, resign: bool) -> Path:
    """Apply ``edit(doc)`` to the file's JSON; ``resign`` recomputes the checksum (a consistent-looking edit)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    edit(doc)  # type: ignore[operator]
    if resign:
        body = {k: v for k, v in doc.items() if k != "sha256"}
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        doc["sha256"] = hashlib.sha256(canonical.encode()).hexdigest()
    out = path.with_name("edited.json")
    out.write_text(json.dumps(doc), encoding="utf-8")
    return out


def test_save_load_round_trip_with_exact_values(env: IAPOEnv, tmp_path: Path) -> None:
    policy = Policy(((3, 5), (0, 2), (7, 1)))
    path = policy.save(tmp_path / "p" / "policy.json", env, learned={"agent": "hand", "budget": 0})
    assert Policy.load(path) == policy
    pf = load_policy(path)
    assert [(pf.prompt(c.prompt).id, c.n) for c in pf.contexts] == [(env.table.prompts[p], n) for p, n in policy.arms]
    assert pf.estimate["method"] == "exact"
    assert pf.estimate["acr"] == pytest.approx(env.evaluate(policy), abs=1e-12)
    best = env.evaluate(env.optimal_policy())
    assert pf.estimate["optimal_acr"] == pytest.approx(best, abs=1e-12)
    assert pf.estimate["regret"] == pytest.approx(best - env.evaluate(policy), abs=1e-12)
    q = env.q_table("test")
    for c, (p, n) in enumerate(policy.arms):
        assert pf.contexts[c].value == q[c, p, n - 1] and pf.contexts[c].optimal == q[c].max()
    assert [c.name for c in pf.contexts] == list(env.table.context_names)
    assert pf.learned == {"agent": "hand", "budget": 0}
    assert pf.scorer is None and pf.api is None and not pf.prompts[0].servable
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    # the file validates against the schema shipped in the package
    import jsonschema

    jsonschema.validate(json.loads(path.read_text(encoding="utf-8")), schema())


def test_tampered_and_malformed_files_are_refused(env: IAPOEnv, tmp_path: Path) -> None:
    path = Policy(((3, 5), (0, 2), (7, 1))).save(tmp_path / "policy.json", env)

    def bump_n(doc: dict) -> None:
        doc["contexts"][0]["n"] = 6

    with pytest.raises(PolicyFileError, match="checksum does not match"):
        Policy.load(_rewrite(path, bump_n, resign=False))
    assert Policy.load(_rewrite(path, bump_n, resign=True)).arms[0] == (3, 6)  # a re-signed edit is a valid file

    def n_too_big(doc: dict) -> None:
        doc["contexts"][1]["n"] = 99

    with pytest.raises(PolicyFileError, match="context 'mid' has N = 99, expected 1..32"):
        load_policy(_rewrite(path, n_too_big, resign=True))

    def unknown_prompt(doc: dict) -> None:
        doc["contexts"][2]["prompt"] = "p99"

    with pytest.raises(PolicyFileError, match="uses prompt 'p99', which is not among the prompts"):
        load_policy(_rewrite(path, unknown_prompt, resign=True))

    def drop_contexts(doc: dict) -> None:
        del doc["contexts"]

    dropped = _rewrite(path, drop_contexts, resign=True)
    with pytest.raises(PolicyFileError) as err:  # the one message format of the three file schemas
        load_policy(dropped)
    assert str(err.value) == f"{dropped}: field 'contexts' is missing"

    def bad_type(doc: dict) -> None:
        doc["contexts"][0]["n"] = "five"

    typed = _rewrite(path, bad_type, resign=True)
    with pytest.raises(PolicyFileError) as err:
        load_policy(typed)
    assert str(err.value) == f"{typed}: field 'contexts[0].n' must be an integer, got 'five'"

    def unknown_field(doc: dict) -> None:
        doc["contexts"][0]["colour"] = "red"

    with pytest.raises(PolicyFileError, match=r"\.json: field 'contexts\[0\]\.colour' is not a known field "
                                              r"\(expected one of cost_weight, n, name, "):
        load_policy(_rewrite(path, unknown_field, resign=True))

    def version(doc: dict) -> None:
        doc["version"] = 3

    with pytest.raises(PolicyFileError, match="version 3 is not supported"):
        load_policy(_rewrite(path, version, resign=True))
    text = path.read_text(encoding="utf-8")
    (tmp_path / "cut.json").write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(PolicyFileError, match="not a valid JSON policy file"):
        load_policy(tmp_path / "cut.json")
    (tmp_path / "nan.json").write_text(text.replace('"cost_weight": -0.2', '"cost_weight": NaN'), encoding="utf-8")
    with pytest.raises(PolicyFileError, match="NaN is not a number JSON allows"):
        load_policy(tmp_path / "nan.json")
    (tmp_path / "other.json").write_text('{"arms": [[0, 1]]}', encoding="utf-8")
    with pytest.raises(PolicyFileError, match="not an iapo-gym policy file"):
        load_policy(tmp_path / "other.json")
    with pytest.raises(PolicyFileError, match="cannot read policy file"):
        load_policy(tmp_path / "missing.json")


def test_inconsistent_documents_are_not_written(tmp_path: Path) -> None:
    good = mv_policy()
    with pytest.raises(PolicyFileError, match="probabilities sum to"):
        PolicyFile(**{**good.__dict__, "contexts": good.contexts[:2]})
    with pytest.raises(PolicyFileError, match="api is 'chat' but the prompts are written for the completions API"):
        PolicyFile(**{**good.__dict__, "api": "chat"})
    assert not list(tmp_path.iterdir())


def test_spec_gives_prompt_texts_and_must_match_the_table(env: IAPOEnv, tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, free_port()))
    with pytest.raises(ValueError, match="are not the table's"):
        describe(((0, 1),) * 3, env, spec=spec)
    # a table without its spec is known by prompt ids only: the router refuses it, saying why
    path = Policy(((3, 5), (0, 2), (7, 1))).save(tmp_path / "ids.json", env)
    with pytest.raises(PolicyFileError, match="no template or messages for prompt.*--spec"):
        Router(path, spec)
    # a servable policy for the tiny spec: prompts and scorer from the spec
    served = mv_policy().save(tmp_path / "ok.json")
    router = Router(served, spec)
    assert router.policy.prompt("plain").template == "Q: {query}\nA:"
