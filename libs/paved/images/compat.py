"""Static compatibility of paved (and of the pinned Triton vLLM backend) with a pinned vLLM wheel.

Nothing here imports vLLM: the wheel is read as a zip and its modules as ASTs, so a GPU wheel
is checked on a CPU machine and nothing is installed. Checked, for one lock and its wheel:

  * the wheel is the pinned one (name, version, sha256) and pins the lock's torch / CUDA major;
  * every vLLM module and name paved imports exists (the list is collected from paved's
    sources by AST, never maintained by hand);
  * every class paved derives from a vLLM class still defines the methods paved overrides,
    with a compatible signature and kind, and paved implements all its abstract methods;
  * the entry-point groups paved registers into (its dist-info) are still read by vLLM;
  * every vLLM module and name the pinned Triton release's vLLM backend imports (the manifest
    recorded in the lock) exists.

`check()` returns a report; `main()` writes it as JSON (the image rules keep it beside each
image, the push refuses an image whose report is not ok, and a test fails on it).
"""

from __future__ import annotations

import argparse
import ast
import configparser
import dataclasses
import email.parser
import functools
import hashlib
import json
import re
import sys
import zipfile
from collections import defaultdict
from pathlib import Path

from paved.images import lock as locks

ROOT = "vllm"
_EXT_SUFFIXES = (".so", ".pyd")


# ---- what our sources import -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImportRef:
    module: str
    name: str | None  # None for `import module`
    where: str  # file:line
    optional: bool = False  # inside `try: ... except ImportError`

    def text(self) -> str:
        return self.module if self.name is None else f"{self.module}:{self.name}"


@dataclasses.dataclass(frozen=True)
class Sig:
    """The calling shape of a def: positional parameters after self/cls, and its kind."""

    kind: str  # method | classmethod | staticmethod
    n_positional: int
    n_required: int
    varargs: bool
    required_kwonly: tuple[str, ...]
    abstract: bool = False

    @classmethod
    def of(cls, node: ast.FunctionDef | ast.AsyncFunctionDef) -> Sig:
        decorators = {_dotted(d).rsplit(".", 1)[-1] for d in node.decorator_list}
        kind = (
            "staticmethod"
            if "staticmethod" in decorators
            else "classmethod"
            if "classmethod" in decorators
            else "method"
        )
        a = node.args
        params = [*a.posonlyargs, *a.args]
        if kind != "staticmethod" and params:
            params = params[1:]
        n_defaults = min(len(a.defaults), len(params))
        kwonly = tuple(
            arg.arg for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True) if default is None
        )
        return cls(
            kind,
            len(params),
            len(params) - n_defaults,
            a.vararg is not None,
            kwonly,
            "abstractmethod" in decorators,
        )

    def accepts_calls_of(self, base: Sig) -> str | None:
        """Why a call that fits `base` would not fit this override (None: it fits)."""
        if self.kind != base.kind:
            return f"is a {self.kind}, the base's is a {base.kind}"
        if base.varargs and not self.varargs:
            return "takes no *args, the base's does"
        if self.n_required > base.n_required:
            return f"requires {self.n_required} positional arguments, callers may pass {base.n_required}"
        if not self.varargs and self.n_positional < base.n_positional:
            return f"takes {self.n_positional} positional arguments, callers may pass {base.n_positional}"
        extra = sorted(set(self.required_kwonly) - set(base.required_kwonly))
        if extra:
            return f"requires keyword arguments {extra} the base's callers do not pass"
        return None


@dataclasses.dataclass
class Subclass:
    """A class in our sources that derives from vLLM classes."""

    qualname: str  # module-ish path of the file : class name
    where: str
    vllm_bases: list[tuple[str, str]]  # (module, name)
    methods: dict[str, Sig]


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return _dotted(node.value) + "." + node.attr
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    if isinstance(node, ast.Subscript):
        return _dotted(node.value)
    return ""


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = {
        _dotted(t) for t in (handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type])
    }
    return bool(names & {"ImportError", "ModuleNotFoundError", "Exception"})


