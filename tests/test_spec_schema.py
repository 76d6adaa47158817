"""The collection spec's JSON Schema (iapo_gym/llm/spec.schema.json): one statement of every field's type and range,
messages naming the file and the field, and the rules between fields that the schema cannot state."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from iapo_gym.llm.spec import SpecError, load_spec, schema

QUERIES = [{"id": "q0", "text": "1 + 1 =", "gold": "2"}, {"id": "q1", "text": "2 + 2 =", "gold": "4"}]
BASE: dict[str, Any] = {
    "task": "t", "aggregator": "mv", "n_max": 4,
    "endpoint": {"base_url": "http://127.0.0.1:9/v1", "model": "m"},
    "sampling": {"max_tokens": 8},
    "prompts": [{"id": "p", "template": "Q: {query}"}, {"id": "r", "template": "{query} ->"}],
    "queries": {"path": "q.jsonl"},
    "scorer": {"extractor": "last_number"},
}
TWO = {k: v for k, v in BASE.items() if k != "endpoint"} | {"endpoints": [
    {"id": "small", "base_url": "http://127.0.0.1:9/v1", "model": "s", "api_key_env": "SMALL_KEY",
     "input_price_per_million": 0.1, "output_price_per_million": 0.4},
    {"id": "large", "base_url": "https://api.example.com/v1", "model": "l", "api_key_env": "LARGE_KEY",
     "input_price_per_million": 2.5, "output_price_per_million": 10.0}]}


def write(folder: Path, doc: Any, name: str = "spec.json") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUERIES), encoding="utf-8")
    path = folder / name
    if name.endswith(".json"):
        path.write_text(json.dumps(doc), encoding="utf-8")
    else:
        path.write_text(doc, encoding="utf-8")
    return path


def refused(tmp_path: Path, doc: Any) -> str:
    path = write(tmp_path, doc)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    message = str(err.value)
    assert message.startswith(f"{path}: "), message  # every message names the file first
    return message


def with_value(doc: dict[str, Any], dotted: list[Any], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    node = out
    for part in dotted[:-1]:
        node = node.setdefault(part, {}) if isinstance(part, str) else node[part]
    node[dotted[-1]] = value
    return out


def fields_of(definition: str) -> list[list[Any]]:
    """Every field of the spec whose schema is ``#/$defs/<definition>``, as a path into a document like TWO/BASE."""
    found: list[list[Any]] = []

    def walk(node: Any, path: list[Any]) -> None:
        if not isinstance(node, dict):
            return
        if node.get("$ref") == f"#/$defs/{definition}" and path:
            found.append(path)
        for key, sub in node.get("properties", {}).items():
            walk(sub, [*path, key])
        if isinstance(node.get("items"), dict):
            walk(node["items"], [*path, 0])
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/") and ref != f"#/$defs/{definition}":
            walk(schema()["$defs"][ref.rsplit("/", 1)[1]], path)

    walk(schema(), [])
    return found


def test_the_schema_states_positive_integers_once_and_every_such_field_refuses_bools_zero_and_fractions(
        tmp_path: Path) -> None:
    paths = fields_of("positiveInt")
    names = {".".join(str(p) for p in path) for path in paths}
    assert {"n_max", "endpoints.0.concurrency", "endpoint.concurrency", "sampling.max_tokens", "budget.max_requests",
            "budget.max_tokens_total", "queries.limit", "build.top_k"} <= names
    for path in paths:
        doc = TWO if path[0] == "endpoints" else BASE
        dotted = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        for bad in (True, 0, -3, 1.5, "2"):
            message = refused(tmp_path, with_value(doc, path, bad))
            assert f"field {dotted!r} must be an integer >= 1, got {bad!r}" in message, message
        write(tmp_path, with_value(doc, path, 1))
        assert load_spec(tmp_path / "spec.json") is not None


