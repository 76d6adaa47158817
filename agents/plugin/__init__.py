"""The plug-in agents: prompts compared on common train queries, Q read off per-(prompt, query) distributions.

* ``anytime.AnytimePlugIn`` (``plugin_anytime``, the recommended ``auto``): elimination paced by the
  completions spent, one trajectory for every budget, each budget ending in successive halving;
* ``halving.PlugInHalving`` (``plugin_halving``): successive halving for one known budget;
* ``estimator.PlugInEstimator``: the estimate both read (majority vote and Best-of-N).
"""

from agents.plugin.anytime import AnytimePlugIn
from agents.plugin.auto import Auto
from agents.plugin.estimator import PlugInEstimator
from agents.plugin.halving import PlugInHalving

__all__ = ["AnytimePlugIn", "Auto", "PlugInEstimator", "PlugInHalving"]
