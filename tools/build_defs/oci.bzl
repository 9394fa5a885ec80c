"""A small deterministic OCI image rule set for Bazel 4.2.3 offline.

rules_oci cannot be fetched here (no Bazel registry, no GitHub), so paved carries these rules
with rules_oci's interface, so that moving to rules_oci is a rename of the load():

    oci_image(name, base, tars, entrypoint, cmd, env, labels, workdir, user)   # as rules_oci
    oci_push(name, image, repository, remote_tags)                           # as rules_oci
    py_image_layer(name, binary, root)           # as aspect_rules_py's py_image_layer
    oci_files_layer(name, files)                 # the role of rules_pkg's pkg_tar / tar()

paved additions (not in rules_oci): `oci_image.lock` (images/<flavour>.lock.toml: pins the
base digest, labels the pinned versions, picks the interpreter of a py_binary entrypoint),
`oci_image.compat_report` (the push refuses an image whose report failed), `oci_push_all`
(one runnable that pushes several oci_push targets; rules_oci users reach for rules_multirun)
and `paved_compat_report`. The actions run //tools/oci:oci (libs/paved/images).

Outputs: an oci_image is a directory in the OCI image layout format (like rules_oci's) plus
`<name>.digest` (the manifest digest). The layout holds the image's own blobs only; the
base's layers are referenced by digest and come from the registry's mirror of the base.
"""

OciImageInfo = provider(
    doc = "An OCI image layout built by oci_image (or a vendored base layout).",
    fields = {
        "layout": "File: the layout directory (tree artifact), or the layout's index.json",
        "files": "depset of every file of the layout",
        "digest": "File holding the manifest digest, or None",
        "base": "OciImageInfo of the base, or None",
        "lock": "File: the lock the image was baked with, or None",
        "compat_report": "File: the compatibility report of the lock, or None",
    },
)

OciLayerInfo = provider(
    doc = "A layer: gzipped tar plus its JSON info (digests; the entrypoint of a py_binary).",
    fields = {"tar": "File", "info": "File"},
)

OciPushInfo = provider(
    doc = "What oci_push_all needs of an oci_push target.",
    fields = {"entry": "dict for the push spec", "files": "depset of runfiles"},
)

_TOOL = attr.label(default = "//tools/oci:oci", executable = True, cfg = "host")

def _layout_root(info):
    return info.layout.path if info.layout.is_directory else info.layout.dirname

def _layout_short(info):
    return info.layout.short_path if info.layout.is_directory else info.layout.short_path.rpartition("/")[0]

def _layer_outputs(ctx):
    tar = ctx.actions.declare_file(ctx.label.name + ".tar.gz")
    info = ctx.actions.declare_file(ctx.label.name + ".layer.json")
    return tar, info

def _runfiles_path(f, workspace):
    # short_path is "pkg/file" for the main repository and "../repo/file" for external ones.
    if f.short_path.startswith("../"):
        return f.short_path[3:]
    return workspace + "/" + f.short_path

def _py_image_layer_impl(ctx):
    binary = ctx.attr.binary
    exe = binary[DefaultInfo].files_to_run.executable
    runfiles = binary[DefaultInfo].default_runfiles
    ws = ctx.workspace_name
    root = ctx.attr.root or ("/app/" + ctx.label.name)
    rf = root + "/" + exe.basename + ".runfiles"
    entries = [{"path": root + "/" + exe.basename, "source": exe.path}]
    inputs = [exe]
    for f in runfiles.files.to_list():
        entries.append({"path": rf + "/" + _runfiles_path(f, ws), "source": f.path})
        inputs.append(f)
    for name in runfiles.empty_filenames.to_list():
        entries.append({"path": rf + "/" + ws + "/" + name})
    for link in runfiles.symlinks.to_list():
        entries.append({"path": rf + "/" + ws + "/" + link.path, "source": link.target_file.path})
        inputs.append(link.target_file)
    for link in runfiles.root_symlinks.to_list():
        entries.append({"path": rf + "/" + link.path, "source": link.target_file.path})
        inputs.append(link.target_file)
    manifest = ctx.actions.declare_file(ctx.label.name + ".entries.json")
    ctx.actions.write(manifest, json.encode({
        "entries": entries,
        "binary": {"stub": exe.path, "runfiles_dir": rf, "workspace": ws},
    }))
    tar, info = _layer_outputs(ctx)
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = ["layer", "--manifest", manifest.path, "--out", tar.path, "--info", info.path],
        inputs = depset([manifest] + inputs),
        outputs = [tar, info],
        mnemonic = "OciLayer",
        progress_message = "OCI layer of %s" % binary.label,
    )
    return [
        DefaultInfo(files = depset([tar, info, manifest]), runfiles = ctx.runfiles(files = [tar, info, manifest])),
        OciLayerInfo(tar = tar, info = info),
    ]