@pytest.mark.parametrize("path, value, words", [
    (["endpoint", "timeout"], 0, "field 'endpoint.timeout' must be a finite number > 0, got 0"),
    (["endpoint", "timeout"], 10 ** 400, "field 'endpoint.timeout' must be a finite number > 0, got 1000"),
    (["endpoint", "max_retries"], -1, "field 'endpoint.max_retries' must be an integer >= 0, got -1"),
    (["endpoint", "api"], "rest", "field 'endpoint.api' must be one of 'completions' or 'chat', got 'rest'"),
    (["endpoint", "base_url"], "ftp://x", "field 'endpoint.base_url' must be a URL starting with http:// or https://"),
    (["endpoint", "colour"], "red", "field 'endpoint.colour' is not a known field (expected one of api, "),
    (["sampling", "top_p"], 0, "field 'sampling.top_p' must be a number in (0, 1], got 0"),
    (["sampling", "stop"], ["", "x"], "field 'sampling.stop' must be a string or a list of non-empty strings"),
    (["prompts", 1, "template"], "no placeholder", "field 'prompts[1].template' must be a string with the "
                                                   "placeholder {query}, got 'no placeholder'"),
    (["build", "test_fraction"], 1, "field 'build.test_fraction' must be a number in [0, 1), got 1"),
    (["aggregator"], "vote", "field 'aggregator' must be one of 'mv' (majority vote) or 'bon' (Best-of-N)"),
    (["task"], "no spaces", "field 'task' must be letters, digits, '.', '_' or '-', got 'no spaces'"),
])
def test_bad_values_are_refused_naming_the_file_the_field_and_what_was_expected(
        tmp_path: Path, path: list[Any], value: Any, words: str) -> None:
    assert words in refused(tmp_path, with_value(BASE, path, value))


def test_a_missing_field_and_a_non_table_are_named(tmp_path: Path) -> None:
    doc = copy.deepcopy(BASE)
    del doc["endpoint"]["model"]
    assert "field 'endpoint.model' is missing" in refused(tmp_path, doc)
    assert "field 'sampling' must be a table of settings, got [1]" in refused(tmp_path, with_value(BASE, ["sampling"],
                                                                                                   [1]))
    assert "the spec must be a table of settings, got list" in refused(tmp_path, [1, 2])


def test_a_key_given_in_place_of_its_variable_name_is_refused_without_showing_it(tmp_path: Path) -> None:
    message = refused(tmp_path, with_value(BASE, ["endpoint", "api_key_env"], "sk-live-0123456789"))
    assert "field 'endpoint.api_key_env' must be the NAME of an environment variable" in message
    assert "sk-live" not in message


@pytest.mark.parametrize("text", ["n_max = 4\ntemperature = nan", "n_max = inf"])
def test_nan_and_infinity_are_refused_in_toml(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text.replace("temperature = nan", "[sampling]\ntemperature = nan"), name="spec.toml")
    with pytest.raises(SpecError, match=r"must be a finite number, got (nan|inf)"):
        load_spec(path)


def test_endpoints_form_gives_arms_per_endpoint_and_prompt(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, TWO))
    assert [p.id for p in spec.prompts] == ["small/p", "small/r", "large/p", "large/r"]
    assert [p.endpoint for p in spec.prompts] == [0, 0, 1, 1]
    assert [t.id for t in spec.templates] == ["p", "r"]
    assert spec.priced and spec.cost_unit == "USD" and spec.endpoint.id == "small"
    routes = spec.llm_routes({"SMALL_KEY": "a", "LARGE_KEY": "b"})
    assert [(r.origin, r.key_env) for r in routes] == [("http://127.0.0.1:9", "SMALL_KEY"),
                                                       ("https://api.example.com:443", "LARGE_KEY")]
    assert spec.for_endpoint(1).endpoint.model == "l"
    assert spec.endpoints[1].price(1000, 100) == pytest.approx((1000 * 2.5 + 100 * 10.0) / 1e6)


@pytest.mark.parametrize("change, words", [
    (lambda d: d | {"endpoint": BASE["endpoint"]}, "field 'endpoint' or 'endpoints' must be given (exactly one"),
    (lambda d: with_value(d, ["endpoints", 1, "id"], "small"), "field 'endpoints[1].id' repeats endpoint id 'small'"),
    (lambda d: with_value(d, ["endpoints", 1, "id"], "a/b"), "field 'endpoints[1].id' must be the endpoint's id"),
    (lambda d: with_value(d, ["endpoints", 1, "api"], "chat"), "field 'endpoints[1].api' is 'chat', but endpoints[0]"),
    (lambda d: {**d, "endpoints": [{k: v for k, v in d["endpoints"][0].items() if k != "output_price_per_million"},
                                   d["endpoints"][1]]},
     "field 'endpoints[0]' gives no price or half of one"),
    (lambda d: with_value(d, ["endpoints", 1, "input_price_per_million"], -1),
     "field 'endpoints[1].input_price_per_million' must be a finite number >= 0, got -1"),
    (lambda d: d | {"live": {"cost": [0.1, 0.2]}},
     "field 'live.cost' must list one number >= 0 per arm ((endpoint, prompt) pair, 4)"),
    (lambda d: with_value(d, ["endpoints", 0, "id"], 7), "field 'endpoints[0].id' must be the endpoint's id in arm "
                                                         "names: letters, digits, '.', '_' or '-', got 7"),
])
def test_rules_between_fields_of_several_endpoints(tmp_path: Path, change: Any, words: str) -> None:
    assert words in refused(tmp_path, change(copy.deepcopy(TWO)))


