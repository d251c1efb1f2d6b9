"""dbr service — the per-host daemon: agent sessions, sampling snapshots, worker pool.

Runs in the foreground (systemd Type=notify: READY=1 once its sockets are bound,
WATCHDOG=1 when WatchdogSec is set).  SIGTERM/SIGINT stop it within 2 s (agents get
BYE; patches kept or reverted per on_shutdown); SIGHUP reloads the configuration
(a bad file keeps the old configuration and is logged).
"""

from __future__ import annotations

import argparse
import logging
import sys

from dbr_service.common.config import DEFAULT_CONFIG_FILE, ConfigSources
from dbr_service.common.errors import ConfigError

EPILOG = """examples:
  dbr service                                   # defaults, /etc/dbr/dbr.toml if present
  dbr service -c ./dbr.toml -o max_workers=2
  DBR_RUNTIME_DIR=/tmp/dbr dbr service --aggressive -o sampling_source=agent-timer
  systemctl start dbr-service                   # see docs/dbr-service.service
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("-c", "--config", metavar="FILE",
                        help=f"TOML configuration file (default: {DEFAULT_CONFIG_FILE} if present)")
    parser.add_argument("-o", dest="overrides", metavar="KEY=VALUE", action="append",
                        default=[], help="set a configuration key (repeatable; wins over all)")
    parser.add_argument("--aggressive", action="store_true",
                        help="preset: short snapshot interval, low thresholds")


def setup_logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, format="dbr[%(process)d] %(levelname)s %(name)s: "
                        "%(message)s")
    logging.getLogger("dbr").setLevel(level.upper())


def run(args: argparse.Namespace) -> int:
    from dbr_service.commands.control import ControlServer
    from dbr_service.common.errors import ServiceError
    from dbr_service.daemon.service import Service

    sources = ConfigSources(file=args.config, overrides=tuple(args.overrides),
                            aggressive=args.aggressive)
    try:
        svc = Service(sources, control_server=ControlServer)
    except ConfigError as exc:
        print(f"dbr service: configuration error: {exc}", file=sys.stderr)
        return 2
    setup_logging(svc.config.log_level)
    try:
        svc.start()
    except ServiceError as exc:
        print(f"dbr service: {exc}", file=sys.stderr)
        return 1
    svc.run()
    return 0
