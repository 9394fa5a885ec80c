"""Prompt templates: a versioned registry of Jinja2 chat templates in the gateway's state, their
sandboxed rendering, per-tenant prompting (a system prompt and a default template) and the
admin API over them (`templates_router`).

A template is a list of chat messages (`{"role", "content"}`) whose contents are Jinja2 sources.
A request names it as `name` (the latest version) or `name@N` (pinned) and passes `variables`, a
JSON object; rendering yields the messages in order.

Invariants callers rely on:
- Versions are immutable: `create` appends version latest+1 (unique (name, version); concurrent
  creators retry), nothing ever rewrites or deletes one, so a pinned version is cached forever
  and `name` (latest) is cached at most `cache_s`; so are tenant prompting and misses.
- Template source is vetted when it is created: no include/import/extends/block (no loader
  exists anyway), no autoescape blocks, no attribute or item access to a name starting with "_"
  (`''.__class__`, `x['__class__']`), no `attr` filter, only the allowed filters and tests, at
  most MAX_MESSAGES messages of at most MAX_SOURCE_BYTES each, roles from ROLES. A refusal is
  GatewayError(400, code="template_refused") saying why (so is a template nested too deeply for
  Python's compiler); a syntax error is
  GatewayError(400, code="template_syntax_error").
- Rendering runs in a worker thread of its own small pool (never on the event loop), in an
  ImmutableSandboxedEnvironment with StrictUndefined and autoescape off, and is bounded:
  * time: a wall-clock deadline of `render_timeout_s`, enforced inside the worker by a trace
    function (line events of the template's own frames, call events of every frame), so a pure
    Jinja loop with an empty body stops too, and by a watchdog thread that, past the deadline,
    raises the deadline in the worker again every 20 ms until it returns (a single raise can be
    swallowed by a generator's finalization, which also drops the trace function); compiling
    (create, a render's cache miss) runs in the same workers under a deadline of its own, and
    the Python a big template compiles to is compiled by a child process killed at that
    deadline (CPython's compile() holds the GIL throughout: in a thread it still stalls the
    event loop);
  * workers: a job takes a free worker or, when none frees up within `render_timeout_s`,
    answers 503 (template_render_busy); it never queues behind a busy one;
  * size: the output is counted while it is generated and stops at `max_output_chars`; no value
    a template builds (concatenation, `+`, `*`, `**`, literals, filters, method calls) may exceed
    that weight either, checked before the allocation where the size is predictable (`'x' * 10**9`,
    `2 ** 10**9`, `replace`, `join`, `indent`, `round`'s precision in -20..20) and right after it
    otherwise; integers weigh by their size; buffered output ({% set %} blocks, macro and call
    bodies, {% filter %}) and lists count as they are built against a per-render total of
    32 x `max_output_chars`; an undefined inside a rendered container is its error (a refused
    lookup's SecurityError), never the text "Undefined"; output must encode as UTF-8 (no lone
    surrogates); `range` is bounded;
    only allow-listed callables run (range, dict, namespace, joiner, macros, and a few non-growing
    str/dict/list methods; never `str.format` or `%` string formatting).
  * values: an expression may output (or join with ~, |join, |string) only strings, numbers,
    booleans, None and lists, tuples or dicts of those; a function, macro, `loop`, `self`,
    joiner, namespace or iterator is a "template_render_error" naming the expression, never
    its repr in a prompt.
  Every failure is GatewayError(400): "template_refused" for what the sandbox forbids (a
  SecurityError), "template_render_error" for a limit, an undefined variable (named in the
  message) or any other error the template raises; never a 500, never a hung worker. No
  message carries an object repr (`<function ... at 0x...>`: `_clip` replaces them).
- Variables are data: a JSON object of at most MAX_VARIABLES_BYTES (serialized) whose keys are
  identifiers; it is serialized and parsed back before rendering, so a template sees only plain
  JSON values, and a variable holding "{{ 7*7 }}" renders literally.
- The tenant system prompt is literal text, never rendered.
"""

from __future__ import annotations

import asyncio
import builtins
import ctypes
import functools
import json
import marshal
import re
import subprocess
import sys
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, MappingView
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, TypeVar, cast

import sqlalchemy as sa
from fastapi import APIRouter, Query
from jinja2 import StrictUndefined, TemplateError, TemplateSyntaxError, UndefinedError, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.environment import Template
from jinja2.exceptions import SecurityError
from jinja2.filters import FILTERS, make_attrgetter
from jinja2.runtime import LoopContext, Macro, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import Joiner, Namespace
from pydantic import BaseModel, ConfigDict, StrictStr
from sqlalchemy.exc import IntegrityError

from paved.gateway.access.admin_api import _admin_route_class
from paved.gateway.access.auth import AdminAuth
from paved.gateway.access.state import TENANT_NAME_RE, GatewayStore, validate_tenant_name
from paved.gateway.errors import GatewayError
from paved.sql import utc, utc_now

TEMPLATE_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_REF_RE = re.compile(r"([a-z0-9][a-z0-9._-]{0,63})(?:@([1-9][0-9]{0,8}))?")
_VARIABLE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
ROLES = frozenset({"system", "developer", "user", "assistant"})
MAX_MESSAGES = 32
MAX_SOURCE_BYTES = 64 * 1024
MAX_DESCRIPTION_CHARS = 1024
MAX_VARIABLES_BYTES = 64 * 1024
MAX_SYSTEM_PROMPT_BYTES = 64 * 1024
# Integers a template computes stay far below Python's 4300-digit str() limit.
MAX_INT_BITS = 4096
# The filename of every compiled template: how the deadline's trace function knows its frames.
_TEMPLATE_FILENAME = "<paved-prompt-template>"
# A render's result is awaited this long past its deadline before answering 503 (the watchdog
# has interrupted the worker long before).
_QUEUE_GRACE_S = 5.0
# Vetting and compiling (create, or a render's cache miss) run under this deadline of their own.
_COMPILE_TIMEOUT_S = 10.0
# The Python a template compiles to is compiled by a child process beyond this size: CPython's
# compile() holds the GIL from start to end (0.4 s for the 1.9 MB a 64 KiB `{{[a*a, a*a, ...]}}`
# becomes), which no worker thread can keep from stalling the event loop. Below it the work is
# a few milliseconds and a process would cost more.
_INLINE_COMPILE_CHARS = 64 * 1024
_COMPILER = """\
import marshal, sys
source = sys.stdin.buffer.read()
try:
    code = compile(source, sys.argv[1], "exec", dont_inherit=True)
except (SyntaxError, RecursionError, MemoryError, OverflowError) as e:
    kind = next(k for k in (SyntaxError, RecursionError, MemoryError, OverflowError) if isinstance(e, k))
    sys.stdout.buffer.write(b"E" + kind.__name__.encode())
else:
    sys.stdout.buffer.write(b"C" + marshal.dumps(code))
"""
_COMPILE_ERRORS: dict[bytes, type[Exception]] = {
    e.__name__.encode(): e for e in (SyntaxError, RecursionError, MemoryError, OverflowError)
}
# Past a deadline the watchdog interrupts its worker every _KICK_INTERVAL_S, at most _MAX_KICKS times.
_KICK_INTERVAL_S = 0.02
_MAX_KICKS = 500
# A render may build (buffered block output, lists) this many times max_output_chars in all.
_BUILT_BUDGET_FACTOR = 32
_MAX_CACHED = 4096
_MAX_COMPILED = 256
_MAX_COMPILED_SOURCE = 32 * 1024 * 1024
_CREATE_ATTEMPTS = 8
_MAX_ERROR_CHARS = 300

_T = TypeVar("_T")

metadata = sa.MetaData()