py_image_layer = rule(
    implementation = _py_image_layer_impl,
    doc = "One deterministic layer with a py_binary, its launcher stub and its runfiles under `root`.",
    attrs = {
        "binary": attr.label(mandatory = True, executable = True, cfg = "target"),
        "root": attr.string(doc = "directory in the image (default /app/<name>)"),
        "_tool": _TOOL,
    },
)

def _oci_files_layer_impl(ctx):
    entries = []
    inputs = []
    for target, path in ctx.attr.files.items():
        files = target.files.to_list()
        if len(files) != 1:
            fail("%s must be exactly one file" % target.label)
        entries.append({"path": path, "source": files[0].path})
        inputs.append(files[0])
    for path, link in ctx.attr.symlinks.items():
        entries.append({"path": path, "symlink": link})
    manifest = ctx.actions.declare_file(ctx.label.name + ".entries.json")
    ctx.actions.write(manifest, json.encode({"entries": entries}))
    tar, info = _layer_outputs(ctx)
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = ["layer", "--manifest", manifest.path, "--out", tar.path, "--info", info.path],
        inputs = [manifest] + inputs,
        outputs = [tar, info],
        mnemonic = "OciLayer",
    )
    return [DefaultInfo(files = depset([tar, info])), OciLayerInfo(tar = tar, info = info)]

oci_files_layer = rule(
    implementation = _oci_files_layer_impl,
    doc = "One deterministic layer of loose files: {label: absolute path in the image}.",
    attrs = {
        "files": attr.label_keyed_string_dict(allow_files = True),
        "symlinks": attr.string_dict(doc = "{absolute path: link target}"),
        "_tool": _TOOL,
    },
)

def _oci_image_impl(ctx):
    layout = ctx.actions.declare_directory(ctx.label.name)
    digest = ctx.actions.declare_file(ctx.label.name + ".digest")
    spec = ctx.actions.declare_file(ctx.label.name + ".spec.json")
    ctx.actions.write(spec, json.encode({
        "entrypoint": ctx.attr.entrypoint,
        "cmd": ctx.attr.cmd,
        "env": ctx.attr.env,
        "labels": ctx.attr.labels,
        "workdir": ctx.attr.workdir,
        "user": ctx.attr.user,
        "ref_name": ctx.attr.ref_name or ctx.label.name,
        "created_by": "paved oci_image %s" % (ctx.attr.ref_name or ctx.label.name),
    }))
    args = ["image", "--out", layout.path, "--spec", spec.path, "--digest-out", digest.path]
    inputs = [spec]
    for t in ctx.attr.tars:
        layer = t[OciLayerInfo]
        args += ["--layer", "%s=%s" % (layer.tar.path, layer.info.path)]
        inputs += [layer.tar, layer.info]
    base = ctx.attr.base[OciImageInfo] if ctx.attr.base else None
    transitive = []
    if base:
        args += ["--base", _layout_root(base)]
        transitive.append(base.files)
    lock = ctx.file.lock
    if lock:
        # The source revision (label org.opencontainers.image.revision) comes from
        # --workspace_status_command=tools/oci/workspace_status.sh (STABLE_PAVED_REVISION).
        args += ["--lock", lock.path, "--status", ctx.info_file.path]
        inputs += [lock, ctx.info_file]
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = args,
        inputs = depset(inputs, transitive = transitive),
        outputs = [layout, digest],
        mnemonic = "OciImage",
        progress_message = "OCI image %s" % ctx.label,
    )
    return [
        DefaultInfo(files = depset([layout, digest, spec]), runfiles = ctx.runfiles(files = [layout, digest, spec])),
        OciImageInfo(
            layout = layout,
            files = depset([layout]),
            digest = digest,
            base = base,
            lock = lock,
            compat_report = ctx.file.compat_report,
        ),
    ]

