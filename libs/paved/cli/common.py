"""What every `paved` subcommand shares: the error type, argument types and the admin client.

Invariants: the admin key is sent only in the Authorization header and never printed (not in
errors, not in reprs); every request has a 10 s deadline; any failure becomes a CliError whose
message is one line (main prints it and exits 1). Bad input is a usage error (exit 2) found
before any request: every URL (option or environment variable) and the admin key are checked
here, by connect(), and every value put into a URL path is a checked name, percent-encoded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

import httpx

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
TIMEOUT_S = 10.0
# [0-9], not \d: int() also takes other scripts' digits, "1_000" and surrounding spaces.
_DURATION = re.compile(r"([0-9]{1,12})([smhdw]?)")
_INTEGER = re.compile(r"-?[0-9]{1,20}")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_DURATION_S = 10 * 366 * 86400
# A bearer token is sent in an HTTP header: printable ASCII only, and no spaces (a space or a
# control character would be refused by httpx mid-request, or split the header).
_ADMIN_KEY = re.compile(r"[\x21-\x7e]{1,4096}")
# The control plane's model/version/region names and ids (control_plane.store.NAME_RE): starting
# with a letter or digit also keeps "." and ".." out, so a checked name is one URL path segment.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class CliError(Exception):
    """A failure to report as `paved: error: <message>` with exit status 1."""


def duration_s(text: str) -> int:
    """argparse type: "30d", "12h", "90m", "3600s" or "3600" -> seconds (1 s .. 10 years)."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid duration '{text}': use e.g. 30d, 12h, 90m or 3600s")
    seconds = int(match.group(1)) * _UNITS[match.group(2)]
    if not 0 < seconds <= MAX_DURATION_S:
        raise argparse.ArgumentTypeError(f"duration '{text}' must be between 1 s and 10 years")
    return seconds


def _integer(text: str) -> int:
    if _INTEGER.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer")
    return int(text)


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type for a decimal integer in [low, high]."""

    def parse(text: str) -> int:
        value = _integer(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"'{text}' must be between {low} and {high}")
        return value

    parse.__name__ = f"integer in {low}..{high}"
    return parse


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if not 0 <= value <= 2**53:
        raise argparse.ArgumentTypeError(f"'{text}' must be between 0 and 2^53")
    return value


def resource_name(text: str) -> str:
    """argparse type: a model, version or region name, or an id ([A-Za-z0-9][A-Za-z0-9._-]{0,127})."""
    if _NAME.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(
            f"invalid name {text!r}: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit"
        )
    return text


def segment(value: str) -> str:
    """One URL path segment. Values are checked names already; encoding is the second guard."""
    return urllib.parse.quote(value, safe="")


def json_value(text: str) -> Any:
    """json.loads without NaN/Infinity, which JSON lacks (httpx refuses to send them);
    ValueError for anything it refuses, nesting too deep for the parser included."""

    def constant(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    try:
        return json.loads(text, parse_constant=constant)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None


def base_url(text: str) -> str:
    """argparse type: an http(s)://HOST[:PORT][/PATH] base URL (no query or fragment)."""
    url = text.strip().rstrip("/")

    def bad(why: str) -> argparse.ArgumentTypeError:
        return argparse.ArgumentTypeError(f"invalid URL {text!r}: {why}; expected http://HOST:PORT")

    if not url.isascii() or not url.isprintable() or any(c.isspace() for c in url):
        raise bad("spaces, control or non-ASCII characters")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # parses it: a ValueError for "abc" or 65536
    except ValueError as exc:
        raise bad(str(exc)) from None
    if parts.scheme not in ("http", "https"):
        raise bad("the scheme must be http or https")
    if not parts.hostname:
        raise bad("no host")
    if port is not None and not 1 <= port <= 65535:
        raise bad("the port must be 1..65535")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise bad("no query or fragment allowed")
    try:
        httpx.URL(url + "/x")  # what the requests will be built from
    except (httpx.InvalidURL, ValueError) as exc:
        raise bad(str(exc).splitlines()[0] if str(exc) else "not a URL") from None
    return url


