"""The builder is deterministic: same inputs -> same bytes, whatever mtimes, umask or order."""

import gzip
import json
import os
import tarfile

import pytest

from paved.images import oci


def _tree(root, mtime, umask):
    old = os.umask(umask)
    try:
        (root / "pkg").mkdir(parents=True)
        (root / "pkg" / "a.py").write_text("print('a')\n")
        (root / "pkg" / "run").write_text("#!/bin/sh\n")
        os.chmod(root / "pkg" / "run", 0o700)
        (root / "pkg" / "data").mkdir()
        (root / "pkg" / "data" / "x.bin").write_bytes(bytes(range(256)) * 10)
    finally:
        os.umask(old)
    for p in root.rglob("*"):
        os.utime(p, (mtime, mtime))
    return root


def _entries(root, reverse=False):
    entries = [
        oci.Entry("/app/pkg/a.py", source=str(root / "pkg" / "a.py")),
        oci.Entry(
            "/app/pkg/run",
            source=str(root / "pkg" / "run"),
            executable=oci._is_exec(str(root / "pkg" / "run")),
        ),
        oci.Entry("/app/pkg/data", source=str(root / "pkg" / "data")),  # a directory: expanded
        oci.Entry("/app/pkg/__init__.py"),  # empty file
        oci.Entry("/app/link", "symlink", target="pkg/run"),
    ]
    return list(reversed(entries)) if reverse else entries


def test_layer_bytes_do_not_depend_on_mtime_umask_or_order(tmp_path):
    a = oci.write_layer(_entries(_tree(tmp_path / "a", 1_000, 0o022)), tmp_path / "a.tgz")
    b = oci.write_layer(_entries(_tree(tmp_path / "b", 2_000_000, 0o077), reverse=True), tmp_path / "b.tgz")
    assert a == b
    assert (tmp_path / "a.tgz").read_bytes() == (tmp_path / "b.tgz").read_bytes()
    assert a.digest == oci.sha256_file(tmp_path / "a.tgz")
    assert a.diff_id == oci.sha256_bytes(gzip.decompress((tmp_path / "a.tgz").read_bytes()))


def test_layer_normalizes_every_header(tmp_path):
    oci.write_layer(_entries(_tree(tmp_path / "a", 1_234, 0o027)), tmp_path / "a.tgz")
    raw = (tmp_path / "a.tgz").read_bytes()
    assert raw[4:8] == b"\0\0\0\0"  # gzip mtime 0
    assert raw[3] & 0x08 == 0  # no file name in the gzip header
    with tarfile.open(tmp_path / "a.tgz") as tar:
        members = tar.getmembers()
    names = [m.name.rstrip("/") for m in members]
    assert names == sorted(names)
    assert names[:2] == ["app", "app/link"]  # every parent directory is listed
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
    modes = {m.name.rstrip("/"): (m.type, m.mode) for m in members}
    assert modes["app/pkg"] == (tarfile.DIRTYPE, 0o755)
    assert modes["app/pkg/a.py"] == (tarfile.REGTYPE, 0o644)
    assert modes["app/pkg/run"] == (tarfile.REGTYPE, 0o755)
    assert modes["app/pkg/data/x.bin"] == (tarfile.REGTYPE, 0o644)
    assert modes["app/link"][0] == tarfile.SYMTYPE


def test_conflicting_and_unsafe_paths_are_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    g = tmp_path / "g"
    g.write_text("y")
    with pytest.raises(oci.OciError, match="twice"):
        oci.expand_entries([oci.Entry("/a", source=str(f)), oci.Entry("/a", source=str(g))])
    with pytest.raises(oci.OciError, match="not normalized"):
        oci.expand_entries([oci.Entry("/a/../b", source=str(f))])
    with pytest.raises(oci.OciError, match="absolute"):
        oci.expand_entries([oci.Entry("a", source=str(f))])
    with pytest.raises(oci.OciError, match="both a directory"):
        oci.expand_entries([oci.Entry("/a", source=str(f)), oci.Entry("/a/b", source=str(g))])


def _image(tmp_path, name, base=None, env=None):
    tree = _tree(tmp_path / (name + "_src"), 5, 0o022)
    entries = _entries(tree)
    if base is None:  # a base: other bytes than the images stacked on it
        entries.append(oci.Entry("/etc/base-marker"))
    info = oci.write_layer(entries, tmp_path / (name + ".tgz"))
    spec = oci.ImageSpec(
        entrypoint=["/opt/py", "/app/pkg/a.py"],
        env=env or {"PATH": "/opt/bin:${PATH}", "B": "2", "A": "1"},
        labels={"z": "1", "a": "2"},
        workdir="/app",
    )
    digest = oci.build_image(tmp_path / name, [(tmp_path / (name + ".tgz"), info)], spec, base)
    return digest, oci.Layout(tmp_path / name)


def test_image_twice_is_the_same_digest(tmp_path):
    base_digest, base_layout = _image(tmp_path, "base", env={"PATH": "/usr/bin"})
    base = base_layout.image()
    d1, l1 = _image(tmp_path, "one", base)
    d2, l2 = _image(tmp_path, "two", base)
    assert d1 == d2
    assert (l1.root / "index.json").read_bytes() == (l2.root / "index.json").read_bytes()
    image = l1.image()
    assert image.manifest_digest == d1
    # The config is canonical JSON; the base's layers come first and are referenced, not copied.
    assert image.config_bytes == oci.canonical_json(json.loads(image.config_bytes))
    assert image.layers[0] == base.layers[0] and not l1.has_blob(base.layers[0]["digest"])
    assert l1.has_blob(image.layers[1]["digest"])
    cfg = image.config
    assert cfg["created"] == oci.EPOCH and all(h["created"] == oci.EPOCH for h in cfg["history"])
    assert cfg["rootfs"]["diff_ids"][0] == base.config["rootfs"]["diff_ids"][0]
    assert len(cfg["rootfs"]["diff_ids"]) == len(image.layers) == len(cfg["history"]) == 2
    assert "PATH=/opt/bin:/usr/bin" in cfg["config"]["Env"]  # ${PATH} is the base's
    assert cfg["config"]["Entrypoint"] == ["/opt/py", "/app/pkg/a.py"]
    assert base_digest != d1


def test_docker_media_types_of_a_base_become_oci_names(tmp_path):
    _, base_layout = _image(tmp_path, "base")
    base = base_layout.image()
    base.manifest["layers"][0]["mediaType"] = "application/vnd.docker.image.rootfs.diff.tar.gzip"
    _, layout = _image(tmp_path, "img", base)
    assert layout.image().layers[0]["mediaType"] == oci.MEDIA_LAYER_GZIP


def test_a_tampered_blob_is_detected(tmp_path):
    _, layout = _image(tmp_path, "img")
    image = layout.image()
    layout.blob_path(image.manifest["config"]["digest"]).write_bytes(b"{}")
    with pytest.raises(oci.OciError, match="does not match its digest"):
        layout.image()


def test_platform_mismatch_with_the_base_is_refused(tmp_path):
    _, base_layout = _image(tmp_path, "base")
    base = base_layout.image()
    base.config["architecture"] = "arm64"
    with pytest.raises(oci.OciError, match="arm64"):
        _image(tmp_path, "img", base)
