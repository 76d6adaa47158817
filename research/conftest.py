"""pytest setup of the research scripts' tests (``research/tests``), which CI runs with the package's.

The scripts import each other as top-level modules (``from screen_tables import level_table``), as they do when
run as ``python research/NAME.py``. This file has no ``__init__.py`` beside it, so pytest (its default "prepend"
import mode) puts this folder first on ``sys.path`` when it loads it, before it imports any test below it: the
tests import the scripts by the same names. The package tests' isolated cache applies here too.
"""

from tests.conftest import _isolated_cache  # noqa: F401  (an autouse fixture: every test's tables in a temp cache)
