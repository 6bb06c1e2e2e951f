"""The one place where hetplan's commands are registered.

Each command is a module in `hetplan.commands` with HELP, add_arguments(parser) and
main(args) -> int; `args.hetplan` is this module's `main`, for a command that runs others (demo),
so no command imports the registry. Bad input from outside raises `hetplan.planner.files.io.InputError`; it is printed here as
one line on stderr with exit code 2, never as a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from hetplan.planner.files.io import InputError

# name -> module; order is the order of `hetplan --help`
COMMANDS = {
    "profile": "hetplan.commands.profile",
    "graph": "hetplan.commands.graph",
    "simulate": "hetplan.commands.simulate",
    "plan": "hetplan.commands.plan",
    "run": "hetplan.commands.run",
    "compare": "hetplan.commands.compare",
    "explain": "hetplan.commands.explain",
    "demo": "hetplan.commands.demo",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hetplan", description="Simulate, plan and run heterogeneous parallel training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, modname in COMMANDS.items():
        mod = importlib.import_module(modname)
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.add_argument("--json", action="store_true", help="print one JSON object to stdout")
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.hetplan = main
    if getattr(args, "json", False):   # progress as plain lines on stderr, no terminal bars
        from hetplan.planner.files.progress import plain
        plain()
    try:
        return int(args._main(args) or 0)
    except InputError as e:
        line = " ".join(str(e).split())   # one line even where a value or key held a newline
        print(f"hetplan {args.command}: error: {line}", file=sys.stderr)
        if e.detail:
            print(e.detail, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hetplan {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