class _Collector(ast.NodeVisitor):
    def __init__(self, path: str, roots: tuple[str, ...]):
        self.path = path
        self.roots = roots
        self.refs: list[ImportRef] = []
        self.aliases: dict[str, tuple[str, str | None]] = {}  # local name -> (module, name)
        self.classes: list[ast.ClassDef] = []
        self._optional = 0

    def _ours(self, module: str) -> bool:
        return module.split(".")[0] in self.roots

    def visit_Try(self, node: ast.Try) -> None:
        self._visit_try(node)

    def visit_TryStar(self, node: ast.TryStar) -> None:
        self._visit_try(node)

    def _visit_try(self, node: ast.Try | ast.TryStar) -> None:
        guarded = any(_catches_import_error(h) for h in node.handlers)
        self._optional += guarded
        for stmt in node.body:
            self.visit(stmt)
        self._optional -= guarded
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self._ours(alias.name):
                self.refs.append(
                    ImportRef(alias.name, None, f"{self.path}:{node.lineno}", self._optional > 0)
                )
                if alias.asname:
                    self.aliases[alias.asname] = (alias.name, None)
                else:
                    self.aliases.setdefault(alias.name.split(".")[0], (alias.name.split(".")[0], None))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module or not self._ours(node.module):
            return
        for alias in node.names:
            name = None if alias.name == "*" else alias.name
            self.refs.append(ImportRef(node.module, name, f"{self.path}:{node.lineno}", self._optional > 0))
            if name:
                self.aliases[alias.asname or name] = (node.module, name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node)
        self.generic_visit(node)

    def resolve(self, expr: ast.AST) -> tuple[str, str] | None:
        """(module, name) of a base-class expression bound to one of `roots`, else None."""
        dotted = _dotted(expr)
        if not dotted:
            return None
        head, *rest = dotted.split(".")
        if head not in self.aliases:
            return None
        module, name = self.aliases[head]
        parts = ([name] if name else []) + rest
        if not parts:
            return None
        if name is None:
            return ".".join([module, *parts[:-1]]), parts[-1]
        return ".".join([module, *parts[:-1]]) if len(parts) > 1 else module, parts[-1]


def collect(
    sources: dict[str, str], roots: tuple[str, ...] = (ROOT,)
) -> tuple[list[ImportRef], list[Subclass]]:
    """Imports of `roots` and subclasses of their classes, in `sources` (path -> text)."""
    refs: list[ImportRef] = []
    subclasses: list[Subclass] = []
    for path in sorted(sources):
        tree = ast.parse(sources[path], filename=path)
        c = _Collector(path, roots)
        c.visit(tree)
        refs.extend(c.refs)
        for cls in c.classes:
            bases = [b for b in (c.resolve(e) for e in cls.bases) if b is not None]
            if not bases:
                continue
            methods = {
                n.name: Sig.of(n) for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            }
            subclasses.append(Subclass(f"{path}:{cls.name}", f"{path}:{cls.lineno}", bases, methods))
    return refs, subclasses


def entry_point_groups(text: str) -> list[str]:
    """Entry-point groups of a dist-info entry_points.txt."""
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    parser.optionxform = str  # type: ignore[assignment]
    parser.read_string(text)
    return sorted(parser.sections())


# ---- what a wheel provides ---------------------------------------------------------------


@dataclasses.dataclass
class ClassInfo:
    module: str
    name: str
    methods: dict[str, Sig]  # own and inherited (within the wheel), nearest definition wins
    owner: dict[str, str]  # method -> "module.Class" that defines it
    missing_bases: list[str]


class _Binding:
    """How a module-level name is bound."""

    def __init__(self, kind: str, node: ast.AST | None = None, source: tuple[str, str] | None = None):
        self.kind = kind  # class | def | value | import | module
        self.node = node
        self.source = source  # (module, name) for `from module import name`


def _is_type_checking(test: ast.AST) -> bool:
    return _dotted(test).rsplit(".", 1)[-1] == "TYPE_CHECKING"