templates_table = sa.Table(
    "gateway_templates",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("messages", sa.JSON, nullable=False),
    sa.Column("description", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

tenant_prompting_table = sa.Table(
    "gateway_tenant_prompting",
    metadata,
    sa.Column("tenant", sa.String(63), primary_key=True),
    sa.Column("system_prompt", sa.Text, nullable=True),
    sa.Column("default_template", sa.String(80), nullable=True),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)


# -- values -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    version: int
    messages: tuple[Mapping[str, str], ...]  # each {"role", "content" (Jinja2 source)}, read-only
    description: str
    created_at: datetime

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def __hash__(self) -> int:
        # The generated hash would fail on the (unhashable) message mappings; a version is
        # immutable, so (name, version) identifies it.
        return hash((self.name, self.version))

    def to_dict(self) -> dict[str, Any]:
        return {
            "object": "prompt_template",
            "name": self.name,
            "version": self.version,
            "ref": self.ref,
            "messages": [dict(m) for m in self.messages],
            "description": self.description,
            "created_at": self.created_at.isoformat(),
        }


@dataclass(frozen=True)
class TenantPrompting:
    tenant: str
    system_prompt: str | None = None  # literal text, prepended as a system message
    default_template: str | None = None  # a ref: "name" or "name@N"

    def to_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "system_prompt": self.system_prompt,
            "default_template": self.default_template,
        }


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, code=code, param=param)


def _refused(message: str, param: str | None) -> GatewayError:
    return GatewayError(400, message, code="template_refused", param=param)


# An object's repr in an error text (`<function safe_range at 0x7f26...>`, `<bound method
# Joiner.__call__ of <...>>`): innermost first, so a nested one goes in a second pass.
_OBJECT_REPR = re.compile(
    r"<(?:[^<>]* at 0x[0-9a-fA-F]+|(?:function|bound method|built-in|method|class|module|generator) [^<>]*)>"
)


def _clip(text: str) -> str:
    """An exception's text for an error message: one line, bounded, and without object reprs
    (a heap address, or a Python object's name, is nothing a template author can use)."""
    text = " ".join(text.split())
    while True:
        scrubbed = _OBJECT_REPR.sub("a Python object", text)
        if scrubbed == text:
            break
        text = scrubbed
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def parse_template_ref(ref: object) -> tuple[str, int | None]:
    """ "name" -> (name, None) (the latest version); "name@3" -> (name, 3)."""
    match = _REF_RE.fullmatch(ref) if isinstance(ref, str) else None
    if match is None:
        raise _bad(
            "template must be 'name' or 'name@version' (name: [a-z0-9][a-z0-9._-]{0,63}, version: 1, 2, ...)",
            param="template",
        )
    version = match.group(2)
    return match.group(1), None if version is None else int(version)


def _validate_name(name: object) -> str:
    if not isinstance(name, str) or TEMPLATE_NAME_RE.fullmatch(name) is None:
        raise _bad("template name must match [a-z0-9][a-z0-9._-]{0,63}", param="name")
    return name


