"""The layering check: every import in the tree follows a dependency its BUILD files declare.

The BUILD files are the only statement of the allowed arrows (visibility says who may depend on
a target, `deps` what a target does depend on). This module reads them with a small Starlark
evaluator (enough for this repository's BUILD files: literals, `+`, `%`, names, comprehensions,
`glob`), maps every Python file to the targets whose `srcs` list it, parses each file's imports
with `ast` (function-local and TYPE_CHECKING ones included: a type-only edge is still an arrow
between layers) and reports, with file and line:

  * an import of a module owned by a target that is neither the importer's own target nor one
    of its direct `deps` (strict deps: a transitive path does not count, so every BUILD target
    names exactly what it uses). `python -m paved.x` / `python -c "import paved.x"` command
    lines are arrows too, declared in `deps` as well: the child inherits the parent's sys.path,
    which Bazel builds from `deps` only (a `data` target's `imports` never reach it);
  * a `deps` entry on a paved Python target that no source of the target uses;
  * a library module that belongs to no target (it would be missing at run time);
  * an import cycle between modules (Bazel only rules out cycles between targets);
  * a breach of RULES below: architecture invariants no BUILD attribute can express, such as
    "the engine knows no HTTP" (no fastapi anywhere in its transitive closure).

Run it on the source tree: `tools/bazel run //tools/lint:layering` (or `python
tools/lint/layering.py [WORKSPACE_DIR]`; exit 1 on findings). //tools/lint:layering_test runs it
in `bazel test`.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import sys
from collections.abc import Iterable, Iterator

BUILD_NAMES = ("BUILD.bazel", "BUILD")
# Not part of the Python build graph (or not ours): never scanned.
SKIP_DIRS = {".git", ".venv", "cc", "third_party", "docs", "node_modules", "__pycache__"}

PY_RULES = {"py_library", "py_binary", "py_test", "paved_py_test", "paved_images_test"}
# Dependencies a macro adds on its own (tools/build_defs/py.bzl, tools/oci/defs.bzl).
MACRO_DEPS = {"paved_images_test": ("//libs/paved/images",)}


def _gateway_rule(layer: str, why: str, above: str = "") -> dict:
    """The gateway layer `layer` (base: //libs/paved/gateway:base, else the package
    //libs/paved/gateway/<layer>) reaches none of the layers named in `above` nor the
    composition (app, server), not even through another target: visibility only stops a direct
    dependency."""
    own = "//libs/paved/gateway:base" if layer == "base" else f"//libs/paved/gateway/{layer}:"
    return {
        "why": why,
        "targets": own,
        "closure": True,
        "no_modules": (),
        "no_targets": (
            *(f"//libs/paved/gateway/{a}:" for a in above.split()),
            "//libs/paved/gateway:gateway",
            "//libs/paved/gateway:server",
        ),
    }


# The gateway's layers (docs/ARCHITECTURE.md, "Enforced dependency arrows"), each over the
# ones it may use: base < access, routing, flow < caching (access) < experiments (access,
# routing) < orchestration (access, routing, caching, experiments) < forwarding (all of them)
# < the composition (app, server).
_GATEWAY_LAYERS = (
    _gateway_rule(
        "base",
        "the gateway's base knows none of its layers",
        "access routing flow caching experiments orchestration forwarding responses",
    ),
    _gateway_rule(
        "access",
        "access knows nothing of orchestration (nor of routing, caching, flow or forwarding)",
        "routing flow caching experiments orchestration forwarding responses",
    ),
    _gateway_rule(
        "routing",
        "routing knows nothing of forwarding, orchestration or caching (nor of access or flow)",
        "access flow caching experiments orchestration forwarding responses",
    ),
    _gateway_rule(
        "flow",
        "flow control orders requests: it knows nothing of routing or forwarding",
        "access routing caching experiments orchestration forwarding responses",
    ),
    _gateway_rule(
        "caching",
        "caching knows nothing of forwarding (nor of routing, experiments or orchestration)",
        "routing flow experiments orchestration forwarding responses",
    ),
    _gateway_rule(
        "experiments",
        "experiments know nothing of orchestration or forwarding",
        "flow caching orchestration forwarding responses",
    ),
    _gateway_rule("orchestration", "orchestration knows nothing of forwarding", "flow forwarding responses"),
    _gateway_rule(
        "forwarding",
        "forwarding is what the app composes (and the Responses API and batches call), never the reverse",
        "responses batches",
    ),
    _gateway_rule("responses", "the Responses API is what the app composes, never the reverse", "batches"),
    _gateway_rule("batches", "the batch path is what the app composes, never the reverse", "responses"),
)


# Invariants of the architecture (docs/ARCHITECTURE.md, "Enforced dependency arrows").
# A rule applies to every target whose label starts with `targets`; `closure` means it is
# checked over the target and everything it depends on, transitively.
RULES = (
    {
        "why": "the engine knows no HTTP",
        "targets": "//libs/paved/engine:",
        "closure": True,
        "no_modules": ("fastapi", "starlette", "uvicorn"),
        "no_targets": ("//libs/paved/frontend:", "//libs/paved/kserve:kserve", "//libs/paved/launcher:"),
    },
    {
        "why": "constraints know nothing of serving",
        "targets": "//libs/paved/constraints:",
        "closure": True,
        "no_modules": ("fastapi", "starlette", "uvicorn", "grpc", "tritonclient", "prometheus_client"),
        "no_targets": (
            "//libs/paved/engine:",
            "//libs/paved/frontend:",
            "//libs/paved/kserve:",
            "//libs/paved/launcher:",
            "//libs/paved/metrics:",
        ),
    },
    {
        "why": "the KServe wire format is shared by client and server, so it carries neither",
        "targets": "//libs/paved/kserve:wire",
        "closure": True,
        "no_modules": ("fastapi", "starlette", "uvicorn", "vllm"),
        "no_targets": ("//libs/paved/frontend:", "//libs/paved/kserve:kserve", "//libs/paved/engine:engine"),
    },
    {
        "why": "the gateway runs no engine: it forwards to instances",
        "targets": "//libs/paved/gateway",  # every layer's package
        "closure": True,
        "no_modules": ("vllm",),
        "no_targets": (
            "//libs/paved/engine:",
            "//libs/paved/frontend:",
            "//libs/paved/kserve:kserve",
            "//libs/paved/constraints:",
            "//cc/",
        ),
    },
    {
        "why": "libraries never import mains, benchmarks or tests",
        "targets": "//libs/paved",
        "closure": True,
        "no_modules": (),
        "no_targets": ("//services/", "//bench:", "//bench/", "//libs/tests"),
    },
    {
        "why": "the image tooling is stdlib only (building an image loads no engine)",
        "targets": "//libs/paved/images:",
        "closure": True,
        "no_modules": ("vllm", "torch", "numpy", "fastapi", "grpc", "pydantic"),
        "no_targets": ("//libs/paved/engine:", "//libs/paved/constraints:", "//cc/"),
    },
    *_GATEWAY_LAYERS,
)


@dataclasses.dataclass
class Target:
    label: str
    kind: str
    package: str  # workspace-relative directory
    srcs: list[str]  # workspace-relative .py paths
    deps: list[str]
    data: list[str]
    imports: list[str]  # workspace-relative sys.path roots
    build_file: str
    line: int


@dataclasses.dataclass(frozen=True, order=True)
class Finding:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


# ---------------------------------------------------------------------------------------------
# Reading BUILD files.
# ---------------------------------------------------------------------------------------------
class _Unknown(Exception):
    """A value the evaluator does not model (a load()ed symbol, select(), a rule's output)."""


def _glob_regex(pattern: str) -> re.Pattern:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def _package_files(root: str, package: str) -> list[str]:
    """Files of `package` (relative to it), not descending into sub-packages."""
    base = os.path.join(root, package)
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        rel = os.path.relpath(dirpath, base)
        if rel != "." and any(os.path.exists(os.path.join(dirpath, b)) for b in BUILD_NAMES):
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for f in filenames:
            out.append(f if rel == "." else os.path.join(rel, f))
    return sorted(out)


class _Evaluator:
    def __init__(self, root: str, package: str):
        self.root = root
        self.package = package
        self.env: dict[str, object] = {}
        self._files: list[str] | None = None

    def glob(self, include, exclude=(), **_):
        if self._files is None:
            self._files = _package_files(self.root, self.package)
        inc = [_glob_regex(p) for p in include]
        exc = [_glob_regex(p) for p in exclude]
        return [f for f in self._files if any(r.match(f) for r in inc) and not any(r.match(f) for r in exc)]

    def eval(self, node: ast.AST, env: dict[str, object] | None = None):
        env = self.env if env is None else env
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.List | ast.Tuple):
            return [self.eval(e, env) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self.eval(k, env): self.eval(v, env) for k, v in zip(node.keys, node.values, strict=True)}
        if isinstance(node, ast.Name):
            if node.id in env:
                value = env[node.id]
                if isinstance(value, _Unknown):
                    raise value
                return value
            if node.id in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[node.id]
            raise _Unknown(node.id)
        if isinstance(node, ast.BinOp):
            left, right = self.eval(node.left, env), self.eval(node.right, env)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Mod):
                return left % (tuple(right) if isinstance(right, list) else right)
            raise _Unknown(ast.dump(node.op))
        if isinstance(node, ast.Subscript):
            return self.eval(node.value, env)[self.eval(node.slice, env)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "glob":
            args = [self.eval(a, env) for a in node.args]
            kwargs = {k.arg: self.eval(k.value, env) for k in node.keywords}
            return self.glob(*args, **kwargs)
        if isinstance(node, ast.ListComp) and len(node.generators) == 1:
            gen = node.generators[0]
            out = []
            for item in self.eval(gen.iter, env):
                inner = dict(env)
                self._bind(gen.target, item, inner)
                if all(self.eval(c, inner) for c in gen.ifs):
                    out.append(self.eval(node.elt, inner))
            return out
        raise _Unknown(type(node).__name__)

    def _bind(self, target: ast.AST, value, env: dict) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, ast.Tuple):
            for t, v in zip(target.elts, value, strict=True):
                self._bind(t, v, env)
        else:
            raise _Unknown("comprehension target")