class Wheel:
    """A wheel read statically: modules, their module-level names, classes and metadata."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._zip = zipfile.ZipFile(self.path)
        self._names = self._zip.namelist()
        self.modules: dict[str, str | None] = {}  # module -> member (.py / ext), None: namespace dir
        for member in self._names:
            parts = member.split("/")
            if parts[0].endswith((".dist-info", ".data")):
                continue
            for i in range(1, len(parts)):
                self.modules.setdefault(".".join(parts[:i]), None)
            leaf = parts[-1]
            if leaf == "__init__.py":
                self.modules[".".join(parts[:-1])] = member
            elif leaf.endswith(".py"):
                self.modules[".".join([*parts[:-1], leaf[:-3]])] = member
            elif leaf.endswith(_EXT_SUFFIXES):
                self.modules[".".join([*parts[:-1], leaf.split(".")[0]])] = member
        meta_member = next(n for n in self._names if n.endswith(".dist-info/METADATA"))
        self.metadata = email.parser.Parser().parsestr(self._zip.read(meta_member).decode())
        self.distribution = self.metadata["Name"]
        self.version = self.metadata["Version"]

    @functools.cached_property
    def sha256(self) -> str:
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return h.hexdigest()

    @property
    def label(self) -> str:
        return f"{self.distribution} {self.version}"

    def requires(self) -> list[str]:
        return self.metadata.get_all("Requires-Dist") or []

    def has_module(self, module: str) -> bool:
        return module in self.modules

    def is_package(self, module: str) -> bool:
        member = self.modules.get(module)
        return member is None or member.endswith("/__init__.py")

    @functools.cache  # noqa: B019 - one Wheel per process
    def _tree(self, module: str) -> ast.Module | None:
        member = self.modules.get(module)
        if member is None or not member.endswith(".py"):
            return None
        return ast.parse(self._zip.read(member), filename=member)

    def _absolute(self, module: str, level: int, target: str | None) -> str:
        package = module if self.is_package(module) else module.rpartition(".")[0]
        parts = package.split(".")
        if level > 1:
            parts = parts[: len(parts) - (level - 1)]
        return ".".join(parts + ([target] if target else []))

    @functools.cache  # noqa: B019
    def bindings(self, module: str) -> dict[str, _Binding]:
        """Names bound at module level at run time (TYPE_CHECKING-only names excluded)."""
        tree = self._tree(module)
        out: dict[str, _Binding] = {}
        if tree is None:
            return out

        def targets(t: ast.AST):
            if isinstance(t, ast.Name):
                yield t.id
            elif isinstance(t, ast.Tuple | ast.List):
                for e in t.elts:
                    yield from targets(e)
            elif isinstance(t, ast.Starred):
                yield from targets(t.value)

        def visit(body: list[ast.stmt]) -> None:
            for node in body:
                if isinstance(node, ast.ClassDef):
                    out[node.name] = _Binding("class", node)
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    out[node.name] = _Binding("def", node)
                elif isinstance(node, ast.Assign):
                    for t in node.targets:
                        for n in targets(t):
                            out[n] = _Binding("value", node)
                elif isinstance(node, ast.AnnAssign | ast.AugAssign) and node.value is not None:
                    for n in targets(node.target):
                        out[n] = _Binding("value", node)
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.asname:
                            out[a.asname] = _Binding("module", source=(a.name, ""))
                        else:
                            head = a.name.split(".")[0]
                            out[head] = _Binding("module", source=(head, ""))
                elif isinstance(node, ast.ImportFrom):
                    # Only a relative import may leave out the module.
                    src = self._absolute(module, node.level, node.module) if node.level else node.module or ""
                    for a in node.names:
                        if a.name == "*":
                            out.setdefault("*" + src, _Binding("star", source=(src, "*")))
                        else:
                            out[a.asname or a.name] = _Binding("import", source=(src, a.name))
                elif isinstance(node, ast.If):
                    if not _is_type_checking(node.test):
                        visit(node.body)
                    visit(node.orelse)
                elif isinstance(node, ast.Try | ast.TryStar):
                    visit(node.body)
                    for h in node.handlers:
                        visit(h.body)
                    visit(node.orelse)
                    visit(node.finalbody)
                elif isinstance(node, ast.With | ast.AsyncWith | ast.For | ast.While):
                    if isinstance(node, ast.For):
                        for n in targets(node.target):
                            out[n] = _Binding("value", node)
                    visit(node.body)
                    visit(getattr(node, "orelse", []))

        visit(tree.body)
        return out

    def _lazy_names(self, module: str) -> dict[str, str | None]:
        """Names a module-level __getattr__ serves: keys of module-level dict literals (their
        "module:attr" string values followed when present) and the entries of __all__."""
        tree = self._tree(module)
        names: dict[str, str | None] = {}
        if tree is None:
            return names
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                for k, v in zip(node.value.keys, node.value.values, strict=True):
                    if isinstance(k, ast.Constant) and isinstance(k.value, str):
                        target = v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else None
                        names[k.value] = target if target and ":" in target else None
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                and isinstance(node.value, ast.List | ast.Tuple)
            ):
                for e in node.value.elts:
                    if isinstance(e, ast.Constant) and isinstance(e.value, str):
                        names.setdefault(e.value, None)
        return names

    def resolve(self, module: str, name: str, _depth: int = 0) -> tuple[str, str] | str | None:
        """Where `from module import name` finds name in this wheel: (module, name) of its
        definition, "module" for a submodule, "opaque" when it cannot be followed statically
        (an extension module, a name imported from outside the wheel), None when absent."""
        if _depth > 20 or not self.has_module(module):
            return None
        member = self.modules.get(module)
        if member is not None and not member.endswith(".py"):
            return "opaque"  # extension module: its names are not visible statically
        b = self.bindings(module).get(name)
        if b is not None:
            if b.kind == "import":
                src_module, src_name = b.source  # type: ignore[misc]
                if src_module.split(".")[0] != module.split(".")[0]:
                    return "opaque"
                found = self.resolve(src_module, src_name, _depth + 1)
                if found is None and self.has_module(f"{src_module}.{src_name}"):
                    return "module"
                return found
            if b.kind == "module":
                return "module"
            return (module, name)
        if self.has_module(f"{module}.{name}"):
            return "module"
        for key, star in self.bindings(module).items():
            if key.startswith("*"):
                src = star.source[0]  # type: ignore[index]
                if src.split(".")[0] != module.split(".")[0]:
                    continue
                found = self.resolve(src, name, _depth + 1)
                if found is not None:
                    return found
        if "__getattr__" in self.bindings(module):
            lazy = self._lazy_names(module)
            if name in lazy:
                target = lazy[name]
                if target:
                    mod, _, attr = target.partition(":")
                    mod = (
                        self._absolute(module, len(mod) - len(mod.lstrip(".")), mod.lstrip("."))
                        if mod.startswith(".")
                        else mod
                    )
                    return self.resolve(mod, attr, _depth + 1)
                return "opaque"
        return None

    @functools.cache  # noqa: B019
    def class_info(self, module: str, name: str) -> ClassInfo | None:
        where = self.resolve(module, name)
        if not isinstance(where, tuple):
            return None
        mod, cls_name = where
        b = self.bindings(mod).get(cls_name)
        if b is None or b.kind != "class":
            return None
        node: ast.ClassDef = b.node  # type: ignore[assignment]
        methods: dict[str, Sig] = {}
        owner: dict[str, str] = {}
        missing: list[str] = []
        # Bases first (right to left, so the leftmost wins), then the class's own definitions.
        for base in reversed(node.bases):
            ref = self._resolve_expr(mod, base)
            if ref is None:
                continue
            info = self.class_info(*ref)
            if info is None:
                missing.append(f"{ref[0]}.{ref[1]}")
                continue
            methods.update(info.methods)
            owner.update(info.owner)
            missing.extend(info.missing_bases)
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                methods[item.name] = Sig.of(item)
                owner[item.name] = f"{mod}.{cls_name}"
        return ClassInfo(mod, cls_name, methods, owner, missing)

    def _resolve_expr(self, module: str, expr: ast.AST) -> tuple[str, str] | None:
        """(module, name) of a base-class expression inside the wheel, None if outside it."""
        dotted = _dotted(expr)
        if not dotted:
            return None
        head, *rest = dotted.split(".")
        b = self.bindings(module).get(head)
        if b is None:
            return None
        if b.kind == "class" and not rest:
            return (module, head)
        if b.kind == "import":
            src_module, src_name = b.source  # type: ignore[misc]
            if src_module.split(".")[0] != module.split(".")[0]:
                return None
            if not rest:
                return (src_module, src_name)
            return (".".join([src_module, src_name, *rest[:-1]]), rest[-1])
        if b.kind == "module" and rest:
            src_module = b.source[0]  # type: ignore[index]
            if src_module.split(".")[0] != module.split(".")[0]:
                return None
            return (".".join([src_module, *rest[:-1]]), rest[-1])
        return None

    def contains_text(self, needle: str, prefix: str = "") -> bool:
        data = needle.encode()
        for member in self._names:
            if member.startswith(prefix) and member.endswith(".py") and data in self._zip.read(member):
                return True
        return False


# ---- markers (enough of PEP 508 for Requires-Dist) ---------------------------------------

_MARKER_ENV = {
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def marker_applies(marker: str, python_version: str) -> bool:
    """Evaluates a Requires-Dist marker for Linux x86_64 and `python_version` (no extras)."""
    if not marker.strip():
        return True
    env = {**_MARKER_ENV, "python_version": python_version, "python_full_version": python_version + ".0"}
    tree = ast.parse(marker.strip(), mode="eval")

    def ver(v: str):
        return tuple(int(p) for p in v.split(".")) if re.fullmatch(r"\d+(\.\d+)*", v) else v

    def ev(n: ast.AST):
        if isinstance(n, ast.BoolOp):
            vals = [ev(v) for v in n.values]
            return all(vals) if isinstance(n.op, ast.And) else any(vals)
        if isinstance(n, ast.Compare) and len(n.ops) == 1:
            a, b = ev(n.left), ev(n.comparators[0])
            op = n.ops[0]
            if isinstance(op, ast.In | ast.NotIn):
                r = a in b
                return r if isinstance(op, ast.In) else not r
            a, b = ver(a), ver(b)
            if type(a) is not type(b):
                a, b = str(a), str(b)
            return {
                ast.Eq: a == b,
                ast.NotEq: a != b,
                ast.Lt: a < b,
                ast.LtE: a <= b,
                ast.Gt: a > b,
                ast.GtE: a >= b,
            }[type(op)]
        if isinstance(n, ast.Name):
            return env.get(n.id, "")
        if isinstance(n, ast.Constant):
            return str(n.value)
        raise ValueError(f"unsupported marker {marker!r}")

    return bool(ev(tree.body))


def pinned_requirement(wheel: Wheel, dist: str, python_version: str) -> list[str]:
    """Exact versions (`==X`) the wheel requires of `dist` on Linux x86_64."""
    out = []
    for req in wheel.requires():
        spec, _, marker = req.partition(";")
        m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$", spec)
        if (
            not m
            or m.group(1).lower().replace("_", "-") != dist
            or not marker_applies(marker, python_version)
        ):
            continue
        out += re.findall(r"==\s*([^\s,]+)", m.group(3))
    return out


def cuda_majors(wheel: Wheel, python_version: str) -> set[str]:
    """CUDA majors the wheel's requirements name (`...-cu13`, `[cu13]`)."""
    majors = set()
    for req in wheel.requires():
        spec, _, marker = req.partition(";")
        if marker_applies(marker, python_version):
            majors.update(re.findall(r"\bcu(\d{2})\b", spec.replace("-", " ").replace("_", " ")))
    return majors