oci_image = rule(
    implementation = _oci_image_impl,
    doc = "An OCI image layout: `tars` stacked on `base` (by digest), with a deterministic config.",
    attrs = {
        "base": attr.label(providers = [OciImageInfo]),
        "tars": attr.label_list(providers = [OciLayerInfo]),
        "entrypoint": attr.string_list(doc = "default for a py_image_layer: [lock's python, the binary's main]"),
        "cmd": attr.string_list(),
        "env": attr.string_dict(doc = "${VAR} expands to the base's value"),
        "labels": attr.string_dict(),
        "workdir": attr.string(),
        "user": attr.string(),
        "ref_name": attr.string(),
        "lock": attr.label(allow_single_file = [".toml"]),
        "compat_report": attr.label(allow_single_file = [".json"]),
        "_tool": _TOOL,
    },
)

def _oci_layout_impl(ctx):
    index = [f for f in ctx.files.srcs if f.short_path == ctx.attr.root + "/index.json"]
    if len(index) != 1:
        fail("%s: expected %s/index.json among srcs" % (ctx.label, ctx.attr.root))
    return [
        DefaultInfo(files = depset(ctx.files.srcs)),
        OciImageInfo(layout = index[0], files = depset(ctx.files.srcs), digest = None, base = None, lock = None, compat_report = None),
    ]

oci_layout = rule(
    implementation = _oci_layout_impl,
    doc = "A checked-in (metadata-only) layout of a mirrored base: index.json, manifest and config blobs.",
    attrs = {
        "srcs": attr.label_list(allow_files = True),
        "root": attr.string(mandatory = True, doc = "workspace-relative directory of index.json"),
    },
)

def _push_entry(ctx, image):
    entry = {
        "name": ctx.attr.repository,
        "repository": ctx.attr.repository,
        "layout": _layout_short(image),
        "remote_tags": ctx.attr.remote_tags,
    }
    files = [image.files]
    if image.base:
        entry["base_layout"] = _layout_short(image.base)
        files.append(image.base.files)
    direct = []
    if ctx.attr.base_repository:
        entry["base_repository"] = ctx.attr.base_repository
    if image.lock:
        # The push reads the base's mirror repository from the lock unless base_repository is set.
        entry["lock"] = image.lock.short_path
        direct.append(image.lock)
    if image.compat_report:
        entry["compat_report"] = image.compat_report.short_path
        direct.append(image.compat_report)
    return entry, depset(direct, transitive = files)

_PUSH_SCRIPT = """#!/usr/bin/env bash
# Generated by oci_push: runs paved-images push over this target's runfiles.
set -euo pipefail
if [[ -n "${{RUNFILES_DIR:-}}" && -d "${{RUNFILES_DIR}}/{ws}" ]]; then rf="$RUNFILES_DIR"
elif [[ -d "$0.runfiles" ]]; then rf="$0.runfiles"
elif [[ -n "${{TEST_SRCDIR:-}}" ]]; then rf="$TEST_SRCDIR"
else rf="$(pwd)/.."; fi
export PAVED_PUSH_ROOT="$rf/{ws}"
export RUNFILES_DIR="$rf"
exec "$rf/{ws}/{tool}" push --spec "$rf/{ws}/{spec}" "$@"
"""

