"""The layering check on the real tree, and on small synthetic trees that must fail it."""

import os
import shutil
import textwrap

import pytest

from tools.lint import layering


def _root() -> str:
    # A `local` test: the WORKSPACE runfile resolves into the real source tree.
    return os.path.dirname(os.path.realpath(os.environ["WORKSPACE_FILE"]))


def _write(root, files: dict[str, str]) -> None:
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(textwrap.dedent(text).lstrip("\n"))


def _messages(root) -> list[str]:
    return [str(f) for f in layering.check(str(root))]


LIB = """
py_library(
    name = "{name}",
    srcs = glob(["**/*.py"]),
    imports = [".."],
    deps = {deps},
    data = {data},
)
"""


ROOT_BUILD = 'py_library(name = "paved", srcs = ["__init__.py"], imports = [".."])\n'


def _lib(name: str, deps=(), data=()) -> str:
    return LIB.format(name=name, deps=list(deps), data=list(data))


def _two_packages(tmp_path, a_module: str, a_deps=(), a_data=()):
    _write(
        tmp_path,
        {
            "WORKSPACE": "",
            "pkg/a/BUILD.bazel": _lib("a", a_deps, a_data),
            "pkg/a/__init__.py": "",
            "pkg/a/mod.py": a_module,
            "pkg/b/BUILD.bazel": _lib("b"),
            "pkg/b/__init__.py": "",
            "pkg/b/thing.py": "VALUE = 1\n",
        },
    )


# ---- the real tree ----------------------------------------------------------------------------
def test_the_tree_follows_the_arrows_its_build_files_declare():
    findings = layering.check(_root())
    assert not findings, "\n" + "\n".join(map(str, findings))


