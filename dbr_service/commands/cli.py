"""`dbr` command line: one subcommand per module, registered in COMMANDS.

Each command module defines ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# name -> (module, one-line help).  Order is the order shown in --help.
COMMANDS: list[tuple[str, str, str]] = [
    ("run", "dbr_service.commands.cmd_run", "run PROG under dbr and report what it did"),
    ("service", "dbr_service.commands.cmd_service",
     "the per-host daemon (foreground, Type=notify)"),
    ("ctl", "dbr_service.commands.cmd_ctl", "talk to a running service's control socket"),
    ("attach", "dbr_service.commands.cmd_attach", "load the agent into a running process (ptrace)"),
    ("detach", "dbr_service.commands.cmd_detach",
     "remove a client's patches; its agent goes dormant"),
    ("profile", "dbr_service.commands.cmd_profile",
     "the profile store: list, show, forget, export, import"),
    ("analyze", "dbr_service.region.analyze", "offline region selection on an ELF file"),
    ("agent-path", "dbr_service.commands.cmd_agent_path", "print the path of libdbr_agent.so"),
]


def pid_arg(text: str) -> int:
    """argparse type of a PID argument, as every command that takes one checks it."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a pid") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a pid")
    return v


def _base_parser() -> argparse.ArgumentParser:
    import dbr_service

    p = argparse.ArgumentParser(
        prog="dbr", description="dbr — sampling-driven dynamic binary rewriter for x86-64 Linux",
        epilog="examples:\n  dbr run --aggressive -- ./prog arg\n  dbr ctl status\n"
               "  dbr analyze ./prog --samples perf.data",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"dbr {dbr_service.__version__}")
    return p


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every command (``only``: just that one's module is imported, so
    `dbr run` does not pay for importing the region and codegen code before PROG starts)."""
    parser = _base_parser()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, modname, help_text in COMMANDS:
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        mod = importlib.import_module(modname)
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = {name for name, _m, _h in COMMANDS}
    # The command is the first word that is not an option (dbr has no global options
    # taking values); import only its module.
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first in names else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:
        # the reader went away (`dbr ctl --json clients | head`): what it did not read
        # goes nowhere, quietly, and the status says a pipe broke, as for other tools
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
