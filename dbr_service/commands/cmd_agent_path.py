"""Print the absolute path of the built libdbr_agent.so."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def run(args: argparse.Namespace) -> int:
    del args
    import dbr_agent

    print(dbr_agent.agent_path())
    return 0
