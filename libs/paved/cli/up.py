"""`paved up [--engine sim] [--replicas N] [--regions N] ...`: the whole platform on this machine
(paved.platform.up: the control plane, a gateway and the tiny model) until Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse

from paved.platform.up import add_arguments, run


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="run the platform here (control plane, gateway, the tiny model) until Ctrl-C",
        description="The paved platform on this machine: control plane, gateway and the tiny model.",
    )
    add_arguments(p)
    p.set_defaults(run=lambda args: run(args, prog="paved up"))
