"""Request bodies decoded (JSON parse and pydantic validation) off the event loop when large
(paved.http.off_loop): a 30 MB body of token ids takes seconds of parse, the Unicode walk and
validation. The schema's size bounds (paved.frontend.schemas) refuse what could never fit before
the O(body) walks.
"""

from __future__ import annotations

import email.message
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from paved.frontend.errors import APIError
from paved.http.json_body import JSONBodyError, parse_json
from paved.http.off_loop import off_loop_if_large


def decode_model(raw: bytes, model: type[pydantic.BaseModel]) -> pydantic.BaseModel:
    """`raw` parsed (nesting bounded) and validated as `model`; APIError 400 or
    RequestValidationError (answered as a 400 naming the field) if it is not one."""
    try:
        value = parse_json(raw)
    except JSONBodyError as e:
        raise APIError(400, f"the request body is {e}") from None
    try:
        return model.model_validate(value)
    except pydantic.ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_input=False), body=value) from None


class _Decoded(Request):
    """The request with its body already read, and its JSON already validated as the route's
    body model: FastAPI's own validation of a model instance returns it as it is."""

    def __init__(self, request: Request, raw: bytes, decoded: pydantic.BaseModel):
        super().__init__(request.scope, request.receive)
        self._body = raw  # Starlette's body cache (as in FastAPI's custom-request recipe)
        self._decoded = decoded

    async def json(self) -> Any:
        return self._decoded


def _is_json(request: Request) -> bool:
    message = email.message.Message()
    message["content-type"] = request.headers.get("content-type", "")
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


class OffLoopBodyRoute(APIRoute):
    """A route whose pydantic body is parsed (nesting bounded) and validated by decode_model: on
    the decode pool when over OFF_LOOP_BYTES, inline otherwise. Bodies FastAPI would not read as
    JSON take FastAPI's path unchanged; the OpenAPI document is the same either way."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field is not None else None
        if not (isinstance(model, type) and issubclass(model, pydantic.BaseModel)):
            return handler
        body_model: type[pydantic.BaseModel] = model

        async def decode_large(request: Request) -> Response:
            raw = await request.body()
            if _is_json(request):
                # Small bodies too (inline): one parser, one nesting bound for every body
                # (FastAPI's own parse took ~980 levels below 1 MiB and 128 above).
                decoded = await off_loop_if_large(len(raw), decode_model, raw, body_model)
                request = _Decoded(request, raw, decoded)
            return await handler(request)

        return decode_large
