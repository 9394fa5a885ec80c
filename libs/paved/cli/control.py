"""`paved deploy|rollout|audit|gc ...`: the control plane's API over HTTP.

  paved deploy create MODEL VERSION PACKAGE_URI [--strategy red_black|versioned] [--replicas N]
        [--min N --max N] [--region R ...] [--engine sim://...] [--no-gc] [--route JSON]
  paved deploy list [--model M] [--json]        paved deploy scale MODEL VERSION N
  paved deploy current MODEL VERSION            paved deploy delete MODEL VERSION
  paved rollout start MODEL VERSION [--phases 25,50,100] [--interval 30] [--force] [--param k=v ...]
  paved rollout list [--model M] [--json]       paved rollout status ID    paved rollout abort ID
  paved audit [--model M] [--rollout ID] [--json]
  paved gc [--since-created 30d] [--since-traffic 7d] [--min-kept N] [--dry-run]

The control plane is `--control-plane URL` (env PAVED_CONTROL_PLANE_URL, default
http://127.0.0.1:8090); its admin key comes from PAVED_ADMIN_KEY (or --admin-key).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any

from paved.cli.common import (
    AdminClient,
    admin_key_option,
    base_url,
    bounded_int,
    connect,
    duration_s,
    json_value,
    resource_name,
    segment,
)

DEFAULT_CONTROL_PLANE = "http://127.0.0.1:8090"
# The control plane's bounds (control_plane.api), checked here so that they are usage errors.
MAX_REPLICAS = 256
MAX_PHASES = 20
_PERCENT = re.compile(r"[0-9]{1,3}")


def _text(what: str, max_len: int) -> Callable[[str], str]:
    """An argparse type for a non-empty string of at most max_len characters."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{what} must not be empty")
        if len(text) > max_len:
            raise argparse.ArgumentTypeError(f"{what} is over {max_len} characters")
        return text

    parse.__name__ = what
    return parse


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json_value(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("control plane")
    group.add_argument(
        "--control-plane",
        type=base_url,
        default=None,
        help=f"control-plane base URL (env PAVED_CONTROL_PLANE_URL, default {DEFAULT_CONTROL_PLANE})",
    )
    admin_key_option(group, "prefer the env var PAVED_ADMIN_KEY")
    group.add_argument("--json", action="store_true", help="print the API's JSON")
    return parent


def _client(args: argparse.Namespace, parser: argparse.ArgumentParser) -> AdminClient:
    return connect(
        args,
        parser,
        url=args.control_plane,
        env="PAVED_CONTROL_PLANE_URL",
        default=DEFAULT_CONTROL_PLANE,
        prefix="/v1",
        service="control plane",
    )


def _phases(text: str) -> list[int]:
    pieces = [p.strip() for p in text.split(",")]
    if not all(_PERCENT.fullmatch(p) for p in pieces):
        raise argparse.ArgumentTypeError("--phases takes percentages, e.g. 25,50,100")
    phases = [int(p) for p in pieces]
    if (
        not phases
        or len(phases) > MAX_PHASES
        or phases[-1] != 100
        or any(not 0 < p <= 100 for p in phases)
        or phases != sorted(set(phases))
    ):
        raise argparse.ArgumentTypeError(
            f"--phases must rise strictly and end at 100 (at most {MAX_PHASES}), e.g. 25,50,100"
        )
    return phases


def _param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--param {text!r}: expected KEY=VALUE (VALUE as JSON, or a string)")
    try:
        return key, json_value(value)
    except ValueError:
        return key, value


def _print(args: argparse.Namespace, body: Any, lines: list[str]) -> int:
    if args.json:
        print(json.dumps(body, indent=2, sort_keys=True))
    else:
        for line in lines:
            print(line)
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    common = _options()
    deploy = commands.add_parser("deploy", help="register, list, scale and delete deployments")
    dsub = deploy.add_subparsers(dest="deploy_command", metavar="COMMAND", required=True)

    create = dsub.add_parser("create", parents=[common], help="register MODEL@VERSION from a package")
    create.add_argument("model", type=resource_name)
    create.add_argument("version", type=resource_name)
    create.add_argument("package_uri", type=_text("PACKAGE_URI", 2048))
    create.add_argument("--strategy", choices=("red_black", "versioned"), default="red_black")
    create.add_argument("--replicas", type=bounded_int(0, MAX_REPLICAS), default=1)
    create.add_argument("--min", dest="min_replicas", type=bounded_int(0, MAX_REPLICAS), default=1)
    create.add_argument("--max", dest="max_replicas", type=bounded_int(1, MAX_REPLICAS), default=4)
    create.add_argument(
        "--region", action="append", dest="regions", type=resource_name, help="repeatable (default: local)"
    )
    create.add_argument(
        "--engine",
        type=_text("--engine", 1024),
        default="package",
        help="'package' or a sim:// URI (simulated engine)",
    )
    create.add_argument("--no-gc", action="store_true", help="never garbage-collect this version")
    create.add_argument(
        "--route",
        type=_json_object,
        default={},
        help='gateway route options for the alias, e.g. \'{"cache": {"exact": true}}\' (cache, template, '
        "max_model_len, summarizer, summarizer_temperature, tokenizer)",
    )

    def run_create(args: argparse.Namespace) -> int:
        if args.min_replicas > args.max_replicas:
            create.error(f"--min ({args.min_replicas}) is above --max ({args.max_replicas})")
        body = {
            "model_id": args.model,
            "version": args.version,
            "package_uri": args.package_uri,
            "strategy": args.strategy,
            "replicas": args.replicas,
            "min_replicas": args.min_replicas,
            "max_replicas": args.max_replicas,
            "regions": args.regions or ["local"],
            "engine": args.engine,
            "no_gc": args.no_gc,
            "route": args.route,
        }
        d = _client(args, create).request("POST", "/deployments", json=body)
        hint = f"paved rollout start {d['model_id']} {d['version']}"
        return _print(
            args, d, [f"registered {d['model_id']}@{d['version']} ({d['id']}); start it with: {hint}"]
        )

    create.set_defaults(run=run_create)

    listing = dsub.add_parser("list", parents=[common], help="list deployments")
    listing.add_argument("--model", type=resource_name)

    def run_list(args: argparse.Namespace) -> int:
        params = {"model_id": args.model} if args.model else None
        body = _client(args, listing).request("GET", "/deployments", params=params)
        lines = [
            f"{d['model_id']}@{d['version']:12} {d['strategy']:10} {d['state']:9} "
            f"{'current ' if d['current'] else ''}desired={d['desired'] or d['replicas']}"
            for d in body["data"]
        ]
        return _print(args, body, lines or ["no deployments"])

    listing.set_defaults(run=run_list)

    scale = dsub.add_parser(
        "scale", parents=[common], help="set the replicas per region (0 also lowers min_replicas to 0)"
    )
    scale.add_argument("model", type=resource_name)
    scale.add_argument("version", type=resource_name)
    scale.add_argument("replicas", type=bounded_int(0, MAX_REPLICAS))

    def run_scale(args: argparse.Namespace) -> int:
        d = _client(args, scale).request(
            "PATCH",
            f"/deployments/{segment(args.model)}/{segment(args.version)}",
            # Scaling to zero is meant whole: a deployment's min_replicas (1 by default) would
            # refuse it, with no other CLI way to lower it.
            json={"replicas": 0, "min_replicas": 0} if args.replicas == 0 else {"replicas": args.replicas},
        )
        return _print(args, d, [f"{d['model_id']}@{d['version']}: {d['replicas']} replicas per region"])

    scale.set_defaults(run=run_scale)

    current = dsub.add_parser("current", parents=[common], help="versioned: the version the alias follows")
    current.add_argument("model", type=resource_name)
    current.add_argument("version", type=resource_name)

    def run_current(args: argparse.Namespace) -> int:
        d = _client(args, current).request(
            "PUT", f"/models/{segment(args.model)}/current", json={"version": args.version}
        )
        return _print(args, d, [f"{d['model_id']} now follows {d['version']}"])

    current.set_defaults(run=run_current)

    delete = dsub.add_parser(
        "delete", parents=[common], help="delete a deployment that no longer serves (scale it to 0 first)"
    )
    delete.add_argument("model", type=resource_name)
    delete.add_argument("version", type=resource_name)

    def run_delete(args: argparse.Namespace) -> int:
        body = _client(args, delete).request(
            "DELETE", f"/deployments/{segment(args.model)}/{segment(args.version)}"
        )
        return _print(args, body, [f"deleted {args.model}@{args.version}"])

    delete.set_defaults(run=run_delete)

    rollout = commands.add_parser("rollout", help="start, watch and abort rollouts")
    rsub = rollout.add_subparsers(dest="rollout_command", metavar="COMMAND", required=True)
    start = rsub.add_parser("start", parents=[common], help="roll MODEL to VERSION")
    start.add_argument("model", type=resource_name)
    start.add_argument("version", type=resource_name)
    start.add_argument("--phases", type=_phases, help="traffic percentages, e.g. 25,50,100")
    start.add_argument("--interval", type=duration_s, help="time per phase before analysis, e.g. 30s")
    start.add_argument("--force", action="store_true", help="red-black despite an I/O fingerprint change")
    start.add_argument(
        "--param", action="append", type=_param, default=[], help="any rollout parameter KEY=VALUE"
    )

    def run_start(args: argparse.Namespace) -> int:
        params: dict[str, Any] = dict(args.param)
        if args.phases:
            params["phases"] = args.phases
        if args.interval:
            params["interval_s"] = args.interval
        if args.force:
            params["force"] = True
        r = _client(args, start).request(
            "POST", "/rollouts", json={"model_id": args.model, "version": args.version, "params": params}
        )
        moves = f"{r['model_id']} {r['from_version'] or '(none)'} -> {r['to_version']}"
        return _print(args, r, [f"rollout {r['id']}: {moves} ({r['phase']})"])

    start.set_defaults(run=run_start)

    rlist = rsub.add_parser("list", parents=[common], help="list rollouts")
    rlist.add_argument("--model", type=resource_name)

    def run_rlist(args: argparse.Namespace) -> int:
        params = {"model_id": args.model} if args.model else {}
        client = _client(args, rlist)
        body = client.request("GET", "/rollouts", params=params or None)
        # Every page (bounded): the API answers at most 1000 rollouts a request.
        for _ in range(1000):
            if not body.get("has_more"):
                break
            more = client.request("GET", "/rollouts", params={**params, "after": body["data"][-1]["id"]})
            body = {**more, "data": body["data"] + more["data"]}
        lines = [
            f"{r['id']} {r['model_id']} {r['from_version'] or '-'} -> {r['to_version']} "
            f"{r['status']:11} {r['phase']}{' (' + r['reason'] + ')' if r['reason'] else ''}"
            for r in body["data"]
        ]
        return _print(args, body, lines or ["no rollouts"])

    rlist.set_defaults(run=run_rlist)

    for name, method, suffix, helptext in (
        ("status", "GET", "", "a rollout's phase and state"),
        ("abort", "POST", "/abort", "roll back (at the next step)"),
    ):
        leaf = rsub.add_parser(name, parents=[common], help=helptext)
        leaf.add_argument("rollout_id", type=resource_name, metavar="ID")

        def run(
            args: argparse.Namespace, method: str = method, suffix: str = suffix, leaf: Any = leaf
        ) -> int:
            r = _client(args, leaf).request(method, f"/rollouts/{segment(args.rollout_id)}{suffix}")
            return _print(
                args,
                r,
                [
                    f"{r['id']}: {r['status']} in phase {r['phase']}"
                    + (f" ({r['reason']})" if r["reason"] else "")
                ],
            )

        leaf.set_defaults(run=run)

    audit = commands.add_parser("audit", parents=[common], help="the control plane's decisions")
    audit.add_argument("--model", type=resource_name)
    audit.add_argument("--rollout", type=resource_name, metavar="ID")
    audit.add_argument("--limit", type=bounded_int(1, 1000), default=50, help="events, 1..1000")

    def run_audit(args: argparse.Namespace) -> int:
        params = {"limit": str(args.limit)}
        if args.model:
            params["model_id"] = args.model
        if args.rollout:
            params["rollout_id"] = args.rollout
        body = _client(args, audit).request("GET", "/audit", params=params)
        lines = [f"{e['at']} {e['kind']:18} {e['message']}" for e in body["data"]]
        return _print(args, body, lines or ["no events"])

    audit.set_defaults(run=run_audit)

    gc = commands.add_parser("gc", parents=[common], help="garbage-collect inactive versioned deployments")
    gc.add_argument("--since-created", type=duration_s, help="retention since creation, e.g. 30d")
    gc.add_argument("--since-traffic", type=duration_s, help="retention since the last traffic, e.g. 7d")
    gc.add_argument(
        "--min-kept", type=bounded_int(1, 1000), default=2, help="versions kept per model, 1..1000"
    )
    gc.add_argument("--dry-run", action="store_true")

    def run_gc(args: argparse.Namespace) -> int:
        body = {
            "retain_s_since_created": args.since_created,
            "retain_s_since_traffic": args.since_traffic,
            "min_kept": args.min_kept,
            "dry_run": args.dry_run,
        }
        out = _client(args, gc).request("POST", "/gc", json=body)
        verb = "would remove" if out["dry_run"] else "removed"
        lines = [f"{verb} {r['model_id']}@{r['version']}: {r['reason']}" for r in out["removed"]]
        return _print(args, out, lines or ["nothing to collect"])

    gc.set_defaults(run=run_gc)
