"""`paved` entry point: `main(argv) -> exit status`, dispatching to registered subcommands.

Exit status: 0 success, 2 usage error (argparse), 1 API or connection error (one line on
stderr: `paved: error: <message>`). A new command group (e.g. `paved deploy`) is a module with
`register(subparsers)` that sets `run=<fn(args) -> int>` on its leaf parsers, appended to
COMMANDS.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from paved.cli import batches, control, keys, render, templates, up
from paved.cli.common import CliError

# The subcommand registry: each entry adds its command group(s) to the top-level subparsers.
COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    keys.register,
    control.register,
    templates.register,
    up.register,
    render.register,
    batches.register,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paved", description="paved platform command line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.run(args))
    except SystemExit as exc:
        # argparse exits 2 on usage errors (0 for --help); returned, so callers in-process
        # (tests, wrappers) get the status instead of an exception.
        return exc.code if isinstance(exc.code, int) else 2
    except CliError as exc:
        print(f"paved: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