def _label(ref: str, package: str) -> str:
    """Canonical `//pkg:name` for a label as written in `package`; external repositories keep '@'."""
    if ref.startswith("@"):
        return ref
    if ref.startswith(":"):
        return f"//{package}{ref}"
    if ref.startswith("//"):
        if ":" in ref:
            return ref
        return f"{ref}:{ref.rsplit('/', 1)[-1]}"
    return f"//{package}:{ref}"


def _calls(tree: ast.Module, ev: _Evaluator) -> Iterator[tuple[ast.Call, dict]]:
    """Top-level rule calls (expanding list comprehensions), each with the env to evaluate it in."""
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            try:
                value = ev.eval(stmt.value)
            except (_Unknown, KeyError, TypeError) as e:
                value = e if isinstance(e, _Unknown) else _Unknown(str(e))
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    ev.env[t.id] = value
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            call = stmt.value
            if isinstance(call.func, ast.Name) and call.func.id == "load":
                for k in call.keywords:
                    ev.env[k.arg] = _Unknown(k.arg)
                for a in call.args[1:]:
                    if isinstance(a, ast.Constant):
                        ev.env[a.value] = _Unknown(a.value)
                continue
            yield call, ev.env
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.ListComp):
            comp = stmt.value
            if len(comp.generators) != 1 or not isinstance(comp.elt, ast.Call):
                continue
            gen = comp.generators[0]
            try:
                items = ev.eval(gen.iter)
            except _Unknown:
                continue
            for item in items:
                env = dict(ev.env)
                ev._bind(gen.target, item, env)
                yield comp.elt, env