def admin_key(text: str) -> str:
    """argparse type for --admin-key; the message never repeats the key."""
    key = text.strip()
    if _ADMIN_KEY.fullmatch(key) is None:
        raise argparse.ArgumentTypeError(_ADMIN_KEY_RULE)
    return key


_ADMIN_KEY_RULE = "the admin key must be 1-4096 printable ASCII characters, without spaces"


def admin_key_option(group: argparse._ArgumentGroup, help_text: str) -> None:
    group.add_argument("--admin-key", type=admin_key, default=None, help=help_text)


def gateway_url_option(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--gateway",
        type=base_url,
        default=None,
        help=f"gateway base URL (env PAVED_GATEWAY_URL, default {DEFAULT_GATEWAY})",
    )


def gateway_options() -> argparse.ArgumentParser:
    """A parent parser with --gateway and --admin-key (added to every leaf command)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("gateway")
    gateway_url_option(group)
    admin_key_option(
        group, "the gateway's admin key; prefer the env var PAVED_ADMIN_KEY (command lines are visible in ps)"
    )
    return parent


def limit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rpm", type=non_negative_int, help="requests per minute (default: no limit)")
    parser.add_argument("--tpm", type=non_negative_int, help="tokens per minute (default: no limit)")
    parser.add_argument(
        "--max-concurrent", type=non_negative_int, help="requests in flight (default: no limit)"
    )


def limits_body(args: argparse.Namespace) -> dict[str, int] | None:
    limits = {
        "requests_per_min": args.rpm,
        "tokens_per_min": args.tpm,
        "max_concurrent": args.max_concurrent,
    }
    given = {k: v for k, v in limits.items() if v is not None}
    return given or None


def connect(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    *,
    url: str | None,
    env: str,
    default: str,
    prefix: str = "/admin/v1",
    service: str = "gateway",
) -> AdminClient:
    """The client for a leaf command: `url` (its URL option, checked by argparse already) or the
    environment variable `env` or `default`, and --admin-key or PAVED_ADMIN_KEY. Anything wrong
    is a usage error naming the variable at fault, before any request."""
    if url is None:
        try:
            url = base_url(os.environ.get(env) or default)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"{env}: {exc}")
    key = args.admin_key
    if key is None:
        raw = os.environ.get("PAVED_ADMIN_KEY") or ""
        if not raw.strip():
            parser.error("no admin key: set PAVED_ADMIN_KEY (or pass --admin-key)")
        try:
            key = admin_key(raw)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"PAVED_ADMIN_KEY: {exc}")
    return AdminClient(url, key, prefix=prefix, service=service)


class AdminClient:
    """An admin API over HTTP: the gateway's /admin/v1 (default) or the control plane's /v1."""

    def __init__(self, gateway: str, admin_key: str, *, prefix: str = "/admin/v1", service: str = "gateway"):
        self.gateway = gateway
        self.prefix = prefix
        self.service = service
        self._headers = {"Authorization": f"Bearer {admin_key}", "Accept": "application/json"}

    @classmethod
    def from_args(cls, args: argparse.Namespace, parser: argparse.ArgumentParser) -> AdminClient:
        return connect(args, parser, url=args.gateway, env="PAVED_GATEWAY_URL", default=DEFAULT_GATEWAY)

    def __repr__(self) -> str:
        return f"AdminClient({self.gateway!r}, <admin key redacted>)"

    def request(
        self, method: str, path: str, *, json: Any = None, params: dict[str, str] | None = None
    ) -> Any:
        url = f"{self.gateway}{self.prefix}{path}"
        try:
            with httpx.Client(timeout=TIMEOUT_S) as client:
                resp = client.request(method, url, json=json, params=params, headers=self._headers)
        except httpx.HTTPError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CliError(f"cannot reach the {self.service} at {self.gateway}: {reason}") from None
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code >= 400:
            message = None
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                message = body["error"].get("message")
            text = " ".join(str(message or resp.reason_phrase or "request failed").split())
            raise CliError(f"{text} (HTTP {resp.status_code})")
        if body is None:
            raise CliError(f"the {self.service} answered HTTP {resp.status_code} without a JSON body")
        return body
