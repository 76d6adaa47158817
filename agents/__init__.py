"""Agents for IAPO: PSST, Top-K screening and the paper's baselines behind one interface.

``agents.make(name, **params)`` builds one; ``agents.available()`` names them. Any object
with ``train(env, budget) -> policy`` is an agent too (see ``examples/custom_agent.py``).
"""

from agents.base import REGISTRY, Agent, AgentLike, AnytimeAgent, available, make, register, register_entry_points

# One module per agent family; variants are the same class with other defaults.
register("psst", "agents.psst:PSST")
register("psst_topk", "agents.psst:PSSTTopK")
register("psst_rb", "agents.psst:PSST", reuse="all_subsets")
register("psst_rb_topk", "agents.psst:PSSTTopK", reuse="all_subsets")
register("uniform", "agents.baselines:Uniform")
register("epsilon_greedy", "agents.baselines:EpsilonGreedy")
register("softmax", "agents.baselines:Softmax")
register("ucb", "agents.baselines:UCB")
register("random", "agents.baselines:RandomAgent")
register("triple_n1", "agents.triple:Triple", n_mode="one")
register("triple_random_n", "agents.triple:Triple", n_mode="random")
register("sequential_halving", "agents.sequential_halving:SequentialHalving")
register("sb3", "agents.sb3:SB3Agent")
register("plugin_halving", "agents.plugin:PlugInHalving")
register("plugin_anytime", "agents.plugin:AnytimePlugIn")
#: The recommended agent: the strongest measured one (docs/agents.md, "auto").
register("auto", "agents.plugin:Auto")
register_entry_points()  # third-party agents (entry-point group ``iapo_gym.agents``)

__all__ = ["REGISTRY", "Agent", "AgentLike", "AnytimeAgent", "available", "make", "register"]