def parse_build(root: str, package: str, text: str, build_file: str = "") -> list[Target]:
    """The Python targets one BUILD file declares."""
    ev = _Evaluator(root, package)
    targets = []
    for call, env in _calls(ast.parse(text, build_file or package), ev):
        if not isinstance(call.func, ast.Name) or call.func.id not in PY_RULES:
            continue
        kind = call.func.id
        attrs = {k.arg: k.value for k in call.keywords if k.arg}

        def get(attr, default, *, required=False, _attrs=attrs, _env=env, _call=call):
            if attr not in _attrs:
                return default
            try:
                return ev.eval(_attrs[attr], _env)
            except _Unknown as e:
                if required:
                    raise ValueError(
                        f"{build_file}:{_call.lineno}: cannot evaluate {attr} ({e}); "
                        "tools/lint/layering.py models literals, +, %, names, comprehensions, glob"
                    ) from None
                return default

        name = get("name", None, required=True)
        srcs = []
        for s in get("srcs", [], required=True):
            if s.startswith("//"):
                pkg, _, f = s[2:].partition(":")
                path = os.path.join(pkg, f)
            elif s.startswith(":"):
                continue  # a generated file or target, not a source
            else:
                path = os.path.join(package, s)
            if path.endswith(".py"):
                srcs.append(os.path.normpath(path))
        deps = [_label(d, package) for d in get("deps", [], required=True)]
        deps += [_label(d, package) for d in MACRO_DEPS.get(kind, ())]
        data = []
        for d in get("data", []):
            if isinstance(d, str):
                data.append(_label(d, package))
        imports = [os.path.normpath(os.path.join(package, i)) for i in get("imports", [])]
        targets.append(
            Target(
                label=f"//{package}:{name}",
                kind=kind,
                package=package,
                srcs=srcs,
                deps=deps,
                data=data,
                imports=imports,
                build_file=build_file,
                line=call.lineno,
            )
        )
    return targets


