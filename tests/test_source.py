"""One env, two completion sources: a table's sampler and any other source behind ``CompletionSource``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import agents
from iapo_gym.env import IAPOEnv
from iapo_gym.source import CompletionSource, TableSource
from iapo_gym.tables import OutcomeTable, TableError, TableSchema
from tests.conftest import tiny_bon_table, tiny_mv_table


def schema_of(table: OutcomeTable) -> TableSchema:
    """The table without its outcome distributions."""
    fields = {f.name: getattr(table, f.name) for f in dataclasses.fields(TableSchema) if f.init}
    return TableSchema(**fields)


class ReplaySource:
    """A source without an exact oracle whose atoms are the next ones of a fixed stream (as an endpoint's would be)."""

    exact = False
    no_exact = "a replayed stream has no exact answer"

    def __init__(self, n_atoms: int) -> None:
        self.stream = np.arange(10_000) % n_atoms
        self.used = 0
        self.restarts = 0

    def draw(self, prompts: np.ndarray, queries: np.ndarray, ns: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        out = self.stream[self.used: self.used + int(ns.sum())]
        self.used += int(ns.sum())
        return out

    def draw_one(self, prompt: int, query: int, n: int, rng: np.random.Generator) -> np.ndarray:
        return self.draw(np.array([prompt]), np.array([query]), np.array([n]), rng)

    def restart(self) -> None:
        self.used = 0
        self.restarts += 1


@pytest.mark.parametrize("make", [tiny_mv_table, tiny_bon_table])
def test_a_schema_has_the_tables_shapes_and_no_probs(make) -> None:
    table = make(0)
    schema = schema_of(table)
    assert not hasattr(schema, "probs") and isinstance(table, TableSchema)
    assert schema.shape == table.shape == table.probs.shape
    assert (schema.n_prompts, schema.n_queries, schema.n_atoms) == (table.n_prompts, table.n_queries, table.n_atoms)
    assert np.array_equal(schema.split_indices("test"), table.split_indices("test"))
    assert np.array_equal(schema.cost_matrix(), table.cost_matrix())


def test_a_schema_is_validated_against_its_shape() -> None:
    fields = {f.name: getattr(schema_of(tiny_mv_table(0)), f.name) for f in dataclasses.fields(TableSchema) if f.init}
    with pytest.raises(TableError, match=r"dataset 'gold' must have shape \(11,\)"):
        TableSchema(**{**fields, "shape": (3, 11, 3), "queries": tuple(f"q{i}" for i in range(11)), "split": None})
    with pytest.raises(TableError, match=r"shape must be \(P, Q, M\) with P, Q, M >= 1, got \(3, 0, 3\)"):
        TableSchema(**{**fields, "shape": (3, 0, 3)})


def test_a_schema_without_a_source_is_refused() -> None:
    with pytest.raises(ValueError, match="TableSchema without outcome distributions needs a completion source"):
        IAPOEnv(table=schema_of(tiny_mv_table(0)))


def test_the_table_source_is_the_default_and_draws_what_the_env_drew_before() -> None:
    table = tiny_bon_table(1)
    env = IAPOEnv(table=table)
    assert isinstance(env.source, TableSource) and isinstance(env.source, CompletionSource)
    assert env.draws_from_table and env.source.exact
    env.reset(seed=5)
    rng = np.random.default_rng()
    rng.bit_generator.state = env.np_random.bit_generator.state
    prompts, ns = np.array([0, 2, 1]), np.array([3, 1, 6])
    pulls = env.pull(prompts, ns)
    pool = env.queries()
    queries = pool[rng.integers(pool.size, size=3)]
    rows = np.repeat(prompts * table.n_queries + queries, ns)
    assert np.array_equal(pulls.queries, queries)
    assert np.array_equal(pulls.atoms, env.sampler.sample(rows, rng))


def test_another_source_serves_pulls_and_the_oracle_says_it_has_no_exact_answer() -> None:
    table = tiny_mv_table(2)
    source = ReplaySource(table.n_atoms)
    env = IAPOEnv(table=schema_of(table), source=source)
    assert not env.draws_from_table
    env.reset(seed=0)
    assert source.restarts == 1
    pulls = env.pull(np.array([0, 1]), np.array([2, 3]))
    assert np.array_equal(pulls.atoms, [0, 1, 2, 0, 1]) and env.budget_used == 5
    query, atoms = env.pull_one(2, 2)
    assert np.array_equal(atoms, [2, 0]) and query in env.queries()
    _, reward, _, _, info = env.step((1, 1))
    assert np.array_equal(info["outcomes"][:, 0], [1]) and env.completions_drawn == 8
    env.reset(seed=0)  # a seeded reset restarts the source
    assert source.used == 0 and source.restarts == 2
    policy = ((0, 1),) * env.n_contexts
    for call in (lambda: env.q_table(), lambda: env.optimal_policy(), lambda: env.evaluate(policy),
                 lambda: env.evaluate_monte_carlo(policy, n_samples=10)):
        with pytest.raises(NotImplementedError, match="a replayed stream has no exact answer"):
            call()
    with pytest.raises(NotImplementedError, match="no outcome distribution to sample"):
        _ = env.sampler


def test_agents_train_on_another_source_through_its_pulls() -> None:
    table = tiny_mv_table(3)
    source = ReplaySource(table.n_atoms)
    env = IAPOEnv(table=schema_of(table), source=source)
    env.reset(seed=1)
    policy = agents.make("ucb", seed=0).train(env, 200)
    assert env.budget_used == 200 == source.used
    assert len(policy.arms) == env.n_contexts
