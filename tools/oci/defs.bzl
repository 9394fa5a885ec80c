"""paved_images_test: a pytest py_test of the image tooling.

Like //tools/build_defs:py.bzl's paved_py_test, but it depends on //tools/oci:paved_images
(stdlib only) instead of all of //libs:paved, so image tests build no C++ and load no engine.
"""

def paved_images_test(name, srcs, deps = [], **kwargs):
    native.py_test(
        name = name,
        srcs = srcs + ["//tools/build_defs:pytest_main.py"],
        main = "//tools/build_defs:pytest_main.py",
        args = ["$(rootpath %s)" % s for s in srcs] + kwargs.pop("args", []),
        deps = deps + ["//tools/oci:paved_images"],
        python_version = "PY3",
        **kwargs
    )