# ---- the check ---------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    flavour: str
    lock: str
    lock_sha256: str
    wheel: str
    wheel_sha256: str
    engine: str
    errors: list[str] = dataclasses.field(default_factory=list)
    checked: dict = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "ok": self.ok}


def _group(refs: list[tuple[str, str | None, str]]) -> dict[str, list[tuple[str | None, str]]]:
    out: dict[str, list[tuple[str | None, str]]] = defaultdict(list)
    for module, name, where in refs:
        out[module].append((name, where))
    return out


def check_imports(wheel: Wheel, refs: list[ImportRef], who: str) -> list[str]:
    """Errors for imports of modules or names the wheel lacks (optional imports excepted)."""
    errors = []
    for module, items in sorted(
        _group([(r.module, r.name, r.where) for r in refs if not r.optional]).items()
    ):
        wheres = sorted({w for _, w in items if w})
        at = f" ({', '.join(wheres)})" if wheres else ""
        if not wheel.has_module(module):
            names = sorted({n for n, _ in items if n})
            listed = f" ({', '.join(names)})" if names else ""
            errors.append(f"{who} imports {module}{listed}{at}, but {wheel.label} has no module {module}")
            continue
        for name in sorted({n for n, _ in items if n}):
            if wheel.resolve(module, name) is None:
                w = sorted({w for n, w in items if n == name and w})
                errors.append(
                    f"{who} imports {name} from {module}{' (' + ', '.join(w) + ')' if w else ''}, "
                    f"but {module} in {wheel.label} does not define it"
                )
    return errors