def _validate_messages(messages: object) -> list[dict[str, str]]:
    if not isinstance(messages, list | tuple) or not messages:
        raise _bad("messages must be a non-empty list of {role, content} objects", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise _refused(f"a template may have at most {MAX_MESSAGES} messages", param="messages")
    out = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
            raise _bad(f"{param} must be an object with exactly 'role' and 'content'", param=param)
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or role not in ROLES:
            raise _refused(f"{param}.role must be one of {', '.join(sorted(ROLES))}", param=f"{param}.role")
        if not isinstance(content, str):
            raise _bad(f"{param}.content must be a string (Jinja2 source)", param=f"{param}.content")
        if len(content.encode("utf-8", "surrogatepass")) > MAX_SOURCE_BYTES:
            raise _refused(
                f"{param}.content is over {MAX_SOURCE_BYTES // 1024} KiB of template source",
                param=f"{param}.content",
            )
        out.append({"role": role, "content": content})
    return out


def _validate_variables(variables: object) -> dict[str, Any]:
    """The variables as plain JSON data (serialized and parsed back), or GatewayError(400)."""
    if variables is None:
        return {}
    if not isinstance(variables, Mapping):
        raise _bad("variables must be a JSON object", param="variables", code="template_render_error")
    for key in variables:
        if not isinstance(key, str) or _VARIABLE_RE.fullmatch(key) is None:
            raise _bad(
                "variable names must be identifiers ([A-Za-z_][A-Za-z0-9_]*, at most 64 characters)",
                param="variables",
                code="template_render_error",
            )
    try:
        text = json.dumps(variables, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        raise _bad(
            "variables must hold JSON values only (objects, arrays, strings, finite numbers, booleans, null)",
            param="variables",
            code="template_render_error",
        ) from None
    if len(text.encode("utf-8", "surrogatepass")) > MAX_VARIABLES_BYTES:
        raise _bad(
            f"variables are over {MAX_VARIABLES_BYTES // 1024} KiB serialized",
            param="variables",
            code="template_render_error",
        )
    parsed: dict[str, Any] = json.loads(text)
    return parsed


# -- the sandbox ------------------------------------------------------------------------------


class _RenderLimit(Exception):
    """A size or shape limit a render (or its compile-time constant folding) ran into."""


class _DeadlineExceeded(BaseException):
    """Raised by the trace function. A BaseException, so no `except Exception` on the way (in
    Jinja's runtime or a filter) can swallow it and carry on untraced."""


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with every literal container and every `~` concatenation passed
    through the environment's size check (`paved_vet`, `paved_concat`)."""

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self.write("environment.paved_vet(")
        super().visit_List(node, frame)
        self.write(")")

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self.write("environment.paved_vet(")
        super().visit_Dict(node, frame)
        self.write(")")

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx != "load":  # an assignment target ({% for a, b in ... %}), not a value
            super().visit_Tuple(node, frame)
            return
        self.write("environment.paved_vet(")
        super().visit_Tuple(node, frame)
        self.write(")")

    def buffer(self, frame: Frame) -> None:
        # Buffered output ({% set %} blocks, macro and call bodies, {% filter %}) goes to a list
        # that counts what is appended against the render's budget, not only when joined.
        super().buffer(frame)
        self.writeline(f"{frame.buffer} = environment.paved_buffer()")

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.paved_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(f"), {_expression_label(node)!r})")

    # Every {{ expression }} is output through paved_output, told which one it is, so a value
    # that is not text names its expression (autoescape, the other branch, is refused at create).
    def _output_child_pre(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        self.write(f"environment.paved_output({_expression_label(node)!r}, ")

    def _output_child_post(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        self.write(")")


_LABEL_CHARS = 60


def _expression_text(node: nodes.Node, depth: int = 0) -> str:
    """The source of a (common) expression, rebuilt from its tree: Jinja keeps no columns."""
    if depth > 6:
        return "..."
    d = depth + 1
    if isinstance(node, nodes.Name):
        return node.name
    if isinstance(node, nodes.Const):
        return repr(node.value) if isinstance(node.value, str | int | float | bool | None) else "..."
    if isinstance(node, nodes.Getattr):
        return f"{_expression_text(node.node, d)}.{node.attr}"
    if isinstance(node, nodes.Getitem):
        return f"{_expression_text(node.node, d)}[{_expression_text(node.arg, d)}]"
    if isinstance(node, nodes.Call):
        inner = "..." if node.args or node.kwargs or node.dyn_args or node.dyn_kwargs else ""
        return f"{_expression_text(node.node, d)}({inner})"
    if isinstance(node, nodes.Filter):
        base = "" if node.node is None else _expression_text(node.node, d) + " | "
        return base + node.name
    if isinstance(node, nodes.Test):
        return f"{_expression_text(node.node, d)} is {node.name}"
    if isinstance(node, nodes.List):
        return "[...]" if node.items else "[]"
    if isinstance(node, nodes.Tuple):
        return "(...)"
    if isinstance(node, nodes.Dict):
        return "{...}" if node.items else "{}"
    if isinstance(node, nodes.BinExpr):
        return f"{_expression_text(node.left, d)} {node.operator} {_expression_text(node.right, d)}"
    if isinstance(node, nodes.Concat):
        return " ~ ".join(_expression_text(n, d) for n in node.nodes)
    if isinstance(node, nodes.CondExpr):
        return f"{_expression_text(node.expr1, d)} if ..."
    return "..."


def _expression_label(node: nodes.Node) -> str:
    text = _expression_text(node)
    if len(text) > _LABEL_CHARS:
        text = text[: _LABEL_CHARS - 3] + "..."
    return f"{{{{ {text} }}}} (line {node.lineno})"


class _NotText(_RenderLimit):
    """A value that has no text a prompt could carry (a function, a macro, an iterator...)."""

    def __init__(self, value: Any):
        super().__init__(f"{_kind_of(value)} is not text")
        self.value = value


def _kind_of(value: Any) -> str:
    """What a non-plain value is, in words (never its repr)."""
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType | types.MethodType):
        return "a function"
    if isinstance(value, Iterator) and not isinstance(value, LoopContext):
        return "an iterator (add |list)"
    if isinstance(value, MappingView):
        return "a dict view (add |list)"
    return f"a {type(value).__name__} object"


def _not_plain(value: Any) -> Any:
    """The first part of `value` that is not a string, number, boolean, None, or a list, tuple
    or dict of those; None when there is none. `value` was weighed: the walk is bounded."""
    stack = [value]
    while stack:
        item = stack.pop()
        if item is None or isinstance(item, str | int | float):
            continue
        if isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        else:
            return item
    return None


# Methods a template may call, by the type of the object they are bound to: none of them builds a
# value much larger than its object (str.replace and str.join are checked before they run).
# fmt: off
_STR_METHODS = frozenset({
    "capitalize", "casefold", "count", "endswith", "find", "isalnum", "isalpha", "isascii",
    "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric", "isprintable", "isspace",
    "istitle", "isupper", "join", "lower", "lstrip", "partition", "removeprefix",
    "removesuffix", "replace", "rfind", "rpartition", "rsplit", "rstrip", "split",
    "splitlines", "startswith", "strip", "swapcase", "title", "upper",
})
# fmt: on
_DICT_METHODS = frozenset({"get", "items", "keys", "values"})
_SEQ_METHODS = frozenset({"count", "index"})
_LOOP_METHODS = frozenset({"cycle", "changed"})

# Jinja filters used as they are (their results are size-checked); join, list, replace, string,
# sum, tojson, indent and wordwrap are reimplemented or pre-checked below. Absent on purpose:
# attr (attribute walks), format (unbounded widths), center, batch, slice, groupby, random,
# pprint, urlize, xmlattr, escape/safe (no HTML here), filesizeformat, striptags, urlencode.
# fmt: off
_PLAIN_FILTERS = (
    "abs", "capitalize", "count", "d", "default", "dictsort", "first", "float", "int", "items",
    "last", "length", "lower", "map", "max", "min", "reject", "rejectattr", "reverse",
    "select", "selectattr", "sort", "title", "trim", "truncate", "unique", "upper", "wordcount",
)
# fmt: on
# Filters whose argument (positional for selectattr/rejectattr, else `attribute=`) names an
# attribute path, vetted like `.name`.
_ATTRIBUTE_FILTERS = frozenset({"selectattr", "rejectattr"})


class _WeightCache:
    """The weights of the containers one render has already weighed, so that growing a list in a
    loop (`ns.l + [x]`) costs O(1) per step instead of a walk of the whole list. Sound because
    containers are immutable in the sandbox (namespaces, which are not, are never cached);
    entries hold their object, so an id cannot be reused while cached; bounded by total weight."""

    def __init__(self, budget: int):
        self._entries: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        self._budget = budget
        self._total = 0

    def get(self, obj: Any) -> int | None:
        entry = self._entries.get(id(obj))
        return entry[1] if entry is not None and entry[0] is obj else None

    def put(self, obj: Any, weight: int) -> None:
        if weight < 32 or type(obj) not in (list, tuple, dict):
            return  # small ones are cheaper to walk again than to track
        old = self._entries.pop(id(obj), None)
        if old is not None:
            self._total -= old[1]
        self._entries[id(obj)] = (obj, weight)
        self._total += weight
        while self._total > self._budget and self._entries:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._total -= dropped


_render_state = threading.local()


def _charge(amount: int) -> None:
    """Count `amount` against the current render's budget of built values (buffered output,
    lists); nothing outside a render (compile-time folding) is charged."""
    left: int | None = getattr(_render_state, "budget", None)
    if left is None:
        return
    left -= amount
    _render_state.budget = left
    if left < 0:
        raise _RenderLimit("the values this render built would exceed its total budget")


class _BudgetedBuffer(list[Any]):
    """A render's output buffer that charges every appended string as it arrives."""

    def append(self, item: Any) -> None:
        _charge(len(item) + 1 if isinstance(item, str) else 1)
        super().append(item)

    def extend(self, items: Iterable[Any]) -> None:
        for item in items:
            self.append(item)


def _int_weight(value: int) -> int:
    # A 4096-bit integer holds as much memory as a short string: weighed by its size.
    return value.bit_length() // 30 + 1


def _weights() -> _WeightCache | None:
    cache: _WeightCache | None = getattr(_render_state, "weights", None)
    return cache


def _namespace_attrs(ns: Namespace) -> Any:
    try:
        return object.__getattribute__(ns, "_Namespace__attrs")
    except AttributeError:  # a Jinja that stores them differently: weigh it as opaque
        return None


def _describe(obj: Any) -> str:
    """A short name for a callable in an error message (never its repr: that could be data)."""
    name = getattr(obj, "__name__", None)
    owner = getattr(obj, "__self__", None)
    if isinstance(name, str) and owner is not None and not isinstance(owner, types.ModuleType):
        return f"{type(owner).__name__}.{name}"
    return name if isinstance(name, str) else type(obj).__name__


class _PromptEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox templates compile and render in (see the module docstring)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, max_chars: int):
        super().__init__(
            undefined=StrictUndefined,
            autoescape=False,
            finalize=self._finalize,
            keep_trailing_newline=True,
            optimized=False,  # no compile-time folding beyond what Jinja's output path does
            cache_size=0,
            auto_reload=False,
        )
        self.max_chars = max_chars
        self.globals.clear()
        self.globals.update(range=safe_range, dict=dict, namespace=Namespace, joiner=Joiner)
        filters: dict[str, Callable[..., Any]] = {
            name: self._checked(FILTERS[name]) for name in _PLAIN_FILTERS
        }
        filters.update(
            join=self._join,
            list=self._list,
            replace=self._replace,
            string=self._text,
            sum=self._sum,
            tojson=self._tojson,
            indent=self._indent,
            round=self._round,
            wordwrap=self._checked(FILTERS["wordwrap"], self._wordwrap_pre),
        )
        self.filters = filters

    # -- size checks ------------------------------------------------------------------------

    def _limit(self, what: str) -> _RenderLimit:
        return _RenderLimit(f"{what} would exceed the limit of {self.max_chars} characters")

    def weigh(self, value: Any, budget: int | None = None, fail_undefined: bool = False) -> int:
        """A value's expanded size (characters plus container slots, shared parts counted each
        time they occur), walked iteratively and abandoned once over `budget`."""
        limit = self.max_chars if budget is None else budget
        cache = _weights()
        total = 0
        stack = [value]
        pop, extend = stack.pop, stack.extend
        while stack:
            item = pop()
            kind = type(item)
            if cache is not None and not fail_undefined and (kind is list or kind is tuple or kind is dict):
                known = cache.get(item)
                if known is not None:
                    total += known
                    if total + len(stack) > limit:
                        raise self._limit("a value")
                    continue
            # Every entry left on the stack will weigh at least 1, so total + len(stack) is a
            # lower bound of the final weight: the walk stops as soon as that passes the limit
            # (before pushing a container's items, so the stack never outgrows the limit).
            if kind is int:
                total += _int_weight(item)
            elif kind is float or kind is bool or item is None:
                total += 1
            elif isinstance(item, str):
                total += len(item) + 1
            elif isinstance(item, dict):
                total += 1
                if total + len(stack) + 2 * len(item) > limit:
                    raise self._limit("a value")
                extend(item.keys())
                extend(item.values())
            elif isinstance(item, list | tuple | set | frozenset | MappingView):
                total += 1
                if total + len(stack) + len(item) > limit:
                    raise self._limit("a value")
                extend(cast("Iterable[Any]", item))
            elif isinstance(item, Namespace):
                total += 1
                attrs = _namespace_attrs(item)
                if attrs is not None:
                    stack.append(attrs)
            elif fail_undefined and isinstance(item, Undefined):
                # An undefined inside a container being rendered (`xs|map(attribute=k)|list`
                # with a refused or missing k): its own error (SecurityError for an unsafe
                # lookup), never the text "Undefined".
                item._fail_with_undefined_error()
            else:  # range, macros, generators, undefined: constant-size reprs
                total += 1
            if total + len(stack) > limit:
                raise self._limit("a value")
        if cache is not None:
            cache.put(value, total)
        return total

    def paved_vet(self, value: _T) -> _T:
        if isinstance(value, str):
            if len(value) > self.max_chars:
                raise self._limit("a string")
        elif isinstance(value, int) and not isinstance(value, bool):
            if value.bit_length() > MAX_INT_BITS:
                raise _RenderLimit(f"an integer would exceed {MAX_INT_BITS} bits")
        elif not isinstance(value, float | bool | type(None)):
            self.weigh(value)
        return value

    def _text(self, value: Any) -> str:
        """str(value), refusing (before converting) anything whose text would be over the limit
        and anything but plain values (_not_plain): no object repr ever reaches a prompt."""
        if isinstance(value, str):
            text = value
        elif isinstance(value, Undefined):
            text = str(value)  # StrictUndefined: raises UndefinedError naming the variable
        else:
            if not isinstance(value, int | float | bool | type(None)):
                self.weigh(value, fail_undefined=True)
                foreign = _not_plain(value)
                if foreign is not None:
                    raise _NotText(foreign)
            text = str(value)
        if len(text) > self.max_chars:
            raise self._limit("a string")
        return text

    def paved_buffer(self) -> list[Any]:
        return _BudgetedBuffer()

    def _finalize(self, value: Any) -> str:
        return self._text(value)

    def paved_output(self, label: str, value: Any) -> str:
        """The text of one {{ expression }} (`label` says which, for the error)."""
        try:
            return self._text(value)
        except _NotText as exc:
            raise _RenderLimit(
                f"{label} is {_kind_of(exc.value)}, not text: a template may output only strings, "
                "numbers, booleans, none, and lists or dicts of those"
            ) from None

    def _compile(self, source: str, filename: str) -> types.CodeType:
        return _compile_python(source, filename)

    def paved_concat(self, parts: Iterable[Any], label: str | None = None) -> str:
        texts, total = [], 0
        for part in parts:
            try:
                text = self._text(part)
            except _NotText as exc:
                if label is None:
                    raise
                raise _RenderLimit(f"{label} joins {_kind_of(exc.value)}, which is not text") from None
            total += len(text)
            if total > self.max_chars:
                raise self._limit("a concatenation")
            texts.append(text)
        return "".join(texts)

    def concat(self, parts: Iterable[Any]) -> str:
        # Used by macros, {% set %} blocks and call blocks to join their output.
        return self.paved_concat(parts)

    # -- operators and calls ----------------------------------------------------------------

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "%" and isinstance(left, str):
            raise SecurityError(
                "'%' string formatting is not allowed in a prompt template; use ~ and filters"
            )
        if operator == "*":
            self._check_mul(left, right)
        elif operator == "**":
            self._check_pow(left, right)
        elif operator == "+":
            if isinstance(left, str) and isinstance(right, str):
                if len(left) + len(right) > self.max_chars:
                    raise self._limit("a string")
            elif type(left) in (list, tuple) and type(right) is type(left):
                # Weighed (cached) operands give the result's weight without walking it.
                weight = self.weigh(left) + self.weigh(right) - 1
                if weight > self.max_chars:
                    raise self._limit("a value")
                result = left + right
                cache = _weights()
                if cache is not None:
                    cache.put(result, weight)
                return result
        return self.paved_vet(self.binop_table[operator](left, right))

    def _check_mul(self, left: Any, right: Any) -> None:
        if _is_int(left) and _is_int(right):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise _RenderLimit(f"an integer would exceed {MAX_INT_BITS} bits")
            return
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and _is_int(times) and times > 1:
                size = len(seq) if isinstance(seq, str) else self.weigh(seq)
                if size * times > self.max_chars:
                    raise self._limit("a repetition")

    def _check_pow(self, base: Any, exponent: Any) -> None:
        # (bits - 1) * exponent is a lower bound of the result's size: refused before computing.
        if (
            _is_int(base)
            and _is_int(exponent)
            and exponent > 0
            and abs(base) > 1
            and (base.bit_length() - 1) * exponent > MAX_INT_BITS
        ):
            raise _RenderLimit(f"an integer would exceed {MAX_INT_BITS} bits")

    def call(
        __self,  # Jinja's own signature: the prefixes keep the caller's kwargs free
        __context: Any,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if isinstance(__obj, Undefined):
            return __context.call(__obj, *args, **kwargs)  # raises UndefinedError, naming it
        if not __self._may_call(__obj):
            raise SecurityError(f"{_describe(__obj)}() may not be called from a prompt template")
        owner = getattr(__obj, "__self__", None)
        if type(owner) is str and __obj.__name__ in ("join", "replace"):
            plain = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
            if __obj.__name__ == "join":
                if plain or len(args) != 1:
                    raise TypeError("str.join() takes exactly one argument")
                return __self._join(args[0], owner)
            return __self._replace(owner, *args, **plain)
        return __self.paved_vet(__context.call(__obj, *args, **kwargs))

    def _may_call(self, obj: Any) -> bool:
        if obj is safe_range or obj is dict or obj is Namespace or obj is Joiner:
            return True
        if isinstance(obj, Macro | Joiner | LoopContext):
            return True
        if isinstance(obj, types.BuiltinMethodType):
            owner = obj.__self__
            if type(owner) is str:
                return obj.__name__ in _STR_METHODS
            if type(owner) is dict:
                return obj.__name__ in _DICT_METHODS
            if type(owner) in (list, tuple):
                return obj.__name__ in _SEQ_METHODS
            return False
        if isinstance(obj, types.MethodType):
            return isinstance(obj.__self__, LoopContext) and obj.__name__ in _LOOP_METHODS
        return False

    # -- filters ----------------------------------------------------------------------------

    def _checked(self, fn: Callable[..., Any], pre: Callable[..., None] | None = None) -> Callable[..., Any]:
        """`fn` with its result size-checked (functools.wraps keeps Jinja's pass_* marker)."""

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if pre is not None:
                pre(*args, **kwargs)
            return self.paved_vet(fn(*args, **kwargs))

        return checked

    def _join(self, value: Any, d: Any = "", attribute: Any = None) -> str:
        sep = self._text(d)
        getter = None if attribute is None else make_attrgetter(self, attribute)
        texts: list[str] = []
        total = 0
        for item in value:
            text = self._text(item if getter is None else getter(item))
            total += len(text) + (len(sep) if texts else 0)
            if total > self.max_chars:
                raise self._limit("a join")
            texts.append(text)
        return sep.join(texts)

    def _list(self, value: Any) -> list[Any]:
        out: list[Any] = []
        total = 1
        for item in value:
            kind = type(item)
            if kind is int:
                total += _int_weight(item)
            elif kind is float or kind is bool or item is None:
                total += 1  # the common case, inline: a call per item would dominate
            elif kind is str:
                total += len(item) + 1
            else:
                total += self.weigh(item)
            if total > self.max_chars:
                raise self._limit("a list")
            out.append(item)
        _charge(total)
        cache = _weights()
        if cache is not None:
            cache.put(out, total)
        return out

    def _replace(self, s: Any, old: Any, new: Any, count: Any = None) -> str:
        text, old_text, new_text = self._text(s), self._text(old), self._text(new)
        if count is not None and not _is_int(count):
            raise TypeError("replace() count must be an integer")
        hits = text.count(old_text) if old_text else len(text) + 1
        if count is not None and count >= 0:
            hits = min(hits, count)
        if len(text) + hits * (len(new_text) - len(old_text)) > self.max_chars:
            raise self._limit("a replace")
        return text.replace(old_text, new_text, -1 if count is None else count)

    def _sum(self, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
        if not isinstance(start, int | float):
            raise TypeError("sum() adds numbers only")
        getter = None if attribute is None else make_attrgetter(self, attribute)
        total = start
        for item in iterable:
            number = item if getter is None else getter(item)
            if not isinstance(number, int | float):
                raise TypeError("sum() adds numbers only")
            total = self.paved_vet(total + number)
        return total

    def _tojson(self, value: Any, indent: Any = None) -> str:
        if indent is not None and (not _is_int(indent) or not 0 <= indent <= 8):
            raise TypeError("tojson() indent must be an integer from 0 to 8")
        # Each slot of the weight can grow into at most `indent + 1` characters of layout.
        self.weigh(value, self.max_chars // (1 + (indent or 0)))
        text = json.dumps(value, ensure_ascii=False, indent=indent, allow_nan=False)
        if len(text) > self.max_chars:
            raise self._limit("a tojson")
        return text

    def _indent(self, s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> str:
        text = self._text(s)
        if isinstance(width, str):
            pad = len(width)
        elif _is_int(width):
            pad = width
        else:
            raise TypeError("indent() width must be an integer or a string")
        if not 0 <= pad <= 256:
            raise _RenderLimit("indent() width must be between 0 and 256")
        if len(text) + (text.count("\n") + 1) * pad > self.max_chars:
            raise self._limit("an indent")
        return str(FILTERS["indent"](text, width, first, blank))

    @staticmethod
    def _round(value: Any, precision: Any = 0, method: Any = "common") -> Any:
        # round(1, -10**7) and floor/ceil's 10**precision compute huge powers in C, holding the
        # GIL (and at compile time too, when folded): the precision is bounded first.
        if not _is_int(precision) or not -20 <= precision <= 20:
            raise _RenderLimit("round() precision must be an integer from -20 to 20")
        if method not in ("common", "ceil", "floor"):
            raise _RenderLimit("round() method must be common, ceil or floor")
        return FILTERS["round"](value, precision, method)

    @staticmethod
    def _wordwrap_pre(
        _env: Any,
        s: Any,
        width: Any = 79,
        break_long_words: bool = True,
        wrapstring: Any = None,
        break_on_hyphens: bool = True,
    ) -> None:
        # The output is at most len(s) * (1 + len(wrapstring)): bounded before it is built.
        if not _is_int(width) or not 1 <= width <= 10_000:
            raise _RenderLimit("wordwrap() width must be between 1 and 10000")
        if wrapstring is not None and (not isinstance(wrapstring, str) or len(wrapstring) > 16):
            raise _RenderLimit("wordwrap() wrapstring must be a string of at most 16 characters")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- static vetting ---------------------------------------------------------------------------

_FORBIDDEN_NODES: tuple[tuple[type[nodes.Node], str], ...] = (
    (nodes.Extends, "{% extends %} is not allowed: templates have no loader"),
    (nodes.Include, "{% include %} is not allowed: templates have no loader"),
    (nodes.Import, "{% import %} is not allowed: templates have no loader"),
    (nodes.FromImport, "{% from ... import %} is not allowed: templates have no loader"),
    (nodes.Block, "{% block %} is not allowed: templates have no inheritance"),
    (nodes.EvalContextModifier, "{% autoescape %} is not allowed: prompts are not HTML"),
)


def _private(name: object) -> bool:
    return isinstance(name, str) and any(part.startswith("_") for part in name.split("."))


def _vet_source(env: _PromptEnvironment, source: str, param: str) -> nodes.Template:
    """Refuse (GatewayError 400) what a template may never do, from its syntax tree; returns
    the tree (so it is compiled without parsing the source again)."""
    try:
        tree = env.parse(source)
        found = list(tree.find_all(nodes.Node))
    except TemplateSyntaxError as exc:
        raise _bad(
            f"{param}: template syntax error on line {exc.lineno}: {_clip(exc.message or '')}",
            param=param,
            code="template_syntax_error",
        ) from None
    except RecursionError:
        raise _refused(f"{param}: the template is nested too deeply", param) from None
    eval_ctx = nodes.EvalContext(env)
    for node in found:
        for kind, why in _FORBIDDEN_NODES:
            if isinstance(node, kind):
                raise _refused(f"{param}: {why}", param)
        if isinstance(node, nodes.Getattr | nodes.NSRef) and _private(node.attr):
            raise _refused(f"{param}: access to the attribute '{node.attr}' is not allowed", param)
        if isinstance(node, nodes.Getitem):
            try:
                key = node.arg.as_const(eval_ctx)
            except Exception:  # noqa: BLE001 - not a constant: the sandbox checks it at render
                key = None
            if _private(key):
                raise _refused(f"{param}: access to the item '{_clip(str(key))}' is not allowed", param)
        if isinstance(node, nodes.Filter):
            if node.name == "attr":
                raise _refused(f"{param}: the 'attr' filter is not allowed", param)
            if node.name not in env.filters:
                allowed = ", ".join(sorted(env.filters))
                raise _refused(
                    f"{param}: the filter '{node.name}' is not allowed (allowed: {allowed})", param
                )
        if isinstance(node, nodes.Test) and node.name not in env.tests:
            raise _refused(f"{param}: the test '{node.name}' is not allowed", param)
        if isinstance(node, nodes.Filter | nodes.Test):
            _vet_attribute_args(node, param, eval_ctx)
    return tree


def _vet_attribute_args(node: nodes.Filter | nodes.Test, param: str, eval_ctx: nodes.EvalContext) -> None:
    candidates = [kw.value for kw in node.kwargs if kw.key == "attribute"]
    if node.name in _ATTRIBUTE_FILTERS and node.args:
        candidates.append(node.args[0])
    for candidate in candidates:
        try:
            value = candidate.as_const(eval_ctx)
        except Exception:  # noqa: BLE001, S112 - dynamic: the sandbox's getitem checks it at render
            continue
        if _private(value):
            raise _refused(
                f"{param}: the attribute '{_clip(str(value))}' in filter '{node.name}' is not allowed", param
            )


def _compile(env: _PromptEnvironment, source: str | nodes.Template, param: str) -> Template:
    try:
        code = env.compile(source, filename=_TEMPLATE_FILENAME)
        return env.template_class.from_code(env, code, env.make_globals(None), None)
    except TemplateSyntaxError as exc:  # an unknown test or filter surfaces here too
        raise _bad(
            f"{param}: template error on line {exc.lineno}: {_clip(exc.message or '')}",
            param=param,
            code="template_syntax_error",
        ) from None
    except (RecursionError, SyntaxError, MemoryError, OverflowError):
        # Python's own compiler limits (indentation depth, statically nested blocks, nested
        # parentheses) on a template that parsed: the template is too deep, not a 500.
        raise _refused(f"{param}: the template is nested too deeply", param) from None
    except _CompilerDied:
        raise _refused(f"{param}: the template is too large to compile", param) from None


class _CompilerDied(Exception):
    """The child compiling a template's Python ended without an answer (killed for memory)."""


def _compile_python(source: str, filename: str) -> types.CodeType:
    """compile(source), in a child process when it is big (_INLINE_COMPILE_CHARS), killed at
    the current job's deadline (_DeadlineExceeded)."""
    if len(source) <= _INLINE_COMPILE_CHARS:
        return compile(source, filename, "exec", dont_inherit=True)
    watchdog: _Watchdog | None = getattr(_render_state, "watchdog", None)
    deadline = watchdog.deadline if watchdog is not None else time.monotonic() + _COMPILE_TIMEOUT_S
    command = [sys.executable, "-I", "-S", "-c", _COMPILER, filename]
    try:
        child = subprocess.Popen(  # noqa: S603 - this interpreter and a fixed script; source on stdin
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
    except OSError:  # no child can be started here (no executable, no processes left): compile inline
        return compile(source, filename, "exec", dont_inherit=True)
    if watchdog is not None:
        watchdog.adopt(child)
    try:
        with child:
            try:
                out, _ = child.communicate(
                    source.encode("utf-8", "surrogatepass"), timeout=max(0.0, deadline - time.monotonic())
                )
            except subprocess.TimeoutExpired:
                _kill_and_reap(child)
                raise _DeadlineExceeded from None
            except BaseException:  # the watchdog's interruption, or anything else
                _kill_and_reap(child)  # no child outlives its job
                raise
    finally:
        if watchdog is not None:
            watchdog.adopt(None)
    if child.returncode != 0 and time.monotonic() >= deadline:
        raise _DeadlineExceeded  # the watchdog killed it, before this thread's interruption came
    if out[:1] == b"C" and child.returncode == 0:
        return cast("types.CodeType", marshal.loads(out[1:]))  # noqa: S302 - our own child's output
    error = _COMPILE_ERRORS.get(out[1:]) if out[:1] == b"E" else None
    if error is not None:
        raise error
    raise _CompilerDied


def _kill_and_reap(child: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child and wait for it (at once: nothing outlives SIGKILL). The watchdog
    kicks this thread every _KICK_INTERVAL_S past the deadline, which is exactly when this
    runs, so kicks are absorbed until it is done (the caller raises the deadline anyway)."""
    while True:
        try:
            child.kill()
            child.wait()
            return
        except _DeadlineExceeded:
            continue


# -- rendering under a deadline ---------------------------------------------------------------


def _deadline_tracer(deadline: float) -> Callable[[types.FrameType, str, Any], Any]:
    monotonic = time.monotonic

    def local(frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "line" and monotonic() > deadline:
            raise _DeadlineExceeded
        return local

    def on_call(frame: types.FrameType, event: str, arg: Any) -> Any:
        # Every Python call in the worker comes through here (filters, the runtime, generator
        # resumptions); only the template's own frames get (costlier) line events.
        if monotonic() > deadline:
            raise _DeadlineExceeded
        return local if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    return on_call


_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc


def _absorb() -> None:
    """Nothing: calling it lets a pending asynchronous exception be delivered."""


class _Watchdog:
    """Interrupts the worker thread that created it once `deadline` passes, by raising
    _DeadlineExceeded in it asynchronously, again every _KICK_INTERVAL_S until the worker
    calls close(). One raise is not enough: CPython drops a thread's trace function when it
    raises, and a raise that lands in a generator being finalized is swallowed ("Exception
    ignored"), after which the render would go on with no deadline. After close() returns no
    interruption is pending or will come."""

    def __init__(self, deadline: float):
        self.deadline = deadline  # the worker may move it (compile, then render)
        # What its job answers when an interruption reaches it outside the job's own handlers.
        self.timeout_error: Callable[[], GatewayError] = lambda: _refused(
            "the template took too long to compile", None
        )
        self._thread_id = threading.get_ident()
        self._lock = threading.Lock()
        self._done = False
        self._child: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="paved-template-watchdog", daemon=True).start()

    def _watch(self) -> None:
        kicks = 0
        while kicks < _MAX_KICKS:
            remaining = self.deadline - time.monotonic()
            if remaining > 0:
                # Woken at least every 0.1 s: the worker may have moved the deadline earlier.
                if self._stop.wait(min(remaining, 0.1)):
                    return
                continue
            with self._lock:
                if self._done:
                    return
                if kicks == 0 and self._child is not None:
                    # Killed and reaped from here, where no kick lands: an interruption of the
                    # worker between its timeout and its own kill, or inside its wait, would
                    # leave a compiler running or unreaped.
                    _kill_and_reap(self._child)
                _set_async_exc(ctypes.c_ulong(self._thread_id), ctypes.py_object(_DeadlineExceeded))
            kicks += 1
            if self._stop.wait(_KICK_INTERVAL_S):
                return

    def adopt(self, child: subprocess.Popen[bytes] | None) -> None:
        """The child compiler to kill at the deadline (None once it has ended)."""
        with self._lock:
            self._child = child

    def close(self) -> None:
        while True:
            try:
                with self._lock:
                    self._done = True
                self._stop.set()
                # A kick sent before `done` was set is delivered at the next Python call's
                # start: taken here. (Clearing it with SetAsyncExc(id, NULL) instead leaves
                # CPython 3.11's eval breaker signalled for good.)
                _absorb()
                return
            except _DeadlineExceeded:  # delivered on the way out: done is set, so once more
                continue


class _LRU:
    """A bounded, thread-safe LRU map (rendering threads and the event loop share it)."""

    def __init__(self, max_entries: int, max_weight: int | None = None):
        self._data: OrderedDict[Any, tuple[int, Any]] = OrderedDict()
        self._max_entries = max_entries
        self._max_weight = max_weight
        self._weight = 0
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                return None
            self._data.move_to_end(key)
            return entry[1]

    def put(self, key: Any, value: Any, weight: int = 0) -> None:
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._weight -= old[0]
            self._data[key] = (weight, value)
            self._weight += weight
            while len(self._data) > self._max_entries or (
                self._max_weight is not None and self._weight > self._max_weight and len(self._data) > 1
            ):
                _, (dropped, _) = self._data.popitem(last=False)
                self._weight -= dropped

    def pop(self, key: Any) -> None:
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._weight -= old[0]


# -- the registry -----------------------------------------------------------------------------


def _template_from_row(row: Any) -> PromptTemplate:
    return PromptTemplate(
        name=row.name,
        version=int(row.version),
        messages=tuple(
            types.MappingProxyType({"role": str(m["role"]), "content": str(m["content"])})
            for m in row.messages
        ),
        description=row.description or "",
        created_at=utc(row.created_at) or utc_now(),  # NOT NULL column: the fallback never runs
    )


def _busy() -> GatewayError:
    return GatewayError(
        503,
        "prompt templates are rendering at capacity; retry",
        code="template_render_busy",
        headers={"Retry-After": "1"},
    )


def _not_found(ref: str, param: str = "template") -> GatewayError:
    return GatewayError(404, f"no prompt template '{ref}'", code="template_not_found", param=param)


class TemplateRegistry:
    """Versioned prompt templates and tenant prompting over a GatewayStore; renders templates."""

    def __init__(
        self,
        store: GatewayStore,
        *,
        render_timeout_s: float = 0.25,
        max_output_chars: int = 100_000,
        cache_s: float = 1.0,
        max_concurrent_renders: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 < render_timeout_s <= 60:
            raise ValueError("render_timeout_s must be in (0, 60] seconds")
        if not 1 <= max_output_chars <= 10_000_000:
            raise ValueError("max_output_chars must be between 1 and 10,000,000")
        if not 0 <= cache_s <= 60:
            raise ValueError("cache_s must be between 0 and 60 seconds")
        if not 1 <= max_concurrent_renders <= 64:
            raise ValueError("max_concurrent_renders must be between 1 and 64")
        self._store = store
        self._timeout_s = render_timeout_s
        self._max_output = max_output_chars
        self._cache_s = cache_s
        self._clock = clock
        self._env = _PromptEnvironment(max_output_chars)
        # Rendering has its own threads: a burst of renders never queues the database's work.
        self._pool = ThreadPoolExecutor(
            max_workers=max_concurrent_renders, thread_name_prefix="paved-template"
        )
        # Free workers: taken before a job is submitted, given back by the worker when it is
        # done, so a job never queues behind a worker that is still busy (or stuck).
        self._slots = threading.Semaphore(max_concurrent_renders)
        self._pinned = _LRU(_MAX_CACHED)  # (name, version) -> PromptTemplate, forever
        self._expiring = _LRU(_MAX_CACHED * 4)  # key -> (expires_at, value); misses as value None
        self._compiled = _LRU(_MAX_COMPILED, _MAX_COMPILED_SOURCE)  # (name, version) -> templates

    async def start(self) -> None:
        await self._store.create_tables(metadata)

    async def admin_prompting(self, tenant: str) -> TenantPrompting:
        """The tenant's prompting read fresh for the admin API; 404 for an unknown tenant."""
        validate_tenant_name(tenant)
        if await self._store.get_tenant(tenant) is None:
            raise GatewayError(404, f"no tenant named '{tenant}'", code="tenant_not_found", param="tenant")
        return await self.tenant_prompting(tenant, fresh=True)

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _in_pool(self, wait_s: float, fn: Callable[..., _T], *args: Any) -> _T:
        """fn(*args) in a free worker, waiting at most `wait_s` for one (then 503); fn runs
        under a _Watchdog it is given as its first argument."""
        give_up = time.monotonic() + wait_s
        while not self._slots.acquire(blocking=False):
            if time.monotonic() >= give_up:
                raise _busy()
            await asyncio.sleep(0.005)
        try:
            job = self._pool.submit(self._guarded, fn, *args)
        except BaseException:
            self._slots.release()
            raise
        # A job cancelled before it ran never reaches _guarded's release.
        job.add_done_callback(lambda f: self._slots.release() if f.cancelled() else None)
        try:
            return await asyncio.wait_for(
                asyncio.wrap_future(job), wait_s + _COMPILE_TIMEOUT_S + _QUEUE_GRACE_S
            )
        except TimeoutError:
            raise _busy() from None

    def _guarded(self, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            watchdog = _Watchdog(time.monotonic() + _COMPILE_TIMEOUT_S)
            _render_state.watchdog = watchdog  # whose deadline a child compiler is killed at
            try:
                try:
                    return fn(watchdog, *args)
                finally:
                    _render_state.watchdog = None
                    watchdog.close()
            except _DeadlineExceeded:
                raise watchdog.timeout_error() from None
        finally:
            self._slots.release()

    # -- short-lived cache ------------------------------------------------------------------

    def _cached(self, key: Any) -> tuple[bool, Any]:
        entry = self._expiring.get(key)
        if entry is None or entry[0] <= self._clock():
            return False, None
        return True, entry[1]

    def _remember(self, key: Any, value: Any, started: float) -> None:
        # Counted from when the read began, so nothing is served older than cache_s.
        if self._cache_s > 0:
            self._expiring.put(key, (started + self._cache_s, value))

    # -- templates --------------------------------------------------------------------------

    async def create(self, name: str, messages: list[dict], *, description: str = "") -> PromptTemplate:
        name = _validate_name(name)
        clean = _validate_messages(messages)
        if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
            raise _bad(
                f"description must be a string of at most {MAX_DESCRIPTION_CHARS} characters", "description"
            )
        compiled = await self._in_pool(self._timeout_s, self._vet_all, clean)
        created = await self._store.run(self._create_sync, name, clean, description)
        self._pinned.put((name, created.version), created)
        self._compiled.put((name, created.version), compiled, sum(len(m["content"]) for m in clean))
        self._expiring.pop(("pinned", name, created.version))
        self._remember(("latest", name), created.version, self._clock())
        return created

    def _vet_all(self, _watchdog: _Watchdog, messages: list[dict[str, str]]) -> tuple[Template, ...]:
        compiled = []
        for i, message in enumerate(messages):
            param = f"messages[{i}].content"
            tree = _vet_source(self._env, message["content"], param)
            compiled.append(_compile(self._env, tree, param))
        return tuple(compiled)

    def _create_sync(self, name: str, messages: list[dict[str, str]], description: str) -> PromptTemplate:
        for _ in range(_CREATE_ATTEMPTS):
            try:
                with self._store.engine.begin() as conn:
                    if conn.dialect.name == "postgresql":
                        # Creators of one name take turns (SQLite's BEGIN IMMEDIATE already
                        # does): optimistic retries alone can all lose under many replicas.
                        conn.execute(
                            sa.text("SELECT pg_advisory_xact_lock(hashtext(:key))"),
                            {"key": "paved.gateway.template:" + name},
                        )
                    latest = conn.execute(
                        sa.select(sa.func.max(templates_table.c.version)).where(
                            templates_table.c.name == name
                        )
                    ).scalar()
                    version = int(latest or 0) + 1
                    created = utc_now()
                    conn.execute(
                        templates_table.insert().values(
                            name=name,
                            version=version,
                            messages=messages,
                            description=description,
                            created_at=created,
                        )
                    )
            except IntegrityError:
                continue  # another creator took this version: read the new latest and retry
            return PromptTemplate(
                name=name,
                version=version,
                messages=tuple(types.MappingProxyType(dict(m)) for m in messages),
                description=description,
                created_at=created,
            )
        raise GatewayError(409, f"template '{name}' is being created concurrently; retry", code="conflict")

    async def get(self, ref: str) -> PromptTemplate:
        name, version = parse_template_ref(ref)
        if version is None:
            started = self._clock()
            hit, latest = self._cached(("latest", name))
            if not hit:
                template = await self._store.run(self._read_sync, name, None)
                latest = None if template is None else template.version
                self._remember(("latest", name), latest, started)
                if template is not None:
                    self._pinned.put((name, template.version), template)
            if latest is None:
                raise _not_found(name)
            version = latest
        found: PromptTemplate | None = self._pinned.get((name, version))
        if found is not None:
            return found
        started = self._clock()
        hit, _ = self._cached(("pinned", name, version))
        if hit:
            raise _not_found(f"{name}@{version}")
        found = await self._store.run(self._read_sync, name, version)
        if found is None:
            self._remember(("pinned", name, version), None, started)
            raise _not_found(f"{name}@{version}")
        self._pinned.put((name, version), found)
        return found

    def _read_sync(self, name: str, version: int | None) -> PromptTemplate | None:
        query = sa.select(templates_table).where(templates_table.c.name == name)
        if version is None:
            query = query.order_by(templates_table.c.version.desc()).limit(1)
        else:
            query = query.where(templates_table.c.version == version)
        with self._store.engine.connect() as conn:
            row = conn.execute(query).first()
        return None if row is None else _template_from_row(row)

    async def list(self, name: str | None = None) -> list[PromptTemplate]:
        """Every version of `name`, oldest first; without a name, the latest version of each
        template, by name."""
        if name is not None:
            _validate_name(name)
        return await self._store.run(self._list_sync, name)

    def _list_sync(self, name: str | None) -> builtins.list[PromptTemplate]:
        t = templates_table
        if name is not None:
            query = sa.select(t).where(t.c.name == name).order_by(t.c.version)
        else:
            latest = (
                sa.select(t.c.name, sa.func.max(t.c.version).label("version")).group_by(t.c.name).subquery()
            )
            query = (
                sa.select(t)
                .join(latest, sa.and_(t.c.name == latest.c.name, t.c.version == latest.c.version))
                .order_by(t.c.name)
            )
        with self._store.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [_template_from_row(r) for r in rows]

    # -- tenant prompting -------------------------------------------------------------------

    async def set_tenant_prompting(
        self, tenant: str, *, system_prompt: str | None, default_template: str | None
    ) -> TenantPrompting:
        """Replace the tenant's prompting (None or "" clears a field)."""
        validate_tenant_name(tenant)
        if system_prompt is not None:
            if not isinstance(system_prompt, str):
                raise _bad("system_prompt must be a string or null", param="system_prompt")
            if len(system_prompt.encode("utf-8", "surrogatepass")) > MAX_SYSTEM_PROMPT_BYTES:
                raise _bad(
                    f"system_prompt is over {MAX_SYSTEM_PROMPT_BYTES // 1024} KiB", param="system_prompt"
                )
        if default_template is not None:
            if not isinstance(default_template, str):
                raise _bad("default_template must be a template ref or null", param="default_template")
            if default_template:
                try:
                    parse_template_ref(default_template)
                except GatewayError as exc:
                    raise _bad(exc.message, param="default_template") from None
        if await self._store.get_tenant(tenant) is None:
            raise GatewayError(404, f"no tenant named '{tenant}'", code="tenant_not_found", param="tenant")
        if default_template:
            try:
                await self.get(default_template)
            except GatewayError as exc:
                if exc.status == 404:
                    raise _not_found(default_template, param="default_template") from None
                raise
        prompting = TenantPrompting(tenant, system_prompt or None, default_template or None)
        await self._store.run(self._set_prompting_sync, prompting)
        self._remember(("tenant", tenant), prompting, self._clock())
        return prompting

    def _set_prompting_sync(self, p: TenantPrompting) -> None:
        t = tenant_prompting_table
        values = {
            "system_prompt": p.system_prompt,
            "default_template": p.default_template,
            "updated_at": utc_now(),
        }
        for attempt in range(2):
            try:
                with self._store.engine.begin() as conn:
                    updated = conn.execute(t.update().where(t.c.tenant == p.tenant).values(**values)).rowcount
                    if not updated:
                        conn.execute(t.insert().values(tenant=p.tenant, **values))
                return
            except IntegrityError:
                if attempt == 1:  # a concurrent first write won twice: cannot happen, but bounded
                    raise GatewayError(
                        409, "tenant prompting changed concurrently; retry", code="conflict"
                    ) from None

    async def tenant_prompting(self, tenant: str, *, fresh: bool = False) -> TenantPrompting:
        """The tenant's prompting (None, None when never set); at most cache_s old unless fresh."""
        if not isinstance(tenant, str) or TENANT_NAME_RE.fullmatch(tenant) is None:
            return TenantPrompting(str(tenant))  # no such tenant can exist: nothing to read
        started = self._clock()
        if not fresh:
            hit, cached = self._cached(("tenant", tenant))
            if hit:
                return cached
        prompting = await self._store.run(self._get_prompting_sync, tenant)
        self._remember(("tenant", tenant), prompting, started)
        return prompting

    def _get_prompting_sync(self, tenant: str) -> TenantPrompting:
        t = tenant_prompting_table
        with self._store.engine.connect() as conn:
            row = conn.execute(sa.select(t).where(t.c.tenant == tenant)).first()
        if row is None:
            return TenantPrompting(tenant)
        return TenantPrompting(tenant, row.system_prompt, row.default_template)

    # -- rendering --------------------------------------------------------------------------

    async def render(self, template: PromptTemplate, variables: object) -> builtins.list[dict[str, str]]:
        """The template's messages rendered with `variables`, in order (GatewayError 400 on any
        refusal, limit or template error; 503 when every rendering thread stays busy)."""
        if not isinstance(template, PromptTemplate):
            raise TypeError("render() takes a PromptTemplate (from get())")
        return await self._in_pool(self._timeout_s, self._render_sync, template, variables)

    def _compiled_for(self, template: PromptTemplate) -> tuple[Template, ...]:
        key = (template.name, template.version)
        compiled: tuple[Template, ...] | None = self._compiled.get(key)
        if compiled is None:
            compiled = tuple(
                _compile(self._env, m["content"], f"messages[{i}].content")
                for i, m in enumerate(template.messages)
            )
            weight = sum(len(m["content"]) for m in template.messages)
            self._compiled.put(key, compiled, weight)
        return compiled

    def _render_sync(
        self, watchdog: _Watchdog, template: PromptTemplate, variables: object
    ) -> builtins.list[dict[str, str]]:
        compiled = self._compiled_for(template)  # under the watchdog's compile deadline
        data = _validate_variables(variables)
        index = 0
        # The render's answer first, then its deadline: a watchdog that fires in between (a
        # loaded machine) must not answer with the compile-time message.
        watchdog.timeout_error = lambda: self._render_error(
            template, index, f"rendering took longer than the limit of {self._timeout_s:g} s"
        )
        deadline = time.monotonic() + self._timeout_s
        watchdog.deadline = deadline
        previous = sys.gettrace()
        _render_state.weights = _WeightCache(8 * self._max_output)
        _render_state.budget = _BUILT_BUDGET_FACTOR * self._max_output
        tracer = _deadline_tracer(deadline)
        sys.settrace(tracer)
        try:
            out = []
            used = 0
            for message, tmpl in zip(template.messages, compiled, strict=True):
                chunks = []
                for chunk in _generate(tmpl, data):
                    if time.monotonic() > deadline:  # in case anything switched the tracer off
                        raise _DeadlineExceeded
                    if sys.gettrace() is not tracer:  # CPython drops a tracer that raised
                        sys.settrace(tracer)
                    used += len(chunk)
                    if used > self._max_output:
                        raise _RenderLimit(
                            f"the output would exceed the limit of {self._max_output} characters"
                        )
                    chunks.append(chunk)
                content = "".join(chunks)
                try:
                    content.encode("utf-8")
                except UnicodeEncodeError:
                    # A lone surrogate ('\ud800' in a literal): the response body is UTF-8.
                    raise _RenderLimit("the output is not valid Unicode text (a lone surrogate)") from None
                out.append({"role": message["role"], "content": content})
                index += 1
            return out
        except _DeadlineExceeded:
            raise self._render_error(
                template, index, f"rendering took longer than the limit of {self._timeout_s:g} s"
            ) from None
        except SecurityError as exc:
            raise GatewayError(
                400,
                f"template {template.ref}, message {index}: refused: {_clip(str(exc))}",
                code="template_refused",
                param="template",
            ) from None
        except UndefinedError as exc:
            raise self._render_error(template, index, f"undefined variable: {_clip(str(exc))}") from None
        except (_RenderLimit, TemplateError) as exc:
            raise self._render_error(template, index, _clip(str(exc))) from None
        except RecursionError:
            raise self._render_error(template, index, "recursion too deep") from None
        except MemoryError:
            raise self._render_error(template, index, "out of memory") from None
        except Exception as exc:  # noqa: BLE001 - whatever a template raises is the caller's 400
            raise self._render_error(template, index, f"{type(exc).__name__}: {_clip(str(exc))}") from None
        finally:
            sys.settrace(previous)
            _render_state.weights = None
            _render_state.budget = None

    @staticmethod
    def _render_error(template: PromptTemplate, index: int, why: str) -> GatewayError:
        return GatewayError(
            400,
            f"template {template.ref}, message {index}: {why}",
            code="template_render_error",
            param="variables" if why.startswith("undefined variable") else "template",
        )


def _generate(template: Template, data: dict[str, Any]) -> Iterator[str]:
    # Template.generate re-raises through Jinja's traceback rewriting; the exception types stay.
    yield from template.generate(data)


# -- admin API --------------------------------------------------------------------------------


class TemplateCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    messages: list[Any]
    description: StrictStr = ""


class PromptingBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    system_prompt: StrictStr | None = None
    default_template: StrictStr | None = None


def templates_router(registry: TemplateRegistry, admin: AdminAuth) -> APIRouter:
    """The admin API over templates and tenant prompting (admin key checked before the body):

    POST /admin/v1/templates {name, messages, description?}   -> 201 the new version
    GET  /admin/v1/templates[?name=N]     -> latest version of each template (all versions of N)
    GET  /admin/v1/templates/{name}       -> all versions of a template (404 if none)
    GET  /admin/v1/templates/{name}/{version}                 -> that version
    PUT  /admin/v1/tenants/{tenant}/prompting {system_prompt, default_template} -> prompting
    GET  /admin/v1/tenants/{tenant}/prompting                  -> prompting
    """
    router = APIRouter(prefix="/admin/v1", route_class=_admin_route_class(admin))

    @router.post("/templates", status_code=201)
    async def create_template(body: TemplateCreate) -> dict[str, Any]:
        created = await registry.create(body.name, body.messages, description=body.description)
        return created.to_dict()

    @router.get("/templates")
    async def list_templates(name: Annotated[str | None, Query(max_length=64)] = None) -> dict[str, Any]:
        return {"object": "list", "data": [t.to_dict() for t in await registry.list(name)]}

    @router.get("/templates/{name}")
    async def template_versions(name: str) -> dict[str, Any]:
        versions = await registry.list(name)
        if not versions:
            raise _not_found(name, param="name")
        return {"object": "list", "data": [t.to_dict() for t in versions]}

    @router.get("/templates/{name}/{version}")
    async def template_version(name: str, version: str) -> dict[str, Any]:
        return (await registry.get(f"{name}@{version}")).to_dict()

    @router.put("/tenants/{tenant}/prompting")
    async def put_prompting(tenant: str, body: PromptingBody) -> dict[str, Any]:
        prompting = await registry.set_tenant_prompting(
            tenant, system_prompt=body.system_prompt, default_template=body.default_template
        )
        return prompting.to_dict()

    @router.get("/tenants/{tenant}/prompting")
    async def get_prompting(tenant: str) -> dict[str, Any]:
        return (await registry.admin_prompting(tenant)).to_dict()

    return router
