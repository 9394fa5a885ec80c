"""Validation of a batch input file (JSONL), all or nothing, as it streams in.

Each line is `{"custom_id": str, "method": "POST", "url": <endpoint>, "body": {...}}`. The
file is refused (400, the line number and the field named in the message and `param`) unless
every line is valid, the custom_ids are unique, every line names the same url and the same
model, and every body passes the checks the interactive endpoint makes before forwarding
(model known and allowed for the tenant, not a KServe model, max_tokens / n, no streaming,
response_format's shape). Nothing of an invalid file is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from paved.gateway.errors import GatewayError
from paved.gateway.forwarding.proxy import check_openai_body
from paved.http.json_body import MAX_DEPTH, JSONBodyError, parse_json

if TYPE_CHECKING:
    from paved.gateway.routing.router import Router
    from paved.gateway.types import Principal

# url -> the proxy's endpoint name.
ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
MAX_CUSTOM_ID_LEN = 512


@dataclass(frozen=True)
class Limits:
    max_lines: int = 50_000
    max_bytes: int = 200 * 1024 * 1024
    # A single line past this is refused before it is parsed (bounded memory per line).
    max_line_bytes: int = 8 * 1024 * 1024
    # Unfinished batches per tenant: each holds its lines in the database until it ends, and
    # one input file may be batched any number of times.
    max_active_batches: int = 100


@dataclass(frozen=True)
class Summary:
    lines: int
    bytes: int
    url: str | None
    model: str | None


def _bad(line: int, field: str, message: str) -> GatewayError:
    where = f"line {line}" + (f", field {field}" if field else "")
    return GatewayError(
        400, f"invalid batch file: {where}: {message}", param=field or None, code="invalid_batch_file"
    )


def check_response_format(value: Any) -> str | None:
    """Why `response_format` is malformed, or None: the shapes OpenAI accepts."""
    if not isinstance(value, dict):
        return "response_format must be an object"
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        return "response_format.type must be one of: text, json_object, json_schema"
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec.get("name"):
            return "response_format.json_schema must be an object with a name"
        if "schema" in spec and not isinstance(spec["schema"], dict):
            return "response_format.json_schema.schema must be an object"
    return None


def validate_stream(
    src: IO[bytes],
    dest: IO[bytes],
    *,
    principal: Principal,
    router: Router,
    limits: Limits,
    default_max_tokens: int,
) -> Summary:
    """Read JSONL from `src` line by line, copying it to `dest`; GatewayError(400) at the first
    bad line. Memory: one line plus the set of custom_ids (bounded by max_lines)."""
    seen: set[str] = set()
    url: str | None = None
    model: str | None = None
    total = 0
    n = 0
    while True:
        raw = src.readline(limits.max_line_bytes + 1)
        if not raw:
            break
        total += len(raw)
        if total > limits.max_bytes:
            raise GatewayError(
                400,
                f"invalid batch file: larger than {limits.max_bytes} bytes",
                param="file",
                code="invalid_batch_file",
            )
        dest.write(raw)
        if not raw.strip():
            continue
        n += 1
        if n > limits.max_lines:
            raise _bad(n, "", f"a batch file holds at most {limits.max_lines} requests")
        if len(raw) > limits.max_line_bytes:
            raise _bad(n, "", f"a line may be at most {limits.max_line_bytes} bytes")
        try:
            # Nesting bounded (one level more than a request's: the line wraps its body), and no
            # lone surrogate: every line is stored and sent as UTF-8.
            obj = parse_json(raw, MAX_DEPTH + 1, unicode_text=True)
        except JSONBodyError as e:
            raise _bad(n, "", str(e)) from None
        if not isinstance(obj, dict):
            raise _bad(n, "", "each line must be a JSON object")
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_LEN:
            raise _bad(
                n,
                "custom_id",
                f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID_LEN} characters",
            )
        if "\x00" in custom_id:  # a database's text cannot hold it
            raise _bad(n, "custom_id", "custom_id must not contain NUL characters")
        if custom_id in seen:
            raise _bad(n, "custom_id", f"duplicate custom_id '{custom_id}'")
        seen.add(custom_id)
        if obj.get("method") != "POST":
            raise _bad(n, "method", "method must be POST")
        line_url = obj.get("url")
        if not isinstance(line_url, str) or line_url not in ENDPOINTS:
            raise _bad(n, "url", "url must be one of: " + ", ".join(ENDPOINTS))
        if url is None:
            url = line_url
        elif line_url != url:
            raise _bad(n, "url", f"every line of a batch file must name the same url (line 1 names {url})")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise _bad(n, "body", "body must be a JSON object")
        line_model = body.get("model")
        if model is not None and line_model != model:
            raise _bad(n, "body.model", f"every line of a batch file must name the same model ({model})")
        if body.get("stream") is True:
            raise _bad(n, "body.stream", "a batch request cannot be streamed")
        if "response_format" in body and body["response_format"] is not None:
            why = check_response_format(body["response_format"])
            if why is not None:
                raise _bad(n, "body.response_format", why)
        try:
            check_openai_body(principal, router, ENDPOINTS[line_url], body, default_max_tokens)
        except GatewayError as e:
            raise _bad(n, f"body.{e.param}" if e.param else "body", e.message) from None
        model = line_model
    if n == 0:
        raise GatewayError(
            400, "invalid batch file: it holds no requests", param="file", code="invalid_batch_file"
        )
    return Summary(lines=n, bytes=total, url=url, model=model)


def iter_lines(chunks: Any) -> Any:
    """The non-blank lines of a JSONL byte stream given as chunks."""
    rest = b""
    for chunk in chunks:
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if rest.strip():
        yield rest
