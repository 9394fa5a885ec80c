"""`paved batches ...`: OpenAI batches through the gateway, with a tenant's API key.

  paved batches create FILE.jsonl [--endpoint /v1/chat/completions] [--metadata k=v ...]
                       [--cache off|write|refresh] [--wait]
  paved batches list [--limit N] [--after ID] [--json]
  paved batches get BATCH_ID [--json]
  paved batches cancel BATCH_ID
  paved batches download BATCH_ID [--output PATH] [--errors PATH]

The key comes from --api-key or $PAVED_API_KEY (or $OPENAI_API_KEY), the gateway from --gateway
or $PAVED_GATEWAY_URL. `create` prints the batch id alone on stdout; with --wait it then shows a
progress bar on stderr until the batch ends (exit 1 unless it completed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from paved.cli.common import DEFAULT_GATEWAY, CliError, base_url, gateway_url_option, segment

_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
_TERMINAL = ("completed", "failed", "expired", "cancelled")
_TIMEOUT_S = 60.0
# Sent in a header: printable ASCII without spaces. Anything else made httpx fail mid-request,
# with the header (the key) in its message or as a UnicodeEncodeError traceback.
_API_KEY = re.compile(r"[\x21-\x7e]{1,4096}")


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--metadata takes KEY=VALUE, got '{text}'")
    return key, value


def _poll_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.05 <= value <= 3600:  # nan fails this too; time.sleep refused a negative one
        raise argparse.ArgumentTypeError(f"--poll {text!r:.40}: seconds in 0.05..3600")
    return value


def _options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("gateway")
    gateway_url_option(group)
    group.add_argument("--api-key", default=None, help="a tenant's API key; prefer the env var PAVED_API_KEY")
    return parent


def register(commands: argparse._SubParsersAction) -> None:
    common = _options()
    batches = commands.add_parser("batches", help="submit and follow OpenAI batches")
    sub = batches.add_subparsers(dest="batches_command", metavar="COMMAND", required=True)

    create = sub.add_parser("create", parents=[common], help="upload a JSONL file and start a batch")
    create.add_argument("file", type=Path, metavar="FILE")
    create.add_argument(
        "--endpoint", choices=_ENDPOINTS, default=None, help="default: the url of the file's lines"
    )
    create.add_argument("--metadata", type=_pair, action="append", default=[], metavar="KEY=VALUE")
    create.add_argument(
        "--cache", choices=("off", "write", "refresh"), default=None, help="metadata paved_cache"
    )
    create.add_argument(
        "--wait", action="store_true", help="follow the batch with a progress bar until it ends"
    )
    create.add_argument("--poll", type=_poll_s, default=1.0, help=argparse.SUPPRESS)
    create.set_defaults(run=_create, parser=create)

    list_ = sub.add_parser("list", parents=[common], help="the tenant's batches, newest first")
    list_.add_argument("--limit", type=int, default=20)
    list_.add_argument("--after", default=None, help="the last id of the previous page")
    list_.add_argument("--json", action="store_true")
    list_.set_defaults(run=_list, parser=list_)

    get = sub.add_parser("get", parents=[common], help="one batch")
    get.add_argument("batch_id", metavar="BATCH_ID")
    get.add_argument("--json", action="store_true")
    get.set_defaults(run=_get, parser=get)

    cancel = sub.add_parser("cancel", parents=[common], help="cancel a batch (finished lines are kept)")
    cancel.add_argument("batch_id", metavar="BATCH_ID")
    cancel.set_defaults(run=_cancel, parser=cancel)

    download = sub.add_parser("download", parents=[common], help="write a batch's output (and errors)")
    download.add_argument("batch_id", metavar="BATCH_ID")
    download.add_argument("--output", type=Path, default=None, help="default: BATCH_ID_output.jsonl")
    download.add_argument("--errors", type=Path, default=None, help="default: BATCH_ID_errors.jsonl")
    download.set_defaults(run=_download, parser=download)


class _Client:
    def __init__(self, args: argparse.Namespace):
        url = args.gateway
        if url is None:
            try:
                url = base_url(os.environ.get("PAVED_GATEWAY_URL") or DEFAULT_GATEWAY)
            except argparse.ArgumentTypeError as exc:
                args.parser.error(f"PAVED_GATEWAY_URL: {exc}")
        key = str(args.api_key or os.environ.get("PAVED_API_KEY") or os.environ.get("OPENAI_API_KEY") or "")
        if not key.strip():
            args.parser.error("no API key: set PAVED_API_KEY (or pass --api-key)")
        if _API_KEY.fullmatch(key.strip()) is None:
            # The message never repeats the key.
            args.parser.error("the API key must be 1-4096 printable ASCII characters, without spaces")
        self.url = url
        self.headers = {"Authorization": f"Bearer {key.strip()}"}

    def call(self, method: str, path: str, *, raw: bool = False, **kwargs: Any) -> Any:
        try:
            with httpx.Client(timeout=_TIMEOUT_S) as client:
                resp = client.request(method, self.url + path, headers=self.headers, **kwargs)
        except httpx.HTTPError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CliError(f"cannot reach the gateway at {self.url}: {reason}") from None
        if resp.status_code >= 400:
            message = None
            with contextlib.suppress(ValueError, KeyError, TypeError):
                message = resp.json()["error"]["message"]
            raise CliError(f"{message or resp.reason_phrase} (HTTP {resp.status_code})")
        if raw:
            return resp.content
        try:
            return resp.json()
        except ValueError:
            raise CliError(f"the gateway answered HTTP {resp.status_code} without a JSON body") from None


def _endpoint_of(path: Path) -> str:
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                try:
                    url = json.loads(line).get("url")
                except (ValueError, AttributeError):
                    break
                if url in _ENDPOINTS:
                    return str(url)
                break
    raise CliError(f"cannot tell the endpoint from the first line of {path}: pass --endpoint")


def _create(args: argparse.Namespace) -> int:
    client = _Client(args)
    if not args.file.is_file():
        args.parser.error(f"no such file: {args.file}")
    endpoint = args.endpoint or _endpoint_of(args.file)
    with args.file.open("rb") as f:
        uploaded = client.call(
            "POST", "/v1/files", data={"purpose": "batch"}, files={"file": (args.file.name, f)}
        )
    metadata = dict(args.metadata)
    if args.cache is not None:
        metadata["paved_cache"] = args.cache
    body: dict[str, Any] = {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h"}
    if metadata:
        body["metadata"] = metadata
    batch = client.call("POST", "/v1/batches", json=body)
    print(batch["id"], flush=True)
    if not args.wait:
        return 0
    while batch["status"] not in _TERMINAL:
        _progress(batch)
        time.sleep(args.poll)
        batch = client.call("GET", f"/v1/batches/{segment(batch['id'])}")
    _progress(batch)
    print(file=sys.stderr)
    return 0 if batch["status"] == "completed" else 1


def _progress(batch: dict[str, Any], width: int = 30) -> None:
    counts = batch["request_counts"]
    total = max(1, counts["total"])
    done = counts["completed"] + counts["failed"]
    filled = int(width * done / total)
    bar = "#" * filled + "." * (width - filled)
    print(
        f"\r[{bar}] {done}/{counts['total']} ({counts['failed']} failed) {batch['status']}",
        end="",
        file=sys.stderr,
        flush=True,
    )


def _list(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"limit": args.limit}
    if args.after:
        params["after"] = args.after
    page = _Client(args).call("GET", "/v1/batches", params=params)
    if args.json:
        print(json.dumps(page, indent=2))
        return 0
    for b in page["data"]:
        c = b["request_counts"]
        print(
            f"{b['id']}  {b['status']:<11} {c['completed']}/{c['total']} done, "
            f"{c['failed']} failed  {b['endpoint']}"
        )
    return 0


def _get(args: argparse.Namespace) -> int:
    batch = _Client(args).call("GET", f"/v1/batches/{segment(args.batch_id)}")
    if args.json:
        print(json.dumps(batch, indent=2))
    else:
        c = batch["request_counts"]
        print(f"{batch['id']}: {batch['status']}, {c['completed']}/{c['total']} done, {c['failed']} failed")
        print(f"output file: {batch['output_file_id'] or '-'}, error file: {batch['error_file_id'] or '-'}")
    return 0


def _cancel(args: argparse.Namespace) -> int:
    batch = _Client(args).call("POST", f"/v1/batches/{segment(args.batch_id)}/cancel")
    print(f"{batch['id']}: {batch['status']}")
    return 0


def _download(args: argparse.Namespace) -> int:
    client = _Client(args)
    batch = client.call("GET", f"/v1/batches/{segment(args.batch_id)}")
    if batch["status"] not in _TERMINAL:
        raise CliError(f"batch {batch['id']} is {batch['status']}: its files exist once it ends")
    targets = (
        (batch["output_file_id"], args.output or Path(f"{batch['id']}_output.jsonl")),
        (batch["error_file_id"], args.errors or Path(f"{batch['id']}_errors.jsonl")),
    )
    for file_id, path in targets:
        if file_id is None:
            continue
        path.write_bytes(client.call("GET", f"/v1/files/{segment(file_id)}/content", raw=True))
        print(path)
    return 0
