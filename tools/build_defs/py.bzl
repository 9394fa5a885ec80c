"""paved_py_test: a py_test that runs its sources with pytest.

It adds no paved library: a test lists the targets it imports in `deps`, like any target
(//tools/lint:layering_test checks that the list is exact).
"""

def paved_py_test(name, srcs, deps = [], **kwargs):
    native.py_test(
        name = name,
        srcs = srcs + ["//tools/build_defs:pytest_main.py"],
        main = "//tools/build_defs:pytest_main.py",
        args = ["$(rootpath %s)" % s for s in srcs],
        deps = deps,
        python_version = "PY3",
        **kwargs
    )