def check_subclasses(
    wheel: Wheel, subclasses: list[Subclass], references: list[Wheel]
) -> tuple[list[str], list]:
    """Our overrides of vLLM base classes against the wheel. A method of ours counts as an
    override of a base when the base defines it in this wheel or in any reference wheel (the
    vLLM the dev venv tests against), so a method the new vLLM dropped is caught."""
    errors: list[str] = []
    checked = []
    for sub in subclasses:
        provided: dict[str, Sig] = dict(sub.methods)
        infos = []
        for module, name in sub.vllm_bases:
            info = wheel.class_info(module, name)
            if info is None:
                errors.append(
                    f"{sub.qualname} derives from {module}.{name}, which {wheel.label} does not define"
                )
                continue
            infos.append((module, name, info))
            for m, sig in info.methods.items():
                if not sig.abstract:
                    provided.setdefault(m, sig)
        for module, name, info in infos:
            known = set(info.methods)
            for ref in references:
                ref_info = ref.class_info(module, name)
                if ref_info is not None:
                    known |= set(ref_info.methods)
            overrides = sorted(m for m in sub.methods if m in known)
            checked.append({"class": sub.qualname, "base": f"{module}.{name}", "overrides": overrides})
            for m in overrides:
                if m not in info.methods:
                    errors.append(
                        f"{sub.qualname} overrides {name}.{m}, but {module}.{name} in {wheel.label} "
                        f"no longer defines {m} (it would never be called)"
                    )
                    continue
                why = sub.methods[m].accepts_calls_of(info.methods[m])
                if why:
                    errors.append(
                        f"{sub.qualname}.{m} no longer fits {module}.{name}.{m} in {wheel.label}: ours {why}"
                    )
            for m, sig in sorted(info.methods.items()):
                if sig.abstract and (m not in provided or provided[m].abstract):
                    errors.append(
                        f"{sub.qualname} does not implement {m}, abstract in {module}.{name} in {wheel.label}"
                    )
            if info.missing_bases:
                errors.append(
                    f"{module}.{name} in {wheel.label} derives from {sorted(set(info.missing_bases))}, "
                    f"which the wheel does not define"
                )
    return errors, checked