def _write_push(ctx, entries, files):
    spec = ctx.actions.declare_file(ctx.label.name + ".push.json")
    ctx.actions.write(spec, json.encode({"images": entries}))
    script = ctx.actions.declare_file(ctx.label.name + ".sh")
    ctx.actions.write(script, _PUSH_SCRIPT.format(
        ws = ctx.workspace_name,
        tool = ctx.executable._push_tool.short_path,
        spec = spec.short_path,
    ), is_executable = True)
    runfiles = ctx.runfiles(files = [spec], transitive_files = files)
    runfiles = runfiles.merge(ctx.attr._push_tool[DefaultInfo].default_runfiles)
    return script, runfiles

def _oci_push_impl(ctx):
    entry, files = _push_entry(ctx, ctx.attr.image[OciImageInfo])
    script, runfiles = _write_push(ctx, [entry], files)
    return [
        DefaultInfo(executable = script, runfiles = runfiles),
        OciPushInfo(entry = entry, files = files),
    ]

oci_push = rule(
    implementation = _oci_push_impl,
    executable = True,
    doc = "`bazel run` it with -- --registry HOST:PORT [--tag T]: pushes `image` to HOST:PORT/repository.",
    attrs = {
        "image": attr.label(mandatory = True, providers = [OciImageInfo]),
        "repository": attr.string(mandatory = True, doc = "repository path; the registry host is given at run time"),
        "remote_tags": attr.string_list(),
        "base_repository": attr.string(doc = "repository mirroring the base (default: the lock's mirror_repository)"),
        "_push_tool": attr.label(default = "//tools/oci:oci", executable = True, cfg = "target"),
    },
)

def _oci_push_all_impl(ctx):
    entries = [p[OciPushInfo].entry for p in ctx.attr.pushes]
    files = depset(transitive = [p[OciPushInfo].files for p in ctx.attr.pushes])
    script, runfiles = _write_push(ctx, entries, files)
    return [DefaultInfo(executable = script, runfiles = runfiles)]

oci_push_all = rule(
    implementation = _oci_push_all_impl,
    executable = True,
    doc = "One runnable pushing every oci_push in `pushes` (shared layers are mounted, not re-sent).",
    attrs = {
        "pushes": attr.label_list(providers = [OciPushInfo]),
        "_push_tool": attr.label(default = "//tools/oci:oci", executable = True, cfg = "target"),
    },
)

def _paved_compat_report_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".json")
    sources = []
    for t in ctx.attr.srcs:
        if PyInfo in t:
            sources.append(t[PyInfo].transitive_sources)
        sources.append(t[DefaultInfo].files)
    # paved's own files only (the main repository), as source text: no C++ is built for this.
    files = [
        f
        for f in depset(transitive = sources).to_list()
        if f.is_source and not f.short_path.startswith("../") and
           (f.extension == "py" or f.basename == "entry_points.txt")
    ]
    listing = ctx.actions.declare_file(ctx.label.name + ".sources")
    ctx.actions.write(listing, "\n".join(sorted([f.path for f in files])) + "\n")
    args = ["compat", "--lock", ctx.file.lock.path, "--wheel", ctx.file.wheel.path, "--sources", listing.path, "--out", out.path]
    for w in ctx.files.reference_wheels:
        args += ["--reference-wheel", w.path]
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = args,
        inputs = [ctx.file.lock, ctx.file.wheel, listing] + ctx.files.reference_wheels + files,
        outputs = [out],
        mnemonic = "PavedCompat",
        progress_message = "vLLM compatibility of %s" % ctx.file.lock.short_path,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

paved_compat_report = rule(
    implementation = _paved_compat_report_impl,
    doc = "The static vLLM compatibility report (JSON) of a lock against its wheel and paved's sources.",
    attrs = {
        "lock": attr.label(mandatory = True, allow_single_file = [".toml"]),
        "wheel": attr.label(mandatory = True, allow_single_file = [".whl"]),
        "reference_wheels": attr.label_list(allow_files = [".whl"], doc = "the vLLM the dev venv tests"),
        "srcs": attr.label_list(allow_files = True, doc = "py targets / files whose vLLM use is checked"),
        "_tool": _TOOL,
    },
)
