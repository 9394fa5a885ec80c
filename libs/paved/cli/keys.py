"""`paved keys ...` and `paved tenants ...`: API keys and tenants through the admin API.

  paved keys create --tenant T [--name N] [--expires-in 30d|12h|3600s] [--rpm N --tpm N --max-concurrent N]
  paved keys list [--tenant T] [--json]
  paved keys revoke KEY_ID
  paved tenants create NAME [--models a,b] [--rpm N --tpm N --max-concurrent N]
  paved tenants list [--json]

`keys create` writes the plaintext key alone on stdout (so `KEY=$(paved keys create ...)` works)
and the "will not be shown again" note on stderr; listings show the key's prefix, never a secret.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from paved.cli.common import (
    AdminClient,
    CliError,
    duration_s,
    gateway_options,
    limit_options,
    limits_body,
    segment,
)

_TENANT = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
_KEY_ID = re.compile(r"(?:pvd_)?([a-z2-7]{12})")


def _tenant_name(text: str) -> str:
    if _TENANT.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"invalid tenant name '{text}': use [a-z0-9][a-z0-9._-]{{0,62}}")
    return text


def _key_id(text: str) -> str:
    match = _KEY_ID.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid key id '{text}': expected the 12-character id (or pvd_<id>)"
        )
    return match.group(1)


def _key_name(text: str) -> str:
    # The gateway's MAX_KEY_NAME_LEN; a control character would garble `keys list`'s table.
    if len(text) > 128 or not text.isprintable():
        raise argparse.ArgumentTypeError("--name must be at most 128 printable characters")
    return text


def _models(text: str) -> list[str]:
    models = [m.strip() for m in text.split(",")]
    if not all(models):
        raise argparse.ArgumentTypeError("--models takes a comma-separated list of aliases, e.g. llama,qwen")
    return models


def register(commands: argparse._SubParsersAction) -> None:
    common = gateway_options()

    keys = commands.add_parser("keys", help="create, list and revoke API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", metavar="COMMAND", required=True)

    create = keys_sub.add_parser("create", parents=[common], help="create a key (printed once)")
    create.add_argument("--tenant", required=True, type=_tenant_name, help="the tenant the key belongs to")
    create.add_argument("--name", type=_key_name, default="", help="a label for the key")
    create.add_argument(
        "--expires-in",
        type=duration_s,
        default=None,
        metavar="DURATION",
        help="expiry, e.g. 30d, 12h, 90m, 3600s (default: never)",
    )
    limit_options(create)
    create.set_defaults(run=_keys_create, parser=create)

    list_ = keys_sub.add_parser("list", parents=[common], help="list keys (prefixes, never secrets)")
    list_.add_argument("--tenant", type=_tenant_name, default=None)
    list_.add_argument("--json", action="store_true", help="print JSON instead of a table")
    list_.set_defaults(run=_keys_list, parser=list_)

    revoke = keys_sub.add_parser("revoke", parents=[common], help="revoke a key")
    revoke.add_argument("key_id", type=_key_id, metavar="KEY_ID")
    revoke.set_defaults(run=_keys_revoke, parser=revoke)

    tenants = commands.add_parser("tenants", help="create and list tenants")
    tenants_sub = tenants.add_subparsers(dest="tenants_command", metavar="COMMAND", required=True)

    t_create = tenants_sub.add_parser("create", parents=[common], help="create a tenant")
    t_create.add_argument("name", type=_tenant_name, metavar="NAME")
    t_create.add_argument(
        "--models", type=_models, default=None, help="allowed model aliases, comma-separated (default: all)"
    )
    limit_options(t_create)
    t_create.set_defaults(run=_tenants_create, parser=t_create)

    t_list = tenants_sub.add_parser("list", parents=[common], help="list tenants")
    t_list.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t_list.set_defaults(run=_tenants_list, parser=t_list)


def _client(args: argparse.Namespace) -> AdminClient:
    return AdminClient.from_args(args, args.parser)


def _keys_create(args: argparse.Namespace) -> int:
    client = _client(args)
    body: dict[str, Any] = {"tenant": args.tenant, "name": args.name}
    if args.expires_in is not None:
        body["expires_in_s"] = args.expires_in
    limits = limits_body(args)
    if limits is not None:
        body["limits"] = limits
    created = client.request("POST", "/keys", json=body)
    key = created.get("key") if isinstance(created, dict) else None
    if not isinstance(key, str):
        raise CliError("the gateway's answer carried no key")
    print(key)
    expiry = f", expires {created['expires_at']}" if created.get("expires_at") else ""
    print(
        f"Created key {created.get('prefix')} for tenant {created.get('tenant')}{expiry}. "
        "Store it now: it will not be shown again.",
        file=sys.stderr,
    )
    return 0


def _status(key: dict[str, Any]) -> str:
    if key.get("revoked_at"):
        return "revoked"
    return "active" if not key.get("expires_at") else f"expires {key['expires_at']}"


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _limit(value: Any) -> str:
    return "-" if value is None else str(value)


def _keys_list(args: argparse.Namespace) -> int:
    params = {"tenant": args.tenant} if args.tenant else None
    data = _client(args).request("GET", "/keys", params=params).get("data", [])
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [[k["prefix"], k["tenant"], k.get("name") or "-", k["created_at"], _status(k)] for k in data]
    _table(rows, ["PREFIX", "TENANT", "NAME", "CREATED", "STATUS"])
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    key = _client(args).request("POST", f"/keys/{segment(args.key_id)}/revoke")
    print(f"Revoked key {key.get('prefix')} (tenant {key.get('tenant')}) at {key.get('revoked_at')}.")
    return 0


def _tenants_create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name}
    if args.models is not None:
        body["models"] = args.models
    limits = limits_body(args)
    if limits is not None:
        body["limits"] = limits
    tenant = _client(args).request("POST", "/tenants", json=body)
    print(f"Created tenant {tenant.get('name')} (models: {','.join(tenant.get('models', []))}).")
    return 0


def _tenants_list(args: argparse.Namespace) -> int:
    data = _client(args).request("GET", "/tenants").get("data", [])
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [
        [
            t["name"],
            ",".join(t.get("models", [])),
            _limit(t["limits"].get("requests_per_min")),
            _limit(t["limits"].get("tokens_per_min")),
            _limit(t["limits"].get("max_concurrent")),
        ]
        for t in data
    ]
    _table(rows, ["NAME", "MODELS", "RPM", "TPM", "MAX_CONCURRENT"])
    return 0
