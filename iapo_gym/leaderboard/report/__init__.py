"""Reporting a results folder: statistics (``stats``), the report's data (``model``) and its writers
(``write``: Markdown, CSV, JSON; ``plots``; ``html``: the static site)."""

#: The paired tests and multiplicity corrections ``stats`` implements, and the default significance level
#: (here, not in ``stats``, so that the command line offers them without importing scipy).
TESTS = ("wilcoxon", "sign")
CORRECTIONS = ("holm", "bh", "none")
DEFAULT_ALPHA = 0.05