def check_wheel_pins(lock: locks.Lock, wheel: Wheel) -> list[str]:
    errors = []
    e = lock.engine
    if (wheel.distribution.lower(), wheel.version) != (e.distribution, e.version):
        errors.append(f"{lock.path} pins {e.distribution} {e.version}, the wheel is {wheel.label}")
    if wheel.path.name != e.wheel:
        errors.append(f"{lock.path} pins wheel {e.wheel}, got {wheel.path.name}")
    if wheel.sha256 != e.sha256:
        errors.append(f"{lock.path} pins {e.wheel} sha256 {e.sha256}, the wheel has {wheel.sha256}")
    torch = pinned_requirement(wheel, "torch", lock.python_version)
    if torch != [e.torch]:
        errors.append(
            f"{lock.path} pins torch {e.torch}, {wheel.label} requires torch=={' / '.join(torch) or '?'}"
        )
    if e.cuda:
        majors = cuda_majors(wheel, lock.python_version)
        if majors and majors != {e.cuda.split(".")[0]}:
            errors.append(
                f"{lock.path} pins CUDA {e.cuda}, {wheel.label} requires CUDA {sorted(majors)} packages"
            )
    return errors


# ---- what paved's processor assumes of the model runners ---------------------------------
# Read from vLLM 0.33.0's sources and encoded here, so a wheel where they stop holding fails
# the build instead of serving constrained outputs from stale state.

