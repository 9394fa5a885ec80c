"""Local repository rules that let Bazel 4.2.3 build offline.

Nothing here downloads: the venv is created by tools/bazel from the pinned lock,
and these rules only point Bazel at it.
"""

def _native_forwarder_impl(rctx):
    # Bazel's built-in WORKSPACE suffix declares rules_cc/rules_java as http_archives;
    # declaring same-named local repositories first keeps it from reaching the network.
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)
    rctx.file("BUILD.bazel", "")
    for path, content in rctx.attr.files.items():
        rctx.file(path, content)

native_forwarder = repository_rule(
    implementation = _native_forwarder_impl,
    attrs = {"files": attr.string_dict()},
)

def _forwarders(names):
    return "".join(["def %s(**kwargs):\n    native.%s(**kwargs)\n\n" % (n, n) for n in names])

# Every symbol @bazel_tools loads from these repositories in Bazel 4.2.3.
_CC_DEFS = _forwarders([
    "cc_binary",
    "cc_library",
    "cc_test",
    "cc_import",
    "cc_proto_library",
    "cc_toolchain",
    "cc_toolchain_suite",
    "objc_library",
])

_JAVA_DEFS = _forwarders([
    "java_binary",
    "java_import",
    "java_library",
    "java_proto_library",
    "java_runtime",
    "java_test",
    "java_toolchain",
])

def offline_rules_repositories():
    native_forwarder(
        name = "rules_cc",
        files = {"cc/BUILD.bazel": "", "cc/defs.bzl": _CC_DEFS},
    )
    native_forwarder(
        name = "rules_java",
        files = {
            "java/BUILD.bazel": "",
            "java/defs.bzl": _JAVA_DEFS,
            "java/repositories.bzl": "def rules_java_dependencies():\n    pass\n\ndef rules_java_toolchains():\n    pass\n",
        },
    )

def _venv_impl(rctx):
    ws = rctx.path(Label("//:WORKSPACE")).dirname
    venv = ws.get_child(".venv")
    python = venv.get_child("bin").get_child("python")

    # Reading the lock makes Bazel re-run this rule whenever the lock changes.
    lock = rctx.read(Label("//third_party/python:requirements.lock"))
    if not python.exists:
        fail("%s is missing: run tools/bazel (it creates the venv from third_party/python/requirements.lock)" % python)

    probe = rctx.execute([
        str(python),
        "-c",
        "import sysconfig, pybind11; print(sysconfig.get_paths()['include']); print(pybind11.get_include())",
    ])
    if probe.return_code != 0:
        fail("probing %s failed: %s" % (python, probe.stderr))
    py_include, pybind_include = probe.stdout.strip().split("\n")
    rctx.symlink(py_include, "python_include")
    rctx.symlink(pybind_include, "pybind11_include")
    rctx.symlink(venv.get_child("bin").get_child("ruff"), "ruff")
    rctx.file("lock.sha", str(hash(lock)) + "\n")

    rctx.file("BUILD.bazel", """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

exports_files(["ruff"])

# interpreter_path is the venv's bin/python itself, never its resolved target:
# resolving it would drop the venv's site-packages.
py_runtime(
    name = "py3_runtime",
    interpreter_path = "{python}",
    python_version = "PY3",
    stub_shebang = "#!{python}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "py_toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)

cc_library(
    name = "pybind11",
    hdrs = glob(["pybind11_include/**/*.h"]),
    includes = ["pybind11_include"],
    deps = [":python_headers"],
)
""".format(python = python))

paved_venv = repository_rule(
    implementation = _venv_impl,
    local = True,
    attrs = {},
)
