"""The OpenAI Responses API over chat completions: one translation for every paved server that
serves `/v1/responses` (the gateway, stateful; an instance's frontend, stateless).

`parse_request` validates a create body and gives the chat completions body it runs as;
`ResponseStream` turns that chat stream's chunks (parsed `chat.completion.chunk` dicts) into
the Responses API's typed events, each with its `sequence_number`, and keeps the response
object they describe.

Invariants:
- A field this translation cannot honour (built-in tools, reasoning, audio, unknown fields) is
  a ResponsesError(400) naming it; nothing is silently ignored.
- Sequence numbers start at 0 and grow by one per event; the last event of a stream is its
  terminal one (`response.completed`, `.incomplete`, `.failed`), and the stream's response
  object then has that event's status.
- Events are plain dicts of the shapes the official `openai` SDK parses
  (openai.types.responses.ResponseStreamEvent); `sse(event)` is their wire form.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from paved.http.sse import event_json

MAX_METADATA_KEYS = 16
TERMINAL_EVENTS = frozenset(("response.completed", "response.incomplete", "response.failed"))
TERMINAL_STATUSES = frozenset(("completed", "incomplete", "failed", "cancelled"))

# Fields of a create body, and the values that need no translation.
_SUPPORTED = frozenset(
    (
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text",
        "tools", "tool_choice", "metadata", "store", "previous_response_id", "stream",
        "background", "user", "parallel_tool_calls", "truncation", "service_tier",
    )
)  # fmt: skip


class ResponsesError(Exception):
    """A request the Responses API refuses: `status` with an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def new_id(prefix: str) -> str:
    """An unguessable id (192 random bits): ids are the only handle on a stored response."""
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass
class ParsedRequest:
    """A validated create body: `chat` is the chat completions body it runs as, without the
    messages of a previous response (the caller prepends `history`)."""

    body: dict[str, Any]
    model: str
    input_items: list[dict[str, Any]]
    input_messages: list[dict[str, Any]]
    instructions: str | None
    chat: dict[str, Any]
    stream: bool
    background: bool
    store: bool
    previous_response_id: str | None
    metadata: dict[str, str]
    history: list[dict[str, Any]] = field(default_factory=list)

    def chat_body(self) -> dict[str, Any]:
        """The chat completions request (always streamed: one path for every mode)."""
        messages = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages.extend(self.history)
        messages.extend(self.input_messages)
        return {**self.chat, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}


def _bad(message: str, param: str) -> ResponsesError:
    return ResponsesError(message, param)


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise _bad(f"{name} must be a number between {low} and {high}", name)
    return float(value)


def parse_request(body: Any, *, stateless: bool = False) -> ParsedRequest:
    """Validate a `POST /v1/responses` body. `stateless` (an instance): `store`,
    `background` and `previous_response_id` are refused, and `store` defaults to false."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body")
    for name in body:
        if name not in _SUPPORTED:
            raise _bad(f"'{name}' is not supported by paved's Responses API", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("you must provide a model parameter", "model")
    store = body.get("store", not stateless)
    background = body.get("background") or False
    stream = body.get("stream") or False
    for name, value in (("store", store), ("background", background), ("stream", stream)):
        if not isinstance(value, bool):
            raise _bad(f"{name} must be a boolean", name)
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _bad("previous_response_id must be a response id", "previous_response_id")
    if stateless:
        for name, on in (("store", store), ("background", background), ("previous_response_id", previous)):
            if on:
                raise _bad(
                    f"'{name}' needs stored responses, which a paved instance does not keep: "
                    "call the gateway, or send store: false",
                    name,
                )
    if background and not store:
        raise _bad("background responses must be stored (store: true)", "background")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions must be a string", "instructions")
    for name, allowed in (("truncation", ("disabled",)), ("service_tier", ("auto", "default"))):
        if body.get(name) is not None and body[name] not in allowed:
            raise _bad(f"{name} must be one of {', '.join(allowed)}", name)
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user must be a string", "user")
    metadata = _metadata(body.get("metadata"))
    items, messages = _input(body.get("input"))

    chat: dict[str, Any] = {"model": model}
    max_out = body.get("max_output_tokens")
    if max_out is not None:
        if isinstance(max_out, bool) or not isinstance(max_out, int) or max_out < 1:
            raise _bad("max_output_tokens must be a positive integer", "max_output_tokens")
        chat["max_tokens"] = max_out
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = _number(body, name, low, high)
        if value is not None:
            chat[name] = value
    if user:
        chat["user"] = user
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"], tools)
    if body.get("parallel_tool_calls") is False:
        chat["parallel_tool_calls"] = False
    return ParsedRequest(
        body=body, model=model, input_items=items, input_messages=messages, instructions=instructions,
        chat=chat, stream=stream, background=background, store=store, previous_response_id=previous,
        metadata=metadata,
    )  # fmt: skip


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA_KEYS:
        raise _bad(f"metadata must be an object of at most {MAX_METADATA_KEYS} pairs", "metadata")
    for k, v in value.items():
        if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise _bad("metadata keys are at most 64 characters, values strings of at most 512", "metadata")
    return dict(value)


def _text_of(content: Any, param: str) -> str:
    """A message's content as text: a string, or a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise _bad(f"content part type {kind!r} is not supported (text only)", f"{param}[{j}].type")
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad("a text part needs its text", f"{param}[{j}].text")
        texts.append(text)
    return "".join(texts)