def test_currency_without_prices_is_refused_and_defaults_to_usd_with_them(tmp_path: Path) -> None:
    assert "field 'currency' names the unit of the endpoints' prices" in refused(tmp_path, BASE | {"currency": "EUR"})
    assert load_spec(write(tmp_path, TWO | {"currency": "EUR"})).cost_unit == "EUR"
    assert load_spec(write(tmp_path, BASE)).cost_unit is None


def test_the_single_endpoint_form_keeps_its_prompt_ids(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, BASE))
    assert [p.id for p in spec.prompts] == ["p", "r"] and len(spec.endpoints) == 1 and spec.endpoint.id == ""
    assert spec.llm_route({}).why == ("the spec names no endpoint.api_key_env and the endpoint is not the OpenAI "
                                      "API, so OPENAI_API_KEY is not sent")


def test_a_json_spec_may_name_its_schema_for_editors(tmp_path: Path) -> None:
    assert load_spec(write(tmp_path, BASE | {"$schema": "../iapo_gym/llm/spec.schema.json"})).task == "t"


def test_the_example_specs_are_valid() -> None:
    root = Path(__file__).resolve().parent.parent
    for path in sorted((root / "examples").glob("*.toml")):
        assert load_spec(path).prompts


def test_the_two_model_spec_of_docs_collect_md_is_valid_and_has_the_arms_it_names(tmp_path: Path) -> None:
    import re
    import shutil

    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "collect.md").read_text(encoding="utf-8")
    section = doc.split("## Several models as arms", 1)[1]
    text = re.search(r"```toml\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    shutil.copy(root / "examples" / "collect_llamacpp_queries.jsonl", tmp_path / "collect_llamacpp_queries.jsonl")
    (tmp_path / "two.toml").write_text(text, encoding="utf-8")
    spec = load_spec(tmp_path / "two.toml")
    arms = [p.id for p in spec.prompts]
    assert arms == ["small/direct", "small/steps", "large/direct", "large/steps"]
    assert ", ".join(f"`{a}`" for a in arms) in " ".join(section.split())
    routes = spec.llm_routes({"EXAMPLE_API_KEY": "k"})
    assert [r.key_env for r in routes] == [None, "EXAMPLE_API_KEY"] and spec.cost_unit == "USD"


def test_contexts_take_a_cost_weight_or_a_value_of_quality(tmp_path: Path) -> None:
    contexts = [{"name": "cheap", "value_per_quality": 0.002, "probability": 0.25},
                {"name": "dear", "cost_weight": -3, "objective_weights": [2.0], "probability": 0.75}]
    spec = load_spec(write(tmp_path, TWO | {"contexts": contexts}))
    weights, names, probs = spec.context_arrays()  # type: ignore[misc]
    assert names == ("cheap", "dear") and weights.tolist() == [[1.0, -500.0], [2.0, -3.0]]
    assert probs.tolist() == [0.25, 0.75]
    assert load_spec(write(tmp_path, BASE)).context_arrays() is None


@pytest.mark.parametrize("contexts, words", [
    ([{"name": "x", "cost_weight": 0.5}], "field 'contexts[0].cost_weight' must be a finite number <= 0 (the weight"),
    ([{"name": "x"}], "field 'contexts[0].cost_weight' or 'value_per_quality' must be given (exactly one"),
    ([{"name": "x", "cost_weight": -1, "value_per_quality": 1}], "'contexts[0].cost_weight' or 'value_per_quality'"),
    ([{"name": "x", "value_per_quality": 0}], "field 'contexts[0].value_per_quality' must be a finite number > 0"),
    ([{"name": "x", "cost_weight": -1}, {"name": "x", "cost_weight": 0}], "'contexts[1].name' repeats context name"),
    ([{"name": "x", "cost_weight": -1, "objective_weights": [1, 2]}],
     "field 'contexts[0].objective_weights' must list one weight per objective (1), got [1.0, 2.0]"),
    ([{"name": "x", "cost_weight": -1, "probability": 0.4}, {"name": "y", "cost_weight": 0, "probability": 0.4}],
     "field 'contexts' probabilities sum to 0.8"),
    ([{"name": "x", "cost_weight": -1, "probability": 1}, {"name": "y", "cost_weight": 0}],
     "field 'contexts[1].probability' is missing: give a probability for every context or for none"),
])
def test_bad_contexts_are_refused(tmp_path: Path, contexts: list[dict[str, Any]], words: str) -> None:
    assert words in refused(tmp_path, BASE | {"contexts": contexts})


def test_cost_weight_is_minus_one_over_the_value_of_a_unit_of_quality() -> None:
    from iapo_gym.llm.prices import cost_weight

    assert cost_weight(0.01) == -100.0 and cost_weight(4.0) == -0.25
    for bad in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="value_per_quality must be a finite number > 0"):
            cost_weight(bad)  # type: ignore[arg-type]


