"""The flags several commands share, declared once (serve, run, explain, doctor)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def terminal_columns() -> int:
    # shutil.get_terminal_size(): $COLUMNS, else the terminal on stdout, else 80.
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno() if sys.__stdout__ else 1)[0]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def add_upstream(p: argparse.ArgumentParser, *, doctor: bool = False) -> None:
    what = "describe chaining through" if doctor else "reach allowed destinations through"
    p.add_argument(
        "--upstream",
        metavar="URL",
        help=f"{what} this proxy: http://HOST:PORT (CONNECT) or socks5://HOST:PORT; every "
        "request is still decided by the policy first (overrides [egress] upstream). "
        "Credentials: EGRESSBOX_UPSTREAM_USER and EGRESSBOX_UPSTREAM_PASSWORD",
    )
    p.add_argument(
        "--upstream-target",
        choices=["address", "name"],
        help="ask the upstream for the checked address (default; pinning holds) or for the "
        "name (the upstream resolves it: pinning: partial)",
    )


def add_ask_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ask-timeout",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="a question not answered within SECONDS denies (default 30)",
    )
    p.add_argument(
        "--save-approved",
        metavar="FILE",
        help="at exit, write the destinations approved when asked as a policy file (allowed "
        "for the session: entries; allowed once: commented out)",
    )


def add_nameserver(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nameserver",
        action="append",
        default=[],
        metavar="IP[:PORT]",
        help="use only this DNS server (repeatable); the hosts file and the system "
        "configuration are then not consulted",
    )