def _item_id(raw: dict[str, Any], prefix: str, param: str, seen: set[str]) -> str:
    """An input item's id: the client's (a string, unique in the input: `input_items`
    pagination names an item by it), else a new one."""
    ident = raw.get("id")
    if ident is None or ident == "":
        return new_id(prefix)
    if not isinstance(ident, str):
        raise _bad("an input item's id must be a string", f"{param}.id")
    if ident in seen:
        raise _bad(f"input item id {ident!r} is used twice: ids must be unique", f"{param}.id")
    seen.add(ident)
    return ident


def _input(value: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The input items (as stored and listed, each with an id unique among them) and the chat
    messages they become."""
    if isinstance(value, str):
        item = {
            "id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": value}],
        }  # fmt: skip
        return [item], [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input must be a string or a non-empty list of input items", "input")
    items: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, raw in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(raw, dict):
            raise _bad("an input item must be an object", param)
        kind = raw.get("type", "message")
        if kind == "message":
            role = raw.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad("role must be user, system, developer or assistant", f"{param}.role")
            text = _text_of(raw.get("content"), f"{param}.content")
            part = "output_text" if role == "assistant" else "input_text"
            items.append(
                {
                    "id": _item_id(raw, "msg", param, seen), "type": "message", "role": role,
                    "status": "completed", "content": [{"type": part, "text": text}],
                }
            )  # fmt: skip
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id, name, arguments = raw.get("call_id"), raw.get("name"), raw.get("arguments")
            if not all(isinstance(x, str) and x for x in (call_id, name)) or not isinstance(arguments, str):
                raise _bad("a function_call item needs call_id, name and arguments (strings)", param)
            items.append(
                {
                    "id": _item_id(raw, "fc", param, seen), "type": "function_call", "call_id": call_id,
                    "name": name, "arguments": arguments, "status": "completed",
                }
            )  # fmt: skip
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = raw.get("call_id"), raw.get("output")
            if not isinstance(call_id, str) or not call_id or not isinstance(output, str):
                raise _bad("a function_call_output item needs call_id and output (strings)", param)
            items.append(
                {
                    "id": _item_id(raw, "fco", param, seen), "type": "function_call_output",
                    "call_id": call_id, "output": output, "status": "completed",
                }
            )  # fmt: skip
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise _bad(f"input item type {kind!r} is not supported", f"{param}.type")
    return items, messages


def _text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text must be an object", "text")
    for name in text:
        if name != "format":
            raise _bad(f"text.{name} is not supported", f"text.{name}")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        name, schema = fmt.get("name"), fmt.get("schema")
        if not isinstance(name, str) or not name or not isinstance(schema, dict):
            raise _bad("a json_schema format needs a name and a schema object", "text.format")
        spec: dict[str, Any] = {"name": name, "schema": schema}
        if fmt.get("strict") is not None:
            spec["strict"] = bool(fmt["strict"])
        if isinstance(fmt.get("description"), str):
            spec["description"] = fmt["description"]
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("text.format.type must be text, json_object or json_schema", "text.format.type")


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("tools must be a list", "tools")
    tools = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(
                f"tool type {kind!r} is not supported: paved serves function tools only "
                "(no built-in tools such as web_search or file_search)",
                f"tools[{i}].type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad("a function tool needs a name", f"tools[{i}].name")
        function: dict[str, Any] = {"name": name, "parameters": tool.get("parameters") or {}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = bool(tool["strict"])
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> Any:
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        if not any(t["function"]["name"] == value["name"] for t in tools):
            raise _bad(f"tool_choice names {value['name']!r}, which is not in tools", "tool_choice")
        return {"type": "function", "function": {"name": value["name"]}}
    raise _bad("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")


def _tools_echo(body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for tool in body.get("tools") or []:
        out.append(
            {
                "type": "function", "name": tool["name"], "description": tool.get("description"),
                "parameters": tool.get("parameters") or {}, "strict": tool.get("strict"),
            }
        )  # fmt: skip
    return out


def base_response(parsed: ParsedRequest, response_id: str, status: str) -> dict[str, Any]:
    """The response object before any output, as `response.created` and a background create
    show it."""
    body = parsed.body
    text = body.get("text") if isinstance(body.get("text"), dict) else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "background": parsed.background,
        "error": None,
        "incomplete_details": None,
        "instructions": parsed.instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "model": parsed.model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": parsed.previous_response_id,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "text": {"format": (text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": _tools_echo(body),
        "truncation": "disabled",
        "metadata": parsed.metadata,
        "store": parsed.store,
        "user": body.get("user"),
        "usage": None,
    }


def sse(event: dict[str, Any]) -> bytes:
    """An event's SSE frame (`event:` names its type, as OpenAI sends them)."""
    return f"event: {event['type']}\ndata: {event_json(event)}\n\n".encode()


class ResponseStream:
    """One response's events, built from its chat stream. Feed it chunks; `finish` ends it.

    `response` is the response object as of the last event; `output_messages` the assistant
    message (with its tool calls) a later response chained to this one continues from."""

    def __init__(self, parsed: ParsedRequest, response_id: str, *, queued: bool = False):
        self.response = base_response(parsed, response_id, "queued" if queued else "in_progress")
        self.seq = -1
        self._queued = queued
        self._message: dict[str, Any] | None = None
        self._text: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self.done = False
        # Output deltas a previous replica already emitted (`resumed`): counted as output
        # tokens, one per delta (paved's engines send one token per chunk; an estimate where a
        # backend sends more).
        self.prior_tokens = 0

    @classmethod
    def resumed(cls, parsed: ParsedRequest, response_id: str, events: list[dict[str, Any]]) -> ResponseStream:
        """The state after `events` (the events another replica emitted, from sequence number
        0, in order): feeding it the rest of the generation continues the same sequence, the
        same output item and the same text. ValueError when the events are not a gap-free
        sequence from 0 of events this class emits."""
        run = cls(parsed, response_id, queued=parsed.background)
        for event in events:
            run._replay(event)
        return run

    def _replay(self, event: dict[str, Any]) -> None:
        if event.get("sequence_number") != self.seq + 1:
            raise ValueError(f"event {self.seq + 1} is missing")
        self.seq += 1
        kind = event.get("type")
        if kind in TERMINAL_EVENTS or kind in ("response.created", "response.queued", "response.in_progress"):
            snapshot = event["response"]
            self.response = {**snapshot, "output": list(self.response["output"])}
            self.done = kind in TERMINAL_EVENTS
            if self.done:
                self.response = dict(snapshot)
        elif kind == "response.output_item.added":
            item, index = dict(event["item"]), int(event["output_index"])
            if index != len(self.response["output"]):
                raise ValueError("output items out of order")
            self.response["output"].append(item)
            if item.get("type") == "message":
                self._message = {"id": item["id"], "_index": index}
            else:
                self._calls[len(self._calls)] = {
                    "id": item["id"], "call_id": item.get("call_id"), "name": item.get("name") or "",
                    "arguments": "", "output_index": index,
                }  # fmt: skip
        elif kind == "response.output_text.delta":
            self._text.append(str(event["delta"]))
            self.prior_tokens += 1
        elif kind == "response.function_call_arguments.delta":
            for state in self._calls.values():
                if state["id"] == event.get("item_id"):
                    state["arguments"] += str(event["delta"])
            self.prior_tokens += 1
        elif kind == "response.output_item.done":
            index = int(event["output_index"])
            self.response["output"][index] = dict(event["item"])
            if self._message is not None and self._message["_index"] == index:
                self._message["closed"] = True

    @property
    def text(self) -> str:
        """The output text so far."""
        return "".join(self._text)

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def hit_limit(self) -> None:
        """End as max_output_tokens does (the budget was spent before a continuation)."""
        self._finish_reason = "length"

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def _snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": [dict(item) for item in self.response["output"]]}

    def start(self) -> list[dict[str, Any]]:
        """`response.created` (and, for a queued response, `response.queued`)."""
        events = [self._event("response.created", response=self._snapshot())]
        if self._queued:
            events.append(self._event("response.queued", response=self._snapshot()))
        return events

    def running(self) -> list[dict[str, Any]]:
        self.response["status"] = "in_progress"
        return [self._event("response.in_progress", response=self._snapshot())]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events one `chat.completion.chunk` gives (none for a role or usage chunk)."""
        events: list[dict[str, Any]] = []
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if isinstance(text, str) and text:
                events.extend(self._open_message())
                self._text.append(text)
                events.append(
                    self._event(
                        "response.output_text.delta", item_id=self._message_id(), output_index=self._index(),
                        content_index=0, delta=text, logprobs=[],
                    )
                )  # fmt: skip
            for call in delta.get("tool_calls") or ():
                events.extend(self._call_delta(call))
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return events

    def _message_id(self) -> str:
        return str((self._message or {})["id"])

    def _index(self) -> int:
        return int((self._message or {})["_index"])

    def _open_message(self) -> list[dict[str, Any]]:
        if self._message is not None:
            return []
        index = len(self.response["output"])
        self._message = {"id": new_id("msg"), "_index": index}
        item = {"id": self._message["id"], "type": "message", "role": "assistant", "status": "in_progress",
                "content": []}  # fmt: skip
        self.response["output"].append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.output_item.added", output_index=index, item=dict(item)),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        index = call.get("index", 0)
        state = self._calls.get(index)
        function = call.get("function") or {}
        if state is None:
            events.extend(self._close_message())
            output_index = len(self.response["output"])
            state = {
                "id": new_id("fc"), "call_id": call.get("id") or new_id("call"),
                "name": function.get("name") or "", "arguments": "", "output_index": output_index,
            }  # fmt: skip
            self._calls[index] = state
            item = self._call_item(state, "in_progress")
            self.response["output"].append(item)
            events.append(
                self._event("response.output_item.added", output_index=output_index, item=dict(item))
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            state["arguments"] += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta", item_id=state["id"],
                    output_index=state["output_index"], delta=arguments,
                )
            )  # fmt: skip
        return events

    @staticmethod
    def _call_item(state: dict[str, Any], status: str) -> dict[str, Any]:
        return {
            "id": state["id"], "type": "function_call", "call_id": state["call_id"], "name": state["name"],
            "arguments": state["arguments"], "status": status,
        }  # fmt: skip

    def _close_message(self) -> list[dict[str, Any]]:
        message = self._message
        if message is None or message.get("closed"):
            return []
        message["closed"] = True
        index, item_id, text = message["_index"], message["id"], "".join(self._text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [part],
        }
        self.response["output"][index] = item
        return [
            self._event(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self._event(
                "response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def finish(self, *, error: str | None = None, cancelled: bool = False) -> list[dict[str, Any]]:
        """Close the open items and end with the terminal event: `response.failed` for an
        error or a cancellation (whose response says `cancelled`), `response.incomplete` when
        the output hit max_output_tokens, else `response.completed`."""
        if self.done:
            return []
        self.done = True
        events = self._close_message()
        for state in self._calls.values():
            item = self._call_item(state, "completed")
            self.response["output"][state["output_index"]] = item
            events.append(
                self._event(
                    "response.function_call_arguments.done", item_id=state["id"],
                    output_index=state["output_index"], arguments=state["arguments"], name=state["name"],
                )
            )  # fmt: skip
            events.append(
                self._event("response.output_item.done", output_index=state["output_index"], item=item)
            )
        self.response["usage"] = self._final_usage()
        if cancelled:
            self.response["status"] = "cancelled"
            kind = "response.failed"
        elif error is not None:
            self.response["status"] = "failed"
            self.response["error"] = {"code": "server_error", "message": error}
            kind = "response.failed"
        elif self._finish_reason == "length":
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            kind = "response.incomplete"
        else:
            self.response["status"] = "completed"
            kind = "response.completed"
        events.append(self._event(kind, response=self._snapshot()))
        return events

    def _final_usage(self) -> dict[str, Any] | None:
        """The response's usage; None when the backend never reported one (a cancellation or
        a failure before the stream's usage chunk): zeros would claim tokens were free."""
        if self._usage is None:
            return None
        usage = self._usage
        prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        if self.prior_tokens:
            # A continuation's prompt held the output a previous replica emitted: that part is
            # output, as if one replica had generated it all.
            prompt, completion = max(prompt - self.prior_tokens, 0), completion + self.prior_tokens
        return {
            "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        }  # fmt: skip

    def output_messages(self) -> list[dict[str, Any]]:
        """The chat messages this response's output adds to a conversation."""
        text = "".join(self._text)
        calls = [
            {
                "id": s["call_id"],
                "type": "function",
                "function": {"name": s["name"], "arguments": s["arguments"]},
            }
            for s in self._calls.values()
        ]
        if not text and not calls:
            return []
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return [message]


def chat_error_message(chunk: dict[str, Any]) -> str | None:
    """The message of an `error` event a chat stream ended with (None for a normal chunk)."""
    error = chunk.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or "the model failed")
    return None
