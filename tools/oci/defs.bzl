"""paved_images_test: a pytest py_test of the image tooling.

Like //tools/build_defs:py.bzl's paved_py_test, plus a dependency on the image tooling
(//libs/paved/images, stdlib only): image tests build no C++ and load no engine.
"""

def paved_images_test(name, srcs, deps = [], **kwargs):
    native.py_test(
        name = name,
        srcs = srcs + ["//tools/build_defs:pytest_main.py"],
        main = "//tools/build_defs:pytest_main.py",
        args = ["$(rootpath %s)" % s for s in srcs] + kwargs.pop("args", []),
        deps = deps + ["//libs/paved/images"],
        python_version = "PY3",
        **kwargs
    )