def build_files(root: str) -> Iterator[str]:
    ignored = set(SKIP_DIRS)
    ignore_file = os.path.join(root, ".bazelignore")
    if os.path.exists(ignore_file):
        with open(ignore_file) as f:
            ignored |= {ln.strip().strip("/") for ln in f if ln.strip() and not ln.startswith("#")}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in ignored
            and not d.startswith("bazel-")
            and os.path.normpath(os.path.join(rel, d)) not in ignored
        )
        for b in BUILD_NAMES:
            if b in filenames:
                yield os.path.normpath(os.path.join(rel, b))
                break


def load_targets(root: str) -> dict[str, Target]:
    targets = {}
    for build in build_files(root):
        package = os.path.dirname(build)
        package = "" if package == "." else package
        with open(os.path.join(root, build)) as f:
            for t in parse_build(root, package, f.read(), build):
                targets[t.label] = t
    return targets


# ---------------------------------------------------------------------------------------------
# Reading imports.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name as written (from-imports: module.name)
    fallback: str | None  # for `from m import n`: `m`, when n is not a module
    line: int
    how: str  # "import", "python -m", "python -c"


def _is_type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _package_of(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def imports_of(source: str, path: str, module: str = "", is_package: bool = False) -> list[Import]:
    """Every import in `source` (any depth), plus the modules its command lines run with
    `python -m MODULE` or `python -c CODE`. `module`: the file's own dotted name (for relative
    imports)."""
    tree = ast.parse(source, path)
    out: list[Import] = []
    strings: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(getattr(node.value, "value", None), str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    strings.setdefault(t.id, []).append(node.value.value)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append(Import(a.name, None, node.lineno, "import"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package_of(module, is_package).split(".")
                pkg = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                base = ".".join([*pkg, base] if base else pkg)
            for a in node.names:
                if a.name == "*":
                    out.append(Import(base, None, node.lineno, "import"))
                else:
                    out.append(Import(f"{base}.{a.name}", base, node.lineno, "import"))
        elif isinstance(node, ast.List | ast.Tuple):
            elts = node.elts
            for i in range(len(elts) - 1):
                flag = elts[i]
                if not (isinstance(flag, ast.Constant) and flag.value in ("-m", "-c")):
                    continue
                arg = elts[i + 1]
                values = []
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    values = [arg.value]
                elif isinstance(arg, ast.Name):
                    values = strings.get(arg.id, [])
                for value in values:
                    if flag.value == "-m":
                        out.append(Import(value, None, node.lineno, "python -m"))
                        continue
                    try:
                        inner = imports_of(value, path)
                    except SyntaxError:
                        continue
                    out += [Import(m.module, m.fallback, node.lineno, "python -c") for m in inner]
    return out


# ---------------------------------------------------------------------------------------------
# The check.
# ---------------------------------------------------------------------------------------------
class Graph:
    def __init__(self, root: str, targets: dict[str, Target]):
        self.root = root
        self.targets = targets
        self.owners: dict[str, list[Target]] = {}
        for t in targets.values():
            for s in t.srcs:
                self.owners.setdefault(s, []).append(t)
        # dotted name -> files, for names importable from anywhere (under an `imports` root).
        self.modules: dict[str, set[str]] = {}
        self.names: dict[str, str] = {}  # file -> its dotted name under an imports root
        for t in targets.values():
            for s in t.srcs:
                # The runfiles' workspace directory is on sys.path too ("" below).
                for r in [*t.imports, ""]:
                    rel = os.path.relpath(s, r or ".")
                    if rel.startswith(".."):
                        continue
                    parts = rel[: -len(".py")].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    if parts:
                        name = ".".join(parts)
                        self.modules.setdefault(name, set()).add(s)
                        self.names.setdefault(s, name)

    def resolve(self, imp: Import, importer: str) -> tuple[str, set[str]] | None:
        """(module name, files) of a first-party import, or None for a third-party one."""
        for candidate in filter(None, (imp.module, imp.fallback)):
            name = candidate
            while name:
                if name in self.modules:
                    return name, self.modules[name]
                name = name.rpartition(".")[0]
            # A sibling file: the importing script's (or pytest test's) directory is on sys.path.
            first = candidate.split(".")[0]
            sibling = os.path.join(os.path.dirname(importer), first + ".py")
            if sibling in self.owners and sibling != importer:
                return first, {sibling}
        return None

    def closure(self, label: str) -> list[str]:
        seen, stack = [], [label]
        while stack:
            cur = stack.pop()
            if cur in seen:
                continue
            seen.append(cur)
            t = self.targets.get(cur)
            if t is not None:
                stack += [d for d in t.deps if d not in seen]
        return seen


def _parents(name: str) -> Iterator[str]:
    while "." in name:
        name = name.rpartition(".")[0]
        yield name


def check(root: str, targets: dict[str, Target] | None = None) -> list[Finding]:
    targets = load_targets(root) if targets is None else targets
    g = Graph(root, targets)
    findings: list[Finding] = []
    used: dict[str, set[str]] = {label: set() for label in targets}
    file_imports: dict[str, list[tuple[Import, str, set[str]]]] = {}

    for path in sorted(g.owners):
        with open(os.path.join(root, path)) as f:
            source = f.read()
        name = g.names.get(path, "")
        try:
            imps = imports_of(source, path, name, path.endswith("__init__.py"))
        except SyntaxError as e:
            findings.append(Finding(path, e.lineno or 0, f"does not parse: {e.msg}"))
            continue
        resolved = []
        for imp in imps:
            hit = g.resolve(imp, path)
            resolved.append((imp, hit[0] if hit else "", hit[1] if hit else set()))
        file_imports[path] = resolved

        for t in g.owners[path]:
            reach = set(g.closure(t.label))
            declared = []
            for imp, module, files in resolved:
                if not files:
                    continue
                owners = {o.label for f in files for o in g.owners.get(f, [])}
                if t.label in owners:
                    declared.append((imp, module))
                    continue
                if owners & set(t.deps):
                    used[t.label] |= owners & set(t.deps)
                    declared.append((imp, module))
                    continue
                findings.append(
                    Finding(
                        path,
                        imp.line,
                        f"{t.label} -> {' | '.join(sorted(owners))} ({imp.how} {module}) "
                        f"is not declared in {t.build_file}: add it to deps, "
                        f"or keep the code out of {t.label}",
                    )
                )
            # Importing a.b.c runs a/__init__.py and a/b/__init__.py: their targets must be in
            # the closure (a direct dep is not required for a package's __init__).
            # A module's own packages run first when it is imported.
            own = [(Import(name, None, 1, "import"), name)] if name else []
            for imp, module in declared + own:
                for parent in _parents(module):
                    for f in g.modules.get(parent, ()):
                        owners = {o.label for o in g.owners.get(f, [])}
                        if owners & set(t.deps):
                            used[t.label] |= owners & set(t.deps)
                        if not owners & reach:
                            findings.append(
                                Finding(
                                    path,
                                    imp.line,
                                    f"{t.label} imports {module}, whose package {parent} "
                                    f"({' | '.join(sorted(owners))}) is not among its dependencies",
                                )
                            )

    # Declared but unused deps on first-party Python targets.
    for t in targets.values():
        if not t.srcs:
            continue
        implicit = {_label(d, t.package) for d in MACRO_DEPS.get(t.kind, ())}
        for d in t.deps:
            if d in implicit:
                continue  # the macro's, not the target's
            if d in targets and targets[d].srcs and d not in used[t.label] and d != t.label:
                findings.append(
                    Finding(
                        t.build_file,
                        t.line,
                        f"{t.label} depends on {d} but none of its sources imports it (drop it)",
                    )
                )

    # Library modules outside every target.
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "libs", "paved")):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for f in filenames:
            p = os.path.relpath(os.path.join(dirpath, f), root)
            if f.endswith(".py") and p not in g.owners:
                findings.append(Finding(p, 1, "belongs to no py_library (add it to a target's srcs)"))

    findings += _cycles(g, file_imports)
    findings += _rules(g, file_imports)
    return sorted(set(findings))


def _cycles(g: Graph, file_imports) -> list[Finding]:
    edges: dict[str, dict[str, int]] = {}
    for path, resolved in file_imports.items():
        for imp, _, files in resolved:
            if imp.how != "import":
                continue  # another process
            for f in files:
                if f != path:
                    edges.setdefault(path, {}).setdefault(f, imp.line)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    findings = []
    for comp in out:
        first = comp[0]
        links = [f"{a}:{edges[a][b]} -> {b}" for a in comp for b in edges.get(a, {}) if b in comp]
        findings.append(Finding(first, 1, "import cycle: " + "; ".join(sorted(links))))
    return findings


def _rules(g: Graph, file_imports) -> list[Finding]:
    findings = []
    for rule in RULES:
        for t in g.targets.values():
            if not t.label.startswith(rule["targets"]):
                continue
            scope = g.closure(t.label) if rule["closure"] else [t.label]
            for label in scope:
                if label != t.label and any(label.startswith(p) for p in rule["no_targets"]):
                    findings.append(
                        Finding(
                            t.build_file,
                            t.line,
                            f"{t.label} reaches {label} ({rule['why']}): "
                            + " -> ".join(_path(g, t.label, label)),
                        )
                    )
                inner = g.targets.get(label)
                if inner is None:
                    continue
                for src in inner.srcs:
                    for imp, _, files in file_imports.get(src, []):
                        top = imp.module.split(".")[0]
                        if not files and top in rule["no_modules"]:
                            via = "" if label == t.label else f" (in {t.label}'s closure via {label})"
                            findings.append(
                                Finding(src, imp.line, f"imports {imp.module}{via}: {rule['why']}")
                            )
    return findings


def _path(g: Graph, start: str, goal: str) -> list[str]:
    prev = {start: ""}
    queue = [start]
    while queue:
        cur = queue.pop(0)
        if cur == goal:
            break
        for d in g.targets[cur].deps if cur in g.targets else []:
            if d not in prev:
                prev[d] = cur
                queue.append(d)
    path = [goal]
    while prev.get(path[-1]):
        path.append(prev[path[-1]])
    return path[::-1]


def main(argv: Iterable[str]) -> int:
    args = list(argv)
    # `bazel run` starts in the runfiles; it names the workspace in BUILD_WORKSPACE_DIRECTORY.
    root = os.path.abspath(args[0] if args else os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.getcwd()))
    findings = check(root)
    for f in findings:
        print(f)
    targets = load_targets(root)
    print(
        f"layering: {len(findings)} finding(s) in {sum(len(t.srcs) for t in targets.values())} "
        f"sources of {len(targets)} Python targets"
    )
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
