"""The ``iapo-gym`` command line: ``data ...``, ``leaderboard``, ``report``, ``bundle``, ``verify``, ``collect``,
``optimize``, ``serve``, ``simulate``.

Each command group lives in its own module and adds its parser here; exit codes: 0 success,
1 a failure the command reports, 2 bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from iapo_gym._version import __version__

#: Modules that each provide ``add_commands(subparsers)``; parsers set ``func(args) -> int``.
COMMAND_MODULES = ("iapo_gym.data.cli", "iapo_gym.leaderboard.cli", "iapo_gym.llm.cli",
                   "iapo_gym.leaderboard.optimize", "iapo_gym.deploy.cli", "iapo_gym.deploy.simulate_cli")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (command groups that fail to import are skipped)."""
    parser = argparse.ArgumentParser(prog="iapo-gym", description="Inference-aware prompt optimization benchmark.")
    parser.add_argument("--version", action="version", version=f"iapo-gym {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not exc.name or not name.startswith(exc.name):
                raise
            continue
        module.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
