"""`paved templates ...`: prompt templates and tenant prompting through the gateway's admin API.

  paved templates create NAME (--file F.json | [--system TEXT] [--user TEXT]) [--description D]
  paved templates list [NAME] [--json]
  paved templates show NAME[@VERSION] [--json]
  paved templates tenant TENANT [--system-prompt TEXT] [--default-template REF] [--json]

`create` always adds a new version (latest + 1); versions are never changed. F.json holds a list
of {"role", "content"} messages or {"messages": [...], "description": "..."} ("-" reads stdin).
`tenant` without options shows the tenant's prompting; with options it changes only the fields
given (an empty value clears one).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from paved.cli.common import AdminClient, CliError, gateway_options, segment

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_REF = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}(?:@[1-9][0-9]{0,8})?")
_TENANT = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
MAX_FILE_BYTES = 4 * 1024 * 1024


def _template_name(text: str) -> str:
    if _NAME.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"invalid template name '{text}': use [a-z0-9][a-z0-9._-]{{0,63}}")
    return text


def _template_ref(text: str) -> str:
    if _REF.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(
            f"invalid template '{text}': use NAME or NAME@VERSION (e.g. greet@2)"
        )
    return text


def _optional_ref(text: str) -> str:
    return text if text == "" else _template_ref(text)


def _path(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("--file needs a path ('-' for stdin)")
    return text


def _tenant_name(text: str) -> str:
    if _TENANT.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"invalid tenant name '{text}': use [a-z0-9][a-z0-9._-]{{0,62}}")
    return text


def register(commands: argparse._SubParsersAction) -> None:
    common = gateway_options()
    templates = commands.add_parser("templates", help="create and inspect prompt templates, tenant prompting")
    sub = templates.add_subparsers(dest="templates_command", metavar="COMMAND", required=True)

    create = sub.add_parser("create", parents=[common], help="create a template (a new version if it exists)")
    create.add_argument("name", type=_template_name, metavar="NAME")
    create.add_argument("--file", type=_path, metavar="F.json", help="the messages as JSON ('-' for stdin)")
    create.add_argument("--system", metavar="TEXT", help="a system message (Jinja2 source); not with --file")
    create.add_argument("--user", metavar="TEXT", help="a user message (Jinja2 source); not with --file")
    create.add_argument("--description", default=None, help="what the template is for")
    create.set_defaults(run=_create, parser=create)

    list_ = sub.add_parser("list", parents=[common], help="list templates (or every version of one)")
    list_.add_argument("name", type=_template_name, nargs="?", default=None, metavar="NAME")
    list_.add_argument("--json", action="store_true", help="print JSON instead of a table")
    list_.set_defaults(run=_list, parser=list_)

    show = sub.add_parser("show", parents=[common], help="show a template's messages")
    show.add_argument("ref", type=_template_ref, metavar="NAME[@VERSION]")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(run=_show, parser=show)

    tenant = sub.add_parser(
        "tenant", parents=[common], help="show or set a tenant's system prompt and template"
    )
    tenant.add_argument("tenant", type=_tenant_name, metavar="TENANT")
    tenant.add_argument("--system-prompt", default=None, metavar="TEXT", help="literal text ('' clears it)")
    tenant.add_argument(
        "--default-template",
        type=_optional_ref,
        default=None,
        metavar="REF",
        help="NAME[@VERSION] ('' clears it)",
    )
    tenant.add_argument("--json", action="store_true", help="print JSON")
    tenant.set_defaults(run=_tenant, parser=tenant)


def _client(args: argparse.Namespace) -> AdminClient:
    return AdminClient.from_args(args, args.parser)


def _read_file(path: str) -> Any:
    try:
        if path == "-":
            raw = sys.stdin.read(MAX_FILE_BYTES + 1)
        else:
            with Path(path).open(encoding="utf-8") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise CliError(f"{path} is over {MAX_FILE_BYTES // (1024 * 1024)} MiB")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CliError(f"{path} is not valid JSON: {exc}") from None


def _create(args: argparse.Namespace) -> int:
    description = args.description
    inline = args.system is not None or args.user is not None
    if (args.file is None) == (not inline):
        args.parser.error("give --file, or --system and/or --user")
    if args.file is not None:
        loaded = _read_file(args.file)
        if isinstance(loaded, dict) and "messages" in loaded:
            messages = loaded["messages"]
            if description is None and isinstance(loaded.get("description"), str):
                description = loaded["description"]
        elif isinstance(loaded, list):
            messages = loaded
        else:
            raise CliError(f"{args.file} must hold a list of messages or an object with 'messages'")
    else:
        messages = [
            {"role": role, "content": text}
            for role, text in (("system", args.system), ("user", args.user))
            if text is not None
        ]
    body: dict[str, Any] = {"name": args.name, "messages": messages, "description": description or ""}
    created = _client(args).request("POST", "/templates", json=body)
    count = len(created.get("messages", []))
    print(f"Created template {created.get('ref')} ({count} message{'s' if count != 1 else ''}).")
    return 0


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _one_line(text: str, width: int = 60) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def _list(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.name is None:
        data = client.request("GET", "/templates").get("data", [])
    else:
        data = client.request("GET", f"/templates/{segment(args.name)}").get("data", [])
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [
        [t["ref"], str(len(t.get("messages", []))), t["created_at"], _one_line(t.get("description") or "-")]
        for t in data
    ]
    _table(rows, ["TEMPLATE", "MESSAGES", "CREATED", "DESCRIPTION"])
    return 0


def _show(args: argparse.Namespace) -> int:
    client = _client(args)
    name, _, version = args.ref.partition("@")
    if version:
        template = client.request("GET", f"/templates/{segment(name)}/{segment(version)}")
    else:
        versions = client.request("GET", f"/templates/{segment(name)}").get("data", [])
        if not versions:
            raise CliError(f"no prompt template '{name}'")
        template = max(versions, key=lambda t: t["version"])
    if args.json:
        print(json.dumps(template, indent=2))
        return 0
    print(f"{template['ref']}  created {template['created_at']}")
    if template.get("description"):
        print(template["description"])
    for message in template.get("messages", []):
        print(f"--- {message['role']} ---")
        print(message["content"])
    return 0


def _tenant(args: argparse.Namespace) -> int:
    client = _client(args)
    path = f"/tenants/{segment(args.tenant)}/prompting"
    prompting = client.request("GET", path)
    if args.system_prompt is not None or args.default_template is not None:
        body = {
            "system_prompt": prompting.get("system_prompt"),
            "default_template": prompting.get("default_template"),
        }
        if args.system_prompt is not None:
            body["system_prompt"] = args.system_prompt or None
        if args.default_template is not None:
            body["default_template"] = args.default_template or None
        prompting = client.request("PUT", path, json=body)
    if args.json:
        print(json.dumps(prompting, indent=2))
        return 0
    print(f"tenant:           {prompting.get('tenant')}")
    print(f"default template: {prompting.get('default_template') or '-'}")
    system = prompting.get("system_prompt")
    print(f"system prompt:    {_one_line(system, 200) if system else '-'}")
    return 0
