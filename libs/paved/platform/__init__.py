"""The whole paved platform on one machine (`tools/bazel run //services/platform:up`, `paved up`).

`paved.platform.up.Platform` starts the existing mains as child processes (the control plane,
a gateway following its routes, optionally a loopback S3) and rolls the tiny model out through
the control plane's API; it reimplements none of them.
"""