V1_PROCESSOR = ("vllm.v1.sample.logits_processor.interface", "LogitsProcessor")
V2_PROCESSOR = ("vllm.v1.worker.gpu.sample.logits_processor.interface", "LogitsProcessor")
V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V1_BATCH = ("vllm.v1.worker.gpu_input_batch", "InputBatch")
# What paved's V2 path reads of Model Runner V2's objects (paved.constraints.vllm_processor).
V2_READS = {
    (V2_PROCESSOR[0], "LogitsContext"): ("expanded_idx_mapping", "input_ids", "pos"),
    (V2_PROCESSOR[0], "LogitsProcRequestState"): ("all_token_ids", "prompt_len"),
    ("vllm.v1.worker.gpu.buffer_utils", "StagedWriteTensor"): ("gpu",),
    ("vllm.v1.worker.gpu.buffer_utils", "UvaBackedTensor"): ("np",),
}
ASYNC_IDS = (
    "under async scheduling the V1 runner replaces -1 output-token placeholders with the sampled "
    "ids only for processors named in logits_processors (logitsprocs_need_output_token_ids = "
    "bool(<the logits_processors given to build_logitsprocs>)), and paved relies on that"
)


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    if tree is None:
        return None
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    if cls is None:
        return None
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _reads_attribute(func: ast.AST, name: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether local `name` in `func` is computed from an `.attr` read, through local names."""
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
            continue
        for sub in ast.walk(value):
            if isinstance(sub, ast.Attribute) and sub.attr == attr:
                return True
            if (
                isinstance(sub, ast.Name)
                and sub.id not in seen | {name}
                and _reads_attribute(func, sub.id, attr, seen | {name})
            ):
                return True
    return False


def _runner_patches_listed_processors(runner: ast.Module) -> bool:
    """InputBatch(..., logitsprocs=build_logitsprocs(..., X), logitsprocs_need_output_token_ids=
    bool(X)) with X computed from `.logits_processors`, in one function of the V1 runner."""
    for func in _functions(runner):
        calls = [n for n in ast.walk(func) if isinstance(n, ast.Call)]
        listed = {
            a.id
            for c in calls
            if _dotted(c.func).rsplit(".", 1)[-1] == "build_logitsprocs"
            for a in [*c.args, *(k.value for k in c.keywords)]
            if isinstance(a, ast.Name)
        }
        for c in calls:
            if _dotted(c.func).rsplit(".", 1)[-1] != V1_BATCH[1]:
                continue
            for k in c.keywords:
                v = k.value
                if (
                    k.arg == "logitsprocs_need_output_token_ids"
                    and isinstance(v, ast.Call)
                    and _dotted(v.func) == "bool"
                    and len(v.args) == 1
                    and isinstance(v.args[0], ast.Name)
                    and v.args[0].id in listed
                    and _reads_attribute(func, v.args[0].id, "logits_processors")
                ):
                    return True
    return False


def _patch_precedes_sampling(runner: ast.Module) -> bool:
    """A runner method calls input_batch.update_async_output_token_ids() before self.sampler(."""
    for func in _functions(runner):
        called = [(n.lineno, _dotted(n.func)) for n in ast.walk(func) if isinstance(n, ast.Call)]
        patch = [line for line, f in called if f.endswith("input_batch.update_async_output_token_ids")]
        sample = [line for line, f in called if f == "self.sampler"]
        if patch and sample and min(patch) < min(sample):
            return True
    return False


def _assigns_self(cls: ast.ClassDef | None, method: str, attr: str, read: bool = False) -> bool:
    fn = _method(cls, method)
    ctx = ast.Load if read else ast.Store
    return fn is not None and any(
        isinstance(n, ast.Attribute)
        and n.attr == attr
        and isinstance(n.ctx, ctx)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        for n in ast.walk(fn)
    )


def _has_field(cls: ast.ClassDef, attr: str) -> bool:
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == attr:
            return True
    return any(_assigns_self(cls, f.name, attr) for f in cls.body if isinstance(f, ast.FunctionDef))


def check_runner_assumptions(wheel: Wheel, subclasses: list[Subclass]) -> tuple[list[str], list[str]]:
    """(errors, what was checked) for what paved's processor assumes of vLLM's model runners,
    for the interfaces paved's sources subclass."""
    bases = set()
    for sub in subclasses:
        for module, name in sub.vllm_bases:
            where = wheel.resolve(module, name)
            bases.add(where if isinstance(where, tuple) else (module, name))
    errors: list[str] = []
    checked: list[str] = []
    if V1_PROCESSOR in bases:
        checked.append(ASYNC_IDS)
        runner = wheel._tree(V1_RUNNER)
        batch = _class(wheel._tree(V1_BATCH[0]), V1_BATCH[1])
        problems = []
        if runner is None or batch is None:
            problems.append(f"{V1_RUNNER} or {V1_BATCH[0]}.{V1_BATCH[1]} is missing")
        else:
            if not _runner_patches_listed_processors(runner):
                problems.append(
                    f"{V1_RUNNER} no longer sets logitsprocs_need_output_token_ids from the "
                    "logits_processors it builds"
                )
            if not _patch_precedes_sampling(runner):
                problems.append(f"{V1_RUNNER} no longer calls update_async_output_token_ids before sampling")
            if not (
                _assigns_self(batch, "__init__", "logitsprocs_need_output_token_ids")
                and _assigns_self(batch, "_make_sampling_metadata", "logitsprocs_need_output_token_ids", True)
                and _method(batch, "update_async_output_token_ids") is not None
            ):
                problems.append(
                    f"{V1_BATCH[0]}.{V1_BATCH[1]} no longer gates its output-token ids (and their "
                    "async repair) on logitsprocs_need_output_token_ids"
                )
        errors += [
            f"{wheel.label}: {p}; {ASYNC_IDS}: re-read the runner and fix "
            "paved.constraints.vllm_processor / tracking before pinning this wheel"
            for p in problems
        ]
    if V2_PROCESSOR in bases:
        for (module, name), attrs in sorted(V2_READS.items()):
            checked.append(f"{module}.{name} has {', '.join(attrs)} (read by paved's V2 path)")
            cls = _class(wheel._tree(module), name)
            missing = list(attrs) if cls is None else [a for a in attrs if not _has_field(cls, a)]
            if missing:
                errors.append(
                    f"paved's Model Runner V2 path reads {', '.join(missing)} of {module}.{name}, "
                    f"which {wheel.label} no longer defines"
                )
    return errors, checked


def check(
    lock: locks.Lock,
    wheel: Wheel,
    sources: dict[str, str],
    references: list[Wheel] = (),  # type: ignore[assignment]
) -> Report:
    """Everything above, for one lock and its wheel; `sources` are paved's files (path ->
    text): .py files are scanned by AST, a dist-info entry_points.txt for plugin groups."""
    report = Report(lock.flavour, lock.path, lock.sha256, wheel.path.name, wheel.sha256, wheel.label)
    report.errors += check_wheel_pins(lock, wheel)

    py = {p: t for p, t in sources.items() if p.endswith(".py")}
    refs, subclasses = collect(py)
    report.errors += check_imports(wheel, refs, "paved")
    errors, overrides = check_subclasses(wheel, subclasses, list(references))
    report.errors += errors
    errors, assumptions = check_runner_assumptions(wheel, subclasses)
    report.errors += errors

    groups = []
    for path, text in sorted(sources.items()):
        if path.endswith(".dist-info/entry_points.txt"):
            for group in entry_point_groups(text):
                if group.split(".")[0] == ROOT:
                    groups.append(group)
                    if not wheel.contains_text(group, ROOT + "/"):
                        report.errors.append(
                            f"paved registers plugins in the entry-point group {group} ({path}), "
                            f"which no module of {wheel.label} reads any more"
                        )

    backend: list[str] = []
    stale: list[str] = []
    if lock.triton is not None:
        t = lock.triton
        backend = list(t.effective_imports())
        trefs = [ImportRef(m, n or None, "") for m, _, n in (i.partition(":") for i in backend)]
        who = f"Triton {t.release}'s vLLM backend ({t.vllm_backend_source})"
        if t.vllm_backend_rewrites:
            who += f" with {len(t.vllm_backend_rewrites)} import rewrites"
        report.errors += check_imports(wheel, trefs, who)
        for old in sorted(t.vllm_backend_rewrites):
            module, _, name = old.partition(":")
            if wheel.has_module(module) and wheel.resolve(module, name) is not None:
                stale.append(old)  # the released import works again: the rewrite can go

    report.checked = {
        "paved_imports": sorted({r.text() for r in refs}),
        "optional_imports": sorted({r.text() for r in refs if r.optional}),
        "overrides": overrides,
        "runner_assumptions": assumptions,
        "entry_point_groups": sorted(set(groups)),
        "triton_vllm_backend_imports": backend,
        "triton_vllm_backend_rewrites": dict(lock.triton.vllm_backend_rewrites) if lock.triton else {},
        "triton_vllm_backend_rewrites_no_longer_needed": stale,
        "sources": len(sources),
    }
    return report


def backend_manifest(src_dir: str | Path) -> list[str]:
    """The `module` / `module:Name` vLLM imports of a vLLM backend checkout (its src/), for
    the lock's [triton] vllm_backend_imports."""
    root = Path(src_dir)
    sources = {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*.py"))}
    refs, _ = collect(sources)
    return sorted({r.text() for r in refs})


def rewrite_backend(src_dir: str | Path, rewrites: dict[str, str]) -> list[str]:
    """Applies the lock's import rewrites to a vLLM backend checkout in place: each
    `from A import X` with "A:X" in `rewrites` becomes an import of X from its new module.
    Returns what changed ("file:line A:X -> B:X")."""
    changes = []
    root = Path(src_dir)
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines(keepends=True)
        edits = []
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            moved = [a for a in node.names if f"{node.module}:{a.name}" in rewrites]
            if not moved:
                continue
            indent = " " * node.col_offset
            kept = [a for a in node.names if a not in moved]
            new_lines = []
            if kept:
                names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in kept)
                new_lines.append(f"{indent}from {node.module} import {names}\n")
            for a in moved:
                target_module, _, target_name = rewrites[f"{node.module}:{a.name}"].partition(":")
                alias = a.asname or (a.name if target_name != a.name else None)
                as_ = f" as {alias}" if alias else ""
                new_lines.append(f"{indent}from {target_module} import {target_name}{as_}\n")
                where = f"{path.relative_to(root)}:{node.lineno}"
                changes.append(f"{where} {node.module}:{a.name} -> {target_module}:{target_name}")
            edits.append((node.lineno, node.end_lineno, new_lines))
        for start, end, new_lines in sorted(edits, reverse=True):
            lines[start - 1 : end] = new_lines
        if edits:
            path.write_text("".join(lines))
    return changes


def read_sources(paths: list[str]) -> dict[str, str]:
    return {p: Path(p).read_text() for p in paths}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paved-images compat", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lock", required=True)
    ap.add_argument("--wheel", required=True)
    ap.add_argument("--reference-wheel", action="append", default=[], help="the vLLM the dev venv tests")
    ap.add_argument("--sources", help="file listing paved's source files, one per line")
    ap.add_argument("--out", help="write the JSON report here")
    ap.add_argument("--strict", action="store_true", help="exit 1 when the check fails")
    args = ap.parse_args(argv)
    lock = locks.load(args.lock)
    paths = Path(args.sources).read_text().split() if args.sources else []
    wheel = Wheel(args.wheel)
    refs = [Wheel(p) for p in args.reference_wheel if Path(p).name != wheel.path.name]
    report = check(lock, wheel, read_sources(paths), refs)
    if args.out:
        Path(args.out).write_text(json.dumps(report.to_json(), indent=1, sort_keys=True) + "\n")
    if not report.ok or not args.out:
        status = "ok" if report.ok else f"FAILED ({len(report.errors)} problems)"
        print(f"compat {lock.flavour} ({lock.path}) against {wheel.label}: {status}", file=sys.stderr)
        for err in report.errors:
            print(f"  - {err}", file=sys.stderr)
    return 1 if (args.strict and not report.ok) else 0
