"""What every `paved` subcommand shares: the error type, argument types and the admin client.

Invariants: the admin key is sent only in the Authorization header and never printed (not in
errors, not in reprs); every request has a 10 s deadline; any failure becomes a CliError whose
message is one line (main prints it and exits 1).
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

import httpx

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
TIMEOUT_S = 10.0
_DURATION = re.compile(r"(\d{1,12})([smhdw]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_DURATION_S = 10 * 366 * 86400


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


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if not 0 <= value <= 2**53:
        raise argparse.ArgumentTypeError(f"'{text}' must be between 0 and 2^53")
    return value


def gateway_url(text: str) -> str:
    url = text.strip().rstrip("/")
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
        raise argparse.ArgumentTypeError(f"invalid gateway URL '{text}': expected http://HOST:PORT")
    return url


def gateway_options() -> argparse.ArgumentParser:
    """A parent parser with --gateway and --admin-key (added to every leaf command)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("gateway")
    group.add_argument(
        "--gateway",
        type=gateway_url,
        default=None,
        help=f"gateway base URL (env PAVED_GATEWAY_URL, default {DEFAULT_GATEWAY})",
    )
    group.add_argument(
        "--admin-key",
        default=None,
        help="the gateway's admin key; prefer the env var PAVED_ADMIN_KEY (command lines are visible in ps)",
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


class AdminClient:
    """An admin API over HTTP: the gateway's /admin/v1 (default) or the control plane's /v1."""

    def __init__(self, gateway: str, admin_key: str, *, prefix: str = "/admin/v1", service: str = "gateway"):
        self.gateway = gateway
        self.prefix = prefix
        self.service = service
        self._headers = {"Authorization": f"Bearer {admin_key}", "Accept": "application/json"}

    @classmethod
    def from_args(cls, args: argparse.Namespace, parser: argparse.ArgumentParser) -> AdminClient:
        gateway = args.gateway
        if gateway is None:
            try:
                gateway = gateway_url(os.environ.get("PAVED_GATEWAY_URL") or DEFAULT_GATEWAY)
            except argparse.ArgumentTypeError as exc:
                parser.error(f"PAVED_GATEWAY_URL: {exc}")
        admin_key = (args.admin_key or os.environ.get("PAVED_ADMIN_KEY") or "").strip()
        if not admin_key:
            parser.error("no admin key: set PAVED_ADMIN_KEY (or pass --admin-key)")
        return cls(gateway, admin_key)

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
