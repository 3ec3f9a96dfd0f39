"""``kvq``: a short dispatcher; each subcommand lives in its own module with its own parser and ``main``."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "list": ("kvq.cli.list_cmd", "plugins, methods, backends, and what runs on this machine"),
    "select": ("kvq.cli.select_cmd", "the implementation chosen per op for a shape, and why"),
}


def _usage() -> str:
    lines = ["usage: kvq COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'kvq COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvq`` script. Returns the exit code (2 for usage errors, 1 for bad input)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"kvq: unknown command {name!r}; choose one of {', '.join(COMMANDS)}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return module.main(rest) or 0
    except (ValueError, TypeError) as exc:
        print(f"kvq {name}: error: {exc}", file=sys.stderr)
        return 1