def test_a_bad_import_in_the_real_tree_is_reported(tmp_path):
    """The real BUILD graph, plus one import the engine's contract must not make."""
    root = _root()
    for top in ("libs", "services", "bench", "tools"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = [d for d in dirnames if d not in layering.SKIP_DIRS]
            for f in filenames:
                if f.endswith((".py", ".bazel", ".bzl")):
                    src = os.path.join(dirpath, f)
                    dst = os.path.join(tmp_path, os.path.relpath(src, root))
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    shutil.copyfile(src, dst)
    assert _messages(tmp_path) == []
    protocol = tmp_path / "libs/paved/engine/protocol.py"
    lines = protocol.read_text().splitlines(keepends=True)
    lines.append("\n\ndef _late():\n    from paved.frontend import app  # noqa\n")
    protocol.write_text("".join(lines))
    line = len("".join(lines).splitlines())
    found = _messages(tmp_path)
    assert any(
        m.startswith(
            f"libs/paved/engine/protocol.py:{line}: //libs/paved/engine:protocol -> "
            "//libs/paved/frontend:frontend (import paved.frontend.app) is not declared"
        )
        for m in found
    ), found


# ---- synthetic trees ------------------------------------------------------------------------
def test_an_undeclared_import_names_file_line_and_arrow(tmp_path):
    _two_packages(tmp_path, "import os\n\ndef f():\n    from b import thing\n    return thing\n")
    assert _messages(tmp_path) == [
        "pkg/a/mod.py:4: //pkg/a:a -> //pkg/b:b (import b.thing) is not declared in "
        "pkg/a/BUILD.bazel: add it to deps, or keep the code out of //pkg/a:a"
    ]


def test_a_declared_import_passes(tmp_path):
    _two_packages(tmp_path, "from b.thing import VALUE\n", a_deps=["//pkg/b"])
    assert _messages(tmp_path) == []


def test_type_checking_imports_are_arrows_too(tmp_path):
    _two_packages(tmp_path, "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b.thing\n")
    assert [m.split(": ")[1].split(" (")[0] for m in _messages(tmp_path)] == ["//pkg/a:a -> //pkg/b:b"]


def test_an_unused_dep_is_reported(tmp_path):
    _two_packages(tmp_path, "import os\n", a_deps=["//pkg/b:b"])
    assert _messages(tmp_path) == [
        "pkg/a/BUILD.bazel:1: //pkg/a:a depends on //pkg/b:b but none of its sources imports it (drop it)"
    ]


def test_a_started_process_is_an_arrow_only_deps_declare(tmp_path):
    module = 'import sys\nCMD = [sys.executable, "-m", "b.thing"]\n'
    # `data` brings the files but not the target's sys.path entries, which the child inherits.
    _two_packages(tmp_path, module, a_data=["//pkg/b"])
    assert [m.split(": ")[1].split(" is")[0] for m in _messages(tmp_path)] == [
        "//pkg/a:a -> //pkg/b:b (python -m b.thing)"
    ]
    _two_packages(tmp_path, module, a_deps=["//pkg/b"])
    assert _messages(tmp_path) == []
    code = 'import sys\nCODE = "from b.thing import VALUE"\nCMD = [sys.executable, "-c", CODE]\n'
    _two_packages(tmp_path, code)
    assert [m.split(": ")[1].split(" is")[0] for m in _messages(tmp_path)] == [
        "//pkg/a:a -> //pkg/b:b (python -c b.thing)"
    ]


def test_an_import_cycle_inside_one_target_is_reported(tmp_path):
    _write(
        tmp_path,
        {
            "WORKSPACE": "",
            "pkg/a/BUILD.bazel": _lib("a"),
            "pkg/a/__init__.py": "",
            "pkg/a/x.py": "from a import y\n",
            "pkg/a/y.py": "import os\n\ndef f():\n    from a import x\n",
        },
    )
    assert _messages(tmp_path) == [
        "pkg/a/x.py:1: import cycle: pkg/a/x.py:1 -> pkg/a/y.py; pkg/a/y.py:4 -> pkg/a/x.py"
    ]


def test_the_engine_knows_no_http_even_through_a_dependency(tmp_path):
    _write(
        tmp_path,
        {
            "WORKSPACE": "",
            "libs/paved/BUILD.bazel": ROOT_BUILD,
            "libs/paved/__init__.py": "",
            "libs/paved/engine/BUILD.bazel": textwrap.dedent(
                """
                py_library(
                    name = "engine",
                    srcs = ["__init__.py", "core.py"],
                    imports = ["../.."],
                    deps = ["//libs/paved", "//libs/paved/web"],
                )
                """
            ),
            "libs/paved/engine/__init__.py": "",
            "libs/paved/engine/core.py": "from paved.web import page\n",
            "libs/paved/web/BUILD.bazel": textwrap.dedent(
                """
                py_library(name = "web", srcs = glob(["*.py"]), imports = ["../.."], deps = ["//libs/paved"])
                """
            ),
            "libs/paved/web/__init__.py": "",
            "libs/paved/web/page.py": "import fastapi\n",
        },
    )
    assert _messages(tmp_path) == [
        "libs/paved/web/page.py:1: imports fastapi (in //libs/paved/engine:engine's closure via "
        "//libs/paved/web:web): the engine knows no HTTP"
    ]


def test_a_library_module_in_no_target_is_reported(tmp_path):
    _write(
        tmp_path,
        {
            "WORKSPACE": "",
            "libs/paved/BUILD.bazel": ROOT_BUILD,
            "libs/paved/__init__.py": "",
            "libs/paved/stray.py": "",
        },
    )
    assert _messages(tmp_path) == [
        "libs/paved/stray.py:1: belongs to no py_library (add it to a target's srcs)"
    ]


def test_the_starlark_reader(tmp_path):
    _write(
        tmp_path,
        {
            "WORKSPACE": "",
            "p/BUILD.bazel": textwrap.dedent(
                """
                load("//x:defs.bzl", "SOMETHING")
                COMMON = ["//q:lib"]
                py_library(
                    name = "lib",
                    srcs = glob(["**/*.py"], exclude = ["skip.py"]),
                    deps = COMMON + [":other"],
                    data = SOMETHING,
                )
                [py_test(name = "t_%s" % n, srcs = ["%s_test.py" % n], deps = [":lib"]) for n in ["a", "b"]]
                genrule(name = "g", outs = ["o"], cmd = SOMETHING)
                """
            ),
            "p/one.py": "",
            "p/skip.py": "",
            "p/deep/two.py": "",
            "p/sub/BUILD.bazel": "",
            "p/sub/three.py": "",
        },
    )
    targets = layering.load_targets(str(tmp_path))
    assert sorted(targets) == ["//p:lib", "//p:t_a", "//p:t_b"]
    assert targets["//p:lib"].srcs == ["p/deep/two.py", "p/one.py"]  # not skip.py, not sub/
    assert targets["//p:lib"].deps == ["//q:lib", "//p:other"]
    assert targets["//p:t_b"].srcs == ["p/b_test.py"]
    assert targets["//p:t_b"].deps == ["//p:lib"]


def test_an_unreadable_srcs_is_an_error_not_a_silent_pass(tmp_path):
    build = 'load(":x.bzl", "S")\npy_library(name = "l", srcs = S)\n'
    _write(tmp_path, {"WORKSPACE": "", "p/BUILD.bazel": build})
    with pytest.raises(ValueError, match="cannot evaluate srcs"):
        layering.load_targets(str(tmp_path))


def _gateway_layer(name: str, deps=()) -> str:
    return textwrap.dedent(
        f"""
        py_library(name = "{name}", srcs = glob(["*.py"]), imports = ["../../.."], deps = {list(deps)})
        """
    )


@pytest.mark.parametrize(
    ("layer", "above", "via", "why"),
    [
        ("caching", "forwarding", None, "caching knows nothing of forwarding"),
        # Through a target outside the gateway: visibility would not see it, the closure does.
        ("access", "orchestration", "libs/paved/helper", "access knows nothing of orchestration"),
    ],
)
def test_a_gateway_layer_reaching_one_above_it_is_reported(tmp_path, layer, above, via, why):
    base = "//libs/paved/gateway:base"
    files = {
        "WORKSPACE": "",
        "libs/paved/BUILD.bazel": ROOT_BUILD,
        "libs/paved/__init__.py": "",
        "libs/paved/gateway/BUILD.bazel": (
            'py_library(name = "base", srcs = ["__init__.py"], imports = ["../.."], '
            'deps = ["//libs/paved"])\n'
        ),
        "libs/paved/gateway/__init__.py": "",
        f"libs/paved/gateway/{above}/BUILD.bazel": _gateway_layer(above, [base]),
        f"libs/paved/gateway/{above}/__init__.py": "",
        f"libs/paved/gateway/{above}/top.py": "VALUE = 1\n",
        f"libs/paved/gateway/{layer}/__init__.py": "",
    }
    if via is None:
        files[f"libs/paved/gateway/{layer}/BUILD.bazel"] = _gateway_layer(
            layer, [base, f"//libs/paved/gateway/{above}"]
        )
        files[f"libs/paved/gateway/{layer}/low.py"] = f"from paved.gateway.{above}.top import VALUE\n"
        path = [f"//libs/paved/gateway/{layer}:{layer}", f"//libs/paved/gateway/{above}:{above}"]
    else:
        files[f"{via}/BUILD.bazel"] = textwrap.dedent(
            f"""
            py_library(
                name = "helper",
                srcs = ["__init__.py"],
                imports = ["../.."],
                deps = ["//libs/paved", "//libs/paved/gateway/{above}"],
            )
            """
        )
        files[f"{via}/__init__.py"] = f"from paved.gateway.{above}.top import VALUE\n"
        files[f"libs/paved/gateway/{layer}/BUILD.bazel"] = _gateway_layer(layer, [base, f"//{via}"])
        files[f"libs/paved/gateway/{layer}/low.py"] = "from paved.helper import VALUE\n"
        path = [
            f"//libs/paved/gateway/{layer}:{layer}",
            f"//{via}:helper",
            f"//libs/paved/gateway/{above}:{above}",
        ]
    _write(tmp_path, files)
    found = _messages(tmp_path)
    assert len(found) == 1, found
    head, _, tail = found[0].partition(" (")
    assert head == (
        f"libs/paved/gateway/{layer}/BUILD.bazel:1: //libs/paved/gateway/{layer}:{layer} "
        f"reaches //libs/paved/gateway/{above}:{above}"
    )
    assert tail.startswith(why)
    assert tail.endswith("): " + " -> ".join(path))
