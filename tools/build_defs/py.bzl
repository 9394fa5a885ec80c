"""paved_py_test: a py_test that runs its sources with pytest."""

def paved_py_test(name, srcs, deps = [], **kwargs):
    native.py_test(
        name = name,
        srcs = srcs + ["//tools/build_defs:pytest_main.py"],
        main = "//tools/build_defs:pytest_main.py",
        args = ["$(rootpath %s)" % s for s in srcs],
        deps = deps + ["//libs:paved"],
        python_version = "PY3",
        **kwargs
    )