SETTINGS = {  # a table of the spec -> its dataclass and a value other than the default for every setting
    "endpoint": ("Endpoint", {"api_key_env": "MY_KEY", "api": "chat", "concurrency": 2, "timeout": 7,
                              "max_retries": 1, "backoff": 2, "max_backoff": 9, "use_n": "no",
                              "input_price_per_million": 1, "output_price_per_million": 3}),
    "sampling": ("Sampling", {"temperature": 0, "top_p": 0.5, "seed": 3, "stop": "\n"}),
    "budget": ("Budget", {"max_requests": 10, "max_tokens_total": 99, "price_per_1k_tokens": 2}),
    "build": ("Build", {"top_k": 2, "cost_scale": 1, "test_fraction": 0.5, "seed": 7}),
    "scorer": ("Scorer", {"choices": "ABCD"}),
}


def test_settings_left_out_take_the_dataclass_defaults_and_settings_given_are_read(tmp_path: Path) -> None:
    """The defaults are stated once (the dataclasses of iapo_gym.llm.spec): the parser adds none of its own."""
    import dataclasses

    import iapo_gym.llm.spec as spec_module

    plain = load_spec(write(tmp_path / "plain", BASE))
    doc = copy.deepcopy(BASE)
    doc["prompts"] = [{"id": "p", "messages": [{"role": "user", "content": "{query}"}]}]  # api = "chat"
    for table, (_, values) in SETTINGS.items():
        doc[table] = {**doc.get(table, {}), **values}
    given = load_spec(write(tmp_path / "given", doc))
    for table, (name, values) in SETTINGS.items():
        cls = getattr(spec_module, name)
        before, after = getattr(plain, table), getattr(given, table)
        assert isinstance(before, cls) and isinstance(after, cls)
        for f in dataclasses.fields(cls):
            if f.name in BASE.get(table, {}):
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            assert getattr(before, f.name) == default, (table, f.name)
            if f.name in values:
                want = values[f.name]
                want = (want,) if f.name == "stop" else float(want) if str(f.type).startswith("float") else want
                assert getattr(after, f.name) == want and type(getattr(after, f.name)) is type(want), (table, f.name)
    assert plain.scorer.grid == load_spec(write(tmp_path / "bon", BON)).scorer.grid == spec_module.BuildOptions.grid
    exact = load_spec(write(tmp_path / "exact", with_value(BON, ["scorer", "grid"], False)))
    assert exact.scorer.grid is None


BON = {**BASE, "aggregator": "bon", "scorer": {"callable": "math:fabs", "objectives": ["a"]}}


def _documented_defaults() -> dict[tuple[str, str], str]:
    """(section, field) -> the default column of docs/collect.md's table of the spec's fields."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "collect.md").read_text(encoding="utf-8")
    out: dict[tuple[str, str], str] = {}
    section = ""
    for line in text.split("## The spec (TOML or JSON)")[1].split("\n## ")[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith(("`", "**")):
            continue
        if cells[0].startswith("**"):
            section = cells[0].strip("*`").split("`")[0]
            continue
        names = [n.strip("` ") for n in cells[0].split(",")]
        values = [v.strip() for v in cells[1].split(",")] if len(names) > 1 else [cells[1]]
        values = values * len(names) if len(values) == 1 else values  # one default for several fields
        assert len(values) == len(names), line
        out.update({(section, n): v.strip('`') for n, v in zip(names, values, strict=True)})
    return out


def test_docs_state_the_defaults_the_dataclasses_give() -> None:
    import dataclasses

    import iapo_gym.llm.spec as spec_module

    documented = _documented_defaults()
    sections = {"[endpoint]": "Endpoint", "[sampling]": "Sampling", "[budget]": "Budget", "[build]": "Build",
                "[scorer]": "Scorer"}
    checked = 0
    for section, name in sections.items():
        for f in dataclasses.fields(getattr(spec_module, name)):
            cell = documented.get((section, f.name))
            if cell is None or cell in ("required", "") or f.default is dataclasses.MISSING:
                continue
            default = f.default
            if default is None or default == ():
                assert cell in ("none", "from the scorer"), (section, f.name, cell)
            elif isinstance(default, str):
                assert cell == f'"{default}"', (section, f.name, cell)
            else:
                assert float(cell) == default, (section, f.name, cell)
            checked += 1
    assert checked >= 20  # every documented default of these tables was compared
